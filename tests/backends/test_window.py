"""Multi-slot windows on the CPU backend: each slot gets what it would get alone, KVs commit
only after a whole pass, and bad windows fail before any KV changes."""
import copy

import numpy as np
import pytest
from synth_models import synth_cpu_models

from strata._native import kernels
from strata.backends.window import Window
from strata.errors import RequestError

NAMES = ["qwen3moe-f32", "qwen2moe-f32", "qwen3moe-q4_0", "qwen2moe-q4_0"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("window")
    variants = {
        "qwen3moe-f32": dict(shape="tiny", weight_type="f32", seed=11),
        "qwen2moe-f32": dict(shape="tiny-qwen2moe", weight_type="f32", seed=12),
        "qwen3moe-q4_0": dict(shape="tiny", weight_type="q4_0", seed=13),
        "qwen2moe-q4_0": dict(shape="tiny-qwen2moe", weight_type="q4_0", seed=14),
    }
    return synth_cpu_models(root, variants)


def _tokens(rng, n):
    return rng.integers(0, 4096, size=n).astype(np.int32)


def _assert_same(name, got, want):
    """F32: every product is per row, so only float reordering could differ (1e-5 of the
    logit scale). Q4_0: the kernels quantise activations per row (8 bits per 32 values of that
    row alone) and no kernel mixes rows, so a row's logits are bit-identical however it is
    batched."""
    assert got.shape == want.shape
    if name.endswith("f32"):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * float(np.max(np.abs(want))))
    else:
        np.testing.assert_array_equal(got, want)


def _history(model, rng, lengths, capacity=64):
    """One KV per length, filled with that many random tokens (0: an empty slot)."""
    kvs = []
    for n in lengths:
        kv = model.new_kv(capacity)
        if n:
            model.forward(_tokens(rng, n), kv)
        kvs.append(kv)
    return kvs


def test_build_lays_out_runs_positions_and_logit_rows(models):
    model = models["qwen3moe-f32"]
    kvs = _history(model, np.random.default_rng(0), [7, 0, 3])
    window = Window.build([(kvs[0], [5]), (kvs[1], [1, 2, 3, 4]), (kvs[2], [9, 8, 7])],
                          logits=["last", "none", "all"])
    np.testing.assert_array_equal(window.tokens, [5, 1, 2, 3, 4, 9, 8, 7])
    np.testing.assert_array_equal(window.slots, [0, 1, 1, 1, 1, 2, 2, 2])
    np.testing.assert_array_equal(window.positions, [7, 0, 1, 2, 3, 3, 4, 5])
    np.testing.assert_array_equal(window.run_starts, [0, 1, 5, 8])
    np.testing.assert_array_equal(window.logit_rows, [0, 5, 6, 7])
    np.testing.assert_array_equal(window.logit_starts, [0, 1, 1, 4])
    assert (window.num_rows, window.num_slots, window.num_logit_rows) == (8, 3, 4)
    assert [kv.num_tokens for kv in kvs] == [7, 0, 3]  # building changes no KV
    last = Window.build([(kvs[0], [5]), (kvs[1], [1, 2, 3, 4])])
    np.testing.assert_array_equal(last.logit_rows, [0, 4])
    for w in (window, last):
        assert (w.tokens.dtype, w.positions.dtype, w.slots.dtype, w.run_starts.dtype,
                w.start_tokens.dtype, w.logit_rows.dtype, w.logit_starts.dtype) == (
            np.int32, np.int64, np.int32, np.int64, np.int64, np.int64, np.int64)
    # one run (every decode token of one slot): the same layout
    one = Window.build([(kvs[2], np.array([4, 6, 1], dtype=np.int64))], logits="all")
    np.testing.assert_array_equal(one.tokens, [4, 6, 1])
    assert one.tokens.dtype == np.int32 and one.slots.dtype == np.int32
    np.testing.assert_array_equal(one.slots, [0, 0, 0])
    np.testing.assert_array_equal(one.positions, [3, 4, 5])
    np.testing.assert_array_equal(one.logit_rows, [0, 1, 2])
    np.testing.assert_array_equal(one.logit_starts, [0, 3])
    assert one.runs == [(kvs[2], 0, 3, 3)]
    none = Window.build([(kvs[0], [5])], logits="none")
    assert none.num_logit_rows == 0 and none.logit_rows.dtype == np.int64


@pytest.mark.parametrize("name", NAMES)
def test_mixed_window_equals_each_slot_alone(models, name):
    model = models[name]
    rng = np.random.default_rng(1)
    kvs = _history(model, rng, [7, 3, 0, 12])
    alone_kvs = [copy.deepcopy(kv) for kv in kvs]
    # a decode row, a prompt chunk continuing a read, a fresh prompt, another decode row
    runs = [_tokens(rng, 1), _tokens(rng, 5), _tokens(rng, 4), _tokens(rng, 1)]
    for logits_mode in ("all", "last"):
        window = Window.build(list(zip(kvs, runs)), logits=logits_mode)
        logits = model.forward_window(window)
        assert logits.shape == (window.num_logit_rows, model.spec.vocab)
        for i, (kv, tokens) in enumerate(zip(alone_kvs, runs)):
            alone = model.forward(tokens, kv, all_logits=logits_mode == "all")
            _assert_same(name, window.logits_of(logits, i), alone)
        # each slot's KV holds exactly what it holds after running alone
        for kv, alone_kv in zip(kvs, alone_kvs):
            assert kv.num_tokens == alone_kv.num_tokens
            for li in range(model.spec.n_layers):
                _assert_same(name, kv.keys(li), alone_kv.keys(li))
                _assert_same(name, kv.values(li), alone_kv.values(li))
        runs = [_tokens(rng, n) for n in (2, 1, 3, 1)]  # the next window continues them


def _greedy_schedule(model, chunks_per_slot, num_new_tokens, together):
    """Greedy tokens of every slot: each reads its prompt chunks, then decodes. Together: one
    window per step, a slot contributing its next chunk or decode row. Alone: the same
    forwards, one slot at a time."""
    num_slots = len(chunks_per_slot)
    capacity = max(sum(len(c) for c in chunks) for chunks in chunks_per_slot) + num_new_tokens
    kvs = [model.new_kv(capacity) for _ in range(num_slots)]
    pending = [list(chunks) for chunks in chunks_per_slot]
    generated = [[] for _ in range(num_slots)]

    def next_rows(i):
        if pending[i]:
            chunk = pending[i].pop(0)
            return chunk, "none" if pending[i] else "last"
        return np.array(generated[i][-1:], dtype=np.int32), "last"

    def take(i, logits):
        if len(logits):
            generated[i].append(int(np.argmax(logits[-1])))

    if together:
        while True:
            active = [i for i in range(num_slots) if len(generated[i]) < num_new_tokens]
            if not active:
                break
            rows = [next_rows(i) for i in active]
            window = Window.build([(kvs[i], r[0]) for i, r in zip(active, rows)],
                                  logits=[r[1] for r in rows])
            logits = model.forward_window(window)
            for s, i in enumerate(active):
                take(i, window.logits_of(logits, s))
    else:
        for i in range(num_slots):
            while len(generated[i]) < num_new_tokens:
                tokens, mode = next_rows(i)
                logits = model.forward(tokens, kvs[i])
                take(i, logits if mode == "last" else logits[:0])
    return generated


@pytest.mark.parametrize("name", NAMES)
def test_greedy_slots_decoded_together_equal_each_decoded_alone(models, name):
    model = models[name]
    rng = np.random.default_rng(2)
    # slot 2's long prompt is read in three chunks while slots 0 and 1 already decode
    chunks = [[_tokens(rng, 6)], [_tokens(rng, 2)],
              [_tokens(rng, 5), _tokens(rng, 5), _tokens(rng, 3)]]
    together = _greedy_schedule(model, chunks, 20, together=True)
    alone = _greedy_schedule(model, chunks, 20, together=False)
    assert [len(g) for g in together] == [20, 20, 20]
    assert together == alone
    assert len({tuple(g) for g in together}) == 3  # three different continuations


def test_threaded_window_equals_single_threaded_slots(models):
    # every kernel splits work by rows and sums each row in a fixed order, so threads change
    # nothing either: Q4_0 stays bit-identical. The first window's 80 rows put every product
    # of the tiny model past the kernels' threading threshold (2^18 multiply-adds).
    model = models["qwen2moe-q4_0"]
    rng = np.random.default_rng(9)
    chunks = [[_tokens(rng, 60)], [_tokens(rng, 3)], [_tokens(rng, 17), _tokens(rng, 9)]]
    alone = _greedy_schedule(model, chunks, 6, together=False)
    kernels.set_num_threads(2)
    try:
        together = _greedy_schedule(model, chunks, 6, together=True)
    finally:
        kernels.set_num_threads(1)
    assert together == alone


def test_routing_counts_and_relocated_experts(models):
    # experts read from copies elsewhere in memory (as from cache slots) give the same logits,
    # and the window reports the rows routed to every (layer, expert): K per row per layer
    model = models["qwen2moe-q4_0"]
    spec = model.spec
    rng = np.random.default_rng(5)
    tokens = [_tokens(rng, 7), _tokens(rng, 2)]
    base = model.forward_window(Window.build([(model.new_kv(16), t) for t in tokens]))
    copies = []  # keeps the copied bytes alive while the pass reads them
    pointers = model.expert_pointers.copy()
    for li in range(spec.n_layers):
        for expert in range(0, spec.n_experts, 2):  # every other expert moves
            for part, name in enumerate(("gate", "up", "down")):
                raw = getattr(model._layers[li], f"{name}_exps").raw[expert]
                copy = np.array(raw)  # [rows, row_bytes], a new buffer
                copies.append(copy)
                pointers[li, part, expert] = copy.ctypes.data
    assert (pointers != model.expert_pointers).sum() == spec.n_layers * 3 * len(
        range(0, spec.n_experts, 2))
    counts = np.zeros((spec.n_layers, spec.n_experts), dtype=np.int64)
    moved = model.forward_window(Window.build([(model.new_kv(16), t) for t in tokens]),
                                 expert_pointers=pointers, routing_counts=counts)
    np.testing.assert_array_equal(moved, base)
    np.testing.assert_array_equal(counts.sum(axis=1), [9 * spec.n_experts_used] * spec.n_layers)
    assert (counts <= 9).all()  # an expert appears at most once in a row's top-k


def test_bad_expert_pointers_are_refused(models):
    model = models["qwen2moe-q4_0"]
    window = Window.build([(model.new_kv(4), [1])])
    with pytest.raises(ValueError, match="expert_pointers must be"):
        model.forward_window(window, expert_pointers=model.expert_pointers[:, :2])
    with pytest.raises(ValueError, match="routing_counts must be"):
        model.forward_window(window, routing_counts=np.zeros((1, 1), dtype=np.int64))


def _kv_state(kvs):
    # the whole cell arrays, uncommitted tail included: "no KV changes" means no cell written
    return [(kv.num_tokens, kv._k.copy(), kv._v.copy()) for kv in kvs]


def _assert_unchanged(kvs, before):
    for kv, (num_tokens, k, v) in zip(kvs, before):
        assert kv.num_tokens == num_tokens
        np.testing.assert_array_equal(kv._k, k)
        np.testing.assert_array_equal(kv._v, v)


def test_a_full_slot_fails_the_window_before_any_kv_changes(models):
    model = models["qwen3moe-f32"]
    rng = np.random.default_rng(4)
    kvs = [model.new_kv(16), model.new_kv(12), model.new_kv(16)]
    for kv, n in zip(kvs, (5, 10, 2)):
        model.forward(_tokens(rng, n), kv)
    before = _kv_state(kvs)
    with pytest.raises(RequestError,
                       match="slot 1: KV cache full: it holds 10 of 12 tokens and cannot take "
                             "3 more"):
        Window.build([(kvs[0], [1]), (kvs[1], [1, 2, 3]), (kvs[2], [4])])
    _assert_unchanged(kvs, before)
    # exactly full is fine
    model.forward_window(Window.build([(kvs[0], [1]), (kvs[1], [1, 2]), (kvs[2], [4])]))
    assert [kv.num_tokens for kv in kvs] == [6, 12, 3]


def test_a_failing_pass_commits_no_kv(models, monkeypatch):
    model = models["qwen2moe-f32"]
    rng = np.random.default_rng(5)
    kvs = _history(model, rng, [3, 6])
    runs = [(kvs[0], _tokens(rng, 2)), (kvs[1], _tokens(rng, 1))]
    fresh = [copy.deepcopy(kv) for kv in kvs]
    expected = model.forward_window(Window.build(list(zip(fresh, [t for _, t in runs]))))
    real = kernels.window_forward

    def fails_after_every_layer(*args):
        real(*args)  # every layer ran and wrote its K/V cells
        raise MemoryError("the window's kernels could not allocate their work buffers")

    monkeypatch.setattr(kernels, "window_forward", fails_after_every_layer)
    with pytest.raises(MemoryError):
        model.forward_window(Window.build(runs))
    assert [kv.num_tokens for kv in kvs] == [3, 6]
    monkeypatch.setattr(kernels, "window_forward", real)
    # the appended but uncommitted rows are simply overwritten by the retry
    _assert_same("f32", model.forward_window(Window.build(runs)), expected)


def test_a_stale_window_is_refused(models):
    model = models["qwen3moe-f32"]
    kvs = _history(model, np.random.default_rng(6), [2, 4])
    window = Window.build([(kvs[0], [7]), (kvs[1], [8])])
    model.forward(np.array([9], dtype=np.int32), kvs[1])
    before = _kv_state(kvs)
    with pytest.raises(RequestError, match="slot 1: the window was built when its KV held 4 "
                                           "tokens but it now holds 5"):
        model.forward_window(window)
    _assert_unchanged(kvs, before)


def test_no_logit_rows(models):
    model = models["qwen3moe-f32"]
    kvs = _history(model, np.random.default_rng(7), [0, 3])
    window = Window.build([(kvs[0], [1, 2, 3]), (kvs[1], [4])], logits="none")
    logits = model.forward_window(window)
    assert logits.shape == (0, model.spec.vocab)
    assert [kv.num_tokens for kv in kvs] == [3, 4]


@pytest.mark.parametrize("runs, logits, message", [
    (lambda kvs: [], "last", "at least one"),
    (lambda kvs: [(kvs[0], [1]), (kvs[0], [2])], "last", "slots 0 and 1 share one KV cache"),
    (lambda kvs: [(kvs[0], [1]), (kvs[1], [4096])], "last",
     "slot 1: token id 4096 is outside the vocabulary"),
    (lambda kvs: [(kvs[0], [1]), (kvs[1], [])], "last", "slot 1: .*non-empty 1-D array"),
    (lambda kvs: [(kvs[0], [1.5])], "last", "integer token ids"),
    (lambda kvs: [(kvs[0], [1]), (kvs[1], [2])], ["last"], "1 modes for 2 runs"),
    (lambda kvs: [(kvs[0], [1]), (kvs[1], [2])], ["last", "first"],
     "slot 1: logits mode 'first' is not one of last, all, none"),
])
def test_bad_windows(models, runs, logits, message):
    model = models["qwen3moe-f32"]
    kvs = _history(model, np.random.default_rng(8), [2, 2])
    before = _kv_state(kvs)
    with pytest.raises(RequestError, match=message):
        Window.build(runs(kvs), logits=logits)
    _assert_unchanged(kvs, before)


def test_kv_of_another_model_is_refused(models):
    model, other = models["qwen3moe-f32"], models["qwen2moe-f32"]
    kv, other_kv = model.new_kv(8), other.new_kv(8)
    with pytest.raises(RequestError, match="slot 1: its KV cache belongs to another model"):
        Window.build([(kv, [1]), (other_kv, [2])])
    with pytest.raises(RequestError, match="made for another model \\(qwen2moe, 2 layers\\)"):
        model.forward_window(Window.build([(other_kv, [2])]))
    assert other_kv.num_tokens == 0
