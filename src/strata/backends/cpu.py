"""The CPU forward pass of qwen3moe / qwen2moe: numpy for attention and glue, the native
kernels for every weight product (read straight from the mapped GGUF, never dequantised whole).
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType

from strata._native import kernels
from strata.backends.window import Window
from strata.engine.kv import KVCache
from strata.errors import ConfigError, RequestError
from strata.model.arch import ModelSpec
from strata.model.gguf_file import GGUFModel, TensorInfo

# Legend: T = rows of this call, R = rows of a window (several slots), N = its logit rows,
# H = hidden, Q = query heads, KV = KV heads, G = Q / KV, D = head dim, C = cached + new
# tokens, E = experts, K = experts per token, F = expert width, S = shared-expert width,
# V = vocabulary.

_SCORES_BYTES = 64 << 20  # bound on one attention score block [KV, G*rows, C] (float32)
_F32 = int(GGMLQuantizationType.F32)


class _Matrix:
    """A weight matrix as the kernels take it: raw GGUF rows and the ggml type id."""

    __slots__ = ("raw", "qtype")

    def __init__(self, t: TensorInfo):
        self.raw = t.raw  # [rows, row_bytes] (or [E, rows, row_bytes] for experts)
        self.qtype = t.qtype

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return kernels.matmul(self.raw, self.qtype, x)  # [T, rows]


def _small(t: TensorInfo) -> np.ndarray:
    """A norm weight, bias or gate vector, dequantised once into float32."""
    n = int(np.prod(t.shape))
    return np.array(kernels.dequantize(t.raw.reshape(-1), t.qtype, n), dtype=np.float32)


class _Layer:
    """One decoder layer's tensors, resolved once at load so the forward pass does no lookups
    by name."""

    __slots__ = ("attn_norm", "wq", "wk", "wv", "wo", "bq", "bk", "bv", "q_norm", "k_norm",
                 "ffn_norm", "router", "gate_exps", "up_exps", "down_exps",
                 "shexp_gate", "shexp_gate_raw", "shexp_w_gate", "shexp_w_up", "shexp_w_down")

    def __init__(self, model: GGUFModel, spec: ModelSpec, i: int):
        def t(name: str) -> TensorInfo:
            return model.tensor(f"blk.{i}.{name}")

        self.attn_norm = _small(t("attn_norm.weight"))  # [H]
        self.wq = _Matrix(t("attn_q.weight"))  # [Q*D, H]
        self.wk = _Matrix(t("attn_k.weight"))  # [KV*D, H]
        self.wv = _Matrix(t("attn_v.weight"))  # [KV*D, H]
        self.wo = _Matrix(t("attn_output.weight"))  # [H, Q*D]
        has_bias = spec.has_attn_bias
        self.bq = _small(t("attn_q.bias")) if has_bias else None
        self.bk = _small(t("attn_k.bias")) if has_bias else None
        self.bv = _small(t("attn_v.bias")) if has_bias else None
        self.q_norm = _small(t("attn_q_norm.weight")) if spec.has_qk_norm else None  # [D]
        self.k_norm = _small(t("attn_k_norm.weight")) if spec.has_qk_norm else None  # [D]
        self.ffn_norm = _small(t("ffn_norm.weight"))  # [H]
        self.router = _Matrix(t("ffn_gate_inp.weight"))  # [E, H]
        self.gate_exps = _Matrix(t("ffn_gate_exps.weight"))  # [E, F, H]
        self.up_exps = _Matrix(t("ffn_up_exps.weight"))  # [E, F, H]
        self.down_exps = _Matrix(t("ffn_down_exps.weight"))  # [E, H, F]
        if spec.has_shared_expert:
            self.shexp_gate = _small(t("ffn_gate_inp_shexp.weight"))  # [H]
            self.shexp_gate_raw = self.shexp_gate.reshape(1, -1).view(np.uint8)  # [1, 4*H]
            self.shexp_w_gate = _Matrix(t("ffn_gate_shexp.weight"))  # [S, H]
            self.shexp_w_up = _Matrix(t("ffn_up_shexp.weight"))  # [S, H]
            self.shexp_w_down = _Matrix(t("ffn_down_shexp.weight"))  # [H, S]
        else:
            self.shexp_gate = self.shexp_gate_raw = None
            self.shexp_w_gate = self.shexp_w_up = self.shexp_w_down = None


def _gguf_expert_pointers(layers: list[_Layer]) -> np.ndarray:
    """[L, 3, E] uint64: the address of each expert's gate, up and down blocks in the mapped
    GGUF (its stacked [E, rows, row_bytes] tensors)."""
    pointers = np.empty((len(layers), 3, layers[0].gate_exps.raw.shape[0]), dtype=np.uint64)
    for li, ly in enumerate(layers):
        for part, matrix in enumerate((ly.gate_exps, ly.up_exps, ly.down_exps)):
            raw = matrix.raw  # [E, rows, row_bytes]
            pointers[li, part] = raw.ctypes.data + np.arange(raw.shape[0],
                                                             dtype=np.uint64) * raw.strides[0]
    return pointers


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x * rsqrt(mean(x^2) + eps) * w over the last axis, in float32 as transformers does
    (one native call: the numpy form costs ~5 array passes and ~15 us a call)."""
    out = kernels.rmsnorm(x.reshape(-1, x.shape[-1]), w, float(eps))
    return out.reshape(x.shape)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def softmax_(x: np.ndarray) -> None:
    """Softmax over the last axis, in place (no temporaries the size of x)."""
    x -= np.max(x, axis=-1, keepdims=True)
    np.exp(x, out=x)
    x /= np.sum(x, axis=-1, keepdims=True)


def top_k(probs: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k largest per row, largest first; ties go to the lowest expert id (stable sort)."""
    ids = np.argsort(-probs, axis=-1, kind="stable")[:, :k].astype(np.int32)  # [T, K]
    return ids, np.take_along_axis(probs, ids, axis=-1)  # [T, K], [T, K]


class CpuModel:
    """Runs a GGUF MoE model on the CPU. `forward_window` takes the next rows of several
    sequences in one pass; `forward` the next tokens of one sequence."""

    def __init__(self, gguf_model: GGUFModel, num_threads: int | None = None):
        if num_threads is not None:
            if int(num_threads) <= 0:
                raise ConfigError(f"num_threads = {num_threads} must be positive (or None: all)")
            kernels.set_num_threads(int(num_threads))
        self.gguf = gguf_model
        self.spec = spec = gguf_model.spec
        self._embd = gguf_model.tensor("token_embd.weight")
        self._layers = [_Layer(gguf_model, spec, i) for i in range(spec.n_layers)]
        self._out_norm = _small(gguf_model.tensor("output_norm.weight"))
        head = "token_embd.weight" if spec.tied_output else "output.weight"
        self._head = _Matrix(gguf_model.tensor(head))  # [V, H]
        self.expert_pointers = _gguf_expert_pointers(self._layers)  # [L, 3, E] uint64
        # torch computes the inverse frequencies in float32; so do we, for parity.
        exps = np.arange(0, spec.head_dim, 2, dtype=np.float32) / np.float32(spec.head_dim)
        inv_freq = 1.0 / np.power(np.float32(spec.rope_theta), exps)
        self._inv_freq = inv_freq.astype(np.float32)  # [D/2]
        self._eps = np.float32(spec.rms_eps)
        self._scale = np.float32(spec.head_dim ** -0.5)

    def new_kv(self, capacity_tokens: int, dtype=np.float32) -> KVCache:
        """An empty KV cache for one sequence (float16 cells halve its memory)."""
        if capacity_tokens > self.spec.context_length:
            raise ConfigError(
                f"context of {capacity_tokens} tokens exceeds the model's "
                f"{self.spec.context_length}; ask for at most {self.spec.context_length}")
        return KVCache(self.spec, capacity_tokens, dtype=dtype)

    # ---- pieces ---------------------------------------------------------------------------
    def embed(self, tokens: np.ndarray) -> np.ndarray:
        """Dequantise only the rows of `tokens` from the embedding table."""
        rows = np.ascontiguousarray(self._embd.raw[tokens])  # [T, row_bytes]
        n = len(tokens) * self.spec.hidden
        x = kernels.dequantize(rows.reshape(-1), self._embd.qtype, n)
        return np.asarray(x, dtype=np.float32).reshape(len(tokens), self.spec.hidden)  # [T, H]

    def _rope(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        freqs = positions.astype(np.float32)[:, None] * self._inv_freq[None, :]  # [T, D/2]
        return np.cos(freqs)[:, None, :], np.sin(freqs)[:, None, :]  # [T, 1, D/2] each

    @staticmethod
    def _apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        """NEOX rotation: the halves of each head rotate together (x [T, heads, D])."""
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return np.concatenate((x1 * cos - x2 * sin, x2 * cos + x1 * sin), axis=-1)

    def _attention(self, ly: _Layer, li: int, h: np.ndarray, window: Window,
                   cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        """Attention of all R rows: projections, norms and RoPE over every row at once; the
        scores per slot run against that slot's KV (its K/V appended, not yet committed)."""
        spec = self.spec
        R, Q, KV, D = h.shape[0], spec.n_heads, spec.n_kv_heads, spec.head_dim
        q = ly.wq(h)  # [R, Q*D]
        k = ly.wk(h)  # [R, KV*D]
        v = ly.wv(h)  # [R, KV*D]
        if ly.bq is not None:
            q += ly.bq
            k += ly.bk
            v += ly.bv
        q = q.reshape(R, Q, D)
        k = k.reshape(R, KV, D)
        if ly.q_norm is not None:
            q = rms_norm(q, ly.q_norm, self._eps)
            k = rms_norm(k, ly.k_norm, self._eps)
        q = self._apply_rope(q, cos, sin)  # [R, Q, D]
        k = self._apply_rope(k, cos, sin).transpose(1, 0, 2)  # [KV, R, D]
        v = v.reshape(R, KV, D).transpose(1, 0, 2)  # [KV, R, D]
        out = np.empty((R, Q * D), dtype=np.float32)  # [R, Q*D]
        for kv, r0, r1, first_pos in window.runs:
            keys, values = kv.append(li, k[:, r0:r1], v[:, r0:r1])  # [KV, C, D] each
            # Rows are attended in blocks so the score matrix stays under _SCORES_BYTES however
            # long the prompt chunk and the context are.
            rows_per_block = max(1, _SCORES_BYTES // (4 * Q * keys.shape[1]))
            for b0 in range(r0, r1, rows_per_block):
                b1 = min(r1, b0 + rows_per_block)
                out[b0:b1] = self._attend(q[b0:b1], keys, values, first_pos + b0 - r0)
        return ly.wo(out)  # [R, H]

    def _attend(self, q: np.ndarray, keys: np.ndarray, values: np.ndarray,
                first_pos: int) -> np.ndarray:
        """Causal attention of query rows q [T, Q, D] at positions first_pos.. over the
        cache keys/values [KV, C, D]; returns [T, Q*D]."""
        T, Q, D = q.shape
        KV, C = keys.shape[0], keys.shape[1]
        G = Q // KV
        # Query head j reads KV head j // G (transformers' repeat_kv order). The G heads of a
        # KV head form one [G*T, D] matrix, and each KV head is its own 2-D product: numpy
        # runs a batched matmul over the strided cache view ~10x slower than these BLAS calls.
        qg = np.ascontiguousarray(q.reshape(T, KV, G, D).transpose(1, 2, 0, 3))  # [KV, G, T, D]
        qg = qg.reshape(KV, G * T, D)
        scores = np.empty((KV, G * T, C), dtype=np.float32)
        for j in range(KV):
            np.matmul(qg[j], keys[j].T, out=scores[j])  # [G*T, C]
        scores *= self._scale
        if first_pos < C - 1:  # not a lone last row: each row sees columns up to itself
            future = np.arange(C)[None, :] > (first_pos + np.arange(T))[:, None]  # [T, C]
            mask = np.where(future, np.float32(-np.inf), np.float32(0))
            scores.reshape(KV, G, T, C)[...] += mask
        softmax_(scores)  # [KV, G*T, C]
        out = np.empty((KV, G * T, D), dtype=np.float32)
        for j in range(KV):
            np.matmul(scores[j], values[j], out=out[j])  # [G*T, D]
        out = out.reshape(KV, G, T, D)
        return out.transpose(2, 0, 1, 3).reshape(T, Q * D)  # [T, Q*D]

    def _moe(self, ly: _Layer, h: np.ndarray, pointers: np.ndarray,
             routed_rows: np.ndarray | None) -> np.ndarray:
        """The routed experts (read through `pointers` [3, E]) plus the shared expert of rows h
        [T, H]; adds the rows routed to each expert into `routed_rows` [E] when given."""
        spec = self.spec
        probs = ly.router(h)  # [T, E] logits
        softmax_(probs)  # [T, E]
        experts, weights = top_k(probs, spec.n_experts_used)  # [T, K], [T, K]
        if spec.norm_topk:
            weights = weights / np.sum(weights, axis=-1, keepdims=True)
        out = np.zeros_like(h)  # [T, H]
        kernels.moe_ffn_ptrs(h, pointers, ly.gate_exps.qtype, ly.up_exps.qtype,
                             ly.down_exps.qtype, ly.gate_exps.raw.shape[1], experts,
                             np.ascontiguousarray(weights, dtype=np.float32), out, routed_rows)
        if ly.shexp_gate is not None:
            inner = silu(ly.shexp_w_gate(h)) * ly.shexp_w_up(h)  # [T, S]
            shared = ly.shexp_w_down(inner)  # [T, H]
            # the shared expert's gate is a single [H] vector, read into float32 at load; the
            # kernel (not numpy's gemv, whose sums depend on the row count) keeps each row's
            # result independent of the rows batched with it
            logit = kernels.matmul(ly.shexp_gate_raw, _F32, h)  # [T, 1]
            gate = 1.0 / (1.0 + np.exp(-logit[:, 0]))  # [T]
            out += gate[:, None] * shared
        return out

    def _check_pointers(self, expert_pointers: np.ndarray | None) -> np.ndarray:
        if expert_pointers is None:
            return self.expert_pointers
        shape = (self.spec.n_layers, 3, self.spec.n_experts)
        if (not isinstance(expert_pointers, np.ndarray) or expert_pointers.dtype != np.uint64
                or expert_pointers.shape != shape or not expert_pointers.flags.c_contiguous):
            raise ValueError(f"expert_pointers must be a C-contiguous uint64 array of shape "
                             f"{shape} (layer, gate/up/down, expert)")
        return expert_pointers

    # ---- the pass -------------------------------------------------------------------------
    def forward(self, tokens: np.ndarray, kv: KVCache, all_logits: bool = False) -> np.ndarray:
        """Run `tokens` at positions kv.num_tokens.. and append their K/V; return the logits
        [T, V] of every row when `all_logits`, else [1, V] of the last row (a one-slot window)."""
        window = Window.build([(kv, tokens)], logits="all" if all_logits else "last")
        return self.forward_window(window)

    def forward_window(self, window: Window, expert_pointers: np.ndarray | None = None,
                       routing_counts: np.ndarray | None = None) -> np.ndarray:
        """One pass over the R rows of `window` (several slots); returns the logits
        [N, V] of its logit rows (`window.logits_of(logits, slot)` picks a slot's). Every
        KV commits its rows only after all layers ran: an error leaves each KV as it was.

        `expert_pointers` [L, 3, E] uint64 says where each expert's gate, up and down blocks
        are read from (default: `self.expert_pointers`, the GGUF mapping; an expert cache passes
        its slots for resident experts). The memory must stay valid and unchanged until the
        call returns. `routing_counts` [L, E] int64, when given, gets the rows routed to each
        (layer, expert) in this window added to it."""
        window.check_current()
        pointers = self._check_pointers(expert_pointers)
        if routing_counts is not None and (
                not isinstance(routing_counts, np.ndarray) or routing_counts.dtype != np.int64
                or routing_counts.shape != (self.spec.n_layers, self.spec.n_experts)):
            raise ValueError(f"routing_counts must be an int64 array of shape "
                             f"{(self.spec.n_layers, self.spec.n_experts)}")
        if window.kvs[0].spec != self.spec:
            raise RequestError(
                f"the window's KV caches were made for another model ({window.kvs[0].spec.arch}, "
                f"{window.kvs[0].spec.n_layers} layers); make them with this model's new_kv")
        eps = self._eps
        cos, sin = self._rope(window.positions)  # [R, 1, D/2] each
        x = self.embed(window.tokens)  # [R, H]
        for li, ly in enumerate(self._layers):
            h = rms_norm(x, ly.attn_norm, eps)  # [R, H]
            x += self._attention(ly, li, h, window, cos, sin)
            h = rms_norm(x, ly.ffn_norm, eps)  # [R, H]
            x += self._moe(ly, h, pointers[li],
                           None if routing_counts is None else routing_counts[li])
        window.commit()
        if window.num_logit_rows < window.num_rows:
            x = x[window.logit_rows]  # [N, H]
        x = rms_norm(np.ascontiguousarray(x), self._out_norm, eps)
        return self._head(x)  # [N, V]
