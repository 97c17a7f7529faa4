"""The prompt attention kernels alone on the CUDA backend (attention_prompt.cu: attention_prompt
over fp16 cells, attention_prompt_i8 over int8 ones): a chunk of --rows rows after a cached
prefix of each --depths length. No model needed: random cells and queries of the given shape
(default Qwen3-30B-A3B's heads).

Usage: python tools/bench_prompt_attention.py [--rows 512] [--depths 0,16384,65536]
           [--heads 32 --kv-heads 4 --head-dim 128] [--layers 4] [-r 5] [--baseline CUBIN ...]
Prints milliseconds per layer (the best of -r rounds, each timing 10-50 layers by CUDA events)
for each depth, cell type and build. --layers N gives each launch the next of N layers' caches
in turn, as a model's window does (so the L2 does not keep one layer's cells between launches).
--baseline CUBIN also times another build of attention_prompt.cu (e.g. the previous commit's,
from tools/precompile_cubins.py --kernel-dir) in the same rounds, named by its file; a build
with one kernel for both cell types (before session 42) runs attention_prompt for int8 too.
"""
import argparse
import os

import numpy as np

from strata.backends.cuda.plan import (ATTENTION_PROMPT_FMT, CELLS_FP16, CELLS_INT8, PA_ROWS,
                                       PA_WARPS, attention_prompt_shared_bytes, prompt_kernels)
from strata.backends.cuda.runtime import DYNAMIC_SHARED_MAX


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--depths", default="0,16384,65536")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4, help="layer caches the launches cycle over")
    ap.add_argument("-r", "--repeats", type=int, default=5)
    ap.add_argument("--baseline", action="append", default=[], metavar="CUBIN",
                    help="another build of attention_prompt.cu, timed beside this one's "
                    "(named by its file; may be repeated)")
    args = ap.parse_args()
    from strata._native.cuda_driver import Module
    from strata.backends.cuda.runtime import Runtime

    rt = Runtime(0)
    Q, KVH, D, R, L = args.heads, args.kv_heads, args.head_dim, args.rows, args.layers
    depths = _ints(args.depths)
    C = max(depths) + R
    rng = np.random.default_rng(0)
    keep = []

    def put(a) -> int:
        keep.append(rt.upload(np.ascontiguousarray(a)))
        return int(keep[-1])

    def alloc(num_bytes: int) -> int:
        keep.append(rt.alloc(num_bytes))
        rt.drv.memset_d8(keep[-1], 0, num_bytes)
        return int(keep[-1])

    with rt.active():
        # each cell type's cache [L, 2, KVH, C, D] (int8: then the scales [L, 2, KVH, C]), the
        # same random layer L times; int8's base carries bit 0 (kv.py)
        half = rng.standard_normal((2, KVH, C, D)).astype(np.float16)
        codes = rng.integers(-127, 128, (2, KVH, C, D), dtype=np.int8)
        scales = rng.uniform(0.005, 0.02, (2, KVH, C)).astype(np.float32)
        caches = {}
        for cells, layer, tail in ((CELLS_FP16, half, None), (CELLS_INT8, codes, scales)):
            base = alloc(L * layer.nbytes + (L * tail.nbytes if tail is not None else 0))
            for i in range(L):
                rt.drv.memcpy_htod(base + i * layer.nbytes, layer)
                if tail is not None:
                    rt.drv.memcpy_htod(base + L * layer.nbytes + i * tail.nbytes, tail)
            caches[cells] = base | int(cells == CELLS_INT8)
        del half, codes
        # builds: {label: {cells: kernel}}
        builds = {"this": {cells: rt.kernel(prompt_kernels(cells)[0])
                           for cells in (CELLS_FP16, CELLS_INT8)}}
        for path in args.baseline:
            with open(path, "rb") as f:
                module = Module(f.read())  # its kernels keep it loaded
            kernels = {}
            for cells in (CELLS_FP16, CELLS_INT8):
                try:
                    kernels[cells] = module.function(prompt_kernels(cells)[0])
                except Exception:  # one kernel for both cell types
                    kernels[cells] = module.function("attention_prompt")
                kernels[cells].set_max_dynamic_shared(DYNAMIC_SHARED_MAX["attention_prompt"])
            builds[os.path.splitext(os.path.basename(path))[0]] = kernels
        group = Q // KVH
        warps = min(group, PA_WARPS)
        grid = ((R + PA_ROWS - 1) // PA_ROWS, KVH, (group + warps - 1) // warps)
        q = put(rng.standard_normal((R, Q, D)).astype(np.float32))
        outs = [q, alloc(4 * R * Q * D), alloc(R * Q * D), alloc(R * Q * D // 8)]
        cap = put(np.full(R, C, dtype=np.int32))
        for depth in depths:
            pos = put(np.arange(depth, depth + R, dtype=np.int32))
            launches = {}
            for label, kernels in builds.items():
                for cells, kernel in kernels.items():
                    base = put(np.full(R, caches[cells], dtype=np.uint64))
                    name = f"{label} {'int8' if cells == CELLS_INT8 else 'fp16'}"
                    launches[name] = [kernel.prepare(
                        grid, (32 * warps,), ATTENTION_PROMPT_FMT,
                        [*outs, base, pos, cap, R, i, L, Q, KVH, D, D ** -0.5],
                        attention_prompt_shared_bytes(D), programmatic=False)
                        for i in range(L)]  # as a prompt window's plan: no PDL
            best = {}
            n = 10 if depth > 10000 else 50
            for _ in range(args.repeats):
                for name, per_layer in launches.items():
                    per_layer[0].launch(rt.stream_handle)
                    rt.synchronize()
                    start, stop = rt.drv.Event(), rt.drv.Event()
                    start.record(rt.stream)
                    for j in range(n):
                        per_layer[(j + 1) % L].launch(rt.stream_handle)
                    stop.record(rt.stream)
                    stop.synchronize()
                    ms = stop.time_since(start) / n
                    best[name] = min(best.get(name, ms), ms)
            times = "  ".join(f"{name} {ms:.3f} ms" for name, ms in best.items())
            print(f"{R} rows at {depth:>6}: {times}", flush=True)


if __name__ == "__main__":
    main()
