"""SSE framing of parsed output (tool-call deltas, cut calls, errors after the stream began,
keep-alives), and a client that disconnects mid-stream."""
import json
import logging
import queue
import socket
import threading
import time

import pytest
import requests

from strata.engine.generate import GenerationEvent, GenerationStats
from strata.server.api_error import ApiError
from strata.server.generation import GenerationRoutes, Outcome, _Choice
from strata.server.logprobs_format import AnswerLogprobs
from strata.server.openai_format import ResponseHeader
from strata.server.output_parser import OutputParser
from strata.server.worker import ChoiceQueue, Job, JobEnd, iterate_jobs
from live_server import metric_value

MAX_TOKENS = 4000  # with ignore_eos: the generation would run to the end of the context


class _State:
    class config:
        keepalive_s = 0.05


def run_stream(pieces, finish, end=None, is_usage_streamed=True, delay_first_s=0.0):
    """Frames `pieces` (text of consecutive tokens; the last one carries `finish`) as the
    chat stream would, and returns the SSE lines' payloads."""
    shared = queue.Queue()
    job = Job(request_id="test", prompt_tokens=[1, 2, 3], params=None,
              events=ChoiceQueue(shared, 0))
    stats = GenerationStats(num_prompt_tokens=3, num_cached_tokens=1,
                            num_generated_tokens=len(pieces))
    items = [GenerationEvent(i, piece, finish if i == len(pieces) - 1 else None,
                             stats if i == len(pieces) - 1 else None)
             for i, piece in enumerate(pieces)]
    items.append(end or JobEnd(num_generated_tokens=len(pieces), num_cached_tokens=1))

    def put_all():
        time.sleep(delay_first_s)
        for item in items:
            job.events.put(item)

    if delay_first_s:
        threading.Thread(target=put_all).start()
    else:
        put_all()
    routes = GenerationRoutes(_State)
    choice = _Choice(0, job, Outcome(3), AnswerLogprobs(None), OutputParser(parse_tools=True))
    header = ResponseHeader("chat", "m")
    lines = "".join(routes._chat_stream([choice], iterate_jobs([job], shared, 0.05), header,
                                        is_usage_streamed))
    return lines.split("\n\n")[:-1]


def payloads(frames):
    return [json.loads(f[len("data: "):]) for f in frames
            if f.startswith("data: {")]


def test_tool_call_stream():
    pieces = ["<think>", "hmm", "</think>", "Checking.", "\n<tool", "_call>\n{\"name\": ",
              "\"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>"]
    frames = run_stream(pieces, "stop")
    assert frames[-1] == "data: [DONE]"
    chunks = payloads(frames)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert deltas[1:-1] == [
        {"reasoning_content": "hmm"}, {"content": "Checking."},
        {"tool_calls": [{"index": 0, "id": deltas[3]["tool_calls"][0]["id"],
                         "type": "function",
                         "function": {"name": "get_weather", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Paris"}'}}]},
    ]
    assert deltas[3]["tool_calls"][0]["id"].startswith("call_")
    assert chunks[-2]["choices"][0]["finish_reason"] == "tool_calls"
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": len(pieces),
                                   "total_tokens": 3 + len(pieces),
                                   "prompt_tokens_details": {"cached_tokens": 1},
                                   # "<think>", "hmm", "</think>"
                                   "completion_tokens_details": {"reasoning_tokens": 3}}


@pytest.mark.parametrize("finish", ["length", "stop"])
def test_call_cut_by_the_end_of_the_output_is_text_and_logged(caplog, finish):
    """Never half a call, nor text lost: what the model wrote comes as content."""
    with caplog.at_level(logging.INFO, logger="strata.server"):
        frames = run_stream(["Sure.", "\n<tool_call>\n{\"name\": \"get_", "weather\""],
                            finish)
    chunks = payloads(frames)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert deltas == [{"role": "assistant", "content": ""}, {"content": "Sure."},
                      {"content": "\n<tool_call>\n{\"name\": \"get_weather\""}, {}]
    assert chunks[-2]["choices"][0]["finish_reason"] == finish
    assert "ended inside a tool call" in caplog.text
    assert "generated 3" in caplog.text and f"finish {finish}" in caplog.text


def test_error_after_the_stream_began_is_an_event():
    error = ApiError(500, "The engine failed on this request.", code="engine_error")
    frames = run_stream(["Hel"], None, end=JobEnd(error=error, num_generated_tokens=1))
    assert frames[-1] == "data: [DONE]"
    assert json.loads(frames[-2][len("data: "):]) == {"error": {
        "message": "The engine failed on this request.", "type": "server_error",
        "param": None, "code": "engine_error"}}


def test_keepalive_while_waiting():
    frames = run_stream(["Hi"], "stop", delay_first_s=0.3)
    assert frames[1] == ": keep-alive"
    assert payloads(frames)[1]["choices"][0]["delta"] == {"content": "Hi"}


@pytest.mark.parametrize("n", [1, 2])
def test_disconnect_mid_stream_cancels_the_generation(live_long, caplog, n):
    """With n = 2 both choices stop, the one still queued too (one slot here)."""
    live = live_long
    caplog.set_level(logging.INFO, logger="strata.server")
    body = json.dumps({"messages": [{"role": "user", "content": "Write a long story."}],
                       "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True, "n": n})
    generated_before = metric_value(live, "strata_generated_tokens_total")
    host, port = live.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall((f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
                  "Content-Type: application/json\r\n"
                  f"Content-Length: {len(body)}\r\n\r\n{body}").encode())
    received = b""
    # a chunk after the n role chunks: those go out before any token is generated, and a
    # client that left then could stop the generation before its first token
    while received.count(b"data: {") < n + 1:
        received += sock.recv(4096)
    assert received.startswith(b"HTTP/1.1 200")
    sock.close()
    deadline = time.monotonic() + 20
    while metric_value(live, "strata_requests_running") != 0:
        assert time.monotonic() < deadline, "the generation did not stop"
        time.sleep(0.05)
    generated = metric_value(live, "strata_generated_tokens_total") - generated_before
    assert 1 <= generated < MAX_TOKENS
    if n == 1:
        assert f"cancelled after {int(generated)} generated tokens" in caplog.text
    time.sleep(0.3)  # nothing starts after: no choice was left queued
    assert metric_value(live, "strata_requests_running") == 0
    assert metric_value(live, "strata_generated_tokens_total") - generated_before == generated
    response = requests.post(live.url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "Still there?"}], "max_tokens": 3})
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] >= 1


def test_disconnect_while_waiting_for_a_whole_answer_cancels_it(live_long, caplog):
    live = live_long
    caplog.set_level(logging.INFO, logger="strata.server")
    body = json.dumps({"messages": [{"role": "user", "content": "Another long story."}],
                       "max_tokens": MAX_TOKENS, "ignore_eos": True})
    generated_before = metric_value(live, "strata_generated_tokens_total")
    host, port = live.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall((f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
                      "Content-Type: application/json\r\n"
                      f"Content-Length: {len(body)}\r\n\r\n{body}").encode())
        deadline = time.monotonic() + 20
        while metric_value(live, "strata_requests_running") != 1:
            assert time.monotonic() < deadline, "the generation did not start"
            time.sleep(0.01)
    deadline = time.monotonic() + 20
    while metric_value(live, "strata_requests_running") != 0:
        assert time.monotonic() < deadline, "the generation did not stop"
        time.sleep(0.05)
    generated = metric_value(live, "strata_generated_tokens_total") - generated_before
    assert f"cancelled after {int(generated)} generated tokens" in caplog.text


def test_keepalive_while_a_long_prompt_is_read(live_long):
    """3000 prompt tokens take far longer than the 20 ms keep-alive period to read."""
    response = requests.post(live_long.url + "/v1/completions", timeout=60, json={
        "prompt": [(7 * i) % 3000 + 10 for i in range(3000)], "max_tokens": 2,
        "stream": True})
    assert response.status_code == 200
    assert response.headers["Content-Type"].startswith("text/event-stream")
    frames = response.text.split("\n\n")
    first_data = next(i for i, f in enumerate(frames) if f.startswith("data: {"))
    assert first_data >= 1 and set(frames[:first_data]) == {": keep-alive"}
    assert frames[-2:] == ["data: [DONE]", ""]
