"""Benchmark multi-slot decoding on the CPU backend: aggregate decode tokens/s with N slots in
one window per step vs N separate one-slot forwards per step (medians of several runs).

Usage: python tools/bench_window.py MODEL.gguf [--slots 1,2,4,8] [--steps 8] [--repeats 5]
                                    [--prompt-tokens 32] [--threads N] [--cpu-time]
       [--synth SHAPE --weight-type q4_0]   write a synth model to MODEL.gguf first if missing
"""
import argparse
import os
import statistics
import time

import numpy as np

from strata._native import kernels
from strata.backends.cpu import CpuModel
from strata.backends.window import Window
from strata.model.gguf_file import GGUFModel


def decode_steps(model, kvs, tokens, num_steps, is_window):
    """`num_steps` decode steps of every slot (a token each); returns the seconds they took.
    The KVs are cut back to their prompts first, so every run starts from the same state."""
    for kv, num_prompt in zip(kvs, PROMPT_TOKENS):
        kv.truncate(num_prompt)
    clock = time.process_time if CPU_TIME[0] else time.perf_counter
    t0 = clock()
    for step in range(num_steps):
        if is_window:
            model.forward_window(Window.build(
                [(kv, tokens[i, step:step + 1]) for i, kv in enumerate(kvs)]))
        else:
            for i, kv in enumerate(kvs):
                model.forward(tokens[i, step:step + 1], kv)
    return clock() - t0


PROMPT_TOKENS: list[int] = []
CPU_TIME = [False]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="GGUF file (qwen3moe / qwen2moe)")
    ap.add_argument("--slots", default="1,2,4,8", help="slot counts to measure")
    ap.add_argument("--steps", type=int, default=8, help="decode steps per run")
    ap.add_argument("--repeats", type=int, default=5, help="runs per measurement (median)")
    ap.add_argument("--prompt-tokens", type=int, default=32, help="tokens in each slot's KV")
    ap.add_argument("--threads", type=int, default=None, help="kernel threads (default: all)")
    ap.add_argument("--cpu-time", action="store_true",
                    help="process CPU time, not wall time (steadier on a busy machine; with "
                         "--threads 1 it is what one core costs)")
    ap.add_argument("--synth", default=None, help="write this synth shape to MODEL if missing")
    ap.add_argument("--weight-type", default="q4_0", help="weight type for --synth")
    args = ap.parse_args()
    CPU_TIME[0] = args.cpu_time

    if args.synth and not os.path.exists(args.model):
        from strata.tool.synth import synth_model
        print(f"writing synth model {args.synth} ({args.weight_type}) to {args.model}")
        synth_model(args.model, shape=args.synth, weight_type=args.weight_type)
    model = CpuModel(GGUFModel.open(args.model), num_threads=args.threads)
    spec = model.spec
    slot_counts = [int(s) for s in args.slots.split(",")]
    rng = np.random.default_rng(0)
    max_slots = max(slot_counts)
    capacity = args.prompt_tokens + args.steps
    kvs = [model.new_kv(capacity) for _ in range(max_slots)]
    PROMPT_TOKENS[:] = [args.prompt_tokens] * max_slots
    for kv in kvs:
        model.forward(rng.integers(0, spec.vocab, args.prompt_tokens).astype(np.int32), kv)
    tokens = rng.integers(0, spec.vocab, (max_slots, args.steps)).astype(np.int32)  # [S, steps]
    print(f"{spec.arch}: {spec.n_layers} layers, hidden {spec.hidden}, {spec.n_experts} experts "
          f"top-{spec.n_experts_used}; {kernels.get_num_threads()} threads, "
          f"{kernels.simd_level()}; {args.prompt_tokens} tokens in each KV, {args.steps} steps "
          f"x {args.repeats} runs, {'CPU' if args.cpu_time else 'wall'} time")
    print(f"{'slots':>5} {'window tok/s':>13} {'separate tok/s':>15} {'speed-up':>9}")
    for num_slots in slot_counts:
        used = kvs[:num_slots]
        times = {True: [], False: []}
        decode_steps(model, used, tokens, 1, True)  # warm-up
        decode_steps(model, used, tokens, 1, False)
        # the two ways alternate, so a busy spell on a shared machine slows both alike
        for _ in range(args.repeats):
            for is_window in (True, False):
                times[is_window].append(decode_steps(model, used, tokens, args.steps, is_window))
        rates = {k: num_slots * args.steps / statistics.median(v) for k, v in times.items()}
        print(f"{num_slots:>5} {rates[True]:>13.1f} {rates[False]:>15.1f} "
              f"{rates[True] / rates[False]:>8.2f}x")


if __name__ == "__main__":
    main()
