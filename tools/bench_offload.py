"""Benchmark the CUDA offload tiers: the dense part in VRAM, every routed expert in pinned RAM,
a VRAM expert cache of 0% and 50% of the experts (misses read over PCIe by the GPU, or part of
them computed by the CPU pool with --pcie-frac < 1), medians of several runs, tokens/s.

Usage: python tools/bench_offload.py MODEL.gguf [-p 512,4096] [--read-chunk 512] [-n 128]
       [-r 3] [--fractions 0,0.5] [--slots 4] [--pcie-frac 1] [--stream-rows 32]
       [--compare-pcie] [--crossover 16,24,32,64] [--whole-window]
       [--synth qwen3-30b-a3b --weight-type q4_0 --routing-skew 1 --jobs 16]
       (writes the synth model first when MODEL is missing)
Per cache fraction: pp (each prompt in windows of --read-chunk rows, as the engine reads it;
windows of >= --stream-rows rows stream their layers' missing experts into staging slots,
stream.py; --compare-pcie also times them read over PCIe), tg (one slot decoding), aggregate
decode with --slots slots; the cache filled in layer order and frozen (50% = the experts of the
first half of the layers in VRAM), then the same decodes (1 and --slots slots) with the adaptive
tier (async), after --adaptive-warm windows of it, and their hit rate. --crossover: one window
of R rows with streaming off and on, ms (the first fraction).
"""
import argparse
import os
import statistics
import time

import numpy as np

from bench_cuda import write_synth  # tools/ is on the path of a tools/ script
from strata.backends.window import Window
from strata.model.gguf_file import GGUFModel


def bench_prompt(model, num_tokens, rng, chunk=None) -> float:
    """Seconds of a prompt of num_tokens read in windows of `chunk` rows (None: one window;
    greedy: no logits copied). The arena readies each window as the engine's tier does
    (streaming staging); the borrowed slots are given back and refilled after, untimed."""
    arena = model.expert_arena
    chunk = chunk or num_tokens
    kv = model.new_kv(num_tokens + 1)
    tokens = rng.integers(0, model.spec.vocab, num_tokens).astype(np.int32)
    t0 = time.perf_counter()
    for at in range(0, num_tokens, chunk):
        part = tokens[at:at + chunk]
        arena.before_window(len(part))
        model.forward_window_greedy(Window.build([(kv, part)]))
    secs = time.perf_counter() - t0
    arena.before_window(1)  # what the next decode window does: slots back, refills queued
    arena.streamer.wait_idle(60)
    arena.before_window(1)
    return secs


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


def tier_decode(tier, model, num_slots, num_steps, num_prompt, rng, after_prompts=None,
                full_logits=False) -> float:
    """Seconds of num_steps greedy decode windows of num_slots rows through the expert tier
    (argmax on the device; `full_logits`: every row's logits copied and argmax on the host),
    after a prompt of num_prompt tokens per slot (not timed; then `after_prompts()`)."""
    kvs = [model.new_kv(num_prompt + num_steps + 1) for _ in range(num_slots)]
    for kv in kvs:
        tier.forward_window(Window.build(
            [(kv, rng.integers(0, model.spec.vocab, num_prompt).astype(np.int32))]))
    if after_prompts is not None:
        after_prompts()
    tok = rng.integers(0, model.spec.vocab, num_slots).astype(np.int32)
    t0 = time.perf_counter()
    for _ in range(num_steps):
        window = Window.build([(kv, tok[i:i + 1]) for i, kv in enumerate(kvs)])
        if full_logits:
            tok = np.argmax(tier.forward_window(window), axis=1).astype(np.int32)
        else:
            tok = np.asarray(tier.forward_window(window, greedy=True), dtype=np.int32)
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("-p", "--prompt-tokens", default="512",
                    help="prompt lengths, comma-separated")
    ap.add_argument("--read-chunk", type=int, default=512,
                    help="rows per prompt window, as the engine's --read-chunk")
    ap.add_argument("--whole-window", action="store_true",
                    help="also one run of each longer prompt as a single window")
    ap.add_argument("--stream-rows", type=int, default=None,
                    help="windows of at least this many rows stream (0: off; default "
                         "stream.STREAM_MIN_ROWS)")
    ap.add_argument("--compare-pcie", action="store_true",
                    help="also time the first prompt with streaming off (misses over PCIe)")
    ap.add_argument("--crossover", default="",
                    help="window rows to time with streaming off and on (first fraction)")
    ap.add_argument("-n", "--decode-tokens", type=int, default=128)
    ap.add_argument("-r", "--repeats", type=int, default=3)
    ap.add_argument("--fractions", default="0,0.5", help="cache sizes as fractions of experts")
    ap.add_argument("--slots", type=int, default=4, help="slots of the aggregate decode")
    ap.add_argument("--slot-decode-tokens", type=int, default=None,
                    help="decode steps of the aggregate decode (default: -n)")
    ap.add_argument("--pcie-frac", type=float, default=1.0,
                    help="share of the misses read over PCIe (< 1: a CPU pool does the rest)")
    ap.add_argument("--pool-threads", type=int, default=None)
    ap.add_argument("--adaptive-warm", type=int, default=64,
                    help="decode windows the adaptive tier runs before its timed runs")
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
    from strata.backends.cuda.stream import STREAM_MIN_ROWS

    stream_rows = STREAM_MIN_ROWS if args.stream_rows is None else args.stream_rows
    prompts = [int(p) for p in args.prompt_tokens.split(",") if p]

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
            arena.attach_pool(args.pcie_frac, max_rows=max(max(prompts), args.slots),
                              threads=args.pool_threads)
            arena.before_window()
        streamer = arena.streamer
        streamer.min_rows = stream_rows
        label = f"cache {fraction:.0%} ({n} slots)"

        def record(name, runs, note=""):
            rows.append((label, name, statistics.median(runs), runs, note))
            print(rows[-1][:3], note, flush=True)

        chunk = min(args.read_chunk, prompts[0])
        bench_prompt(model, prompts[0], rng, chunk)  # warm-up: plans, modules, staging
        if args.crossover and not rows:
            for num_rows in [int(r) for r in args.crossover.split(",") if r]:
                for on in (False, True):
                    streamer.min_rows = num_rows if on else 0
                    bench_prompt(model, num_rows, rng)
                    record(f"one window of {num_rows} rows, ms, streamed {on}",
                           [1e3 * bench_prompt(model, num_rows, rng)
                            for _ in range(args.repeats)])
            streamer.min_rows = stream_rows
        for num_tokens in prompts:
            chunk = min(args.read_chunk, num_tokens)
            before = streamer.streamed_bytes, streamer.num_windows
            runs = [num_tokens / bench_prompt(model, num_tokens, rng, chunk)
                    for _ in range(args.repeats)]
            num_bytes = (streamer.streamed_bytes - before[0]) / args.repeats
            record(f"pp{num_tokens} (windows of {chunk}, stream >= {stream_rows} rows)", runs,
                   f"{num_bytes / 2**30:.2f} GiB streamed per prompt in "
                   f"{(streamer.num_windows - before[1]) // args.repeats} windows")
            if args.whole_window and chunk < num_tokens:
                record(f"pp{num_tokens} (one window)",
                       [num_tokens / bench_prompt(model, num_tokens, rng)])
        if args.compare_pcie:
            streamer.min_rows = 0
            chunk = min(args.read_chunk, prompts[0])
            record(f"pp{prompts[0]} (windows of {chunk}, streaming off: misses over PCIe)",
                   [prompts[0] / bench_prompt(model, prompts[0], rng, chunk)
                    for _ in range(args.repeats)])
            streamer.min_rows = stream_rows
        record("prompt streaming totals", [streamer.streamed_bytes / 2**30],
               f"GiB streamed in {streamer.num_windows} windows; {streamer.num_borrowed} "
               f"slots borrowed, {streamer.num_refilled} refilled")
        if args.decode_tokens:
            bench_decode(model, 1, 4, 0, rng)
            record(f"tg{args.decode_tokens}", [args.decode_tokens / bench_decode(
                model, 1, args.decode_tokens, 0, rng) for _ in range(args.repeats)])
        if args.decode_tokens and args.slots:
            bench_decode(model, args.slots, 2, 128, rng)
            steps = args.slot_decode_tokens or args.decode_tokens
            record(f"decode x{args.slots} slots ({steps} steps)", [
                args.slots * steps / bench_decode(model, args.slots, steps, 128, rng)
                for _ in range(args.repeats)])
        if args.decode_tokens and args.adaptive_steps and 0 < n < total:
            config = EngineConfig(args.model, n_ctx=2048, expert_cache=n, adapt_every=4)
            tier = ExpertTier(model, store, arena, config)
            tier.start(DecayedCountTier(n))
            tier_decode(tier, model, 1, args.adaptive_warm, 128, rng)  # the tier adapts
            for num_slots in sorted({1, args.slots} - {0}):
                steps = args.adaptive_steps if num_slots == 1 else \
                    (args.slot_decode_tokens or args.adaptive_steps)
                runs, parts = [], []  # the totals' change over each run's decode windows

                def mark():  # after the run's prompts: its decode windows only are counted
                    parts.append(tier.snapshot_totals())

                for _ in range(args.repeats):
                    runs.append(num_slots * steps / tier_decode(tier, model, num_slots, steps,
                                                                128, rng, after_prompts=mark))
                    parts.append(tier.snapshot_totals())
                pairs = list(zip(parts[::2], parts[1::2]))
                hits = sum(b.num_hits - a.num_hits for a, b in pairs)
                misses = sum(b.num_misses - a.num_misses for a, b in pairs)
                swaps = sum(b.num_swaps - a.num_swaps for a, b in pairs)
                wait_s = sum(b.wait_s - a.wait_s for a, b in pairs)
                num_windows = max(sum(b.num_windows - a.num_windows for a, b in pairs), 1)
                record(f"adaptive tier (async, every 4), {num_slots} slot(s) x {steps} steps",
                       runs, f"after {args.adaptive_warm} warm-up windows, decode windows only: "
                       f"hit rate {hits / max(hits + misses, 1):.1%}, {swaps} swaps, tier wait "
                       f"{wait_s / num_windows * 1e3:.2f} ms/window")
            tier.wait_idle(60)
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
