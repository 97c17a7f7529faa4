"""The model's tensors in device memory as the GGUF stores them (quantised blocks, no
dequantised copy), resolved per layer once at load; norms and biases as float32 vectors.
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType

from strata._native import kernels
from strata.errors import ConfigError
from strata.model.arch import ModelSpec
from strata.model.delta_layout import recurrent_matrices
from strata.model.gguf_file import GGUFModel, TensorInfo

# Kernel-name suffix of each GGUF type the CUDA kernels read.
TYPE_SUFFIX = {
    int(GGMLQuantizationType.F32): "f32", int(GGMLQuantizationType.F16): "f16",
    int(GGMLQuantizationType.BF16): "bf16", int(GGMLQuantizationType.Q8_0): "q8_0",
    int(GGMLQuantizationType.Q4_0): "q4_0", int(GGMLQuantizationType.Q2_K): "q2_k",
    int(GGMLQuantizationType.Q3_K): "q3_k", int(GGMLQuantizationType.Q4_K): "q4_k",
    int(GGMLQuantizationType.Q5_K): "q5_k", int(GGMLQuantizationType.Q6_K): "q6_k",
    int(GGMLQuantizationType.IQ4_XS): "iq4_xs", int(GGMLQuantizationType.Q4_1): "q4_1",
    int(GGMLQuantizationType.Q5_0): "q5_0", int(GGMLQuantizationType.Q5_1): "q5_1",
    int(GGMLQuantizationType.IQ4_NL): "iq4_nl", int(GGMLQuantizationType.IQ2_XXS): "iq2_xxs",
    int(GGMLQuantizationType.IQ2_XS): "iq2_xs", int(GGMLQuantizationType.IQ2_S): "iq2_s",
    int(GGMLQuantizationType.IQ3_XXS): "iq3_xxs", int(GGMLQuantizationType.IQ3_S): "iq3_s",
    int(GGMLQuantizationType.IQ1_S): "iq1_s", int(GGMLQuantizationType.IQ1_M): "iq1_m",
}
FLOAT_TYPES = {int(GGMLQuantizationType.F32), int(GGMLQuantizationType.F16),
               int(GGMLQuantizationType.BF16)}


class DeviceMatrix:
    """A weight matrix on the device: rows [N, row_bytes] (or [E, N, row_bytes] for experts).
    Experts are also reached through `table_ptr`, a device table uint64 [E] of each expert's
    first byte, which the grouped products read. Routed experts left in host RAM
    (`upload=False`, the offload tiers) have no device copy here: their table lives in the
    model's `expert_tables` and points at VRAM slots or mapped host copies (offload.py)."""

    __slots__ = ("buf", "ptr", "qtype", "rows", "cols", "row_bytes", "expert_bytes", "name",
                 "table", "table_ptr")

    def __init__(self, runtime, t: TensorInfo, upload: bool = True, table_ptr: int = 0,
                 rows: np.ndarray | None = None):
        """`rows`: only these rows of a 2-D tensor, in this order (whole quantised rows)."""
        if t.qtype not in TYPE_SUFFIX:
            raise ConfigError(f"tensor {t.name} has type {t.type_name}, which the CUDA kernels "
                              "do not read; use --device cpu or requantise the model")
        self.name = t.name
        self.qtype = t.qtype
        self.rows = int(t.shape[-2]) if len(t.shape) >= 2 else 1
        self.cols = int(t.shape[-1])
        self.row_bytes = t.row_bytes
        self.expert_bytes = self.rows * self.row_bytes if len(t.shape) == 3 else 0
        if not upload:
            self.buf, self.ptr, self.table, self.table_ptr = None, 0, None, int(table_ptr)
            return
        raw = t.raw
        if rows is not None:
            raw = np.ascontiguousarray(raw[rows])  # [len(rows), row_bytes]
            self.rows = int(len(rows))
        self.buf = runtime.upload(raw)
        self.ptr = int(self.buf)
        self.table, self.table_ptr = None, 0
        if self.expert_bytes:
            num_experts = int(t.shape[0])
            self.table = runtime.upload(
                self.ptr + self.expert_bytes * np.arange(num_experts, dtype=np.uint64))
            self.table_ptr = int(self.table)

    @property
    def is_float(self) -> bool:
        return self.qtype in FLOAT_TYPES

    @property
    def suffix(self) -> str:
        return TYPE_SUFFIX[self.qtype]


class DeviceVector:
    """A small float32 vector (norm weight, bias, shared-expert gate) on the device."""

    __slots__ = ("buf", "ptr", "size")

    def __init__(self, runtime, values: np.ndarray):
        values = np.ascontiguousarray(values, dtype=np.float32)
        self.size = int(values.size)
        self.buf = runtime.upload(values)
        self.ptr = int(self.buf)


def small_values(t: TensorInfo) -> np.ndarray:
    """A norm weight, bias or gate vector dequantised into float32 (as the CPU backend does)."""
    n = int(np.prod(t.shape))
    return np.array(kernels.dequantize(t.raw.reshape(-1), t.qtype, n), dtype=np.float32)


class DeviceLayer:
    """One decoder layer's device tensors (None where the architecture has none)."""

    def __init__(self, runtime, model: GGUFModel, spec: ModelSpec, i: int,
                 expert_tables_ptr: int = 0):
        """`expert_tables_ptr`: 0 uploads the routed experts; else the device address of the
        offload tables uint64 [L, 3, E] whose rows this layer's gate/up/down read."""
        def t(name: str) -> TensorInfo:
            return model.tensor(f"blk.{i}.{name}")

        def mat(name: str) -> DeviceMatrix:
            return DeviceMatrix(runtime, t(name))

        def vec(name: str) -> DeviceVector:
            return DeviceVector(runtime, small_values(t(name)))

        self.attn_norm = vec("attn_norm.weight")  # [H]
        self.is_recurrent = spec.is_recurrent(i)
        # index among the layers of its kind: KV cells (attention) or state (recurrent)
        kind = spec.recurrent_layers if self.is_recurrent else spec.attention_layers
        self.cache_index = kind.index(i)
        self.wq = self.wk = self.wv = self.wo = None
        self.bq = self.bk = self.bv = self.q_norm = self.k_norm = None
        if self.is_recurrent:
            self._recurrent(runtime, model, spec, i, vec)
        else:
            self._attention(spec, mat, vec)
        ffn_norm = "post_attention_norm" if spec.arch == "qwen3next" else "ffn_norm"
        self.ffn_norm = vec(ffn_norm + ".weight")  # [H]
        self.router = mat("ffn_gate_inp.weight")  # [E, H]
        if expert_tables_ptr:  # [E] uint64 each, in the tables [L, 3, E]
            row_bytes = 8 * spec.n_experts
            at = expert_tables_ptr + 3 * i * row_bytes
            self.gate_exps, self.up_exps, self.down_exps = (
                DeviceMatrix(runtime, t(f"ffn_{p}_exps.weight"), upload=False,
                             table_ptr=at + j * row_bytes)
                for j, p in enumerate(("gate", "up", "down")))
        else:
            self.gate_exps = mat("ffn_gate_exps.weight")  # [E, F, H]
            self.up_exps = mat("ffn_up_exps.weight")  # [E, F, H]
            self.down_exps = mat("ffn_down_exps.weight")  # [E, H, F]
        if self.gate_exps.qtype != self.up_exps.qtype:
            raise ConfigError(
                f"layer {i}: ffn_gate_exps is {self.gate_exps.suffix} but ffn_up_exps is "
                f"{self.up_exps.suffix}; the fused gate/up kernel needs one type for both")
        self.shexp_gate = self.shexp_w_gate = self.shexp_w_up = self.shexp_w_down = None
        if spec.has_shared_expert:
            self.shexp_gate = vec("ffn_gate_inp_shexp.weight")  # [H] float32: a [1, H] F32 row
            self.shexp_w_gate = mat("ffn_gate_shexp.weight")  # [S, H]
            self.shexp_w_up = mat("ffn_up_shexp.weight")  # [S, H]
            self.shexp_w_down = mat("ffn_down_shexp.weight")  # [H, S]
            if self.shexp_w_gate.qtype != self.shexp_w_up.qtype:
                raise ConfigError(f"layer {i}: the shared expert's gate and up weights differ "
                                  "in type; the fused gate/up kernel needs one type for both")

    def _attention(self, spec: ModelSpec, mat, vec) -> None:
        self.wq = mat("attn_q.weight")  # [Q*D, H] ([Q*2D, H]: each head's query, then gate)
        self.wk = mat("attn_k.weight")  # [KV*D, H]
        self.wv = mat("attn_v.weight")  # [KV*D, H]
        self.wo = mat("attn_output.weight")  # [H, Q*D]
        has_bias = spec.has_attn_bias
        self.bq = vec("attn_q.bias") if has_bias else None
        self.bk = vec("attn_k.bias") if has_bias else None
        self.bv = vec("attn_v.bias") if has_bias else None
        self.q_norm = vec("attn_q_norm.weight") if spec.has_qk_norm else None  # [D]
        self.k_norm = vec("attn_k_norm.weight") if spec.has_qk_norm else None  # [D]

    def _recurrent(self, runtime, model: GGUFModel, spec: ModelSpec, i: int, vec) -> None:
        """A gated delta-net layer: its products with rows in the kernels' order
        (model/delta_layout.py), conv taps, A, dt bias and norm."""
        m = {key: DeviceMatrix(runtime, model.tensor(name), rows=rows) for key, (name, rows)
             in recurrent_matrices(spec, model.tensor_names, i).items()}
        self.ssm_qkv, self.ssm_gate = m["qkv"], m["gate"]  # [C, H], [VI, H]
        self.ssm_ba, self.ssm_out = m["ba"], m["out"]  # [2*Hv, H], [H, VI]
        self.conv_w = vec("ssm_conv1d.weight")  # [C, K]
        self.ssm_a, self.ssm_dt = vec("ssm_a"), vec("ssm_dt.bias")  # [Hv] each
        self.ssm_norm = vec("ssm_norm.weight")  # [Dv]


def weight_bytes(model: GGUFModel, routed_experts: bool = True) -> int:
    """Bytes of every tensor the device will hold: the whole file's tensor data, or without
    the routed experts (`routed_experts=False`: the dense part, when experts stay in RAM).
    Layers past the spec's (a multi-token-prediction layer, which no pass runs) are left out."""
    num_layers = model.spec.n_layers  # (a stage's names count from its first layer)
    return sum(model.tensor(name).nbytes for name in model.tensor_names
               if (routed_experts or not is_routed_expert(name))
               and not (name.startswith("blk.") and int(name.split(".")[1]) >= num_layers))


def is_routed_expert(name: str) -> bool:
    return name.endswith(("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight"))
