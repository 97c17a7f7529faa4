# The window loop: one forward pass over the R rows of several slots, every layer in C kernels
# with the GIL released for the whole pass (included by kernels.pyx: one module, one thread
# setting). Legend: R = rows, N = logit rows, S = runs (slots), L = layers, H = hidden,
# Q / KV = query / KV heads, D = head dim, E = experts, K = experts per row, F = expert width,
# SH = shared-expert width, V = vocabulary; a hybrid model's (qwen3next) gated delta-net
# layers: La / Lr = attention / recurrent layers, Hk / Hv = key / value heads of Dk / Dv dims,
# C = conv channels (2*Hk*Dk + Hv*Dv), KC = conv taps, VI = Hv*Dv.

from libc.stdlib cimport free, malloc
from libc.string cimport memcpy, memset
from libc.stdint cimport uint16_t, uintptr_t


cdef extern from "window.h" nogil:
    ctypedef struct st_attn_run:
        const void *k
        const void *v
        int64_t cap
        int64_t k_tiles
        int64_t row0
        int64_t num_rows
        int64_t pos0
        int is_f16
    int st_attention_key_tile()
    size_t st_attention_scratch_bytes(int Q, int KV, int D)
    void st_attention(const float *q, int Q, int KV, int D, float scale, const st_attn_run *runs,
                      int num_runs, float *out, void *scratch, int num_threads)
    void st_rope_table(const int64_t *positions, int64_t R, const float *inv_freq, int half,
                       float *cos_out, float *sin_out)
    void st_rope_neox(float *x, int64_t R, int heads, int D, int n_rot, const float *cos_t,
                      const float *sin_t)
    void st_router_topk(float *logits, int64_t R, int E, int K, int norm_topk,
                        int32_t *experts, float *weights)
    void st_kv_write(void *cells, int is_f16, int64_t cap, int64_t start, const float *src,
                     int64_t n, int KV, int D)
    void st_kv_write_keys(void *cells, int is_f16, int64_t k_tiles, int64_t start,
                          const float *src, int64_t n, int KV, int D)
    uint16_t st_fp32_to_fp16(float f)
    void st_add(float *x, const float *y, int64_t num_values)
    void st_add_bias(float *x, const float *b, int64_t T, int n)
    void st_silu_mul(float *g, const float *u, int64_t num_values)
    void st_add_gated(float *out, const float *y, const float *logit, int64_t T, int n)
    void st_split_q_gate(float *qg, int64_t R, int heads, int D, float *q, float *gate)
    void st_mul_sigmoid(float *x, const float *gate, int64_t num_values)


# K cells are stored tile-transposed [.., NT, D, KV_KEY_TILE]: attention reads each tile as the
# [D, keys] panel of its score product (see window.h)
KV_KEY_TILE = st_attention_key_tile()


cdef struct st_mat:
    const uint8_t *w       # [rows, row_bytes] GGUF blocks
    int qtype
    int64_t rows
    int64_t row_bytes
    int cols


cdef struct st_layer:
    int recurrent              # 1: a gated delta-net layer (qwen3next), 0: attention
    int cache_index            # the layer's index in the KV cells (La) or the state (Lr)
    const float *attn_norm     # [H]
    const float *ffn_norm      # [H]
    const float *q_norm        # [D] or NULL (qwen2moe)
    const float *k_norm        # [D] or NULL
    const float *bq            # [Q*D] or NULL (qwen3moe)
    const float *bk            # [KV*D] or NULL
    const float *bv            # [KV*D] or NULL
    st_mat wq                  # [Q*D, H]
    st_mat wk                  # [KV*D, H]
    st_mat wv                  # [KV*D, H]
    st_mat wo                  # [H, Q*D]
    st_mat router              # [E, H]
    int gate_type              # the routed experts' types (read through the pointer table)
    int up_type
    int down_type
    int has_shared
    st_mat sh_gate             # [SH, H]
    st_mat sh_up               # [SH, H]
    st_mat sh_down             # [H, SH]
    st_mat sh_inp              # [1, H] float32: the shared expert's sigmoid gate
    st_mat ssm_qkv             # [C, H]: q (Hk heads), k (Hk heads), v (Hv heads)
    st_mat ssm_gate            # [VI, H]: z of each value head
    st_mat ssm_ba              # [2*Hv, H]: beta logits, then alpha inputs, by value head
    const float *conv_w        # [C, KC]
    const float *ssm_a         # [Hv] A = -exp(A_log)
    const float *ssm_dt        # [Hv] dt bias
    const float *ssm_norm      # [Dv]
    st_mat ssm_out             # [H, VI]


cdef inline int _mat_mul(const st_mat *m, const float *x, int64_t T, float *out) noexcept nogil:
    return st_matmul(m.qtype, m.w, m.rows, m.row_bytes, m.cols, x, T, out)  # out [T, rows]


cdef inline int64_t row_bytes_c(int qtype, int cols) noexcept nogil:
    return cols // st_block_size(qtype) * st_type_size(qtype)


cdef inline float *_carve(char **at, int64_t num_floats) noexcept nogil:
    """The next 64-byte aligned piece of a window's one scratch block."""
    cdef float *p = <float *>at[0]
    at[0] += (num_floats * 4 + 63) // 64 * 64
    return p


def _check_cells(run, k_cells, v_cells, lead, int D):
    """ValueError unless k/v are one run's writable C-contiguous cells: k [*lead, NT, D, TILE]
    and v [*lead, cap, D] of one dtype (float32 or float16), NT * TILE >= cap."""
    for name, arr, ndim in (("k", k_cells, len(lead) + 3), ("v", v_cells, len(lead) + 2)):
        if (not isinstance(arr, np.ndarray) or arr.dtype not in (np.float32, np.float16)
                or arr.ndim != ndim or arr.shape[:len(lead)] != lead
                or not arr.flags.c_contiguous or not arr.flags.writeable):
            raise ValueError(f"run {run}: {name} cells must be a writable C-contiguous "
                             f"float32/float16 array of {ndim} dimensions starting {lead}")
    n = len(lead)
    if (k_cells.dtype != v_cells.dtype or k_cells.shape[n + 1:] != (D, KV_KEY_TILE)
            or v_cells.shape[n + 1] != D
            or k_cells.shape[n] * KV_KEY_TILE < v_cells.shape[n]):
        raise ValueError(f"run {run}: k cells {k_cells.shape} {k_cells.dtype} and v cells "
                         f"{v_cells.shape} {v_cells.dtype} do not match: k must be [.., NT, {D}, "
                         f"{KV_KEY_TILE}] covering v's [.., cap, {D}] cells, of one dtype")


cdef class WindowModel:
    """A model's tensors as the native window loop reads them: pointers into arrays that this
    object keeps alive, resolved once at load. `forward` runs one window."""

    cdef st_layer *layers
    cdef int n_layers, H, Q, KV, D, E, K, F, SH, V, norm_topk, embd_block
    cdef int n_rot, gated, La, Lr, Hk, Hv, Dk, Dv, KC, C, VI
    cdef float eps, scale
    cdef st_mat embd, head
    cdef const float *out_norm
    cdef const float *inv_freq
    cdef list _keep

    def __cinit__(self):
        self.layers = NULL

    def __dealloc__(self):
        free(self.layers)

    def __init__(self, dict dims, embd, head, out_norm, inv_freq, list layers):
        """dims: n_layers, hidden, n_heads, n_kv_heads, head_dim, n_experts, n_experts_used,
        expert_ffn, shared_ffn, vocab, norm_topk, rms_eps, and optionally rope_dim (0: the whole
        head), attn_gate (wq rows are each head's query then its gate), and a hybrid model's
        ssm_conv, ssm_state, ssm_groups, ssm_heads, ssm_inner. Matrices are (raw uint8
        [rows, row_bytes], ggml type); vectors float32. `layers`: one dict per layer with
        attn_norm, ffn_norm, router, expert_types (gate, up, down), sh_gate, sh_up, sh_down,
        sh_inp (None without a shared expert), and either (attention) q_norm, k_norm, bq, bk,
        bv (None where the model has none), wq, wk, wv, wo, or (recurrent: "recurrent" True)
        ssm_qkv, ssm_gate, ssm_ba, conv_w [C, KC], ssm_a, ssm_dt, ssm_norm, ssm_out."""
        self._keep = []
        self.n_layers = dims["n_layers"]
        self.H, self.Q, self.KV = dims["hidden"], dims["n_heads"], dims["n_kv_heads"]
        self.D, self.E, self.K = dims["head_dim"], dims["n_experts"], dims["n_experts_used"]
        self.F, self.SH, self.V = dims["expert_ffn"], dims["shared_ffn"], dims["vocab"]
        self.norm_topk = 1 if dims["norm_topk"] else 0
        self.eps = dims["rms_eps"]
        self.scale = self.D ** -0.5
        self.n_rot = dims.get("rope_dim", 0) or self.D
        self.gated = 1 if dims.get("attn_gate", False) else 0
        self.KC, self.Dk = dims.get("ssm_conv", 0), dims.get("ssm_state", 0)
        self.Hk, self.Hv, self.VI = (dims.get("ssm_groups", 0), dims.get("ssm_heads", 0),
                                    dims.get("ssm_inner", 0))
        self.Dv = self.VI // self.Hv if self.Hv else 0
        self.C = 2 * self.Hk * self.Dk + self.VI
        if self.Q % self.KV != 0 or self.D % 2 != 0 or len(layers) != self.n_layers \
                or self.n_rot % 2 or self.n_rot > self.D:
            raise ValueError(f"unusable dims {dims} for {len(layers)} layers: query heads must "
                             "be a multiple of KV heads, the head dim and rope dims even")
        if any(t.get("recurrent") for t in layers) and (
                min(self.KC, self.Dk, self.Hk, self.Hv, self.VI) <= 0 or self.Hv % self.Hk
                or self.VI % self.Hv):
            raise ValueError(f"unusable recurrent dims {dims}: ssm_conv, ssm_state, "
                             "ssm_groups, ssm_heads, ssm_inner must be positive, the value "
                             "heads a multiple of the key heads and divide ssm_inner")
        self.embd = self._mat(embd, self.H, "token_embd")
        self.embd_block = st_block_size(self.embd.qtype)
        self.head = self._mat(head, self.H, "output")
        self.out_norm = self._vec(out_norm, self.H, "output_norm")
        self.inv_freq = self._vec(inv_freq, self.n_rot // 2, "inv_freq")
        self.layers = <st_layer *>malloc(self.n_layers * sizeof(st_layer))
        if self.layers == NULL:
            raise MemoryError("no memory for the layer table")
        memset(self.layers, 0, self.n_layers * sizeof(st_layer))
        cdef int i
        cdef st_layer *ly
        qd, kvd = self.Q * self.D, self.KV * self.D
        self.La = self.Lr = 0
        for i, t in enumerate(layers):
            ly = &self.layers[i]
            ly.attn_norm = self._vec(t["attn_norm"], self.H, f"blk.{i}.attn_norm")
            ly.ffn_norm = self._vec(t["ffn_norm"], self.H, f"blk.{i}.ffn_norm")
            self._ffn_tensors(ly, t, i)
            ly.recurrent = 1 if t.get("recurrent") else 0
            if ly.recurrent:
                ly.cache_index = self.Lr
                self.Lr += 1
                self._recurrent_tensors(ly, t, i)
                continue
            ly.cache_index = self.La
            self.La += 1
            ly.q_norm = self._opt_vec(t["q_norm"], self.D, f"blk.{i}.attn_q_norm")
            ly.k_norm = self._opt_vec(t["k_norm"], self.D, f"blk.{i}.attn_k_norm")
            ly.bq = self._opt_vec(t["bq"], qd, f"blk.{i}.attn_q.bias")
            ly.bk = self._opt_vec(t["bk"], kvd, f"blk.{i}.attn_k.bias")
            ly.bv = self._opt_vec(t["bv"], kvd, f"blk.{i}.attn_v.bias")
            if (ly.q_norm == NULL) != (ly.k_norm == NULL) or (ly.bq == NULL) != (ly.bv == NULL) \
                    or (ly.bq == NULL) != (ly.bk == NULL):
                raise ValueError(f"layer {i}: q/k norms and q/k/v biases come in full sets")
            ly.wq = self._mat(t["wq"], self.H, f"blk.{i}.attn_q", qd * (1 + self.gated))
            ly.wk = self._mat(t["wk"], self.H, f"blk.{i}.attn_k", kvd)
            ly.wv = self._mat(t["wv"], self.H, f"blk.{i}.attn_v", kvd)
            ly.wo = self._mat(t["wo"], qd, f"blk.{i}.attn_output", self.H)
        if self.La == 0:
            raise ValueError("a model needs at least one attention layer")

    cdef int _ffn_tensors(self, st_layer *ly, dict t, int i) except -1:
        ly.router = self._mat(t["router"], self.H, f"blk.{i}.ffn_gate_inp", self.E)
        gate_type, up_type, down_type = t["expert_types"]
        ly.gate_type = _check_type(gate_type, "gate_type")
        ly.up_type = _check_type(up_type, "up_type")
        ly.down_type = _check_type(down_type, "down_type")
        row_bytes(ly.gate_type, self.H), row_bytes(ly.down_type, self.F)  # shapes check
        ly.has_shared = t["sh_gate"] is not None
        if ly.has_shared:
            ly.sh_gate = self._mat(t["sh_gate"], self.H, f"blk.{i}.ffn_gate_shexp", self.SH)
            ly.sh_up = self._mat(t["sh_up"], self.H, f"blk.{i}.ffn_up_shexp", self.SH)
            ly.sh_down = self._mat(t["sh_down"], self.SH, f"blk.{i}.ffn_down_shexp", self.H)
            ly.sh_inp = self._mat(t["sh_inp"], self.H, f"blk.{i}.ffn_gate_inp_shexp", 1)
        return 0

    cdef int _recurrent_tensors(self, st_layer *ly, dict t, int i) except -1:
        p = f"blk.{i}."
        ly.ssm_qkv = self._mat(t["ssm_qkv"], self.H, p + "attn_qkv", self.C)
        ly.ssm_gate = self._mat(t["ssm_gate"], self.H, p + "attn_gate", self.VI)
        ly.ssm_ba = self._mat(t["ssm_ba"], self.H, p + "ssm_ba", 2 * self.Hv)
        ly.conv_w = self._vec(t["conv_w"], self.C * self.KC, p + "ssm_conv1d")
        ly.ssm_a = self._vec(t["ssm_a"], self.Hv, p + "ssm_a")
        ly.ssm_dt = self._vec(t["ssm_dt"], self.Hv, p + "ssm_dt.bias")
        ly.ssm_norm = self._vec(t["ssm_norm"], self.Dv, p + "ssm_norm")
        ly.ssm_out = self._mat(t["ssm_out"], self.VI, p + "ssm_out", self.H)
        return 0

    cdef st_mat _mat(self, pair, int cols, str name, int64_t rows=-1) except *:
        raw, qtype = pair
        qtype = _check_type(qtype, f"{name} type")
        _check_array(name, raw, np.uint8, 2)
        if raw.shape[1] != row_bytes(qtype, cols) or (rows >= 0 and raw.shape[0] != rows):
            raise ValueError(f"{name} is {raw.shape[0]} rows of {raw.shape[1]} bytes; expected "
                             f"{rows if rows >= 0 else 'any'} rows of {cols} "
                             f"{_TYPE_NAMES[qtype]} columns")
        self._keep.append(raw)
        cdef const uint8_t[:, ::1] view = raw
        cdef st_mat m
        m.w = &view[0, 0]
        m.qtype = qtype
        m.rows = raw.shape[0]
        m.row_bytes = raw.shape[1]
        m.cols = cols
        return m

    cdef const float *_vec(self, arr, int n, str name) except NULL:
        _check_array(name, arr, np.float32, 1)
        if arr.shape[0] != n:
            raise ValueError(f"{name} has {arr.shape[0]} values; expected {n}")
        self._keep.append(arr)
        cdef const float[::1] view = arr
        return &view[0]

    cdef const float *_opt_vec(self, arr, int n, str name):
        return NULL if arr is None else self._vec(arr, n, name)

    def forward(self, tokens, positions, run_starts, list cells, logit_rows, pointers,
                routing_counts, list states=None):
        """Logits [N, V] of the logit rows of one window; writes every row's K/V into its
        run's cells at the run's positions, committing nothing. One (k, v) cell pair per run,
        float32 or float16: k [La, KV, NT, D, KV_KEY_TILE] (tile-transposed), v [La, KV, cap, D]
        (La: the attention layers). A hybrid model takes one (conv_in, conv_out, ssm_in,
        ssm_out) per run in `states`, float32 conv [Lr, KC-1, C] and ssm [Lr, Hv, Dk, Dv]: the
        pass reads the "in" state and writes the "out" one (the caller makes it current).
        tokens int32 [R], positions int64 [R] (a run's rows are consecutive from its first
        position), run_starts int64 [S+1], logit_rows int64 [N], pointers uint64 [L, 3, E] (each expert's gate/up/down blocks),
        routing_counts int64 [L, E] or None (rows routed to each expert are added)."""
        _check_array("tokens", tokens, np.int32, 1)
        _check_array("positions", positions, np.int64, 1)
        _check_array("run_starts", run_starts, np.int64, 1)
        _check_array("logit_rows", logit_rows, np.int64, 1)
        _check_array("pointers", pointers, np.uint64, 3)
        cdef int64_t R = tokens.shape[0], N = logit_rows.shape[0]
        cdef int S = run_starts.shape[0] - 1
        cdef int L = self.n_layers, H = self.H, Q = self.Q, KV = self.KV, D = self.D
        cdef int E = self.E, K = self.K, F = self.F, SH = self.SH
        if R == 0 or S < 1 or len(cells) != S or positions.shape[0] != R \
                or run_starts[0] != 0 or run_starts[S] != R:
            raise ValueError(f"a window of {R} rows needs {S} (k, v) cell pairs and run starts "
                             f"from 0 to {R}")
        if pointers.shape[0] != L or pointers.shape[1] != 3 or pointers.shape[2] != E:
            raise ValueError(f"pointers must be [{L}, 3, {E}], got {pointers.shape}")
        if (pointers == 0).any():
            raise ValueError("pointers holds a null address; every expert needs its three "
                             "matrices")
        if int(tokens.min()) < 0 or int(tokens.max()) >= self.V:
            raise ValueError(f"token ids must lie in [0, {self.V})")
        if N and (int(logit_rows.min()) < 0 or int(logit_rows.max()) >= R):
            raise ValueError(f"logit rows must lie in [0, {R})")
        cdef int64_t *counts = NULL
        cdef int64_t[:, ::1] counts_view
        if routing_counts is not None:
            _check_array("routing_counts", routing_counts, np.int64, 2, writable=True)
            if routing_counts.shape[0] != L or routing_counts.shape[1] != E:
                raise ValueError(f"routing_counts must be [{L}, {E}]")
            counts_view = routing_counts
            counts = &counts_view[0, 0]

        state_ptrs = self._state_pointers(states, S)  # [S, 4] uint64: conv in/out, ssm in/out
        cdef st_attn_run *runs = <st_attn_run *>malloc(S * sizeof(st_attn_run))
        cdef int64_t *k_layer_bytes = <int64_t *>malloc(S * sizeof(int64_t))
        cdef int64_t *v_layer_bytes = <int64_t *>malloc(S * sizeof(int64_t))
        cdef char **k_base = <char **>malloc(S * sizeof(char *))
        cdef char **v_base = <char **>malloc(S * sizeof(char *))
        cdef char *block = NULL
        try:
            if (runs == NULL or k_layer_bytes == NULL or v_layer_bytes == NULL or k_base == NULL
                    or v_base == NULL):
                raise MemoryError("no memory for the window's run table")
            for s, (k_cells, v_cells) in enumerate(cells):
                _check_cells(s, k_cells, v_cells, (self.La, KV), D)
                r0, r1 = int(run_starts[s]), int(run_starts[s + 1])
                if not 0 <= r0 < r1 <= R:
                    raise ValueError(f"run {s}: rows {r0}..{r1} are empty or out of order")
                pos0 = int(positions[r0])
                if pos0 < 0 or pos0 + (r1 - r0) > v_cells.shape[2]:
                    raise ValueError(f"run {s}: positions {pos0}..{pos0 + r1 - r0} exceed its "
                                     f"{v_cells.shape[2]} cells")
                runs[s].cap = v_cells.shape[2]
                runs[s].k_tiles = k_cells.shape[2]
                runs[s].row0 = r0
                runs[s].num_rows = r1 - r0
                runs[s].pos0 = pos0
                runs[s].is_f16 = k_cells.dtype == np.float16
                k_layer_bytes[s] = k_cells.strides[0]
                v_layer_bytes[s] = v_cells.strides[0]
                k_base[s] = <char *><uintptr_t>k_cells.ctypes.data
                v_base[s] = <char *><uintptr_t>v_cells.ctypes.data

            logits = np.empty((N, self.V), dtype=np.float32)
            num_threads = st_get_num_threads()
            attn_bytes = st_attention_scratch_bytes(Q, KV, D) * num_threads
            floats = (4 * R * H + (2 + 3 * self.gated) * R * Q * D + 2 * R * KV * D + R * E
                      + R * K + R * D + 2 * R * SH + R + N * H)
            if self.Lr:  # qkv, conv out, z, core out, beta/alpha
                floats += 2 * R * self.C + 2 * R * self.VI + 2 * R * self.Hv
            block = <char *>malloc(floats * 4 + R * K * 4 + attn_bytes + 64 * 32)
            if block == NULL:
                raise MemoryError(f"no memory for the scratch of a {R}-row window "
                                  f"({(floats * 4 + attn_bytes) >> 20} MiB)")
            rc = self._pass(tokens, positions, logit_rows, pointers, counts, runs, S,
                            k_layer_bytes, v_layer_bytes, k_base, v_base, state_ptrs, block,
                            num_threads, logits)
        finally:
            free(runs)
            free(k_layer_bytes)
            free(v_layer_bytes)
            free(k_base)
            free(v_base)
            free(block)
        if rc != 0:
            raise MemoryError("the window's kernels could not allocate their work buffers")
        return logits

    def _state_pointers(self, states, int S):
        """[S, 4] uint64 base addresses of each run's conv in/out and ssm in/out states (zeros
        for a model without recurrent layers), after checking their shapes."""
        out = np.zeros((S, 4), dtype=np.uint64)
        if self.Lr == 0:
            if states is not None and any(st is not None for st in states):
                raise ValueError("this model has no recurrent layers; pass no states")
            return out
        if states is None or len(states) != S:
            raise ValueError(f"a hybrid model's window of {S} runs needs {S} (conv_in, "
                             "conv_out, ssm_in, ssm_out) states")
        conv_shape = (self.Lr, self.KC - 1, self.C)
        ssm_shape = (self.Lr, self.Hv, self.Dk, self.Dv)
        for s, st in enumerate(states):
            if st is None or len(st) != 4:
                raise ValueError(f"run {s}: states must be (conv_in, conv_out, ssm_in, ssm_out)")
            for j, (arr, shape) in enumerate(zip(st, (conv_shape, conv_shape, ssm_shape,
                                                      ssm_shape))):
                if (not isinstance(arr, np.ndarray) or arr.dtype != np.float32
                        or arr.shape != shape or not arr.flags.c_contiguous
                        or (j % 2 == 1 and not arr.flags.writeable)):
                    raise ValueError(f"run {s}: state {j} must be a C-contiguous float32 array "
                                     f"of shape {shape}" + (", writable" if j % 2 else ""))
                out[s, j] = arr.ctypes.data
            if out[s, 0] == out[s, 1] or out[s, 2] == out[s, 3]:
                raise ValueError(f"run {s}: the in and out states must be different buffers "
                                 "(a failed pass must leave the sequence as it was)")
        return out

    cdef int _ffn(self, const st_layer *ly, float *x, float *h, int64_t R, float *tmp,
                  float *sh_out, float *probs, float *weights, int32_t *experts, float *sh_g,
                  float *sh_u, float *sh_logit, const uint64_t *ptrs,
                  int64_t *counts) noexcept nogil:
        """The routed experts (+ the shared expert) of one layer, added to x [R, H]; ptrs
        [3, E] the layer's expert addresses, counts [E] or NULL. Nonzero when a kernel could
        not allocate its work buffers."""
        cdef int H = self.H, E = self.E, K = self.K, F = self.F, SH = self.SH, rc = 0
        st_rmsnorm(x, ly.ffn_norm, self.eps, R, H, h)                         # [R, H]
        rc |= _mat_mul(&ly.router, h, R, probs)                              # [R, E]
        st_router_topk(probs, R, E, K, self.norm_topk, experts, weights)     # [R, K] each
        memset(tmp, 0, R * H * sizeof(float))
        rc |= st_moe_ffn_ptrs(
            h, R, H, F, E, K,
            <const uint8_t *const *>ptrs, ly.gate_type, row_bytes_c(ly.gate_type, H),
            <const uint8_t *const *>(ptrs + E), ly.up_type, row_bytes_c(ly.up_type, H),
            <const uint8_t *const *>(ptrs + 2 * E), ly.down_type, row_bytes_c(ly.down_type, F),
            experts, weights, tmp, counts, 0)                                # [R, H]
        if ly.has_shared:
            rc |= _mat_mul(&ly.sh_gate, h, R, sh_g)                          # [R, SH]
            rc |= _mat_mul(&ly.sh_up, h, R, sh_u)                            # [R, SH]
            st_silu_mul(sh_g, sh_u, R * SH)
            rc |= _mat_mul(&ly.sh_down, sh_g, R, sh_out)                     # [R, H]
            rc |= _mat_mul(&ly.sh_inp, h, R, sh_logit)                       # [R, 1]
            st_add_gated(tmp, sh_out, sh_logit, R, H)
        st_add(x, tmp, R * H)
        return rc

    cdef int _pass(self, const int32_t[::1] tokens, const int64_t[::1] positions,
                   const int64_t[::1] logit_rows, const uint64_t[:, :, ::1] pointers,
                   int64_t *counts, st_attn_run *runs, int S, const int64_t *k_layer_bytes,
                   const int64_t *v_layer_bytes, char **k_base, char **v_base,
                   const uint64_t[:, ::1] state_ptrs, char *block, int num_threads,
                   float[:, ::1] logits) except? -1:
        cdef int64_t R = tokens.shape[0], N = logit_rows.shape[0], r, n
        cdef int L = self.n_layers, H = self.H, Q = self.Q, KV = self.KV, D = self.D
        cdef int E = self.E, K = self.K, F = self.F, SH = self.SH, li, s, rc = 0
        cdef float eps = self.eps
        cdef const st_layer *ly
        cdef char *at = <char *>(((<uintptr_t>block) + 63) // 64 * 64)
        cdef float *x = _carve(&at, R * H)                  # [R, H] the residual stream
        cdef float *h = _carve(&at, R * H)                  # [R, H] normed rows
        cdef float *tmp = _carve(&at, R * H)                # [R, H] a block's output
        cdef float *sh_out = _carve(&at, R * H)             # [R, H] the shared expert's
        cdef float *q = _carve(&at, R * Q * D)              # [R, Q*D]
        cdef float *att = _carve(&at, R * Q * D)            # [R, Q*D]
        cdef float *qg = _carve(&at, 2 * R * Q * D * self.gated)  # [R, Q, 2D] query + gate
        cdef float *gate = _carve(&at, R * Q * D * self.gated)    # [R, Q*D]
        cdef float *k = _carve(&at, R * KV * D)             # [R, KV*D]
        cdef float *v = _carve(&at, R * KV * D)             # [R, KV*D]
        cdef float *probs = _carve(&at, R * E)              # [R, E]
        cdef float *weights = _carve(&at, R * K)            # [R, K]
        cdef int32_t *experts = <int32_t *>_carve(&at, R * K)   # [R, K]
        cdef float *cos_t = _carve(&at, R * (D // 2))       # [R, D/2]
        cdef float *sin_t = _carve(&at, R * (D // 2))       # [R, D/2]
        cdef float *sh_g = _carve(&at, R * SH)              # [R, SH]
        cdef float *sh_u = _carve(&at, R * SH)              # [R, SH]
        cdef float *sh_logit = _carve(&at, R)               # [R, 1]
        cdef float *xl = _carve(&at, N * H)                 # [N, H]
        cdef int C = self.C, VI = self.VI, Hv = self.Hv, has_rec = self.Lr > 0
        cdef float *qkv = _carve(&at, R * C * has_rec)      # [R, C] q | k | v projections
        cdef float *conv_y = _carve(&at, R * C * has_rec)   # [R, C] after the conv + SiLU
        cdef float *z = _carve(&at, R * VI * has_rec)        # [R, VI]
        cdef float *core = _carve(&at, R * VI * has_rec)     # [R, VI] the delta rule's output
        cdef float *ba = _carve(&at, R * 2 * Hv * has_rec)  # [R, 2*Hv] beta logits | alpha
        cdef int64_t conv_layer = (self.KC - 1) * C, ssm_layer = Hv * self.Dk * self.Dv
        cdef int64_t r0, nr, ci
        cdef int Hk = self.Hk, Dk = self.Dk
        cdef float *conv_in
        cdef float *conv_out
        cdef float *ssm_in
        cdef float *ssm_out
        cdef float *y
        cdef void *attn_scratch = at
        with nogil:
            # ---- embed: dequantise only the rows of the window's tokens ----
            for r in range(R):
                st_dequantize(self.embd.qtype, self.embd.w + tokens[r] * self.embd.row_bytes,
                              x + r * H, H // self.embd_block)
            st_rope_table(&positions[0], R, self.inv_freq, self.n_rot // 2, cos_t, sin_t)
            for li in range(L):
                ly = &self.layers[li]
                st_rmsnorm(x, ly.attn_norm, eps, R, H, h)                    # [R, H]
                if ly.recurrent:
                    # ---- gated delta net: each run's rows in order, from its own state ----
                    rc |= _mat_mul(&ly.ssm_qkv, h, R, qkv)                   # [R, C]
                    rc |= _mat_mul(&ly.ssm_gate, h, R, z)                    # [R, VI]
                    rc |= _mat_mul(&ly.ssm_ba, h, R, ba)                     # [R, 2*Hv]
                    ci = ly.cache_index
                    for s in range(S):
                        r0, nr = runs[s].row0, runs[s].num_rows
                        conv_in = <float *><uintptr_t>state_ptrs[s, 0] + ci * conv_layer
                        conv_out = <float *><uintptr_t>state_ptrs[s, 1] + ci * conv_layer
                        ssm_in = <float *><uintptr_t>state_ptrs[s, 2] + ci * ssm_layer
                        ssm_out = <float *><uintptr_t>state_ptrs[s, 3] + ci * ssm_layer
                        y = conv_y + r0 * C                                  # [nr, C]
                        st_conv_silu(qkv + r0 * C, C, nr, C, self.KC, ly.conv_w, conv_in,
                                     conv_out, y)
                        st_gated_delta(nr, self.Hk, Hv, self.Dk, self.Dv, y, y + Hk * Dk,
                                       y + 2 * Hk * Dk, C, ba + r0 * 2 * Hv,
                                       ba + r0 * 2 * Hv + Hv, 2 * Hv, ly.ssm_a, ly.ssm_dt, eps,
                                       ssm_in, ssm_out, core + r0 * VI)      # [nr, VI]
                    st_gated_rmsnorm(core, R, Hv, self.Dv, z, VI, ly.ssm_norm, eps)
                    rc |= _mat_mul(&ly.ssm_out, core, R, tmp)                # [R, H]
                    st_add(x, tmp, R * H)
                    rc |= self._ffn(ly, x, h, R, tmp, sh_out, probs, weights, experts, sh_g,
                                    sh_u, sh_logit, &pointers[li, 0, 0],
                                    NULL if counts == NULL else counts + li * E)
                    if rc != 0:
                        break
                    continue
                # ---- attention ----
                if self.gated:
                    rc |= _mat_mul(&ly.wq, h, R, qg)                         # [R, Q, 2D]
                    st_split_q_gate(qg, R, Q, D, q, gate)                    # [R, Q*D] each
                else:
                    rc |= _mat_mul(&ly.wq, h, R, q)                          # [R, Q*D]
                rc |= _mat_mul(&ly.wk, h, R, k)                              # [R, KV*D]
                rc |= _mat_mul(&ly.wv, h, R, v)                              # [R, KV*D]
                if ly.bq != NULL:
                    st_add_bias(q, ly.bq, R, Q * D)
                    st_add_bias(k, ly.bk, R, KV * D)
                    st_add_bias(v, ly.bv, R, KV * D)
                if ly.q_norm != NULL:
                    st_rmsnorm(q, ly.q_norm, eps, R * Q, D, q)               # per head [D]
                    st_rmsnorm(k, ly.k_norm, eps, R * KV, D, k)
                st_rope_neox(q, R, Q, D, self.n_rot, cos_t, sin_t)
                st_rope_neox(k, R, KV, D, self.n_rot, cos_t, sin_t)
                for s in range(S):
                    # the rows' K/V go into the cells first: a run attends to its own rows too
                    runs[s].k = k_base[s] + ly.cache_index * k_layer_bytes[s]
                    runs[s].v = v_base[s] + ly.cache_index * v_layer_bytes[s]
                    st_kv_write_keys(<void *>runs[s].k, runs[s].is_f16, runs[s].k_tiles,
                                     runs[s].pos0, k + runs[s].row0 * KV * D, runs[s].num_rows,
                                     KV, D)
                    st_kv_write(<void *>runs[s].v, runs[s].is_f16, runs[s].cap, runs[s].pos0,
                                v + runs[s].row0 * KV * D, runs[s].num_rows, KV, D)
                st_attention(q, Q, KV, D, self.scale, runs, S, att, attn_scratch,
                             num_threads)                                    # [R, Q*D]
                if self.gated:
                    st_mul_sigmoid(att, gate, R * Q * D)
                rc |= _mat_mul(&ly.wo, att, R, tmp)                          # [R, H]
                st_add(x, tmp, R * H)
                rc |= self._ffn(ly, x, h, R, tmp, sh_out, probs, weights, experts, sh_g, sh_u,
                                sh_logit, &pointers[li, 0, 0],
                                NULL if counts == NULL else counts + li * E)
                if rc != 0:
                    break
            # ---- the logit rows: final norm and head ----
            if rc == 0 and N > 0:
                for n in range(N):
                    memcpy(xl + n * H, x + logit_rows[n] * H, H * sizeof(float))
                st_rmsnorm(xl, self.out_norm, eps, N, H, xl)                 # [N, H]
                rc |= _mat_mul(&self.head, xl, N, &logits[0, 0])             # [N, V]
        return rc



def window_forward(WindowModel model, tokens, positions, run_starts, list cells, logit_rows,
                   pointers, routing_counts, list states=None):
    """`model.forward(...)`: one window through every layer (see WindowModel.forward)."""
    return model.forward(tokens, positions, run_starts, cells, logit_rows, pointers,
                         routing_counts, states)
