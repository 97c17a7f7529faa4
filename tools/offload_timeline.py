"""Where a decode token goes with the experts in RAM and a CPU pool (CUDA backend), window by
window, from the host's clock and the pool's own (both CLOCK_MONOTONIC):

  before   host work from the forward call to the pool's post (tier, plan, descriptor, seq)
  lag      from the post until the pool saw the window
  pool     the pool's window, first ready[0] wait to the last done[l]: compute + wait
           (compute and wait are its own counters; wait is the GPU's serial part per window)
  after    from the pool's last done to the forward's return, in two parts:
    tail   to the window's synchronize (the last combine, the head, the read-back, the wake-up)
    host   from there to the return (the pool's stats, the tier's accounting)
  between  from one forward's return to the next call (the loop's own Python)

Usage, on the GPU machine:
  python tools/offload_timeline.py MODEL.gguf [--tokens 64] [--rounds 3] [--threads 15]
      [--pcie-frac F] [--expert-cache 0] [--greedy]
Prints medians per round (ms per token) and tokens/s; --greedy reads only the argmax back
(forward_window(..., greedy=True), as the engine's greedy decode does) instead of the logits.
--profile N then runs N one-row windows launch by launch with CUDA events between the launches
(CudaModel.profile_window; the pool serves them) and prints each kernel's median device time
per window (each launch's time includes the gap before it, so small kernels read high).
"""
import argparse
import statistics
import time
from pathlib import Path

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--pcie-frac", type=float, default=None)
    ap.add_argument("--expert-cache", default="0")
    ap.add_argument("--greedy", action="store_true")
    ap.add_argument("--profile", type=int, default=0, metavar="N")
    args = ap.parse_args(argv)

    from strata._native import kernels
    from strata.backends.select import build_model
    from strata.backends.window import Window
    from strata.cli import _bench_tier
    from strata.config import EngineConfig
    from strata.model.gguf_file import GGUFModel

    path = Path(args.model)
    config = EngineConfig(path, threads=args.threads, device="cuda", parallel=1,
                          expert_cache=args.expert_cache, pcie_frac=args.pcie_frac)
    rng = np.random.default_rng(0)
    with GGUFModel.open(path) as gguf:
        model = build_model(gguf, "cuda", args.threads, needs_cpu_experts=True, config=config)
        tier = _bench_tier(config, gguf, model)
        pool = getattr(tier.arena, "pool", None)
        if pool is None:
            raise SystemExit("no CPU pool: give --pcie-frac below 1 and an --expert-cache "
                             "that leaves experts in RAM")
        ctl = pool._ctl
        device_tier = model.tier
        marks = {}
        finish = device_tier.finish

        def timed_finish(*a, **kw):  # called right after the window's synchronize
            marks["synced"] = time.monotonic_ns()
            return finish(*a, **kw)

        device_tier.finish = timed_finish
        try:
            for rnd in range(args.rounds + 1):  # round 0 warms up
                kv = model.new_kv(args.tokens)
                toks = rng.integers(0, model.spec.vocab, args.tokens, dtype=np.int32)
                rows = []
                last_exit = None
                for i in range(args.tokens):
                    enter = time.monotonic_ns()
                    window = Window.build([(kv, toks[i:i + 1])], logits="last")
                    tier.forward_window(window, greedy=args.greedy)
                    leave = time.monotonic_ns()
                    st = pool.last_stats
                    posted = int(ctl[kernels.POOL_CTL_POSTED_NS])
                    start = int(ctl[kernels.POOL_CTL_START_NS])
                    end = int(ctl[kernels.POOL_CTL_END_NS])
                    rows.append(dict(
                        total=(leave - enter) / 1e6,
                        before=(posted - enter) / 1e6, lag=(start - posted) / 1e6,
                        pool=(end - start) / 1e6, compute=st.pool_ms, wait=st.wait_ms,
                        after=(leave - end) / 1e6, tail=(marks["synced"] - end) / 1e6,
                        host=(leave - marks["synced"]) / 1e6,
                        between=(enter - last_exit) / 1e6 if last_exit else 0.0))
                    last_exit = leave
                if rnd == 0:
                    continue
                keys = list(rows[0])
                med = {k: statistics.median(r[k] for r in rows[1:]) for k in keys}
                per_token = statistics.median(r["total"] + r["between"] for r in rows[1:])
                print(f"round {rnd}: {1e3 / per_token:.1f} tokens/s; ms per token (medians): "
                      + ", ".join(f"{k} {med[k]:.3f}" for k in keys), flush=True)
            if args.profile:
                _profile(model, tier, args.profile, rng)
        finally:
            tier.close()
    return 0


def _profile(model, tier, num_windows: int, rng) -> None:
    """Per kernel name: median device us per one-row window over `num_windows` windows."""
    from strata.backends.window import Window

    kv = model.new_kv(num_windows + 1)
    toks = rng.integers(0, model.spec.vocab, num_windows + 1, dtype=np.int32)
    tier.forward_window(Window.build([(kv, toks[:1])], logits="last"))  # sets the where table
    runs = []
    for i in range(1, num_windows + 1):
        runs.append(model.profile_window(Window.build([(kv, toks[i:i + 1])], logits="last")))
    names = sorted(runs[0], key=lambda n: -statistics.median(r.get(n, 0.0) for r in runs))
    total = statistics.median(sum(r.values()) for r in runs)
    print(f"profile: {num_windows} windows, median {total:.3f} ms of launches a window")
    for name in names:
        us = statistics.median(r.get(name, 0.0) for r in runs) * 1e3
        print(f"  {name:40s} {us:9.1f} us")


if __name__ == "__main__":
    raise SystemExit(main())
