"""The decode attention kernels alone on the CUDA backend, at context positions: attention.cu's
block per query head (attention_d*) against attention_group.cu's block per GQA group (its SIMT
and tensor-core forms): where plan.ATT_DEEP_FROM (the crossover) should lie. No model needed:
random fp16 cells and queries of the given shape (default Qwen3-30B-A3B's heads).

Usage: python tools/bench_attention.py [--rows 1,2,4,8] [--positions 0,1023,2047,4095,16383,65535]
           [--heads 32 --kv-heads 4 --head-dim 128] [--layers 1] [-r 3] [--splits 32]
           [--baseline CUBIN ...]
Prints microseconds per layer (the best of -r rounds of 50-200 layers timed by CUDA events)
for each rows x position and kernel; a group kernel's time includes its merge launch
(attention_group_merge, which folds the split partials). Figures: docs/cuda.md, "Deep in a
context".
--layers N gives each launch the next of N layers' caches in turn, as a model's window does:
with 1 layer a cache that fits the L2 (up to ~12K cells of 4 KV heads x 128 dims in the H200's
50 MB) is read from there by every launch after the first, which a model never sees.
--baseline CUBIN also times the group kernel (and its merge launch, where that build has one)
of another build of attention_group.cu (e.g. the previous commit's, from
tools/precompile_cubins.py) in the same rounds, named by its file (a
build with its split count fixed at compile time reads true only at that count). --splits
32,64 times the group kernels at each split count (the grid's z; plan.GQA_SPLITS by default).
"""
import argparse
import os

import numpy as np

from strata.backends.cuda.plan import (ATT_SPLITS, ATTENTION_FMT, ATTENTION_GROUP_FMT,
                                       ATTENTION_GROUP_MERGE_FMT, GQA_SPLITS, INT_MAX,
                                       attention_group_kernel, attention_group_launch,
                                       attention_group_merge_launch,
                                       attention_group_part_floats, attention_kernels)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--positions", default="0,255,1023,2047,4095,8191,16383,65535")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=1, help="layer caches the launches cycle over")
    ap.add_argument("-r", "--repeats", type=int, default=3)
    ap.add_argument("--splits", default=str(GQA_SPLITS),
                    help="split counts (grid z) of the group kernel to time, e.g. 32,64")
    ap.add_argument("--baseline", action="append", default=[], metavar="CUBIN",
                    help="another build of attention_group.cu, timed beside this one's "
                    "(named by its file; may be repeated)")
    args = ap.parse_args()
    from strata.backends.cuda.runtime import Runtime

    rt = Runtime(0)
    Q, KVH, D = args.heads, args.kv_heads, args.head_dim
    positions = _ints(args.positions)
    C, L = max(positions) + 1, args.layers
    splits = _ints(args.splits)
    rng = np.random.default_rng(0)
    keep = []

    def put(a) -> int:
        keep.append(rt.upload(np.ascontiguousarray(a)))
        return int(keep[-1])

    def zeros(num_bytes: int) -> int:
        keep.append(rt.alloc(num_bytes))
        rt.drv.memset_d8(keep[-1], 0, num_bytes)
        return int(keep[-1])

    with rt.active():
        layer = rng.standard_normal((2, KVH, C, D)).astype(np.float16)  # [2, KVH, C, D]
        keep.append(rt.alloc(L * layer.nbytes))  # [L, 2, KVH, C, D]: the same cells each layer
        cache = int(keep[-1])
        for i in range(L):
            rt.drv.memcpy_htod(cache + i * layer.nbytes, layer)
        del layer
        per_head = rt.kernel(attention_kernels(D)[0])
        merge = rt.kernel("attention_group_merge")
        # form: (group kernel, its merge launch's kernel or None: a build whose group kernel
        # folds the splits itself)
        forms = {form: (rt.kernel(attention_group_kernel(D, Q // KVH,
                                                         {"STRATA_ATT_GROUP": form})[0]), merge)
                 for form in ("simt", "mma")}
        if forms["mma"][0].name == forms["simt"][0].name:
            del forms["mma"]  # a head dim only the SIMT form takes
        for path in args.baseline:
            from strata._native.cuda_driver import Module

            with open(path, "rb") as f:
                baseline = Module(f.read())  # its kernels keep it loaded
            label = os.path.splitext(os.path.basename(path))[0]
            kernels = [baseline.function(attention_group_kernel(D, Q // KVH)[0])]
            try:
                kernels.append(baseline.function("attention_group_merge"))
            except Exception:  # a build from before the merge launch
                kernels.append(None)
            for kernel in kernels:
                if kernel is not None:
                    kernel.programmatic = per_head.programmatic
            forms[label] = tuple(kernels)
        for R in _ints(args.rows):
            q = put(rng.standard_normal((R, Q, D)).astype(np.float32))
            outs = [q, zeros(4 * R * Q * D), zeros(R * Q * D), zeros(R * Q * D // 8),
                    put(np.full(R, cache, dtype=np.uint64))]
            cap = put(np.full(R, C, dtype=np.int32))
            split = [zeros(4 * R * Q * ATT_SPLITS * (2 + D)), zeros(4 * R * Q)]
            # the partials for the most splits asked for (plan.GQA_SPLITS by default)
            most = max(splits) / GQA_SPLITS
            group_split = [zeros(int(4 * most * attention_group_part_floats(R, Q, D))),
                           zeros(4 * R * Q)]  # and each slot's row (the merge launch's)
            _, grid, block = attention_group_launch(R, Q, KVH, D)
            _, merge_grid, merge_block = attention_group_merge_launch(R, Q, D)
            for pos in positions:
                pos_buf = put(np.full(R, pos, dtype=np.int32))
                dims = [L, Q, KVH, D, D ** -0.5]  # after the layer
                # each layer's launches
                launches = {"per head": [[per_head.prepare(
                    (R, Q, ATT_SPLITS), (128,), ATTENTION_FMT,
                    [*outs, pos_buf, cap, i, *dims, *split, INT_MAX])] for i in range(L)]}
                for form, (kernel, fold) in forms.items():
                    for S in splits:
                        label = f"group {form}" + (f" x{S}" if len(splits) > 1 else "")
                        after = [] if fold is None else [fold.prepare(
                            merge_grid, merge_block, ATTENTION_GROUP_MERGE_FMT,
                            [*outs, pos_buf, cap, Q, D, S, *group_split])]
                        launches[label] = [[kernel.prepare(
                            grid[:2] + (S,), block, ATTENTION_GROUP_FMT,
                            [*outs, pos_buf, cap, R, 0, i, *dims, *group_split, 0]), *after]
                            for i in range(L)]
                best = {}
                n = 50 if pos > 10000 else 200
                for _ in range(args.repeats):
                    for name, per_layer in launches.items():
                        for launch in per_layer[0]:
                            launch.launch(rt.stream_handle)
                        rt.synchronize()
                        start, stop = rt.drv.Event(), rt.drv.Event()
                        start.record(rt.stream)
                        for j in range(n):
                            for launch in per_layer[(j + 1) % L]:
                                launch.launch(rt.stream_handle)
                        stop.record(rt.stream)
                        stop.synchronize()
                        us = stop.time_since(start) * 1e3 / n
                        best[name] = min(best.get(name, us), us)
                print(f"{R} rows at {pos:>6}: " + "  ".join(f"{name} {us:7.1f} us"
                                                            for name, us in best.items()),
                      flush=True)


if __name__ == "__main__":
    main()
