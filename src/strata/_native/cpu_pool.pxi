# The CPU pool's window: beside the GPU's pass, compute the routed pairs whose expert the where
# table assigns to the CPU, layer by layer, through the exchange buffer (strata/backends/cuda/
# exchange.py has the protocol). Included by kernels.pyx (one module, one thread setting).
# Legend: L = layers, R = rows of the window, K = experts per row, H = hidden, E = experts,
# F = expert width.

cdef extern from "pool_window.h" nogil:
    int st_pool_serve(int64_t *ctl, const int64_t *ready, int64_t *done, const float *x,
                      const int32_t *ids, const float *wts, float *y, const int32_t *split,
                      int64_t max_rows, const uint8_t *where, const uint64_t *pointers,
                      const int32_t *types, const int64_t *row_bytes, int L, int H, int K,
                      int E, int F, int64_t timeout_ns)
    void st_pool_post(int64_t *ctl, int64_t seq, int64_t num_rows)
    int st_pool_wait_served(const int64_t *ctl, int64_t seq, int64_t timeout_ns)
    enum:
        ST_POOL_OK "POOL_OK"
        ST_POOL_TIMEOUT "POOL_TIMEOUT"
        ST_POOL_ABORTED "POOL_ABORTED"
        ST_POOL_NO_MEMORY "POOL_NO_MEMORY"
        ST_CTL_SEQ "POOL_CTL_SEQ"
        ST_CTL_ROWS "POOL_CTL_ROWS"
        ST_CTL_POSTED_NS "POOL_CTL_POSTED_NS"
        ST_CTL_STOP "POOL_CTL_STOP"
        ST_CTL_SERVED "POOL_CTL_SERVED"
        ST_CTL_STATUS "POOL_CTL_STATUS"
        ST_CTL_LAYER "POOL_CTL_LAYER"
        ST_CTL_ENTRIES "POOL_CTL_ENTRIES"
        ST_CTL_EXPERTS "POOL_CTL_EXPERTS"
        ST_CTL_WAIT_NS "POOL_CTL_WAIT_NS"
        ST_CTL_COMPUTE_NS "POOL_CTL_COMPUTE_NS"
        ST_CTL_START_NS "POOL_CTL_START_NS"
        ST_CTL_END_NS "POOL_CTL_END_NS"
        ST_CTL_EXITED "POOL_CTL_EXITED"
        ST_CTL_WORDS "POOL_CTL_WORDS"

cdef extern from "moe_call.h" nogil:
    int64_t st_moe_reserve(int64_t T, int H, int F, int E, int K,
                           const uint8_t *const *gate_ptrs, int gate_type, int64_t gate_row_bytes,
                           const uint8_t *const *up_ptrs, int up_type, int64_t up_row_bytes,
                           const uint8_t *const *down_ptrs, int down_type,
                           int64_t down_row_bytes)


cdef enum:
    ST_WHERE_CPU = 2                # the where table's code for "the CPU pool computes it"

POOL_OK, POOL_TIMEOUT, POOL_ABORTED, POOL_NO_MEMORY = (ST_POOL_OK, ST_POOL_TIMEOUT,
                                                       ST_POOL_ABORTED, ST_POOL_NO_MEMORY)
POOL_CTL_WORDS = ST_CTL_WORDS
POOL_CTL_SEQ, POOL_CTL_ROWS, POOL_CTL_STOP, POOL_CTL_SERVED, POOL_CTL_EXITED = (
    ST_CTL_SEQ, ST_CTL_ROWS, ST_CTL_STOP, ST_CTL_SERVED, ST_CTL_EXITED)
# CLOCK_MONOTONIC ns (time.monotonic_ns): the last post, and when the pool saw / finished it
POOL_CTL_POSTED_NS, POOL_CTL_START_NS, POOL_CTL_END_NS = (
    ST_CTL_POSTED_NS, ST_CTL_START_NS, ST_CTL_END_NS)


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


def pool_reserve(int64_t rows, int H, int F, int K, pointers, types, row_bytes_table):
    """Fault in the work buffers the pool's calls of up to `rows` rows take (moe.c's
    st_moe_reserve, at layer 0's types; nothing is computed, no weight read): the bytes kept
    for those calls, 0 when they are too big to keep. pointers uint64 [L, 3, E], types int32
    [L, 3], row_bytes_table = pool_row_bytes(types, H, F). MemoryError when they cannot be
    allocated."""
    _check_array("pointers", pointers, np.uint64, 3)
    _check_array("types", types, np.int32, 2)
    _check_array("row_bytes_table", row_bytes_table, np.int64, 2)
    if pointers.shape[0] < 1 or pointers.shape[1] != 3 or types.shape[0] != pointers.shape[0] \
            or types.shape[1] != 3 or row_bytes_table.shape != types.shape:
        raise ValueError(f"pointers must be [L, 3, E] with L >= 1, types and row_bytes_table "
                         f"[L, 3]; got {pointers.shape}, {types.shape}, {row_bytes_table.shape}")
    cdef int E = pointers.shape[2]
    cdef const uint64_t[:, ::1] pv = pointers[0]                      # [3, E]
    cdef int gt = types[0, 0], ut = types[0, 1], dt = types[0, 2]
    cdef int64_t gb = row_bytes_table[0, 0], ub = row_bytes_table[0, 1]
    cdef int64_t db = row_bytes_table[0, 2]
    cdef int64_t kept
    with nogil:
        kept = st_moe_reserve(rows, H, F, E, K, <const uint8_t *const *>&pv[0, 0], gt, gb,
                              <const uint8_t *const *>&pv[1, 0], ut, ub,
                              <const uint8_t *const *>&pv[2, 0], dt, db)
    if kept < 0:
        raise MemoryError(f"the CPU pool's work buffers for {rows} rows could not be allocated")
    return kept


def pool_check_where(where, pointers):
    """ValueError unless every expert the where table [L, E] gives the CPU has its three
    matrices in pointers [L, 3, E] (no null address)."""
    _check_array("where", where, np.uint8, 2)
    _check_array("pointers", pointers, np.uint64, 3)
    if pointers.shape[1] != 3 or where.shape != (pointers.shape[0], pointers.shape[2]):
        raise ValueError(f"pointers must be [L, 3, E] and where [L, E]; got {pointers.shape}, "
                         f"{where.shape}")
    if (pointers.transpose(1, 0, 2)[:, where == ST_WHERE_CPU] == 0).any():     # [3, n]
        raise ValueError("pointers holds a null address for an expert the where table gives "
                         "the CPU; every CPU-assigned expert needs its three matrices in RAM")


def pool_serve(ctl, ready, done, x, ids, wts, y, split, where, pointers, types,
               row_bytes_table, int F, double timeout_s):
    """Serve the CPU pool's windows until ctl[POOL_CTL_STOP] != 0 (run it on a thread of its
    own; it holds no GIL). A window is posted by pool_post(ctl, seq, rows) and served layer by
    layer: wait for ready[l] == seq (up to timeout_s), y[:R] = the weighted sum of each row's
    pairs whose expert has where[l, e] == 2 (each distinct expert once over all its rows; rows
    without one get zeros), then done[l] = seq (release); pool_wait_served gives its stats.
    ctl int64 [POOL_CTL_WORDS]; ready/done int64 [L]; x/y float32 [R_max, H]; ids int32 / wts
    float32 [R_max, K]; split int32 [2] (e, c): the layer's expert e split with the device, of
    which the pool computes gate/up rows and down columns [0, c) (0 < c < F, whole blocks of
    the down's type; else none); where uint8 [L, E] (read during each window: change it between windows
    only; pool_check_where first); pointers uint64 [L, 3, E] (gate, up, down of every expert in
    host RAM); types int32 [L, 3] and row_bytes_table = pool_row_bytes(types, H, F). Sets
    ctl[POOL_CTL_EXITED] when it returns; MemoryError when its buffers cannot be allocated."""
    _check_array("ctl", ctl, np.int64, 1, writable=True)
    _check_array("ready", ready, np.int64, 1)
    _check_array("done", done, np.int64, 1, writable=True)
    _check_array("x", x, np.float32, 2)
    _check_array("ids", ids, np.int32, 2)
    _check_array("wts", wts, np.float32, 2)
    _check_array("y", y, np.float32, 2, writable=True)
    _check_array("split", split, np.int32, 1)
    if split.shape[0] != 2:
        raise ValueError(f"split must hold 2 int32 (expert, columns), got {split.shape}")
    _check_array("where", where, np.uint8, 2)
    _check_array("pointers", pointers, np.uint64, 3)
    _check_array("types", types, np.int32, 2)
    if ctl.shape[0] != ST_CTL_WORDS:
        raise ValueError(f"ctl must hold POOL_CTL_WORDS = {ST_CTL_WORDS} int64, got {ctl.shape}")
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
    if F <= 0:
        raise ValueError(f"F (the expert width) must be positive, got {F}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s = {timeout_s} must be > 0")
    pool_check_where(where, pointers)
    _check_array("row_bytes_table", row_bytes_table, np.int64, 2)
    if row_bytes_table.shape != (L, 3) or (row_bytes_table <= 0).any():
        raise ValueError(f"row_bytes_table {row_bytes_table.shape} must be pool_row_bytes(types, "
                         f"H, F): [{L}, 3], every entry > 0")
    cdef const int64_t[::1] row_bytes_v = row_bytes_table.reshape(-1)   # [L * 3]

    cdef int64_t[::1] cv = ctl
    cdef const int64_t[::1] rv = ready
    cdef int64_t[::1] dv = done
    cdef const float[:, ::1] xv = x
    cdef const int32_t[:, ::1] iv = ids
    cdef const float[:, ::1] wv = wts
    cdef float[:, ::1] yv = y
    cdef const int32_t[::1] sv = split
    cdef const uint8_t[:, ::1] whv = where
    cdef const uint64_t[:, :, ::1] pv = pointers
    cdef const int32_t[:, ::1] tv = types
    cdef int64_t timeout_ns = <int64_t>(timeout_s * 1e9)
    cdef int rc
    with nogil:
        rc = st_pool_serve(&cv[0], &rv[0], &dv[0], &xv[0, 0], &iv[0, 0], &wv[0, 0], &yv[0, 0],
                           &sv[0], R_max, &whv[0, 0], &pv[0, 0, 0], &tv[0, 0], &row_bytes_v[0],
                           L, H, K, E, F, timeout_ns)
    if rc != 0:
        raise MemoryError("the CPU pool could not allocate its routing buffers")


def pool_post(ctl, int64_t seq, int64_t num_rows):
    """Post window `seq` (> every earlier one) of num_rows rows to pool_serve's loop."""
    _check_array("ctl", ctl, np.int64, 1, writable=True)
    if ctl.shape[0] != ST_CTL_WORDS:
        raise ValueError(f"ctl must hold POOL_CTL_WORDS = {ST_CTL_WORDS} int64, got {ctl.shape}")
    if seq <= ctl[ST_CTL_SEQ]:
        raise ValueError(f"seq = {seq} must be > the last posted window's "
                         f"({ctl[ST_CTL_SEQ]}); 0 marks a word never written")
    cdef int64_t[::1] cv = ctl
    st_pool_post(&cv[0], seq, num_rows)


def pool_wait_served(ctl, int64_t seq, double timeout_s):
    """Wait (no GIL) until pool_serve has served window seq: (status, layer, entries, experts,
    wait_ns, compute_ns, start_lag_ns, end_ns) with status POOL_OK or the code that stopped it
    at `layer` (then done[layer] = -seq); status POOL_TIMEOUT when it has not within timeout_s,
    POOL_ABORTED when the loop has exited (stats then all -1)."""
    _check_array("ctl", ctl, np.int64, 1)
    if ctl.shape[0] != ST_CTL_WORDS:
        raise ValueError(f"ctl must hold POOL_CTL_WORDS = {ST_CTL_WORDS} int64, got {ctl.shape}")
    cdef const int64_t[::1] cv = ctl
    cdef int64_t timeout_ns = <int64_t>(timeout_s * 1e9)
    cdef int rc
    with nogil:
        rc = st_pool_wait_served(&cv[0], seq, timeout_ns)
    if rc != ST_POOL_OK:
        return (rc, -1, -1, -1, -1, -1, -1, -1)
    return (int(cv[ST_CTL_STATUS]), int(cv[ST_CTL_LAYER]), cv[ST_CTL_ENTRIES],
            cv[ST_CTL_EXPERTS], cv[ST_CTL_WAIT_NS], cv[ST_CTL_COMPUTE_NS],
            cv[ST_CTL_START_NS] - cv[ST_CTL_POSTED_NS], cv[ST_CTL_END_NS])
