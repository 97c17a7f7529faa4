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
    works and the model (its dense part, with the tier) fits, else the CPU, and logs why.
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
    if not cuda.is_available():
        log.info("device auto: the CPU (no usable CUDA GPU: PyCUDA or the driver is missing)")
        return CpuModel(gguf_model, num_threads=threads)
    try:
        model = cuda.CudaModel(gguf_model, experts_resident=not offload)
    except ConfigError as exc:
        log.warning("device auto: the CPU, since the GPU cannot hold the model: %s", exc)
        return CpuModel(gguf_model, num_threads=threads)
    log.info("device auto: the GPU (%s)%s", model.runtime.name,
             ", routed experts in pinned RAM behind a VRAM cache" if offload else "")
    return model
