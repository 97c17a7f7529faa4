"""Which backend runs the model (`--device auto|cpu|cuda`): the CPU backend, or the CUDA backend
with every layer and expert on one GPU."""
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


def build_model(gguf_model, device: str | None = "auto", threads: int | None = None,
                needs_cpu_experts: bool = False):
    """The model object for `device`. `needs_cpu_experts`: an option that only the CPU backend
    serves yet (the expert cache, an expert pack, a routing trace) was given; `cuda` then
    refuses and `auto` picks the CPU. `auto` takes the GPU when CUDA works and the model fits,
    else the CPU, and logs why."""
    from strata.backends.cpu import CpuModel

    device = check_device(device)
    if device == "cpu":
        return CpuModel(gguf_model, num_threads=threads)
    from strata.backends import cuda

    if device == "cuda":
        if needs_cpu_experts:
            raise ConfigError(
                "--expert-cache, --expert-pack and --dump-routing run on the CPU backend so far; "
                "the CUDA backend holds every expert in VRAM. Drop them or use --device cpu")
        return cuda.CudaModel(gguf_model)
    if needs_cpu_experts:
        log.info("device auto: the CPU (the expert cache and routing traces run on the CPU "
                 "backend so far)")
        return CpuModel(gguf_model, num_threads=threads)
    if not cuda.is_available():
        log.info("device auto: the CPU (no usable CUDA GPU: PyCUDA or the driver is missing)")
        return CpuModel(gguf_model, num_threads=threads)
    try:
        model = cuda.CudaModel(gguf_model)
    except ConfigError as exc:
        log.warning("device auto: the CPU, since the GPU cannot hold the model: %s", exc)
        return CpuModel(gguf_model, num_threads=threads)
    log.info("device auto: the GPU (%s)", model.runtime.name)
    return model
