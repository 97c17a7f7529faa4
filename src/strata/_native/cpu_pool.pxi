# The CPU pool's window: beside the GPU's pass, compute the routed pairs whose expert the where
# table assigns to the CPU, layer by layer, through the exchange buffer (strata/backends/cuda/
# exchange.py has the protocol). Included by kernels.pyx (one module, one thread setting).
# Legend: L = layers, R = rows of the window, K = experts per row, H = hidden, E = experts,
# F = expert width.

cdef extern from "pool_sync.h" nogil:
    int64_t st_load_acquire_i64(const int64_t *p)
    void st_store_release_i64(int64_t *p, int64_t value)
    void st_cpu_relax()
    int64_t st_now_ns()
    void st_sleep_ns(int64_t ns)


cdef enum:
    # pool_run_window's status codes
    ST_POOL_OK = 0
    ST_POOL_TIMEOUT = 1
    ST_POOL_ABORTED = 2
    ST_POOL_NO_MEMORY = 3
    ST_WHERE_CPU = 2                # the where table's code for "the CPU pool computes it"
    ST_SPIN_NS = 2000000            # 2 ms of pause instructions, then short sleeps
    ST_SLEEP_NS = 20000
    ST_CHECK_EVERY = 64             # spins between looks at the clock and the abort flag

POOL_OK, POOL_TIMEOUT, POOL_ABORTED, POOL_NO_MEMORY = (ST_POOL_OK, ST_POOL_TIMEOUT,
                                                       ST_POOL_ABORTED, ST_POOL_NO_MEMORY)


cdef int _wait_ready(const int64_t *ready, int64_t seq, int64_t deadline_ns,
                     const int64_t *abort_flag) noexcept nogil:
    """0 when ready == seq, ST_POOL_TIMEOUT past the deadline, ST_POOL_ABORTED when asked to
    stop. Spins (pause) for the first ST_SPIN_NS: the GPU's dense part between two layers takes
    less, and a sleep would add its wake-up latency to every layer; then sleeps in short steps."""
    cdef int64_t spins = 0, now, spin_until_ns = st_now_ns() + ST_SPIN_NS
    cdef int is_spinning = 1
    while st_load_acquire_i64(ready) != seq:
        spins += 1
        if spins % ST_CHECK_EVERY == 0:
            if st_load_acquire_i64(abort_flag) != 0:
                return ST_POOL_ABORTED
            now = st_now_ns()
            if now > deadline_ns:
                return ST_POOL_TIMEOUT
            is_spinning = now < spin_until_ns
        if is_spinning:
            st_cpu_relax()
        else:
            st_sleep_ns(ST_SLEEP_NS)
    return 0


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
    cdef int32_t *masked = <int32_t *>malloc(<size_t>(num_rows * K + 1) * sizeof(int32_t))
    cdef uint8_t *seen = <uint8_t *>malloc(<size_t>E)
    if masked == NULL or seen == NULL:
        free(masked)
        free(seen)
        raise MemoryError("the CPU pool could not allocate its routing buffers")
    cdef int64_t deadline_ns, t0, t1, wait_ns = 0, compute_ns = 0, entries = 0, experts = 0
    cdef int64_t timeout_ns = <int64_t>(timeout_s * 1e9), i, n_cpu
    cdef int l, e, status = ST_POOL_OK, rc, failed_layer = -1
    with nogil:
        for l in range(L):
            t0 = st_now_ns()
            status = _wait_ready(&rv[l], seq, t0 + timeout_ns, &av[0])
            t1 = st_now_ns()
            wait_ns += t1 - t0
            if status != ST_POOL_OK:
                failed_layer = l
                break
            # ---- the pairs this layer's where table gives the CPU: ids masked [R, K] ----
            memset(seen, 0, <size_t>E)
            n_cpu = 0
            for i in range(num_rows * K):
                e = iv[i // K, i % K]
                if 0 <= e < E and whv[l, e] == ST_WHERE_CPU:
                    masked[i] = e
                    n_cpu += 1
                    if not seen[e]:
                        seen[e] = 1
                        experts += 1
                else:
                    masked[i] = -1
            entries += n_cpu
            if num_rows > 0:
                memset(&yv[0, 0], 0, <size_t>(num_rows * H) * sizeof(float))    # [R, H]
            rc = 0
            if n_cpu > 0:
                rc = st_moe_ffn_ptrs(&xv[0, 0], num_rows, H, F, E, K,
                                     <const uint8_t *const *>&pv[l, 0, 0], tv[l, 0],
                                     row_bytes_v[l * 3],
                                     <const uint8_t *const *>&pv[l, 1, 0], tv[l, 1],
                                     row_bytes_v[l * 3 + 1],
                                     <const uint8_t *const *>&pv[l, 2, 0], tv[l, 2],
                                     row_bytes_v[l * 3 + 2],
                                     masked, &wv[0, 0], &yv[0, 0], NULL)
            compute_ns += st_now_ns() - t1
            if rc != 0:
                status = ST_POOL_NO_MEMORY
                failed_layer = l
                break
            st_store_release_i64(&dv[l], seq)
        if status != ST_POOL_OK:
            st_store_release_i64(&dv[failed_layer], -seq)
    free(masked)
    free(seen)
    return status, failed_layer, entries, experts, wait_ns, compute_ns
