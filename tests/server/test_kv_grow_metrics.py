"""/metrics with --kv-grow: the lent-slot gauge while a request holds lent expert slots and
the grow, trim and refusal counters after it (read through the collector the server uses)."""
import numpy as np
from prometheus_client import CollectorRegistry

from strata.config import EngineConfig
from strata.engine.engine import Engine
from strata.engine.sampling import SamplingParams
from strata.server.metrics import ExpertCacheCollector
from strata.tool.synth import synth_model


def samples(tier) -> dict:
    registry = CollectorRegistry()
    registry.register(ExpertCacheCollector(lambda: tier))
    return {s.name: s.value for family in registry.collect() for s in family.samples
            if s.name.startswith("strata_kv_")}


def test_kv_grow_gauge_and_counters(tmp_path):
    path = tmp_path / "tiny.gguf"
    synth_model(path, shape="tiny", weight_type="f32", seed=3)
    with Engine(EngineConfig(path, n_ctx=512, expert_cache=12, adapt_every=0,
                             kv_grow=64)) as engine:
        tier = engine.expert_tier
        assert samples(tier) == {"strata_kv_lent_slots": 0, "strata_kv_grows_total": 0,
                                 "strata_kv_grows_refused_total": 0, "strata_kv_trims_total": 0}
        prompt = [int(t) for t in np.random.default_rng(0).integers(10, 4000, 100)]
        handle = engine.submit(prompt, SamplingParams(max_tokens=8, temperature=0.0,
                                                      ignore_eos=True))
        # placed: 100 cells doubled to 128, three slots of 48 f32 cells lent
        assert samples(tier)["strata_kv_lent_slots"] == 3
        while not handle.is_finished:
            engine.step()
        assert samples(tier) == {"strata_kv_lent_slots": 0, "strata_kv_grows_total": 1,
                                 "strata_kv_grows_refused_total": 0, "strata_kv_trims_total": 1}


def test_no_kv_grow_metrics_without_it(tmp_path):
    path = tmp_path / "tiny.gguf"
    synth_model(path, shape="tiny", weight_type="f32", seed=3)
    with Engine(EngineConfig(path, n_ctx=512, expert_cache=12)) as engine:
        assert samples(engine.expert_tier) == {}


def test_the_pcie_share_gauge_of_pcie_frac_auto(tmp_path, monkeypatch):
    """--pcie-frac auto's shares per window class, as /metrics shows them (the arena of a GPU
    engine, stood in for by the CPU engine's with the GPU's attributes)."""
    from strata.backends.cuda.share_tuner import ShareTuner

    path = tmp_path / "tiny.gguf"
    synth_model(path, shape="tiny", weight_type="f32", seed=3)
    with Engine(EngineConfig(path, n_ctx=512, expert_cache=12)) as engine:
        arena = engine.expert_tier.arena
        monkeypatch.setattr(arena, "misses_on_gpu", True, raising=False)
        registry = CollectorRegistry()
        registry.register(ExpertCacheCollector(lambda: engine.expert_tier))

        def shares():
            return {s.labels["rows"]: s.value for family in registry.collect()
                    for s in family.samples if s.name == "strata_expert_pcie_share"}

        assert shares() == {}  # a fixed share: no gauge
        tuner = ShareTuner(0.3)
        monkeypatch.setattr(arena, "share_tuner", tuner, raising=False)
        assert shares() == {"1": 0.3, "2": 0.3, "4": 0.3, "8": 0.3, "16": 0.3}
        tuner._classes[4].share = 0.425
        assert shares()["4"] == 0.425


def test_the_stream_pool_gauges_follow_the_streamer(tmp_path, monkeypatch):
    """A GPU arena's prompt streamer with a CPU pool: the sure percent and the rare experts'
    budget as /metrics shows them, read at scrape time (stood in for as above, with the real
    stream.SurePercent moving the budget); none without a pool."""
    from types import SimpleNamespace

    from strata.backends.cuda.share import POOL_SHARE_OF_COPY
    from strata.backends.cuda.stream import PromptStreamer, pool_follower

    path = tmp_path / "tiny.gguf"
    synth_model(path, shape="tiny", weight_type="f32", seed=3)
    with Engine(EngineConfig(path, n_ctx=512, expert_cache=12)) as engine:
        arena = engine.expert_tier.arena
        monkeypatch.setattr(arena, "misses_on_gpu", True, raising=False)
        streamer = PromptStreamer.__new__(PromptStreamer)  # what the gauges read, no device
        streamer.streamed_bytes = streamer.num_left = streamer.num_pulled = 0
        streamer.sure_auto, streamer.fixed_share = pool_follower("auto", "auto")
        streamer.sure_percent = 0
        monkeypatch.setattr(arena, "streamer", streamer, raising=False)
        monkeypatch.setattr(arena, "model", SimpleNamespace(tier=None), raising=False)
        streamer.arena = arena
        registry = CollectorRegistry()
        registry.register(ExpertCacheCollector(lambda: engine.expert_tier))

        def gauges():
            return {s.name: s.value for family in registry.collect() for s in family.samples
                    if s.name.startswith("strata_expert_stream_pool_")}

        assert gauges() == {}  # no pool
        monkeypatch.setattr(arena, "pool", object(), raising=False)
        assert gauges() == {"strata_expert_stream_pool_sure_percent": 0,
                            "strata_expert_stream_pool_budget": POOL_SHARE_OF_COPY}
        streamer.sure_auto.record(1, 10.0, 90.0)  # the pool at 10% of a window: a step up
        streamer.sure_percent = 20
        assert gauges() == {"strata_expert_stream_pool_sure_percent": 20,
                            "strata_expert_stream_pool_budget": streamer.sure_auto.share_of_copy}
        assert streamer.sure_auto.share_of_copy > POOL_SHARE_OF_COPY
