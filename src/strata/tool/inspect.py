"""`strata-tool inspect`: what a GGUF model holds and where its bytes go (dense vs experts)."""
from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
from gguf import LlamaFileType

from strata.model.arch import ModelSpec, is_routed_expert
from strata.model.gguf_file import GGUFModel
from strata.sizes import size_text


@dataclass
class ModelReport:
    """Byte accounting of one model file. `expert_bytes_per_token`: the routed experts one token
    reads (top-k of each layer's gate/up/down); `active_bytes_per_token` adds the dense part."""

    path: str
    file_bytes: int
    name: str
    spec: ModelSpec
    num_tokens: int
    tokenizer_model: str
    file_type: str = "not stated"  # general.file_type, as llama.cpp's quantiser names it
    tokenizer_detail: str = ""  # pre-tokenizer and special tokens
    chat_template_chars: int = 0  # tokenizer.chat_template's length (0: the file has none)
    has_tool_use_template: bool = False
    tensors_by_type: Counter = field(default_factory=Counter)
    bytes_by_type: Counter = field(default_factory=Counter)
    dense_bytes: int = 0
    expert_bytes: int = 0
    expert_bytes_per_token: int = 0
    num_params: int = 0
    num_active_params: int = 0
    embed_row_bytes: int = 0  # one row of token_embd: all the lookup reads of it
    embed_bytes: int = 0

    @property
    def tensor_bytes(self) -> int:
        return self.dense_bytes + self.expert_bytes

    @property
    def active_bytes_per_token(self) -> int:
        # A token reads one embedding row, unless the head (tied) reads the whole table anyway.
        embed_unread = 0 if self.spec.tied_output else self.embed_bytes - self.embed_row_bytes
        return self.dense_bytes - embed_unread + self.expert_bytes_per_token


def inspect_model(path: str | os.PathLike) -> ModelReport:
    """Open `path` (ModelFormatError if it is not a usable model GGUF) and account its bytes."""
    with GGUFModel.open(path) as model:
        spec = model.spec
        meta = model.metadata
        report = ModelReport(
            path=str(path), file_bytes=os.path.getsize(path), spec=spec,
            name=str(meta.get("general.name", "")),
            num_tokens=len(meta.get("tokenizer.ggml.tokens", [])),
            tokenizer_model=str(meta.get("tokenizer.ggml.model", "none")),
            file_type=_file_type(meta.get("general.file_type")),
            tokenizer_detail=_tokenizer_detail(meta),
            chat_template_chars=len(str(meta.get("tokenizer.chat_template") or "")),
            has_tool_use_template=bool(meta.get("tokenizer.chat_template.tool_use")),
        )
        for name in model.tensor_names:
            info = model.tensor(name)
            num_values = int(np.prod(info.shape, dtype=np.int64))
            report.tensors_by_type[info.type_name] += 1
            report.bytes_by_type[info.type_name] += info.nbytes
            report.num_params += num_values
            if name == "token_embd.weight":
                report.embed_bytes, report.embed_row_bytes = info.nbytes, info.row_bytes
            if is_routed_expert(name):
                report.expert_bytes += info.nbytes
                # Each token reads n_experts_used of the layer's n_experts slices.
                report.expert_bytes_per_token += info.nbytes * spec.n_experts_used // spec.n_experts
                report.num_active_params += num_values * spec.n_experts_used // spec.n_experts
            else:
                report.dense_bytes += info.nbytes
                report.num_active_params += num_values
    return report


def _file_type(value) -> str:
    """general.file_type as llama.cpp names it ("Q4_K_M"), with its number."""
    if value is None:
        return "not stated"
    try:
        name = LlamaFileType(int(value)).name
    except (TypeError, ValueError):
        return f"unknown ({value!r})"
    return f"{name.removeprefix('MOSTLY_').removeprefix('ALL_')} (general.file_type {value})"


def _tokenizer_detail(meta: dict) -> str:
    """The pre-tokenizer and the special tokens a user checks a chat model by."""
    tokens = meta.get("tokenizer.ggml.tokens") or []

    def token(key: str) -> str | None:
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is None:
            return None
        if isinstance(token_id, (int, np.integer)) and 0 <= token_id < len(tokens):
            return f"{tokens[token_id]!r} ({token_id})"
        return f"id {token_id!r}, outside the vocabulary"

    parts = [f"pre-tokenizer {meta.get('tokenizer.ggml.pre', 'not stated')}"]
    bos = token("bos")
    if bos is not None:
        add_bos = meta.get("tokenizer.ggml.add_bos_token")
        parts.append(f"BOS {bos}" + {True: ", added to prompts",
                                     False: ", not added to prompts"}.get(add_bos, ""))
    parts += [f"{key.upper()} {text}" for key in ("eos", "eot")
              if (text := token(key)) is not None]
    return "; ".join(parts)


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"


def format_spec(spec: ModelSpec) -> list[str]:
    s = spec
    lines = [
        f"  layers {s.n_layers}, hidden {s.hidden}, vocab {s.vocab}, context {s.context_length}",
        f"  attention: {s.n_heads} query / {s.n_kv_heads} KV heads of {s.head_dim}"
        f"{', QK-norm' if s.has_qk_norm else ''}{', biases' if s.has_attn_bias else ''}"
        f"{', output gate' if s.has_attn_gate else ''}"
        f"{f', rope on {s.n_rot} dims' if s.n_rot != s.head_dim else ''}, "
        f"rope theta {s.rope_theta:g}, rms eps {s.rms_eps:g}",
        f"  experts: {s.n_experts} of width {s.expert_ffn}, top-{s.n_experts_used}"
        f"{' (renormalised)' if s.norm_topk else ''}"
        f"{f', shared expert of width {s.shared_ffn}' if s.has_shared_expert else ''}",
    ]
    if s.recurrent_layers:
        lines.insert(1, f"  gated delta-net: {len(s.recurrent_layers)} recurrent layers, "
                        f"attention in 1 of every {s.full_attn_interval} "
                        f"({len(s.attention_layers)} layers); {s.ssm_groups} key / "
                        f"{s.ssm_heads} value heads of {s.ssm_state} / {s.ssm_v_dim}, "
                        f"conv of {s.ssm_conv} taps")
    if s.tied_output:
        lines.append("  output head tied to the token embeddings")
    return lines


def format_report(r: ModelReport) -> str:
    if r.chat_template_chars:
        template = (f"in the file ({r.chat_template_chars} characters"
                    f"{'; and a tool-use one' if r.has_tool_use_template else ''})")
    else:
        template = "none in the file (Strata uses its ChatML default)"
    lines = [f"{r.path}: {r.spec.arch} '{r.name}', {size_text(r.file_bytes)}",
             f"file type: {r.file_type}",
             "hyperparameters:", *format_spec(r.spec),
             f"tokenizer: {r.tokenizer_model}, {r.num_tokens} tokens", f"  {r.tokenizer_detail}",
             f"chat template: {template}",
             "tensors by type:"]
    for type_name, count in sorted(r.tensors_by_type.items()):
        type_bytes = size_text(r.bytes_by_type[type_name])
        lines.append(f"  {type_name:<6} {count:>5} tensors  {type_bytes:>12}")
    pct = 100 * r.expert_bytes / max(r.tensor_bytes, 1)
    lines += [
        f"dense weights:       {size_text(r.dense_bytes):>12}",
        f"routed experts:      {size_text(r.expert_bytes):>12}  ({pct:.1f}% of the weights)",
        f"experts per token:   {size_text(r.expert_bytes_per_token):>12}  "
        f"(top-{r.spec.n_experts_used} of {r.spec.n_experts} in each of {r.spec.n_layers} layers)",
        f"read per token:      {size_text(r.active_bytes_per_token):>12}  "
        "(dense + experts, one embedding row)",
        f"total weights:       {size_text(r.tensor_bytes):>12}  "
        f"({_count(r.num_params)} parameters, {_count(r.num_active_params)} active)",
    ]
    return "\n".join(lines)
