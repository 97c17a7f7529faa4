"""dequantize and matmul against gguf's numpy dequantiser and float64 references."""
import gguf
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from strata._native import kernels

from .helpers import (ALL_TYPES, FLOAT_TYPES, FP16_FIELDS, QUANT_TYPES, block_size, dequant64,
                      float_error_bound, q8_error_bound, q8_roundtrip, random_weight)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_dequantize_matches_gguf_bit_for_bit(qtype):
    rng = np.random.default_rng(int(qtype))
    rows, cols = 5, 4 * max(block_size(qtype), 64)
    w = random_weight(rng, qtype, rows, cols)
    if qtype in QUANT_TYPES:  # negative scales too: d * 0 is -0.0 there, as gguf gives it
        bs, ts = gguf.GGML_QUANT_SIZES[qtype]
        blocks = w.reshape(-1, ts)
        for off in FP16_FIELDS[qtype]:
            blocks[:, off + 1] |= (rng.integers(0, 2, len(blocks)) << 7).astype(np.uint8)
    expected = gguf.quants.dequantize(w, qtype).reshape(-1)
    got = kernels.dequantize(w, int(qtype), rows * cols)
    assert got.dtype == np.float32 and got.shape == (rows * cols,)
    assert np.array_equal(got.view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("num_tokens", [1, 3, 17, 64])
def test_matmul_matches_float64_reference(qtype, num_tokens):
    rng = np.random.default_rng(1000 * int(qtype) + num_tokens)
    # 37 rows: not a multiple of the 4-row tile nor of the 16-row block
    rows, cols = 37, 2 * max(block_size(qtype), 256)
    w = random_weight(rng, qtype, rows, cols)
    w64 = dequant64(w, qtype)
    x = rng.standard_normal((num_tokens, cols)).astype(np.float32)
    got = kernels.matmul(w, int(qtype), x)
    assert got.shape == (num_tokens, rows) and got.dtype == np.float32
    if qtype in FLOAT_TYPES:
        # float32 math: only accumulation rounding separates it from float64
        expected = x.astype(np.float64) @ w64.T
        assert np.all(np.abs(got - expected) <= float_error_bound(x, w64))
    else:
        # tight: the same 8-bit activations in float64; only float32 rounding is left
        xq = q8_roundtrip(x, qtype)
        expected = xq @ w64.T
        assert np.all(np.abs(got - expected) <= float_error_bound(xq, w64))
        # and within the 8-bit quantisation bound of the unquantised product
        exact = x.astype(np.float64) @ w64.T
        assert np.all(np.abs(got - exact) <= q8_error_bound(x, w64, qtype))


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda t: t.name)
def test_matmul_large_token_count_and_threads(qtype):
    """T above the 128-token work chunk, one and two threads, into a given out array."""
    rng = np.random.default_rng(7 + int(qtype))
    rows, cols, num_tokens = 70, 256, 300
    w = random_weight(rng, qtype, rows, cols)
    w64 = dequant64(w, qtype)
    x = rng.standard_normal((num_tokens, cols)).astype(np.float32)
    xq = q8_roundtrip(x, qtype)
    expected = xq @ w64.T
    saved = kernels.get_num_threads()
    try:
        results = []
        for n in (1, 2):
            kernels.set_num_threads(n)
            out = np.full((num_tokens, rows), np.nan, dtype=np.float32)
            assert kernels.matmul(w, int(qtype), x, out=out) is out
            results.append(out)
    finally:
        kernels.set_num_threads(saved)
    assert np.array_equal(results[0], results[1])
    assert np.all(np.abs(results[0] - expected) <= float_error_bound(xq, w64))


def test_matmul_accepts_read_only_weights(tmp_path):
    rng = np.random.default_rng(3)
    w = random_weight(rng, gguf.GGMLQuantizationType.Q4_0, 8, 64)
    path = tmp_path / "w.bin"
    w.tofile(path)
    mapped = np.memmap(path, dtype=np.uint8, mode="r", shape=w.shape)
    x = rng.standard_normal((2, 64)).astype(np.float32)
    assert np.array_equal(kernels.matmul(mapped, 2, x), kernels.matmul(w, 2, x))
    assert np.array_equal(kernels.dequantize(mapped, 2, 8 * 64),
                          gguf.quants.dequantize(w, 2).reshape(-1))


@settings(max_examples=25, deadline=None)
@given(qtype=st.sampled_from(ALL_TYPES), rows=st.integers(1, 40), num_blocks=st.integers(1, 3),
       num_tokens=st.integers(1, 9), seed=st.integers(0, 2**32 - 1))
def test_matmul_shapes(qtype, rows, num_blocks, num_tokens, seed):
    rng = np.random.default_rng(seed)
    bs = block_size(qtype)
    # float types take any width; quantised ones whole blocks (32 or 256)
    cols = num_blocks * (bs if bs > 1 else 7)
    w = random_weight(rng, qtype, rows, cols)
    w64 = dequant64(w, qtype)
    x = rng.standard_normal((num_tokens, cols)).astype(np.float32)
    got = kernels.matmul(w, int(qtype), x)
    xr = x.astype(np.float64) if qtype in FLOAT_TYPES else q8_roundtrip(x, qtype)
    assert np.all(np.abs(got - xr @ w64.T) <= float_error_bound(xr, w64))


def test_row_bytes_and_type_table():
    assert kernels.SUPPORTED_TYPES == (0, 1, 2, 3, 6, 7, 8, 10, 11, 12, 13, 14, 16, 17, 18, 19,
                                       20, 21, 22, 23, 29, 30)
    for qtype in ALL_TYPES:
        bs, ts = gguf.GGML_QUANT_SIZES[qtype]
        assert kernels.is_supported(int(qtype))
        assert kernels.row_bytes(int(qtype), 4 * 256) == 4 * 256 // bs * ts
    assert not kernels.is_supported(34)  # TQ1_0
    assert kernels.simd_level() in ("avx512", "avx2", "neon", "scalar")


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.Q4_0,
                                   gguf.GGMLQuantizationType.Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 4, 7, 21])
def test_decode_rows_match_the_tiles_at_an_odd_block_count(qtype, rows):
    """The fused decode path takes 4 weight rows and 2 blocks at a time: with 3 blocks (96
    columns, padded to 128) and row counts around 4, the last pair and the last rows are partial,
    and a token's result is still the batched one (12 tokens: the tiles), bit for bit, alone or
    in a group of up to 8 (the fused kernels, 3 tokens a call)."""
    rng = np.random.default_rng(7 + rows)
    w = random_weight(rng, qtype, rows, 96)
    x = rng.standard_normal((12, 96)).astype(np.float32)
    batched = kernels.matmul(w, int(qtype), x)
    for lo, hi in ((0, 1), (1, 3), (3, 7), (4, 12)):
        alone = kernels.matmul(w, int(qtype), np.ascontiguousarray(x[lo:hi]))
        assert np.array_equal(alone, batched[lo:hi])


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_a_token_does_not_depend_on_its_batch(qtype):
    """Decode (fused, 1-3 tokens; 4 in one pass for AVX2's Q4_0 / Q8_0) and batched (tiled)
    paths give a token the same result, bit for bit (Q2_K / Q4_K / Q5_K too: their min terms
    summed in the tiles' order), so greedy output does not depend on which requests share a
    window."""
    rng = np.random.default_rng(50 + int(qtype))
    rows, cols = 21, 2 * max(block_size(qtype), 128)
    w = random_weight(rng, qtype, rows, cols)
    x = rng.standard_normal((12, cols)).astype(np.float32)
    batched = kernels.matmul(w, int(qtype), x)
    for lo, hi in ((0, 1), (1, 3), (6, 9), (8, 12), (2, 7), (4, 12)):
        alone = kernels.matmul(w, int(qtype), np.ascontiguousarray(x[lo:hi]))
        assert np.array_equal(alone, batched[lo:hi])
