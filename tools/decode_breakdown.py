"""Where a decode step's time goes on the CUDA backend: the whole step as `strata bench` times it
(host preparation, graph launch, argmax read back), the captured graph replayed back to back
(device time per window), and with --ncu-csv the kernels' own durations from Nsight Compute,
summed per kernel name. step - graph is host time; graph - kernels is the gaps between kernels.

Usage, on the GPU machine:
  python tools/decode_breakdown.py MODEL.gguf [--rows 1] [--context 128] [--profile]
  ncu --profile-from-start off --metrics gpu__time_duration.sum --csv \\
      python tools/decode_breakdown.py MODEL.gguf --ncu > ncu.csv
  python tools/decode_breakdown.py MODEL.gguf --ncu-csv ncu.csv   (no GPU needed for this part)
--ncu runs one decode window launch by one between cuProfilerStart and cuProfilerStop.
--profile (no ncu needed) runs one window launch by launch with CUDA events between the launches
and prints the device time per kernel name (each launch's time includes the gap before it, so
small kernels read high; the deep-context attention kernels are long enough to read true).
--time-kernel PREFIX times the window's launches of kernels named PREFIX... alone, back to back
over the layers (the model's own arguments and buffers), microseconds per launch.
The context is read in prompt windows of --chunk tokens (a 64K context in 16 windows of 4096).
"""
import argparse
import csv
import ctypes
import io
import statistics
import time

import numpy as np


def _kernel_table(path: str) -> None:
    """Per kernel name: launches and summed gpu__time_duration from ncu's --csv output."""
    with open(path) as f:
        text = f.read()
    start = text.find('"ID"')
    if start < 0:
        raise SystemExit(f"{path}: no ncu CSV table in it")
    sums: dict[str, list[float]] = {}
    for row in csv.DictReader(io.StringIO(text[start:])):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        value = float(row["Metric Value"].replace(",", ""))
        scale = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3,
                 "ms": 1e3}[row["Metric Unit"]]
        name = row["Kernel Name"].split("(")[0]
        sums.setdefault(name, []).append(value * scale)
    total = sum(sum(v) for v in sums.values())
    count = sum(len(v) for v in sums.values())
    print(f"kernels: {count} launches, {total / 1000:.3f} ms of kernel time per window")
    print("| kernel | launches | us total | us each (median) | share |")
    print("| --- | --- | --- | --- | --- |")
    for name, us in sorted(sums.items(), key=lambda kv: -sum(kv[1])):
        print(f"| {name} | {len(us)} | {sum(us):.1f} | {statistics.median(us):.2f} | "
              f"{100 * sum(us) / total:.1f}% |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--rows", type=int, default=1, help="decode rows (slots) per window")
    ap.add_argument("--context", type=int, default=128, help="cells in each KV before the step")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=4096, help="tokens per window reading the context")
    ap.add_argument("--profile", action="store_true",
                    help="also time one window launch by launch, per kernel name")
    ap.add_argument("--time-kernel", default=None, metavar="PREFIX",
                    help="also time the window's launches of kernels named PREFIX... alone")
    ap.add_argument("--ncu", action="store_true", help="profile one window for ncu and stop")
    ap.add_argument("--ncu-csv", default=None, help="summarise this ncu --csv output")
    args = ap.parse_args()
    if args.ncu_csv:
        _kernel_table(args.ncu_csv)
        return

    from strata.backends.cuda import CudaModel
    from strata.backends.cuda.plan import DEEP_ALL, DEEP_SOME
    from strata.backends.window import Window
    from strata.model.gguf_file import GGUFModel

    model = CudaModel(GGUFModel.open(args.model))
    rng = np.random.default_rng(0)
    V = model.spec.vocab
    kvs = [model.new_kv(args.context + 2 * args.steps + 8, dtype=np.float16)
           for _ in range(args.rows)]
    for kv in kvs:
        context = rng.integers(0, V, args.context).astype(np.int32)
        for start in range(0, args.context, args.chunk):
            model.forward_window_greedy(Window.build([(kv, context[start:start + args.chunk])]))

    def window(tokens):
        return Window.build([(kv, tokens[i:i + 1]) for i, kv in enumerate(kvs)])

    tok = rng.integers(0, V, args.rows).astype(np.int32)
    for _ in range(4):  # plans, graph capture
        tok = model.forward_window_greedy(window(tok))
    if args.ncu:
        cuda = ctypes.CDLL("libcuda.so.1")
        cuda.cuProfilerStart()
        model.profile_window(window(tok))
        cuda.cuProfilerStop()
        return
    step = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        tok = model.forward_window_greedy(window(tok))
        step.append(time.perf_counter() - t0)
    # the graph of this window shape replayed back to back: device time per window
    rt = model.runtime
    start, stop = rt.drv.Event(), rt.drv.Event()

    def replay_ms(plan) -> float:
        plan.run(rt.stream_handle, True)
        start.record(rt.stream)
        for _ in range(args.steps):
            plan.run(rt.stream_handle, True)
        stop.record(rt.stream)
        stop.synchronize()
        return start.time_till(stop) / args.steps

    with rt.active():
        plan = model._prepare(window(tok))  # descriptor of a window at the current positions
        graph_ms = replay_ms(plan)
        # a window of rows all deep: also the plan that keeps attention_d*'s launches
        some = (model._plan(args.rows, args.rows, DEEP_SOME)
                if model.deep_level(window(tok)) == DEEP_ALL else None)
        some_ms = replay_ms(some) if some is not None else None
    step_ms = 1000 * statistics.median(step)
    print(f"{args.rows} rows at context {args.context}: step {step_ms:.3f} ms "
          f"({args.rows / step_ms * 1000:.1f} tokens/s), graph replay {graph_ms:.3f} ms per "
          f"window, host {step_ms - graph_ms:.3f} ms; {len(plan.launches.names())} launches")
    if some is not None:
        print(f"  with attention_d*'s launches too (DEEP_SOME's plan): graph replay "
              f"{some_ms:.3f} ms, {len(some.launches.names())} launches")
    if args.time_kernel:
        names = plan.launches.names()
        picked = [i for i, name in enumerate(names) if name.startswith(args.time_kernel)]
        if not picked:
            raise SystemExit(f"no launch of a kernel named {args.time_kernel}... in the window")
        with rt.active():
            for _ in range(2):
                for i in picked:
                    plan.launches.launch_one(i, rt.stream_handle)
            start.record(rt.stream)
            for _ in range(4):
                for i in picked:
                    plan.launches.launch_one(i, rt.stream_handle)
            stop.record(rt.stream)
            stop.synchronize()
            us = start.time_till(stop) * 1e3 / (4 * len(picked))
        print(f"{names[picked[0]]} alone: {us:.1f} us per launch ({len(picked)} launches, "
              "back to back over the layers)")
    if args.profile:
        times = model.profile_window(window(tok))
        total = sum(times.values())
        print(f"launch by launch: {total:.3f} ms of device time")
        print("| kernel | ms | share |")
        print("| --- | --- | --- |")
        for name, ms in sorted(times.items(), key=lambda kv: -kv[1]):
            print(f"| {name} | {ms:.3f} | {100 * ms / total:.1f}% |")


if __name__ == "__main__":
    main()
