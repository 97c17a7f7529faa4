"""Benchmark the native CPU kernels at the target model's shapes (hidden 1024, 64 experts of
width 512, top-8): matmul at T = 1, 64, 512 and moe_ffn for decode and a 512-token prompt.

Usage: python tools/bench_kernels.py [--threads 2] [--repeats 7] [--types Q4_0,Q8_0,...]
                                    [--only matmul|moe] [--cpu-time]
Prints GMAC/s (medians, and the best run) and the implied time per token.
"""
import argparse
import statistics
import time

import gguf
import numpy as np

from strata._native import kernels

T = gguf.GGMLQuantizationType
HIDDEN, NUM_EXPERTS, TOP_K, EXPERT_WIDTH = 1024, 64, 8, 512
_FP16_FIELDS = {T.Q4_0: (0,), T.Q8_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2),
                T.IQ4_NL: (0,), T.IQ4_XS: (0,), T.Q2_K: (80, 82), T.Q3_K: (108,),
                T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,),
                # the grid i-quants (IQ1_M's d is in its scales' top bits: random, for timing)
                T.IQ2_XXS: (0,), T.IQ2_XS: (0,), T.IQ2_S: (0,), T.IQ3_XXS: (0,), T.IQ3_S: (0,),
                T.IQ1_S: (0,), T.IQ1_M: ()}


def random_weight(rng, qtype, rows, cols):
    """uint8[rows, row_bytes] of random blocks with sane fp16 scales."""
    if qtype in (T.F32, T.F16, T.BF16):
        w = rng.standard_normal((rows, cols)).astype(np.float32)
        if qtype == T.F16:
            return w.astype(np.float16).view(np.uint8)
        return w.view(np.uint8) if qtype == T.F32 else gguf.quants.quantize(w, qtype)
    bs, ts = gguf.GGML_QUANT_SIZES[qtype]
    n_blocks = rows * cols // bs
    blocks = rng.integers(0, 256, size=(n_blocks, ts), dtype=np.uint8)
    for off in _FP16_FIELDS[qtype]:
        d = rng.uniform(1e-3, 1e-2, size=n_blocks).astype(np.float16)
        blocks[:, off:off + 2] = d.view(np.uint8).reshape(n_blocks, 2)
    return blocks.reshape(rows, cols // bs * ts)


def median_seconds(fn, repeats):
    """Median wall time of fn (process CPU time with --cpu-time: on a busy machine that is
    what one thread costs); the minimum is kept in MIN_SECONDS."""
    clock = time.process_time if CPU_TIME[0] else time.perf_counter
    fn()                                           # warm-up (page-in, thread start)
    times = []
    for _ in range(repeats):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    MIN_SECONDS[0] = min(times)
    return statistics.median(times)


MIN_SECONDS = [0.0]
CPU_TIME = [False]


def bench_matmul(rng, qtype, repeats):
    rows, cols = 4 * EXPERT_WIDTH, HIDDEN          # 2048 x 1024: a few MB, beyond L2
    w = random_weight(rng, qtype, rows, cols)
    for num_tokens in (1, 64, 512):
        x = rng.standard_normal((num_tokens, cols)).astype(np.float32)
        out = np.empty((num_tokens, rows), np.float32)
        sec = median_seconds(lambda: kernels.matmul(w, int(qtype), x, out), repeats)
        gmacs = rows * cols * num_tokens / sec / 1e9
        print(f"  matmul  {qtype.name:5s} T={num_tokens:<4d} {rows}x{cols}: {sec * 1e3:8.3f} ms "
              f"{gmacs:7.2f} GMAC/s  {sec / num_tokens * 1e6:8.1f} us/token  "
              f"(min {rows * cols * num_tokens / MIN_SECONDS[0] / 1e9:.2f} GMAC/s)")


def bench_moe(rng, qtype, repeats):
    E, H, F, K = NUM_EXPERTS, HIDDEN, EXPERT_WIDTH, TOP_K
    gate = np.stack([random_weight(rng, qtype, F, H) for _ in range(E)])
    up = np.stack([random_weight(rng, qtype, F, H) for _ in range(E)])
    down = np.stack([random_weight(rng, qtype, H, F) for _ in range(E)])
    for label, num_tokens in (("decode", 1), ("prompt", 512)):
        x = (rng.standard_normal((num_tokens, H)) * 0.1).astype(np.float32)
        experts = np.stack([rng.permutation(E)[:K] for _ in range(num_tokens)]).astype(np.int32)
        weights = rng.random((num_tokens, K)).astype(np.float32)
        out = np.zeros((num_tokens, H), np.float32)

        def run():
            kernels.moe_ffn(x, gate, int(qtype), up, int(qtype), down, int(qtype), experts,
                            weights, out)
        sec = median_seconds(run, repeats)
        macs = num_tokens * K * 3 * F * H
        per_token = sec / num_tokens
        print(f"  moe_ffn {qtype.name:5s} {label} T={num_tokens:<4d} K={K}: {sec * 1e3:8.3f} ms "
              f"{macs / sec / 1e9:7.2f} GMAC/s  {per_token * 1e6:8.1f} us/token/layer "
              f"(x24 layers: {per_token * 24 * 1e3:.2f} ms/token; "
              f"min {macs / MIN_SECONDS[0] / 1e9:.2f} GMAC/s)")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--types", default="Q4_0,Q8_0,Q4_K,Q6_K,F16")
    parser.add_argument("--only", choices=("matmul", "moe"), default=None)
    parser.add_argument("--cpu-time", action="store_true",
                        help="time with process CPU time (use with --threads 1 on a busy machine)")
    args = parser.parse_args()
    CPU_TIME[0] = args.cpu_time
    kernels.set_num_threads(args.threads)
    print(f"simd={kernels.simd_level()} threads={kernels.get_num_threads()} "
          f"repeats={args.repeats} (medians of {'CPU' if args.cpu_time else 'wall'} time)")
    rng = np.random.default_rng(0)
    for name in args.types.split(","):
        qtype = T[name.strip()]
        if args.only in (None, "matmul"):
            bench_matmul(rng, qtype, args.repeats)
        if args.only in (None, "moe"):
            bench_moe(rng, qtype, args.repeats)


if __name__ == "__main__":
    main()
