"""An exposed server (--host 0.0.0.0 with --api-key): every endpoint but /health wants the
key and never echoes a wrong one; bodies nested as deep as JSON parses are a 400 or an answer,
never a 500; a slot-file failure does not tell a client the server's folders."""
import json

import pytest
import requests

from conftest import API_KEY, N_CTX_TOKENS, start_live_server
from strata.config import EngineConfig
from strata.engine.engine import Engine
from strata.server.app import ServerConfig
from strata.server.schema import parse_json_body

CHAT = "/v1/chat/completions"
WRONG_KEY = "sk-wrong-key-that-must-not-come-back"
USER = [{"role": "user", "content": "hi"}]


def nested_body(depth: int, leaf: str) -> bytes:
    """A chat request whose `metadata` holds `leaf` (JSON text) under `depth` arrays."""
    return ('{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "metadata": '
            '{"deep": ' + "[" * depth + leaf + "]" * depth + "}}").encode()


@pytest.mark.parametrize("leaf", ['"\\ud83d"', '{"\\udc00": "x\\ud800"}'])
def test_a_lone_surrogate_deep_in_a_body_becomes_a_replacement_character(leaf):
    """Lone UTF-16 halves are replaced however deep json.loads let them be (a RecursionError
    below ~500 levels was a 500)."""
    body = parse_json_body(nested_body(700, leaf))
    node = body["metadata"]["deep"]
    for _ in range(700):
        node = node[0]
    assert node in ("\ufffd", {"\ufffd": "x\ufffd"})


def test_deep_bodies_are_answered_or_refused_never_a_500(live):
    for depth, leaf in ((600, '"\\ud83d"'), (600, '"x"'), (5000, '"\\ud83d"')):
        reply = requests.post(live.url + CHAT, data=nested_body(depth, leaf), timeout=60,
                              headers={"Content-Type": "application/json"})
        assert reply.status_code in (200, 400), (depth, leaf, reply.text)
        if reply.status_code == 400:
            assert reply.json()["error"]["code"] == "invalid_json"
    assert requests.post(live.url + CHAT, json={"messages": USER, "max_tokens": 1},
                         timeout=60).status_code == 200


@pytest.mark.parametrize("method, path", [
    ("GET", "/props"), ("GET", "/slots"), ("POST", "/slots/0?action=erase"),
    ("POST", "/tokenize"), ("POST", "/detokenize"), ("POST", "/apply-template"),
    ("POST", "/completion"), ("POST", "/infill"), ("POST", "/v1/responses"),
    ("POST", "/v1/messages/count_tokens"), ("GET", "/v1/models/tiny-server"),
    ("OPTIONS", CHAT),  # not a preflight (no Origin): no way around the key
])
def test_every_endpoint_but_health_wants_the_key(live_keyed, method, path):
    for headers in ({"Authorization": f"Bearer {WRONG_KEY}"}, {"x-api-key": WRONG_KEY}):
        reply = requests.request(method, live_keyed.url + path, headers=headers,
                                 json={"prompt": "a"}, timeout=30)
        assert reply.status_code == 401, reply.text
        assert reply.json()["error"]["code"] == "invalid_api_key"
        assert WRONG_KEY not in reply.text and API_KEY not in reply.text
    good = requests.request(method, live_keyed.url + path, json={"prompt": "a"}, timeout=60,
                            headers={"x-api-key": API_KEY})
    assert good.status_code != 401, good.text


def test_a_wrong_key_gets_each_apis_own_401(live_keyed):
    headers = {"x-api-key": WRONG_KEY, "anthropic-version": "2023-06-01"}
    anthropic = requests.post(live_keyed.url + "/v1/messages", headers=headers, timeout=30,
                              json={"model": "tiny-server", "max_tokens": 1, "messages": USER})
    assert anthropic.status_code == 401
    body = anthropic.json()
    assert body["type"] == "error" and body["error"]["type"] == "authentication_error"
    openai = requests.post(live_keyed.url + CHAT, json={"messages": USER}, timeout=30,
                           headers={"Authorization": f"Bearer {WRONG_KEY}"})
    assert openai.status_code == 401
    assert openai.json()["error"]["type"] == "invalid_request_error"
    for reply in (anthropic, openai):
        assert WRONG_KEY not in reply.text and API_KEY not in reply.text
        assert reply.headers["Content-Type"] == "application/json"


def test_echoed_request_text_stays_json_and_out_of_the_headers(live):
    """A model name or path with CR LF and markup comes back JSON-escaped in the body only."""
    name = 'a\r\nX-Injected: 1\r\n\r\n<script>"'
    reply = requests.post(live.url + CHAT, json={"model": name, "messages": USER},
                          timeout=30)
    assert reply.status_code == 404 and "X-Injected" not in reply.headers
    assert repr(name) in json.loads(reply.text)["error"]["message"]
    assert "\r\n" not in reply.text and reply.headers["Content-Type"] == "application/json"
    reply = requests.get(live.url + "/v1/models/a%0d%0aX-Injected:%201", timeout=30)
    assert reply.status_code == 404 and "X-Injected" not in reply.headers


def test_a_gone_slot_folder_is_a_500_that_does_not_name_it(model_path, tmp_path):
    folder = tmp_path / "private-slot-folder"
    folder.mkdir()
    server = start_live_server(Engine(EngineConfig(model_path, n_ctx=N_CTX_TOKENS, threads=2)),
                               ServerConfig(model_id="tiny", slot_save_path=str(folder)))
    try:
        folder.rmdir()
        reply = requests.post(server.url + "/slots/0?action=save", json={"filename": "a.bin"},
                              timeout=30)
        assert reply.status_code == 500, reply.text
        message = reply.json()["error"]["message"]
        assert "--slot-save-path" in message and "is not a folder" in message
        assert str(tmp_path) not in reply.text and "private-slot-folder" not in reply.text
    finally:
        server.stop()


@pytest.fixture
def slot_server(model_path, tmp_path):
    folder = tmp_path / "slots"
    folder.mkdir()
    server = start_live_server(Engine(EngineConfig(model_path, n_ctx=N_CTX_TOKENS, threads=2)),
                               ServerConfig(model_id="tiny", slot_save_path=str(folder)))
    yield server, folder
    server.stop()


def test_a_link_out_of_the_slot_folder_is_neither_read_nor_written(slot_server, tmp_path):
    """A link in --slot-save-path leading out of it: a restore read 8 bytes of the file it
    named into its error, a save wrote through it."""
    server, folder = slot_server
    secret = tmp_path / "secret.txt"
    secret.write_text("root:x:0:0:secret\n")
    (folder / "out").symlink_to(secret)
    (folder / "sub").mkdir()
    (folder / "into").symlink_to(folder / "sub" / "x.bin")
    for action, name in (("restore", "out"), ("save", "out"), ("save", "into")):
        reply = requests.post(server.url + f"/slots/0?action={action}",
                              json={"filename": name}, timeout=30)
        assert reply.status_code == 400, reply.text
        assert "link out of --slot-save-path" in reply.json()["error"]["message"]
        assert "root" not in reply.text
    assert secret.read_text() == "root:x:0:0:secret\n"
    assert not (folder / "sub" / "x.bin").exists()


def test_a_name_too_long_with_its_partial_suffix_is_a_400(slot_server):
    """A save writes NAME.partial first: a name of 248-255 bytes was a 500 'File name too
    long'."""
    server, folder = slot_server
    for length, status in ((247, 200), (248, 400), (255, 400)):
        reply = requests.post(server.url + "/slots/0?action=save",
                              json={"filename": "a" * length}, timeout=30)
        assert reply.status_code == status, (length, reply.text)


def test_a_key_from_an_env_file_with_a_carriage_return_still_matches(model_path):
    """STRATA_API_KEY read from a file written on Windows ends in '\\r': clients send the key
    without it, so it could never match (every request a 401)."""
    import os
    import subprocess
    import sys

    from live_server import wait_until_healthy
    from test_serve_signals import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "strata", "serve", "-m", str(model_path),
                               "--port", str(port), "-t", "1"], stderr=subprocess.DEVNULL,
                              env={**os.environ, "STRATA_API_KEY": API_KEY + "\r\n"})
    try:
        wait_until_healthy(server, url)
        headers = {"Authorization": f"Bearer {API_KEY}"}
        assert requests.get(url + "/v1/models", headers=headers, timeout=30).status_code == 200
        assert requests.get(url + "/v1/models", timeout=30).status_code == 401
    finally:
        server.terminate()
        server.wait(60)
