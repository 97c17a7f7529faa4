"""Do the CPU pool and GPU reach share one RAM bandwidth? Each alone, then both at once: the
GPU reading mapped pinned host memory (calibrate's reach kernel, back to back) while the CPU pool's
kernel computes Q4_0 experts of Qwen3-30B-A3B's shape from RAM (bench_pool_kernel's windows).
If the sum at once stays near the faster one alone, decode with every expert in RAM is bound by
the RAM, not by either link: 1.02 GB of experts per token at that sum is the floor of a token.

Usage, on the GPU machine: python tools/bench_ram_share.py [--threads 15] [--per-window 4]
                                                            [--seconds 3] [--gib 2]
Prints GB/s of the GPU alone, the CPU alone, and each at once (with their sum).
"""
import argparse
import time

import numpy as np

from bench_pool_kernel import make_experts, run
from strata._native import kernels
from strata.backends.cuda.runtime import import_pycuda
from strata.tool.calibrate import READ_KERNEL

Q4_0 = 2  # ggml type


def gpu_reader(drv, num_bytes):
    """(launch() -> one read of the whole buffer queued, its bytes)."""
    import warnings

    from pycuda.compiler import SourceModule

    with warnings.catch_warnings():  # nvcc's remarks arrive as UserWarnings
        warnings.simplefilter("ignore", UserWarning)
        kernel = SourceModule(READ_KERNEL, no_extern_c=True).get_function("reach_read")
    host = drv.pagelocked_empty(num_bytes, np.uint8, mem_flags=drv.host_alloc_flags.DEVICEMAP)
    host[:] = np.arange(num_bytes, dtype=np.uint64).astype(np.uint8)  # pages present
    src = np.uintp(host.base.get_device_pointer())
    sink = drv.mem_alloc(4)
    num_sms = drv.Context.get_device().get_attribute(drv.device_attribute.MULTIPROCESSOR_COUNT)

    def launch():
        kernel(src, np.uint64(num_bytes // 16), sink, block=(256, 1, 1), grid=(num_sms * 8, 1))
    return launch, (host, sink)


def queue_reads(drv, launch, launches):
    """Queue `launches` whole-buffer reads back to back: (start event, each read's end event)."""
    start = drv.Event()
    start.record()
    ends = []
    for _ in range(launches):
        launch()
        ends.append(drv.Event())
        ends[-1].record()
    return start, ends


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=15)
    parser.add_argument("--per-window", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--gib", type=float, default=2.0)
    args = parser.parse_args()
    drv = import_pycuda()
    context = drv.Device(0).retain_primary_context()
    context.push()
    try:
        num_bytes = int(args.gib * 2**30) // 16 * 16
        launch, keep = gpu_reader(drv, num_bytes)
        rng = np.random.default_rng(0)
        pointers, owners, expert_bytes = make_experts(rng, Q4_0, 512)
        kernels.set_num_threads(args.threads)

        def cpu(seconds):
            return run(pointers, Q4_0, 512, 1, args.per_window, seconds, rng) * expert_bytes / 1e9

        launch()
        drv.Context.synchronize()                                 # warm
        start, ends = queue_reads(drv, launch, 8)
        ends[-1].synchronize()
        gpu_alone = 8 * num_bytes / (ends[-1].time_since(start) / 1e3) / 1e9
        cpu_alone = cpu(args.seconds)
        # both: enough reads queued to outlast the CPU's run even at half speed
        launches = int(args.seconds * gpu_alone * 1e9 / num_bytes * 2) + 2
        start, ends = queue_reads(drv, launch, launches)
        t0 = time.perf_counter()
        time.sleep(0.05)                                          # the GPU's reads under way
        c0 = time.perf_counter() - t0
        cpu_both = cpu(args.seconds)
        c1 = time.perf_counter() - t0
        ends[-1].synchronize()
        done = [e.time_since(start) / 1e3 for e in ends]          # s after start, per launch
        inside = [i for i, t in enumerate(done) if c0 <= t <= c1]
        if len(inside) >= 2:
            first, last = inside[0], inside[-1]
            gpu_both = (last - first) * num_bytes / (done[last] - done[first]) / 1e9
        else:
            gpu_both = float("nan")
        print(f"{args.threads} CPU threads, {args.per_window} experts per CPU window, "
              f"{num_bytes / 2**30:.1f} GiB read by the GPU per launch")
        print(f"alone:   GPU {gpu_alone:6.2f} GB/s, CPU {cpu_alone:6.2f} GB/s")
        print(f"at once: GPU {gpu_both:6.2f} GB/s, CPU {cpu_both:6.2f} GB/s, sum "
              f"{gpu_both + cpu_both:6.2f} GB/s ({len(inside)} GPU reads inside the CPU's run)")
        del owners, keep
    finally:
        context.pop()


if __name__ == "__main__":
    main()
