"""Which backend runs the model (`--device auto|cpu|cuda`): the CPU backend, or the CUDA backend
with every layer and expert on one GPU, or its dense part with the experts offloaded."""
from __future__ import annotations

import logging

from strata.errors import ConfigError

log = logging.getLogger("strata.engine")

DEVICES = ("auto", "cpu", "cuda")


def check_device(device: str | None) -> str:
    """The normalised device name; ConfigError naming the choices for anything else."""
    name = "auto" if device is None else str(device).strip().lower()
    if name not in DEVICES:
        raise ConfigError(f"--device {device!r} is not one of {', '.join(DEVICES)}")
    return name


def is_cuda_model(model) -> bool:
    """Whether `model` runs on the CUDA backend (its KV cells are on the device)."""
    return type(model).__module__.startswith("strata.backends.cuda")


def build_model(gguf_model, device: str | None = "auto", threads: int | None = None,
                needs_cpu_experts: bool = False, config=None):
    """The model object for `device`. `needs_cpu_experts`: the expert tier was asked for (an
    expert cache, an expert pack or a routing trace); on the GPU the model then keeps only its
    dense part in VRAM and reads the routed experts through the tier's arena (VRAM slots, the
    rest from pinned RAM over PCIe; backends/cuda/offload.py). `auto` takes the GPU when CUDA
    works and the model (its dense part, with the tier) fits; a Mixture-of-Experts model too
    large for it goes there with its experts in RAM and `config.expert_cache = "auto"` (the
    engine then builds the cache and the tier); else the CPU. It logs why.
    `config` (an EngineConfig) with --split-device / --layer-split: the layers split over GPUs
    (backends/cuda/split_model.py), the plan logged."""
    from strata.backends.cpu import CpuModel

    device = check_device(device)
    if config is not None and config.is_split and device != "cpu":
        from strata.backends.cuda.split_model import build_split_model

        return build_split_model(gguf_model, config, offload=bool(needs_cpu_experts))
    if device == "cpu":
        return CpuModel(gguf_model, num_threads=threads)
    from strata.backends import cuda

    offload = bool(needs_cpu_experts)
    if device == "cuda":
        return cuda.CudaModel(gguf_model, experts_resident=not offload)
    why_not = cuda.unavailable_reason()
    if why_not is not None:
        log.info("device auto: the CPU (no usable CUDA GPU: %s)", why_not)
        return CpuModel(gguf_model, num_threads=threads)
    try:
        model = cuda.CudaModel(gguf_model, experts_resident=not offload)
    except ConfigError as exc:
        model = _offload_when_the_dense_part_fits(cuda, gguf_model, offload, config, exc)
        if model is None:
            log.warning("device auto: the CPU, since the GPU cannot hold the model: %s", exc)
            return CpuModel(gguf_model, num_threads=threads)
        return model
    log.info("device auto: the GPU (%s)%s", model.runtime.name,
             ", routed experts in pinned RAM behind a VRAM cache" if offload else "")
    return model


def _offload_when_the_dense_part_fits(cuda, gguf_model, offload: bool, config, why):
    """`--device auto` with a Mixture-of-Experts model too large for the GPU and no expert
    option: the GPU with the dense part in VRAM and the routed experts in pinned RAM behind an
    adaptive VRAM cache (`--expert-cache auto`, set in `config` for the engine's tier), rather
    than the whole model on the CPU. None when that does not fit either, or cannot be asked
    (no config to carry the cache option, or experts already offloaded)."""
    if offload or config is None or not gguf_model.spec.n_experts:
        return None
    try:
        model = cuda.CudaModel(gguf_model, experts_resident=False)
    except ConfigError as exc:
        log.info("device auto: not the GPU with the experts in RAM either: %s", exc)
        return None
    config.expert_cache = "auto"
    log.info("device auto: the GPU (%s) with the routed experts in pinned RAM behind an "
             "adaptive VRAM cache (--expert-cache auto), since the whole model does not fit: "
             "%s", model.runtime.name, why)
    return model
