"""Benchmark the layer split: decode tokens/s of one card vs the split over two, each card's
expert cache budget set so that one card alone caches a quarter of the experts, the adaptive
async tier on, with 1/2/4 slots and --batch-groups 1 / 2 / auto; medians of -r runs, the tier's
hit rate and its wait per window on each stage.

Usage: python tools/bench_split.py MODEL.gguf [-n 32] [-r 3] [--slots 1,2,4] [--warm 64]
       [--devices 0,1] [--layer-split auto] [--groups 1,2,auto ("": one card only)]
       [--cache-share 0.25] [--expert-profile FILE]
       [--policy decayed-count|window-score] [--no-admission] [--full-logits]
       [--synth qwen3-30b-a3b --weight-type q4_0
       --routing-skew 1 --jobs 16]   (writes the synth model first when MODEL is missing)
Misses are read over PCIe (--pcie-frac 1: no CPU pool, which would keep one group). With more
than one group the decode windows are pipelined as the engine's scheduler runs them.
"""
import argparse
import logging
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_cuda import write_synth  # noqa: E402
from bench_offload import tier_decode  # noqa: E402
from strata.model.gguf_file import GGUFModel  # noqa: E402


def stage_waits(tier) -> str:
    """The tier's wait per window (ms) and hit rate, per stage of a split."""
    stages = getattr(tier, "stages", [tier])
    parts = []
    for i, t in enumerate(stages):
        tot = t.snapshot_totals()
        hit = tot.num_hits / max(tot.num_hits + tot.num_misses, 1)
        wait_ms = tot.wait_s / max(tot.num_windows, 1) * 1e3
        parts.append(f"stage {i}: hit {hit:.1%}, wait {wait_ms:.2f} ms/window, "
                     f"{tot.num_swaps} swaps ({tot.num_admissions} admissions)")
    return "; ".join(parts)


def pipelined_decode(tier, model, num_slots, num_steps, num_prompt, rng, num_groups) -> float:
    """Seconds of num_steps greedy decode windows per slot group, the groups' windows
    pipelined as the engine's scheduler runs them (slot i in group i % num_groups; a group's
    next window starts as soon as its last one finished, while the others are in flight),
    after a prompt of num_prompt tokens per slot (not timed)."""
    from collections import deque

    from strata.backends.window import Window

    kvs = [model.new_kv(num_prompt + num_steps + 1) for _ in range(num_slots)]
    for kv in kvs:
        tier.forward_window(Window.build(
            [(kv, rng.integers(0, model.spec.vocab, num_prompt).astype(np.int32))]))
    tok = rng.integers(0, model.spec.vocab, num_slots).astype(np.int32)
    lanes = [[i for i in range(num_slots) if i % num_groups == g] for g in range(num_groups)]
    left = [num_steps] * num_groups
    flying = deque()

    def start(g):
        window = Window.build([(kvs[i], tok[i:i + 1]) for i in lanes[g]])
        flying.append((g, tier.start_window(window, g, "greedy")))
        left[g] -= 1

    t0 = time.perf_counter()
    for g in range(num_groups):
        start(g)
    while flying:
        g, ticket = flying.popleft()
        tok[lanes[g]] = tier.finish_window(ticket)
        if left[g]:
            start(g)
    return time.perf_counter() - t0


def run_setting(args, label, options, rows, rng):
    from strata.backends.select import build_model
    from strata.config import EngineConfig
    from strata.engine.expert_tier import ExpertTier
    from strata.experts.tier import DecayedCountTier
    from strata.experts.tier_window import WindowScoreTier

    gguf = GGUFModel.open(args.model)
    config = EngineConfig(args.model, n_ctx=1024, parallel=max(args.slot_counts),
                          device="cuda", expert_cache="auto", vram_budget_bytes=args.budget,
                          pcie_frac=1.0, adapt_every=4, adapt_async=True,
                          expert_profile_path=args.expert_profile, **options)
    t0 = time.perf_counter()
    model = build_model(gguf, "cuda", needs_cpu_experts=True, config=config)
    tier = ExpertTier.build(config, gguf, model)
    if args.policy == "window-score":  # its `victims`: windows keep misses (free admission)
        policy = WindowScoreTier(config.expert_cache_slots, max_swaps=64)
        if args.no_admission:
            policy.victims = None  # the engine keeps misses only for a policy with victims
    else:
        policy = DecayedCountTier(config.expert_cache_slots, max_swaps=64)
    tier.start(policy)
    print(f"{label}: built in {time.perf_counter() - t0:.1f} s, {tier.arena.n_slots} slots, "
          f"tier {tier.mode}, policy {policy.name}, free admission "
          f"{[t.admits for t in getattr(tier, 'stages', [tier])]}", flush=True)
    try:
        for num_slots in args.slot_counts:
            full = args.full_logits
            groups = min(getattr(model, "batch_groups", 1), num_slots)
            if groups > 1 and getattr(tier, "pipelines", False) and not full:
                def decode(steps, tier=tier, model=model):  # the scheduler's pipelined decode
                    return pipelined_decode(tier, model, num_slots, steps, 64, rng, groups)
                label_n = f"{label} (pipelined)"
            else:
                def decode(steps, tier=tier, model=model):
                    return tier_decode(tier, model, num_slots, steps, 64, rng,
                                       full_logits=full)
                label_n = label
            decode(args.warm)  # plans, graphs, the tier warms
            runs = [num_slots * args.decode_tokens / decode(args.decode_tokens)
                    for _ in range(args.repeats)]
            rows.append((label_n, num_slots, statistics.median(runs), runs, stage_waits(tier)))
            print(rows[-1], flush=True)
    finally:
        tier.close()
        del tier, model
        gguf.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("-n", "--decode-tokens", type=int, default=32)
    ap.add_argument("-r", "--repeats", type=int, default=3)
    ap.add_argument("--slots", default="1,2,4")
    ap.add_argument("--warm", type=int, default=64, help="decode windows before timing")
    ap.add_argument("--devices", default="0,1")
    ap.add_argument("--layer-split", default="auto")
    ap.add_argument("--groups", default="1,2,auto",
                    help="--batch-groups values of the split (\"\": one card only)")
    ap.add_argument("--cache-share", type=float, default=0.25,
                    help="each card's cache budget as a share of all experts")
    ap.add_argument("--policy", default="decayed-count", choices=["decayed-count",
                                                                  "window-score"],
                    help="tier policy (with window-score windows keep their misses: free "
                         "admission)")
    ap.add_argument("--no-admission", action="store_true",
                    help="window-score without free admission (its rounds only)")
    ap.add_argument("--expert-profile", default=None,
                    help="fill every cache from this routing profile (default: layer order)")
    ap.add_argument("--full-logits", action="store_true",
                    help="copy every row's logits and take the argmax on the host (default: "
                         "greedy ids from the device, as the engine's greedy rows)")
    ap.add_argument("--synth", default=None)
    ap.add_argument("--weight-type", default="q4_0")
    ap.add_argument("--routing-skew", type=float, default=1.0)
    ap.add_argument("--jobs", type=int, default=os.cpu_count())
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    if args.synth and not os.path.exists(args.model):
        write_synth(args.model, args.synth, args.weight_type, args.routing_skew, args.jobs)
    from strata.backends.cuda.offload import slot_layout
    from strata.experts.store import ExpertStore

    with GGUFModel.open(args.model) as gguf:
        store = ExpertStore.from_gguf(gguf)
        _, slot_bytes = slot_layout(store)
        share = int(store.n_layers * store.n_experts * args.cache_share)
    args.budget = share * slot_bytes  # per card: --cache-share of all experts
    args.slot_counts = [int(s) for s in args.slots.split(",")]
    print(f"budget per card {args.budget / 2**30:.2f} GiB = {share} expert slots", flush=True)
    rng = np.random.default_rng(0)
    rows = []
    run_setting(args, "one card", {}, rows, rng)
    for groups in [g for g in args.groups.split(",") if g]:
        run_setting(args, f"split {args.devices}, groups {groups}",
                    dict(split_devices=args.devices, layer_split=args.layer_split,
                         batch_groups=groups), rows, rng)
    one = {n: m for label, n, m, _, _ in rows if label == "one card"}
    print(f"| setting | slots | tokens/s (median of {args.repeats}) | vs one card | runs | "
          "tier per stage |")
    print("| --- | --- | --- | --- | --- | --- |")
    for label, n, median, runs, waits in rows:
        print(f"| {label} | {n} | {median:,.1f} | {median / one[n]:.2f}x | "
              f"{', '.join(f'{r:,.1f}' for r in runs)} | {waits} |")


if __name__ == "__main__":
    main()
