# Qwen3-Next's gated delta net kernels (delta_net.h) one at a time, for tests and benchmarks
# (included by kernels.pyx). Legend: T = rows, C = conv channels, K = conv taps, Hk / Hv = key /
# value heads, Dk / Dv = key / value head dims. Each call runs the rows of one sequence.
from libc.stdint cimport uintptr_t


cdef extern from "delta_net.h" nogil:
    void st_conv_silu(const float *x, int64_t ldx, int64_t T, int C, int K, const float *w,
                      const float *state_in, float *state_out, float *y)
    void st_gated_delta(int64_t T, int Hk, int Hv, int Dk, int Dv, const float *q,
                        const float *k, const float *v, int64_t ld, const float *beta_logit,
                        const float *alpha, int64_t ld_ba, const float *A, const float *dt_bias,
                        float eps, const float *state_in, float *state_out, float *out)
    void st_gated_rmsnorm(float *x, int64_t T, int Hv, int Dv, const float *z, int64_t ldz,
                          const float *w, float eps)


cdef int64_t _row_stride(name, arr) except -1:
    """Row stride in floats of a float32 [T, n] array with contiguous rows (a column slice of a
    wider C-contiguous matrix is fine); 0 when T <= 1 (no stride is used)."""
    if not isinstance(arr, np.ndarray):
        raise ValueError(f"{name} must be a numpy array, got {type(arr).__name__}")
    if arr.dtype != np.float32:
        raise ValueError(f"{name} must have dtype float32, got {arr.dtype.name}")
    if arr.ndim != 2:
        raise ValueError(f"{name} must have 2 dimensions, got shape {arr.shape}")
    if arr.shape[0] > 0 and arr.shape[1] > 1 and arr.strides[1] != 4:
        raise ValueError(f"{name} must have contiguous rows (column stride 4 bytes, got "
                         f"{arr.strides[1]}); use np.ascontiguousarray")
    if arr.shape[0] <= 1:
        return 0
    if arr.strides[0] % 4 or arr.strides[0] < 4 * arr.shape[1]:
        raise ValueError(f"{name} rows must be whole float32 rows apart, in order and not "
                         f"overlapping (row stride {arr.strides[0]} bytes for {arr.shape[1]} "
                         f"values); use np.ascontiguousarray")
    return arr.strides[0] // 4


cdef tuple _one_row_stride(names, arrays, int64_t T):
    """(arrays, ld): [T, n] float32 arrays with contiguous rows as they are when they share
    one row stride of ld floats, else copies side by side in one matrix (the kernels take one
    stride for all of them)."""
    lds = [_row_stride(name, arr) for name, arr in zip(names, arrays)]
    for name, arr in zip(names, arrays):
        if arr.shape[0] != T:
            raise ValueError(f"{name} must have T = {T} rows (those of q), got {arr.shape[0]}")
    if all(ld == lds[0] for ld in lds):
        return arrays, lds[0]
    packed = np.concatenate(arrays, axis=1)
    ends = np.cumsum([arr.shape[1] for arr in arrays])
    return [packed[:, end - arr.shape[1]:end] for arr, end in zip(arrays, ends)], packed.shape[1]


cdef _check_state_out(state_in, state_out):
    """state_out for a kernel that carries state_in: None (update state_in in place), state_in
    itself, or a writable buffer of its shape that does not overlap it."""
    if state_out is None or state_out is state_in:
        _check_array("state_in", state_in, np.float32, state_in.ndim, writable=True)
        return state_in
    _check_array("state_out", state_out, np.float32, state_in.ndim, writable=True)
    if state_out.shape != state_in.shape:
        raise ValueError(f"state_out must have state_in's shape {state_in.shape}, "
                         f"got {state_out.shape}")
    if (state_out.ctypes.data != state_in.ctypes.data
            and np.shares_memory(state_in, state_out)):
        raise ValueError("state_out must be state_in itself or not overlap it")
    return state_out


cdef inline const float *_ptr(arr):
    return <const float *><uintptr_t>arr.ctypes.data


def conv_silu(x, w, state_in, state_out=None):
    """y [T, C] float32 = silu(causal depthwise conv) of x [T, C] (contiguous rows; a column
    slice of a wider matrix is fine) with taps w [C, K] (tap K-1 on the current row) after the
    previous rows state_in [K-1, C] (oldest first). state_in then holds the last K-1 input
    rows, or state_out does when given (state_in is then left unchanged)."""
    cdef int64_t ldx = _row_stride("x", x)
    _check_array("w", w, np.float32, 2)
    _check_array("state_in", state_in, np.float32, 2)
    cdef int64_t T = x.shape[0]
    cdef int C = x.shape[1], K = w.shape[1]
    if K < 1 or w.shape[0] != C:
        raise ValueError(f"w must have shape [C, K] = [{C}, K >= 1] for x of {C} channels, "
                         f"got {w.shape}")
    if state_in.shape != (K - 1, C):
        raise ValueError(f"state_in must have shape [K-1, C] = {(K - 1, C)}, got "
                         f"{state_in.shape}")
    state_out = _check_state_out(state_in, state_out)
    y = np.empty((T, C), dtype=np.float32)
    cdef const float *xp = _ptr(x)
    cdef const float *wp = _ptr(w)
    cdef const float *sp = _ptr(state_in)
    cdef float *so = <float *>_ptr(state_out)
    cdef float *yp = <float *>_ptr(y)
    if C:
        with nogil:
            st_conv_silu(xp, ldx, T, C, K, wp, sp, so, yp)
    return y


def gated_delta(q, k, v, beta_logit, alpha, A, dt_bias, state_in, state_out=None,
                float eps=1e-6):
    """out [T, Hv*Dv] float32 of the gated delta rule over T rows: q, k [T, Hk*Dk] and
    v [T, Hv*Dv] with contiguous rows (column slices of one matrix are read in place, other
    arrays are first packed into one), beta_logit and alpha [T, Hv] likewise, A [Hv]
    (negative: -exp(A_log)), dt_bias [Hv], the recurrent state state_in [Hv, Dk, Dv].
    state_in is updated in place, or state_out is written when given (state_in is then left
    unchanged)."""
    _row_stride("q", q)  # a float32 matrix before its rows are counted
    cdef int64_t T = q.shape[0]
    cdef int64_t ld, ld_ba
    (q, k, v), ld = _one_row_stride(("q", "k", "v"), (q, k, v), T)
    (beta_logit, alpha), ld_ba = _one_row_stride(("beta_logit", "alpha"), (beta_logit, alpha), T)
    _check_array("A", A, np.float32, 1)
    _check_array("dt_bias", dt_bias, np.float32, 1)
    _check_array("state_in", state_in, np.float32, 3)
    cdef int Hv = state_in.shape[0], Dk = state_in.shape[1], Dv = state_in.shape[2], Hk
    if Hv < 1 or Dk < 1 or Dv < 1:
        raise ValueError(f"state_in [Hv, Dk, Dv] must have no empty dimension, got "
                         f"{state_in.shape}")
    if q.shape[1] % Dk or not 0 < q.shape[1] // Dk <= Hv or Hv % (q.shape[1] // Dk):
        raise ValueError(f"q rows of {q.shape[1]} values must be Hk heads of Dk = {Dk} with "
                         f"Hv = {Hv} a multiple of Hk")
    Hk = q.shape[1] // Dk
    for name, arr, width in (("k", k, Hk * Dk), ("v", v, Hv * Dv),
                             ("beta_logit", beta_logit, Hv), ("alpha", alpha, Hv)):
        if arr.shape != (T, width):
            raise ValueError(f"{name} must have shape {(T, width)}, got {arr.shape}")
    for name, arr in (("A", A), ("dt_bias", dt_bias)):
        if arr.shape[0] != Hv:
            raise ValueError(f"{name} must have Hv = {Hv} values, got {arr.shape[0]}")
    state_out = _check_state_out(state_in, state_out)
    out = np.empty((T, Hv * Dv), dtype=np.float32)
    cdef const float *qp = _ptr(q)
    cdef const float *kp = _ptr(k)
    cdef const float *vp = _ptr(v)
    cdef const float *bp = _ptr(beta_logit)
    cdef const float *ap = _ptr(alpha)
    cdef const float *Ap = _ptr(A)
    cdef const float *dp = _ptr(dt_bias)
    cdef const float *sp = _ptr(state_in)
    cdef float *so = <float *>_ptr(state_out)
    cdef float *op = <float *>_ptr(out)
    with nogil:
        st_gated_delta(T, Hk, Hv, Dk, Dv, qp, kp, vp, ld, bp, ap, ld_ba, Ap, dp, eps, sp, so, op)
    return out


def gated_rmsnorm(x, z, w, float eps=1e-6):
    """x [T, Hv*Dv] float32 in place (and returned): each head's [Dv] vector becomes
    w * x / sqrt(mean(x^2) + eps) * silu(z), z [T, Hv*Dv] (contiguous rows), w [Dv]."""
    _check_array("x", x, np.float32, 2, writable=True)
    cdef int64_t ldz = _row_stride("z", z)
    _check_array("w", w, np.float32, 1)
    cdef int64_t T = x.shape[0]
    cdef int Dv = w.shape[0], Hv
    if Dv < 1 or x.shape[1] % Dv:
        raise ValueError(f"x rows of {x.shape[1]} values are not whole heads of w's Dv = {Dv}")
    Hv = x.shape[1] // Dv
    if z.shape != x.shape:
        raise ValueError(f"z must have x's shape {x.shape}, got {z.shape}")
    cdef float *xp = <float *>_ptr(x)
    cdef const float *zp = _ptr(z)
    cdef const float *wp = _ptr(w)
    if Hv:
        with nogil:
            st_gated_rmsnorm(xp, T, Hv, Dv, zp, ldz, wp, eps)
    return x
