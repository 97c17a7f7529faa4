"""Prompt windows on the CUDA backend with mmq.cu's tiled products against matmul.cu's dp4a
kernels, at several window sizes: where plan.MMQ_MIN_ROWS (the crossover) should lie.

Usage: python tools/bench_mmq.py MODEL.gguf [--rows 4,8,12,16,24,32,64,128,512] [-r 5] [--profile]
Prints milliseconds per window (median of -r runs after a warm-up) for both kernel families,
then, for the largest window, mmq with dense tiles of 64 rows, of 32 and as plan.py picks them,
and with --profile its device time per kernel.
"""
import argparse
import statistics
import time

import numpy as np

from strata.backends.cuda import plan as cuda_plan
from strata.backends.window import Window
from strata.model.gguf_file import GGUFModel


def window_ms(model, num_rows: int, repeats: int, rng) -> float:
    times = []
    for _ in range(repeats + 1):  # the first run builds the plan (and captures its graph)
        kv = model.new_kv(num_rows + 1)
        tokens = rng.integers(0, model.spec.vocab, num_rows).astype(np.int32)
        t0 = time.perf_counter()
        model.forward_window_greedy(Window.build([(kv, tokens)]))  # returns synchronised
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times[1:])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="GGUF file (qwen3moe / qwen2moe)")
    ap.add_argument("--rows", default="4,8,12,16,24,32,64,128,512")
    ap.add_argument("-r", "--repeats", type=int, default=5)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    from strata.backends.cuda import CudaModel

    model = CudaModel(GGUFModel.open(args.model))
    rng = np.random.default_rng(0)
    default = cuda_plan.MMQ_MIN_ROWS
    print(f"plan.MMQ_MIN_ROWS = {default}")
    print("| rows | dp4a ms | mmq ms | dp4a tokens/s | mmq tokens/s |")
    print("| --- | --- | --- | --- | --- |")
    for num_rows in [int(s) for s in args.rows.split(",") if s]:
        ms = {}
        for family, threshold in (("dp4a", 1 << 30), ("mmq", 1)):
            cuda_plan.MMQ_MIN_ROWS = threshold
            model._plans.clear()  # plans hold their kernel choice
            ms[family] = window_ms(model, num_rows, args.repeats, rng)
        print(f"| {num_rows} | {ms['dp4a']:.2f} | {ms['mmq']:.2f} | "
              f"{1000 * num_rows / ms['dp4a']:,.0f} | {1000 * num_rows / ms['mmq']:,.0f} |")
    cuda_plan.MMQ_MIN_ROWS = default
    num_rows = max(int(s) for s in args.rows.split(",") if s)
    default_blocks = cuda_plan.MMQ_MIN_BLOCKS_64
    print(f"\n| dense tiles, {num_rows} rows | ms | tokens/s |\n| --- | --- | --- |")
    for label, min_blocks in (("64 rows", 0), ("32 rows", 1 << 30),
                              (f"plan (64 from {default_blocks} blocks)", default_blocks)):
        cuda_plan.MMQ_MIN_BLOCKS_64 = min_blocks
        model._plans.clear()
        ms = window_ms(model, num_rows, args.repeats, rng)
        print(f"| {label} | {ms:.2f} | {1000 * num_rows / ms:,.0f} |")
    if args.profile:
        kv = model.new_kv(num_rows + 1)
        window = Window.build([(kv, rng.integers(0, model.spec.vocab, num_rows).astype(np.int32))])
        times = model.profile_window(window)
        total = sum(times.values())
        print(f"\nkernel time per window of {num_rows} rows: {total:.3f} ms (launched one by one)")
        for name, ms in sorted(times.items(), key=lambda item: -item[1])[:12]:
            print(f"  {name:20s} {ms:8.3f} ms  {100 * ms / total:5.1f}%")


if __name__ == "__main__":
    main()
