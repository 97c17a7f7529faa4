"""Benchmark tier policies by replay: hit rates at cache sizes of 10/25/50% of all experts on a
skewed synthetic trace (or a recorded one) for the default tier, LRU, LFU, static, the oracles.

Usage: python tools/bench_replay.py [--trace FILE] [--layers 24] [--experts 64] [--top-k 8]
           [--windows 3000] [--rows 4] [--skew 1.0] [--locality 0.5] [--phase-windows 500]
           [--fractions 0.1,0.25,0.5] [--adapt-every 4] [--adapt-swaps 64] [--decay 0.7]
"""
import argparse
import time

from strata.experts.replay import replay_all
from strata.experts.tier import DecayedCountTier
from strata.experts.trace import format_skew_summary, read_trace
from strata.tool.routing import synth_trace


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default=None, help="a recorded trace instead of a synth one")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--windows", type=int, default=3000)
    parser.add_argument("--rows", type=int, default=4, help="decode rows per window")
    parser.add_argument("--skew", type=float, default=1.0)
    parser.add_argument("--locality", type=float, default=0.5)
    parser.add_argument("--phase-windows", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fractions", default="0.1,0.25,0.5")
    parser.add_argument("--adapt-every", type=int, default=4)
    parser.add_argument("--adapt-swaps", type=int, default=64)
    parser.add_argument("--decay", type=float, default=0.7)
    args = parser.parse_args()

    if args.trace:
        trace = read_trace(args.trace)
    else:
        trace = synth_trace(args.layers, args.experts, args.top_k, args.windows, args.rows,
                            args.skew, args.locality, args.phase_windows, args.seed)
        print(f"synth trace: top-{args.top_k}, {args.rows} rows per window, skew {args.skew}, "
              f"locality {args.locality}, phase {args.phase_windows} windows, seed {args.seed}")
    for line in format_skew_summary(trace):
        print(line)
    total = trace.n_layers * trace.n_experts
    print(f"adapt every {args.adapt_every} windows, at most {args.adapt_swaps} swaps, "
          f"decay {args.decay}")
    print(f"{'slots':>12}  {'policy':<14} {'hit rate':>8} {'/belady':>8} {'/oracle':>8} "
          f"{'loads/window':>12}")
    for fraction in (float(f) for f in args.fractions.split(",")):
        num_slots = round(fraction * total)
        tier = DecayedCountTier(num_slots, args.decay, args.adapt_swaps)
        t0 = time.perf_counter()
        results = replay_all(trace, num_slots, tier, args.adapt_every)
        seconds = time.perf_counter() - t0
        by_name = {r.name: r.hit_rate for r in results}
        for result in results:
            print(f"{num_slots:>5} ({fraction:>4.0%})  {result.name:<14} {result.hit_rate:>8.1%} "
                  f"{result.hit_rate / max(by_name['belady'], 1e-12):>8.3f} "
                  f"{result.hit_rate / max(by_name['round-oracle'], 1e-12):>8.3f} "
                  f"{result.num_loads / trace.num_windows:>12.1f}")
        print(f"{'':>12}  (replayed in {seconds:.1f} s)")


if __name__ == "__main__":
    main()
