"""Do the CPU pool and GPU reach share one RAM bandwidth? Each alone, then both at once: the
GPU reading mapped pinned host memory (calibrate's reach kernel, back to back) while the CPU pool's
kernel computes Q4_0 experts of Qwen3-30B-A3B's shape from RAM (bench_pool_kernel's windows).
If the sum at once stays near the faster one alone, decode with every expert in RAM is bound by
the RAM, not by either link: 1.02 GB of experts per token at that sum is the floor of a token.

Usage, on the GPU machine: python tools/bench_ram_share.py [--threads 15] [--per-window 4]
                                                            [--seconds 3] [--gib 2]
                                                            [--cpu-read pool|sum]
                                                            [--memory numpy|pinned|huge]
Prints GB/s of the GPU alone, the CPU alone, and each at once (with their sum). `--memory
pinned|huge` puts the experts in one pinned buffer that the GPU reads too: cuMemHostAlloc's 4 KiB
pages, or transparent huge pages registered afterwards (the engine's); numpy, the default: the
experts in numpy's memory, the GPU reading a buffer of its own. `--cpu-read sum`
replaces the pool's kernel by a plain threaded sum over a 4 GiB buffer (torch's, as the
device README's RAM figures): what the RAM gives both links when the CPU side computes nothing,
i.e. whether a faster pool kernel could still raise the sum.
"""
import argparse
import time

import numpy as np

from bench_pool_kernel import make_experts, run
from strata._native import kernels
from strata.backends.cuda.runtime import import_pycuda
from strata.tool.calibrate import READ_KERNEL

Q4_0 = 2  # ggml type


def gpu_reader(drv, num_bytes, src=None):
    """(launch() -> one read of `num_bytes` queued, what to keep alive): the GPU reading `src` (a
    device address of mapped pinned host memory) or, without one, a pinned buffer of its own."""
    import warnings

    from pycuda.compiler import SourceModule

    with warnings.catch_warnings():  # nvcc's remarks arrive as UserWarnings
        warnings.simplefilter("ignore", UserWarning)
        kernel = SourceModule(READ_KERNEL, no_extern_c=True).get_function("reach_read")
    host = None
    if src is None:
        host = drv.pagelocked_empty(num_bytes, np.uint8,
                                    mem_flags=drv.host_alloc_flags.DEVICEMAP)
        host[:] = np.arange(num_bytes, dtype=np.uint64).astype(np.uint8)  # pages present
        src = host.base.get_device_pointer()
    src = np.uintp(src)
    sink = drv.mem_alloc(4)
    num_sms = drv.Context.get_device().get_attribute(drv.device_attribute.MULTIPROCESSOR_COUNT)

    def launch():
        kernel(src, np.uint64(num_bytes // 16), sink, block=(256, 1, 1), grid=(num_sms * 8, 1))
    return launch, (host, sink)


def host_experts(drv, mats, memory):
    """The experts of `mats` copied one after another into one pinned host buffer as the engine
    keeps them (offload.HostExperts, host_memory.PinnedBuffer): `pinned`, cuMemHostAlloc's 4 KiB
    pages, or `huge`, transparent huge pages registered with cuMemHostRegister (the engine's
    default). (pointers [3, n] uint64, device address, bytes, owner)."""
    import os

    from strata.backends.cuda.host_memory import ENV_PAGES, PinnedBuffer

    expert = sum(m.nbytes for m in mats[0])
    slot = -(-expert // 4096) * 4096
    os.environ[ENV_PAGES] = "small" if memory == "pinned" else "huge"
    pinned = PinnedBuffer(drv, (len(mats) * slot,))
    if pinned.pages != ("small" if memory == "pinned" else "huge"):
        raise SystemExit(f"--memory {memory}: the buffer got {pinned.pages} pages")
    buf = pinned.array
    for i, parts in enumerate(mats):
        at = i * slot
        for m in parts:
            buf[at:at + m.nbytes] = m.reshape(-1)
            at += m.nbytes
    print(f"{memory}: {pinned.huge_page_bytes() / 2**30:.2f} of {buf.nbytes / 2**30:.2f} GiB "
          "in huge pages")
    starts = buf.ctypes.data + np.arange(len(mats), dtype=np.uint64) * np.uint64(slot)
    offsets = np.cumsum([0] + [m.nbytes for m in mats[0][:-1]]).astype(np.uint64)
    pointers = (starts[None, :] + offsets[:, None]).astype(np.uint64)   # [3, n]
    return pointers, pinned.device, buf.nbytes, pinned


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


def plain_reader(threads, gib=4.0):
    """cpu(seconds) -> GB/s of torch summing a `gib` GiB int64 buffer with `threads` threads."""
    import torch

    torch.set_num_threads(threads)
    data = torch.ones(int(gib * 2**30) // 8, dtype=torch.int64)
    data.sum()                                                    # pages present

    def cpu(seconds):
        t0, passes = time.perf_counter(), 0
        while time.perf_counter() - t0 < seconds:
            data.sum()
            passes += 1
        return passes * data.numel() * 8 / (time.perf_counter() - t0) / 1e9

    return cpu


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=15)
    parser.add_argument("--per-window", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--cpu-read", choices=("pool", "sum"), default="pool")
    parser.add_argument("--memory", choices=("numpy", "pinned", "huge"), default="numpy",
                        help="where the pool's experts sit; pinned / huge: the GPU reads them "
                        "too (numpy: the GPU reads a pinned buffer of its own)")
    args = parser.parse_args()
    drv = import_pycuda()
    context = drv.Device(0).retain_primary_context()
    context.push()
    try:
        rng = np.random.default_rng(0)
        pointers, owners, expert_bytes = make_experts(rng, Q4_0, 512)
        if args.memory == "numpy":
            num_bytes = int(args.gib * 2**30) // 16 * 16
            launch, keep = gpu_reader(drv, num_bytes)
        else:
            pointers, device, num_bytes, host = host_experts(drv, owners, args.memory)
            launch, keep = gpu_reader(drv, num_bytes // 16 * 16, device)
            keep = (keep, host)
        kernels.set_num_threads(args.threads)

        def pool(seconds):
            return run(pointers, Q4_0, 512, 1, args.per_window, seconds, rng) * expert_bytes / 1e9

        cpu = plain_reader(args.threads) if args.cpu_read == "sum" else pool

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
        what = ("a plain sum" if args.cpu_read == "sum"
                else f"{args.per_window} experts per CPU window")
        print(f"{args.threads} CPU threads, {what}, "
              f"{num_bytes / 2**30:.1f} GiB read by the GPU per launch")
        print(f"alone:   GPU {gpu_alone:6.2f} GB/s, CPU {cpu_alone:6.2f} GB/s")
        print(f"at once: GPU {gpu_both:6.2f} GB/s, CPU {cpu_both:6.2f} GB/s, sum "
              f"{gpu_both + cpu_both:6.2f} GB/s ({len(inside)} GPU reads inside the CPU's run)")
        del owners, keep
    finally:
        context.pop()


if __name__ == "__main__":
    main()
