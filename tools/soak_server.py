"""Soak a running `strata serve`: many short requests of every kind (the generating APIs whole
and streamed, tool calls, json_schema and grammar constraints, logprobs, n / best_of, stops,
clients that hang up mid-answer, bad requests, long multi-turn conversations with many distinct
conversations so that parking and the conversation files churn), and every --every requests a
row of what the server holds: RSS, open descriptors, threads (with --pid, from /proc), the
conversation files (with --conversation-dir) and /metrics' parked conversations and files
against their budgets. A resource that grows row after row once the work is steady is a leak.

Usage: python tools/soak_server.py [--url http://127.0.0.1:8080] [-n 2000] [--every 200]
           [--pid PID] [--conversation-dir DIR] [--conversations 40] [--turns 12]
           [-c 2] [--kinds chat,stream,...] [--seed 0] [--api-key KEY] [--json]
At the end: requests by (endpoint, status) as this client saw them beside /metrics'
`strata_requests_total` (a hang-up counts as 499, the server's "client closed request"), and
the answers whose status was not the one expected. Exit status 1 when any was not.
Start the server with small budgets so that the tiers churn, e.g.
  strata serve --port 8080 -np 2 -t 1 --cache-ram 1 --conversation-cache-dir /tmp/conv \\
      --conversation-cache-disk-mib 4
"""
from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import os
import random
import socket
import sys
import threading
import time
from urllib.parse import urlsplit

import requests

CLIENT_CLOSED = 499  # the status a request whose client hung up is counted under
WORDS = ("alpha beta gamma delta file parse error build test module value list index read "
         "write server client token thread cache slot fix patch line code run tool call").split()
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
ANSWER_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                                  "n": {"type": "integer"}},
                 "required": ["name", "n"], "additionalProperties": False}
GRAMMAR = 'root ::= ("yes" | "no") " " [0-9] [0-9]?'


class Client:
    """One soak's HTTP side: a session per thread, the statuses seen by endpoint."""

    def __init__(self, url: str, api_key: str | None, timeout_s: float):
        self.url, self.timeout_s = url.rstrip("/"), timeout_s
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.local = threading.local()
        self.lock = threading.Lock()
        self.seen: collections.Counter = collections.Counter()  # (endpoint, status)
        self.unexpected: list[str] = []

    @property
    def session(self) -> requests.Session:
        if not hasattr(self.local, "session"):
            self.local.session = requests.Session()
        return self.local.session

    def record(self, endpoint: str, status: int, expected, what: str, text: str = "") -> None:
        with self.lock:
            self.seen[endpoint, status] += 1
            if status not in expected:
                self.unexpected.append(f"{what}: {endpoint} answered {status}, expected "
                                       f"{sorted(expected)}: {text[:200]}")

    def post(self, path: str, body, what: str, expected=(200,), stream: bool = False,
             endpoint: str | None = None):
        """POST `body`; its status is recorded under `endpoint` (the server's name for the
        route; default `path`)."""
        data = body if isinstance(body, (bytes, str)) else json.dumps(body)
        response = self.session.post(self.url + path, data=data, stream=stream,
                                     timeout=self.timeout_s,
                                     headers=dict(self.headers,
                                                  **{"Content-Type": "application/json"}))
        if stream:
            text = "".join(line + "\n" for line in response.iter_lines(decode_unicode=True))
        else:
            text = response.text
        if stream and response.status_code == 200 and any(
                line.startswith(('data: {"error"', "event: error")) for line in text.split("\n")):
            self.unexpected.append(f"{what}: {path} streamed an error: {text[-300:]}")
        self.record(endpoint or path, response.status_code, expected, what, text)
        return response, text

    def hang_up(self, path: str, body: dict, what: str, read_bytes: int) -> None:
        """Send `body` on a raw socket, read about `read_bytes` of the answer (0: none), close.
        The answer may have ended first: then it is a 200."""
        parts = urlsplit(self.url)
        data = json.dumps(body).encode()
        auth = "".join(f"{k}: {v}\r\n" for k, v in self.headers.items())
        with socket.create_connection((parts.hostname, parts.port or 80),
                                      timeout=self.timeout_s) as sock:
            sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {parts.netloc}\r\n{auth}Content-Type: "
                         f"application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode()
                         + data)
            got = b""
            while len(got) < read_bytes:
                chunk = sock.recv(4096)
                if not chunk:
                    break
                got += chunk
            if not read_bytes:
                time.sleep(0.05)
        with self.lock:  # the server decides: 499 when it noticed before the end, else 200
            self.seen[path, "hang-up"] += 1


def sentence(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


# ---- request kinds: each takes (client, rng, model) --------------------------------------
def chat(c, rng, model):
    c.post("/v1/chat/completions", {"model": model, "max_tokens": rng.randint(1, 12),
                                    "messages": [{"role": "user", "content": sentence(rng, 8)}],
                                    "temperature": rng.choice([0, 0.7])}, "chat")


def chat_stream(c, rng, model):
    c.post("/v1/chat/completions", {"model": model, "max_tokens": 10, "stream": True,
                                    "stream_options": {"include_usage": True},
                                    "messages": [{"role": "user", "content": sentence(rng, 6)}],
                                    "stop": [rng.choice(WORDS)]}, "chat stream", stream=True)


def chat_tools(c, rng, model):
    c.post("/v1/chat/completions", {"model": model, "max_tokens": 80, "tools": [WEATHER_TOOL],
                                    "tool_choice": "required", "stream": rng.random() < 0.5,
                                    "messages": [{"role": "user", "content": "Weather in Oslo?"}]},
           "chat tools", stream=True)


def chat_json(c, rng, model):
    c.post("/v1/chat/completions", {
        "model": model, "max_tokens": 48, "logprobs": True, "top_logprobs": 3,
        "messages": [{"role": "user", "content": sentence(rng, 5)}],
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA}}},
           "chat json_schema")


def chat_n(c, rng, model):
    c.post("/v1/chat/completions", {"model": model, "max_tokens": 6, "n": 2, "seed": 1,
                                    "temperature": 0.9, "stream": rng.random() < 0.5,
                                    "messages": [{"role": "user", "content": sentence(rng, 4)}]},
           "chat n=2", stream=True)


def completions(c, rng, model):
    c.post("/v1/completions", {"model": model, "prompt": sentence(rng, 10), "max_tokens": 6,
                               "logprobs": 2, "n": 2, "best_of": 3, "temperature": 0.8,
                               "echo": rng.random() < 0.5}, "completions best_of")


def completions_stream(c, rng, model):
    c.post("/v1/completions", {"model": model, "prompt": [sentence(rng, 5), sentence(rng, 5)],
                               "max_tokens": 8, "stream": True, "stop": ["\n"]},
           "completions batch stream", stream=True)


def responses(c, rng, model):
    stream = rng.random() < 0.5
    c.post("/v1/responses", {"model": model, "input": sentence(rng, 7), "stream": stream,
                             "max_output_tokens": 8, "tools": [
                                 dict(WEATHER_TOOL["function"], type="function")]},
           "responses", stream=stream)


def messages(c, rng, model):
    stream = rng.random() < 0.5
    tool = WEATHER_TOOL["function"]
    c.post("/v1/messages", {"model": model, "max_tokens": 12, "stream": stream,
                            "system": "You are terse.", "stop_sequences": ["."],
                            "tools": [{"name": tool["name"], "description": tool["description"],
                                       "input_schema": tool["parameters"]}],
                            "messages": [{"role": "user", "content": sentence(rng, 6)}]},
           "messages", stream=stream)


def llama_completion(c, rng, model):
    stream = rng.random() < 0.5
    body = {"prompt": sentence(rng, 6), "n_predict": 8, "n_probs": 2, "stream": stream}
    if rng.random() < 0.5:
        body["grammar"] = GRAMMAR
    else:
        body["json_schema"] = ANSWER_SCHEMA
        body["n_predict"] = 48
    c.post("/completion", body, "llama completion", stream=stream)


def infill(c, rng, model):
    response, text = c.post("/infill", {"input_prefix": "def f(x):\n    ", "n_predict": 6,
                                        "input_suffix": "\n    return y\n"}, "infill",
                            expected=(200, 400))
    if response.status_code == 400 and "no FIM tokens" not in text:  # a model without them
        with c.lock:
            c.unexpected.append(f"infill: 400: {text[:200]}")


def hang_up_stream(c, rng, model):
    path, body = rng.choice([
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": sentence(rng, 5)}]}),
        ("/v1/messages", {"model": model,
                          "messages": [{"role": "user", "content": sentence(rng, 5)}]}),
        ("/v1/responses", {"input": sentence(rng, 5)}),
        ("/completion", {"prompt": sentence(rng, 5)})])
    long = {"/v1/responses": "max_output_tokens", "/completion": "n_predict"}.get(path,
                                                                                  "max_tokens")
    c.hang_up(path, dict(body, stream=True, ignore_eos=True, **{long: 400}), "hang-up stream",
              read_bytes=rng.randint(1, 600))


def hang_up_whole(c, rng, model):
    c.hang_up("/v1/chat/completions", {"messages": [{"role": "user",
                                                     "content": sentence(rng, 5)}],
                                       "max_tokens": 400, "ignore_eos": True},
              "hang-up whole", read_bytes=0)


def slot_file(c, rng, model):
    """llama.cpp's slot actions on a few file names (--slot-save-path: off is a 501): a busy
    slot is a 409, a file not saved yet a 400."""
    action = rng.choice(["save", "save", "restore", "erase"])
    body = {} if action == "erase" else {"filename": f"soak-{rng.randint(0, 3)}.bin"}
    response, text = c.post(f"/slots/{rng.randint(0, 1)}?action={action}", body,
                            f"slot {action}", expected=(200, 400, 409, 501),
                            endpoint="/slots/<id_slot>")
    if response.status_code == 400 and "no slot file" not in text and "no slot " not in text:
        with c.lock:
            c.unexpected.append(f"slot {action}: 400: {text[:200]}")


BAD_REQUESTS = [
    ("/v1/chat/completions", b"{not json", (400,)),
    ("/v1/chat/completions", {"messages": []}, (400,)),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "temperature": "hot"}, (400,)),
    ("/v1/chat/completions", {"model": "no-such-model",
                              "messages": [{"role": "user", "content": "x"}]}, (404,)),
    ("/v1/completions", {"prompt": "x", "max_tokens": -3}, (400,)),
    ("/v1/completions", {"prompt": "x", "best_of": 1, "n": 2}, (400,)),
    ("/v1/messages", {"messages": [{"role": "user", "content": "x"}]}, (400,)),
    ("/v1/responses", {"input": 7}, (400,)),
    ("/completion", {"prompt": "x", "grammar": "root ::= ("}, (400,)),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_schema",
                                                  "json_schema": {"schema": 5}}}, (400,)),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x " * 3000}]}, (400,)),
]


def bad_request(c, rng, model):
    path, body, expected = rng.choice(BAD_REQUESTS)
    c.post(path, body, "bad request", expected=expected)


class Conversations:
    """`num` conversations of up to `turns` turns each: every request continues a random one
    (its whole history resent, as agents do), a finished one starts over with new words."""

    def __init__(self, num: int, turns: int, seed: int):
        self.lock = threading.Lock()
        self.turns = turns
        self.rng = random.Random(seed)
        self.histories = [self._new(i) for i in range(num)]
        self.busy: set[int] = set()

    def _new(self, i: int) -> list:
        return [{"role": "system", "content": f"Agent {i}-{self.rng.random():.6f}. "
                 + sentence(self.rng, 30)}]

    def take(self) -> tuple[int, list]:
        with self.lock:
            free = [i for i in range(len(self.histories)) if i not in self.busy]
            i = self.rng.choice(free)
            self.busy.add(i)
            if len(self.histories[i]) > 2 * self.turns:
                self.histories[i] = self._new(i)
            return i, list(self.histories[i])

    def give_back(self, i: int, history: list) -> None:
        with self.lock:
            self.histories[i] = history
            self.busy.discard(i)


def conversation_turn(c, rng, model, conversations: Conversations):
    i, history = conversations.take()
    history.append({"role": "user", "content": sentence(rng, rng.randint(4, 20))})
    api = rng.choice(["chat", "messages"])
    try:
        if api == "chat":
            response, text = c.post("/v1/chat/completions", {
                "model": model, "messages": history, "max_tokens": 8}, "conversation")
            content = (response.json()["choices"][0]["message"].get("content") or ""
                       if response.status_code == 200 else "")
        else:
            system, turns = history[0]["content"], history[1:]
            response, text = c.post("/v1/messages", {
                "model": model, "system": system, "messages": turns, "max_tokens": 8},
                "conversation")
            content = "".join(b.get("text", "") for b in response.json()["content"]
                              ) if response.status_code == 200 else ""
        history.append({"role": "assistant", "content": content or "ok"})
    finally:
        conversations.give_back(i, history)


KINDS = {"chat": chat, "stream": chat_stream, "tools": chat_tools, "json": chat_json,
         "n": chat_n, "completions": completions, "completions_stream": completions_stream,
         "responses": responses, "messages": messages, "llama": llama_completion,
         "infill": infill, "hangup_stream": hang_up_stream, "hangup_whole": hang_up_whole,
         "slots": slot_file, "bad": bad_request, "conversation": None}
WEIGHTS = {"conversation": 8, "hangup_stream": 2, "bad": 2}  # the others: 1


# ---- what the server holds -----------------------------------------------------------------
def process_figures(pid: int | None) -> dict:
    if pid is None:
        return {}
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key == "VmRSS":
                out["rss_mib"] = int(value.split()[0]) / 1024
            elif key == "Threads":
                out["threads"] = int(value)
    out["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    return out


def folder_figures(folder: str | None) -> dict:
    if folder is None:
        return {}
    sizes = [e.stat().st_size for e in os.scandir(folder) if e.is_file()]
    return {"files": len(sizes), "files_mib": sum(sizes) / 2**20}


def scrape(client: Client) -> dict:
    """/metrics' samples by name (label values joined into the name as name{k=v,...})."""
    from prometheus_client.parser import text_string_to_metric_families

    text = client.session.get(client.url + "/metrics", headers=client.headers,
                              timeout=client.timeout_s).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def snapshot(client: Client, args, num_done: int, start_s: float) -> dict:
    m = scrape(client)
    row = {"requests": num_done, "seconds": round(time.monotonic() - start_s, 1)}
    row.update(process_figures(args.pid))
    row.update(folder_figures(args.conversation_dir))
    row["parked"] = m.get("strata_conversation_cache_entries", 0)
    row["parked_mib"] = m.get("strata_conversation_cache_bytes", 0) / 2**20
    row["parked_budget_mib"] = m.get("strata_conversation_cache_budget_bytes", 0) / 2**20
    row["m_files"] = m.get("strata_conversation_files", 0)
    row["m_files_mib"] = m.get("strata_conversation_files_bytes", 0) / 2**20
    row["files_budget_mib"] = m.get("strata_conversation_files_budget_bytes", 0) / 2**20
    row["running"] = m.get("strata_requests_running", 0)
    row["queued"] = m.get("strata_requests_queued", 0)
    row["metrics"] = m
    return row


COLUMNS = [("requests", "{:>8}"), ("seconds", "{:>8}"), ("rss_mib", "{:>8.1f}"),
           ("fds", "{:>5}"), ("threads", "{:>7}"), ("files", "{:>5}"), ("files_mib", "{:>9.2f}"),
           ("m_files", "{:>7.0f}"), ("m_files_mib", "{:>11.2f}"), ("files_budget_mib", "{:>9.1f}"),
           ("parked", "{:>6.0f}"), ("parked_mib", "{:>10.2f}"), ("parked_budget_mib", "{:>9.1f}"),
           ("running", "{:>7.0f}"), ("queued", "{:>6.0f}")]
HEADERS = {"files_budget_mib": "files_cap", "parked_budget_mib": "park_cap"}


def print_row(row: dict, is_header: bool = False) -> None:
    cells = []
    for key, fmt in COLUMNS:
        width = int(fmt[3:].split(".")[0].rstrip("fd}"))
        if is_header:
            cells.append(HEADERS.get(key, key).rjust(width))
        elif key in row:
            cells.append(fmt.format(row[key]))
        else:
            cells.append("-".rjust(width))
    print(" ".join(cells), flush=True)


def counted_requests(metrics: dict) -> collections.Counter:
    out = collections.Counter()
    for name, value in metrics.items():
        if name.startswith("strata_requests_total{"):
            labels = dict(p.split("=", 1) for p in name[len("strata_requests_total{"):-1]
                          .split(","))
            out[labels["endpoint"], labels["status"]] = int(value)
    return out


def compare_counts(client: Client, before: dict, after: dict) -> list[str]:
    """Requests by (endpoint, status): this client's against the server's counter; a hang-up
    may be a 200 (it ended first) or a 499."""
    server = counted_requests(after)
    server.subtract(counted_requests(before))
    problems = []
    paths = {p for p, _ in client.seen} | {p for p, _ in server if p not in ("/metrics",)}
    for path in sorted(paths):
        if path == "/metrics":
            continue
        mine = {str(s): n for (p, s), n in client.seen.items() if p == path}
        theirs = {s: n for (p, s), n in server.items() if p == path and n}
        hung_up = mine.pop("hang-up", 0)
        if not (mine or hung_up or theirs):
            continue
        extra_499 = theirs.get(str(CLIENT_CLOSED), 0)
        extra_200 = theirs.get("200", 0) - mine.get("200", 0)
        is_ok = (extra_499 + extra_200 == hung_up and extra_200 >= 0
                 and all(theirs.get(s, 0) == n for s, n in mine.items() if s != "200")
                 and set(theirs) <= set(mine) | {"200", str(CLIENT_CLOSED)})
        line = f"{path:24} client {dict(sorted(mine.items()))} + {hung_up} hang-ups; " \
               f"server {dict(sorted(theirs.items()))}"
        print(("  " if is_ok else "! ") + line)
        if not is_ok:
            problems.append(line)
    return problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8080")
    parser.add_argument("-n", "--requests", type=int, default=2000)
    parser.add_argument("--every", type=int, default=200, help="requests between rows")
    parser.add_argument("--pid", type=int, help="the server's process id, on this machine "
                        "(RSS, fds, threads)")
    parser.add_argument("--conversation-dir", help="its --conversation-cache-dir")
    parser.add_argument("--conversations", type=int, default=40,
                        help="distinct conversations the 'conversation' kind takes turns in")
    parser.add_argument("--turns", type=int, default=12, help="turns before one starts over")
    parser.add_argument("-c", "--concurrency", type=int, default=2)
    parser.add_argument("--kinds", default=",".join(KINDS), help="comma-separated, of: "
                        + ", ".join(KINDS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--api-key")
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--json", action="store_true", help="print the rows as JSON lines")
    args = parser.parse_args(argv)
    kinds = args.kinds.split(",")
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        parser.error(f"unknown --kinds {unknown}; choose from {', '.join(KINDS)}")
    if args.concurrency >= args.conversations and "conversation" in kinds:
        parser.error("--conversations must exceed --concurrency (a conversation runs one "
                     "turn at a time)")

    client = Client(args.url, args.api_key, args.timeout)
    model = client.session.get(client.url + "/v1/models", headers=client.headers,
                               timeout=args.timeout).json()["data"][0]["id"]
    conversations = Conversations(args.conversations, args.turns, args.seed)
    rng_lock, rng = threading.Lock(), random.Random(args.seed)
    weights = [WEIGHTS.get(k, 1) for k in kinds]

    def one(index: int) -> None:
        with rng_lock:
            kind = rng.choices(kinds, weights)[0]
            request_rng = random.Random(rng.random())
        try:
            if kind == "conversation":
                conversation_turn(client, request_rng, model, conversations)
            else:
                KINDS[kind](client, request_rng, model)
        except Exception as exc:  # noqa: BLE001 - recorded, the soak goes on
            with client.lock:
                client.unexpected.append(f"{kind}: {type(exc).__name__}: {exc}")

    start_s = time.monotonic()
    first = snapshot(client, args, 0, start_s)
    rows = [first]
    if not args.json:
        print_row({}, is_header=True)
        print_row(first)
    done = 0
    with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
        while done < args.requests:
            batch = min(args.every, args.requests - done)
            list(pool.map(one, range(done, done + batch)))
            done += batch
            time.sleep(0.3)  # the hung-up requests' ends reach the counters
            row = snapshot(client, args, done, start_s)
            rows.append(row)
            if args.json:
                print(json.dumps({k: v for k, v in row.items() if k != "metrics"}), flush=True)
            else:
                print_row(row)
    print("\nrequests by endpoint and status (this client / the server's /metrics):")
    problems = compare_counts(client, first["metrics"], rows[-1]["metrics"])
    for key, name in (("parked_mib", "parked_budget_mib"), ("m_files_mib", "files_budget_mib")):
        over = [r["requests"] for r in rows if r[key] > r[name] + 1e-9]
        if over:
            problems.append(f"{key} over its budget after requests {over}")
    print(f"\n{len(client.unexpected)} unexpected answers")
    for line in client.unexpected[:20]:
        print("  " + line)
    for line in problems:
        print("problem: " + line)
    return 1 if client.unexpected or problems else 0


if __name__ == "__main__":
    sys.exit(main())
