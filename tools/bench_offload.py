"""Benchmark the CUDA offload tiers: the dense part in VRAM, every routed expert in pinned RAM,
a VRAM expert cache of 0% and 50% of the experts (misses read over PCIe by the GPU, or part of
them computed by the CPU pool with --pcie-frac < 1), medians of several runs, tokens/s.

Usage: python tools/bench_offload.py MODEL.gguf [-p 512] [-n 128] [-r 3] [--fractions 0,0.5]
       [--slots 4] [--pcie-frac 1] [--synth qwen3-30b-a3b --weight-type q4_0 --routing-skew 1
       --jobs 16]   (writes the synth model first when MODEL is missing)
Per cache fraction: pp (one prompt window), tg (one slot decoding), aggregate decode with
--slots slots; the cache filled in layer order and frozen (50% = the experts of the first half
of the layers in VRAM), then the same decode with the adaptive tier (async) and its hit rate.
"""
import argparse
import os
import statistics
import time

import numpy as np

from bench_cuda import write_synth  # tools/ is on the path of a tools/ script
from strata.backends.window import Window
from strata.model.gguf_file import GGUFModel


def bench_prompt(model, num_tokens, rng) -> float:
    """Seconds of one prompt window of num_tokens rows (greedy: no logits copied)."""
    kv = model.new_kv(num_tokens + 1)
    tokens = rng.integers(0, model.spec.vocab, num_tokens).astype(np.int32)
    t0 = time.perf_counter()
    model.forward_window_greedy(Window.build([(kv, tokens)]))
    return time.perf_counter() - t0


def bench_decode(model, num_slots, num_steps, num_prompt, rng) -> float:
    """Seconds of num_steps decode windows of num_slots rows after prompts of num_prompt."""
    kvs = [model.new_kv(num_prompt + num_steps + 1) for _ in range(num_slots)]
    for kv in kvs:
        if num_prompt:
            model.forward_window_greedy(Window.build(
                [(kv, rng.integers(0, model.spec.vocab, num_prompt).astype(np.int32))]))
    tok = rng.integers(0, model.spec.vocab, num_slots).astype(np.int32)
    t0 = time.perf_counter()
    for _ in range(num_steps):
        tok = model.forward_window_greedy(
            Window.build([(kv, tok[i:i + 1]) for i, kv in enumerate(kvs)]))
    return time.perf_counter() - t0


def tier_decode(tier, model, num_slots, num_steps, num_prompt, rng) -> float:
    """Seconds of num_steps decode windows of num_slots rows through the expert tier."""
    kvs = [model.new_kv(num_prompt + num_steps + 1) for _ in range(num_slots)]
    for kv in kvs:
        tier.forward_window(Window.build(
            [(kv, rng.integers(0, model.spec.vocab, num_prompt).astype(np.int32))]))
    tok = rng.integers(0, model.spec.vocab, num_slots).astype(np.int32)
    t0 = time.perf_counter()
    for _ in range(num_steps):
        logits = tier.forward_window(Window.build(
            [(kv, tok[i:i + 1]) for i, kv in enumerate(kvs)]))
        tok = np.argmax(logits, axis=1).astype(np.int32)
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("-p", "--prompt-tokens", type=int, default=512)
    ap.add_argument("-n", "--decode-tokens", type=int, default=128)
    ap.add_argument("-r", "--repeats", type=int, default=3)
    ap.add_argument("--fractions", default="0,0.5", help="cache sizes as fractions of experts")
    ap.add_argument("--slots", type=int, default=4, help="slots of the aggregate decode")
    ap.add_argument("--slot-decode-tokens", type=int, default=None,
                    help="decode steps of the aggregate decode (default: -n)")
    ap.add_argument("--pcie-frac", type=float, default=1.0,
                    help="share of the misses read over PCIe (< 1: a CPU pool does the rest)")
    ap.add_argument("--pool-threads", type=int, default=None)
    ap.add_argument("--adaptive-steps", type=int, default=128,
                    help="decode windows through the adaptive tier (0: skip)")
    ap.add_argument("--synth", default=None)
    ap.add_argument("--weight-type", default="q4_0")
    ap.add_argument("--routing-skew", type=float, default=1.0)
    ap.add_argument("--jobs", type=int, default=os.cpu_count())
    args = ap.parse_args()

    if args.synth and not os.path.exists(args.model):
        write_synth(args.model, args.synth, args.weight_type, args.routing_skew, args.jobs)
    from strata.backends.cuda import CudaModel
    from strata.backends.cuda.offload import HostExperts, VramExpertArena, slot_layout
    from strata.config import EngineConfig
    from strata.engine.expert_tier import ExpertTier
    from strata.experts.store import ExpertStore
    from strata.experts.tier import DecayedCountTier

    t0 = time.perf_counter()
    gguf = GGUFModel.open(args.model)
    model = CudaModel(gguf, experts_resident=False)
    store = ExpertStore.from_gguf(gguf)
    offsets, slot_bytes = slot_layout(store)
    host = HostExperts(model.runtime, store, offsets, slot_bytes, progress=False)
    total = store.n_layers * store.n_experts
    print(f"dense part on {model.runtime.name}, {total} experts ({host.nbytes / 2**30:.1f} GiB) "
          f"pinned in {time.perf_counter() - t0:.1f} s; pcie_frac {args.pcie_frac}", flush=True)
    rng = np.random.default_rng(0)
    rows = []
    for fraction in [float(f) for f in args.fractions.split(",") if f]:
        n = int(round(fraction * total))
        arena = VramExpertArena(model, store, n, host)
        model.expert_arena = arena
        arena.fill((layer, e) for layer in range(store.n_layers) for e in range(store.n_experts))
        if args.pcie_frac < 1:
            arena.attach_pool(args.pcie_frac, max_rows=max(args.prompt_tokens, args.slots),
                              threads=args.pool_threads)
            arena.before_window()
        label = f"cache {fraction:.0%} ({n} slots)"
        bench_prompt(model, args.prompt_tokens, rng)  # warm-up: plans, modules
        bench_decode(model, 1, 4, 0, rng)
        figures = {
            f"pp{args.prompt_tokens}": [args.prompt_tokens / bench_prompt(
                model, args.prompt_tokens, rng) for _ in range(args.repeats)],
            f"tg{args.decode_tokens}": [args.decode_tokens / bench_decode(
                model, 1, args.decode_tokens, 0, rng) for _ in range(args.repeats)],
        }
        bench_decode(model, args.slots, 2, 128, rng)
        steps = args.slot_decode_tokens or args.decode_tokens
        figures[f"decode x{args.slots} slots ({steps} steps)"] = [
            args.slots * steps / bench_decode(model, args.slots, steps, 128, rng)
            for _ in range(args.repeats)]
        for name, runs in figures.items():
            rows.append((label, name, statistics.median(runs), runs, ""))
            print(rows[-1][:3], flush=True)
        if args.adaptive_steps and 0 < n < total:
            config = EngineConfig(args.model, n_ctx=2048, expert_cache=n, adapt_every=4)
            tier = ExpertTier(model, store, arena, config)
            tier.start(DecayedCountTier(n))
            secs = tier_decode(tier, model, 1, args.adaptive_steps, 128, rng)
            totals = tier.snapshot_totals()
            tier.wait_idle(60)
            num_windows = max(totals.num_windows, 1)
            hit = totals.num_hits / max(totals.num_hits + totals.num_misses, 1)
            rows.append((label, f"tg{args.adaptive_steps}, adaptive tier (async, every 4)",
                         args.adaptive_steps / secs, [args.adaptive_steps / secs],
                         f"hit rate {hit:.1%}, {totals.num_swaps} swaps, "
                         f"{totals.num_bytes_moved / 2**30:.2f} GiB moved, tier wait "
                         f"{totals.wait_s / num_windows * 1e3:.2f} ms/window"))
            print(rows[-1][:3], rows[-1][4], flush=True)
            tier.close()  # stops its copier (and closes the arena: again below, harmless)
        arena.close()
        model.expert_arena = None
        del arena
    print(f"| cache | test | tokens/s (median of {args.repeats}) | runs | notes |")
    print("| --- | --- | --- | --- | --- |")
    for label, name, median, runs, note in rows:
        print(f"| {label} | {name} | {median:,.1f} | {', '.join(f'{r:,.1f}' for r in runs)} "
              f"| {note} |")


if __name__ == "__main__":
    main()
