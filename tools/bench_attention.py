"""The decode attention kernels alone on the CUDA backend, at context positions: attention.cu's
block per query head (attention_d*) against attention_group.cu's block per GQA group (its SIMT
and tensor-core forms): where plan.ATT_DEEP_FROM (the crossover) should lie. No model needed:
random fp16 cells and queries of the given shape (default Qwen3-30B-A3B's heads).

Usage: python tools/bench_attention.py [--rows 1,2,4,8] [--positions 0,1023,2047,4095,16383,65535]
           [--heads 32 --kv-heads 4 --head-dim 128] [-r 3]
Prints microseconds per launch (the best of -r rounds of 50-200 launches timed by CUDA events)
for each rows x position and kernel. Figures: docs/cuda.md, "Deep in a context".
"""
import argparse

import numpy as np

from strata.backends.cuda.plan import (ATT_SPLITS, ATTENTION_FMT, ATTENTION_GROUP_FMT, INT_MAX,
                                       attention_group_kernel, attention_group_launch,
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
    ap.add_argument("-r", "--repeats", type=int, default=3)
    args = ap.parse_args()
    from strata.backends.cuda.runtime import Runtime

    rt = Runtime(0)
    Q, KVH, D = args.heads, args.kv_heads, args.head_dim
    positions = _ints(args.positions)
    C, L = max(positions) + 1, 1
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
        cache = put(rng.standard_normal((L, 2, KVH, C, D)).astype(np.float16))
        per_head = rt.kernel(attention_kernels(D)[0])
        forms = {form: rt.kernel(attention_group_kernel(D, Q // KVH,
                                                        {"STRATA_ATT_GROUP": form})[0])
                 for form in ("simt", "mma")}
        if forms["mma"].name == forms["simt"].name:
            del forms["mma"]  # a head dim only the SIMT form takes
        for R in _ints(args.rows):
            q = put(rng.standard_normal((R, Q, D)).astype(np.float32))
            outs = [q, zeros(4 * R * Q * D), zeros(R * Q * D), zeros(R * Q * D // 8),
                    put(np.full(R, cache, dtype=np.uint64))]
            cap = put(np.full(R, C, dtype=np.int32))
            split = [zeros(4 * R * Q * ATT_SPLITS * (2 + D)), zeros(4 * R * Q)]
            group_split = [zeros(4 * attention_group_part_floats(R, Q, D)), zeros(4 * R * Q)]
            _, grid, block = attention_group_launch(R, Q, KVH, D)
            for pos in positions:
                pos_buf = put(np.full(R, pos, dtype=np.int32))
                dims = [0, L, Q, KVH, D, D ** -0.5]
                launches = {"per head": per_head.prepare(
                    (R, Q, ATT_SPLITS), (128,), ATTENTION_FMT,
                    [*outs, pos_buf, cap, *dims, *split, INT_MAX])}
                for form, kernel in forms.items():
                    launches[f"group {form}"] = kernel.prepare(
                        grid, block, ATTENTION_GROUP_FMT,
                        [*outs, pos_buf, cap, R, 0, *dims, *group_split, 0])
                best = {}
                n = 50 if pos > 10000 else 200
                for _ in range(args.repeats):
                    for name, launch in launches.items():
                        launch.launch(rt.stream_handle)
                        rt.synchronize()
                        start, stop = rt.drv.Event(), rt.drv.Event()
                        start.record(rt.stream)
                        for _ in range(n):
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
