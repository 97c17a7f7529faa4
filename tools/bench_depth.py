"""Benchmark prompt reading and decoding deep in a context: a CHUNK-token prompt chunk and single
decode tokens against KV caches already holding DEPTH tokens (medians of several runs).

The cached tokens are random K/V cells written through KVCache.append (what a restored
conversation does), so a 16K-token depth costs no 16K-token prompt read to set up.

Usage: python tools/bench_depth.py MODEL.gguf [--depths 0,4096,16384] [--chunk 512]
                                   [--decode-steps 16] [--repeats 3] [--threads N] [--kv f32|f16]
                                   [--cpu-time]
"""
import argparse
import statistics
import time

import numpy as np

from strata._native import kernels
from strata.backends.cpu import CpuModel
from strata.model.gguf_file import GGUFModel


def filled_kv(model, depth, room, dtype, rng):
    """A KV cache holding `depth` random tokens and room for `room` more."""
    spec = model.spec
    kv = model.new_kv(depth + room, dtype=dtype)
    if depth:
        shape = (spec.n_kv_heads, depth, spec.head_dim)  # [KV, depth, D]
        for layer in range(spec.n_layers):
            kv.append(layer, rng.standard_normal(shape, dtype=np.float32),
                      rng.standard_normal(shape, dtype=np.float32))
        kv.commit(depth)
    return kv


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="GGUF file (qwen3moe / qwen2moe)")
    ap.add_argument("--depths", default="0,4096,16384", help="cached tokens before the chunk")
    ap.add_argument("--chunk", type=int, default=512, help="tokens of the prompt chunk")
    ap.add_argument("--decode-steps", type=int, default=16, help="decode tokens per run")
    ap.add_argument("--repeats", type=int, default=3, help="runs per measurement (median)")
    ap.add_argument("--threads", type=int, default=None, help="kernel threads (default: all)")
    ap.add_argument("--kv", choices=("f32", "f16"), default="f32", help="KV cell type")
    ap.add_argument("--cpu-time", action="store_true",
                    help="process CPU time, not wall time (steadier on a busy machine; with "
                         "--threads 1 it is what one core costs)")
    args = ap.parse_args()
    clock = time.process_time if args.cpu_time else time.perf_counter

    model = CpuModel(GGUFModel.open(args.model), num_threads=args.threads)
    spec = model.spec
    rng = np.random.default_rng(0)
    dtype = np.float32 if args.kv == "f32" else np.float16
    chunk = rng.integers(0, spec.vocab, args.chunk).astype(np.int32)
    print(f"{spec.arch}: {spec.n_layers} layers, {spec.n_heads}/{spec.n_kv_heads} heads of "
          f"{spec.head_dim}; {kernels.get_num_threads()} threads, {kernels.simd_level()}, "
          f"{args.kv} KV; medians of {args.repeats} runs "
          f"({'CPU' if args.cpu_time else 'wall'} time)")
    print(f"{'depth':>6} {f'pp{args.chunk} tok/s':>12} {'chunk s':>8} {'tg tok/s':>9}")
    for depth in [int(d) for d in args.depths.split(",")]:
        kv = filled_kv(model, depth, args.chunk + args.decode_steps, dtype, rng)
        read_s, decode_s = [], []
        for _ in range(args.repeats):
            kv.truncate(depth)
            t0 = clock()
            model.forward(chunk, kv)
            read_s.append(clock() - t0)
            kv.truncate(depth)
            t0 = clock()
            for step in range(args.decode_steps):
                model.forward(chunk[step:step + 1], kv)
            decode_s.append(clock() - t0)
        chunk_s = statistics.median(read_s)
        print(f"{depth:>6} {args.chunk / chunk_s:>12.1f} {chunk_s:>8.2f} "
              f"{args.decode_steps / statistics.median(decode_s):>9.1f}", flush=True)


if __name__ == "__main__":
    main()
