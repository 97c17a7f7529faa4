"""Benchmark the CUDA backend: prompt reading (pp), one-slot decoding (tg) and aggregate decode
with several slots in one window, medians of several runs, tokens/s.

Usage: python tools/bench_cuda.py MODEL.gguf [-p 512] [-n 128] [-r 3] [--slots 1,2,4,8]
       [--synth qwen3-30b-a3b --weight-type q4_0 --jobs 16]  write a synth model first if missing
       [--kv int8] [--profile] [--mm-variants 4:4:4,1:8:2]  (matmul.cu's NR:TR:MM_GROUP_UNROLL)
The synth file is the one `strata-tool synth` writes (same bytes), made with --jobs processes.
"""
import argparse
import json
import os
import re
import statistics
import time

import numpy as np

from strata.backends.window import Window
from strata.model.gguf_file import GGUFModel


def write_synth(path: str, shape: str, weight_type: str, skew: float, jobs: int) -> None:
    """`strata-tool synth --jobs` (the same bytes as one process), timed."""
    from strata.tool.synth import synth_model

    t0 = time.perf_counter()
    synth_model(path, shape, weight_type, routing_skew=skew, jobs=jobs)
    print(f"wrote {path} ({os.path.getsize(path) / 2**30:.2f} GiB) in "
          f"{time.perf_counter() - t0:.0f} s", flush=True)


def _sync_time(fn) -> float:
    t0 = time.perf_counter()
    fn()  # every forward returns after its stream synchronised
    return time.perf_counter() - t0


KV_DTYPES = {"f16": np.float16, "int8": np.int8}
KV_DTYPE = np.float16  # of every KV the benchmarks make (--kv)


def bench_prompt(model, num_tokens, rng):
    kv = model.new_kv(num_tokens + 1, dtype=KV_DTYPE)
    tokens = rng.integers(0, model.spec.vocab, num_tokens).astype(np.int32)
    return _sync_time(lambda: model.forward_window_greedy(Window.build([(kv, tokens)])))


def bench_decode(model, num_slots, num_steps, num_prompt, rng):
    """Seconds of `num_steps` windows of `num_slots` decode rows after prompts of num_prompt."""
    kvs = [model.new_kv(num_prompt + num_steps + 1, dtype=KV_DTYPE) for _ in range(num_slots)]
    for kv in kvs:
        if num_prompt:
            model.forward_window_greedy(Window.build(
                [(kv, rng.integers(0, model.spec.vocab, num_prompt).astype(np.int32))]))
    nxt = rng.integers(0, model.spec.vocab, num_slots).astype(np.int32)

    def run():
        tok = nxt
        for _ in range(num_steps):
            tok = model.forward_window_greedy(
                Window.build([(kv, tok[i:i + 1]) for i, kv in enumerate(kvs)]))

    return _sync_time(run)


def use_mm_variant(model, outputs_per_warp: int, rows_per_tile: int, group_unroll: int) -> None:
    """Recompile matmul.cu with NR (outputs per warp), TR (rows per register tile) and
    MM_GROUP_UNROLL changed and make `model` plan with it (plan.MM_ROWS follows NR)."""
    from pycuda.compiler import compile as nvcc_compile

    from strata._native import cuda_driver
    from strata.backends.cuda import plan, runtime

    src = runtime.module_source("matmul.cu")
    src = re.sub(r"^#define NR \d+", f"#define NR {outputs_per_warp}", src, flags=re.M)
    src = re.sub(r"^#define TR \d+", f"#define TR {rows_per_tile}", src, flags=re.M)
    src = re.sub(r"^#define MM_GROUP_UNROLL \d+", f"#define MM_GROUP_UNROLL {group_unroll}",
                 src, flags=re.M)
    warps = int(re.search(r"^#define MM_WARPS (\d+)", src, flags=re.M).group(1))
    with model.runtime.active():
        module = cuda_driver.Module(nvcc_compile(src, no_extern_c=True, arch=model.runtime.arch,
                                                 options=["-std=c++17", "-O3"]))
        for name in runtime._kernel_names(src):
            model.runtime._kernels[name] = module.function(name)
    plan.MM_ROWS = warps * outputs_per_warp
    model._plans.clear()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="GGUF file (qwen3moe / qwen2moe)")
    ap.add_argument("-p", "--prompt-tokens", type=int, default=512)
    ap.add_argument("-n", "--decode-tokens", type=int, default=128)
    ap.add_argument("-r", "--repeats", type=int, default=3)
    ap.add_argument("--slots", default="1,2,4,8", help="slot counts for aggregate decode")
    ap.add_argument("--slot-prompt-tokens", type=int, default=128,
                    help="prompt of each slot before the aggregate decode")
    ap.add_argument("--device", type=int, default=None)
    ap.add_argument("--no-graphs", action="store_true", help="launch lists, no CUDA graphs")
    ap.add_argument("--synth", default=None, help="write this synth shape to MODEL if missing")
    ap.add_argument("--weight-type", default="q4_0", help="weight type for --synth")
    ap.add_argument("--synth-only", action="store_true", help="write the synth file and stop")
    ap.add_argument("--jobs", type=int, default=os.cpu_count(), help="processes for --synth")
    ap.add_argument("--json", default=None, help="write the figures here too")
    ap.add_argument("--kv", choices=sorted(KV_DTYPES), default="f16", help="KV cell type")
    ap.add_argument("--mm-variants", default="",
                    help="NR:TR:MM_GROUP_UNROLL of matmul.cu to re-measure tg with, e.g. "
                    "4:4:4,1:8:2")
    ap.add_argument("--profile", action="store_true",
                    help="also print device time per kernel for a decode and a prompt window")
    args = ap.parse_args()
    global KV_DTYPE
    KV_DTYPE = KV_DTYPES[args.kv]

    if args.synth and not os.path.exists(args.model):
        write_synth(args.model, args.synth, args.weight_type, 0.0, args.jobs)
    if args.synth_only:
        return
    from strata.backends.cuda import CudaModel

    t0 = time.perf_counter()
    model = CudaModel(GGUFModel.open(args.model), device=args.device)
    model.use_graphs = not args.no_graphs
    print(f"loaded on {model.runtime.name} in {time.perf_counter() - t0:.1f} s; "
          f"{model.launches_per_window(1, 1)} launches per decode window of 1 row")
    rng = np.random.default_rng(0)
    figures = {}
    bench_prompt(model, args.prompt_tokens, rng)  # warm-up: plans, module load
    bench_decode(model, 1, 4, 0, rng)
    pp = [args.prompt_tokens / bench_prompt(model, args.prompt_tokens, rng)
          for _ in range(args.repeats)]
    tg = [args.decode_tokens / bench_decode(model, 1, args.decode_tokens, 0, rng)
          for _ in range(args.repeats)]
    figures[f"pp{args.prompt_tokens}"] = pp
    figures[f"tg{args.decode_tokens}"] = tg
    for n in [int(s) for s in args.slots.split(",") if s]:
        bench_decode(model, n, 2, args.slot_prompt_tokens, rng)  # warm-up of this shape
        runs = [n * args.decode_tokens / bench_decode(model, n, args.decode_tokens,
                                                      args.slot_prompt_tokens, rng)
                for _ in range(args.repeats)]
        figures[f"decode x{n} slots"] = runs
    print(f"| test | tokens/s (median of {args.repeats}) | runs |")
    print("| --- | --- | --- |")
    for name, runs in figures.items():
        print(f"| {name} | {statistics.median(runs):,.1f} | "
              f"{', '.join(f'{r:,.1f}' for r in runs)} |")
    if args.profile:
        for label, num_prompt, num_rows in (("decode, 1 row at context 128", 128, 1),
                                            (f"prompt of {args.prompt_tokens}", 0,
                                             args.prompt_tokens)):
            kv = model.new_kv(num_prompt + num_rows + 1, dtype=KV_DTYPE)
            if num_prompt:
                model.forward_window_greedy(Window.build(
                    [(kv, rng.integers(0, model.spec.vocab, num_prompt).astype(np.int32))]))
            window = Window.build([(kv, rng.integers(0, model.spec.vocab,
                                                     num_rows).astype(np.int32))])
            times = model.profile_window(window)
            total = sum(times.values())
            print(f"\nkernel time per window, {label}: {total:.3f} ms (launched one by one)")
            for name, ms in sorted(times.items(), key=lambda kv_: -kv_[1])[:10]:
                print(f"  {name:20s} {ms:8.3f} ms  {100 * ms / total:5.1f}%")
            figures[f"profile {label}"] = times
    for variant in [v for v in args.mm_variants.split(",") if v]:
        nr, tr, unroll = (int(n) for n in variant.split(":"))
        use_mm_variant(model, nr, tr, unroll)
        bench_decode(model, 1, 4, 0, rng)  # warm-up: plans, graph capture
        runs = [args.decode_tokens / bench_decode(model, 1, args.decode_tokens, 0, rng)
                for _ in range(args.repeats)]
        figures[f"NR {nr} TR {tr} unroll {unroll}: tg{args.decode_tokens}"] = runs
        listed = ", ".join(f"{r:,.1f}" for r in runs)
        print(f"matmul.cu NR={nr} TR={tr} MM_GROUP_UNROLL={unroll}: tg{args.decode_tokens} "
              f"{statistics.median(runs):,.1f} tokens/s ({listed})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    main()
