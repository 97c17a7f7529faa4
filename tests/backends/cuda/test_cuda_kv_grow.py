"""KV grow on the GPU: CudaKV cells moved into lent VRAM (fp16 and int8) and back exactly, and the
stress run: tier rounds (blocking, async) and KV grow/trim while windows run, every window's
logits equal the frozen-tier run without KV grow bit for bit."""
import sys
from pathlib import Path

import numpy as np
import pytest

from strata.backends.cuda import kv_copies
from strata.model.gguf_file import GGUFModel

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "engine"))
from kv_grow_stress import assert_windows_equal, run_requests  # noqa: E402

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """tiny with 32 experts of width 64 (Q8_0, 13056-byte slots: 51 fp16 cells each), skewed."""
    from strata.tool.synth import synth_model

    path = tmp_path_factory.mktemp("kvgrow") / "tiny-wide.gguf"
    synth_model(path, shape="tiny", weight_type="q8_0", seed=5, routing_skew=1.0, n_experts=32,
                expert_ffn=64)
    return path


def fill(kv, spec, n, dtype, rng):
    """Cells [0, n) of every layer of `kv` set to random fp16 values or int8 codes and scales,
    committed; returns the (k, v) appended per layer."""
    from strata.backends.cuda.kv import int8_cell_dtype

    KV, D, out = spec.n_kv_heads, spec.head_dim, []
    for layer in range(spec.n_layers):
        if dtype == np.int8:
            k, v = (np.zeros((KV, n), dtype=int8_cell_dtype(D)) for _ in range(2))
            for a in (k, v):
                a["q"] = rng.integers(-127, 128, (KV, n, D))
                a["scale"] = rng.random((KV, n))
        else:
            k, v = (rng.standard_normal((KV, n, D)).astype(np.float16) for _ in range(2))
        kv.append(layer, k, v)
        out.append((k, v))
    kv.commit(n)
    return out


@pytest.mark.parametrize("dtype", [np.float16, np.int8])
def test_rehome_moves_the_cells_exactly(wide, dtype):
    from strata.backends.cuda import CudaModel
    from strata.backends.cuda.kv import CudaKV

    model = CudaModel(GGUFModel.open(wide))
    spec, rng = model.spec, np.random.default_rng(0)
    kv = model.new_kv(64, dtype=dtype)
    want = fill(kv, spec, 50, dtype, rng)
    with model.runtime.active():
        region = model.runtime.alloc(CudaKV.nbytes_for(spec, 200, dtype))
    kv.rehome(200, int(region))
    assert kv.capacity == 200 and kv.address == int(region)
    for layer, (k, v) in enumerate(want):
        assert np.array_equal(kv.keys(layer), k) and np.array_equal(kv.values(layer), v)
    kv.rehome(64)
    assert kv.capacity == 64 and kv.address != int(region)
    for layer, (k, v) in enumerate(want):
        assert np.array_equal(kv.keys(layer), k) and np.array_equal(kv.values(layer), v)


@pytest.mark.parametrize("dtype", [np.float16, np.int8])
def test_rehome_into_cells_overlapping_its_own_keeps_them_exactly(wide, dtype):
    # KV grow extends a lent run in place: the new cells start at, before or after the old
    from strata.backends.cuda import CudaModel
    from strata.backends.cuda.kv import CudaKV

    model = CudaModel(GGUFModel.open(wide))
    spec, rng = model.spec, np.random.default_rng(1)
    kv = model.new_kv(64, dtype=dtype)
    fill(kv, spec, 60, dtype, rng)
    want = [(kv.keys(layer), kv.values(layer)) for layer in range(spec.n_layers)]
    step = CudaKV.nbytes_for(spec, 16, dtype)
    with model.runtime.active():
        region = model.runtime.alloc(CudaKV.nbytes_for(spec, 512, dtype) + 4 * step)
    start = int(region) + 2 * step
    for capacity, address in ((100, start), (200, start), (300, start - 2 * step),
                              (400, start + step)):
        kv.rehome(capacity, address)
        assert kv.capacity == capacity and kv.address == address
        for layer, (k, v) in enumerate(want):
            assert np.array_equal(kv.keys(layer), k) and np.array_equal(kv.values(layer), v)


@pytest.mark.parametrize("is_async", [True, False], ids=["async", "blocking"])
def test_every_window_equals_the_frozen_run_while_rounds_and_kv_grow_run(
        wide, is_async, monkeypatch):
    # parks waited for: a slot whose parked cells are still being copied sits out as many
    # windows as the copy takes (kv_copies.py), and the runs compare window by window
    monkeypatch.setattr(kv_copies, "ASYNC", False)
    options = dict(device="cuda", pcie_frac=1.0, expert_cache=32)
    reference, want_tokens, _ = run_requests(wide, adapt_every=0, **options)
    got, tokens, facts = run_requests(wide, copy_chunk_bytes=256, adapt_every=1,
                                      adapt_async=is_async, kv_grow=64, **options)
    assert_windows_equal(reference, got)
    assert tokens == want_tokens
    assert facts["rounds"] > 100 and facts["evictions"] > 20
    assert facts["grows"] >= 8 and facts["trims"] == 6 and facts["refused"] == 0
    assert facts["lent_at_end"] == 0 and facts["capacities"] == [64, 64, 64]
