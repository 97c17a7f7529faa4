"""CUDA kernels against float64 numpy references on fresh random inputs: the product kernels on
every GGUF type (dense, grouped by expert, gate/up + SiLU; the decode mv_* kernels on every
quantised type), embedding rows equal to the CPU's dequantisation, activation quantisation,
attention over fp16 and int8 KV caches (split over blocks; a block per head, or per GQA group for
rows deep in their context, each row by its own position), QK-norm + RoPE (whole heads or
partial) + KV append, RMSNorm, the combine fused with the next norm, and the one-launch router
(product, top-k, grouping)."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from strata._native import kernels
from strata.backends.cuda.plan import (ATTENTION_FMT, ATTENTION_GROUP_FMT,
                                       ATTENTION_GROUP_MERGE_FMT, GQA_SPLITS, INT_MAX,
                                       attention_group_launch, attention_group_merge_launch,
                                       attention_group_part_floats, attention_kernels)
from strata.tool.synth import random_blocks

from cuda_synth import B32_TYPES, IQ_TYPES, K_TYPES, TYPES, iq_blocks

pytestmark = pytest.mark.cuda

FLOAT = {"f32", "f16", "bf16"}


def _q8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The activation quantisation the kernels use, in numpy (float32 like the device)."""
    blocks = x.reshape(-1, 32)
    d = (np.abs(blocks).max(axis=1) / np.float32(127)).astype(np.float32)  # [B]
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    q = np.rint(blocks * inv[:, None]).astype(np.int8)
    return q.reshape(x.shape), d.reshape(x.shape[0], -1)


class _Dev:
    def __init__(self, runtime):
        self.rt = runtime
        self.keep = []

    def put(self, array) -> int:
        buf = self.rt.upload(np.ascontiguousarray(array))
        self.keep.append(buf)
        return int(buf)

    def empty(self, num_bytes: int, fill: int = 0x7F) -> int:
        buf = self.rt.alloc(num_bytes)
        self.rt.drv.memset_d8(buf, fill, max(num_bytes, 1))  # poison: every output is written
        self.keep.append(buf)
        return int(buf)

    def get(self, ptr: int, shape, dtype) -> np.ndarray:
        out = np.empty(shape, dtype=dtype)
        self.rt.drv.memcpy_dtoh(out, ptr)
        return out

    def launch(self, name, grid, block, fmt, args, shared_bytes=0):
        k = self.rt.kernel(name)
        k.prepare(grid, block, fmt, args, shared_bytes).launch(self.rt.stream_handle)
        self.rt.synchronize()


def _weights(weight_type: str, num_rows: int, num_cols: int, rng):
    if weight_type in IQ_TYPES:  # gguf's own dequantisation: the reference the CPU's equals
        raw, dense = iq_blocks(weight_type, num_rows * num_cols, 0.05, rng)
        return raw.reshape(num_rows, -1), dense.reshape(num_rows, num_cols).astype(np.float64)
    qtype = getattr(QT, weight_type.upper())
    raw = random_blocks(qtype, num_rows * num_cols, 0.05, rng).reshape(num_rows, -1)
    dense = np.asarray(kernels.dequantize(raw.reshape(-1), int(qtype), num_rows * num_cols),
                       dtype=np.float32).reshape(num_rows, num_cols)
    return raw, dense.astype(np.float64)


def _acts(x: np.ndarray, weight_type: str) -> np.ndarray:
    if weight_type in FLOAT:
        return x.astype(np.float64)
    q, d = _q8(x)
    return (q.reshape(-1, 32).astype(np.float64) * d.reshape(-1, 1)).reshape(x.shape)


@pytest.mark.parametrize("weight_type", TYPES)
def test_embed_rows_equal_the_cpu_dequantisation(runtime, weight_type):
    """embed_* (common.cuh's dequant_one) gives the CPU's (gguf's) dequantised values bit for bit,
    tokens in any order and repeated; Q4_1 / Q5_1 too, whose w = d * q + m; the i-quants
    against gguf's dequantize_blocks (IQ1_S / IQ1_M: (dl / 8) * (8 grid +- 1))."""
    dev, rng = _Dev(runtime), np.random.default_rng()
    V, H = 37, 1408 if weight_type not in K_TYPES + IQ_TYPES else 1024  # 44 of 32 / 4 of 256
    raw, dense = _weights(weight_type, V, H, rng)
    tokens = np.array([5, 0, 36, 5, 17], dtype=np.int32)
    x = dev.empty(4 * len(tokens) * H)
    dev.launch(f"embed_{weight_type}", (len(tokens),), (256,), "PqiPP",
               [dev.put(raw), raw.shape[1], H, dev.put(tokens), x])
    np.testing.assert_array_equal(dev.get(x, (len(tokens), H), np.float32),
                                  dense[tokens].astype(np.float32))


def test_quantize_kernel_matches_numpy(runtime):
    dev, rng = _Dev(runtime), np.random.default_rng()
    x = rng.standard_normal((7, 256)).astype(np.float32) * 3
    xq, xd = dev.empty(x.size), dev.empty(4 * x.size // 32)
    dev.launch("quantize_q8", ((x.size // 32 + 7) // 8,), (256,), "PqPP",
               [dev.put(x), x.size // 32, xq, xd])
    q, d = _q8(x)
    np.testing.assert_array_equal(dev.get(xq, x.shape, np.int8), q)
    np.testing.assert_array_equal(dev.get(xd, d.shape, np.float32), d)


@pytest.mark.parametrize("weight_type", TYPES)
def test_dense_and_grouped_products(runtime, weight_type):
    dev, rng = _Dev(runtime), np.random.default_rng()
    E, N, K, T = 3, 42, 512, 11  # N not a multiple of the 4 outputs per warp
    raws, dense = zip(*[_weights(weight_type, N, K, rng) for _ in range(2 * E)])
    gate_raw, up_raw = np.stack(raws[:E]), np.stack(raws[E:])  # [E, N, row_bytes]
    row_bytes = gate_raw.shape[-1]
    x = rng.standard_normal((T, K)).astype(np.float32)
    xr = _acts(x, weight_type)  # [T, K] what the kernel multiplies, float64
    q, d = _q8(x)
    xf, xq, xd = dev.put(x), dev.put(q), dev.put(d)
    fmt = "PPPPqiiPPPPPPPPPiPP"
    name = weight_type

    # dense: one group of all T rows, plus a bias
    bias = rng.standard_normal(N).astype(np.float32)
    y = dev.empty(4 * T * N)
    dense_groups = dev.put(np.array([0, 0, T, 1], dtype=np.int32))
    dev.launch(f"mm_store_{name}", ((N + 15) // 16, 1), (128,), fmt,
               [dev.put(gate_raw[0]), 0, 0, 0, row_bytes, N, K, xf, xq, xd, dense_groups,
                dense_groups + 12, 0, 0, dev.put(bias), y, N, 0, 0])
    want = xr @ dense[0].T + bias
    got = dev.get(y, (T, N), np.float32)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5

    # add mode accumulates into y
    dev.launch(f"mm_add_{name}", ((N + 15) // 16, 1), (128,), fmt,
               [dev.put(gate_raw[1]), 0, 0, 0, row_bytes, N, K, xf, xq, xd, dense_groups,
                dense_groups + 12, 0, 0, 0, y, N, 0, 0])
    want = want + xr @ dense[1].T
    got = dev.get(y, (T, N), np.float32)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5

    # q, k, v in one launch: three matrices of Nq, Nkv, Nkv rows
    Nkv = 18
    outs = [dev.empty(4 * T * n) for n in (N, Nkv, Nkv)]
    biases = [rng.standard_normal(n).astype(np.float32) for n in (N, Nkv, Nkv)]
    num_blocks = (N + 15) // 16 + 2 * ((Nkv + 15) // 16)
    dev.launch(f"mm_qkv_{name}", (num_blocks, 1), (128,), "PPPqiiiPPPPPPPPPPP",
               [dev.put(gate_raw[0]), dev.put(gate_raw[1][:Nkv]), dev.put(gate_raw[2][:Nkv]),
                row_bytes, N, Nkv, K, xf, xq, xd, dense_groups, dense_groups + 12,
                *[dev.put(b) for b in biases], *outs])
    for i, (out_ptr, n) in enumerate(zip(outs, (N, Nkv, Nkv))):
        want = xr @ dense[i][:n].T + biases[i]
        got = dev.get(out_ptr, (T, n), np.float32)
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5

    # grouped gate/up + SiLU: pairs sorted by expert, act_rows name their rows
    experts = rng.integers(0, E, size=T)
    order = np.argsort(experts, kind="stable")
    groups = []
    for e in range(E):
        members = np.flatnonzero(experts[order] == e)
        if len(members):
            groups += [e, int(members[0]), len(members)]
    num_groups = len(groups) // 3
    g = dev.put(np.array(groups + [num_groups], dtype=np.int32))
    out = dev.empty(4 * T * N)
    # each expert through a pointer table, in separate allocations as an offload tier has them
    tables = [dev.put(np.array([dev.put(m[e]) for e in range(E)], dtype=np.uint64))
              for m in (gate_raw, up_raw)]
    dev.launch(f"mm_gateup_{name}", ((N + 15) // 16, E), (128,), fmt,
               [0, 0, tables[0], tables[1], row_bytes, N, K, xf, xq, xd,
                g, g + 12 * num_groups, dev.put(order.astype(np.int32)), 0, 0, out, N, 0, 0])
    got = dev.get(out, (T, N), np.float32)
    want = np.empty((T, N))
    for j, r in enumerate(order):
        gv = xr[r] @ dense[experts[r]].T
        uv = xr[r] @ dense[E + experts[r]].T
        want[j] = gv / (1 + np.exp(-gv)) * uv
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5


ATT_SPLITS = 4  # attention.cu's ATT_SPLITS (blocks per (row, head))


def run_attention(dev, q, bases, positions, capacity, layer, num_layers, num_kv_heads,
                  want_q8=True, num_launches=1, deep_from=None, singles=False):
    """Launch attention_d* (for D) over rows with KVs at `bases` (tagged addresses), after
    attention_group.cu's kernel for the rows at `deep_from` or past it when given (a deep
    plan's decode window; with `singles`, the group kernel alone, taking the rows whose
    neighbours have other KVs); returns (out [R, Q, D], outq, outd) after the last of
    `num_launches` identical launches."""
    R, Q, D = q.shape
    out, outq, outd = dev.empty(4 * R * Q * D), dev.empty(R * Q * D), dev.empty(R * Q * D // 8)
    part = dev.empty(4 * R * Q * ATT_SPLITS * (2 + D))
    counts = dev.empty(4 * R * Q, fill=0)
    group_part = dev.empty(4 * attention_group_part_floats(R, Q, D))
    name, grid, block = attention_group_launch(R, Q, num_kv_heads, D)
    merge, merge_grid, merge_block = attention_group_merge_launch(R, Q, D)
    slot_rows = dev.empty(4 * grid[0])
    outs = [dev.put(q), out, outq if want_q8 else 0, outd if want_q8 else 0,
            dev.put(np.array(bases, dtype=np.uint64)), dev.put(positions.astype(np.int32)),
            dev.put(np.full(R, capacity, dtype=np.int32))]
    dims = [layer, num_layers, Q, num_kv_heads, D, D ** -0.5]
    results = []
    for _ in range(num_launches):
        if deep_from is not None:
            dev.launch(name, grid, block, ATTENTION_GROUP_FMT,
                       [*outs, R, int(singles), *dims, group_part, slot_rows, deep_from])
            dev.launch(merge, merge_grid, merge_block, ATTENTION_GROUP_MERGE_FMT,
                       [*outs, Q, D, GQA_SPLITS, group_part, slot_rows])
        if not singles:
            dev.launch(attention_kernels(D)[0], (R, Q, ATT_SPLITS), (128,), ATTENTION_FMT,
                       [*outs, *dims, part, counts,
                        INT_MAX if deep_from is None else deep_from])
        results.append(dev.get(out, (R, Q, D), np.float32))
    for other in results[:-1]:  # the counters were left at zero: every launch merged
        np.testing.assert_array_equal(other, results[-1])
    assert not dev.get(counts, (R * Q,), np.int32).any()
    return (results[-1], dev.get(outq, (R, Q * D), np.int8),
            dev.get(outd, (R, Q * D // 32), np.float32))


def attention_reference(q, keys, values):
    """Causal attention of one query [D] over keys / values [n, D] in float64."""
    s = keys.astype(np.float64) @ q.astype(np.float64) * q.shape[-1] ** -0.5
    p = np.exp(s - s.max())
    return (p / p.sum()) @ values.astype(np.float64)


@pytest.mark.parametrize("head_dim", (64, 80, 128, 256))  # dims per lane 2, 4 (20 lanes), 4, 8
def test_attention_over_fp16_cache(runtime, head_dim):
    """Rows at positions inside the first chunk, inside block 0 (written by it alone), across
    chunks and across all splits (and their second round), relaunched: counters reset, results
    equal bit for bit."""
    dev, rng = _Dev(runtime), np.random.default_rng()
    L, KVH, Q, D, C = 2, 2, 4, head_dim, 1200
    layer, positions = 1, np.array([0, 7, 31, 32, 127, 149, 512, 1199], dtype=np.int32)
    R = len(positions)
    cache = (rng.standard_normal((R, L, 2, KVH, C, D)) * 2).astype(np.float16)
    bases = [dev.put(cache[r]) for r in range(R)]
    q = rng.standard_normal((R, Q, D)).astype(np.float32)
    fused_q8 = D % 32 == 0  # the 8-bit form is fused when heads are whole blocks of 32
    got, outq, outd = run_attention(dev, q, bases, positions, C, layer, L, KVH,
                                    want_q8=fused_q8, num_launches=2)
    if fused_q8:  # the fused 8-bit form equals quantising the float output
        q8, d8 = _q8(got.reshape(R, Q * D))
        np.testing.assert_array_equal(outq, q8)
        np.testing.assert_array_equal(outd, d8)
    for r, pos in enumerate(positions):
        for h in range(Q):
            kvh = h // (Q // KVH)
            want = attention_reference(q[r, h], cache[r, layer, 0, kvh, :pos + 1],
                                       cache[r, layer, 1, kvh, :pos + 1])
            np.testing.assert_allclose(got[r, h], want, rtol=1e-4, atol=1e-5)
    # a row alone gives the same bits as inside the window
    for r in (4, 5):  # one inside block 0, one across splits
        alone, _, _ = run_attention(dev, q[r:r + 1], bases[r:r + 1], positions[r:r + 1], C,
                                    layer, L, KVH, want_q8=fused_q8)
        np.testing.assert_array_equal(alone[0], got[r])


# (query heads, KV heads, head dim): Qwen3-30B-A3B's (8 heads a group), a whole group of 16
# in two blocks, a group of 3 (blocks of 4 with one head idle), Qwen3-Next's (D 256: 4 heads a
# block)
@pytest.mark.parametrize("form", ("mma", "simt"))  # D 256 takes the SIMT form either way
@pytest.mark.parametrize("shape", [(32, 4, 128), (16, 1, 64), (6, 2, 32), (16, 2, 256)])
def test_group_attention_deep_in_long_contexts(runtime, monkeypatch, shape, form):
    """attention_group.cu (tensor-core and SIMT forms) on rows deep into a long context (every
    split holding cells, their second and third rounds, a split boundary on either side) with
    GQA groups of several sizes: float64's result; a window of more rows than the partials
    hold (the rows past them computed by one block, split after split) and the same rows taken
    as singles give the same bits as each row alone."""
    monkeypatch.setenv("STRATA_ATT_GROUP", form)
    dev, rng = _Dev(runtime), np.random.default_rng()
    Q, KVH, D = shape
    L, C, layer = 1, 17_000, 0
    caches = [(rng.standard_normal((L, 2, KVH, C, D)) * 2).astype(np.float16) for _ in range(3)]
    kvs = [dev.put(c) for c in caches]
    ends = [0, 31, 255, 256, 4000, 8191, 8192, 8300, 16383, 16384, 16999]
    positions = np.array([ends[r % len(ends)] if r % 3 else C - 1 - 37 * r for r in range(40)],
                         dtype=np.int32)
    R = len(positions)
    which = [r % 3 for r in range(R)]  # neighbours never share a KV: every row is a single
    bases = [kvs[w] for w in which]
    q = rng.standard_normal((R, Q, D)).astype(np.float32)
    fused_q8 = D % 32 == 0
    got, _, _ = run_attention(dev, q, bases, positions, C, layer, L, KVH, want_q8=fused_q8,
                              num_launches=2, deep_from=0)
    G = Q // KVH
    for r in range(R):
        cache, n = caches[which[r]].astype(np.float64), positions[r] + 1
        for kvh in range(KVH):
            keys, values = cache[layer, 0, kvh, :n], cache[layer, 1, kvh, :n]
            heads = q[r, kvh * G:(kvh + 1) * G].astype(np.float64)  # [G, D]
            s = heads @ keys.T * D ** -0.5  # [G, n]
            p = np.exp(s - s.max(axis=1, keepdims=True))
            want = (p / p.sum(axis=1, keepdims=True)) @ values
            np.testing.assert_allclose(got[r, kvh * G:(kvh + 1) * G], want, rtol=1e-4,
                                       atol=1e-5, err_msg=f"row {r} at {positions[r]}")
    singles, _, _ = run_attention(dev, q, bases, positions, C, layer, L, KVH,
                                  want_q8=fused_q8, deep_from=0, singles=True)
    np.testing.assert_array_equal(singles, got)
    for r in (1, 7, 33, 38, 39):  # rows with partial slots and rows past them
        alone, _, _ = run_attention(dev, q[r:r + 1], bases[r:r + 1], positions[r:r + 1], C,
                                    layer, L, KVH, want_q8=fused_q8, deep_from=0)
        np.testing.assert_array_equal(alone[0], got[r], err_msg=f"row {r}")


def test_each_row_takes_its_path_by_its_own_position(runtime):
    """A deep plan's window (attention_group.cu for rows at deep_from or past it, attention_d*
    for the rest): every row's bits equal those of the path its own position picks, whatever
    its neighbours' positions; the fused 8-bit form too."""
    dev, rng = _Dev(runtime), np.random.default_rng()
    Q, KVH, D, L, C, layer, deep_from = 16, 2, 128, 1, 3000, 0, 1024
    positions = np.array([5, 1023, 1024, 2999, 300, 2048, 0, 1500], dtype=np.int32)
    R = len(positions)
    caches = (rng.standard_normal((R, L, 2, KVH, C, D)) * 2).astype(np.float16)
    bases = [dev.put(caches[r]) for r in range(R)]
    q = rng.standard_normal((R, Q, D)).astype(np.float32)
    got, outq, outd = run_attention(dev, q, bases, positions, C, layer, L, KVH,
                                    deep_from=deep_from, num_launches=2)
    per_head, _, _ = run_attention(dev, q, bases, positions, C, layer, L, KVH)
    per_group, _, _ = run_attention(dev, q, bases, positions, C, layer, L, KVH, deep_from=0)
    for r, pos in enumerate(positions):
        want = per_group[r] if pos >= deep_from else per_head[r]
        np.testing.assert_array_equal(got[r], want, err_msg=f"row {r} at {pos}")
    q8, d8 = _q8(got.reshape(R, Q * D))
    np.testing.assert_array_equal(outq, q8)
    np.testing.assert_array_equal(outd, d8)
    assert not np.array_equal(per_head, per_group)  # the two paths sum in other orders


def rope_inputs(rng, R, Q, KVH, D, n_rot, theta):
    """Random q [R, Q, D], k and v [R, KVH, D], QK-norm weights [D] and inverse frequencies
    [n_rot / 2] for qk_rope_append."""
    q = rng.standard_normal((R, Q, D)).astype(np.float32)
    k = rng.standard_normal((R, KVH, D)).astype(np.float32)
    v = rng.standard_normal((R, KVH, D)).astype(np.float32)
    qn, kn = (rng.random(D) + 0.5).astype(np.float32), (rng.random(D) + 0.5).astype(np.float32)
    inv_freq = (1.0 / np.power(np.float32(theta),
                               np.arange(0, n_rot, 2, dtype=np.float32) / n_rot)
                ).astype(np.float32)
    return q, k, v, qn, kn, inv_freq


def rope_reference(x, norm_w, pos, inv_freq, eps):
    """QK-norm (when norm_w) + NEOX RoPE of one head [D] in float64: the first
    n_rot = 2 * len(inv_freq) dims rotate, the others pass (partial RoPE)."""
    x = x.astype(np.float64)
    if norm_w is not None:
        x = x / np.sqrt((x ** 2).mean() + eps) * norm_w
    half = len(inv_freq)
    x1, x2, rest = x[:half], x[half:2 * half], x[2 * half:]
    f = pos * inv_freq.astype(np.float64)
    c, s = np.cos(f), np.sin(f)
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s, rest])


@pytest.mark.parametrize("has_norm", (False, True))
def test_partial_rope_append(runtime, has_norm):
    """qk_rope_append with n_rot = D/4 (qwen3next: D 256, 64 rotated dims) into an fp16 KV: q
    and the K cells rotate their first n_rot dims, the others are only normed (without norm
    weights q keeps them bit for bit); V cells are v."""
    dev, rng = _Dev(runtime), np.random.default_rng()
    L, KVH, Q, D, C, layer, eps = 2, 2, 8, 256, 24, 1, 1e-6
    n_rot = D // 4
    positions = np.array([0, 5, 23], dtype=np.int32)
    R = len(positions)
    q, k, v, qn, kn, inv_freq = rope_inputs(rng, R, Q, KVH, D, n_rot, 10000000)
    kvs = [dev.empty(2 * L * 2 * KVH * C * D) for _ in range(R)]
    qp = dev.put(q)
    dev.launch("qk_rope_append", (R, Q + 2 * KVH), (32,), "PPPPPPfPPPiiiiii",
               [qp, dev.put(k), dev.put(v), dev.put(qn) if has_norm else 0,
                dev.put(kn) if has_norm else 0, dev.put(inv_freq), eps,
                dev.put(np.array(kvs, dtype=np.uint64)), dev.put(positions),
                dev.put(np.full(R, C, dtype=np.int32)), layer, L, Q, KVH, D, n_rot])
    got_q = dev.get(qp, (R, Q, D), np.float32)
    if not has_norm:
        np.testing.assert_array_equal(got_q[..., n_rot:], q[..., n_rot:])
    for r, pos in enumerate(positions):
        for h in range(Q):
            want = rope_reference(q[r, h], qn if has_norm else None, pos, inv_freq, eps)
            np.testing.assert_allclose(got_q[r, h], want, rtol=1e-4, atol=1e-4)
        cells = dev.get(kvs[r], (L, 2, KVH, C, D), np.float16)
        for j in range(KVH):
            want = rope_reference(k[r, j], kn if has_norm else None, pos, inv_freq, eps)
            np.testing.assert_allclose(cells[layer, 0, j, pos], want, rtol=2e-3, atol=2e-3)
            np.testing.assert_array_equal(cells[layer, 1, j, pos], v[r, j].astype(np.float16))


def test_rmsnorm_one_pass_and_fallback(runtime):
    dev, rng = _Dev(runtime), np.random.default_rng()
    for H in (64, 2048, 8224):  # one pass from registers (H <= 8192), and the loop beyond
        R = 3
        x = (rng.standard_normal((R + 1, H)) * 3).astype(np.float32)
        w = rng.standard_normal(H).astype(np.float32)
        rows = np.array([2, 0, 3], dtype=np.int32)  # gathered rows (the head's logit rows)
        out, q, d = dev.empty(4 * R * H), dev.empty(R * H), dev.empty(4 * R * H // 32)
        dev.launch("rmsnorm_q8", (R,), (256,), "PPfiPPPP",
                   [dev.put(x), dev.put(w), 1e-6, H, dev.put(rows), out, q, d])
        got = dev.get(out, (R, H), np.float32)
        xr = x[rows].astype(np.float64)
        want = xr / np.sqrt((xr ** 2).mean(axis=1, keepdims=True) + 1e-6) * w
        assert np.abs(got - want).max() / np.abs(want).max() < 1e-5
        q8, d8 = _q8(got)
        np.testing.assert_array_equal(dev.get(q, (R, H), np.int8), q8)
        np.testing.assert_array_equal(dev.get(d, (R, H // 32), np.float32), d8)


@pytest.mark.parametrize("has_shared", (False, True))
def test_combine_fused_with_next_norm(runtime, has_shared):
    dev, rng = _Dev(runtime), np.random.default_rng()
    R, K, H = 5, 8, 2048
    x = rng.standard_normal((R, H)).astype(np.float32)
    Y = rng.standard_normal((R * K, H)).astype(np.float32)  # [P, H] pair r*K + k
    wts = rng.random((R, K)).astype(np.float32)
    S = rng.standard_normal((R, H)).astype(np.float32)
    gate = rng.standard_normal(R).astype(np.float32)
    nw = rng.standard_normal(H).astype(np.float32)
    xp = dev.put(x)
    out, q, d = dev.empty(4 * R * H), dev.empty(R * H), dev.empty(4 * R * H // 32)
    dev.launch("combine_norm", (R,), (256,), "PPPiiPPPfPPP",
               [xp, dev.put(Y), dev.put(wts), K, H, dev.put(S) if has_shared else 0,
                dev.put(gate) if has_shared else 0, dev.put(nw), 1e-6, out, q, d])
    want_x = x + np.einsum("rk,rkh->rh", wts.astype(np.float64),
                           Y.reshape(R, K, H).astype(np.float64))
    if has_shared:
        want_x += (1 / (1 + np.exp(-gate.astype(np.float64))))[:, None] * S
    got_x = dev.get(xp, (R, H), np.float32)
    assert np.abs(got_x - want_x).max() / np.abs(want_x).max() < 1e-5
    got = dev.get(out, (R, H), np.float32)
    xr = got_x.astype(np.float64)  # the norm of the x the kernel wrote
    want = xr / np.sqrt((xr ** 2).mean(axis=1, keepdims=True) + 1e-6) * nw
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-5
    q8, d8 = _q8(got)
    np.testing.assert_array_equal(dev.get(q, (R, H), np.int8), q8)
    np.testing.assert_array_equal(dev.get(d, (R, H // 32), np.float32), d8)


def grouped_reference(ids: np.ndarray, E: int):
    """(groups [G, 3], act_rows, out_rows) of pairs ids [R, K], as group_pairs defines them."""
    flat = ids.reshape(-1)
    order = np.argsort(flat, kind="stable")
    groups, at = [], 0
    for e in range(E):
        n = int((flat == e).sum())
        if n:
            groups.append((e, at, n))
            at += n
    return np.array(groups, dtype=np.int32), (order // ids.shape[1]).astype(np.int32), \
        order.astype(np.int32)


@pytest.mark.parametrize("weight_type", ("f32", "f16", "bf16"))
@pytest.mark.parametrize("num_rows", (1, 11))
def test_router_in_one_launch(runtime, weight_type, num_rows):
    """Logits against float64, top-k and grouping exact (from the kernel's own logits), two
    launches (the last-block counters reset) equal bit for bit."""
    dev, rng = _Dev(runtime), np.random.default_rng()
    E, K, H, R = 60, 4, 512, num_rows
    raw, dense = _weights(weight_type, E, H, rng)
    x = rng.standard_normal((R, H)).astype(np.float32)
    names = ("logits", "ids", "wts", "groups", "num_groups", "act_rows", "out_rows")
    sizes = (4 * R * E, 4 * R * K, 4 * R * K, 12 * E, 4, 4 * R * K, 4 * R * K)
    bufs = {n: dev.empty(b) for n, b in zip(names, sizes)}
    counts = dev.empty(4 * (2 + (R + 7) // 8), fill=0)
    args = [dev.put(raw), raw.shape[1], E, H, dev.put(x), R, K, 1, *bufs.values(), counts]
    outs = []
    for _ in range(2):
        dev.launch(f"router_{weight_type}", ((E + 3) // 4, (R + 7) // 8), (128,),
                   "PqiiPiiiPPPPPPPP", args, shared_bytes=4 * 4 * E + 4 * (2 * E + 1024))
        outs.append({n: dev.get(bufs[n], (s // 4,), np.float32 if n in ("logits", "wts")
                                else np.int32) for n, s in zip(names, sizes)})
    for n in names:
        np.testing.assert_array_equal(outs[0][n], outs[1][n])
    assert not dev.get(counts, (2 + (R + 7) // 8,), np.int32).any()
    got = outs[1]
    logits = got["logits"].reshape(R, E)
    want = x.astype(np.float64) @ dense.T
    assert np.abs(logits - want).max() / np.abs(want).max() < 1e-5
    p = np.exp(logits.astype(np.float64) - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    ids = np.argsort(-p, axis=1, kind="stable")[:, :K]
    np.testing.assert_array_equal(got["ids"].reshape(R, K), ids)
    top = np.take_along_axis(p, ids, axis=1)
    np.testing.assert_allclose(got["wts"].reshape(R, K), top / top.sum(axis=1, keepdims=True),
                               rtol=1e-5)
    groups, act_rows, out_rows = grouped_reference(ids, E)
    assert got["num_groups"][0] == len(groups)
    np.testing.assert_array_equal(got["groups"][:3 * len(groups)].reshape(-1, 3), groups)
    np.testing.assert_array_equal(got["act_rows"], act_rows)
    np.testing.assert_array_equal(got["out_rows"], out_rows)


def test_group_pairs_over_several_chunks(runtime):
    """More pairs than one shared-memory chunk (1024), skewed experts: exact grouping."""
    dev, rng = _Dev(runtime), np.random.default_rng()
    E, K, R = 128, 8, 400
    ids = np.minimum(rng.geometric(0.05, size=(R, K)) - 1, E - 1).astype(np.int32)
    P = R * K
    groups, num_groups = dev.empty(12 * E), dev.empty(4)
    act_rows, out_rows = dev.empty(4 * P), dev.empty(4 * P)
    dev.launch("group_pairs", (1,), (256,), "PiiiPPPP",
               [dev.put(ids), P, K, E, groups, num_groups, act_rows, out_rows],
               shared_bytes=4 * (2 * E + 1024))
    want_groups, want_act, want_out = grouped_reference(ids, E)
    assert dev.get(num_groups, (1,), np.int32)[0] == len(want_groups)
    np.testing.assert_array_equal(dev.get(groups, (len(want_groups), 3), np.int32), want_groups)
    np.testing.assert_array_equal(dev.get(act_rows, (P,), np.int32), want_act)
    np.testing.assert_array_equal(dev.get(out_rows, (P,), np.int32), want_out)


@pytest.mark.parametrize("E, threads", [(128, 1024), (512, 512), (512, 256)])
def test_group_pairs_wide_at_any_block_size(runtime, E, threads):
    """group_pairs_wide groups exactly with fewer threads too (the plan's choice when
    [warps + 1, E] counts would not fit the shared memory: Qwen3-Next's 512 experts)."""
    dev, rng = _Dev(runtime), np.random.default_rng()
    K, R = 10, 512
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(R)]).astype(np.int32)
    P = R * K
    groups, num_groups = dev.empty(12 * E), dev.empty(4)
    act_rows, out_rows = dev.empty(4 * P), dev.empty(4 * P)
    dev.launch("group_pairs_wide", (1,), (threads,), "PiiiPPPP",
               [dev.put(ids), P, K, E, groups, num_groups, act_rows, out_rows],
               shared_bytes=4 * (threads // 32 + 1) * E)
    want_groups, want_act, want_out = grouped_reference(ids, E)
    assert dev.get(num_groups, (1,), np.int32)[0] == len(want_groups)
    np.testing.assert_array_equal(dev.get(groups, (len(want_groups), 3), np.int32), want_groups)
    np.testing.assert_array_equal(dev.get(act_rows, (P,), np.int32), want_act)
    np.testing.assert_array_equal(dev.get(out_rows, (P,), np.int32), want_out)


@pytest.mark.parametrize("H", (64, 2048, 66))
def test_gate_logit_rows(runtime, H):
    dev, rng = _Dev(runtime), np.random.default_rng()
    R = 7
    x = rng.standard_normal((R, H)).astype(np.float32)
    w = rng.standard_normal(H).astype(np.float32)
    out = dev.empty(4 * R)
    dev.launch("gate_logit_rows", ((R + 3) // 4,), (128,), "PPiiP",
               [dev.put(x), dev.put(w), R, H, out])
    want = x.astype(np.float64) @ w.astype(np.float64)
    np.testing.assert_allclose(dev.get(out, (R,), np.float32), want, rtol=1e-5,
                               atol=1e-5 * np.abs(want).max())


def _mv_blocks(num_outputs: int, num_cols: int) -> int:
    from strata.backends.cuda.plan import MV_WARPS, mv_outputs_per_warp

    outputs = MV_WARPS * mv_outputs_per_warp(num_cols)
    return (num_outputs + outputs - 1) // outputs


@pytest.mark.parametrize("weight_type, num_cols",
                         [(t, k) for t in ("q4_0", "q8_0") for k in (64, 512, 2048, 5120)]
                         + [(t, k) for t in K_TYPES for k in (256, 768, 2048, 5120)]
                         + [(t, k) for t in B32_TYPES for k in (32, 96, 512, 1408, 5120)]
                         + [(t, k) for t in IQ_TYPES for k in (256, 768, 5120)])
def test_decode_products_mv(runtime, weight_type, num_cols):
    """matvec.cu's mv_* (decode windows) against float64: dense store + bias (weights also at
    a 2-byte offset), add, q/k/v, grouped gate/up and grouped store through pointer tables with
    rows gathered and scattered. K covers 8, 16 and 32 lanes per output and rows staged in
    several rounds (k-quants: super-blocks of 256 columns; Q6_K's 210-byte ones start at every
    even offset; Q4_1 / Q5_0 / Q5_1 / IQ4_NL at K = 1408, Qwen1.5-MoE's expert down, 44 blocks);
    every row equals the same row computed alone, bit for bit."""
    dev, rng = _Dev(runtime), np.random.default_rng()
    E, N, K, T, Nkv = 3, 45, num_cols, 11, 18  # N not a multiple of a block's outputs
    raws, dense = zip(*[_weights(weight_type, N, K, rng) for _ in range(2 * E)])
    gate_raw, up_raw = np.stack(raws[:E]), np.stack(raws[E:])  # [E, N, row_bytes]
    row_bytes = gate_raw.shape[-1]
    x = rng.standard_normal((T, K)).astype(np.float32)
    xr = _acts(x, weight_type)  # [T, K] what the kernel multiplies, float64
    q, d = _q8(x)
    xq, xd = dev.put(q), dev.put(d)
    fmt, name, bx = "PPPPqiiPPPPPPPPPiPP", weight_type, _mv_blocks(N, K)
    dense_groups = dev.put(np.array([0, 0, T, 1], dtype=np.int32))

    def rel_err(got, want):
        return np.linalg.norm(got - want) / np.linalg.norm(want)

    bias = rng.standard_normal(N).astype(np.float32)
    y = dev.empty(4 * T * N)
    dev.launch(f"mv_store_{name}", (bx, 1), (128,), fmt,
               [dev.put(gate_raw[0]), 0, 0, 0, row_bytes, N, K, 0, xq, xd, dense_groups,
                dense_groups + 12, 0, 0, dev.put(bias), y, N, 0, 0])
    stored = dev.get(y, (T, N), np.float32)
    assert rel_err(stored, xr @ dense[0].T + bias) < 1e-5
    shifted = dev.put(np.concatenate([np.zeros(2, np.uint8), gate_raw[0].reshape(-1)])) + 2
    y_shifted = dev.empty(4 * T * N)
    dev.launch(f"mv_store_{name}", (bx, 1), (128,), fmt,
               [shifted, 0, 0, 0, row_bytes, N, K, 0, xq, xd, dense_groups,
                dense_groups + 12, 0, 0, dev.put(bias), y_shifted, N, 0, 0])
    np.testing.assert_array_equal(dev.get(y_shifted, (T, N), np.float32), stored)
    for r in (0, 5, T - 1):  # a row alone: the same bits as inside the window
        one = dev.put(np.array([0, 0, 1, 1], dtype=np.int32))
        y_one = dev.empty(4 * N)
        dev.launch(f"mv_store_{name}", (bx, 1), (128,), fmt,
                   [dev.put(gate_raw[0]), 0, 0, 0, row_bytes, N, K, 0, dev.put(q[r:r + 1]),
                    dev.put(d[r:r + 1]), one, one + 12, 0, 0, dev.put(bias), y_one, N, 0, 0])
        np.testing.assert_array_equal(dev.get(y_one, (N,), np.float32), stored[r])

    dev.launch(f"mv_add_{name}", (bx, 1), (128,), fmt,
               [dev.put(gate_raw[1]), 0, 0, 0, row_bytes, N, K, 0, xq, xd, dense_groups,
                dense_groups + 12, 0, 0, 0, y, N, 0, 0])
    assert rel_err(dev.get(y, (T, N), np.float32),
                   xr @ dense[0].T + bias + xr @ dense[1].T) < 1e-5

    outs = [dev.empty(4 * T * n) for n in (N, Nkv, Nkv)]
    biases = [rng.standard_normal(n).astype(np.float32) for n in (N, Nkv, Nkv)]
    dev.launch(f"mv_qkv_{name}", (bx + 2 * _mv_blocks(Nkv, K), 1), (128,),
               "PPPqiiiPPPPPPPPPPP",
               [dev.put(gate_raw[0]), dev.put(gate_raw[1][:Nkv]), dev.put(gate_raw[2][:Nkv]),
                row_bytes, N, Nkv, K, 0, xq, xd, dense_groups, dense_groups + 12,
                *[dev.put(b) for b in biases], *outs])
    for i, (out_ptr, n) in enumerate(zip(outs, (N, Nkv, Nkv))):
        assert rel_err(dev.get(out_ptr, (T, n), np.float32),
                       xr @ dense[i][:n].T + biases[i]) < 1e-5

    # grouped: pairs sorted by expert, rows gathered by act_rows, each expert through a
    # pointer table (separate allocations, as an offload tier has them)
    experts = rng.integers(0, E, size=T)
    order = np.argsort(experts, kind="stable")
    groups = []
    for e in range(E):
        members = np.flatnonzero(experts[order] == e)
        if len(members):
            groups += [e, int(members[0]), len(members)]
    num_groups = len(groups) // 3
    g = dev.put(np.array(groups + [num_groups, -1, 0], dtype=np.int32))
    tables = [dev.put(np.array([dev.put(m[e]) for e in range(E)], dtype=np.uint64))
              for m in (gate_raw, up_raw)]
    act_rows = dev.put(order.astype(np.int32))
    out = dev.empty(4 * T * N)
    dev.launch(f"mv_gateup_{name}", (bx, E), (128,), fmt,
               [0, 0, tables[0], tables[1], row_bytes, N, K, 0, xq, xd,
                g, g + 12 * num_groups, act_rows, 0, 0, out, N, 0, 0])
    want = np.empty((T, N))
    for j, r in enumerate(order):
        gv = xr[r] @ dense[experts[r]].T
        uv = xr[r] @ dense[E + experts[r]].T
        want[j] = gv / (1 + np.exp(-gv)) * uv
    assert rel_err(dev.get(out, (T, N), np.float32), want) < 1e-5

    scatter = rng.permutation(T).astype(np.int32)  # pair j's output row
    out = dev.empty(4 * T * N)
    dev.launch(f"mv_store_{name}", (bx, E), (128,), fmt,
               [0, 0, tables[1], 0, row_bytes, N, K, 0, xq, xd, g, g + 12 * num_groups,
                act_rows, dev.put(scatter), 0, out, N, 0, 0])
    want = np.empty((T, N))
    for j, r in enumerate(order):
        want[scatter[j]] = xr[r] @ dense[E + experts[r]].T
    assert rel_err(dev.get(out, (T, N), np.float32), want) < 1e-5

    # the expert a decode layer splits with the CPU pool (num_groups [G, expert, cut]): gate/up
    # leaves its rows below the cut alone, store sums only its columns from the cut on (whole
    # staged units: 32 columns, 256 for the k-quants and grid i-quants); the other experts whole
    split_e, unit = int(experts[order[0]]), 256 if weight_type in K_TYPES + IQ_TYPES else 32
    mine = experts[order] == split_e  # [T] the split expert's pairs, in grouped order
    gs = dev.put(np.array(groups + [num_groups, split_e, 32], dtype=np.int32))
    out = dev.put(np.full((T, N), 7.0, np.float32))
    dev.launch(f"mv_gateup_{name}", (bx, E), (128,), fmt,
               [0, 0, tables[0], tables[1], row_bytes, N, K, 0, xq, xd,
                gs, gs + 12 * num_groups, act_rows, 0, 0, out, N, 0, 0])
    got = dev.get(out, (T, N), np.float32)
    want_gu = np.empty((T, N))
    for j, r in enumerate(order):
        gv, uv = xr[r] @ dense[experts[r]].T, xr[r] @ dense[E + experts[r]].T
        want_gu[j] = gv / (1 + np.exp(-gv)) * uv
    assert np.all(got[mine, :32] == 7.0)  # the pool's rows: not written
    assert rel_err(got[mine, 32:], want_gu[mine, 32:]) < 1e-5
    assert rel_err(got[~mine], want_gu[~mine]) < 1e-5
    if K // unit >= 2:
        cut = unit * (K // unit // 2)
        gs = dev.put(np.array(groups + [num_groups, split_e, cut], dtype=np.int32))
        out = dev.empty(4 * T * N)
        dev.launch(f"mv_store_{name}", (bx, E), (128,), fmt,
                   [0, 0, tables[1], 0, row_bytes, N, K, 0, xq, xd, gs, gs + 12 * num_groups,
                    act_rows, dev.put(scatter), 0, out, N, 0, 0])
        for j, r in enumerate(order):
            if mine[j]:
                want[scatter[j]] = xr[r, cut:] @ dense[E + split_e][:, cut:].T
        assert rel_err(dev.get(out, (T, N), np.float32), want) < 1e-5
