"""Benchmark code completion through a running `strata serve`'s `/infill` as an editor drives
it: a source file around the cursor, other files as context (llama.vscode's ring of chunks),
one completion cold, then one per keystroke at the cursor, each timed from request to answer.

Usage: python tools/bench_infill.py [--url http://127.0.0.1:8080] [--prefix-lines 256]
           [--suffix-lines 16] [--extra-chunks 8] [--chunk-lines 64] [-n 32] [-r 10] [--json]
The defaults are llama.vscode's (256 lines before the cursor, 16 after, chunks of 64 lines);
the server needs a context that holds them (~16K tokens with 8 chunks: --ctx-size 32768).
Each completion generates -n tokens exactly (`ignore_eos`). Per completion: the wall time,
the prompt tokens, those read (`timings.prompt_n`: what the cache did not hold), the prompt
rate (read tokens / `prompt_ms`) and the decode rate (`predicted_per_second`). Rows: "cold"
(the first completion: every file read) and "keystroke" (medians of -r completions, each after
one more character typed at the cursor: the prefix's end changed, so the suffix is read again).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import requests


def source_lines(num_lines: int, seed: int) -> list[str]:
    """Python-like lines, a function every 16 lines (deterministic for `seed`)."""
    out = []
    for i in range(num_lines):
        k = i + seed * 7919
        if i % 16 == 0:
            out.append(f"def block_{k}(values, scale={k % 9 + 1}):")
        else:
            out.append(f"    total_{k} = helper_{k % 13}(values[{k % 31}], total_{k - 1}) * "
                       f"scale + {k * 7 % 101}  # step {k}")
    return [line + "\n" for line in out]


def completion_body(args, typed: str) -> dict:
    before = source_lines(args.prefix_lines, seed=0)
    after = source_lines(args.suffix_lines, seed=1)
    chunks = [{"filename": f"module_{c}.py",
               "text": "".join(source_lines(args.chunk_lines, seed=c + 2))}
              for c in range(args.extra_chunks)]
    return {"input_prefix": "".join(before) + "    result = " + typed,
            "input_suffix": "".join(after), "input_extra": chunks, "filename": "main.py",
            "n_predict": args.tokens, "temperature": 0, "ignore_eos": True}


def complete(url: str, body: dict, headers: dict) -> dict:
    t0 = time.perf_counter()
    response = requests.post(url + "/infill", json=body, headers=headers, timeout=600)
    wall_s = time.perf_counter() - t0
    if response.status_code != 200:
        raise SystemExit(f"/infill: HTTP {response.status_code}: {response.text[:300]}")
    reply = response.json()
    timings = reply["timings"]
    return {"wall_s": wall_s, "prompt_tokens": reply["tokens_evaluated"],
            "read_tokens": timings["prompt_n"], "truncated": reply["truncated"],
            "prompt_rate": timings["prompt_n"] / max(timings["prompt_ms"] / 1000.0, 1e-9),
            "decode": timings["predicted_per_second"],
            "tokens": reply["tokens_predicted"]}


def _row(name: str, runs: list[dict]) -> dict:
    row = {"row": name, "runs": len(runs)}
    for key in ("wall_s", "prompt_tokens", "read_tokens", "prompt_rate", "decode", "tokens"):
        row[key] = statistics.median(r[key] for r in runs)
    row["wall_runs"] = [r["wall_s"] for r in runs]
    row["truncated"] = any(r["truncated"] for r in runs)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--prefix-lines", type=int, default=256)
    ap.add_argument("--suffix-lines", type=int, default=16)
    ap.add_argument("--extra-chunks", type=int, default=8)
    ap.add_argument("--chunk-lines", type=int, default=64)
    ap.add_argument("-n", "--tokens", type=int, default=32)
    ap.add_argument("-r", "--repeats", type=int, default=10)
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = ap.parse_args(argv)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    typed = "c"
    cold = complete(args.url, completion_body(args, typed), headers)
    keystrokes = []
    for i in range(args.repeats):
        typed += "abcdefghij"[i % 10]
        keystrokes.append(complete(args.url, completion_body(args, typed), headers))
    rows = [_row("cold", [cold]), _row("keystroke", keystrokes)]
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"| completion (-n {args.tokens}) | wall s | prompt tokens | read | prompt tokens/s | "
          "decode tokens/s | wall s, each run |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        cut = " (truncated)" if r["truncated"] else ""
        print(f"| {r['row']} | {r['wall_s']:.3f} | {r['prompt_tokens']:,.0f}{cut} | "
              f"{r['read_tokens']:,.0f} | {r['prompt_rate']:,.0f} | {r['decode']:,.1f} | "
              f"{', '.join(f'{x:.3f}' for x in r['wall_runs'])} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
