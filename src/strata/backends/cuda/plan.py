"""A window plan: every kernel launch of one forward pass over R rows (N of them with logits),
prepared once with fixed device addresses. Per-window data (tokens, positions, KV bases, logit
rows) lives in a device descriptor uploaded before each run, so a plan replays unchanged, as a
launch list or as a captured CUDA graph.
"""
from __future__ import annotations

import numpy as np

from strata._native import cuda_driver
from strata.backends.cuda.runtime import align
from strata.model.arch import ModelSpec

# Legend: R = rows of the workspace (max rows of a window), P = R * K (row, expert) pairs,
# H = hidden, Q/KVH = heads, D = head dim, E = experts, K = experts per row, F = expert width,
# S = shared-expert width, V = vocabulary, G = groups (distinct experts) at most min(E, P).

MM_FMT = "PPPPqiiPPPPPPPPPi"
MM_ROWS = 16  # outputs per block of the product kernels (MM_WARPS * NR in matmul.cu)


class Workspace:
    """Device buffers for windows of up to `max_rows` rows, carved from one allocation, and
    the pinned host descriptor mirrored into the device descriptor."""

    def __init__(self, runtime, spec: ModelSpec, max_rows: int):
        R, H, K = max_rows, spec.hidden, spec.n_experts_used
        P, F, S, V = R * K, spec.expert_ffn, max(spec.shared_ffn, 1), spec.vocab
        wide = max(H, spec.q_dim)
        self.max_rows = R
        f4, i4, i1 = 4, 4, 1
        sizes = {
            # descriptor: kv_base u64 [R], then tokens, pos, cap, logit_rows int32 [R] each
            "desc": 8 * R + 4 * 4 * R,
            "x": f4 * R * H,                  # [R, H] the residual stream
            "hf": f4 * R * wide,              # [R, max(H, Q*D)] normed rows / attention output
            "hq": i1 * R * wide,              # its 8-bit form
            "hd": f4 * R * wide // 32,        # and scales per 32 columns
            "qb": f4 * R * spec.q_dim,        # [R, Q*D]
            "kb": f4 * R * spec.kv_dim,       # [R, KVH*D]
            "vb": f4 * R * spec.kv_dim,       # [R, KVH*D]
            "router": f4 * R * spec.n_experts,  # [R, E]
            "ids": i4 * P, "wts": f4 * P,     # [R, K] each
            "groups": i4 * 3 * min(spec.n_experts, P), "num_groups": i4,
            "act_rows": i4 * P, "out_rows": i4 * P,
            "hbuf": f4 * P * F, "hbq": i1 * P * F, "hbd": f4 * P * F // 32,  # [P, F]
            "ybuf": f4 * P * H,               # [P, H] each pair's down product
            "sg": f4 * R * S, "sgq": i1 * R * S, "sgd": f4 * R * S // 32 + 4,  # [R, S]
            "so": f4 * R * H, "sl": f4 * R,   # shared expert output [R, H], gate logit [R]
            "logits": f4 * R * V,             # [N <= R, V]
            "argmax": i4 * R,
        }
        self.offsets: dict[str, int] = {}
        total = 0
        for name, num_bytes in sizes.items():
            self.offsets[name] = total
            total += align(num_bytes)
        self.nbytes = total
        self._buf = runtime.alloc(total)
        self.base = int(self._buf)
        self.host_desc = runtime.pinned(sizes["desc"], np.uint8)
        self.host_kv = self.host_desc[:8 * R].view(np.uint64)  # [R]
        ints = self.host_desc[8 * R:].view(np.int32)
        self.host_tokens, self.host_pos = ints[:R], ints[R:2 * R]
        self.host_cap, self.host_logit_rows = ints[2 * R:3 * R], ints[3 * R:4 * R]
        self.host_logits = runtime.pinned((R, V), np.float32)  # [N <= R, V] read back
        self.host_argmax = runtime.pinned((R,), np.int32)

    def ptr(self, name: str) -> int:
        return self.base + self.offsets[name]

    def desc(self, field: str) -> int:
        R = self.max_rows
        at = {"kv": 0, "tokens": 8 * R, "pos": 12 * R, "cap": 16 * R, "logit_rows": 20 * R}
        return self.ptr("desc") + at[field]


class WindowPlan:
    """The launches of one window shape (R rows, N logit rows) over a workspace."""

    def __init__(self, model, ws: Workspace, num_rows: int, num_logit_rows: int):
        self.num_rows, self.num_logit_rows = num_rows, num_logit_rows
        self._model, self._ws, self._rt = model, ws, model.runtime
        # dense "groups": one group of all R rows, one of the N logit rows
        self._static = self._rt.upload(np.array([0, 0, num_rows, 0, 0, num_logit_rows, 1],
                                                dtype=np.int32))
        self.launches = cuda_driver.LaunchList()
        self.graph = None
        self._build()

    # ---- helpers --------------------------------------------------------------------------
    def _add(self, kernel: str, grid, block, fmt: str, args, shared_bytes: int = 0) -> None:
        k = self._rt.kernel(kernel)
        self.launches.append(k.prepare(grid, block, fmt, args, shared_bytes))

    def _quantize(self, src: str, dst_q: str, dst_d: str, num_values: int) -> None:
        num_blocks = num_values // 32
        self._add("quantize_q8", ((num_blocks + 7) // 8,), (256,), "PqPP",
                  [self._ws.ptr(src), num_blocks, self._ws.ptr(dst_q), self._ws.ptr(dst_d)])

    def _mm(self, mode: str, w, act: str, out: str, *, w2=None, bias=None,
            grouped: bool = False, out_rows: bool = False, act_rows: bool = False,
            logit_rows: bool = False) -> None:
        """Y[out] (mode store/add/gateup) = W x over activation buffer family `act` (float
        `act`, 8-bit `act`q/`act`d, e.g. hf/hq/hd): over the window's R rows (the N logit rows
        with logit_rows), or per expert group with grouped."""
        ws = self._ws
        xf = ws.ptr(act)
        xq, xd = (ws.ptr({"hf": "hq", "hbuf": "hbq", "sg": "sgq"}[act]),
                  ws.ptr({"hf": "hd", "hbuf": "hbd", "sg": "sgd"}[act]))
        static = int(self._static)
        if grouped:
            groups, num_groups = ws.ptr("groups"), ws.ptr("num_groups")
            max_groups = min(self._model.spec.n_experts, self.num_rows * self._model.spec.n_experts_used)
        else:
            groups = static + (12 if logit_rows else 0)
            num_groups, max_groups = static + 24, 1
        self._add(f"mm_{mode}_{w.suffix}", ((w.rows + MM_ROWS - 1) // MM_ROWS, max_groups),
                  (128,), MM_FMT,
                  [w.ptr, w2.ptr if w2 is not None else 0, w.table_ptr if grouped else 0,
                   w2.table_ptr if grouped and w2 is not None else 0, w.row_bytes, w.rows, w.cols, xf, xq, xd, groups, num_groups,
                   ws.ptr("act_rows") if act_rows else 0, ws.ptr("out_rows") if out_rows else 0,
                   bias.ptr if bias is not None else 0, ws.ptr(out), w.rows])

    def _qkv(self, ly) -> None:
        """The q, k, v projections: one launch when the three share a type, else three."""
        if not ly.wq.qtype == ly.wk.qtype == ly.wv.qtype:
            self._mm("store", ly.wq, "hf", "qb", bias=ly.bq)
            self._mm("store", ly.wk, "hf", "kb", bias=ly.bk)
            self._mm("store", ly.wv, "hf", "vb", bias=ly.bv)
            return
        ws, static = self._ws, int(self._static)
        num_blocks = sum((w.rows + MM_ROWS - 1) // MM_ROWS for w in (ly.wq, ly.wk, ly.wv))
        biases = [b.ptr if b is not None else 0 for b in (ly.bq, ly.bk, ly.bv)]
        self._add(f"mm_qkv_{ly.wq.suffix}", (num_blocks, 1), (128,), "PPPqiiiPPPPPPPPPPP",
                  [ly.wq.ptr, ly.wk.ptr, ly.wv.ptr, ly.wq.row_bytes, ly.wq.rows, ly.wk.rows,
                   ly.wq.cols, ws.ptr("hf"), ws.ptr("hq"), ws.ptr("hd"), static, static + 24,
                   *biases, ws.ptr("qb"), ws.ptr("kb"), ws.ptr("vb")])

    def _norm(self, weight_ptr: int, rows: int, quantize: bool, gather: bool = False) -> None:
        ws, H = self._ws, self._model.spec.hidden
        self._add("rmsnorm_q8", (rows,), (256,), "PPfiPPPP",
                  [ws.ptr("x"), weight_ptr, self._model.eps, H,
                   ws.desc("logit_rows") if gather else 0, ws.ptr("hf"),
                   ws.ptr("hq") if quantize else 0, ws.ptr("hd") if quantize else 0])

    # ---- the pass -------------------------------------------------------------------------
    def _build(self) -> None:
        m, ws, spec = self._model, self._ws, self._model.spec
        R, N = self.num_rows, self.num_logit_rows
        H, Q, KVH, D = spec.hidden, spec.n_heads, spec.n_kv_heads, spec.head_dim
        E, K, F = spec.n_experts, spec.n_experts_used, spec.expert_ffn
        P = R * K
        emb = m.embd
        self._add(f"embed_{emb.suffix}", (R,), (256,), "PqiPP",
                  [emb.ptr, emb.row_bytes, H, ws.desc("tokens"), ws.ptr("x")])
        for li, ly in enumerate(m.layers):
            # -- attention
            self._norm(ly.attn_norm.ptr, R, quantize=m.quantize_h)
            self._qkv(ly)  # qb [R, Q*D], kb [R, KVH*D], vb [R, KVH*D]
            self._add("qk_rope_append", (R, Q + 2 * KVH), (32,), "PPPPPPfPPPiiii",
                      [ws.ptr("qb"), ws.ptr("kb"), ws.ptr("vb"),
                       ly.q_norm.ptr if ly.q_norm else 0, ly.k_norm.ptr if ly.k_norm else 0,
                       m.inv_freq.ptr, m.eps, ws.desc("kv"), ws.desc("pos"), ws.desc("cap"),
                       li, Q, KVH, D])
            # hf [R, Q*D]; its 8-bit form in the same kernel when heads are whole blocks of 32
            fuse_q = not ly.wo.is_float and D % 32 == 0
            self._add("attention", (R, Q), (128,), "PPPPPPPiiiif",
                      [ws.ptr("qb"), ws.ptr("hf"), ws.ptr("hq") if fuse_q else 0,
                       ws.ptr("hd") if fuse_q else 0, ws.desc("kv"), ws.desc("pos"),
                       ws.desc("cap"), li, Q, KVH, D, m.attn_scale])
            if not ly.wo.is_float and not fuse_q:
                self._quantize("hf", "hq", "hd", R * Q * D)
            self._mm("add", ly.wo, "hf", "x")  # x += attention [R, H]
            # -- the routed experts
            self._norm(ly.ffn_norm.ptr, R, quantize=m.quantize_h)
            self._mm("store", ly.router, "hf", "router")  # [R, E] logits
            self._add("router_topk", (R,), (32,), "PiiiPP",
                      [ws.ptr("router"), E, K, int(spec.norm_topk), ws.ptr("ids"),
                       ws.ptr("wts")], shared_bytes=4 * E)
            self._add("group_pairs", (1,), (256,), "PiiiPPPP",
                      [ws.ptr("ids"), P, K, E, ws.ptr("groups"), ws.ptr("num_groups"),
                       ws.ptr("act_rows"), ws.ptr("out_rows")], shared_bytes=8 * E)
            # gate/up + SiLU per distinct expert over its rows: hbuf [P (grouped order), F]
            self._mm("gateup", ly.gate_exps, "hf", "hbuf", w2=ly.up_exps, grouped=True,
                     act_rows=True)
            if not ly.down_exps.is_float:
                self._quantize("hbuf", "hbq", "hbd", P * F)
            # down per distinct expert: ybuf [P (pair r*K + k), H]
            self._mm("store", ly.down_exps, "hbuf", "ybuf", grouped=True, out_rows=True)
            shared = (0, 0)
            if ly.shexp_w_gate is not None:
                S = spec.shared_ffn
                self._mm("gateup", ly.shexp_w_gate, "hf", "sg", w2=ly.shexp_w_up)  # [R, S]
                if not ly.shexp_w_down.is_float:
                    self._quantize("sg", "sgq", "sgd", R * S)
                self._mm("store", ly.shexp_w_down, "sg", "so")  # [R, H]
                self._mm("store", m.shexp_gate_rows[li], "hf", "sl")  # [R, 1]
                shared = (ws.ptr("so"), ws.ptr("sl"))
            self._add("moe_combine", ((R * H + 255) // 256,), (256,), "PPPiiiPP",
                      [ws.ptr("x"), ws.ptr("ybuf"), ws.ptr("wts"), R, K, H, *shared])
        # -- the head over the N logit rows
        self._norm(m.out_norm.ptr, N, quantize=not m.head.is_float, gather=True)
        self._mm("store", m.head, "hf", "logits", logit_rows=True)  # [N, V]
        self._add("argmax_rows", (N,), (1024,), "PiP",
                  [ws.ptr("logits"), spec.vocab, ws.ptr("argmax")])

    # ---- running --------------------------------------------------------------------------
    def run(self, stream: int, use_graph: bool) -> None:
        if use_graph:
            if self.graph is None:
                self.graph = cuda_driver.Graph(self.launches, stream)
            self.graph.launch(stream)
        else:
            self.launches.run(stream)
