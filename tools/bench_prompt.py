"""Prompt-chunk windows on the CUDA backend with the prompt kernels (attention_prompt beside
attention_singles, group_pairs_wide) against the decode ones (`attention`, `group_pairs`), in one
run: milliseconds per window, and device time per kernel.

Usage: python tools/bench_prompt.py MODEL.gguf [--rows 512] [--contexts 0,3584] [--decodes 0,8]
       [-r 5] [--profile]
A window is a chunk of --rows prompt rows after a cached prefix of each --contexts length, plus
each --decodes count of decode rows of other slots (at context 128).
"""
import argparse
import statistics
import time

import numpy as np

from strata.backends.cuda import plan as cuda_plan
from strata.backends.window import Window
from strata.model.gguf_file import GGUFModel


def make_window(model, num_rows: int, context: int, num_decodes: int, rng) -> Window:
    """A chunk of num_rows after `context` cached cells, and num_decodes one-row decodes."""
    vocab = model.spec.vocab
    kv = model.new_kv(context + num_rows + 1)
    kv.commit(context)  # cells past the prefix are whatever the KV holds: speed only
    rows = [(kv, rng.integers(0, vocab, num_rows).astype(np.int32))]
    for _ in range(num_decodes):
        other = model.new_kv(130)
        other.commit(128)
        rows.append((other, rng.integers(0, vocab, 1).astype(np.int32)))
    return Window.build(rows)


def window_ms(model, window_args, repeats: int, rng) -> float:
    times = []
    for _ in range(repeats + 1):  # the first run builds the plan
        window = make_window(model, *window_args, rng)
        t0 = time.perf_counter()
        model.forward_window_greedy(window)  # returns synchronised
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times[1:])


def use_prompt_kernels(model, on: bool, defaults) -> None:
    cuda_plan.PA_HEAD_DIMS, cuda_plan.GROUP_WIDE_MAX_SHARED_BYTES = (
        defaults if on else ((), 0))
    model.drop_plans()  # plans hold their kernel choice


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="GGUF file (qwen3moe / qwen2moe)")
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--contexts", default="0,3584")
    ap.add_argument("--decodes", default="0,8")
    ap.add_argument("-r", "--repeats", type=int, default=5)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    from strata.backends.cuda import CudaModel

    model = CudaModel(GGUFModel.open(args.model))
    rng = np.random.default_rng(0)
    defaults = (cuda_plan.PA_HEAD_DIMS, cuda_plan.GROUP_WIDE_MAX_SHARED_BYTES)
    print("| chunk rows | context | decode rows | decode kernels ms | prompt kernels ms | "
          "prompt tokens/s (decode / prompt kernels) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for context in [int(s) for s in args.contexts.split(",") if s]:
        for num_decodes in [int(s) for s in args.decodes.split(",") if s]:
            ms = {}
            for on in (False, True):
                use_prompt_kernels(model, on, defaults)
                ms[on] = window_ms(model, (args.rows, context, num_decodes), args.repeats, rng)
            print(f"| {args.rows} | {context} | {num_decodes} | {ms[False]:.2f} | {ms[True]:.2f}"
                  f" | {1000 * args.rows / ms[False]:,.0f} / {1000 * args.rows / ms[True]:,.0f} |",
                  flush=True)
    if args.profile:
        for on in (False, True):
            use_prompt_kernels(model, on, defaults)
            times = model.profile_window(make_window(model, args.rows, 0, 0, rng))
            total = sum(times.values())
            label = "prompt" if on else "decode"
            print(f"\n{label} kernels, {args.rows} rows at context 0: {total:.3f} ms "
                  "(launched one by one)")
            for name, t in sorted(times.items(), key=lambda kv_: -kv_[1])[:12]:
                print(f"  {name:22s} {t:8.3f} ms  {100 * t / total:5.1f}%")


if __name__ == "__main__":
    main()
