"""Synth-model shapes the CUDA tests use per weight type (k-quants and i-quants need rows of
256)."""
import numpy as np

K_TYPES = ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_xs")
# other 32-column block types: llama.cpp's fallbacks in k-quant files for rows that are not a
# multiple of 256 (Q5_0, Q5_1, IQ4_NL) and the Q4_1 / Q5_1 presets
B32_TYPES = ("q4_1", "q5_0", "q5_1", "iq4_nl")
# the grid i-quants (256-column super-blocks: common.cuh's iq_group, mmq_k.cu's tiles)
IQ_TYPES = ("iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq1_s", "iq1_m")
TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0") + K_TYPES + B32_TYPES + IQ_TYPES
# the types whose activations the CPU quantises per 256 columns (quant.h's ST_ACT_K: the
# k-quants since session 99, the grid i-quants since 100), where the GPU's are per 32
ACT256_TYPES = K_TYPES + IQ_TYPES
K_QUANT_OVERRIDES = {"hidden": 256, "expert_ffn": 256, "head_dim": 64}


def iq_blocks(weight_type: str, num_values: int, std: float, rng):
    """Random blocks of a grid i-quant (flat uint8) and gguf's dequantisation of them (float32):
    random bytes (every grid index, sign and scale bit pattern is valid) with a signed fp16 d of
    about std / 40 (IQ1_M: d's 4 nibbles in the top bits of its 4 u16 scales)."""
    from gguf import GGMLQuantizationType as QT
    from gguf import quants
    from gguf.constants import GGML_QUANT_SIZES

    qtype = getattr(QT, weight_type.upper())
    block_size, block_bytes = GGML_QUANT_SIZES[qtype]
    n = num_values // block_size
    raw = rng.integers(0, 256, (n, block_bytes), dtype=np.uint8)
    d = (rng.standard_normal(n) * (std / 40)).astype(np.float16).view(np.uint16)
    if qtype == QT.IQ1_M:
        scales = raw[:, 48:56].copy().view(np.uint16)  # [n, 4]
        for k in range(4):
            scales[:, k] = (scales[:, k] & 0x0FFF) | (((d >> (4 * k)) & 0xF) << 12)
        raw[:, 48:56] = scales.view(np.uint8)
    else:
        raw[:, :2] = d.view(np.uint8).reshape(n, 2)
    raw = raw.reshape(-1)
    return raw, np.asarray(quants.dequantize(raw, qtype), dtype=np.float32).reshape(-1)


# llama.cpp's k-quant files give a tensor whose rows are not a multiple of 256 a fallback type
# (its llama_tensor_get_type): Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, Q2_K / Q3_K / IQ4_XS ->
# IQ4_NL (Qwen1.5-MoE's expert down, K = 1408, in its Q4_K_M file: Q5_0 and Q8_0). synth does
# the same, so these shapes (expert and shared widths of 96) give such files: weight type ->
# the fallback types of the 96-column rows (Q8_0: the Q6_K rows of the Q4_K_M / Q5_K_M mixes).
FALLBACK_OVERRIDES = {"hidden": 256, "head_dim": 64, "expert_ffn": 96}
FALLBACK_TYPES = {"q4_k_m": ("Q5_0", "Q8_0"), "q5_k_m": ("Q5_1", "Q8_0"), "q3_k": ("IQ4_NL",),
                  "q2_k": ("IQ4_NL",), "iq4_xs": ("IQ4_NL",)}


def fallback_overrides(shape: str) -> dict:
    """synth_model overrides whose expert (and shared) down rows are 96 columns long."""
    extra = {"shared_ffn": 96} if shape == "tiny-qwen2moe" else {}
    return {**FALLBACK_OVERRIDES, **extra}


def synth_overrides(shape: str, weight_type: str) -> dict:
    if weight_type in K_TYPES + IQ_TYPES:
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


def write_pool_test_model(out, n_layers: int = 4) -> None:
    """The CPU pool's and the read-ahead's tests' model: tiny (8 experts, top-2) Q8_0 with
    skewed routing."""
    from strata.tool.synth import synth_model

    synth_model(out, shape="tiny", weight_type="q8_0", seed=12, routing_skew=1.0,
                n_layers=n_layers)
