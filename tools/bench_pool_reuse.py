"""Does this machine's last-level cache carry the CPU pool's experts from one decode token to
the next? The pool's kernel (moe_ffn_ptrs, Q4_0, Qwen3-30B-A3B's expert shape) on token-shaped
work: --layers layers, each with --per-layer pool experts taken from --experts of its own; a
share f of each layer's experts repeats the last token's, the rest are the least recently used
(cold). Prints ms a token and GB/s of expert bytes per f, medians of --repeats passes. If the
repeated experts came back from the cache, a larger f would be faster.

Usage: python tools/bench_pool_reuse.py [--threads N] [--layers 48] [--experts 32]
                                        [--per-layer 5] [--shares 0,0.4,0.8,1] [--tokens 60]
On the H200 host (300 MiB L3, session 48, docs/offload.md): 48 layers x 5 experts (636 MB a
token) read 74-77 GB/s at every share; 16 layers (212 MB, within the L3) 70 at f = 0 and 88
at f = 1.
"""
import argparse
import statistics
import time

import gguf
import numpy as np

from bench_kernels import random_weight
from strata._native import kernels

T = gguf.GGMLQuantizationType
HIDDEN, EXPERT_WIDTH, TOP_K = 2048, 768, 8


def make_layers(rng, num_layers: int, num_experts: int):
    """Per layer [3, E] uint64 pointers to its experts' gate, up, down; the arrays; bytes."""
    layers, owners = [], []
    for _ in range(num_layers):
        mats = [(random_weight(rng, T.Q4_0, EXPERT_WIDTH, HIDDEN),
                 random_weight(rng, T.Q4_0, EXPERT_WIDTH, HIDDEN),
                 random_weight(rng, T.Q4_0, HIDDEN, EXPERT_WIDTH)) for _ in range(num_experts)]
        layers.append(np.array([[m[p].ctypes.data for m in mats] for p in range(3)],
                               dtype=np.uint64))
        owners.append(mats)
    return layers, owners, sum(m.nbytes for m in owners[0][0])


def routing(share: float, num_layers: int, num_experts: int, per_layer: int, tokens: int,
            seed: int) -> list[list[np.ndarray]]:
    """[tokens][layers] ids [1, TOP_K] (-1 past the pool's experts): round(share x per_layer)
    of each layer's experts repeated from the token before, the rest the least recently used."""
    rng = np.random.default_rng(seed)
    keep = int(round(share * per_layer))
    prev = [list(rng.choice(num_experts, per_layer, replace=False)) for _ in range(num_layers)]
    last = np.zeros((num_layers, num_experts))
    out = []
    for t in range(1, tokens + 1):
        token = []
        for layer in range(num_layers):
            kept = [int(e) for e in rng.choice(prev[layer], keep, replace=False)] if keep else []
            order = np.argsort(last[layer] + rng.random(num_experts) * 0.1)
            fresh = [int(e) for e in order if e not in prev[layer]][:per_layer - keep]
            chosen = kept + fresh
            last[layer, chosen] = t
            prev[layer] = chosen
            ids = np.full((1, TOP_K), -1, dtype=np.int32)
            ids[0, :len(chosen)] = chosen
            token.append(ids)
        out.append(token)
    return out


def run(layers, seq, warm: int) -> float:
    """Seconds a token over seq[warm:]."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((1, HIDDEN)).astype(np.float32)             # [1, H]
    wts = rng.random((1, TOP_K)).astype(np.float32)                     # [1, K]
    out = np.zeros((1, HIDDEN), dtype=np.float32)
    q = int(T.Q4_0)
    for i, token in enumerate(seq):
        if i == warm:
            start = time.perf_counter()
        for pointers, ids in zip(layers, token):
            kernels.moe_ffn_ptrs(x, pointers, q, q, q, EXPERT_WIDTH, ids, wts, out)
    return (time.perf_counter() - start) / (len(seq) - warm)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--per-layer", type=int, default=5)
    ap.add_argument("--shares", default="0,0.4,0.8,1")
    ap.add_argument("--tokens", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    shares = [float(s) for s in args.shares.split(",")]
    if (args.per_layer > args.experts // 2 or not all(0 <= s <= 1 for s in shares)
            or args.tokens < 2):
        ap.error("--per-layer at most half of --experts (the fresh ones must be cold), "
                 "--shares in [0, 1], --tokens >= 2")
    if args.threads:
        kernels.set_num_threads(args.threads)
    layers, _owners, expert_bytes = make_layers(np.random.default_rng(0), args.layers,
                                                args.experts)
    warm = max(1, args.tokens // 8)
    seqs = {s: routing(s, args.layers, args.experts, args.per_layer, args.tokens + warm, 1)
            for s in shares}
    times = {s: [] for s in shares}
    for r in range(args.repeats):  # alternating order between passes
        for s in (shares if r % 2 == 0 else shares[::-1]):
            times[s].append(run(layers, seqs[s], warm))
    token_bytes = args.layers * args.per_layer * expert_bytes
    print(f"{args.layers} layers x {args.per_layer} experts of {expert_bytes / 1e6:.2f} MB "
          f"({token_bytes / 1e6:.0f} MB a token), {kernels.get_num_threads()} threads")
    print("| repeated share | ms a token (median) | GB/s | runs (ms) |")
    print("| --- | --- | --- | --- |")
    for s in shares:
        ms = 1e3 * statistics.median(times[s])
        print(f"| {s:g} | {ms:.2f} | {token_bytes / ms / 1e6:.1f} | "
              f"{', '.join(f'{1e3 * t:.2f}' for t in times[s])} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
