# The CPU pool's window: beside the GPU's pass, compute the routed pairs whose expert the where
# table assigns to the CPU, layer by layer, through the exchange buffer (strata/backends/cuda/
# exchange.py has the protocol). Included by kernels.pyx (one module, one thread setting).
# Legend: L = layers, R = rows of the window, K = experts per row, H = hidden, E = experts,
# F = expert width.

cdef extern from "pool_window.h" nogil:
    int st_pool_run_window(const int64_t *ready, int64_t *done, const float *x,
                           const int32_t *ids, const float *wts, float *y, int64_t seq,
                           int64_t num_rows, const uint8_t *where, const uint64_t *pointers,
                           const int32_t *types, const int64_t *row_bytes, int L, int H, int K,
                           int E, int F, int64_t timeout_ns, const int64_t *abort_flag,
                           int64_t *stats)


cdef enum:
    # pool_run_window's status codes (pool_window.c)
    ST_POOL_OK = 0
    ST_POOL_TIMEOUT = 1
    ST_POOL_ABORTED = 2
    ST_POOL_NO_MEMORY = 3
    ST_WHERE_CPU = 2                # the where table's code for "the CPU pool computes it"

POOL_OK, POOL_TIMEOUT, POOL_ABORTED, POOL_NO_MEMORY = (ST_POOL_OK, ST_POOL_TIMEOUT,
                                                       ST_POOL_ABORTED, ST_POOL_NO_MEMORY)


def pool_row_bytes(types, int H, int F):
    """int64 [L, 3]: bytes of one row of each layer's gate / up ([F, H]) and down ([H, F])
    matrices for their ggml types [L, 3] (ValueError for a type the kernels do not read)."""
    _check_array("types", types, np.int32, 2)
    if types.shape[1] != 3:
        raise ValueError(f"types must be [L, 3] (gate, up, down), got {types.shape}")
    out = np.empty(types.shape, dtype=np.int64)
    for layer in range(types.shape[0]):
        for part in range(3):
            qt = _check_type(int(types[layer, part]), "expert type")
            out[layer, part] = row_bytes(qt, H if part < 2 else F)
    return out


def pool_run_window(ready, done, x, ids, wts, y, int64_t seq, int64_t num_rows, where,
                    pointers, types, row_bytes_table, int F, double timeout_s, abort_flag):
    """Serve one window's CPU-assigned pairs, layer by layer: wait for ready[l] == seq, y[:R] =
    the weighted sum of each row's pairs whose expert has where[l, e] == 2 (each distinct expert
    once over all its rows; rows without one get zeros), then done[l] = seq (release).
    ready/done int64 [L]; x/y float32 [R_max, H]; ids int32 / wts float32 [R_max, K]; where uint8
    [L, E]; pointers uint64 [L, 3, E] (gate, up, down of every expert in host RAM); types int32
    [L, 3] and row_bytes_table = pool_row_bytes(types, H, F); abort_flag int64 [1] (nonzero:
    stop waiting). Returns (status, layer, entries,
    experts, wait_ns, compute_ns): status POOL_OK or the code that stopped it at `layer` (on
    failure done[layer] = -seq, so the device can stop waiting)."""
    _check_array("ready", ready, np.int64, 1)
    _check_array("done", done, np.int64, 1, writable=True)
    _check_array("x", x, np.float32, 2)
    _check_array("ids", ids, np.int32, 2)
    _check_array("wts", wts, np.float32, 2)
    _check_array("y", y, np.float32, 2, writable=True)
    _check_array("where", where, np.uint8, 2)
    _check_array("pointers", pointers, np.uint64, 3)
    _check_array("types", types, np.int32, 2)
    _check_array("abort_flag", abort_flag, np.int64, 1)
    cdef int L = ready.shape[0], H = x.shape[1], K = ids.shape[1], E = pointers.shape[2]
    cdef int64_t R_max = x.shape[0]
    if done.shape[0] != L or where.shape[0] != L or pointers.shape[0] != L \
            or types.shape[0] != L:
        raise ValueError(f"ready {ready.shape}, done {done.shape}, where {where.shape}, pointers "
                         f"{pointers.shape} and types {types.shape} must all have {L} layers")
    if y.shape != x.shape or wts.shape != ids.shape or ids.shape[0] != R_max:
        raise ValueError(f"x {x.shape} / y {y.shape} must be [R_max, H] and ids {ids.shape} / "
                         f"wts {wts.shape} [R_max, K] with the same R_max")
    if pointers.shape[1] != 3 or where.shape[1] != E or types.shape[1] != 3:
        raise ValueError(f"pointers must be [L, 3, E], where [L, E] and types [L, 3]; got "
                         f"{pointers.shape}, {where.shape}, {types.shape}")
    if not 0 <= num_rows <= R_max:
        raise ValueError(f"num_rows = {num_rows} must be in [0, {R_max}] (the exchange's rows)")
    if seq <= 0:
        raise ValueError(f"seq = {seq} must be > 0 (0 marks a word never written)")
    if F <= 0:
        raise ValueError(f"F (the expert width) must be positive, got {F}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s = {timeout_s} must be > 0")
    if abort_flag.shape[0] < 1:
        raise ValueError("abort_flag must hold one int64")
    cpu_pointers = pointers.transpose(1, 0, 2)[:, where == ST_WHERE_CPU]    # [3, n]
    if (cpu_pointers == 0).any():
        raise ValueError("pointers holds a null address for an expert the where table gives "
                         "the CPU; every CPU-assigned expert needs its three matrices in RAM")
    _check_array("row_bytes_table", row_bytes_table, np.int64, 2)
    if row_bytes_table.shape != (L, 3) or (row_bytes_table <= 0).any():
        raise ValueError(f"row_bytes_table {row_bytes_table.shape} must be pool_row_bytes(types, "
                         f"H, F): [{L}, 3], every entry > 0")
    cdef const int64_t[::1] row_bytes_v = row_bytes_table.reshape(-1)   # [L * 3]

    cdef const int64_t[::1] rv = ready
    cdef int64_t[::1] dv = done
    cdef const float[:, ::1] xv = x
    cdef const int32_t[:, ::1] iv = ids
    cdef const float[:, ::1] wv = wts
    cdef float[:, ::1] yv = y
    cdef const uint8_t[:, ::1] whv = where
    cdef const uint64_t[:, :, ::1] pv = pointers
    cdef const int32_t[:, ::1] tv = types
    cdef const int64_t[::1] av = abort_flag
    cdef int64_t stats[6]
    cdef int64_t timeout_ns = <int64_t>(timeout_s * 1e9)
    cdef int rc
    with nogil:
        rc = st_pool_run_window(&rv[0], &dv[0], &xv[0, 0], &iv[0, 0], &wv[0, 0], &yv[0, 0], seq,
                                num_rows, &whv[0, 0], &pv[0, 0, 0], &tv[0, 0], &row_bytes_v[0],
                                L, H, K, E, F, timeout_ns, &av[0], stats)
    if rc != 0:
        raise MemoryError("the CPU pool could not allocate its routing buffers")
    return (int(stats[0]), int(stats[1]), stats[2], stats[3], stats[4], stats[5])
