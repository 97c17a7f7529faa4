"""Parks and restores queued on the copy stream (backends/cuda/kv_copies.py): their order
with each other and with the windows that run the KV, a park into a block the copy thread
pins first, and agents taking turns in one slot while another decodes, against fresh runs."""
import gc

import numpy as np
import pytest

from strata import Engine, EngineConfig, SamplingParams
from strata.backends.cuda import host_pool, kv_copies
from strata.backends.cuda.kv import _host_pool
from strata.engine.generate import collect

pytestmark = pytest.mark.cuda

GREEDY = dict(temperature=0.0, ignore_eos=True)
BIG = 200_000  # tokens: ~51 MB of tiny's cells, a few ms on the copy stream


def random_cells(kv, num_tokens, seed):
    """Fill `kv` with random fp16 cells; their (keys, values) per layer."""
    rng = np.random.default_rng(seed)
    shape = (kv.spec.n_kv_heads, num_tokens, kv.spec.head_dim)
    layers = [(rng.standard_normal(shape).astype(np.float16),
               rng.standard_normal(shape).astype(np.float16)) for _ in range(kv.num_layers)]
    kv.fill_cells(layers, num_tokens)
    return layers


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory):
    """tiny with room for KVs of BIG tokens."""
    from strata.tool.synth import synth_model

    path = tmp_path_factory.mktemp("kv-copies") / "tiny-256k.gguf"
    synth_model(path, shape="tiny", weight_type="q8_0", seed=7, context_length=2 * BIG)
    with Engine(EngineConfig(path, n_ctx=1024, device="cuda")) as engine:
        yield engine


def test_a_restore_queued_behind_a_park_of_the_same_cells_keeps_the_order(tiny_engine):
    model = tiny_engine.model
    a, b = model.new_kv(BIG), model.new_kv(BIG)
    cells_a, cells_b = random_cells(a, BIG, 1), random_cells(b, BIG, 2)
    ka, va, landed_a = a.park_prefix(BIG)
    kb, vb, landed_b = b.park_prefix(BIG)
    assert _host_pool(model.runtime).holds(kb, vb)  # pinned: the queued path
    a.restore_cells(kb, vb, BIG)  # behind both parks, into the cells a's park reads
    landed_a.wait()
    for layer, (k, v) in enumerate(cells_a):  # the park read them before the restore came
        assert np.array_equal(ka[layer], k) and np.array_equal(va[layer], v)
    for layer, (k, v) in enumerate(cells_b):  # keys() waits for the copies first
        assert np.array_equal(a.keys(layer), k) and np.array_equal(a.values(layer), v)
    assert not a.copies_pending() and landed_b.done()


def test_a_park_into_a_fresh_block_has_the_copy_thread_pin_it(tiny_engine, monkeypatch):
    model = tiny_engine.model
    pool = _host_pool(model.runtime)
    monkeypatch.setattr(host_pool, "SETTLE_S", 0.0)
    gc.collect()
    pool.settle()
    pool.trim(0)  # nothing kept (blocks just given back too): the park needs a new block
    kv = model.new_kv(BIG)
    cells = random_cells(kv, BIG, 9)
    made = pool.num_made_later
    k, v, landed = kv.park_prefix(BIG)
    assert landed is not None and pool.holds(k, v)  # queued, into the block being pinned
    landed.wait()
    assert pool.num_made_later == made + 1
    for layer, (keys, values) in enumerate(cells):
        assert np.array_equal(k[layer], keys) and np.array_equal(v[layer], values)


def test_a_restore_from_the_heap_lands_before_it_returns_and_unpins_it(tiny_engine):
    from strata._native import cuda_driver
    from strata.backends.cuda.host_memory import _page_range

    model = tiny_engine.model
    source = model.new_kv(BIG)
    cells = random_cells(source, BIG, 11)
    k, v = source.export_prefix(BIG)
    k, v = np.array(k), np.array(v)  # the heap's, like a small conversation file's arrays
    assert not _host_pool(model.runtime).holds(k, v)
    target = model.new_kv(BIG)
    random_cells(target, BIG, 12)
    target.restore_cells(k, v, BIG)
    assert not target.copies_pending()
    for layer, (keys, values) in enumerate(cells):
        assert np.array_equal(target.keys(layer), keys)
        assert np.array_equal(target.values(layer), values)
    low, high = _page_range(k)
    with model.runtime.active():  # unpinned once the copies landed: pinning it again works
        cuda_driver.host_register(low, high - low)
        cuda_driver.host_unregister(low)


def test_a_restore_from_a_mapping_of_its_own_is_pinned_and_copied_on_the_copy_thread(
        tiny_engine, monkeypatch):
    import contextlib
    import threading

    from strata._native import cuda_driver
    from strata.backends.cuda import kv as cuda_kv
    from strata.backends.cuda.host_memory import _page_range
    from strata.model.host_pages import anonymous_array

    pinned_in = []
    real_pinned_while = cuda_kv.pinned_while

    @contextlib.contextmanager
    def spy(*arrays):
        pinned_in.append((threading.current_thread().name, [id(a) for a in arrays]))
        with real_pinned_while(*arrays):
            yield

    monkeypatch.setattr(cuda_kv, "pinned_while", spy)
    model = tiny_engine.model
    source = model.new_kv(BIG)
    cells = random_cells(source, BIG, 13)
    parked = source.export_prefix(BIG)
    k, v = (anonymous_array(a.nbytes).view(a.dtype).reshape(a.shape) for a in parked)
    k[...], v[...] = parked  # as a conversation file's arrays of over 1 MiB are read
    target = model.new_kv(BIG)
    random_cells(target, BIG, 14)
    # a large park queued first: the restore lands late, behind it
    big = model.new_kv(BIG)
    random_cells(big, BIG, 15)
    big.park_prefix(BIG)
    target.restore_cells(k, v, BIG)
    assert target.num_tokens == BIG and target.copies_pending()
    for layer, (keys, values) in enumerate(cells):  # keys() waits for the copies
        assert np.array_equal(target.keys(layer), keys)
        assert np.array_equal(target.values(layer), values)
    assert [name for name, ids in pinned_in if ids == [id(k), id(v)]] == ["kv-copies"]
    for array in (k, v):  # unpinned once the copies landed: pinning it again works
        low, high = _page_range(array)
        with model.runtime.active():
            cuda_driver.host_register(low, high - low)
            cuda_driver.host_unregister(low)


def test_int8_cells_park_and_restore_through_the_copy_thread(tiny_engine, monkeypatch):
    model = tiny_engine.model
    jobs = []
    real_submit = kv_copies.KVCopier.submit

    def spy(self, copies, keep, in_pieces, around=None, before=None, then=None):
        jobs.append((in_pieces, before is not None, then is not None))
        return real_submit(self, copies, keep, in_pieces, around=around, before=before,
                           then=then)

    monkeypatch.setattr(kv_copies.KVCopier, "submit", spy)
    source = model.new_kv(BIG, dtype=np.int8)
    rng = np.random.default_rng(21)
    layers = []
    for _ in range(source.num_layers):
        pair = []
        for _ in range(2):
            records = np.empty((source.spec.n_kv_heads, BIG), source.host_dtype)
            records["q"] = rng.integers(-127, 128, records["q"].shape)
            records["scale"] = rng.uniform(1e-3, 1.0, records.shape).astype(np.float32)
            pair.append(records)
        layers.append(tuple(pair))
    source.fill_cells(layers, BIG)
    big = model.new_kv(BIG)  # an fp16 park queued first: the int8 jobs come behind it
    random_cells(big, BIG, 22)
    big.park_prefix(BIG)
    k, v, landing = source.park_prefix(BIG)
    assert landing is not None and jobs[-1] == (True, False, True)  # gathered by `then`
    landing.wait()
    for layer, pair in enumerate(layers):
        for got, want in zip((k[layer], v[layer]), pair):
            assert np.array_equal(got["q"], want["q"])
            assert np.array_equal(got["scale"], want["scale"])
    target = model.new_kv(BIG, dtype=np.int8)
    target.restore_cells(k[:, :, :BIG - 5], v[:, :, :BIG - 5], BIG - 5)
    assert jobs[-1] == (False, True, False) and target.num_tokens == BIG - 5
    for layer, pair in enumerate(layers):  # keys() waits for the copies
        for got, want in zip((target.keys(layer), target.values(layer)), pair):
            assert np.array_equal(got["q"], want["q"][:, :BIG - 5])
            assert np.array_equal(got["scale"], want["scale"][:, :BIG - 5])


@pytest.mark.parametrize("num_tokens", [BIG // 8, BIG])
def test_a_file_prefix_is_gathered_and_a_whole_file_pinned(tiny_engine, monkeypatch, num_tokens):
    """Cells in a mapping of their own (a conversation or slot file's): a prefix of them is
    gathered into a pinned pool block by the copy thread (`before`), not pinned whole around
    the copies; all of them are pinned where they lie (`around`)."""
    from strata.model.host_pages import anonymous_array

    model = tiny_engine.model
    jobs = []
    real_submit = kv_copies.KVCopier.submit

    def spy(self, copies, keep, in_pieces, around=None, before=None, then=None):
        jobs.append((around is not None, before is not None))
        return real_submit(self, copies, keep, in_pieces, around=around, before=before,
                           then=then)

    monkeypatch.setattr(kv_copies.KVCopier, "submit", spy)
    target = model.new_kv(BIG)
    L, KV, D = target.num_layers, target.spec.n_kv_heads, target.spec.head_dim
    rng = np.random.default_rng(31)
    files = []
    for _ in range(2):
        cells = anonymous_array(L * KV * BIG * D * 2).view(np.float16).reshape(L, KV, BIG, D)
        cells[...] = rng.standard_normal(cells.shape).astype(np.float16)
        files.append(cells)
    k, v = files
    target.restore_cells(k, v, num_tokens)
    # (a gathered prefix's `around` pins a fresh pool block, or is None for a pinned one)
    assert (jobs[-1][1] if num_tokens < BIG else jobs[-1] == (True, False))
    assert target.num_tokens == num_tokens
    for layer in range(L):  # keys() waits for the copies
        assert np.array_equal(target.keys(layer), k[layer, :, :num_tokens])
        assert np.array_equal(target.values(layer), v[layer, :, :num_tokens])


def test_a_window_right_after_a_queued_restore_reads_the_restored_cells(tiny_engine):
    model = tiny_engine.model
    rng = np.random.default_rng(5)
    prompt, more = rng.integers(10, 2000, 300), rng.integers(10, 2000, 20)
    source = model.new_kv(1024)
    model.forward(prompt.tolist(), source)
    k, v, landed = source.park_prefix(len(prompt))
    landed.wait()
    expected = model.forward(more.tolist(), source, all_logits=True)
    # a large park queued first keeps the copy stream busy: the restore lands late, and the
    # window must wait for it rather than read the random cells under it
    big = model.new_kv(BIG)
    random_cells(big, BIG, 3)
    target = model.new_kv(1024)
    random_cells(target, 1024, 4)
    big.park_prefix(BIG)
    target.restore_cells(k, v, len(prompt))
    got = model.forward(more.tolist(), target, all_logits=True)
    assert np.array_equal(got, expected)


@pytest.mark.parametrize("queued", [True, False])
def test_agents_taking_turns_beside_a_decoding_slot_equal_fresh_runs(
        synth_path, monkeypatch, queued):
    monkeypatch.setattr(kv_copies, "ASYNC", queued)
    path = synth_path("tiny", "q8_0")
    rng = np.random.default_rng(6)
    long_answer = SamplingParams(max_tokens=600, **GREEDY)  # beyond the turns
    turn = SamplingParams(max_tokens=4, **GREEDY)
    with Engine(EngineConfig(path, n_ctx=2048, parallel=2, device="cuda")) as engine:
        decoding = engine.submit(rng.integers(10, 2000, 16).tolist(), long_answer)
        agents = [rng.integers(10, 2000, 700).tolist() for _ in range(2)]
        answers, streamed = [], []
        for _ in range(3):
            for i in range(2):
                handle = engine.submit(agents[i], turn)
                while not handle.is_finished:
                    assert engine.step()
                    streamed += [e.token_id for e in decoding.pop_events()]
                out = [e.token_id for e in handle.pop_events()]
                assert handle.error is None and len(out) == 4
                answers.append((list(agents[i]), out))
                agents[i] = agents[i] + out + rng.integers(10, 2000, 50).tolist()
        assert not decoding.is_finished  # slot 0 stayed busy: every turn parked and restored
        assert engine.scheduler.conversations.num_taken >= 4  # agents came back from parks
        while not decoding.is_finished:
            assert engine.step()
            streamed += [e.token_id for e in decoding.pop_events()]
        for prompt, out in answers:
            engine.reset()
            assert collect(engine.generate(prompt, turn)).token_ids == out
        engine.reset()
        again = collect(engine.generate(decoding.prompt_tokens, long_answer)).token_ids
        assert again == streamed
