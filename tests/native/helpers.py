"""Random GGUF weight bytes for the kernel tests, and the float64 references they are checked
with."""
from pathlib import Path

import gguf
import numpy as np

T = gguf.GGMLQuantizationType
IQ_GRID_TYPES = (T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ1_S, T.IQ1_M)
QUANT_TYPES = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.IQ4_NL, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K,
               T.Q6_K, T.IQ4_XS) + IQ_GRID_TYPES
FLOAT_TYPES = (T.F32, T.F16, T.BF16)
# the k-quants and (since session 100) the grid i-quants take activations with one scale per
# 256 columns (quant.h's ST_ACT_K), the other quantised types one per 32
K_TYPES = (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_XS) + IQ_GRID_TYPES
ALL_TYPES = FLOAT_TYPES + QUANT_TYPES

# Byte offsets of the fp16 scale fields in each block: random bytes there give NaN / Inf.
FP16_FIELDS = {T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,),
               T.IQ4_NL: (0,), T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2),
               T.Q5_K: (0, 2), T.Q6_K: (208,), T.IQ4_XS: (0,), T.IQ2_XXS: (0,), T.IQ2_XS: (0,),
               T.IQ2_S: (0,), T.IQ3_XXS: (0,), T.IQ3_S: (0,), T.IQ1_S: (0,), T.IQ1_M: ()}


def block_size(qtype):
    return gguf.GGML_QUANT_SIZES[qtype][0]


def random_weight(rng, qtype, rows, cols):
    """uint8[rows, row_bytes]: random blocks with scales d in [1e-3, 1e-1] (floats: N(0, 1))."""
    qtype = T(qtype)
    if qtype in FLOAT_TYPES:
        w = rng.standard_normal((rows, cols)).astype(np.float32)
        if qtype == T.F32:
            return w.view(np.uint8)
        if qtype == T.F16:
            return w.astype(np.float16).view(np.uint8)
        return gguf.quants.quantize(w, qtype)
    bs, ts = gguf.GGML_QUANT_SIZES[qtype]
    n_blocks = rows * cols // bs
    blocks = rng.integers(0, 256, size=(n_blocks, ts), dtype=np.uint8)
    for off in FP16_FIELDS[qtype]:
        d = rng.uniform(1e-3, 1e-1, size=n_blocks).astype(np.float16)
        blocks[:, off:off + 2] = d.view(np.uint8).reshape(n_blocks, 2)
    if qtype == T.IQ1_M:  # its fp16 d is the top nibbles of the four u16 scales at 48
        d = rng.uniform(1e-3, 1e-1, size=n_blocks).astype(np.float16).view(np.uint16)
        scales = blocks[:, 48:56].copy().view(np.uint16)
        for i in range(4):
            scales[:, i] = (scales[:, i] & 0x0FFF) | (((d >> (4 * i)) & 0xF) << 12)
        blocks[:, 48:56] = scales.view(np.uint8)
    return blocks.reshape(rows, cols // bs * ts)


def dequant64(w, qtype):
    """float64 [rows, cols] reference weights from gguf's numpy dequantiser."""
    return gguf.quants.dequantize(w, qtype).astype(np.float64)


def act_block(qtype):
    """columns per activation scale for weights of qtype"""
    return 256 if T(qtype) in K_TYPES else 32


def q8_error_bound(x, w64, qtype=T.Q8_0):
    """Bound on |kernel - x @ w.T| from quantising x to 8 bits per act_block(qtype) columns.

    Rounding x to q * dx moves each element by at most dx / 2, dx = max|x_block| / 127, so a dot
    product moves by at most sum_i |w_i| * dx_b(i) / 2. float32 arithmetic adds a relative
    ~1e-6 of sum |x_i w_i|; 1.01 and the second term cover that.
    """
    xt = x.astype(np.float64)
    T_, cols = xt.shape
    n = act_block(qtype)
    dx = np.abs(xt.reshape(T_, cols // n, n)).max(axis=2) / 127.0         # [T, cols/n]
    dx_cols = np.repeat(dx, n, axis=1)                                     # [T, cols]
    bound = 0.5 * dx_cols @ np.abs(w64).T                                  # [T, rows]
    return 1.01 * bound + 1e-5 * (np.abs(xt) @ np.abs(w64).T) + 1e-30


def float_error_bound(x, w64):
    """float32 accumulation: |error| <= n * eps32 * sum |x_i w_i| (n = terms per lane chain).

    The kernels split a dot product into <= 16 partial sums of cols/16 terms, then add them;
    eps32 = 6e-8, so a bound of (cols / 16 + 16) * 6e-8 * sum |x w| holds with margin.
    """
    xt = x.astype(np.float64)
    cols = xt.shape[1]
    return (cols / 16 + 16) * 6e-8 * (np.abs(xt) @ np.abs(w64).T) + 1e-30


def q8_roundtrip(x, qtype=T.Q8_0):
    """x as the kernels see it after 8-bit quantisation for weights of qtype, one scale per
    act_block(qtype) columns (same float32 steps as matmul.c)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    T_, cols = x.shape
    n = act_block(qtype)
    xb = x.reshape(T_, cols // n, n)
    d = (np.abs(xb).max(axis=2, keepdims=True) / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv_d = np.where(d > 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    q = np.rint(xb * inv_d)
    return (q.astype(np.float64) * d.astype(np.float64)).reshape(T_, cols)


def silu64(v):
    return v / (1.0 + np.exp(-np.clip(v, -700.0, 700.0)))


def cpu_flags():
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()
