"""A server that runs for days with clients that hang up, retry and send many requests: a
client that leaves stops its generation at once (not a keep-alive period later), and what
the server keeps per request goes away when the request ends."""
import json
import logging
import socket
import time

import pytest
import requests

from strata.config import EngineConfig
from strata.engine.engine import Engine
from strata.server.app import ServerConfig

from live_server import metric_value, start_live_server

MAX_TOKENS = 4000  # with ignore_eos the generation would run to the end of the context


@pytest.fixture(scope="module")
def live_slow_keepalive(model_path):
    """Keep-alives once an hour: a disconnect must be noticed without waiting for one."""
    engine = Engine(EngineConfig(model_path, n_ctx=4096, threads=2))
    server = start_live_server(engine, ServerConfig(model_id="tiny-server", keepalive_s=3600.0))
    yield server
    server.stop()


def _send(live, path: str, body: dict) -> socket.socket:
    host, port = live.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    data = json.dumps(body)
    sock.sendall((f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(data)}\r\n\r\n{data}").encode())
    return sock


def _wait_running(live, value: int) -> None:
    deadline = time.monotonic() + 30
    while metric_value(live, "strata_requests_running") != value:
        assert time.monotonic() < deadline, f"strata_requests_running never became {value}"
        time.sleep(0.01)


_MESSAGES = [{"role": "user", "content": "Write a very long story."}]
_WHOLE_ANSWERS = {
    "/v1/chat/completions": {"messages": _MESSAGES, "max_tokens": MAX_TOKENS},
    "/v1/messages": {"model": "tiny-server", "messages": _MESSAGES, "max_tokens": MAX_TOKENS},
    "/v1/responses": {"input": "Write a very long story.", "max_output_tokens": MAX_TOKENS},
    "/completion": {"prompt": "Once upon a time", "n_predict": MAX_TOKENS},
}


@pytest.mark.parametrize("path", list(_WHOLE_ANSWERS))
def test_a_client_that_hangs_up_before_its_answer_stops_the_generation(
        live_slow_keepalive, caplog, path):
    """The request thread used to ask whether its client was still there only once per
    keep-alive period (5 s by default; an hour here), so a whole answer whose client
    had hung up kept generating that long (here: to its 4000th token)."""
    live = live_slow_keepalive
    caplog.set_level(logging.INFO, logger="strata.server")
    generated_before = metric_value(live, "strata_generated_tokens_total")
    with _send(live, path, dict(_WHOLE_ANSWERS[path], ignore_eos=True)):
        _wait_running(live, 1)
    _wait_running(live, 0)
    generated = metric_value(live, "strata_generated_tokens_total") - generated_before
    assert generated < MAX_TOKENS
    assert f"cancelled after {int(generated)} generated tokens (the client went away)" \
        in caplog.text
    assert metric_value(live, "strata_requests_queued") == 0
    # the server goes on serving, and the conversation was parked for the retry
    retry = dict(_WHOLE_ANSWERS["/v1/chat/completions"], max_tokens=2)
    response = requests.post(live.url + "/v1/chat/completions", json=retry, timeout=60)
    assert response.status_code == 200
    assert response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_idle_keep_alive_connections_do_not_lock_new_clients_out(live):
    """120 connections left open and idle (a pool's keep-alive sockets): a new client is still
    answered (waitress's default limit, 100, made it wait until idle ones timed out, 120 s)."""
    host, port = live.url.removeprefix("http://").split(":")
    idle = [socket.create_connection((host, int(port)), timeout=10) for _ in range(120)]
    try:
        answer = requests.get(live.url + "/health", timeout=10)
        assert answer.status_code == 200
    finally:
        for s in idle:
            s.close()
