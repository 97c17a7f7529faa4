# The window loop's own kernels one at a time, for tests and benchmarks (included by kernels.pyx
# after window_loop.pxi, whose declarations they use). Legend: R = rows, Q / KV = query / KV
# heads, D = head dim, E = experts.

def attention(q, list runs, int n_kv_heads, float scale):
    """Causal attention as the window loop runs it. q [R, Q*D] float32; runs: one
    (k_cells, v_cells, first_row, num_rows, first_position) per slot, cells [KV, cap, D]
    float32 or float16 holding keys 0..first_position + num_rows - 1. Returns [R, Q*D]."""
    _check_array("q", q, np.float32, 2)
    if not runs:
        raise ValueError("attention needs at least one run")
    cdef int KV = n_kv_heads, D = runs[0][0].shape[2]
    if KV <= 0 or q.shape[1] % (KV * D) != 0:
        raise ValueError(f"q rows of {q.shape[1]} values are not a whole number of heads of "
                         f"{D} for {KV} KV heads")
    cdef int Q = q.shape[1] // D, S = len(runs), s
    out = np.zeros_like(q)
    cdef st_attn_run *table = <st_attn_run *>malloc(S * sizeof(st_attn_run))
    cdef void *scratch = NULL
    cdef int num_threads = st_get_num_threads()
    cdef const float[:, ::1] qv = q
    cdef float[:, ::1] ov = out
    try:
        if table == NULL:
            raise MemoryError("no memory for the run table")
        tiled = []  # keeps the tiled copies alive during the call
        for s, (k_cells, v_cells, row0, num_rows, pos0) in enumerate(runs):
            for arr in (k_cells, v_cells):
                if (not isinstance(arr, np.ndarray) or arr.dtype not in (np.float32, np.float16)
                        or arr.ndim != 3 or arr.shape[0] != KV or arr.shape[2] != D
                        or not arr.flags.c_contiguous or arr.dtype != k_cells.dtype
                        or arr.shape != k_cells.shape):
                    raise ValueError(f"run {s}: cells must be C-contiguous float32/float16 "
                                     f"[{KV}, cap, {D}], k and v alike")
            if not (0 <= row0 and num_rows > 0 and row0 + num_rows <= q.shape[0]
                    and 0 <= pos0 and pos0 + num_rows <= k_cells.shape[1]):
                raise ValueError(f"run {s}: rows {row0}+{num_rows} at position {pos0} do not fit "
                                 f"q's {q.shape[0]} rows and {k_cells.shape[1]} cells")
            k_cells = tile_keys(k_cells)
            tiled.append(k_cells)
            table[s].k = <const void *><uintptr_t>k_cells.ctypes.data
            table[s].v = <const void *><uintptr_t>v_cells.ctypes.data
            table[s].cap = v_cells.shape[1]
            table[s].k_tiles = k_cells.shape[1]
            table[s].row0 = row0
            table[s].num_rows = num_rows
            table[s].pos0 = pos0
            table[s].is_f16 = k_cells.dtype == np.float16
        scratch = malloc(st_attention_scratch_bytes(Q, KV, D) * num_threads)
        if scratch == NULL:
            raise MemoryError("no memory for the attention scratch")
        with nogil:
            st_attention(&qv[0, 0], Q, KV, D, scale, table, S, &ov[0, 0], scratch, num_threads)
    finally:
        free(table)
        free(scratch)
    return out


def tile_keys(keys):
    """K cells [KV, cap, D] in the stored layout [KV, NT, D, KV_KEY_TILE] (a copy, zero past
    cap)."""
    kv, cap, d = keys.shape
    num_tiles = -(-cap // KV_KEY_TILE)
    padded = np.zeros((kv, num_tiles * KV_KEY_TILE, d), dtype=keys.dtype)
    padded[:, :cap] = keys
    tiles = padded.reshape(kv, num_tiles, KV_KEY_TILE, d)  # [KV, NT, TILE, D]
    return np.ascontiguousarray(tiles.transpose(0, 1, 3, 2))  # [KV, NT, D, TILE]


def rope_neox(x, positions, inv_freq):
    """x [R, heads, D] float32 rotated (NEOX) at int64 positions [R]; returns a new array. The
    first 2 * len(inv_freq) dims of each head rotate (all D, or fewer: partial RoPE)."""
    _check_array("x", x, np.float32, 3)
    _check_array("positions", positions, np.int64, 1)
    _check_array("inv_freq", inv_freq, np.float32, 1)
    cdef int64_t R = x.shape[0]
    cdef int heads = x.shape[1], D = x.shape[2], half = inv_freq.shape[0]
    if positions.shape[0] != R or half < 1 or 2 * half > D:
        raise ValueError(f"x {x.shape}, positions {positions.shape} and inv_freq "
                         f"{inv_freq.shape} do not match (one position per row, 1..D/2 "
                         "frequencies)")
    out = x.copy()
    cos_t = np.empty((R, half), dtype=np.float32)
    sin_t = np.empty((R, half), dtype=np.float32)
    cdef float[:, :, ::1] ov = out
    cdef const int64_t[::1] pv = positions
    cdef const float[::1] fv = inv_freq
    cdef float[:, ::1] cv = cos_t
    cdef float[:, ::1] sv = sin_t
    if R:
        with nogil:
            st_rope_table(&pv[0], R, &fv[0], half, &cv[0, 0], &sv[0, 0])
            st_rope_neox(&ov[0, 0, 0], R, heads, D, 2 * half, &cv[0, 0], &sv[0, 0])
    return out


def router_topk(logits, int k, bint norm_topk):
    """(experts int32 [R, k], weights float32 [R, k]) of router logits [R, E] float32:
    softmax, the k most probable (ties to the lowest id), renormalised when norm_topk."""
    _check_array("logits", logits, np.float32, 2)
    cdef int64_t R = logits.shape[0]
    cdef int E = logits.shape[1]
    if not 0 < k <= E:
        raise ValueError(f"k = {k} must lie in 1..{E} (the number of experts)")
    probs = logits.copy()
    experts = np.empty((R, k), dtype=np.int32)
    weights = np.empty((R, k), dtype=np.float32)
    cdef float[:, ::1] pv = probs
    cdef int32_t[:, ::1] ev = experts
    cdef float[:, ::1] wv = weights
    if R:
        with nogil:
            st_router_topk(&pv[0, 0], R, E, k, norm_topk, &ev[0, 0], &wv[0, 0])
    return experts, weights


def fp32_to_fp16_bits(values):
    """uint16 fp16 bits of float32 values as the KV cell writer rounds them (tests)."""
    _check_array("values", values, np.float32, 1)
    out = np.empty(values.shape[0], dtype=np.uint16)
    cdef const float[::1] src = values
    cdef uint16_t[::1] dst = out
    cdef Py_ssize_t i
    for i in range(src.shape[0]):
        dst[i] = st_fp32_to_fp16(src[i])
    return out
