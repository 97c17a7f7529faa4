"""Benchmark the CUDA backend: prompt reading (pp), one-slot decoding (tg) and aggregate decode
with several slots in one window, medians of several runs, tokens/s.

Usage: python tools/bench_cuda.py MODEL.gguf [-p 512] [-n 128] [-r 3] [--slots 1,2,4,8]
       [--synth qwen3-30b-a3b --weight-type q4_0 --jobs 16]  write a synth model first if missing
The synth file is the one `strata-tool synth` writes (same bytes), made with --jobs processes.
"""
import argparse
import json
import os
import statistics
import time

import numpy as np

from strata.backends.window import Window
from strata.model.gguf_file import GGUFModel


def write_synth(path: str, shape: str, weight_type: str, jobs: int) -> None:
    """`strata-tool synth` in parallel: tensors made by a process pool, written in order."""
    from multiprocessing import Pool

    from strata.model.writer import write_gguf
    from strata.tool import synth

    qtype = synth.WEIGHT_TYPES[weight_type]
    spec = synth.build_spec(shape)
    synth._check_rows(spec, shape, qtype)
    names = synth._write_order(spec)
    t0 = time.perf_counter()
    with Pool(jobs) as pool:
        arrays = pool.imap(_make, [(spec, n, int(synth.tensor_type(n, qtype))) for n in names])
        tensors = [(n, synth.tensor_type(n, qtype), (lambda it=arrays: next(it))) for n in names]
        extra = {"general.file_type": int(synth._FILE_TYPES[qtype]),
                 "general.quantization_version": 2, "strata.synth.seed": 0,
                 "strata.synth.shape": shape}
        write_gguf(path, spec, tensors, synth.synth_tokenizer_meta(spec.vocab), extra_meta=extra,
                   name=f"strata-synth-{shape}-{weight_type}")
    print(f"wrote {path} ({os.path.getsize(path) / 2**30:.2f} GiB) in "
          f"{time.perf_counter() - t0:.0f} s")


def _make(job):
    from gguf import GGMLQuantizationType

    from strata.tool import synth

    spec, name, qtype = job
    return synth._make_tensor(spec, name, GGMLQuantizationType(qtype), 0)()


def _sync_time(fn) -> float:
    t0 = time.perf_counter()
    fn()  # every forward returns after its stream synchronised
    return time.perf_counter() - t0


def bench_prompt(model, num_tokens, rng):
    kv = model.new_kv(num_tokens + 1)
    tokens = rng.integers(0, model.spec.vocab, num_tokens).astype(np.int32)
    return _sync_time(lambda: model.forward_window_greedy(Window.build([(kv, tokens)])))


def bench_decode(model, num_slots, num_steps, num_prompt, rng):
    """Seconds of `num_steps` windows of `num_slots` decode rows after prompts of num_prompt."""
    kvs = [model.new_kv(num_prompt + num_steps + 1) for _ in range(num_slots)]
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
    ap.add_argument("--jobs", type=int, default=os.cpu_count(), help="processes for --synth")
    ap.add_argument("--json", default=None, help="write the figures here too")
    ap.add_argument("--profile", action="store_true",
                    help="also print device time per kernel for a decode and a prompt window")
    args = ap.parse_args()

    if args.synth and not os.path.exists(args.model):
        write_synth(args.model, args.synth, args.weight_type, args.jobs)
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
            kv = model.new_kv(num_prompt + num_rows + 1)
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
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    main()
