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
