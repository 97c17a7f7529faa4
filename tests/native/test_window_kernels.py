"""The window loop's own kernels against float64 numpy references on fresh random inputs:
causal attention over KV cells, NEOX RoPE, the router's softmax + top-k, fp16 cell rounding."""
import numpy as np
import pytest

from strata._native import kernels


pytestmark = pytest.mark.usefixtures("one_thread")


# ---- attention -----------------------------------------------------------------------------

def _make_runs(rng, run_shapes, n_kv, d, dtype):
    """run_shapes: (first_position, num_rows, capacity) per run -> q rows offsets and cells."""
    runs, row0 = [], 0
    for pos0, num_rows, cap in run_shapes:
        k = rng.standard_normal((n_kv, cap, d)).astype(dtype)
        v = rng.standard_normal((n_kv, cap, d)).astype(dtype)
        runs.append((k, v, row0, num_rows, pos0))
        row0 += num_rows
    return runs, row0


def _attention_ref(q, runs, n_kv, scale):
    """float64: query head j of row r reads KV head j // G over cells [0, position(r)]."""
    d = runs[0][0].shape[2]
    n_q = q.shape[1] // d
    g = n_q // n_kv
    out = np.zeros(q.shape, dtype=np.float64)
    for k, v, row0, num_rows, pos0 in runs:
        k64, v64 = k.astype(np.float64), v.astype(np.float64)
        for i in range(num_rows):
            r, pos = row0 + i, pos0 + i
            for j in range(n_q):
                qj = q[r, j * d:(j + 1) * d].astype(np.float64)
                scores = k64[j // g, :pos + 1] @ qj * scale
                p = np.exp(scores - scores.max())
                out[r, j * d:(j + 1) * d] = (p / p.sum()) @ v64[j // g, :pos + 1]
    return out


@pytest.mark.parametrize("n_q, n_kv, d, dtype", [
    (8, 2, 64, np.float32),      # GQA, G = 4
    (4, 4, 16, np.float32),      # no grouping, a head dim below one 4-vector tile
    (6, 2, 40, np.float32),      # head dim with vector and scalar tails
    (8, 1, 64, np.float16),      # float16 cells, all heads on one KV head
])
def test_attention_matches_float64(n_q, n_kv, d, dtype):
    rng = np.random.default_rng(n_q * 100 + d)
    # a decode row deep in its context, a prompt chunk straddling key tiles (64 keys), a fresh
    # prompt from position 0 and a chunk ending exactly on a tile boundary
    runs, num_rows = _make_runs(rng, [(150, 1, 160), (37, 90, 140), (0, 20, 20), (100, 28, 128)],
                                n_kv, d, dtype)
    q = rng.standard_normal((num_rows, n_q * d)).astype(np.float32)
    scale = d ** -0.5
    got = kernels.attention(q, runs, n_kv, scale)
    ref = _attention_ref(q, runs, n_kv, scale)
    # float32 dot products of length d and an online softmax over <= 160 keys: errors of a few
    # 1e-7 relative; a wrong head, position or mask moves outputs by O(0.1)
    np.testing.assert_allclose(got, ref, rtol=0, atol=2e-5)


def test_attention_ignores_cells_past_each_rows_position():
    rng = np.random.default_rng(1)
    runs, num_rows = _make_runs(rng, [(70, 6, 100)], 2, 32, np.float32)
    q = rng.standard_normal((num_rows, 4 * 32)).astype(np.float32)
    got = kernels.attention(q, runs, 2, 0.2)
    k, v = runs[0][0], runs[0][1]
    k[:, 76:] = np.nan  # cells beyond the last row are stale: never read into a result
    v[:, 76:] = 1e30
    np.testing.assert_array_equal(kernels.attention(q, runs, 2, 0.2), got)


@pytest.mark.parametrize("n_q, n_kv", [(4, 4), (2, 1), (8, 2), (6, 2)])   # G = 1, 2, 4, 3
@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_a_non_finite_cell_reaches_no_earlier_row(n_q, n_kv, bad, dtype):
    """A NaN / inf in the K or V cell of a later row of the chunk (a corrupt token, an fp16
    cell overflowed) leaves the rows before it as they were: a masked key's probability 0
    times its NaN value was NaN in every earlier row of its 64-key tile, so those rows' later
    layers, their KV cells and a prefix cache reusing them went NaN too."""
    rng = np.random.default_rng(n_q + 10 * n_kv)
    d = 32
    runs, num_rows = _make_runs(rng, [(60, 30, 128), (0, 9, 9)], n_kv, d, dtype)
    q = rng.standard_normal((num_rows, n_q * d)).astype(np.float32)
    clean = kernels.attention(q, runs, n_kv, 0.2)
    k, v = runs[0][0], runs[0][1]
    k[:, 60 + 7, 3] = bad                 # row 7 of the chunk: position 67, tile 1 (64-127)
    v[:, 60 + 7, 5] = bad
    v[:, 60 + 20, :] = bad                # row 20: position 80
    got = kernels.attention(q, runs, n_kv, 0.2)
    np.testing.assert_array_equal(got[:7], clean[:7])
    assert not np.isfinite(got[7:30]).all(axis=1).any()
    np.testing.assert_array_equal(got[30:], clean[30:])      # the other run


# Head dims that are not a multiple of the widest vector loop (16, 24, 48, 80 on AVX2) take its
# narrower loops, and with G = 2 or 3 a row alone fills its register tile up with empty query
# vectors: the narrow loop once fused products into FMAs differently there (an AVX2 EPYC, built
# -march=native), so drafted tokens and echoed logprobs of the tiny synth models (head dim 16,
# G = 2) differed in the last bit from the same rows decoded one at a time.
@pytest.mark.parametrize("d", [16, 20, 24, 48, 64, 80])
@pytest.mark.parametrize("n_q", [8, 4, 6])                                  # G = 4, 2, 3
def test_a_rows_attention_does_not_depend_on_its_batch_or_threads(n_q, d):
    rng = np.random.default_rng(2)
    n_kv = 2
    runs, num_rows = _make_runs(rng, [(300, 130, 512), (5, 1, 8)], n_kv, d, np.float32)
    q = rng.standard_normal((num_rows, n_q * d)).astype(np.float32)
    together = kernels.attention(q, runs, n_kv, 0.125)
    k, v, _, _, pos0 = runs[0]
    for first, count in ((0, 1), (17, 1), (64, 40), (129, 1)):
        alone = kernels.attention(np.ascontiguousarray(q[first:first + count]),
                                  [(k, v, 0, count, pos0 + first)], n_kv, 0.125)
        np.testing.assert_array_equal(alone, together[first:first + count])
    kernels.set_num_threads(2)
    np.testing.assert_array_equal(kernels.attention(q, runs, n_kv, 0.125), together)


def test_attention_checks_its_runs():
    q = np.zeros((3, 64), dtype=np.float32)
    k = np.zeros((2, 4, 16), dtype=np.float32)
    with pytest.raises(ValueError, match="do not fit"):
        kernels.attention(q, [(k, k, 0, 3, 2)], 2, 0.25)
    with pytest.raises(ValueError, match="k and v alike"):
        kernels.attention(q, [(k, k.astype(np.float16), 0, 3, 0)], 2, 0.25)


# ---- RoPE ------------------------------------------------------------------------------------

def test_rope_neox_matches_float64():
    rng = np.random.default_rng(3)
    d, heads = 64, 3
    x = rng.standard_normal((9, heads, d)).astype(np.float32)
    positions = np.array([0, 1, 2, 63, 64, 1000, 4095, 16383, 40000], dtype=np.int64)
    inv_freq = (1.0 / np.power(np.float32(1e6), np.arange(0, d, 2, dtype=np.float32) / d)
                ).astype(np.float32)
    got = kernels.rope_neox(x, positions, inv_freq)
    # the angle is rounded to float32 first (as torch does); the rest in float64
    angle = (positions.astype(np.float32)[:, None] * inv_freq[None, :]).astype(np.float64)
    cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
    x1, x2 = x[..., :d // 2].astype(np.float64), x[..., d // 2:].astype(np.float64)
    ref = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-6 * np.max(np.abs(x)))
    np.testing.assert_array_equal(got[0], x[0])  # position 0 does not rotate


def test_partial_rope_rotates_the_first_dims_only():
    """qwen3next rotates 64 of 256 dims: the first n_rot as a NEOX head of n_rot, the rest pass."""
    rng = np.random.default_rng(4)
    d, n_rot, heads = 32, 8, 2
    x = rng.standard_normal((5, heads, d)).astype(np.float32)
    positions = np.array([0, 3, 17, 500, 9000], dtype=np.int64)
    inv_freq = (1.0 / np.power(np.float32(1e7), np.arange(0, n_rot, 2, dtype=np.float32)
                               / n_rot)).astype(np.float32)
    got = kernels.rope_neox(x, positions, inv_freq)
    whole = kernels.rope_neox(np.ascontiguousarray(x[..., :n_rot]), positions, inv_freq)
    np.testing.assert_array_equal(got[..., :n_rot], whole)
    np.testing.assert_array_equal(got[..., n_rot:], x[..., n_rot:])
    with pytest.raises(ValueError, match="frequencies"):
        kernels.rope_neox(x, positions, np.ones(d, dtype=np.float32))


# ---- router ----------------------------------------------------------------------------------

def test_router_top_k_ties_take_the_lowest_id_first():
    logits = np.log(np.array([[0.1, 0.3, 0.3, 0.2, 0.1],
                              [0.25, 0.25, 0.25, 0.25, 0.0]], dtype=np.float32) + 1e-30)
    experts, weights = kernels.router_topk(logits.astype(np.float32), 3, False)
    np.testing.assert_array_equal(experts, [[1, 2, 3], [0, 1, 2]])
    assert experts.dtype == np.int32
    np.testing.assert_allclose(weights, [[0.3, 0.3, 0.2], [0.25, 0.25, 0.25]], rtol=1e-6)
    _, normed = kernels.router_topk(logits.astype(np.float32), 3, True)
    np.testing.assert_allclose(normed, [[0.375, 0.375, 0.25], [1 / 3, 1 / 3, 1 / 3]], rtol=1e-6)


@pytest.mark.parametrize("norm_topk", [False, True])
def test_router_matches_float64(norm_topk):
    rng = np.random.default_rng(4)
    logits = (rng.standard_normal((50, 64)) * 3).astype(np.float32)
    logits[7, 10] = logits[7, 40] = logits[7].max() + 1  # an exact tie at the top
    experts, weights = kernels.router_topk(logits, 8, norm_topk)
    l64 = logits.astype(np.float64)
    probs = np.exp(l64 - l64.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    ids = np.argsort(-logits, axis=-1, kind="stable")[:, :8]
    ref = np.take_along_axis(probs, ids, axis=-1)
    if norm_topk:
        ref /= ref.sum(-1, keepdims=True)
    np.testing.assert_array_equal(experts, ids)
    assert experts[7, 0] == 10 and experts[7, 1] == 40
    np.testing.assert_allclose(weights, ref, rtol=2e-6)


# ---- fp16 cells --------------------------------------------------------------------------------

def test_fp16_cell_rounding_equals_numpy():
    rng = np.random.default_rng(5)
    edge = np.array([0.0, -0.0, 65504.0, 65519.99, 65520.0, -70000.0, np.inf, -np.inf,
                     6.1e-5, 6.0e-8, 2.98e-8, 5.96e-8, 1e-10, 1.0 + 2.0 ** -11,
                     1.0 + 3 * 2.0 ** -11, 2049.0, 2051.0], dtype=np.float32)
    values = np.concatenate([edge, rng.standard_normal(20000).astype(np.float32) * 10.0 ** rng.
                             integers(-9, 5, 20000)]).astype(np.float32)
    with np.errstate(over="ignore"):  # numpy warns where a value rounds to infinity
        expected = values.astype(np.float16).view(np.uint16)
    np.testing.assert_array_equal(kernels.fp32_to_fp16_bits(values), expected)
    nan_bits = kernels.fp32_to_fp16_bits(np.array([np.nan], dtype=np.float32))
    assert np.isnan(nan_bits.view(np.float16)[0])
