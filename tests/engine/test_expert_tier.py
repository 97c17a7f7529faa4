"""The expert tier in the engine: greedy tokens never depend on residency (tier off, frozen,
blocking, async, several slots, chunked prompts), the start-up fill order, a frozen cache, the
routing trace against the forward pass's own counts, WindowStats, packs, config errors."""
from __future__ import annotations

import numpy as np
import pytest

from strata import Engine, EngineConfig, SamplingParams, hookimpl
from strata.errors import ConfigError, ModelFormatError
from strata.experts.pack import write_pack
from strata.experts.profile import build_profile, write_profile
from strata.experts.trace import RECORD_DTYPE, RoutingTrace, read_trace
from strata.model.gguf_file import GGUFModel
from strata.plugins import get_plugin_manager

from request_runs import run_requests

GREEDY = dict(temperature=0.0, ignore_eos=True)
N_LAYERS, N_EXPERTS, TOP_K = 2, 8, 2  # the tiny preset


@pytest.fixture(scope="module")
def skewed(tmp_path_factory):
    from strata.tool.synth import synth_model

    path = tmp_path_factory.mktemp("tier") / "tiny-skew.gguf"
    synth_model(path, shape="tiny", weight_type="f32", seed=4, routing_skew=1.0)
    return path


def new_engine(path, parallel=2, plugin_manager=None, **options) -> Engine:
    return Engine(EngineConfig(path, n_ctx=1024, threads=1, parallel=parallel,
                               prompt_chunk_tokens=16, **options),
                  plugin_manager=plugin_manager)


def prompts_and_params():
    rng = np.random.default_rng(2)
    prompts = [[int(t) for t in rng.integers(10, 4000, n)] for n in (70, 9, 41)]
    params = [SamplingParams(max_tokens=n, **GREEDY) for n in (12, 20, 7)]
    return prompts, params


def run_all(engine: Engine) -> list[list[int]]:
    return [tokens for tokens, _ in run_requests(engine, *prompts_and_params())]


@pytest.fixture(scope="module")
def tier_off_tokens(skewed):
    with new_engine(skewed) as engine:
        assert engine.expert_tier is None
        return run_all(engine)


@pytest.mark.parametrize("options", [
    dict(expert_cache=4, adapt_every=0),
    dict(expert_cache=3, adapt_every=1, adapt_async=False),
    dict(expert_cache=3, adapt_every=1, adapt_async=True),
    dict(expert_cache=16, adapt_every=2),
    dict(expert_cache=0),
], ids=["frozen", "blocking", "async", "all-resident", "zero-slots"])
def test_greedy_tokens_equal_the_tier_off_run(skewed, tier_off_tokens, options):
    with new_engine(skewed, **options) as engine:
        assert run_all(engine) == tier_off_tokens
        tier = engine.expert_tier
        assert tier.wait_idle(30)
        totals = tier.snapshot_totals()
    routed = totals.num_hits + totals.num_misses
    prompts, params = prompts_and_params()
    num_rows = sum(len(p) + sp.max_tokens - 1 for p, sp in zip(prompts, params))
    assert routed == num_rows * TOP_K * N_LAYERS
    if options["expert_cache"] == 16:
        assert totals.num_misses == 0 and totals.num_swaps == 0
    if options["expert_cache"] == 0:
        assert totals.num_hits == 0 and totals.num_rounds == 0
    if options.get("adapt_every") == 1:
        assert totals.num_rounds + totals.num_rounds_skipped == totals.num_windows
        assert totals.num_swaps > 0 and totals.num_hits > 0


def test_adapt_every_0_makes_no_swap(skewed):
    with new_engine(skewed, expert_cache=5, adapt_every=0) as engine:
        table = engine.expert_tier.arena.table
        before = table.peek().table.copy()
        version = table.version
        run_all(engine)
        totals = engine.expert_tier.snapshot_totals()
        assert totals.num_rounds == totals.num_swaps == totals.num_bytes_moved == 0
        assert table.version == version
        assert np.array_equal(table.peek().table, before)


def test_startup_fill_follows_the_profile_order_exactly(skewed, tmp_path):
    # A profile whose ranking is known: accesses fall from (1, 6) down.
    hot = [(1, 6), (0, 3), (1, 0), (0, 7), (0, 0)]
    records = np.zeros(sum(range(1, len(hot) + 1)), dtype=RECORD_DTYPE)
    at = 0
    for rank, (layer, expert) in enumerate(hot):
        for window in range(len(hot) - rank):
            records[at] = (window, layer, expert, 1)
            at += 1
    profile = build_profile(RoutingTrace(N_LAYERS, N_EXPERTS, records, {}))
    assert profile.top(5) == hot
    path = tmp_path / "hot.profile"
    write_profile(path, profile)
    with new_engine(skewed, expert_cache=4, expert_profile_path=path) as engine:
        table = engine.expert_tier.arena.table
        assert [table.slot_owner(s) for s in range(4)] == hot[:4]
        expected = np.full((N_LAYERS, N_EXPERTS), -1)
        for slot, (layer, expert) in enumerate(hot[:4]):
            expected[layer, expert] = slot
        assert np.array_equal(table.peek().table, expected)


def test_startup_fill_without_a_profile_is_layer_order(skewed):
    with new_engine(skewed, expert_cache=10, adapt_every=0) as engine:
        table = engine.expert_tier.arena.table
        assert [table.slot_owner(s) for s in range(10)] == \
            [(0, e) for e in range(8)] + [(1, 0), (1, 1)]
        assert engine.config.expert_cache_slots == 10


class _CountingModel:
    """The real model; gathers each window's routing counts in an array of its own (then
    hands them to the caller's) and keeps a copy."""

    def __init__(self, model):
        self.model = model
        self.counts = []

    def __getattr__(self, name):
        return getattr(self.model, name)

    def forward_window(self, window, expert_pointers=None, routing_counts=None):
        counts = np.zeros((N_LAYERS, N_EXPERTS), dtype=np.int64)
        logits = self.model.forward_window(window, expert_pointers=expert_pointers,
                                           routing_counts=counts)
        self.counts.append(counts)
        if routing_counts is not None:
            routing_counts += counts
        return logits


@pytest.mark.parametrize("cache", [None, 3])
def test_the_routing_trace_equals_the_windows_routing_counts(skewed, tmp_path, cache):
    trace_path = tmp_path / "run.trace"
    options = {} if cache is None else dict(expert_cache=cache, adapt_every=1)
    with new_engine(skewed, dump_routing_path=trace_path, **options) as engine:
        counted = engine.expert_tier.model = _CountingModel(engine.model)
        run_all(engine)
    trace = read_trace(trace_path)
    assert (trace.n_layers, trace.n_experts) == (N_LAYERS, N_EXPERTS)
    assert trace.num_windows == len(counted.counts) > 10
    expected = []
    for window, counts in enumerate(counted.counts):
        assert counts.sum(axis=1).tolist() == [counts.sum() // N_LAYERS] * N_LAYERS
        for layer, expert in zip(*np.nonzero(counts)):
            expected.append((window, layer, expert, counts[layer, expert]))
    got = [tuple(int(v) for v in r) for r in trace.records]
    assert got == [tuple(int(v) for v in r) for r in expected]
    prompts, params = prompts_and_params()
    num_rows = sum(len(p) + sp.max_tokens - 1 for p, sp in zip(prompts, params))
    assert int(trace.records["rows"].sum()) == num_rows * TOP_K * N_LAYERS


class _Recorder:
    def __init__(self):
        self.stats = []

    @hookimpl
    def strata_window_done(self, stats):
        self.stats.append(stats)


def test_window_stats_carry_the_cache_figures(skewed):
    recorder = _Recorder()
    pm = get_plugin_manager(autoload=False)
    pm.register(recorder)
    with new_engine(skewed, plugin_manager=pm, expert_cache=3, adapt_every=2,
                    adapt_async=False) as engine:
        run_all(engine)
        totals = engine.expert_tier.snapshot_totals()
    stats = recorder.stats
    assert len(stats) == totals.num_windows
    assert sum(s.num_cache_hits for s in stats) == totals.num_hits
    assert sum(s.num_cache_misses for s in stats) == totals.num_misses
    assert sum(s.num_swaps for s in stats) == totals.num_swaps
    assert sum(s.tier_wait_s for s in stats) == pytest.approx(totals.wait_s)
    for s in stats:
        rows = s.num_decode_rows + s.num_prompt_rows
        assert s.num_cache_hits + s.num_cache_misses == rows * TOP_K * N_LAYERS
        assert s.tier_wait_s <= s.seconds
    # Rounds close every second window; only those can start swaps.
    assert all(s.num_swaps == 0 for s in stats if s.window_index % 2)


def test_window_stats_without_a_cache_stay_zero(skewed):
    recorder = _Recorder()
    pm = get_plugin_manager(autoload=False)
    pm.register(recorder)
    with new_engine(skewed, plugin_manager=pm) as engine:
        engine.generate_text([11, 12, 13], SamplingParams(max_tokens=3, **GREEDY))
    assert recorder.stats and all(
        (s.num_cache_hits, s.num_cache_misses, s.num_swaps, s.tier_wait_s) == (0, 0, 0, 0.0)
        for s in recorder.stats)


def test_a_pack_serves_the_same_tokens(skewed, tier_off_tokens, tmp_path):
    pack = tmp_path / "tiny.pack"
    with GGUFModel.open(skewed) as gguf:
        write_pack(gguf, pack)
    for options in (dict(), dict(expert_cache=3, adapt_every=1)):
        with new_engine(skewed, expert_pack_path=pack, **options) as engine:
            assert engine.expert_tier.store.source == "pack"
            assert run_all(engine) == tier_off_tokens


def test_a_pack_of_another_model_is_refused(skewed, tmp_path):
    from strata.tool.synth import synth_model

    other = tmp_path / "other.gguf"
    synth_model(other, shape="tiny", weight_type="f32", seed=99)
    pack = tmp_path / "other.pack"
    with GGUFModel.open(other) as gguf:
        write_pack(gguf, pack)
    with pytest.raises(ModelFormatError, match="written for another model"):
        new_engine(skewed, expert_pack_path=pack)


def test_a_profile_of_another_shape_is_refused(skewed, tmp_path):
    records = np.array([(0, 0, 0, 1)], dtype=RECORD_DTYPE)
    path = tmp_path / "wide.profile"
    write_profile(path, build_profile(RoutingTrace(3, 8, records, {})))
    with pytest.raises(ConfigError, match="ranks 3 layers x 8 experts but the model has 2 x 8"):
        new_engine(skewed, expert_cache=2, expert_profile_path=path)


@pytest.mark.parametrize("options, message", [
    (dict(expert_cache=17), "exceeds the model's 16 routed experts"),
    (dict(expert_cache="auto"), "auto needs --vram-budget"),
    (dict(expert_cache="lots"), "'lots'; give 'auto' or a number"),
    (dict(expert_cache=-2), "give 'auto' or a number of slots >= 0"),
    (dict(expert_cache=4, vram_budget_bytes="12Q"), "'12Q', not a size"),
    (dict(expert_cache=4, vram_budget_bytes="1K"), "needs 98304 bytes.*give at most 0 slots"),
    (dict(vram_budget_bytes="1G"), "give --expert-cache auto"),
    (dict(adapt_every=-1), r"adapt_every \(--adapt-every\) = -1 must be >= 0"),
    (dict(adapt_swaps=0), r"adapt_swaps \(--adapt-swaps\) = 0 must be >= 1"),
    (dict(adapt_min_gain=-1.0), "adapt_min_gain = -1.0 must be a number >= 0"),
    (dict(adapt_async=2), "give 0 \\(blocking\\) or 1"),
    (dict(expert_profile_path="/nonexistent/p"), "is not a file"),
    (dict(dump_routing_path="/nonexistent/dir/t.trace"), "existing folder"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_config_errors(skewed, options, message):
    with pytest.raises(ConfigError, match=message):
        new_engine(skewed, **options)


def test_auto_fills_the_budget(skewed):
    with new_engine(skewed, expert_cache="auto", vram_budget_bytes="100K",
                    adapt_every=0) as engine:
        arena = engine.expert_tier.arena
        assert arena.slot_bytes == 24576  # F32: 3 x 32 x 64 x 4 bytes
        assert arena.n_slots == 100 * 1024 // 24576 == engine.config.expert_cache_slots


def test_parse_size_bytes():
    from strata.config import parse_size_bytes

    assert parse_size_bytes("512M") == 512 * 2**20
    assert parse_size_bytes("8G") == parse_size_bytes("8GiB") == parse_size_bytes("8gib") \
        == 8 * 2**30
    assert parse_size_bytes("8GB") == 8 * 10**9
    assert parse_size_bytes("1.5K") == 1536
    assert parse_size_bytes("4096") == parse_size_bytes(4096) == 4096
    for bad in ("", "G", "8X", "-1G", "8 G B"):
        with pytest.raises(ConfigError, match="not a size"):
            parse_size_bytes(bad)
