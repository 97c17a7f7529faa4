"""The CPU pool's kernel (moe_ffn_ptrs) on decode rows, experts read from RAM or from the caches,
at Qwen3-30B-A3B's expert shape (hidden 2048, width 768, top-8), per weight type and thread
count: the figure `strata-tool calibrate` turns into --pcie-frac, without a model file.

Usage: python tools/bench_pool_kernel.py [--threads 1,2] [--types Q4_0,Q8_0,Q4_K,Q6_K]
                                         [--experts 512] [--rows 1] [--per-window 8]
                                         [--rows-per-expert 1,4,16] [--amx off|on|both]
                                         [--seconds 3] [--repeats 3]
Each call is one layer's window: `rows` rows routed to --per-window experts in all (top-8 each
by default; fewer: the pool's part of a layer's misses, e.g. 4 at --pcie-frac 0.5), no expert
shared between rows, taken in turn from a set of --experts experts (512 x 2.5 MiB of Q4_0 is far
more than the L3 cache: "from RAM"; --experts 8 keeps them in cache). Prints distinct experts
per second and GB/s of expert bytes, medians of --repeats runs (and the spread).
--rows-per-expert N,..: prompt-shaped calls instead: N rows, each routed to the same 8 experts,
so every expert is read once for N rows (what an expert with N rows in a prompt window would
cost the pool: docs/offload.md, "Tried and dropped"; where the fused kernels give way to the
tiles: matmul.c's FUSED_MAX_TOKENS; the k-quants have no tiles, their rows take every N);
prints experts/s and routed rows/s per N.
"""
import argparse
import statistics
import time

import gguf
import numpy as np

from bench_kernels import random_weight
from strata._native import kernels

T = gguf.GGMLQuantizationType
HIDDEN, EXPERT_WIDTH, TOP_K = 2048, 768, 8


def make_experts(rng, qtype, n):
    """[3, n] uint64 pointers to n experts' gate, up [F, H] and down [H, F] matrices, the
    arrays that own them and one expert's bytes."""
    mats = [(random_weight(rng, qtype, EXPERT_WIDTH, HIDDEN),
             random_weight(rng, qtype, EXPERT_WIDTH, HIDDEN),
             random_weight(rng, qtype, HIDDEN, EXPERT_WIDTH)) for _ in range(n)]
    pointers = np.array([[m[p].ctypes.data for m in mats] for p in range(3)], dtype=np.uint64)
    return pointers, mats, sum(m.nbytes for m in mats[0])


def run(pointers, qtype, n, rows, per_call, seconds, rng, shared=False, amx=False):
    """Distinct experts per second over `seconds` of one-layer windows of `per_call` experts
    (the rest of each row's top-K slots are -1: another side's). shared: every row routed to
    the same TOP_K experts (per_call = TOP_K). amx: the pool's call (allow_amx)."""
    x = rng.standard_normal((rows, HIDDEN)).astype(np.float32)            # [R, H]
    wts = rng.random((rows, TOP_K)).astype(np.float32)                    # [R, K]
    out = np.zeros((rows, HIDDEN), dtype=np.float32)
    mine = np.arange(rows * TOP_K) < per_call                             # [R * K]
    calls, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        first = calls * per_call % n
        if shared:
            ids = np.tile((np.arange(TOP_K) + first) % n, (rows, 1)).astype(np.int32)  # [R, K]
        else:
            ids = np.where(mine, (np.arange(rows * TOP_K) + first) % n, -1)
            ids = ids.astype(np.int32).reshape(rows, TOP_K)
        kernels.moe_ffn_ptrs(x, pointers, int(qtype), int(qtype), int(qtype), EXPERT_WIDTH,
                             ids, wts, out, allow_amx=amx)
        calls += 1
    return calls * per_call / elapsed


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--types", default="Q4_0,Q8_0,Q4_K,Q6_K")
    parser.add_argument("--experts", type=int, default=512)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--per-window", type=int, default=None,
                        help="distinct experts per window (default: rows x top-8)")
    parser.add_argument("--rows-per-expert", default=None,
                        help="comma list: prompt-shaped calls, each expert read once for N rows")
    parser.add_argument("--amx", choices=("off", "on", "both"), default="off",
                        help="--rows-per-expert calls as the CPU pool makes them (allow_amx: "
                             "the AMX rows from STRATA_AMX_ROWS rows, where the CPU has AMX)")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    per_call = args.per_window or args.rows * TOP_K
    if not 0 < per_call <= args.rows * TOP_K or per_call > args.experts:
        parser.error(f"--per-window {per_call} must be in 1..rows x top-{TOP_K} and at most "
                     f"--experts")
    rng = np.random.default_rng(0)
    before = kernels.get_num_threads()
    print(f"simd {kernels.simd_level()}, {args.experts} experts, {args.rows} row(s) and "
          f"{per_call} experts per window; AMX rows {'yes' if kernels.amx_available() else 'no'}"
          f" (from {kernels.amx_rows()} rows)")
    amx_modes = {"off": [False], "on": [True], "both": [False, True]}[args.amx]
    for name in args.types.split(","):
        qtype = T[name.strip()]
        pointers, owners, expert_bytes = make_experts(rng, qtype, args.experts)
        for threads in (int(t) for t in args.threads.split(",")):
            kernels.set_num_threads(threads)
            if args.rows_per_expert:
                for shared_rows, amx in ((int(r), a) for r in args.rows_per_expert.split(",")
                                         for a in amx_modes):
                    rates = [run(pointers, qtype, args.experts, shared_rows, TOP_K, args.seconds,
                                 rng, shared=True, amx=amx) for _ in range(args.repeats)]
                    mid = statistics.median(rates)
                    print(f"{qtype.name:5s} threads {threads:3d} rows/expert {shared_rows:4d}"
                          f"{' amx' if amx else '    '}: "
                          f"{mid:9,.0f} experts/s ({min(rates):,.0f}-{max(rates):,.0f}), "
                          f"{mid * shared_rows:10,.0f} rows/s, {mid * expert_bytes / 1e9:6.2f} "
                          "GB/s", flush=True)
                continue
            rates = [run(pointers, qtype, args.experts, args.rows, per_call, args.seconds, rng)
                     for _ in range(args.repeats)]
            mid = statistics.median(rates)
            print(f"{qtype.name:5s} threads {threads:3d}: {mid:9,.0f} experts/s "
                  f"({min(rates):,.0f}-{max(rates):,.0f}), {mid * expert_bytes / 1e9:6.2f} GB/s",
                  flush=True)
        del owners
    kernels.set_num_threads(before)


if __name__ == "__main__":
    main()
