"""The layer split on the GPU: stages over layer ranges (two on one GPU, and on two GPUs when
there are two) give the one-GPU model's logits bit for bit (the same kernels on the same rows);
several slots, greedy and lazy outputs, park/restore, slot groups pipelined (2 groups equal 1;
two lanes' windows in flight at once equal the same windows one at a time),
the tier on every stage while its swaps land (each window checked against the frozen pass), and
the engine's greedy tokens through --split-device / --layer-split."""
from __future__ import annotations

import numpy as np
import pytest

from strata import Engine, EngineConfig, SamplingParams
from strata.backends.window import Window
from strata.experts.tier import DecayedCountTier
from strata.model.gguf_file import GGUFModel

from cuda_synth import num_gpus, write_split_test_model
from request_runs import run_requests

pytestmark = pytest.mark.cuda

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    """tiny Q8_0 with 4 layers and skewed routing (cuda_synth.write_split_test_model)."""
    out = tmp_path_factory.mktemp("split") / "tiny-split-q8_0.gguf"
    write_split_test_model(out)
    return out


@pytest.fixture(scope="module")
def full(path):
    from strata.backends.cuda import CudaModel

    model = CudaModel(GGUFModel.open(path))
    model.enable_routing_counts()
    return model


def make_windows(rng, num_windows: int, chunk_tokens: int = 9):
    """Per window, per slot (3 slots): the tokens it adds (a chunk every 5th window, else 1)."""
    return [[rng.integers(10, 4000, chunk_tokens if w % 5 == 0 else 1) for _ in range(3)]
            for w in range(num_windows)]


def run_windows(model, plans, mode="logits", forward=None):
    """Per window: the output of every row (logits [N, V], or greedy ids [N]) and the routing
    counts [L, E]."""
    kvs = [model.new_kv(256) for _ in range(3)]
    outs, counts = [], []
    for plan in plans:
        window = Window.build(list(zip(kvs, plan)), logits="all")
        c = np.zeros((model.spec.n_layers, model.spec.n_experts), dtype=np.int64)
        if forward is not None:
            out = forward(window)
        elif mode == "greedy":
            out = model.forward_window_greedy(window, routing_counts=c)
        elif mode == "lazy":
            out = np.asarray(model.forward_window_lazy(window, routing_counts=c))
        else:
            out = model.forward_window(window, routing_counts=c)
        outs.append(np.array(out))
        counts.append(c)
    return outs, counts


def split_model(path, devices, counts, **kwargs):
    from strata.backends.cuda.split_model import SplitModel

    return SplitModel(GGUFModel.open(path), devices, counts, **kwargs)


def _device_sets():
    sets = [[0, 0]]
    if num_gpus() >= 2:
        sets.append([0, 1])
    return sets


@pytest.mark.parametrize("counts", [[1, 3], [2, 2], [3, 1]])
@pytest.mark.parametrize("mode", ["logits", "greedy", "lazy"])
def test_split_equals_the_one_gpu_model_bit_for_bit(path, full, counts, mode):
    plans = make_windows(np.random.default_rng(3), 8)
    want, want_counts = run_windows(full, plans, mode)
    for devices in _device_sets():
        model = split_model(path, devices, counts)
        got, got_counts = run_windows(model, plans, mode)
        for index, (a, b) in enumerate(zip(want, got)):
            assert np.array_equal(a, b), f"window {index} differs on GPUs {devices} {counts}"
        for a, b in zip(want_counts, got_counts):
            assert np.array_equal(a, b)


def test_three_stages_and_the_hop_kinds(path, full):
    plans = make_windows(np.random.default_rng(4), 6)
    want, _ = run_windows(full, plans)
    devices = [0, 1, 0] if num_gpus() >= 2 else [0, 0, 0]
    model = split_model(path, devices, [1, 2, 1])
    got, _ = run_windows(model, plans)
    assert all(np.array_equal(a, b) for a, b in zip(want, got))
    hows = [h.how for h in model.hops]
    print(model.describe())
    if devices[1] == 1:
        assert set(hows) <= {"peer copy", "pinned host buffer"}
    else:
        assert hows == ["device-to-device", "device-to-device"]


@pytest.mark.parametrize("mode", ["logits", "greedy", "lazy"])
def test_two_batch_groups_equal_one(path, full, mode):
    # windows under plan.MMQ_MIN_ROWS rows: a group takes the same kernel family as the whole
    plans = make_windows(np.random.default_rng(5), 10, chunk_tokens=5)
    want, want_counts = run_windows(full, plans, mode)
    for devices in _device_sets():
        model = split_model(path, devices, [2, 2], batch_groups=2)
        got, got_counts = run_windows(model, plans, mode)
        for index, (a, b) in enumerate(zip(want, got)):
            assert np.array_equal(a, b), f"window {index} differs with 2 groups on {devices}"
        for a, b in zip(want_counts, got_counts):
            assert np.array_equal(a, b)


def run_lanes(model, plans, mode="logits", start=None, finish=None):
    """The windows of `plans` as two pipelined lanes (slots 0, 2 and slot 1), started and
    finished as the scheduler does (A0, B0 started; A0 finished, A1 started; B0 finished, B1
    started; ...) through model.start_window / finish_window, or with `start` / `finish` given
    (a tier's); per (window, lane): the rows' output and routing counts."""
    kvs = [model.new_kv(256) for _ in range(3)]
    lanes = [(0, [0, 2]), (1, [1])]
    start = start or (lambda w, lane, c: model.start_window(w, lane, mode, routing_counts=c))
    finish = finish or model.finish_window
    outs, flying = {}, []
    for index, plan in enumerate(plans):
        for lane, slots in lanes:
            if len(flying) == 2:  # the oldest finishes before its lane starts again
                key, ticket, c = flying.pop(0)
                outs[key] = (np.array(finish(ticket)), c)
            window = Window.build([(kvs[i], plan[i]) for i in slots], logits="all")
            c = np.zeros((model.spec.n_layers, model.spec.n_experts), dtype=np.int64)
            flying.append(((index, lane), start(window, lane, c), c))
    for key, ticket, c in flying:
        outs[key] = (np.array(finish(ticket)), c)
    return outs


def lanes_one_at_a_time(model, plans, mode):
    """The same lane windows through the one-GPU model, one after the other."""
    kvs = [model.new_kv(256) for _ in range(3)]
    outs = {}
    for index, plan in enumerate(plans):
        for lane, slots in ((0, [0, 2]), (1, [1])):
            window = Window.build([(kvs[i], plan[i]) for i in slots], logits="all")
            c = np.zeros((model.spec.n_layers, model.spec.n_experts), dtype=np.int64)
            run = {"greedy": model.forward_window_greedy, "logits": model.forward_window,
                   "lazy": model.forward_window_lazy}[mode]
            outs[(index, lane)] = (np.array(run(window, routing_counts=c)), c)
    return outs


@pytest.mark.parametrize("mode", ["logits", "greedy", "lazy"])
def test_pipelined_lanes_equal_the_one_gpu_model(path, full, mode):
    """Two lanes' windows in flight at once (start_window / finish_window) give the one-GPU
    model's outputs and routing counts for the same windows bit for bit; a plain pass is
    refused while a lane is in flight."""
    plans = make_windows(np.random.default_rng(6), 10, chunk_tokens=5)
    want = lanes_one_at_a_time(full, plans, mode)
    for devices in _device_sets():
        model = split_model(path, devices, [2, 2], batch_groups=2)
        got = run_lanes(model, plans, mode)
        assert got.keys() == want.keys()
        for key in want:
            assert np.array_equal(want[key][0], got[key][0]), f"{key} differs on {devices}"
            assert np.array_equal(want[key][1], got[key][1]), f"{key} counts on {devices}"
        kv = model.new_kv(16)
        ticket = model.start_window(Window.build([(kv, np.array([5, 6]))]), 0, mode)
        with pytest.raises(RuntimeError, match="in flight"):
            model.forward_window(Window.build([(model.new_kv(16), np.array([7]))]))
        with pytest.raises(RuntimeError, match="in flight"):
            model.start_window(Window.build([(model.new_kv(16), np.array([7]))]), 0, mode)
        model.finish_window(ticket)


def test_pipelined_lanes_with_every_stage_tier_swapping(path, full, caplog):
    """The asynchronous tier on both stages, swapping every window, while two lanes' windows
    are in flight: every window equals the frozen all-resident pass, no pump fails (a load
    lands only once no window started before its claim holds its snapshot), and each stage's
    device tables equal its residency afterwards."""
    import logging

    caplog.set_level(logging.WARNING, logger="strata")
    plans = make_windows(np.random.default_rng(7), 40, chunk_tokens=5)
    want = lanes_one_at_a_time(full, plans, "logits")
    devices = [0, 1] if num_gpus() >= 2 else [0, 0]
    # (the config names the split its model has: --batch-groups needs one)
    model, tier = _split_tier(path, devices, 10, adapt_every=1, adapt_async=True,
                              batch_groups=2, layer_split="2,2")
    for t in tier.stages:
        t.copy_chunk_bytes = 256
    tier.start(DecayedCountTier(10, decay=0.5, hysteresis=0.0))
    assert tier.pipelines
    for t in tier.stages:
        t._copier.chunk_bytes = 256
        t._copier.chunks_per_window = 16
    try:
        def start(window, lane, counts):
            return tier.start_window(window, lane, "logits")

        got = run_lanes(model, plans, start=start, finish=tier.finish_window)
        assert tier.wait_idle(30)
    finally:
        tier.close()
    for key in want:
        assert np.array_equal(want[key][0], got[key][0]), f"{key} differs from the frozen pass"
    for t in tier.stages:
        assert t.totals.num_swaps >= 10, t.label
        assert_tables_match_residency(t)
    assert tier.snapshot_totals().num_windows == 80
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text[-2000:]
    for t in tier.stages:  # no slot left claimed: every load landed or was aborted
        assert t.arena.table.num_resident + len(t.arena.table.free_slots()) == t.arena.n_slots


def test_park_and_restore_continue_bit_for_bit(path):
    model = split_model(path, [0, 0], [1, 3])
    rng = np.random.default_rng(9)
    prompt, more = rng.integers(10, 4000, 13), rng.integers(10, 4000, 5)
    kv = model.new_kv(64)
    model.forward(prompt, kv)
    L = model.spec.n_layers
    k = np.stack([kv.keys(layer) for layer in range(L)])  # [L, KV, n, D]
    v = np.stack([kv.values(layer) for layer in range(L)])
    want = model.forward(more, kv, all_logits=True)
    restored = model.new_kv(64)
    for layer in range(L):
        restored.append(layer, k[layer], v[layer])
    restored.commit(k.shape[2])
    got = model.forward(more, restored, all_logits=True)
    assert restored.num_tokens == kv.num_tokens == 18
    assert np.array_equal(want, got)


def assert_tables_match_residency(stage_tier) -> None:
    """A stage's device tables point every resident expert at its slot, the rest at RAM."""
    arena = stage_tier.arena
    table, host = arena.device_table(), arena.host.pointers(device=True)
    residency = arena.table.peek().table
    for layer in range(stage_tier.store.n_layers):
        for e in range(stage_tier.store.n_experts):
            slot = int(residency[layer, e])
            ptrs = arena.slot_pointers(slot, layer) if slot >= 0 else host[layer, :, e]
            assert list(table[layer, :, e]) == list(ptrs)


def _split_tier(path, devices, num_slots, **options):
    from strata.backends.cuda.split_tier import SplitTier

    gguf = GGUFModel.open(path)
    model = split_model(path, devices, [2, 2], experts_resident=False)
    config = EngineConfig(path, n_ctx=256, parallel=3, expert_cache=num_slots, pcie_frac=1.0,
                          **options)
    return model, SplitTier.build(config, gguf, model)


@pytest.mark.parametrize("is_async", [True, False], ids=["async", "blocking"])
def test_every_stage_tier_swaps_while_windows_equal_the_frozen_pass(path, full, is_async):
    plans = make_windows(np.random.default_rng(5), 60)
    want, _ = run_windows(full, plans)
    devices = [0, 1] if num_gpus() >= 2 else [0, 0]
    model, tier = _split_tier(path, devices, 10, adapt_every=1, adapt_async=is_async)
    assert [t.arena.n_slots for t in tier.stages] == [5, 5]
    for t in tier.stages:
        t.copy_chunk_bytes = 256
    tier.start(DecayedCountTier(10, decay=0.5, hysteresis=0.0))
    if is_async:
        for t in tier.stages:
            t._copier.chunk_bytes = 256
            t._copier.chunks_per_window = 16
    try:
        got, _ = run_windows(model, plans, forward=lambda w: tier.forward_window(w))
        assert tier.wait_idle(30)
    finally:
        tier.close()
    for index, (a, b) in enumerate(zip(want, got)):
        assert np.array_equal(a, b), f"window {index} differs from the frozen pass"
    for t in tier.stages:  # every stage's cache moved, and its tables match its residency
        assert t.totals.num_swaps >= 10, t.label
        assert_tables_match_residency(t)
    totals = tier.snapshot_totals()
    assert totals.num_swaps == sum(t.totals.num_swaps for t in tier.stages)
    assert totals.num_windows == 60


def _engine_tokens(path, **options):
    rng = np.random.default_rng(2)
    prompts = [[int(t) for t in rng.integers(10, 4000, n)] for n in (40, 9, 25)]
    params = [SamplingParams(max_tokens=n, **GREEDY) for n in (16, 24, 10)]
    with Engine(EngineConfig(path, n_ctx=256, parallel=2, prompt_chunk_tokens=16,
                             device="cuda", **options)) as engine:
        return [t for t, _ in run_requests(engine, prompts, params)]


@pytest.mark.parametrize("options", [
    dict(layer_split="2,2"),
    dict(layer_split="auto", batch_groups=2),
    dict(layer_split="1,3", expert_cache=6, adapt_every=1, adapt_async=False, pcie_frac=1.0),
    dict(layer_split="3,1", expert_cache=6, adapt_every=1, adapt_async=True, pcie_frac=1.0),
    dict(layer_split="2,2", expert_cache=6, adapt_every=1, batch_groups="auto", pcie_frac=1.0),
    dict(layer_split="2,2", expert_cache=6, adapt_every=1, adapt_async=False, batch_groups=2,
         pcie_frac=1.0),
    dict(layer_split="2,2", expert_cache=6, adapt_every=1),
], ids=["resident", "auto-2-groups", "blocking-tier", "async-tier", "pipelined-async-tier",
        "pipelined-blocking-asked", "pipelined-pcie-frac-auto"])
def test_engine_on_two_gpus_gives_the_one_gpu_tokens(path, options):
    if num_gpus() < 2:
        pytest.skip("needs two GPUs")
    want = _engine_tokens(path)
    got = _engine_tokens(path, split_devices="0,1", **options)
    assert got == want


@pytest.mark.parametrize("pcie_frac,groups", [(None, 2), (0.5, 1)])
def test_pipelined_groups_read_misses_over_pcie_unless_a_pool_is_asked_for(
        path, pcie_frac, groups):
    """--batch-groups auto on a split with a cache: without --pcie-frac the misses are read
    over PCIe (a CPU pool takes one window at a time) and 2 groups pipeline; --pcie-frac 0.5
    asks for the pool, which keeps one group."""
    if num_gpus() < 2:
        pytest.skip("needs two GPUs")
    options = {} if pcie_frac is None else {"pcie_frac": pcie_frac}
    with Engine(EngineConfig(path, n_ctx=256, parallel=2, device="cuda", split_devices="0,1",
                             layer_split="2,2", expert_cache=6, **options)) as engine:
        assert engine.model.batch_groups == groups
        assert engine.scheduler._num_groups == groups
        pools = [t.arena.pool is not None for t in engine.expert_tier.stages]
        assert pools == [pcie_frac is not None] * 2
        assert ("misses read over PCIe" in engine.model.plan_text) == (pcie_frac is None)


def test_engine_split_stores_the_whole_models_profile(path, full, tmp_path, monkeypatch,
                                                      caplog):
    """--expert-profile auto on a split: the run's routing of every layer is stored at close
    (one profile of the whole model) and the next start fills each stage from its layers'
    part; tokens do not change."""
    import logging

    from strata.experts.profile import read_profile, stored_profile_path

    if num_gpus() < 2:
        pytest.skip("needs two GPUs")
    monkeypatch.setenv("STRATA_CACHE_DIR", str(tmp_path))
    options = dict(split_devices="0,1", layer_split="2,2", expert_cache=6, pcie_frac=1.0,
                   expert_profile_path="auto")
    first = _engine_tokens(path, **options)
    profile = read_profile(stored_profile_path(path))
    spec = full.spec
    assert (profile.n_layers, profile.n_experts) == (spec.n_layers, spec.n_experts)
    num_rows = sum((40, 9, 25)) + sum(n - 1 for n in (16, 24, 10))
    assert profile.rows_by_expert().sum() == num_rows * spec.n_experts_used * spec.n_layers
    assert (profile.rows_by_expert().sum(axis=1) > 0).all()  # both stages' layers counted
    with caplog.at_level(logging.INFO, logger="strata.tier"):
        assert _engine_tokens(path, **options) == first
    for stage in (0, 1):
        assert any(f"stage {stage} " in r.getMessage() and "from profile" in r.getMessage()
                   for r in caplog.records)
