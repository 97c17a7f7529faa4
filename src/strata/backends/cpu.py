"""The CPU forward pass of qwen3moe / qwen2moe / qwen3next: the native window loop
(`kernels.WindowModel`) runs every layer in C with the GIL released; weights are read straight
from the mapped GGUF.
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType

from strata._native import kernels
from strata.backends.window import Window
from strata.engine.kv import KVCache
from strata.engine.recurrent import DEFAULT_CHECKPOINTS
from strata.errors import ConfigError, RequestError
from strata.model.arch import ModelSpec
from strata.model.delta_layout import recurrent_matrices
from strata.model.gguf_file import GGUFModel, TensorInfo

# Legend: R = rows of a window (several slots), N = its logit rows, H = hidden, Q = query
# heads, KV = KV heads, D = head dim, E = experts, F = expert width, S = shared-expert width,
# V = vocabulary, L = layers.

_F32 = int(GGMLQuantizationType.F32)


class _Matrix:
    """A weight matrix as the kernels take it: raw GGUF rows and the ggml type id; `rows`
    picks and orders rows (a copy; whole quantised rows move as they are)."""

    __slots__ = ("raw", "qtype")

    def __init__(self, t: TensorInfo, rows: np.ndarray | None = None):
        self.raw = t.raw  # [rows, row_bytes] (or [E, rows, row_bytes] for experts)
        if rows is not None:
            self.raw = np.ascontiguousarray(self.raw[rows])
        self.qtype = t.qtype

    def pair(self) -> tuple[np.ndarray, int]:
        return self.raw, self.qtype


def _small(t: TensorInfo) -> np.ndarray:
    """A norm weight, bias or gate vector, dequantised once into float32."""
    n = int(np.prod(t.shape))
    return np.array(kernels.dequantize(t.raw.reshape(-1), t.qtype, n), dtype=np.float32)


class _Layer:
    """One decoder layer's tensors, resolved once at load so the forward pass does no lookups
    by name. A qwen3next recurrent layer has `ssm` (its gated delta-net tensors) instead of
    the attention ones."""

    __slots__ = ("attn_norm", "wq", "wk", "wv", "wo", "bq", "bk", "bv", "q_norm", "k_norm",
                 "ffn_norm", "router", "gate_exps", "up_exps", "down_exps",
                 "shexp_gate_raw", "shexp_w_gate", "shexp_w_up", "shexp_w_down", "ssm")

    def __init__(self, model: GGUFModel, spec: ModelSpec, i: int):
        def t(name: str) -> TensorInfo:
            return model.tensor(f"blk.{i}.{name}")

        self.attn_norm = _small(t("attn_norm.weight"))  # [H]
        ffn_norm = "post_attention_norm" if spec.arch == "qwen3next" else "ffn_norm"
        self.ffn_norm = _small(t(ffn_norm + ".weight"))  # [H]
        self._ffn(spec, t)
        self.ssm = None
        if spec.is_recurrent(i):
            self.ssm = self._recurrent(model, spec, t, i)
            self.wq = self.wk = self.wv = self.wo = None
            self.bq = self.bk = self.bv = self.q_norm = self.k_norm = None
            return
        self.wq = _Matrix(t("attn_q.weight"))  # [Q*D, H] ([Q*2D, H]: query + gate heads)
        self.wk = _Matrix(t("attn_k.weight"))  # [KV*D, H]
        self.wv = _Matrix(t("attn_v.weight"))  # [KV*D, H]
        self.wo = _Matrix(t("attn_output.weight"))  # [H, Q*D]
        has_bias = spec.has_attn_bias
        self.bq = _small(t("attn_q.bias")) if has_bias else None
        self.bk = _small(t("attn_k.bias")) if has_bias else None
        self.bv = _small(t("attn_v.bias")) if has_bias else None
        self.q_norm = _small(t("attn_q_norm.weight")) if spec.has_qk_norm else None  # [D]
        self.k_norm = _small(t("attn_k_norm.weight")) if spec.has_qk_norm else None  # [D]

    @staticmethod
    def _recurrent(model: GGUFModel, spec: ModelSpec, t, i: int) -> dict:
        """A gated delta-net layer's tensors in the form kernels.WindowModel takes."""
        m = {key: _Matrix(model.tensor(name), rows) for key, (name, rows) in
             recurrent_matrices(spec, model.tensor_names, i).items()}
        return dict(
            recurrent=True, ssm_qkv=m["qkv"].pair(), ssm_gate=m["gate"].pair(),  # [C|VI, H]
            ssm_ba=m["ba"].pair(),  # [2*Hv, H]
            conv_w=_small(t("ssm_conv1d.weight")),  # [C*KC]
            ssm_a=_small(t("ssm_a")), ssm_dt=_small(t("ssm_dt.bias")),  # [Hv] each
            ssm_norm=_small(t("ssm_norm.weight")),  # [Dv]
            ssm_out=m["out"].pair())  # [H, VI]

    def _ffn(self, spec: ModelSpec, t) -> None:
        self.router = _Matrix(t("ffn_gate_inp.weight"))  # [E, H]
        self.gate_exps = _Matrix(t("ffn_gate_exps.weight"))  # [E, F, H]
        self.up_exps = _Matrix(t("ffn_up_exps.weight"))  # [E, F, H]
        self.down_exps = _Matrix(t("ffn_down_exps.weight"))  # [E, H, F]
        if spec.has_shared_expert:
            # the gate is a single [H] vector, read into float32 at load and multiplied by the
            # matmul kernel as a [1, H] F32 matrix
            gate = _small(t("ffn_gate_inp_shexp.weight"))  # [H]
            self.shexp_gate_raw = gate.reshape(1, -1).view(np.uint8)  # [1, 4*H]
            self.shexp_w_gate = _Matrix(t("ffn_gate_shexp.weight"))  # [S, H]
            self.shexp_w_up = _Matrix(t("ffn_up_shexp.weight"))  # [S, H]
            self.shexp_w_down = _Matrix(t("ffn_down_shexp.weight"))  # [H, S]
        else:
            self.shexp_gate_raw = None
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


def _native_layer(ly: _Layer) -> dict:
    """One layer's tensors in the form kernels.WindowModel takes."""
    has_shared = ly.shexp_gate_raw is not None
    out = dict(
        attn_norm=ly.attn_norm, ffn_norm=ly.ffn_norm, router=ly.router.pair(),
        expert_types=(ly.gate_exps.qtype, ly.up_exps.qtype, ly.down_exps.qtype),
        sh_gate=ly.shexp_w_gate.pair() if has_shared else None,
        sh_up=ly.shexp_w_up.pair() if has_shared else None,
        sh_down=ly.shexp_w_down.pair() if has_shared else None,
        sh_inp=(ly.shexp_gate_raw, _F32) if has_shared else None)
    if ly.ssm is not None:
        return {**out, **ly.ssm}
    return {**out, **dict(q_norm=ly.q_norm, k_norm=ly.k_norm, bq=ly.bq, bk=ly.bk, bv=ly.bv,
                          wq=ly.wq.pair(), wk=ly.wk.pair(), wv=ly.wv.pair(), wo=ly.wo.pair())}


class CpuModel:
    """Runs a GGUF MoE model on the CPU. `forward_window` takes the next rows of several
    sequences in one pass; `forward` the next tokens of one sequence."""

    def __init__(self, gguf_model: GGUFModel, num_threads: int | None = None):
        if num_threads is not None:
            if int(num_threads) <= 0:
                raise ConfigError(f"num_threads = {num_threads} must be positive (or None: all)")
            if int(num_threads) > kernels.MAX_THREADS:
                raise ConfigError(f"num_threads = {num_threads} is more than the "
                                  f"{kernels.MAX_THREADS} threads the kernels run; give the "
                                  f"number of cores or fewer (--threads)")
            kernels.set_num_threads(int(num_threads))
        self.gguf = gguf_model
        self.spec = spec = gguf_model.spec
        self._layers = [_Layer(gguf_model, spec, i) for i in range(spec.n_layers)]
        self.expert_pointers = _gguf_expert_pointers(self._layers)  # [L, 3, E] uint64
        # torch computes the inverse frequencies in float32; so do we, for parity.
        # (qwen3next rotates only the first n_rot dims of a head, at frequencies of n_rot)
        exps = np.arange(0, spec.n_rot, 2, dtype=np.float32) / np.float32(spec.n_rot)
        inv_freq = (1.0 / np.power(np.float32(spec.rope_theta), exps)).astype(np.float32)
        head = "token_embd.weight" if spec.tied_output else "output.weight"
        dims = dict(n_layers=spec.n_layers, hidden=spec.hidden, n_heads=spec.n_heads,
                    n_kv_heads=spec.n_kv_heads, head_dim=spec.head_dim,
                    n_experts=spec.n_experts, n_experts_used=spec.n_experts_used,
                    expert_ffn=spec.expert_ffn, shared_ffn=spec.shared_ffn, vocab=spec.vocab,
                    norm_topk=spec.norm_topk, rms_eps=float(np.float32(spec.rms_eps)),
                    rope_dim=spec.n_rot, attn_gate=spec.has_attn_gate, ssm_conv=spec.ssm_conv,
                    ssm_state=spec.ssm_state, ssm_groups=spec.ssm_groups,
                    ssm_heads=spec.ssm_heads, ssm_inner=spec.ssm_inner)
        self._native = kernels.WindowModel(
            dims, _Matrix(gguf_model.tensor("token_embd.weight")).pair(),
            _Matrix(gguf_model.tensor(head)).pair(),
            _small(gguf_model.tensor("output_norm.weight")), inv_freq,
            [_native_layer(ly) for ly in self._layers])

    def new_kv(self, capacity_tokens: int, dtype=np.float32,
               max_checkpoints: int = DEFAULT_CHECKPOINTS) -> KVCache:
        """An empty KV cache for one sequence (float16 cells halve its memory); a hybrid
        model's keeps up to `max_checkpoints` recurrent states to go back to."""
        if capacity_tokens > self.spec.context_length:
            raise ConfigError(
                f"context of {capacity_tokens} tokens exceeds the model's "
                f"{self.spec.context_length}; ask for at most {self.spec.context_length}")
        return KVCache(self.spec, capacity_tokens, dtype=dtype, max_checkpoints=max_checkpoints)

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
        spec = window.kvs[0].spec
        if spec is not self.spec and spec != self.spec:  # (a dataclass compare per window)
            raise RequestError(
                f"the window's KV caches were made for another model ({window.kvs[0].spec.arch}, "
                f"{window.kvs[0].spec.n_layers} layers); make them with this model's new_kv")
        # one native call: every layer, the GIL released; K/V land in the cells uncommitted,
        # recurrent states in each KV's other buffer
        states = [kv.state.buffers() for kv in window.kvs] if self.spec.recurrent_layers \
            else None
        logits = kernels.window_forward(self._native, window.tokens, window.positions,
                                        window.run_starts, [kv.cells for kv in window.kvs],
                                        window.logit_rows, pointers, routing_counts,
                                        states)  # [N, V]
        window.commit()
        return logits
