"""`strata-tool calibrate MODEL`: measure the GPU's reach over PCIe and the CPU pool's expert
throughput on this machine, time decode at each PCIe share of the cache misses (share_sweep.py),
and store the fastest share (share.py).
"""
from __future__ import annotations

import re
import time

import click
import numpy as np

from strata.errors import ConfigError, StrataError
from strata.tool.fail import fail

# A plain read of mapped pinned host memory: every byte crosses PCIe once (the GPU's reach of a
# missing expert reads its blocks the same way, once per window).
READ_KERNEL = r"""
extern "C" __global__ void reach_read(const uint4 *src, unsigned long long num_vec,
                                      unsigned int *sink) {
    uint4 acc = make_uint4(0, 0, 0, 0);
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
         i < num_vec; i += (unsigned long long)gridDim.x * blockDim.x) {
        uint4 v = src[i];
        acc.x ^= v.x; acc.y ^= v.y; acc.z ^= v.z; acc.w ^= v.w;
    }
    if ((acc.x ^ acc.y ^ acc.z ^ acc.w) == 0x9e3779b9u) atomicAdd(sink, 1u);  // keeps the reads
}
"""


def measure_cpu_pool(store, threads: int, seconds: float = 2.0, rows: int = 1,
                     seed: int = 0) -> dict:
    """Distinct experts per second the CPU pool's kernel computes from RAM: windows of `rows`
    rows (1: a decode step, where the pool matters), each routed to top-K experts no other row
    of the window shares, layer after layer (so the experts come from RAM, not the CPU caches)."""
    from strata._native import kernels

    spec = store.model.spec
    H, E, K, F = spec.hidden, spec.n_experts, spec.n_experts_used, spec.expert_ffn
    rows = max(1, min(rows, E // K))
    pointers = store.expert_pointers()  # [L, 3, E]
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, H)) / np.sqrt(H)).astype(np.float32)       # [R, H]
    wts = rng.random((rows, K)).astype(np.float32)                               # [R, K]
    out = np.zeros((rows, H), dtype=np.float32)
    before = kernels.get_num_threads()
    kernels.set_num_threads(threads)
    num_experts, num_calls, elapsed_s = 0, 0, 0.0
    try:
        start = time.perf_counter()
        while elapsed_s < seconds or num_calls < store.n_layers:
            layer = num_calls % store.n_layers
            ids = rng.permutation(E)[:rows * K].reshape(rows, K).astype(np.int32)  # [R, K]
            gate_type, up_type, down_type = store.types(layer)
            kernels.moe_ffn_ptrs(x, np.ascontiguousarray(pointers[layer]), gate_type, up_type,
                                 down_type, F, ids, wts, out)
            num_experts += rows * K
            num_calls += 1
            elapsed_s = time.perf_counter() - start
    finally:
        kernels.set_num_threads(before)
    return {"cpu_experts_per_s": num_experts / elapsed_s, "cpu_rows": rows,
            "cpu_calls": num_calls, "cpu_seconds": elapsed_s}


def measure_gpu_reach(device_index: int = 0, num_bytes: int = 256 << 20,
                      repeats: int = 5) -> dict:
    """Bytes per second a GPU kernel reads from mapped pinned host memory (best of `repeats`),
    and the GPU's name."""
    from strata.backends.cuda.runtime import import_pycuda

    drv = import_pycuda()
    if not 0 <= device_index < drv.Device.count():
        raise ConfigError(f"CUDA device {device_index} does not exist: this machine has "
                          f"{drv.Device.count()}")
    device = drv.Device(device_index)
    context = device.retain_primary_context()
    context.push()
    try:
        import warnings

        from pycuda.compiler import SourceModule

        with warnings.catch_warnings():  # nvcc's remarks arrive as UserWarnings
            warnings.simplefilter("ignore", UserWarning)
            kernel = SourceModule(READ_KERNEL, no_extern_c=True).get_function("reach_read")
        host = drv.pagelocked_empty(num_bytes, np.uint8,
                                    mem_flags=drv.host_alloc_flags.DEVICEMAP)
        host[:] = np.arange(num_bytes, dtype=np.uint64).astype(np.uint8)  # pages present
        src = np.uintp(host.base.get_device_pointer())
        sink = drv.mem_alloc(4)
        num_sms = device.get_attribute(drv.device_attribute.MULTIPROCESSOR_COUNT)
        grid = (num_sms * 8, 1)
        best_s = float("inf")
        start, end = drv.Event(), drv.Event()
        for _ in range(repeats + 1):  # the first launch warms up
            start.record()
            kernel(src, np.uint64(num_bytes // 16), sink, block=(256, 1, 1), grid=grid)
            end.record()
            end.synchronize()
            best_s = min(best_s, end.time_since(start) / 1e3)
        name = device.name()
        sink.free()
        host.base.free()
    finally:
        context.pop()
    return {"gpu": name, "gpu_reach_bytes_per_s": num_bytes / best_s, "gpu_read_bytes": num_bytes}


def _no_gpu_message(exc: Exception) -> str:
    """The error of a machine calibrate cannot measure: what CUDA said, without its hint to run
    with --device cpu (calibrate has no CPU mode: the CPU backend splits nothing)."""
    reason = re.sub(r"[,;]? ?(or )?run with --device cpu$", "", str(exc)).rstrip(" ,;")
    return (f"calibrate needs the GPU to measure its PCIe reach: {reason}; the CPU backend "
            f"needs no calibration (it has no PCIe share to set)")


def _need_gpu() -> None:
    """Refuse at once on a machine without a usable GPU, before timing the CPU pool."""
    from strata.backends.cuda import unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        fail(_no_gpu_message(ConfigError(reason)))


@click.command()
@click.argument("model_path", metavar="MODEL", type=click.Path(dir_okay=False))
@click.option("--threads", "-t", default=None, type=click.IntRange(min=1),
              help="CPU pool threads (default: the pool's, all cores but one); the share is "
                   "stored for this count.")
@click.option("--seconds", default=2.0, show_default=True, type=click.FloatRange(0.01, 3600),
              help="How long to time the CPU pool.")
@click.option("--rows", default=1, show_default=True, type=click.IntRange(min=1),
              help="Rows per timed CPU window (1: decode), each with its own top-K experts.")
@click.option("--device-index", default=0, show_default=True, type=click.IntRange(min=0),
              help="Which GPU.")
@click.option("--sweep/--no-sweep", default=True, show_default=True,
              help="Time decode windows of MODEL at each share and store the fastest (needs "
                   "the dense part in VRAM and every expert pinned in RAM); --no-sweep stores "
                   "the share the two rates suggest.")
def calibrate(model_path, threads, seconds, rows, device_index, sweep):
    """Measure how fast the GPU reads missing experts over PCIe and how fast the CPU pool computes
    them, time decode at each PCIe share of the misses, and store the fastest share
    (`--pcie-frac` unset reads it) for MODEL, this GPU and the thread count."""
    from strata.backends.cuda.cpu_pool import default_pool_threads
    from strata.backends.cuda.share import share_from_rates, store_calibration
    from strata.experts.store import ExpertStore
    from strata.model.gguf_file import GGUFModel

    if seconds != seconds:  # NaN passes click's range check; the timing loop stopped at once
        raise click.BadParameter("nan: give a number of seconds in 0.01..3600",
                                 param_hint="--seconds")
    threads = threads or default_pool_threads()
    _need_gpu()
    try:
        with GGUFModel.open(model_path) as model:
            store = ExpertStore.from_gguf(model)
            expert_nbytes = store.expert_nbytes
            cpu = measure_cpu_pool(store, threads, seconds, rows)
            del store
    except StrataError as exc:
        fail(str(exc))
    except OSError as exc:
        fail(f"cannot read {model_path}: {exc.strerror or exc}")
    size = (f"{expert_nbytes / 2**20:.2f} MiB" if expert_nbytes >= 2**20
            else f"{expert_nbytes / 2**10:.1f} KiB")
    click.echo(f"CPU pool ({threads} thread{'s' if threads > 1 else ''}): "
               f"{cpu['cpu_experts_per_s']:,.0f} experts/s ({cpu['cpu_rows']} row"
               f"{'s' if cpu['cpu_rows'] > 1 else ''} per window, "
               f"{cpu['cpu_calls']} windows in {cpu['cpu_seconds']:.2f} s; {size} per expert)")
    try:
        gpu = measure_gpu_reach(device_index)
    except ConfigError as exc:
        fail(_no_gpu_message(exc))
    gpu_experts_per_s = gpu["gpu_reach_bytes_per_s"] / expert_nbytes
    click.echo(f"GPU reach ({gpu['gpu']}): {gpu['gpu_reach_bytes_per_s'] / 1e9:.1f} GB/s from "
               f"mapped pinned RAM = {gpu_experts_per_s:,.0f} experts/s")
    frac = rates_frac = share_from_rates(gpu_experts_per_s, cpu["cpu_experts_per_s"])
    details = {**cpu, **gpu, "expert_bytes": expert_nbytes,
               "gpu_experts_per_s": gpu_experts_per_s, "rates_pcie_frac": rates_frac}
    click.echo(f"the two rates suggest a PCIe share of {rates_frac:.3f}")
    if sweep:
        from strata.tool.share_sweep import sweep_shares

        try:
            timed = sweep_shares(model_path, threads, device_index)
        except StrataError as exc:
            fail(f"timing decode at each share: {exc} (--no-sweep stores the rates' share)")
        click.echo("decode tokens/s, every routed expert a miss, by PCIe share (in brackets, ms "
                   "per window: the CPU pool's compute / wait for the GPU / start after the "
                   "post):")
        speeds = timed["tokens_per_s"]
        click.echo("share  " + "  ".join(f"{n} slot{'s' if n > 1 else ''}".rjust(32)
                                         for n in speeds))
        for i, share in enumerate(timed["shares"]):
            click.echo(f"{share:5.2f}  " + "  ".join(
                f"{speeds[n][i]:9.1f} ({timed['pool_ms'][n][i]:5.2f} / "
                f"{timed['wait_ms'][n][i]:5.2f} / {timed['lag_ms'][n][i]:5.3f})"
                for n in speeds))
        frac = timed["best"]
        details["sweep"] = {"shares": timed["shares"],
                            "tokens_per_s": {str(k): v for k, v in timed["tokens_per_s"].items()},
                            "pool_ms": {str(k): v for k, v in timed["pool_ms"].items()},
                            "wait_ms": {str(k): v for k, v in timed["wait_ms"].items()},
                            "lag_ms": {str(k): v for k, v in timed["lag_ms"].items()}}
    path = store_calibration(model_path, gpu["gpu"], threads, frac, details)
    click.echo(f"PCIe share of cache misses: {frac:.3f} (CPU pool {1 - frac:.3f}); stored in "
               f"{path}")
