"""Synth-model shapes the CUDA tests use per weight type (k-quants need rows of 256)."""

K_TYPES = ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_xs")
TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0") + K_TYPES
K_QUANT_OVERRIDES = {"hidden": 256, "expert_ffn": 256, "head_dim": 64}


def synth_overrides(shape: str, weight_type: str) -> dict:
    if weight_type in K_TYPES:
        extra = {"shared_ffn": 256} if shape == "tiny-qwen2moe" else {}
        return {**K_QUANT_OVERRIDES, **extra}
    return {}


def num_gpus() -> int:
    """GPUs the driver sees (the two-GPU tests skip with fewer)."""
    import pycuda.driver as drv

    drv.init()
    return drv.Device.count()


def write_split_test_model(out) -> None:
    """The layer-split and drafts tests' model: tiny Q8_0 with 4 layers and skewed routing (hot
    experts for the tiers to chase)."""
    from strata.tool.synth import synth_model

    synth_model(out, shape="tiny", weight_type="q8_0", seed=11, routing_skew=1.0, n_layers=4)
