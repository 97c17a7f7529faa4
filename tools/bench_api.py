"""Benchmark a running `strata serve` through each of its generating APIs, as a client sees them:
streamed requests to /v1/chat/completions, /v1/messages and /v1/responses (and /v1/completions),
one at a time, timing the first streamed text (TTFT) and the decode rate after it, medians of
-r runs. The same prompt and token count go to each, so the figures compare the APIs' own
costs per token (parsing, events, JSON) on top of the engine's.

Usage: python tools/bench_api.py [--url http://127.0.0.1:8080] [-n 128] [-r 3] [-c 1]
           [--apis chat,messages,responses,completions] [--api-key KEY] [--json]
`-c N` sends N requests at once (as N agents would; start the server with --parallel N): the
decode figure is then their aggregate, all their tokens after the first of each over the span
from the earliest first text to the latest last one.
The decode rate is (streamed tokens - 1) / (time of the last text - time of the first), with
the tokens from the answer's usage; every request asks for -n tokens exactly (`ignore_eos`).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
import sys
import time

import requests

PROMPT = "Write a long story about a lighthouse keeper and the sea, in many short chapters."


def _events(response):
    """(name or None, data dict) of each SSE event; `data: [DONE]` ends it."""
    name = None
    for line in response.iter_lines(decode_unicode=True):
        if not line or line.startswith(":"):
            continue
        if line.startswith("event: "):
            name = line[len("event: "):]
        elif line.startswith("data: "):
            if line == "data: [DONE]":
                return
            yield name, json.loads(line[len("data: "):])
            name = None


def _request(api: str, model: str, num_tokens: int) -> tuple[str, dict]:
    """The path and body; each asks for `num_tokens` tokens exactly (`ignore_eos`, an
    extension every API of the server takes)."""
    if api == "chat":
        return "/v1/chat/completions", {
            "model": model, "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": num_tokens, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    if api == "completions":
        return "/v1/completions", {
            "model": model, "prompt": PROMPT, "max_tokens": num_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    if api == "messages":
        return "/v1/messages", {
            "model": model, "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": num_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    if api == "responses":
        return "/v1/responses", {
            "model": model, "input": PROMPT, "max_output_tokens": num_tokens,
            "temperature": 0, "stream": True, "ignore_eos": True}
    raise ValueError(f"unknown API {api!r}")


def _text_and_tokens(api: str, name: str | None, data: dict) -> tuple[bool, int | None]:
    """(this event carries streamed text, the output token count if it carries the usage)."""
    if api in ("chat", "completions"):
        usage = data.get("usage")
        choices = data.get("choices") or []
        has_text = bool(choices) and bool(
            choices[0].get("text") or (choices[0].get("delta") or {}).get("content")
            or (choices[0].get("delta") or {}).get("reasoning_content"))
        return has_text, usage["completion_tokens"] if usage else None
    if api == "messages":
        if name == "message_delta":
            return False, data["usage"]["output_tokens"]
        return name == "content_block_delta", None
    if name in ("response.completed", "response.incomplete"):
        return False, data["response"]["usage"]["output_tokens"]
    return name is not None and name.endswith(".delta"), None


def run_once(url: str, api: str, model: str, num_tokens: int, headers: dict) -> dict:
    path, body = _request(api, model, num_tokens)
    t0 = time.perf_counter()
    first = last = None
    tokens = None
    with requests.post(url + path, json=body, headers=headers, stream=True,
                       timeout=600) as response:
        if response.status_code != 200:
            raise SystemExit(f"{api}: HTTP {response.status_code}: {response.text[:300]}")
        for name, data in _events(response):
            has_text, count = _text_and_tokens(api, name, data)
            if has_text:
                last = time.perf_counter()
                first = first or last
            if count is not None:
                tokens = count
    if first is None or tokens is None:
        raise SystemExit(f"{api}: the stream held no text or no usage")
    rate = (tokens - 1) / (last - first) if tokens > 1 and last > first else 0.0
    return {"ttft_s": first - t0, "tokens": tokens, "decode": rate, "first": first,
            "last": last}


def run_together(url: str, api: str, model: str, num_tokens: int, headers: dict,
                 num_requests: int) -> dict:
    """`num_requests` requests at once: their aggregate decode rate, median TTFT and tokens."""
    if num_requests == 1:
        return run_once(url, api, model, num_tokens, headers)
    with concurrent.futures.ThreadPoolExecutor(num_requests) as pool:
        runs = list(pool.map(lambda _: run_once(url, api, model, num_tokens, headers),
                             range(num_requests)))
    span = max(r["last"] for r in runs) - min(r["first"] for r in runs)
    return {"ttft_s": statistics.median(r["ttft_s"] for r in runs),
            "tokens": sum(r["tokens"] for r in runs),
            "decode": sum(r["tokens"] - 1 for r in runs) / span if span > 0 else 0.0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("-n", "--tokens", type=int, default=128)
    ap.add_argument("-r", "--repeats", type=int, default=3)
    ap.add_argument("--apis", default="chat,messages,responses")
    ap.add_argument("-c", "--concurrent", type=int, default=1)
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = ap.parse_args(argv)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    models = requests.get(args.url + "/v1/models", headers=headers, timeout=30).json()
    model = models["data"][0]["id"]
    rows = []
    for api in args.apis.split(","):
        run_together(args.url, api, model, args.tokens, headers, args.concurrent)  # warm-up
        runs = [run_together(args.url, api, model, args.tokens, headers, args.concurrent)
                for _ in range(args.repeats)]
        rows.append({"api": api, "decode": statistics.median(r["decode"] for r in runs),
                     "ttft_s": statistics.median(r["ttft_s"] for r in runs),
                     "tokens": [r["tokens"] for r in runs],
                     "decode_runs": [r["decode"] for r in runs]})
    if args.json:
        print(json.dumps(rows))
        return 0
    together = f", {args.concurrent} requests at once" if args.concurrent > 1 else ""
    print(f"| API | decode tokens/s (median of {args.repeats}{together}) | TTFT s | tokens | "
          "runs |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        short = "" if min(r["tokens"]) >= args.tokens * args.concurrent else " (stopped early)"
        print(f"| {r['api']} | {r['decode']:,.1f} | {r['ttft_s']:.3f} | "
              f"{', '.join(map(str, r['tokens']))}{short} | "
              f"{', '.join(f'{x:,.1f}' for x in r['decode_runs'])} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
