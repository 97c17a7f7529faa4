"""Replay a routing trace (`--dump-routing`) through the prompt streamer's choice of what to
copy (stream.rare_experts with the routing counts and, unless --no-hits, the share of windows
that routed to each expert), with no GPU: per layer and window, the experts copied ahead, those
copied but not routed (wasted link bytes), and the rare ones routed after all, split as the
device would split them (the CPU pool within share.PROMPT_POOL_ROWS and the layer's budget,
the fewest rows first; of the rest, those of at least --guess-rows rows as guessed copies, an
oracle of the device's guess (router.cu's predict_*, 96% of whose guesses are routed); pull_rare
past device_tier.pull_min_rows() rows, per-tile PCIe reads for the rest). `link` is the experts
a layer moves over PCIe in all (copied + guessed + pulled + read). No expert is cached. Also
prints the pool's modelled time a layer (--pool-us: its time for an expert by rows) and how the
streamer's copies spread over the layers (the pool's budget comes from them).

Usage: python tools/replay_stream.py TRACE [--cost 1.01] [--hit-cost 1.25] [--no-hits]
                                           [--warm 3] [--threads 15] [--pool-share 1.5]
                                           [--pull-rows N] [--guess-rows 16]
                                           [--pool-us ROWS:US,...]
Session 46 (docs/offload.md, "Bursts"): on a trace of `strata bench -p 512 -n 0` over the
synth qwen3-30b-a3b (routing skew 1) the counts alone copied 45.4 experts a layer, 13.2 of them
not routed; with the share of windows 23.1 and 3.0. Session 86 ("Session 86"): on the skew-0
synth the copies spread 0 / 2 / 17 a layer (10th / 50th / 90th percentile).
"""
import argparse

import numpy as np

from strata.backends.cuda.device_tier import pull_min_rows
from strata.backends.cuda.guess import guess_min_rows
from strata.backends.cuda.share import (POOL_EXPERT_ROWS, POOL_SHARE_OF_COPY, PROMPT_POOL_ROWS,
                                        prompt_pool_budget)
from strata.backends.cuda.stream import (HIT_REACH_COST, POOL_REACH_COST, HitShare,
                                         decay_counts, rare_experts)
from strata.experts.trace import read_trace


def window_counts(path: str) -> np.ndarray:
    """[W, L, E] routed rows per window, layer and expert."""
    trace = read_trace(path)
    r = trace.records
    counts = np.zeros((int(r["window"].max()) + 1, trace.n_layers, trace.n_experts))
    np.add.at(counts, (r["window"], r["layer"], r["expert"]), r["rows"])
    return counts


def pool_walk(rows: np.ndarray, rare: np.ndarray, budget: int) -> tuple[list, list]:
    """(rows of the experts the pool takes, rows of the other routed rare ones) of one layer,
    as the device's count_groups / guess_publish walk them: the fewest rows first (expert order
    among equal rows) within the budget and share.PROMPT_POOL_ROWS; rows [E], rare [E] bool."""
    taken, left = [], []
    routed = np.flatnonzero(rare & (rows > 0))
    for e in routed[np.argsort(rows[routed], kind="stable")]:
        cost = POOL_EXPERT_ROWS + rows[e]
        if rows[e] <= PROMPT_POOL_ROWS and cost <= budget:
            budget -= cost
            taken.append(rows[e])
        else:
            left.append(rows[e])
    return taken, left


def split_rare(rows: np.ndarray, rare: np.ndarray, budget: int,
               pull_rows: int | None = None, guess_rows: int = 0) -> tuple[int, ...]:
    """(pooled, pulled, read), with guess_rows > 0 (pooled, guessed, pulled, read), of one
    layer's routed rare experts as the device splits them: the pool's (pool_walk); of the
    others, those of at least guess_rows rows are guessed copies (an oracle guess); pull_rare
    those of more than pull_rows rows (device_tier.pull_min_rows), the rest read per tile;
    rows [E] routed rows, rare [E] bool."""
    pull_rows = pull_min_rows() if pull_rows is None else pull_rows
    taken, left = pool_walk(rows, rare, budget)
    left = np.asarray(left)
    guessed = int((left >= guess_rows).sum()) if guess_rows > 0 else 0
    rest = left[left < guess_rows] if guess_rows > 0 else left
    pulled, read = int((rest > pull_rows).sum()), int((rest <= pull_rows).sum())
    return (len(taken), guessed, pulled, read) if guess_rows > 0 else (len(taken), pulled, read)


# The pool's time for one expert (us, 15 threads) by its rows, for --pool-us: session 86's
# tools/bench_pool_kernel.py --rows-per-expert on an H100 host (64 rows extrapolated)
POOL_US = "1:30,2:36.5,4:51,8:60,16:78,32:109,64:170"


def pool_us(rows: list, table: str = POOL_US) -> float:
    """The pool's modelled time (us) for experts of these rows, interpolated in log2(rows)."""
    pairs = sorted((float(a), float(b)) for a, b in (p.split(":") for p in table.split(",")))
    xs, ys = np.log2([a for a, _ in pairs]), [b for _, b in pairs]
    return float(sum(np.interp(np.log2(max(r, 1)), xs, ys) for r in rows))


def main(argv=None) -> dict:
    """Print the per-layer figures and return them (experts per layer and window)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--cost", type=float, default=POOL_REACH_COST, help="the counts' reach cost")
    ap.add_argument("--hit-cost", type=float, default=HIT_REACH_COST)
    ap.add_argument("--no-hits", action="store_true", help="the routing counts alone")
    ap.add_argument("--warm", type=int, default=3, help="windows replayed before the figures")
    ap.add_argument("--threads", type=int, default=15, help="CPU pool threads (its budget)")
    ap.add_argument("--pool-share", type=float, default=POOL_SHARE_OF_COPY,
                    help="the pool's budget in copy times of the layer (share.POOL_SHARE_OF_COPY)")
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--pull-rows", type=int, default=None,
                    help="rows past which pull_rare copies a rare expert (default "
                         "device_tier.pull_min_rows(): STRATA_PULL_ROWS, else 0)")
    ap.add_argument("--guess-rows", type=int, default=None,
                    help="rows from which a rare expert the pool leaves is a guessed copy "
                         "(default guess.guess_min_rows(): STRATA_GUESS_ROWS, else 16; 0: none)")
    ap.add_argument("--pool-us", default=POOL_US,
                    help="ROWS:US,...: the pool's time for an expert of ROWS rows, for the "
                         "modelled time a layer (default: an H100 host's 15 threads)")
    args = ap.parse_args(argv)
    guess_rows = guess_min_rows() if args.guess_rows is None else args.guess_rows
    counts = window_counts(args.trace)
    W, L, E = counts.shape
    K = args.top_k
    residency = np.full((L, E), -1)
    routed, hits = np.zeros((L, E)), HitShare(L, E)
    rows_per_window, copies, pool_time = [], [], []  # copies: [windows, L]; pool_time: us a layer
    for w in range(W):
        c = counts[w]
        num_rows = int(round(c.sum(axis=1).max() / K))
        if w >= args.warm:
            share = None if args.no_hits else hits.share()
            rare = rare_experts(residency, routed, num_rows, K, args.cost, share, args.hit_cost,
                                cold_rare=True)  # the pool's path (stream.COLD_LAYERS_RARE)
            copied = ~rare
            copies.append(copied.sum(axis=1))
            budget = prompt_pool_budget(copied.sum(axis=1), args.threads, args.pool_share)
            split = np.array([split_rare(c[layer], rare[layer], int(budget[layer]),
                                         args.pull_rows, max(guess_rows, 0))
                              for layer in range(L)])  # [L, 3 or 4]
            pool_time += [pool_us(pool_walk(c[layer], rare[layer], int(budget[layer]))[0],
                                  args.pool_us) for layer in range(L)]
            if guess_rows <= 0:  # no guessed copies: a zero column where they would be
                split = np.insert(split, 1, 0, axis=1)
            hit = c > 0
            rows_per_window.append([copied.sum(axis=1).mean(), (copied & ~hit).sum(axis=1).mean(),
                                    *split.mean(axis=0), hit.sum(axis=1).mean()])
        decay_counts(routed, c, K)
        hits.add(c)
    if not rows_per_window:
        raise SystemExit(f"{args.trace}: {W} windows, none past --warm {args.warm}")
    copied, wasted, pooled, guessed, pulled, read, routed_experts = np.mean(rows_per_window,
                                                                            axis=0)
    copies = np.concatenate(copies)
    spread = np.percentile(copies, [10, 50, 90])
    figures = dict(routed=routed_experts, copied=copied, wasted=wasted, pooled=pooled,
                   guessed=guessed, pulled=pulled, read=read,
                   link=copied + guessed + pulled + read, copies_spread=tuple(spread),
                   layers_uncopied=float((copies == 0).mean()))
    print(f"{W - args.warm} windows, per layer: {routed_experts:.1f} experts routed; copied "
          f"{copied:.1f} ({wasted:.1f} not routed); rare but routed: pool {pooled:.1f}, "
          f"guessed {guessed:.1f}, pulled {pulled:.1f}, read per tile {read:.1f}; link "
          f"{figures['link']:.1f} experts")
    pool_time = np.asarray(pool_time)
    figures["pool_us"] = tuple(np.percentile(pool_time, [50, 90, 100]))
    print(f"the pool's modelled time a layer: {pool_time.mean():.0f} us on average, "
          f"{figures['pool_us'][0]:.0f} / {figures['pool_us'][1]:.0f} / "
          f"{figures['pool_us'][2]:.0f} (50th / 90th percentile / most), "
          f"{pool_time.sum() / len(copies) * L / 1e3:.1f} ms a window")
    print(f"the streamer's copies a layer: {spread[0]:.0f} / {spread[1]:.0f} / {spread[2]:.0f} "
          f"(10th / 50th / 90th percentile), none in {figures['layers_uncopied']:.0%} of the "
          "layers")
    return figures


if __name__ == "__main__":
    main()
