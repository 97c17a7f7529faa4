"""What a server left running for days with coding agents must keep right (tools/soak_server.py
drives one for long): strata_requests_total counts a request whose client hung up before its
answer was whole as 499 (nginx's "client closed request"), not as the 200 its stream began
with or the whole answer nobody read; an idle server holds nothing of its last request."""
import contextlib
import gc
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
from flask import Response

from strata.engine.scheduler import RequestHandle
from strata.server.metrics import ServerMetrics
from strata.server.worker import Job, JobEnd

from test_long_runs import _send, _wait_running
from test_metrics_health import delta, scrape

SOAK_TOOL = Path(__file__).resolve().parents[2] / "tools" / "soak_server.py"
TOTAL = "strata_requests_total"
_MESSAGES = [{"role": "user", "content": "Write a very long story."}]
_STREAMS = {
    "/v1/chat/completions": {"messages": _MESSAGES, "max_tokens": 4000},
    "/v1/messages": {"model": "tiny-server", "messages": _MESSAGES, "max_tokens": 4000},
    "/v1/responses": {"input": "Write a very long story.", "max_output_tokens": 4000},
    "/completion": {"prompt": "Once upon a time", "n_predict": 4000},
    "/v1/completions": {"prompt": "Once upon a time", "max_tokens": 4000, "n": 2},
}


def _counted(live, before: dict, endpoint: str) -> dict:
    """The statuses `endpoint` was counted under since `before`, once it was counted at all
    (a stream is counted when the server closes it, after its client left)."""
    deadline = time.monotonic() + 30
    while True:
        after = scrape(live)
        got = {status: delta(after, before, TOTAL, endpoint=endpoint, status=status)
               for status in ("200", "499")}
        if any(got.values()):
            return got
        assert time.monotonic() < deadline, f"{endpoint} was never counted"
        time.sleep(0.02)


@pytest.mark.parametrize("path", list(_STREAMS))
def test_a_stream_whose_client_hangs_up_is_counted_as_499(live_long, path):
    """It was counted as a 200 (its status line went out before the first token)."""
    before = scrape(live_long)
    with _send(live_long, path, dict(_STREAMS[path], stream=True, ignore_eos=True)) as sock:
        got = b""
        while b"data: " not in got:  # the stream has begun
            chunk = sock.recv(4096)
            assert chunk, f"{path} closed its stream: {got!r}"
            got += chunk
    assert _counted(live_long, before, path) == {"200": 0, "499": 1}
    _wait_running(live_long, 0)  # its generation stopped; the server goes on serving
    whole = dict(_STREAMS[path], stream=True, ignore_eos=True)
    whole.update({key: 2 for key in ("max_tokens", "max_output_tokens", "n_predict")
                  if key in whole})
    before = scrape(live_long)
    answer = requests.post(live_long.url + path, json=whole, timeout=60)
    assert answer.status_code == 200
    assert _counted(live_long, before, path) == {"200": 1, "499": 0}


def test_a_whole_answer_whose_client_hangs_up_is_counted_as_499(live_long):
    """The answer, cut where the cancel stopped it, was built and counted as a 200."""
    path = "/v1/chat/completions"
    before = scrape(live_long)
    with _send(live_long, path, dict(_STREAMS[path], ignore_eos=True)):
        _wait_running(live_long, 1)
    _wait_running(live_long, 0)
    assert _counted(live_long, before, path) == {"200": 0, "499": 1}
    answer = requests.post(live_long.url + path, timeout=60,
                           json={"messages": _MESSAGES, "max_tokens": 2})
    assert answer.status_code == 200


def test_a_soak_leaves_no_request_behind(live):
    """tools/soak_server.py's mix (every API, streamed and whole, tools, constraints, n and
    best_of, hang-ups, bad requests, conversations): every answer as expected, /metrics'
    counts as the client's, and nothing a request held is alive once it ended: the engine
    thread's loop variables held the last request (its job with its prompt and events, its
    handle, its JobEnd) until the next one came."""
    num_before = _num_alive_requests()  # (what other tests' engines may still hold)
    run = subprocess.run([sys.executable, str(SOAK_TOOL), "--url", live.url, "-n", "60",
                          "--every", "30", "--turns", "3", "--conversations", "6",
                          "--kinds", "chat,stream,tools,json,n,completions,completions_stream,"
                          "responses,messages,llama,hangup_stream,hangup_whole,bad,"
                          "conversation"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    # (a hung-up request's thread may still be noticing that its client left)
    deadline = time.monotonic() + 30
    while _num_alive_requests() > num_before:
        assert time.monotonic() < deadline, "a request's objects outlived it: " \
            f"{_num_alive_requests()} alive, {num_before} before the soak"
        time.sleep(0.05)


def _num_alive_requests() -> int:
    """Jobs, JobEnds and RequestHandles alive in this process."""
    gc.collect()
    # type(), not isinstance: isinstance reads __class__, which some modules' objects (torch's
    # deprecated aliases, when another test imported torch) answer with a warning
    kinds = (RequestHandle, Job, JobEnd)
    return sum(type(o) in kinds for o in gc.get_objects())


def _stream(fail: bool = False):
    yield b"data: 1\n\n"
    if fail:
        raise RuntimeError("a stream that fails")
    yield b"data: [DONE]\n\n"


@pytest.mark.parametrize("is_read_whole, fail, status", [(True, False, "200"),
                                                         (False, False, "499"),
                                                         (True, True, "500")])
def test_a_stream_is_counted_when_it_ends_by_how_it_ended(is_read_whole, fail, status):
    """Read to its end: its status; left by the server after a failed write: 499; raising:
    500 (its status line said 200)."""
    metrics = ServerMetrics()
    response = Response(_stream(fail), mimetype="text/event-stream")
    metrics.count_response(response, "/v1/chat/completions", "/v1/chat/completions", None)
    chunks = iter(response.response)
    with pytest.raises(RuntimeError) if fail else contextlib.nullcontext():
        next(chunks)
        if is_read_whole:
            list(chunks)
    assert _samples(metrics) == {}  # not before it ends
    response.close()
    response.close()  # counted once
    assert _samples(metrics) == {("/v1/chat/completions", status): 1.0}


@pytest.mark.parametrize("status, is_gone, counted", [(200, True, 499), (200, False, 200),
                                                      (400, True, 400)])
def test_a_whole_answer_whose_client_is_gone_is_counted_as_499(status, is_gone, counted):
    """A 200 its client did not wait for is a 499; an error stays what it was."""
    metrics = ServerMetrics()
    metrics.count_response(Response("{}", status=status), "/v1/messages", "/v1/messages",
                           lambda: is_gone)
    assert _samples(metrics) == {("/v1/messages", str(counted)): 1.0}


def _samples(metrics) -> dict:
    return {(s.labels["endpoint"], s.labels["status"]): s.value
            for family in metrics.registry.collect() if family.name == "strata_requests"
            for s in family.samples if s.name == "strata_requests_total"}


def test_a_stream_that_ends_with_an_error_event_is_counted_under_its_status():
    """The error event (the engine failed, the server stopped) is the stream's answer: counted
    under its status, not the 200 the stream began with."""
    from strata.server.api_error import ApiError
    from strata.server.generation import _sse_response

    ended = []

    def stream():
        yield b"data: {}\n\n"
        ended.append(ApiError(503, "The server is shutting down.", code="shutting_down"))
        yield b'data: {"error": {}}\n\n'

    metrics = ServerMetrics()
    response = _sse_response(stream(), lambda: ended[0] if ended else None)
    metrics.count_response(response, "/v1/messages", "/v1/messages", None)
    assert len(list(response.response)) == 2
    response.close()
    assert _samples(metrics) == {("/v1/messages", "503"): 1.0}
