"""The adaptive tier's wait per window on the GPU: decode through a VRAM expert cache of a given
size with the tier live, asynchronous and blocking, in solo (1 slot) and batch (several slots)
windows; tokens/s, hit rate, swaps and the tier's mean / max wait per window kind.

Usage: python tools/bench_tier_wait.py MODEL.gguf [--fractions 0.25,0.5] [--slots 1,4]
       [--modes async,blocking] [-n 96] [--adapt-every 4] [--synth qwen3-30b-a3b
       --weight-type q4_0 --routing-skew 1 --jobs 16]
Each run starts from a fresh cache filled in layer order, reads a 128-token prompt per slot, then
times -n decode windows; the wait counters cover the decode windows only.
"""
import argparse
import os

import numpy as np

from bench_cuda import write_synth  # tools/ is on the path of a tools/ script
from bench_offload import tier_decode
from strata.model.gguf_file import GGUFModel

PROMPT_TOKENS = 128


def run_tier(model_path, model, store, host, num_cache_slots, is_async, num_slots, num_steps,
             adapt_every, rng):
    """One run from a fresh cache: (tokens/s, the tier's totals, its waits by window kind)."""
    from strata.backends.cuda.offload import VramExpertArena
    from strata.config import EngineConfig
    from strata.engine.expert_tier import ExpertTier
    from strata.engine.tier_stats import WaitTotals
    from strata.experts.tier import DecayedCountTier

    arena = VramExpertArena(model, store, num_cache_slots, host)
    model.expert_arena = arena
    arena.fill((layer, e) for layer in range(store.n_layers) for e in range(store.n_experts))
    config = EngineConfig(model_path, n_ctx=2048, expert_cache=num_cache_slots,
                          adapt_every=adapt_every, adapt_async=is_async)
    tier = ExpertTier(model, store, arena, config)
    tier.start(DecayedCountTier(num_cache_slots))
    try:
        marks = {}

        def start_counting():  # the decode windows only
            tier.wait_by_kind = {"solo": WaitTotals(), "batch": WaitTotals()}
            marks["before"] = tier.snapshot_totals()

        secs = tier_decode(tier, model, num_slots, num_steps, PROMPT_TOKENS, rng,
                           after_prompts=start_counting)
        return (num_slots * num_steps / secs, marks["before"], tier.snapshot_totals(),
                dict(tier.wait_by_kind))
    finally:
        tier.wait_idle(60)
        tier.close()
        arena.close()
        model.expert_arena = None


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--fractions", default="0.25,0.5", help="cache sizes as fractions of experts")
    ap.add_argument("--slots", default="1,4", help="slot counts (1: solo windows, more: batch)")
    ap.add_argument("--modes", default="async,blocking")
    ap.add_argument("-n", "--decode-tokens", type=int, default=96)
    ap.add_argument("--adapt-every", type=int, default=4)
    ap.add_argument("--synth", default=None)
    ap.add_argument("--weight-type", default="q4_0")
    ap.add_argument("--routing-skew", type=float, default=1.0)
    ap.add_argument("--jobs", type=int, default=os.cpu_count())
    args = ap.parse_args()

    if args.synth and not os.path.exists(args.model):
        write_synth(args.model, args.synth, args.weight_type, args.routing_skew, args.jobs)
    from strata.backends.cuda import CudaModel
    from strata.backends.cuda.offload import HostExperts, slot_layout
    from strata.experts.store import ExpertStore

    gguf = GGUFModel.open(args.model)
    model = CudaModel(gguf, experts_resident=False)
    store = ExpertStore.from_gguf(gguf)
    offsets, slot_bytes = slot_layout(store)
    host = HostExperts(model.runtime, store, offsets, slot_bytes, progress=False)
    total = store.n_layers * store.n_experts
    rng = np.random.default_rng(0)
    print("| cache | tier | slots | tokens/s | hit rate | swaps | wait solo ms/window (max) "
          "| wait batch ms/window (max) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for fraction in [float(f) for f in args.fractions.split(",") if f]:
        n = int(round(fraction * total))
        for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
            if mode not in ("async", "blocking"):
                raise SystemExit(f"--modes: {mode!r} is not async or blocking")
            for num_slots in [int(s) for s in args.slots.split(",") if s]:
                tps, before, after, waits = run_tier(args.model, model, store, host, n,
                                                     mode == "async", num_slots,
                                                     args.decode_tokens, args.adapt_every, rng)
                hits = after.num_hits - before.num_hits
                misses = after.num_misses - before.num_misses
                cells = [f"{w.mean_wait_ms:.3f} ({w.max_wait_s * 1e3:.2f})" if w.num_windows
                         else "-" for w in (waits["solo"], waits["batch"])]
                print(f"| {fraction:.0%} ({n} slots) | {mode} | {num_slots} | {tps:,.1f} | "
                      f"{hits / max(hits + misses, 1):.1%} | "
                      f"{after.num_swaps - before.num_swaps} | {cells[0]} | {cells[1]} |",
                      flush=True)


if __name__ == "__main__":
    main()
