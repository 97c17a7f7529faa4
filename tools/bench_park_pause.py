"""Benchmark what a park costs the other slots: slot 0 decodes a long answer while agents with
growing conversations take turns in slot 1, so every turn parks one agent's KV and restores
another's (docs/conversations.md). Per turn: slot 0's longest pause while the agent's request
runs (its placement, which parks and restores, counts into the first window's: slot 0 waits for
both; the agent's prompt chunks are windows too), the switch itself (the placement and the
window after it), the placement's time, the agent's first token, and the pinned blocks the
park made on the engine thread, had the copy thread pin before its copies (`sync` waits for
them) or found made ahead.

Usage: python tools/bench_park_pause.py MODEL.gguf [--device cuda] [--start 12000]
           [--grow 2000] [--turns 8] [--agents 2] [--rounds 2] [--modes ahead,sync]
           [--files DIR --cache-mib MIB] [--kv int8] [--json FILE]
Rounds alternate the modes in one process, each from an empty pool (`engine.reset()`, the
pool trimmed to nothing): `ahead` is the default (spare blocks made on the pool's helper
thread, host_pool.MAKE_AHEAD; the park's and restore's copies queued on the copy stream while
the other slots run, kv_copies.ASYNC); `sync` waits for those copies on the engine thread
(the behaviour before kv_copies.py); `engine` also makes blocks only when a park finds none
(before host_pool's helper). On the CPU backend there is no pinned pool or copy stream: the
pauses are still measured. `--files DIR --cache-mib MIB --agents 3`, MIB a little over one
agent's conversation: each park evicts the one parked before it to its file, and each agent
comes back from its file (read ahead on a thread while slot 0 decodes, then restored).
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import statistics
import time

import numpy as np

from strata.backends.cuda import host_pool, kv_copies
from strata.config import EngineConfig
from strata.engine.engine import Engine
from strata.engine.sampling import SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)
log = logging.getLogger("bench_park_pause")  # marks each turn in the engine's log


def pinned_pool(engine):
    runtime = getattr(engine.model, "runtime", None)
    return getattr(runtime, "kv_host_pool", None)


def empty_the_pool(engine, make_ahead: bool, copies_async: bool) -> None:
    engine.reset()
    gc.collect()
    host_pool.MAKE_AHEAD = make_ahead
    kv_copies.ASYNC = copies_async
    pool = pinned_pool(engine)
    if pool is not None:
        pool.settle()
        pool.trim(0)
        pool.make_ahead = make_ahead


def made_counts(engine) -> tuple[int, int, int]:
    """Pinned blocks made so far: on the engine thread, by the copy thread, ahead."""
    pool = pinned_pool(engine)
    if pool is None:
        return 0, 0, 0
    pool.settle()
    runtime = engine.model.runtime
    if getattr(runtime, "kv_copier", None) is not None:
        runtime.kv_copier.settle()
    later, ahead = pool.num_made_later, pool.num_made_ahead
    return pool.num_made - later - ahead, later, ahead


def files_read(engine) -> int:
    disk = engine.scheduler.conversations.disk
    return 0 if disk is None else disk.num_read


def run_round(engine, args, seed: int) -> list[dict]:
    """One round: slot 0's long answer, the agents' turns beside it; a row per turn after
    the first agent's first (every one of them parks)."""
    rng = np.random.default_rng(seed)
    vocab = min(engine.tokenizer.vocab_size, engine.spec.vocab)

    def fresh(n):
        return [int(t) for t in rng.integers(10, vocab, n)]

    decoding = engine.submit(fresh(16), SamplingParams(max_tokens=engine.n_ctx - 32, **GREEDY))
    engine.step()
    engine.step()
    decoding.pop_events()
    prompts = [fresh(args.start) for _ in range(args.agents)]
    rows = []
    for turn in range(args.turns):
        for agent in range(args.agents):
            made_before, read_before = made_counts(engine), files_read(engine)
            log.info("turn %d, agent %d: %d tokens submitted", turn, agent, len(prompts[agent]))
            t_start = time.perf_counter()
            # submit places the request at once: the park of slot 1's conversation and the
            # restore of this agent's run here, on the engine thread between two windows (the
            # server's worker submits there too), so slot 0 waits for them and the first window
            handle = engine.submit(prompts[agent],
                                   SamplingParams(max_tokens=args.tokens, **GREEDY))
            place_s = time.perf_counter() - t_start
            log.info("turn %d, agent %d: submit returned after %.3f s", turn, agent, place_s)
            windows, first_token_s, answer = [], None, []
            while not handle.is_finished:
                t0 = time.perf_counter()
                engine.step()
                windows.append(time.perf_counter() - t0)
                events = handle.pop_events()
                if events and first_token_s is None:
                    first_token_s = time.perf_counter() - t_start
                answer += [e.token_id for e in events]
            if handle.error is not None:
                raise SystemExit(f"agent {agent}, turn {turn}: {handle.error}")
            made_after = made_counts(engine)
            prompts[agent] = prompts[agent] + answer + fresh(args.grow)
            if turn == 0 and agent == 0:
                continue  # nothing parked yet
            pauses = [place_s + windows[0]] + windows[1:]
            rows.append({"turn": turn, "agent": agent, "longest_pause_s": max(pauses),
                         "place_s": place_s, "first_window_s": windows[0],
                         "first_token_s": first_token_s,
                         "windows": len(windows),
                         "made_on_engine": made_after[0] - made_before[0],
                         "made_by_copies": made_after[1] - made_before[1],
                         "made_ahead": made_after[2] - made_before[2],
                         "from_file": files_read(engine) - read_before})
    decoding.cancel()
    engine.scheduler.drop_cancelled()
    while engine.step():
        pass
    return rows


def summary(mode: str, rows: list[dict]) -> dict:
    later = [r for r in rows if r["turn"] >= 1]  # the agents' conversations have grown
    return {"mode": mode, "switches": len(later),
            "longest_pause_median_s": statistics.median(r["longest_pause_s"] for r in later),
            "longest_pause_max_s": max(r["longest_pause_s"] for r in later),
            "place_median_s": statistics.median(r["place_s"] for r in later),
            # what the switch itself costs slot 0: the placement and the window right after it
            "switch_median_s": statistics.median(r["place_s"] + r["first_window_s"]
                                                 for r in later),
            "switch_max_s": max(r["place_s"] + r["first_window_s"] for r in later),
            "first_window_median_s": statistics.median(r["first_window_s"] for r in later),
            "first_token_median_s": statistics.median(r["first_token_s"] for r in later),
            "made_on_engine": sum(r["made_on_engine"] for r in rows),
            "made_by_copies": sum(r["made_by_copies"] for r in rows),
            "made_ahead": sum(r["made_ahead"] for r in rows),
            "from_files": sum(r["from_file"] for r in later)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="GGUF file")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--start", type=int, default=12000, help="an agent's first prompt, tokens")
    ap.add_argument("--grow", type=int, default=2000, help="tokens an agent adds a turn")
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--agents", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2, help="rounds of each mode")
    ap.add_argument("-n", "--tokens", type=int, default=4, help="an agent's answer, tokens")
    ap.add_argument("--modes", default="ahead,sync")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--kv", default="auto", help="the KV cells' type (--kv: auto, f16, int8)")
    ap.add_argument("--files", default=None,
                    help="conversation files in this folder (--conversation-cache-dir)")
    ap.add_argument("--cache-mib", type=float, default=None,
                    help="--conversation-cache-mib: with --files and 3 agents, the size of "
                         "one conversation makes every restore come from a file")
    ap.add_argument("--json", default=None, help="write every turn's row here")
    args = ap.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",")]
    if not set(modes) <= {"ahead", "sync", "engine"}:
        ap.error(f"--modes takes ahead, sync and/or engine, not {args.modes!r}")
    n_ctx = args.start + args.turns * (args.grow + args.tokens) + 64
    files = {} if args.files is None else {"conversation_cache_dir": args.files}
    if args.cache_mib is not None:
        files["conversation_cache_mib"] = args.cache_mib
    config = EngineConfig(args.model, device=args.device, n_ctx=n_ctx, parallel=2,
                          threads=args.threads, kv_type=args.kv, **files)
    results = []
    with Engine(config) as engine:
        for r in range(args.rounds):
            for mode in modes:
                empty_the_pool(engine, mode != "engine", mode == "ahead")
                rows = run_round(engine, args, seed=r)
                results.append({"round": r, **summary(mode, rows), "rows": rows})
    print("| round | mode | switches | slot 0's longest pause, median / max (s) | "
          "the switch (placement + next window), median / max (s) | placement, median (s) | "
          "agent's first token, median (s) | blocks made on the engine thread / by the copy "
          "thread / ahead | restored from files |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for s in results:
        print(f"| {s['round']} | {s['mode']} | {s['switches']} | "
              f"{s['longest_pause_median_s']:.3f} / {s['longest_pause_max_s']:.3f} | "
              f"{s['switch_median_s']:.3f} / {s['switch_max_s']:.3f} | "
              f"{s['place_median_s']:.3f} | {s['first_token_median_s']:.3f} | "
              f"{s['made_on_engine']} / {s['made_by_copies']} / {s['made_ahead']} | "
              f"{s['from_files']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
