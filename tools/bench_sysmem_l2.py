"""Does the GPU's L2 keep what a kernel read from mapped pinned host memory (GPU reach), and can
an L2 prefetch bring an expert's bytes over PCIe while another kernel reads other bytes? A
decode window reads a PCIe expert's gate/up and then, after the SiLU and the quantize, its down
(docs/offload.md, "Window by window"): if the down could be on its way during the gate/up, the
GPU's side of a one-slot window at 0% would shrink by about the down's read.

Usage, on the GPU machine: python tools/bench_sysmem_l2.py [--reps 20] [--gib 1]
Prints microseconds (medians over reps, each rep on bytes no earlier rep touched, so the L2
starts cold) for a read of a down-sized range (2048 x 432 bytes, Qwen3-30B-A3B's Q4_0 down)
and a gate/up-sized one (2 x 768 x 1152), from mapped pinned host memory:
  read D cold / read D again (L2 hit?) / read D after a bulk L2 prefetch of D and a pause /
  GU then D / prefetch D, GU, then D (bulk and per-line prefetch).
"""
import argparse
import statistics
import warnings

import numpy as np

from strata.backends.cuda.runtime import import_pycuda

KERNELS = r"""
extern "C" __global__ void read_sum(const uint4 *src, unsigned long long num_vec,
                                    unsigned int *sink) {
    uint4 acc = make_uint4(0, 0, 0, 0);
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
         i < num_vec; i += (unsigned long long)gridDim.x * blockDim.x) {
        uint4 v = src[i];
        acc.x ^= v.x; acc.y ^= v.y; acc.z ^= v.z; acc.w ^= v.w;
    }
    if ((acc.x ^ acc.y ^ acc.z ^ acc.w) == 0x9e3779b9u) atomicAdd(sink, 1u);
}

// one thread per `chunk` bytes: cp.async.bulk.prefetch.L2 (sm_90), fire and forget
extern "C" __global__ void prefetch_bulk(const char *src, unsigned long long num_bytes,
                                         unsigned int chunk) {
    const unsigned long long i = (blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x)
                                 * chunk;
    if (i >= num_bytes) return;
    const unsigned int n = (unsigned int)min((unsigned long long)chunk, num_bytes - i);
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(src + i), "r"(n)
                 : "memory");
}

// one thread per 128-byte line: prefetch.global.L2
extern "C" __global__ void prefetch_lines(const char *src, unsigned long long num_bytes) {
    for (unsigned long long i = (blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x)
                                * 128ull;
         i < num_bytes; i += (unsigned long long)gridDim.x * blockDim.x * 128ull)
        asm volatile("prefetch.global.L2 [%0];" :: "l"(src + i) : "memory");
}

// a pause on the device: spins for `ns`
extern "C" __global__ void pause_ns(unsigned long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
}
"""

DOWN_BYTES = 2048 * 432          # one Q4_0 down matrix of Qwen3-30B-A3B's shape
GATEUP_BYTES = 2 * 768 * 1152    # its gate and up


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--experts", type=int, default=2, help="PCIe experts a layer (D and GU x)")
    ap.add_argument("--chunk", type=int, default=16384, help="bytes per bulk prefetch")
    args = ap.parse_args()
    drv = import_pycuda()
    import pycuda.autoinit  # noqa: F401
    from pycuda.compiler import SourceModule

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        mod = SourceModule(KERNELS, no_extern_c=True, arch="sm_90")
    read, bulk = mod.get_function("read_sum"), mod.get_function("prefetch_bulk")
    lines, pause = mod.get_function("prefetch_lines"), mod.get_function("pause_ns")
    total = int(args.gib * (1 << 30))
    host = drv.pagelocked_empty(total, np.uint8, mem_flags=drv.host_alloc_flags.DEVICEMAP)
    host[:] = np.arange(total, dtype=np.uint64).astype(np.uint8)
    base = host.base.get_device_pointer()
    sink = drv.mem_alloc(4)
    sms = drv.Context.get_device().get_attribute(drv.device_attribute.MULTIPROCESSOR_COUNT)
    stream = drv.Stream()
    d_bytes, gu_bytes = args.experts * DOWN_BYTES, args.experts * GATEUP_BYTES
    span = (d_bytes + gu_bytes + 4095) // 4096 * 4096
    cursor = [0]

    def fresh() -> tuple[int, int]:
        """(D, GU) addresses no earlier rep read"""
        if cursor[0] + span > total:
            cursor[0] = 0
        at = base + cursor[0]
        cursor[0] += span
        return at, at + d_bytes

    def do_read(src, num_bytes):
        read(np.uintp(src), np.uint64(num_bytes // 16), sink, block=(256, 1, 1),
             grid=(sms * 8, 1), stream=stream)

    def do_bulk(src, num_bytes):
        n = (num_bytes + args.chunk - 1) // args.chunk
        bulk(np.uintp(src), np.uint64(num_bytes), np.uint32(args.chunk), block=(128, 1, 1),
             grid=((n + 127) // 128, 1), stream=stream)

    def do_lines(src, num_bytes):
        lines(np.uintp(src), np.uint64(num_bytes), block=(256, 1, 1), grid=(sms * 2, 1),
              stream=stream)

    def timed(steps) -> float:
        """us from before the first to after the last of steps (callables), one rep"""
        a, b = drv.Event(), drv.Event()
        a.record(stream)
        for s in steps:
            s()
        b.record(stream)
        b.synchronize()
        return b.time_since(a) * 1000.0

    def measure(name, make):
        for _ in range(3):  # warm-up
            timed(make(*fresh()))
        t = [timed(make(*fresh())) for _ in range(args.reps)]
        print(f"{name:44s} {statistics.median(t):8.1f} us  (min {min(t):.1f})", flush=True)
        return statistics.median(t)

    def pause_for(us):
        return lambda: pause(np.uint64(int(us * 1000)), block=(1, 1, 1), grid=(1, 1),
                             stream=stream)

    print(f"D = {d_bytes} bytes ({args.experts} downs), GU = {gu_bytes} bytes; "
          f"{sms} SMs; reps {args.reps}")
    t_d = measure("read D cold", lambda d, g: [lambda: do_read(d, d_bytes)])
    t_dd = measure("read D, read D again (both)",
                   lambda d, g: [lambda: do_read(d, d_bytes), lambda: do_read(d, d_bytes)])
    print(f"  -> second read of D: {t_dd - t_d:.1f} us")
    t_p = measure("pause 100 us", lambda d, g: [pause_for(100)])
    t_bp = measure("bulk prefetch D, pause 100, read D",
                   lambda d, g: [lambda: do_bulk(d, d_bytes), pause_for(100),
                                 lambda: do_read(d, d_bytes)])
    print(f"  -> read D after its bulk prefetch: {t_bp - t_p:.1f} us")
    t_lp = measure("line prefetch D, pause 100, read D",
                   lambda d, g: [lambda: do_lines(d, d_bytes), pause_for(100),
                                 lambda: do_read(d, d_bytes)])
    print(f"  -> read D after its line prefetch: {t_lp - t_p:.1f} us")
    measure("read GU", lambda d, g: [lambda: do_read(g, gu_bytes)])
    measure("read GU, read D",
            lambda d, g: [lambda: do_read(g, gu_bytes), lambda: do_read(d, d_bytes)])
    measure("bulk prefetch D, read GU, read D",
            lambda d, g: [lambda: do_bulk(d, d_bytes), lambda: do_read(g, gu_bytes),
                          lambda: do_read(d, d_bytes)])
    measure("line prefetch D, read GU, read D",
            lambda d, g: [lambda: do_lines(d, d_bytes), lambda: do_read(g, gu_bytes),
                          lambda: do_read(d, d_bytes)])
    measure("read GU and D as one range", lambda d, g: [lambda: do_read(d, d_bytes + gu_bytes)])


if __name__ == "__main__":
    main()
