"""Synth-model shapes the CUDA tests use per weight type (k-quants need rows of 256)."""

TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_k", "q5_k", "q6_k")
K_QUANT_OVERRIDES = {"hidden": 256, "expert_ffn": 256, "head_dim": 64}


def synth_overrides(shape: str, weight_type: str) -> dict:
    if weight_type in ("q4_k", "q5_k", "q6_k"):
        extra = {"shared_ffn": 256} if shape == "tiny-qwen2moe" else {}
        return {**K_QUANT_OVERRIDES, **extra}
    return {}
