"""Architectures Strata runs: their hyperparameters (ModelSpec), GGUF metadata keys and tensors.

This module is the one contract between whoever writes a GGUF (`strata-tool synth`) and whoever
reads one (the loader): both go through `spec_to_metadata` / `spec_from_metadata` and
`expected_tensors`. Shapes are in numpy order (the last axis is contiguous; GGUF's `ne` reversed).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from strata.errors import ModelFormatError

ARCHITECTURES = ("qwen3moe", "qwen2moe")


@dataclass(frozen=True)
class ModelSpec:
    """Hyperparameters of one MoE transformer. H = hidden, F = expert width, E = experts."""

    arch: str
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_experts: int
    n_experts_used: int
    expert_ffn: int  # F, width of one routed expert
    vocab: int
    context_length: int = 32768
    rms_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    shared_ffn: int = 0  # width of the shared expert (qwen2moe), 0 when there is none
    norm_topk: bool = True  # renormalise the top-k router weights to sum to 1
    tied_output: bool = False  # no output.weight: the head reuses token_embd.weight

    @property
    def has_qk_norm(self) -> bool:
        return self.arch == "qwen3moe"

    @property
    def has_attn_bias(self) -> bool:
        return self.arch == "qwen2moe"

    @property
    def has_shared_expert(self) -> bool:
        return self.shared_ffn > 0

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def with_(self, **changes) -> "ModelSpec":
        return replace(self, **changes)

    def as_dict(self) -> dict:
        return asdict(self)


def _arch_defaults(arch: str) -> dict:
    # llama.cpp's qwen3moe always normalises the top-k weights; qwen2moe never does.
    return {"norm_topk": arch == "qwen3moe"}


def spec_to_metadata(spec: ModelSpec) -> dict[str, object]:
    """The GGUF metadata keys (llama.cpp's names) that describe `spec`."""
    a = spec.arch
    meta: dict[str, object] = {
        "general.architecture": a,
        f"{a}.block_count": spec.n_layers,
        f"{a}.context_length": spec.context_length,
        f"{a}.embedding_length": spec.hidden,
        f"{a}.feed_forward_length": spec.expert_ffn,
        f"{a}.expert_feed_forward_length": spec.expert_ffn,
        f"{a}.attention.head_count": spec.n_heads,
        f"{a}.attention.head_count_kv": spec.n_kv_heads,
        f"{a}.attention.key_length": spec.head_dim,
        f"{a}.attention.value_length": spec.head_dim,
        f"{a}.attention.layer_norm_rms_epsilon": float(spec.rms_eps),
        f"{a}.rope.freq_base": float(spec.rope_theta),
        f"{a}.expert_count": spec.n_experts,
        f"{a}.expert_used_count": spec.n_experts_used,
        f"{a}.vocab_size": spec.vocab,
    }
    if spec.has_shared_expert:
        meta[f"{a}.expert_shared_feed_forward_length"] = spec.shared_ffn
    if spec.norm_topk != _arch_defaults(a)["norm_topk"]:
        meta[f"{a}.expert_weights_norm"] = bool(spec.norm_topk)
    return meta


def spec_from_metadata(meta: dict, tensor_shapes: dict[str, tuple] | None = None,
                       source: str = "model") -> ModelSpec:
    """Build a ModelSpec from GGUF metadata (plain Python values), checking every key.

    `tensor_shapes` (numpy order) fills what metadata may leave out: the vocabulary size from
    token_embd, whether the head is tied, and the head dim of files without key_length.
    """
    arch = meta.get("general.architecture")
    if arch is None:
        raise ModelFormatError(f"{source}: no general.architecture key; is this a model GGUF?")
    if arch not in ARCHITECTURES:
        raise ModelFormatError(
            f"{source}: unknown architecture {arch!r}; Strata runs {', '.join(ARCHITECTURES)}")
    shapes = tensor_shapes or {}

    def need(key: str, kind=int):
        full = f"{arch}.{key}"
        if full not in meta:
            raise ModelFormatError(f"{source}: metadata key {full!r} is missing")
        value = meta[full]
        try:
            return kind(value)
        except (TypeError, ValueError):
            raise ModelFormatError(
                f"{source}: metadata key {full!r} has value {value!r}, expected {kind.__name__}"
            ) from None

    def opt(key: str, default, kind=int):
        return need(key, kind) if f"{arch}.{key}" in meta else default

    hidden = need("embedding_length")
    n_heads = need("attention.head_count")
    head_dim = opt("attention.key_length", hidden // max(n_heads, 1))
    if "token_embd.weight" in shapes:
        vocab = int(shapes["token_embd.weight"][0])
    elif f"{arch}.vocab_size" in meta:
        vocab = need("vocab_size")
    elif "tokenizer.ggml.tokens" in meta:
        vocab = len(meta["tokenizer.ggml.tokens"])
    else:
        raise ModelFormatError(f"{source}: cannot tell the vocabulary size (no token_embd.weight)")
    expert_ffn = opt("expert_feed_forward_length", None)
    if expert_ffn is None:
        if "blk.0.ffn_gate_exps.weight" in shapes:
            expert_ffn = int(shapes["blk.0.ffn_gate_exps.weight"][1])
        else:
            raise ModelFormatError(
                f"{source}: metadata key '{arch}.expert_feed_forward_length' is missing")
    spec = ModelSpec(
        arch=arch,
        n_layers=need("block_count"),
        hidden=hidden,
        n_heads=n_heads,
        n_kv_heads=opt("attention.head_count_kv", n_heads),
        head_dim=head_dim,
        n_experts=need("expert_count"),
        n_experts_used=need("expert_used_count"),
        expert_ffn=expert_ffn,
        vocab=vocab,
        context_length=opt("context_length", 32768),
        rms_eps=opt("attention.layer_norm_rms_epsilon", 1e-6, float),
        rope_theta=opt("rope.freq_base", 10000.0, float),
        shared_ffn=opt("expert_shared_feed_forward_length", 0),
        norm_topk=opt("expert_weights_norm", _arch_defaults(arch)["norm_topk"], bool),
        tied_output=bool(shapes) and "output.weight" not in shapes,
    )
    _check_spec(spec, source)
    return spec


def _check_spec(spec: ModelSpec, source: str) -> None:
    for name in ("n_layers", "hidden", "n_heads", "n_kv_heads", "head_dim", "n_experts",
                 "n_experts_used", "expert_ffn", "vocab"):
        if getattr(spec, name) <= 0:
            raise ModelFormatError(f"{source}: {name} = {getattr(spec, name)} must be positive")
    if spec.n_heads % spec.n_kv_heads:
        raise ModelFormatError(
            f"{source}: {spec.n_heads} query heads are not a multiple of {spec.n_kv_heads} KV heads")
    if spec.n_experts_used > spec.n_experts:
        raise ModelFormatError(
            f"{source}: uses {spec.n_experts_used} experts per token but has {spec.n_experts}")
    if spec.head_dim % 2:
        raise ModelFormatError(f"{source}: head dim {spec.head_dim} must be even for RoPE")
    if spec.arch == "qwen2moe" and not spec.has_shared_expert:
        raise ModelFormatError(
            f"{source}: qwen2moe needs '{spec.arch}.expert_shared_feed_forward_length'")


def expected_tensors(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor the architecture needs, name -> shape in numpy order (rows, cols)."""
    H, V, E, F = spec.hidden, spec.vocab, spec.n_experts, spec.expert_ffn
    out: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (V, H),
        "output_norm.weight": (H,),
    }
    if not spec.tied_output:
        out["output.weight"] = (V, H)
    for i in range(spec.n_layers):
        p = f"blk.{i}."
        out[p + "attn_norm.weight"] = (H,)
        out[p + "attn_q.weight"] = (spec.q_dim, H)
        out[p + "attn_k.weight"] = (spec.kv_dim, H)
        out[p + "attn_v.weight"] = (spec.kv_dim, H)
        out[p + "attn_output.weight"] = (H, spec.q_dim)
        if spec.has_attn_bias:
            out[p + "attn_q.bias"] = (spec.q_dim,)
            out[p + "attn_k.bias"] = (spec.kv_dim,)
            out[p + "attn_v.bias"] = (spec.kv_dim,)
        if spec.has_qk_norm:
            out[p + "attn_q_norm.weight"] = (spec.head_dim,)
            out[p + "attn_k_norm.weight"] = (spec.head_dim,)
        out[p + "ffn_norm.weight"] = (H,)
        out[p + "ffn_gate_inp.weight"] = (E, H)
        out[p + "ffn_gate_exps.weight"] = (E, F, H)
        out[p + "ffn_up_exps.weight"] = (E, F, H)
        out[p + "ffn_down_exps.weight"] = (E, H, F)
        if spec.has_shared_expert:
            S = spec.shared_ffn
            out[p + "ffn_gate_inp_shexp.weight"] = (H,)
            out[p + "ffn_gate_shexp.weight"] = (S, H)
            out[p + "ffn_up_shexp.weight"] = (S, H)
            out[p + "ffn_down_shexp.weight"] = (H, S)
    return out


def is_small_tensor(name: str) -> bool:
    """Norms, biases and the shared-expert gate stay F32 whatever type the weights use."""
    return (name.endswith(".bias") or "norm" in name or name.endswith("ffn_gate_inp_shexp.weight"))


def is_routed_expert(name: str) -> bool:
    return "_exps." in name
