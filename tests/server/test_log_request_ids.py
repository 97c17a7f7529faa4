"""The log names each request by the id its client got (`chatcmpl-…`, `cmpl-…`, `resp_…`,
`msg_…`) on every line of it, the engine's and the server's, whole or streamed; several jobs of
one response (n, best_of, a batch) are `<id>/<index>`; a client's X-Request-Id is logged beside,
escaped."""
import json
import logging
import re
import socket
import time

import pytest
import requests

from live_server import metric_value

MESSAGES = [{"role": "user", "content": "Say something."}]
# The lines one finished request leaves at INFO, each with its id first
SLOT_TAKEN = r"request (\S+): slot \d+ .*\(\d+ tokens reused\)"
PROMPT_READ = r"request (\S+): prompt \d+ tokens = \d+ reused \+ \d+ read"
ENDED = r"request (\S+): prompt \d+ tokens \(\d+ reused\), generated \d+"
# any line about a request: "request <id>: ..." or "request <id> waits ..."
ANY_REQUEST = r"^request (\S+?):? "


def sse_payloads(response) -> list[dict]:
    return [json.loads(line[len("data: "):]) for line in response.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def only(values) -> str:
    [value] = set(values)
    return value


# Each API: (path, body, the id of a whole answer, the id of a streamed one's events)
APIS = {
    "chat": ("/v1/chat/completions", {"messages": MESSAGES},
             lambda answer: answer["id"], lambda events: only(e["id"] for e in events)),
    "completions": ("/v1/completions", {"prompt": "Once upon a time"},
                    lambda answer: answer["id"], lambda events: only(e["id"] for e in events)),
    "responses": ("/v1/responses", {"input": "Say something.", "max_output_tokens": 3},
                  lambda answer: answer["id"],
                  lambda events: only(e["response"]["id"] for e in events if "response" in e)),
    "messages": ("/v1/messages", {"messages": MESSAGES},
                 lambda answer: answer["id"],
                 lambda events: only(e["message"]["id"] for e in events if "message" in e)),
}


def ask(live, api: str, is_stream: bool, headers=None, **fields) -> str:
    """One request to `api`; the id its answer carries."""
    path, body, whole_id, streamed_id = APIS[api]
    body = {"max_tokens": 3, "temperature": 0, **body, **fields, "stream": is_stream}
    if api == "responses":
        body.pop("max_tokens")
    response = requests.post(live.url + path, json=body, headers=headers, timeout=60)
    assert response.status_code == 200, response.text
    return streamed_id(sse_payloads(response)) if is_stream else whole_id(response.json())


def lines(caplog, pattern: str) -> list[str]:
    """The ids of the INFO lines that match `pattern` (its group: the id), in order."""
    return [m.group(1) for r in caplog.records if r.levelno == logging.INFO
            for m in [re.search(pattern, r.getMessage())] if m]


@pytest.mark.parametrize("is_stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("api", list(APIS))
def test_every_line_of_a_request_names_the_id_its_client_got(live, caplog, api, is_stream):
    caplog.set_level(logging.INFO, logger="strata")
    caplog.clear()
    response_id = ask(live, api, is_stream)
    prefix = {"chat": "chatcmpl-", "completions": "cmpl-", "responses": "resp_",
              "messages": "msg_"}[api]
    assert response_id.startswith(prefix)
    for pattern in (SLOT_TAKEN, PROMPT_READ, ENDED):
        assert lines(caplog, pattern) == [response_id], pattern
    assert set(lines(caplog, ANY_REQUEST)) == {response_id}


@pytest.mark.parametrize("api, is_stream, fields, num_jobs", [
    ("chat", False, {"n": 2}, 2),
    ("chat", True, {"n": 2}, 2),
    ("completions", True, {"n": 2}, 2),
    ("completions", False, {"n": 1, "best_of": 3}, 3),
    ("completions", False, {"prompt": ["One", "Two"]}, 2),
], ids=["chat-n2", "chat-n2-streamed", "completions-n2-streamed", "best-of-3", "batch-of-2"])
def test_the_jobs_of_one_response_have_distinct_ids_under_its_id(live, caplog, api, is_stream,
                                                                 fields, num_jobs):
    caplog.set_level(logging.INFO, logger="strata")
    caplog.clear()
    response_id = ask(live, api, is_stream, **fields, seed=3)
    job_ids = [f"{response_id}/{i}" for i in range(num_jobs)]
    for pattern in (SLOT_TAKEN, PROMPT_READ, ENDED):
        assert sorted(lines(caplog, pattern)) == job_ids, pattern
    assert set(lines(caplog, ANY_REQUEST)) == set(job_ids)


def test_a_cancelled_request_is_logged_under_its_id(live_long, caplog):
    """A streamed chat whose client leaves after its first chunk (which names the id)."""
    caplog.set_level(logging.INFO, logger="strata.server")
    caplog.clear()
    body = json.dumps({"messages": MESSAGES, "max_tokens": 3000, "ignore_eos": True,
                       "stream": True})
    host, port = live_long.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall((f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
                      "Content-Type: application/json\r\n"
                      f"Content-Length: {len(body)}\r\n\r\n{body}").encode())
        received = b""
        while (match := re.search(rb'"id": ?"(chatcmpl-\w+)"', received)) is None:
            chunk = sock.recv(4096)
            assert chunk, "the server closed the stream before its first chunk"
            received += chunk
        response_id = match.group(1).decode()
    deadline = time.monotonic() + 20
    while not lines(caplog, r"request (\S+): cancelled after \d+ generated tokens"):
        assert time.monotonic() < deadline, "the request was not cancelled"
        time.sleep(0.05)
    assert lines(caplog, r"request (\S+): cancelled after") == [response_id]
    assert metric_value(live_long, "strata_requests_running") == 0


@pytest.mark.parametrize("api", ["chat", "messages"])
def test_a_client_x_request_id_is_logged_beside_the_id(live, caplog, api):
    caplog.set_level(logging.INFO, logger="strata.server")
    caplog.clear()
    response_id = ask(live, api, False, headers={"X-Request-Id": "trace-42/a b"})
    assert lines(caplog, r"request (\S+): the client's X-Request-Id is 'trace-42/a b'$") == [
        response_id]


def test_llama_completion_lines_share_one_id_and_the_client_s(live, caplog):
    """llama-server's /completion answers with no id: its lines share the server's own, and
    an X-Request-Id names it."""
    caplog.set_level(logging.INFO, logger="strata")
    caplog.clear()
    response = requests.post(live.url + "/completion", headers={"X-Request-Id": "job-7"},
                             json={"prompt": "Once", "n_predict": 3}, timeout=60)
    assert response.status_code == 200, response.text
    [server_id] = lines(caplog, r"request (\S+): the client's X-Request-Id is 'job-7'$")
    for pattern in (SLOT_TAKEN, PROMPT_READ, ENDED):
        assert lines(caplog, pattern) == [server_id], pattern


def test_an_x_request_id_cannot_forge_a_log_line(live, caplog):
    """What waitress lets through of a header's bytes (tab, and any byte over 0x7f, read as
    Latin-1: NEL, a line break to Python and some viewers, and the 8-bit terminal escape CSI;
    it refuses the other control bytes) comes out escaped on the one line; a long id is cut.
    (A raw request: an HTTP client refuses to send those bytes.)"""
    caplog.set_level(logging.INFO, logger="strata.server")
    caplog.clear()
    body = json.dumps({"messages": MESSAGES, "max_tokens": 1})
    host, port = live.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall((f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
                      "X-Request-Id: a\x85request forged\x9b2J\té\r\n"
                      "Content-Type: application/json\r\nConnection: close\r\n"
                      f"Content-Length: {len(body)}\r\n\r\n{body}").encode("latin-1"))
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    [line] = [r.getMessage() for r in caplog.records if "X-Request-Id" in r.getMessage()]
    assert line.endswith(r"the client's X-Request-Id is 'a\x85request forged\x9b2J\t\xe9'")
    assert line.isprintable() and line.isascii()
    caplog.clear()
    response_id = ask(live, "chat", False, headers={"X-Request-Id": "x" * 300})
    assert lines(caplog, r"request (\S+): the client's X-Request-Id is 'x{128}' \(its first "
                         r"128 of 300 characters\)$") == [response_id]
