"""CORS: a browser page served from another origin (a hosted chat UI, a local HTML page, an
editor's webview) can call the server. Preflights are answered on every route before the API
key check, every answer (errors and streams included, waitress's own refusals too) carries the
headers, and each --cors-* flag narrows the policy as llama-server's and vLLM's do."""
import json
import socket
import subprocess
import sys

import pytest
import requests
from click.testing import CliRunner

from conftest import API_KEY, new_engine
from strata.server.app import ServerConfig, create_app
from strata.server.command import serve
from strata.server.cors import CorsPolicy, parse_headers, parse_methods, parse_origins
from test_body_cap import declared_only, raw_exchange
from live_server import wait_until_healthy

UI = "http://localhost:5173"
CHAT = "/v1/chat/completions"
API_ROUTES = [CHAT, "/v1/completions", "/v1/responses", "/v1/messages",
              "/v1/messages/count_tokens", "/completion", "/completions", "/infill", "/tokenize",
              "/detokenize", "/apply-template", "/v1/models", "/v1/models/tiny-server", "/props",
              "/slots", "/slots/0", "/v1/responses/resp_1", "/health", "/metrics"]


def preflight_headers(origin=UI, method="POST", headers="content-type", **extra):
    return {"Origin": origin, "Access-Control-Request-Method": method,
            "Access-Control-Request-Headers": headers, **extra}


def vary(response) -> set[str]:
    return {v.strip().lower() for v in response.headers.get("Vary", "").split(",") if v.strip()}


@pytest.fixture(scope="module")
def make_app(model_path):
    """Apps on the tiny model with a given CORS policy (test client: real requests through
    the whole app, no socket)."""
    apps = []

    def make(policy: CorsPolicy, **config):
        app = create_app(lambda: new_engine(model_path),
                         ServerConfig(model_id="tiny-server", cors=policy, **config))
        apps.append(app)
        assert app.extensions["strata"].worker.wait_loaded(30)
        return app.test_client()

    yield make
    for app in apps:
        app.extensions["strata"].close()


# ---- the default: llama-server's (any origin, echoed, credentials) ----

@pytest.mark.parametrize("path", API_ROUTES + ["/no/such/route"])
def test_a_preflight_is_answered_on_every_route(live, path):
    # Before, OPTIONS had no CORS headers: the browser refused the request before sending it.
    response = live.app.test_client().options(path, headers=preflight_headers(
        headers="Authorization, Content-Type, X-Api-Key, anthropic-version"))
    assert response.status_code == 204, response.data
    assert response.headers["Access-Control-Allow-Origin"] == UI
    assert response.headers["Access-Control-Allow-Credentials"] == "true"
    assert response.headers["Access-Control-Allow-Methods"] == "POST"
    # named, not "*": a "*" does not cover Authorization in browsers
    assert response.headers["Access-Control-Allow-Headers"] == \
        "authorization, content-type, x-api-key, anthropic-version"
    assert response.headers["Access-Control-Max-Age"] == "600"
    assert {"origin", "access-control-request-method"} <= vary(response)
    assert response.data == b""


def test_answers_name_the_origin_and_vary_on_it(live):
    client = live.app.test_client()
    ok = client.get("/v1/models", headers={"Origin": "vscode-webview://1ab2c3"})
    assert ok.status_code == 200
    assert ok.headers["Access-Control-Allow-Origin"] == "vscode-webview://1ab2c3"
    assert ok.headers["Access-Control-Allow-Credentials"] == "true"
    assert "origin" in vary(ok)
    # a file:// page sends "null"
    assert client.get("/health", headers={"Origin": "null"}).headers[
        "Access-Control-Allow-Origin"] == "null"
    # no Origin: not a browser's cross-origin call, no CORS headers, but a cache must know
    plain = client.get("/v1/models")
    assert "Access-Control-Allow-Origin" not in plain.headers and "origin" in vary(plain)


@pytest.mark.parametrize("method, path, body, status, code", [
    ("GET", "/v2/nothing", None, 404, "not_found"),
    ("GET", CHAT, None, 405, "method_not_allowed"),
    ("POST", CHAT, b"{not json", 400, None),
    ("POST", "/v1/messages", b"{}", 400, None),
])
def test_error_answers_carry_the_headers(live, method, path, body, status, code):
    response = live.app.test_client().open(
        path, method=method, data=body,
        headers={"Origin": UI, "Content-Type": "application/json"})
    assert response.status_code == status, response.data
    assert response.headers["Access-Control-Allow-Origin"] == UI
    assert response.headers["Access-Control-Allow-Credentials"] == "true"
    if code:
        assert response.get_json()["error"]["code"] == code


def test_chrome_private_network_preflight_is_allowed(live):
    # A public page calling a server on this machine: Chrome asks first.
    response = live.app.test_client().options(CHAT, headers=preflight_headers(
        **{"Access-Control-Request-Private-Network": "true"}))
    assert response.status_code == 204
    assert response.headers["Access-Control-Allow-Private-Network"] == "true"


def test_an_options_request_that_is_not_a_preflight_is_left_alone(live):
    response = live.app.test_client().options(CHAT)  # no Origin: Flask's own answer
    assert response.status_code == 200 and "POST" in response.headers["Allow"]
    assert "Access-Control-Allow-Methods" not in response.headers


# ---- over a real socket (waitress) ----

def test_a_preflight_passes_the_api_key_check_and_the_answers_carry_the_headers(live_keyed):
    # A browser sends no Authorization with a preflight; it got 401, so the page never ran.
    url = live_keyed.url + CHAT
    pre = requests.options(url, timeout=10, headers=preflight_headers(
        headers="authorization,content-type"))
    assert pre.status_code == 204, pre.text
    assert pre.headers["Access-Control-Allow-Origin"] == UI
    assert pre.headers["Access-Control-Allow-Headers"] == "authorization, content-type"
    refused = requests.post(url, json={}, timeout=10, headers={"Origin": UI})
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert refused.headers["Access-Control-Allow-Origin"] == UI  # the page can read why
    ok = requests.post(url, timeout=60, headers={"Origin": UI,
                                                 "Authorization": f"Bearer {API_KEY}"},
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert ok.status_code == 200 and ok.headers["Access-Control-Allow-Origin"] == UI


def test_a_streamed_answer_carries_the_headers(live):
    with requests.post(live.url + CHAT, stream=True, timeout=60, headers={"Origin": UI},
                       json={"messages": [{"role": "user", "content": "hi"}],
                             "max_tokens": 3, "stream": True}) as stream:
        assert stream.status_code == 200
        assert stream.headers["Content-Type"].startswith("text/event-stream")
        assert stream.headers["Access-Control-Allow-Origin"] == UI
        assert stream.headers["Access-Control-Allow-Credentials"] == "true"
        frames = [line for line in stream.iter_lines() if line.startswith(b"data: ")]
    assert frames[-1] == b"data: [DONE]" and len(frames) >= 3


def test_the_413_for_a_body_over_the_cap_carries_the_headers(live):
    status, headers, body = raw_exchange(live, declared_only(CHAT, 10 * 2**30,
                                                             f"Origin: {UI}\r\n"))
    assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"
    assert headers["access-control-allow-origin"] == UI


@pytest.mark.parametrize("request_bytes, status, origin", [
    # a bad header line after the Origin: waitress read the Origin
    (f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nOrigin: {UI}\r\nno colon\r\n\r\n".encode(), 400, UI),
    # headers too large to read: no Origin known, "*" lets any page read the error
    (f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nOrigin: {UI}\r\nX-Big: {'a' * 300 * 1024}\r\n\r\n"
     .encode(), 431, "*"),
    (f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nOrigin: {UI}\r\nTransfer-Encoding: gzip\r\n\r\n"
     .encode(), 501, UI),
], ids=["bad-header-line", "headers-too-large", "unknown-transfer-encoding"])
def test_waitress_own_refusals_carry_the_headers(live, request_bytes, status, origin):
    got, headers, body = raw_exchange(live, request_bytes)
    assert got == status and json.loads(body)["error"]["message"], body
    assert headers["access-control-allow-origin"] == origin
    assert ("access-control-allow-credentials" in headers) == (origin != "*")
    assert "origin" in headers["vary"].lower()


# ---- each flag ----

def test_cors_origins_lists_the_pages_that_may_call(make_app):
    client = make_app(CorsPolicy(origins=parse_origins(
        "http://localhost:3000, HTTPS://UI.Example.com:443, null")))
    for origin in ("http://localhost:3000", "https://ui.example.com", "null"):
        response = client.options(CHAT, headers=preflight_headers(origin))
        assert response.status_code == 204 and \
            response.headers["Access-Control-Allow-Origin"] == origin
    refused = client.options(CHAT, headers=preflight_headers("https://evil.example"))
    assert refused.status_code == 403
    error = refused.get_json()["error"]
    assert error["code"] == "cors_origin_not_allowed" and "--cors-origins" in error["message"]
    assert "Access-Control-Allow-Origin" not in refused.headers
    # the request itself is answered, but the page may not read it
    answer = client.get("/v1/models", headers={"Origin": "https://evil.example"})
    assert answer.status_code == 200 and "Access-Control-Allow-Origin" not in answer.headers
    assert "origin" in vary(answer)
    # Anthropic's error shape under /v1/messages
    refused = client.options("/v1/messages", headers=preflight_headers("https://evil.example"))
    assert refused.get_json()["type"] == "error"


def test_cors_origins_localhost_allows_only_pages_on_this_machine(make_app):
    client = make_app(CorsPolicy(origins=parse_origins("localhost")))
    for origin in ("http://localhost:5173", "http://127.0.0.1:8080", "http://[::1]:3000",
                   "https://app.localhost"):
        assert client.options(CHAT, headers=preflight_headers(origin)).status_code == 204
    for origin in ("https://localhost.evil.example", "http://192.168.1.5:3000", "null",
                   "vscode-webview://abc"):
        assert client.options(CHAT, headers=preflight_headers(origin)).status_code == 403


def test_cors_methods_limits_what_a_page_may_do(make_app):
    client = make_app(CorsPolicy(methods=parse_methods("get, post")))
    ok = client.options(CHAT, headers=preflight_headers())
    assert ok.status_code == 204 and ok.headers["Access-Control-Allow-Methods"] == "GET, POST"
    refused = client.options("/v1/responses/x", headers=preflight_headers(method="DELETE"))
    assert refused.status_code == 403
    assert refused.get_json()["error"]["code"] == "cors_method_not_allowed"
    # a DELETE that came anyway is answered, unreadable by the page
    answer = client.delete("/v1/responses/x", headers={"Origin": UI})
    assert answer.status_code == 404 and "Access-Control-Allow-Origin" not in answer.headers


def test_cors_headers_limits_the_headers_a_page_may_send(make_app):
    client = make_app(CorsPolicy(headers=parse_headers("Authorization")))
    ok = client.options(CHAT, headers=preflight_headers(headers="Authorization, Content-Type"))
    assert ok.status_code == 204  # Content-Type is always allowed
    assert ok.headers["Access-Control-Allow-Headers"] == "authorization"
    refused = client.options(CHAT, headers=preflight_headers(headers="authorization, x-trace"))
    assert refused.status_code == 403
    error = refused.get_json()["error"]
    assert error["code"] == "cors_header_not_allowed" and "x-trace" in error["message"]


def test_no_cors_credentials_answers_any_origin_with_a_star(make_app):
    client = make_app(CorsPolicy(allow_credentials=False))
    answer = client.get("/v1/models", headers={"Origin": UI})
    assert answer.headers["Access-Control-Allow-Origin"] == "*"
    assert "Access-Control-Allow-Credentials" not in answer.headers
    assert "origin" not in vary(answer)
    listed = make_app(CorsPolicy(origins=(UI,), allow_credentials=False))
    answer = listed.get("/v1/models", headers={"Origin": UI})
    assert answer.headers["Access-Control-Allow-Origin"] == UI
    assert "Access-Control-Allow-Credentials" not in answer.headers


def test_the_flags_take_llama_server_and_vllm_forms():
    assert parse_origins('["http://a.test:8000", "http://b.test:80"]', "--allowed-origins") \
        == ("http://a.test:8000", "http://b.test")
    assert parse_origins("*") == ("*",) and parse_origins("LocalHost") == ("localhost",)
    # as browsers send them: lower case, no default port, punycode
    assert parse_origins("HTTPS://Bücher.Example:443, http://[::1]:8080") == \
        ("https://xn--bcher-kva.example", "http://[::1]:8080")
    assert parse_methods('["*"]') == ("*",) and parse_headers("X-Api-Key, authorization") == \
        ("x-api-key", "authorization")


@pytest.mark.parametrize("args, words", [
    (["--cors-origins", "http://localhost:3000/chat"],
     ["not an origin", "'http://localhost:3000'"]),
    (["--allowed-origins", "localhost:3000"], ["--allowed-origins", "not an origin"]),
    (["--cors-origins", "*,http://a.test"], ["must stand alone"]),
    (["--cors-origins", "localhost,http://a.test"], ["stands alone"]),
    (["--cors-origins", " , "], ["nothing given"]),
    (["--allowed-origins", '["http://a.test"'], ["not a JSON list"]),
    (["--cors-methods", "GET,P0ST"], ["'P0ST' is not an HTTP method"]),
    (["--allowed-headers", '[1]'], ["list of strings"]),
    (["--cors-headers", "Authorization:"], ["not a header name"]),
])
def test_a_wrong_flag_value_is_a_clear_usage_error(args, words):
    result = CliRunner().invoke(serve, ["-m", "unused.gguf", *args])
    assert result.exit_code == 2, result.output
    for word in words:
        assert word in result.output, result.output


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_strata_serve_applies_the_flags(model_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, "-m", "strata", "serve", "-m", str(model_path), "--port", str(port),
         "-t", "2", "-c", "512", "--allowed-origins", '["http://ui.test:8000"]',
         "--cors-methods", "GET,POST", "--cors-headers", "Authorization",
         "--no-cors-credentials"], stderr=subprocess.DEVNULL)
    try:
        wait_until_healthy(server, url)
        ok = requests.options(url + CHAT, timeout=10, headers=preflight_headers(
            "http://ui.test:8000", headers="authorization"))
        assert ok.status_code == 204
        assert ok.headers["Access-Control-Allow-Origin"] == "http://ui.test:8000"
        assert ok.headers["Access-Control-Allow-Methods"] == "GET, POST"
        assert ok.headers["Access-Control-Allow-Headers"] == "authorization"
        assert "Access-Control-Allow-Credentials" not in ok.headers
        assert requests.options(url + CHAT, timeout=10, headers=preflight_headers(
            UI)).status_code == 403
        assert requests.options(url + CHAT, timeout=10, headers=preflight_headers(
            "http://ui.test:8000", method="PUT")).status_code == 403
        assert requests.options(url + CHAT, timeout=10, headers=preflight_headers(
            "http://ui.test:8000", headers="x-other")).status_code == 403
    finally:
        server.terminate()
        server.wait(30)


def test_cors_origins_is_read_from_the_environment():
    result = CliRunner().invoke(serve, ["-m", "unused.gguf"],
                                env={"STRATA_CORS_ORIGINS": "http://ui.test/app"})
    assert result.exit_code == 2 and "'http://ui.test'" in result.output, result.output
