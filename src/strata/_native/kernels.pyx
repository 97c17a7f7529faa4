# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""CPU kernels on GGUF weights: dequantise, matmul, the routed-expert block and rmsnorm.

Thin typed wrappers over the C in this folder; inputs are checked here, the GIL is released
for the compute. Weights are raw uint8 views of the GGUF bytes (read-only buffers are fine).
"""
import numpy as np

from libc.stdint cimport int8_t, int32_t, int64_t, uint8_t, uint64_t


cdef extern from "quant.h" nogil:
    int st_set_iq_grid(int qtype, const int8_t *values, int n, int width)
    int st_set_iq_ksigns(const uint8_t *signs)
    int st_is_supported(int qtype)
    int st_block_size(int qtype)
    int st_type_size(int qtype)
    const char *st_simd_level()
    void st_dequantize(int qtype, const uint8_t *src, float *dst, int64_t n_blocks)
    int st_matmul(int qtype, const uint8_t *w, int64_t rows, int64_t row_bytes, int cols,
                  const float *x, int64_t T, float *out)
    int st_moe_ffn(const float *x, int64_t T, int H, int F, int E, int K,
                   const uint8_t *gate, int gate_type, int64_t gate_row_bytes,
                   const uint8_t *up, int up_type, int64_t up_row_bytes,
                   const uint8_t *down, int down_type, int64_t down_row_bytes,
                   const int32_t *experts, const float *weights, float *out)
    int st_moe_ffn_ptrs(const float *x, int64_t T, int H, int F, int E, int K,
                        const uint8_t *const *gate_ptrs, int gate_type, int64_t gate_row_bytes,
                        const uint8_t *const *up_ptrs, int up_type, int64_t up_row_bytes,
                        const uint8_t *const *down_ptrs, int down_type, int64_t down_row_bytes,
                        const int32_t *experts, const float *weights, float *out,
                        int64_t *routed_rows, int allow_amx)
    int st_amx_available()
    int st_moe_amx_rows()
    void st_rmsnorm(const float *x, const float *w, float eps, int64_t T, int H, float *out)
    void st_set_num_threads(int n)
    int st_get_num_threads()


# ggml type ids (gguf.GGMLQuantizationType)
_TYPE_NAMES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0",
               10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 16: "IQ2_XXS",
               17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S",
               23: "IQ4_XS", 29: "IQ1_M", 30: "BF16"}


def _set_iq_tables():
    """Hand the i-quants' grids and sign patterns (gguf's, strata/model/iq_grids.py) to C."""
    from strata.model import iq_grids

    cdef const uint8_t[::1] signs = iq_grids.ksigns()
    cdef const int8_t[:, ::1] values
    if st_set_iq_ksigns(&signs[0]) != 0:
        raise RuntimeError("the i-quant sign table was refused")
    for qtype in iq_grids.GRID_TYPES:
        values = iq_grids.grid(int(qtype))
        if st_set_iq_grid(int(qtype), &values[0, 0], values.shape[0], values.shape[1]) != 0:
            raise RuntimeError(f"the {qtype.name} grid {values.shape} was refused")


_set_iq_tables()
SUPPORTED_TYPES = tuple(sorted(_TYPE_NAMES))


def _type_name(qtype):
    try:
        import gguf
        return gguf.GGMLQuantizationType(qtype).name
    except (ImportError, ValueError):
        return "unknown"


def _check_type(qtype, what="weight type"):
    if not isinstance(qtype, (int, np.integer)) or not st_is_supported(int(qtype)):
        supported = ", ".join(f"{_TYPE_NAMES[t]}={t}" for t in SUPPORTED_TYPES)
        raise ValueError(f"{what} {qtype!r} ({_type_name(qtype)}) is not supported by the CPU "
                         f"kernels; supported ggml type ids: {supported}")
    return int(qtype)


def _check_array(name, arr, dtype, ndim, writable=False):
    if not isinstance(arr, np.ndarray):
        raise ValueError(f"{name} must be a numpy array, got {type(arr).__name__}")
    if arr.dtype != dtype:
        raise ValueError(f"{name} must have dtype {np.dtype(dtype).name}, got {arr.dtype.name}")
    if arr.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {arr.shape}")
    if not arr.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous (use np.ascontiguousarray)")
    if writable and not arr.flags.writeable:
        raise ValueError(f"{name} must be writable")


def is_supported(qtype):
    """True when the kernels handle this ggml type id."""
    return isinstance(qtype, (int, np.integer)) and bool(st_is_supported(int(qtype)))


def row_bytes(qtype, cols):
    """Bytes of one row of `cols` elements of type `qtype`."""
    qtype = _check_type(qtype)
    cdef int block = st_block_size(qtype)
    if cols <= 0 or cols % block != 0:
        raise ValueError(f"a {_TYPE_NAMES[qtype]} row needs a positive multiple of {block} "
                         f"columns, got {cols}")
    return cols // block * st_type_size(qtype)


def simd_level():
    """The instruction set this build's kernels use: avx512, avx2, neon or scalar."""
    return st_simd_level().decode()


# More threads than any machine's cores: OpenMP segfaulted starting a team of 100,000 (the
# process's thread limit) and aborted at 2**31 - 1; more than the cores only adds switching.
MAX_THREADS = 1024


def set_num_threads(n):
    """Threads for the kernels (0: OpenMP's default, the number of cores; at most
    MAX_THREADS)."""
    if n < 0:
        raise ValueError(f"the number of threads must be >= 0, got {n}")
    if n > MAX_THREADS:
        raise ValueError(f"the kernels run at most {MAX_THREADS} threads, got {n}; give the "
                         f"number of cores or fewer")
    st_set_num_threads(int(n))


def get_num_threads():
    """Threads the kernels use."""
    return st_get_num_threads()


def dequantize(raw, qtype, n_elems):
    """float32[n_elems] from the raw bytes of n_elems elements of type qtype."""
    qtype = _check_type(qtype)
    if not isinstance(raw, np.ndarray) or raw.dtype != np.uint8 or not raw.flags.c_contiguous:
        raise ValueError("raw must be a C-contiguous numpy uint8 array of the tensor's bytes")
    num_bytes = row_bytes(qtype, n_elems)
    if raw.size != num_bytes:
        raise ValueError(f"{n_elems} {_TYPE_NAMES[qtype]} elements take {num_bytes} bytes, "
                         f"got {raw.size}")
    cdef const uint8_t[::1] src = raw.reshape(-1)
    out = np.empty(n_elems, dtype=np.float32)
    cdef float[::1] dst = out
    cdef int64_t n_blocks = n_elems // st_block_size(qtype)
    cdef int qt = qtype
    with nogil:
        st_dequantize(qt, &src[0], &dst[0], n_blocks)
    return out


def matmul(w, qtype, x, out=None):
    """out[T, rows] = x[T, cols] @ dequant(w).T for w a uint8[rows, row_bytes] weight."""
    qtype = _check_type(qtype)
    _check_array("w", w, np.uint8, 2)
    _check_array("x", x, np.float32, 2)
    cdef int64_t T = x.shape[0], rows = w.shape[0]
    cdef int cols = x.shape[1]
    expected = row_bytes(qtype, cols)
    if w.shape[1] != expected:
        raise ValueError(f"w rows hold {w.shape[1]} bytes but {cols} {_TYPE_NAMES[qtype]} "
                         f"columns (x.shape[1]) take {expected}: x and w do not match")
    if out is None:
        out = np.empty((T, rows), dtype=np.float32)
    else:
        _check_array("out", out, np.float32, 2, writable=True)
        if out.shape != (T, rows):
            raise ValueError(f"out must have shape {(T, rows)}, got {out.shape}")
    if T == 0 or rows == 0:
        return out
    cdef const uint8_t[:, ::1] wv = w
    cdef const float[:, ::1] xv = x
    cdef float[:, ::1] ov = out
    cdef int rc, qt = qtype
    with nogil:
        rc = st_matmul(qt, &wv[0, 0], rows, wv.shape[1], cols, &xv[0, 0], T, &ov[0, 0])
    if rc != 0:
        raise MemoryError("matmul could not allocate its work buffers")
    return out


def _has_routed_rows(x, experts, weights, out, int E):
    """Check the routing of a MoE call (experts and weights [T, K] for x [T, H], out [T, H],
    ids in [0, E) or -1); False when there is nothing to compute (no rows or no experts)."""
    T, H, K = x.shape[0], x.shape[1], experts.shape[1]
    if experts.shape[0] != T or weights.shape != experts.shape:
        raise ValueError(f"experts {experts.shape} and weights {weights.shape} must both be "
                         f"({T}, K) for x with {T} rows")
    if out.shape != (T, H):
        raise ValueError(f"out must have shape {(T, H)}, got {out.shape}")
    if T == 0 or K == 0:
        return False
    lo, hi = int(experts.min()), int(experts.max())
    if lo < -1 or hi >= E:
        bad = lo if lo < -1 else hi
        raise ValueError(f"expert id {bad} is out of range: ids must be in [0, {E}) or -1 "
                         f"(skip)")
    return True


def moe_ffn(x, gate, gate_type, up, up_type, down, down_type, experts, weights, out):
    """out[t] += sum_k weights[t, k] * down_e @ (silu(gate_e @ x[t]) * (up_e @ x[t])),
    e = experts[t, k]; ids of -1 are skipped. Each distinct expert runs once on its rows."""
    gate_type = _check_type(gate_type, "gate_type")
    up_type = _check_type(up_type, "up_type")
    down_type = _check_type(down_type, "down_type")
    _check_array("x", x, np.float32, 2)
    _check_array("gate", gate, np.uint8, 3)
    _check_array("up", up, np.uint8, 3)
    _check_array("down", down, np.uint8, 3)
    _check_array("experts", experts, np.int32, 2)
    _check_array("weights", weights, np.float32, 2)
    _check_array("out", out, np.float32, 2, writable=True)
    cdef int64_t T = x.shape[0]
    cdef int H = x.shape[1], E = gate.shape[0], F = gate.shape[1], K = experts.shape[1]
    if up.shape[:2] != (E, F):
        raise ValueError(f"up has {up.shape[:2]} (experts, rows) but gate has {(E, F)}")
    if down.shape[:2] != (E, H):
        raise ValueError(f"down has {down.shape[:2]} (experts, rows); expected {(E, H)} "
                         f"from gate's experts and x's hidden size")
    for name, arr, qt, cols in (("gate", gate, gate_type, H), ("up", up, up_type, H),
                                ("down", down, down_type, F)):
        expected = row_bytes(qt, cols)
        if arr.shape[2] != expected:
            raise ValueError(f"{name} rows hold {arr.shape[2]} bytes but {cols} "
                             f"{_TYPE_NAMES[qt]} columns take {expected}")
    if not _has_routed_rows(x, experts, weights, out, E):
        return
    cdef const float[:, ::1] xv = x
    cdef const uint8_t[:, :, ::1] gv = gate
    cdef const uint8_t[:, :, ::1] uv = up
    cdef const uint8_t[:, :, ::1] dv = down
    cdef const int32_t[:, ::1] ev = experts
    cdef const float[:, ::1] wv = weights
    cdef float[:, ::1] ov = out
    cdef int gt = gate_type, ut = up_type, dt = down_type, rc
    cdef int64_t gb = gate.shape[2], ub = up.shape[2], db = down.shape[2]
    with nogil:
        rc = st_moe_ffn(&xv[0, 0], T, H, F, E, K, &gv[0, 0, 0], gt, gb, &uv[0, 0, 0], ut, ub,
                        &dv[0, 0, 0], dt, db, &ev[0, 0], &wv[0, 0], &ov[0, 0])
    if rc != 0:
        raise MemoryError("moe_ffn could not allocate its work buffers")


def moe_ffn_ptrs(x, pointers, gate_type, up_type, down_type, F, experts, weights, out,
                 routed_rows=None, allow_amx=False):
    """moe_ffn with each expert's matrices given by address: `pointers` [3, E] uint64 holds the
    start of expert e's gate [F, H], up [F, H] and down [H, F] rows (row-major GGUF blocks).
    The caller keeps that memory alive and unchanged during the call. `routed_rows` (int64 [E],
    optional) gets the number of rows routed to each expert added to it. allow_amx: experts of
    amx_rows() or more rows take the AMX rows where the CPU has them (the CPU pool's calls; not
    bit-equal to the default path: amx_available)."""
    gate_type = _check_type(gate_type, "gate_type")
    up_type = _check_type(up_type, "up_type")
    down_type = _check_type(down_type, "down_type")
    _check_array("x", x, np.float32, 2)
    _check_array("pointers", pointers, np.uint64, 2)
    _check_array("experts", experts, np.int32, 2)
    _check_array("weights", weights, np.float32, 2)
    _check_array("out", out, np.float32, 2, writable=True)
    cdef int64_t T = x.shape[0]
    cdef int H = x.shape[1], E = pointers.shape[1], K = experts.shape[1], Fc = F
    if pointers.shape[0] != 3:
        raise ValueError(f"pointers must be [3, E] (gate, up, down), got {pointers.shape}")
    if F <= 0:
        raise ValueError(f"F (the expert width) must be positive, got {F}")
    if routed_rows is not None:
        _check_array("routed_rows", routed_rows, np.int64, 1, writable=True)
        if routed_rows.shape[0] != E:
            raise ValueError(f"routed_rows has {routed_rows.shape[0]} entries for {E} experts")
    if not _has_routed_rows(x, experts, weights, out, E):
        return
    if (pointers == 0).any():
        raise ValueError("pointers holds a null address; every expert needs its three matrices")
    cdef const float[:, ::1] xv = x
    cdef const uint64_t[:, ::1] pv = pointers
    cdef const int32_t[:, ::1] ev = experts
    cdef const float[:, ::1] wv = weights
    cdef float[:, ::1] ov = out
    cdef int64_t[::1] cv
    cdef int64_t *counts = NULL
    if routed_rows is not None:
        cv = routed_rows
        counts = &cv[0]
    cdef int gt = gate_type, ut = up_type, dt = down_type, rc, amx = bool(allow_amx)
    cdef int64_t gb = row_bytes(gate_type, H), ub = row_bytes(up_type, H)
    cdef int64_t db = row_bytes(down_type, F)
    with nogil:
        rc = st_moe_ffn_ptrs(&xv[0, 0], T, H, Fc, E, K,
                             <const uint8_t *const *>&pv[0, 0], gt, gb,
                             <const uint8_t *const *>&pv[1, 0], ut, ub,
                             <const uint8_t *const *>&pv[2, 0], dt, db,
                             &ev[0, 0], &wv[0, 0], &ov[0, 0], counts, amx)
    if rc != 0:
        raise MemoryError("moe_ffn_ptrs could not allocate its work buffers")


def amx_available():
    """Does this CPU run the CPU pool's AMX-BF16 rows (amx.c: Sapphire Rapids and later Xeons,
    Linux >= 5.16, a GCC 12+ x86-64 build; STRATA_AMX=0 turns them off)?"""
    return bool(st_amx_available())


def amx_rows():
    """The fewest rows an expert of the CPU pool's call needs to take the AMX rows
    (STRATA_AMX_ROWS; 8)."""
    return st_moe_amx_rows()


def rmsnorm(x, w, eps, out=None):
    """out[t] = w * x[t] / sqrt(mean(x[t]^2) + eps), float32 like transformers' RMSNorm."""
    _check_array("x", x, np.float32, 2)
    _check_array("w", w, np.float32, 1)
    cdef int64_t T = x.shape[0]
    cdef int H = x.shape[1]
    if w.shape[0] != H:
        raise ValueError(f"w has {w.shape[0]} elements but x rows have {H}")
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    if out is None:
        out = np.empty((T, H), dtype=np.float32)
    else:
        _check_array("out", out, np.float32, 2, writable=True)
        if out.shape != (T, H):
            raise ValueError(f"out must have shape {(T, H)}, got {out.shape}")
    if T == 0 or H == 0:
        return out
    cdef const float[:, ::1] xv = x
    cdef const float[::1] wv = w
    cdef float[:, ::1] ov = out
    cdef float e = eps
    with nogil:
        st_rmsnorm(&xv[0, 0], &wv[0], e, T, H, &ov[0, 0])
    return out
include "delta_net_kernels.pxi"
include "window_loop.pxi"
include "window_kernels.pxi"
include "cpu_pool.pxi"
