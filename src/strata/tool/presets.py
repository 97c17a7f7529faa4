"""Model shapes `strata-tool synth` can build: name -> (ModelSpec, one-line description)."""
from __future__ import annotations

from strata.errors import ConfigError
from strata.model.arch import ModelSpec

# Size of the shipped tokenizer (`strata/data/synth_tokenizer.json`): 4089 BPE tokens + 7 special.
SYNTH_TOKENIZER_VOCAB = 4096

PRESETS: dict[str, tuple[ModelSpec, str]] = {
    "tiny": (
        ModelSpec(arch="qwen3moe", n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, head_dim=16,
                  n_experts=8, n_experts_used=2, expert_ffn=32, vocab=SYNTH_TOKENIZER_VOCAB,
                  context_length=4096),
        "qwen3moe, 2 layers, hidden 64, 8 experts top-2: fast F32 parity tests",
    ),
    "tiny-qwen2moe": (
        ModelSpec(arch="qwen2moe", n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, head_dim=16,
                  n_experts=8, n_experts_used=2, expert_ffn=32, vocab=SYNTH_TOKENIZER_VOCAB,
                  context_length=4096, shared_ffn=64, norm_topk=False),
        "qwen2moe, as tiny plus a shared expert of width 64 and attention biases",
    ),
    "tiny-qwen3next": (
        ModelSpec(arch="qwen3next", n_layers=4, hidden=64, n_heads=4, n_kv_heads=2, head_dim=32,
                  n_experts=8, n_experts_used=2, expert_ffn=32, vocab=SYNTH_TOKENIZER_VOCAB,
                  context_length=4096, rope_theta=10_000_000.0, shared_ffn=32, rope_dim=8,
                  full_attn_interval=2, ssm_conv=4, ssm_state=16, ssm_groups=2, ssm_heads=4,
                  ssm_inner=64),
        "qwen3next, 4 layers (gated delta-net and gated attention by turns), hidden 64",
    ),
    "cpu-bench": (
        ModelSpec(arch="qwen3moe", n_layers=24, hidden=1024, n_heads=16, n_kv_heads=4,
                  head_dim=64, n_experts=64, n_experts_used=8, expert_ffn=512, vocab=32000,
                  context_length=32768),
        "qwen3moe, 24 layers, hidden 1024, 64 experts top-8: the CPU benchmark (~1.4 GB Q4_0)",
    ),
    "qwen3-30b-a3b": (
        ModelSpec(arch="qwen3moe", n_layers=48, hidden=2048, n_heads=32, n_kv_heads=4,
                  head_dim=128, n_experts=128, n_experts_used=8, expert_ffn=768, vocab=151936,
                  context_length=40960, rope_theta=1_000_000.0),
        "Qwen3-30B-A3B's shape: 48 layers, 128 experts top-8 (~17 GB Q4_0)",
    ),
    "qwen3-next-80b-a3b": (
        ModelSpec(arch="qwen3next", n_layers=48, hidden=2048, n_heads=16, n_kv_heads=2,
                  head_dim=256, n_experts=512, n_experts_used=10, expert_ffn=512, vocab=151936,
                  context_length=262144, rope_theta=10_000_000.0, shared_ffn=512, rope_dim=64,
                  full_attn_interval=4, ssm_conv=4, ssm_state=128, ssm_groups=16, ssm_heads=32,
                  ssm_inner=4096),
        "Qwen3-Next-80B-A3B's shape: 36 delta-net + 12 attention layers, 512 experts top-10 "
        "(~45 GB Q4_0)",
    ),
    "olmoe-1b-7b-like": (
        ModelSpec(arch="qwen3moe", n_layers=16, hidden=2048, n_heads=16, n_kv_heads=16,
                  head_dim=128, n_experts=64, n_experts_used=8, expert_ffn=1024, vocab=50304,
                  context_length=4096),
        "qwen3moe at OLMoE-1B-7B's shape: 16 layers, 64 experts top-8",
    ),
    "qwen2-moe-a2.7b-like": (
        ModelSpec(arch="qwen2moe", n_layers=24, hidden=2048, n_heads=16, n_kv_heads=16,
                  head_dim=128, n_experts=60, n_experts_used=4, expert_ffn=1408, vocab=151936,
                  context_length=8192, shared_ffn=5632, norm_topk=False),
        "qwen2moe at Qwen1.5-MoE-A2.7B's shape: 24 layers, 60 experts top-4, shared 5632",
    ),
}


def get_preset(name: str) -> ModelSpec:
    """The ModelSpec of preset `name`; ConfigError listing the presets when it is unknown."""
    try:
        return PRESETS[name][0]
    except KeyError:
        raise ConfigError(
            f"unknown model shape {name!r}; choose one of: {', '.join(PRESETS)}") from None
