"""Which backend runs the model (`--device auto|cpu|cuda`): the CPU backend, or the CUDA backend
with every layer and expert on one GPU, or its dense part with the experts offloaded."""
from __future__ import annotations

import logging
import sys

from strata.errors import ConfigError

log = logging.getLogger("strata.engine")

DEVICES = ("auto", "cpu", "cuda")
# --no-mmap reads the weights into RAM only with this much memory left over besides
READ_HEADROOM = 512 << 20


def check_device(device: str | None) -> str:
    """The normalised device name; ConfigError naming the choices for anything else."""
    name = "auto" if device is None else str(device).strip().lower()
    if name not in DEVICES:
        raise ConfigError(f"--device {device!r} is not one of {', '.join(DEVICES)}")
    return name


def release_thread_gpu() -> None:
    """For a thread that built models and now ends: the GPU contexts it made current come off
    its stack (else PyCUDA aborts the process as the thread ends). Nothing without CUDA."""
    runtime = sys.modules.get("strata.backends.cuda.runtime")
    if runtime is not None:
        runtime.release_thread()


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
    device = check_device(device)
    if config is not None and config.is_split and device != "cpu":
        from strata.backends.cuda.split_model import build_split_model

        return build_split_model(gguf_model, config, offload=bool(needs_cpu_experts))
    if device == "cpu":
        return _cpu_model(gguf_model, threads, config)
    from strata.backends import cuda

    offload = bool(needs_cpu_experts)
    if device == "cuda":
        return cuda.CudaModel(gguf_model, experts_resident=not offload)
    why_not = cuda.unavailable_reason()
    if why_not is not None:
        log.info("device auto: the CPU (no usable CUDA GPU: %s)", why_not)
        return _cpu_model(gguf_model, threads, config)
    try:
        model = cuda.CudaModel(gguf_model, experts_resident=not offload)
    except ConfigError as exc:
        model = _offload_when_the_dense_part_fits(cuda, gguf_model, offload, config, exc)
        if model is None:
            log.warning("device auto: the CPU, since the GPU cannot hold the model: %s", exc)
            return _cpu_model(gguf_model, threads, config)
        return model
    log.info("device auto: the GPU (%s)%s", model.runtime.name,
             ", routed experts in pinned RAM behind a VRAM cache" if offload else "")
    return model


def _cpu_model(gguf_model, threads, config):
    """The CPU backend's model, its weights read into RAM first with `--no-mmap`."""
    from strata.backends.cpu import CpuModel

    if config is not None and not config.mmap:
        check_room_to_read(gguf_model)
        seconds = gguf_model.load_into_memory()
        log.info("model: weights read into RAM, huge pages asked for (--no-mmap; %.2f GiB in "
                 "%.1f s)", gguf_model.tensor_bytes / 2**30, seconds)
    else:
        log.info("model: weights served from the file's memory map (%.2f GiB; --no-mmap reads "
                 "them into RAM)", gguf_model.tensor_bytes / 2**30)
    return CpuModel(gguf_model, num_threads=threads)


def check_room_to_read(gguf_model) -> None:
    """ConfigError when the memory the kernel can hand out (MemAvailable, the file's own page
    cache included) cannot hold the weights and READ_HEADROOM besides: --no-mmap would end in
    the OOM killer or in swap rather than in a message."""
    from strata.model.host_pages import available_bytes

    need = gguf_model.tensor_bytes + READ_HEADROOM
    available = available_bytes()
    if available is not None and available < need:
        raise ConfigError(
            f"--no-mmap: reading the weights into RAM needs {need / 2**30:.2f} GiB with "
            f"headroom but {available / 2**30:.2f} GiB are available; free memory, or leave "
            "--no-mmap out to compute from the file's memory map")


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
