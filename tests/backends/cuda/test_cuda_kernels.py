"""CUDA kernels against float64 numpy references on fresh random inputs: the product kernels on
every GGUF type (dense, grouped by expert, gate/up + SiLU), activation quantisation and
attention over an fp16 KV cache."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from strata._native import kernels
from strata.tool.synth import random_blocks

from cuda_synth import TYPES

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
    fmt = "PPPPqiiPPPPPPPPPi"
    name = weight_type

    # dense: one group of all T rows, plus a bias
    bias = rng.standard_normal(N).astype(np.float32)
    y = dev.empty(4 * T * N)
    dense_groups = dev.put(np.array([0, 0, T, 1], dtype=np.int32))
    dev.launch(f"mm_store_{name}", ((N + 15) // 16, 1), (128,), fmt,
               [dev.put(gate_raw[0]), 0, 0, 0, row_bytes, N, K, xf, xq, xd, dense_groups,
                dense_groups + 12, 0, 0, dev.put(bias), y, N])
    want = xr @ dense[0].T + bias
    got = dev.get(y, (T, N), np.float32)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5

    # add mode accumulates into y
    dev.launch(f"mm_add_{name}", ((N + 15) // 16, 1), (128,), fmt,
               [dev.put(gate_raw[1]), 0, 0, 0, row_bytes, N, K, xf, xq, xd, dense_groups,
                dense_groups + 12, 0, 0, 0, y, N])
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
                g, g + 12 * num_groups, dev.put(order.astype(np.int32)), 0, 0, out, N])
    got = dev.get(out, (T, N), np.float32)
    want = np.empty((T, N))
    for j, r in enumerate(order):
        gv = xr[r] @ dense[experts[r]].T
        uv = xr[r] @ dense[E + experts[r]].T
        want[j] = gv / (1 + np.exp(-gv)) * uv
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5


def test_attention_over_fp16_cache(runtime):
    dev, rng = _Dev(runtime), np.random.default_rng()
    L, KVH, Q, D, C = 2, 2, 4, 64, 150
    layer, positions = 1, np.array([0, 7, 31, 32, 149], dtype=np.int32)
    R = len(positions)
    cache = (rng.standard_normal((R, L, 2, KVH, C, D)) * 2).astype(np.float16)
    bases = [dev.put(cache[r]) for r in range(R)]
    q = rng.standard_normal((R, Q, D)).astype(np.float32)
    out, outq, outd = dev.empty(4 * R * Q * D), dev.empty(R * Q * D), dev.empty(4 * R * Q * D // 32)
    scale = D ** -0.5
    dev.launch("attention", (R, Q), (128,), "PPPPPPPiiiif",
               [dev.put(q), out, outq, outd, dev.put(np.array(bases, dtype=np.uint64)),
                dev.put(positions), dev.put(np.full(R, C, dtype=np.int32)), layer, Q, KVH, D,
                scale])
    got = dev.get(out, (R, Q, D), np.float32)
    # the fused 8-bit form equals quantising the float output
    q8, d8 = _q8(got.reshape(R, Q * D))
    np.testing.assert_array_equal(dev.get(outq, (R, Q * D), np.int8), q8)
    np.testing.assert_array_equal(dev.get(outd, (R, Q * D // 32), np.float32), d8)
    for r, pos in enumerate(positions):
        for h in range(Q):
            keys = cache[r, layer, 0, h // (Q // KVH), :pos + 1].astype(np.float64)
            values = cache[r, layer, 1, h // (Q // KVH), :pos + 1].astype(np.float64)
            s = keys @ q[r, h].astype(np.float64) * scale
            p = np.exp(s - s.max())
            want = (p / p.sum()) @ values
            np.testing.assert_allclose(got[r, h], want, rtol=1e-4, atol=1e-5)
