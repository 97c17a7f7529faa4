"""Architectures Strata runs: their hyperparameters (ModelSpec), GGUF metadata keys and tensors.

This module is the one contract between whoever writes a GGUF (`strata-tool synth`) and whoever
reads one (the loader): both go through `spec_to_metadata` / `spec_from_metadata` and
`expected_tensors`. Shapes are in numpy order (the last axis is contiguous; GGUF's `ne` reversed).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from strata.errors import ModelFormatError

ARCHITECTURES = ("qwen3moe", "qwen2moe", "qwen3next")


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
    rope_dim: int = 0  # dims of each head RoPE rotates (its first ones); 0: the whole head
    # qwen3next: every full_attn_interval-th layer attends, the others are gated delta-net
    # (recurrent) layers of ssm_groups key heads of ssm_state dims and ssm_heads value heads
    # (ssm_inner values in all), with a causal conv of ssm_conv taps over their q, k and v
    full_attn_interval: int = 0
    ssm_conv: int = 0
    ssm_state: int = 0
    ssm_groups: int = 0
    ssm_heads: int = 0
    ssm_inner: int = 0
    # the model layer that is this spec's layer 0: a stage of a layer split sees layers
    # [first_layer, first_layer + n_layers) of the file (which of them are recurrent)
    first_layer: int = 0

    @property
    def has_qk_norm(self) -> bool:
        return self.arch in ("qwen3moe", "qwen3next")

    @property
    def has_attn_gate(self) -> bool:
        """The attention output is multiplied by sigmoid of a gate the q projection also
        makes (qwen3next: wq rows are [q head 0, gate head 0, q head 1, ...])."""
        return self.arch == "qwen3next"

    @property
    def n_rot(self) -> int:
        return self.rope_dim or self.head_dim

    def is_recurrent(self, layer: int) -> bool:
        return (self.full_attn_interval > 0
                and (self.first_layer + layer + 1) % self.full_attn_interval != 0)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.n_layers) if not self.is_recurrent(i))

    @property
    def recurrent_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.n_layers) if self.is_recurrent(i))

    @property
    def ssm_v_dim(self) -> int:
        return self.ssm_inner // self.ssm_heads if self.ssm_heads else 0

    @property
    def ssm_channels(self) -> int:
        """Channels of the conv: q and k (ssm_groups x ssm_state each) and v (ssm_inner)."""
        return 2 * self.ssm_groups * self.ssm_state + self.ssm_inner

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
    # llama.cpp's qwen3moe and qwen3next always normalise the top-k weights; qwen2moe never does.
    return {"norm_topk": arch in ("qwen3moe", "qwen3next")}


# qwen3next's recurrent-layer sizes under llama.cpp's ssm.* keys (spec field -> key)
_SSM_KEYS = {"ssm_conv": "ssm.conv_kernel", "ssm_state": "ssm.state_size",
             "ssm_groups": "ssm.group_count", "ssm_heads": "ssm.time_step_rank",
             "ssm_inner": "ssm.inner_size"}


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
    if spec.rope_dim:
        meta[f"{a}.rope.dimension_count"] = spec.rope_dim
    if a == "qwen3next":
        meta[f"{a}.full_attention_interval"] = spec.full_attn_interval
        meta[f"{a}.attention.recurrent_layers"] = [spec.is_recurrent(i)
                                                   for i in range(spec.n_layers)]
        for field, key in _SSM_KEYS.items():
            meta[f"{a}.{key}"] = getattr(spec, field)
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
        converted = metadata_value(value, kind)
        if converted is None:
            raise ModelFormatError(
                f"{source}: metadata key {full!r} has value {value!r}, expected "
                f"{'an integer' if kind is int else kind.__name__}; the metadata is corrupt")
        return converted

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
    expert_ffn = meta.get(f"{arch}.expert_feed_forward_length")
    if isinstance(expert_ffn, (list, tuple)):  # newer llama.cpp files: one width per layer
        widths = [metadata_value(width, int) for width in expert_ffn]
        if not widths or None in widths:
            raise ModelFormatError(
                f"{source}: metadata key '{arch}.expert_feed_forward_length' is "
                f"{expert_ffn[:8]!r}, expected one integer per layer; the metadata is corrupt")
        if len(set(widths)) != 1:
            raise ModelFormatError(f"{source}: experts of different widths per layer "
                                   f"({sorted(set(widths))}) are not supported")
        expert_ffn = widths[0]
    elif expert_ffn is not None:
        expert_ffn = need("expert_feed_forward_length")
    if expert_ffn is None:
        if "blk.0.ffn_gate_exps.weight" in shapes:
            expert_ffn = int(shapes["blk.0.ffn_gate_exps.weight"][1])
        else:
            raise ModelFormatError(
                f"{source}: metadata key '{arch}.expert_feed_forward_length' is missing")
    # llama.cpp counts a qwen3next file's multi-token-prediction layer in block_count; Strata
    # does not use it (nor does llama.cpp's forward pass)
    block_count = need("block_count")
    num_nextn = opt("nextn_predict_layers", 0)
    if block_count > 0 and not 0 <= num_nextn < block_count:
        raise ModelFormatError(
            f"{source}: metadata key '{arch}.nextn_predict_layers' = {num_nextn} must lie in "
            f"0..{block_count - 1} ('{arch}.block_count' is {block_count}); the metadata is "
            "corrupt")
    n_layers = block_count - num_nextn
    if tensor_shapes is not None:
        _check_layer_count(arch, n_layers, block_count, shapes, source)
    hybrid = _hybrid_fields(arch, meta, n_layers, need, opt, source)
    spec = ModelSpec(
        arch=arch,
        n_layers=n_layers,
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
        rope_dim=opt("rope.dimension_count", 0) if arch == "qwen3next" else 0,
        **hybrid,
    )
    _check_spec(spec, source)
    return spec


def metadata_value(value, kind):
    """`value` (as GGUF metadata decodes: int, float, bool, str or list) as `kind` (int, float
    or bool), or None when it is not one: a count stored as 8.9, "8", inf or [8] is corrupt, not
    8, and "false" is not True."""
    if isinstance(value, bool):
        return value if kind is bool else None
    if kind is bool:
        return bool(value) if isinstance(value, int) and value in (0, 1) else None
    if kind is int:
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        return None
    return float(value) if isinstance(value, (int, float)) else None


def _check_layer_count(arch: str, n_layers: int, block_count: int, shapes: dict,
                       source: str) -> None:
    """Refuse a block_count the tensors do not bear out before anything loops over the layers:
    a corrupt count (say 2**32 - 1) would otherwise build per-layer tables for hours, and one
    too small would drop the last layers silently."""
    found = [int(name.split(".")[1]) for name in shapes
             if name.startswith("blk.") and name.split(".")[1].isdigit()]
    if found and max(found) >= block_count > 0:
        raise ModelFormatError(
            f"{source}: metadata key '{arch}.block_count' says {block_count} layers but the "
            f"file has tensors of layer {max(found)} (e.g. "
            f"{next(n for n in shapes if n.startswith(f'blk.{max(found)}.'))!r}); the metadata "
            "and tensors disagree")
    if n_layers <= 0 or f"blk.{n_layers - 1}.attn_norm.weight" in shapes:
        return
    last = (f"the last layer with tensors is blk.{max(found)}" if found
            else "it has no blk.* tensors")
    raise ModelFormatError(
        f"{source}: metadata key '{arch}.block_count' says {n_layers} layers but there is no "
        f"tensor 'blk.{n_layers - 1}.attn_norm.weight' ({last}); the metadata and tensors "
        "disagree")


def _hybrid_fields(arch: str, meta: dict, n_layers: int, need, opt, source: str) -> dict:
    """qwen3next's layer pattern and recurrent sizes (spec fields), checked."""
    if arch != "qwen3next":
        return {}
    fields = {field: need(key) for field, key in _SSM_KEYS.items()}
    interval = opt("full_attention_interval", 4)
    pattern = meta.get(f"{arch}.attention.recurrent_layers")
    if pattern is not None:
        pattern = [bool(x) for x in list(pattern)[:n_layers]]
        # the array allows any pattern; Strata runs llama.cpp's one, every interval-th layer
        # attending (the array's own period is tried when it differs from the key)
        period = next((i + 1 for i, r in enumerate(pattern) if not r), 0)
        for candidate in (interval, period):
            if candidate > 0 and pattern == [(i + 1) % candidate != 0 for i in range(n_layers)]:
                interval = candidate
                break
        else:
            raise ModelFormatError(
                f"{source}: '{arch}.attention.recurrent_layers' is not a repeating pattern of "
                f"recurrent layers with every n-th layer attending; Strata runs only that")
    if interval <= 0:
        raise ModelFormatError(f"{source}: '{arch}.full_attention_interval' = {interval} "
                               "must be positive")
    return dict(full_attn_interval=interval, **fields)


def _check_spec(spec: ModelSpec, source: str) -> None:
    for name in ("n_layers", "hidden", "n_heads", "n_kv_heads", "head_dim", "n_experts",
                 "n_experts_used", "expert_ffn", "vocab", "context_length"):
        if getattr(spec, name) <= 0:
            raise ModelFormatError(f"{source}: {name} = {getattr(spec, name)} must be positive")
    # NaN fails both comparisons; either value would turn every logit into NaN
    if not 0 < spec.rope_theta < math.inf:
        raise ModelFormatError(f"{source}: {spec.arch}.rope.freq_base = {spec.rope_theta} must "
                               "be a positive number; the metadata is corrupt")
    if not 0 <= spec.rms_eps < math.inf:
        raise ModelFormatError(f"{source}: {spec.arch}.attention.layer_norm_rms_epsilon = "
                               f"{spec.rms_eps} must be a number >= 0; the metadata is corrupt")
    if spec.n_heads % spec.n_kv_heads:
        raise ModelFormatError(
            f"{source}: {spec.n_heads} query heads are not a multiple of "
            f"{spec.n_kv_heads} KV heads")
    if spec.n_experts_used > spec.n_experts:
        raise ModelFormatError(
            f"{source}: uses {spec.n_experts_used} experts per token but has {spec.n_experts}")
    if spec.head_dim % 2:
        raise ModelFormatError(f"{source}: head dim {spec.head_dim} must be even for RoPE")
    if spec.arch == "qwen2moe" and not spec.has_shared_expert:
        raise ModelFormatError(
            f"{source}: qwen2moe needs '{spec.arch}.expert_shared_feed_forward_length'")
    if spec.rope_dim < 0 or spec.rope_dim > spec.head_dim or spec.rope_dim % 2:
        raise ModelFormatError(f"{source}: rope.dimension_count {spec.rope_dim} must be even "
                               f"and at most the head dim {spec.head_dim}")
    if spec.arch == "qwen3next":
        for field, key in _SSM_KEYS.items():
            if getattr(spec, field) <= 0:
                raise ModelFormatError(f"{source}: '{spec.arch}.{key}' = "
                                       f"{getattr(spec, field)} must be positive")
        if spec.ssm_heads % spec.ssm_groups or spec.ssm_inner % spec.ssm_heads:
            raise ModelFormatError(
                f"{source}: {spec.ssm_heads} value heads (ssm.time_step_rank) must be a multiple "
                f"of {spec.ssm_groups} key heads (ssm.group_count) and divide ssm.inner_size "
                f"{spec.ssm_inner}")
        if spec.full_attn_interval <= 0 or not spec.attention_layers:
            raise ModelFormatError(f"{source}: no attention layer among {spec.n_layers} with "
                                   f"full_attention_interval {spec.full_attn_interval}")
        if not spec.has_shared_expert:
            raise ModelFormatError(
                f"{source}: qwen3next needs '{spec.arch}.expert_shared_feed_forward_length'")


def expected_tensors(spec: ModelSpec, legacy: bool = False) -> dict[str, tuple[int, ...]]:
    """Every tensor the architecture needs, name -> shape in numpy order (rows, cols).
    `legacy`: a qwen3next file with ssm_in for attn_qkv and attn_gate (`legacy_ssm_in`)."""
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
        if spec.is_recurrent(i):
            _recurrent_tensors(spec, p, out, legacy)
        else:
            _attention_tensors(spec, p, out)
        # qwen3next names the norm before the experts post_attention_norm
        norm = "post_attention_norm" if spec.arch == "qwen3next" else "ffn_norm"
        out[p + norm + ".weight"] = (H,)
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


def _attention_tensors(spec: ModelSpec, p: str, out: dict) -> None:
    H = spec.hidden
    # with an output gate, each head's wq rows are its query then its gate
    out[p + "attn_q.weight"] = (spec.q_dim * (2 if spec.has_attn_gate else 1), H)
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


def _recurrent_tensors(spec: ModelSpec, p: str, out: dict, legacy: bool) -> None:
    """A gated delta-net layer as llama.cpp writes it: attn_qkv rows are q (key heads), k (key
    heads), v (value heads), the conv's channel order; attn_gate rows z of each value head;
    ssm_ba rows, per key head, its value heads' beta logits then their alpha inputs; ssm_a is
    A = -exp(A_log); ssm_norm is shared by the value heads."""
    H, Hv = spec.hidden, spec.ssm_heads
    if legacy:
        out[p + "ssm_in.weight"] = (spec.ssm_channels + spec.ssm_inner, H)
    else:
        out[p + "attn_qkv.weight"] = (spec.ssm_channels, H)
        out[p + "attn_gate.weight"] = (spec.ssm_inner, H)
    out[p + "ssm_ba.weight"] = (2 * Hv, H)
    out[p + "ssm_conv1d.weight"] = (spec.ssm_channels, spec.ssm_conv)
    out[p + "ssm_dt.bias"] = (Hv,)
    out[p + "ssm_a"] = (Hv,)
    out[p + "ssm_norm.weight"] = (spec.ssm_v_dim,)
    out[p + "ssm_out.weight"] = (H, spec.ssm_inner)


def legacy_ssm_in(spec: ModelSpec, names) -> bool:
    """True for a qwen3next file of llama.cpp's first converter: one ssm_in per layer (HF's
    in_proj_qkvz, grouped by key head) instead of attn_qkv and attn_gate."""
    layers = spec.recurrent_layers
    return bool(layers) and f"blk.{layers[0]}.ssm_in.weight" in names \
        and f"blk.{layers[0]}.attn_qkv.weight" not in names


def is_small_tensor(name: str) -> bool:
    """Norms, biases, the shared-expert gate and the recurrent layers' conv and A stay F32
    whatever type the weights use (as llama.cpp's converter keeps them)."""
    return (name.endswith((".bias", "ffn_gate_inp_shexp.weight", "ssm_conv1d.weight", ".ssm_a"))
            or "norm" in name)


def is_routed_expert(name: str) -> bool:
    return "_exps." in name
