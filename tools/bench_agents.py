"""Benchmark agents taking turns on a running `strata serve`: each agent has its own long
conversation and asks in turn, as coding agents sharing a server do; each request is timed from
request to answer, with the prompt tokens the server reused (`cached_tokens`).

Usage: python tools/bench_agents.py [--url http://127.0.0.1:8080] [--agents 2] [--lines 2000]
           [--system-lines 0] [--turns 3] [-n 4] [--api-key KEY] [--json]
An agent's first prompt is --lines short sentences of its own (2000: 24,890 tokens of the
synth tokenizer, 2.28 GiB of Qwen3-30B-A3B's fp16 KV), after --system-lines sentences that
every agent's prompt starts with (a shared system prompt and tools, as coding agents have); each
later turn adds a line. With fewer
slots than agents (`--parallel 1`) every turn after the first parks the other agent's KV and
restores this one's (docs/conversations.md); with `--conversation-cache-dir`, stop and start
the server between two runs and the first run's "switch" is the second run's "cold". Rows:
"cold" (each agent's first turn) and "switch" (the later turns), medians over the agents'
requests, and the time of each request.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import requests


def agent_prompt(agent: int, lines: int, turn: int, system_lines: int = 0) -> str:
    tag = "abcdefghijklmnopqrstuvwxyz"[agent % 26] * (1 + agent // 26)
    shared = "".join(f"sys{i} runs the tests first. " for i in range(system_lines))
    return shared + " ".join(f"{tag}{i} keeps the build green." for i in range(lines)) + \
        " and one more line." * turn


def ask(url: str, prompt: str, tokens: int, headers: dict) -> dict:
    t0 = time.perf_counter()
    response = requests.post(url + "/v1/completions", headers=headers, timeout=600, json={
        "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True})
    wall_s = time.perf_counter() - t0
    if response.status_code != 200:
        raise SystemExit(f"/v1/completions: HTTP {response.status_code}: "
                         f"{response.text[:300]}")
    usage = response.json()["usage"]
    return {"wall_s": wall_s, "prompt_tokens": usage["prompt_tokens"],
            "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]}


def _row(name: str, runs: list[dict]) -> dict:
    row = {"row": name, "runs": len(runs)}
    for key in ("wall_s", "prompt_tokens", "cached_tokens"):
        row[key] = statistics.median(r[key] for r in runs) if runs else 0
    row["wall_runs"] = [r["wall_s"] for r in runs]
    row["cached_runs"] = [r["cached_tokens"] for r in runs]
    row["total_s"] = sum(row["wall_runs"])
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--agents", type=int, default=2)
    ap.add_argument("--lines", type=int, default=2000)
    ap.add_argument("--system-lines", type=int, default=0,
                    help="sentences every agent's prompt starts with (a shared system prompt)")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("-n", "--tokens", type=int, default=4)
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = ap.parse_args(argv)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    turns = [[ask(args.url, agent_prompt(a, args.lines, t, args.system_lines), args.tokens,
                  headers)
              for a in range(args.agents)] for t in range(args.turns)]
    rows = [_row("cold", turns[0]), _row("switch", [r for turn in turns[1:] for r in turn])]
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"| {args.agents} agents, {args.turns} turns (-n {args.tokens}) | wall s (median) | "
          "wall s (sum) | prompt tokens | reused | wall s, each request |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['row']} | {r['wall_s']:.3f} | {r['total_s']:.3f} | "
              f"{r['prompt_tokens']:,.0f} | {r['cached_tokens']:,.0f} | "
              f"{', '.join(f'{x:.3f}' for x in r['wall_runs'])} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
