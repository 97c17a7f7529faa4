"""A server with --conversation-cache-dir, stopped and started again: an agent's next turn
reads only its new tokens, and answers as a server without the files does."""
from __future__ import annotations

import requests

from strata.config import EngineConfig
from strata.engine.engine import Engine
from strata.server.app import ServerConfig

from conftest import N_CTX_TOKENS
from live_server import start_live_server

SYSTEM = "You are a careful coding agent. " * 12


def serve(model_path, folder=None):
    config = EngineConfig(model_path, n_ctx=N_CTX_TOKENS, threads=2,
                          conversation_cache_dir=folder)
    return start_live_server(lambda: Engine(config), ServerConfig(model_id="tiny-server"))


def turn(server, messages):
    reply = requests.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "model": "tiny-server", "messages": messages, "max_tokens": 8, "temperature": 0})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    return body["choices"][0]["message"]["content"], body["usage"]


def test_a_conversation_survives_a_restart(model_path, tmp_path):
    first = [{"role": "system", "content": SYSTEM},
             {"role": "user", "content": "List the files."}]
    server = serve(model_path, tmp_path)
    try:
        answer, usage = turn(server, first)
    finally:
        server.stop()  # a graceful stop: the slot's conversation goes to its file
    assert list(tmp_path.glob("*.strata-kv"))
    second = first + [{"role": "assistant", "content": answer},
                      {"role": "user", "content": "Open the first one."}]
    server = serve(model_path, tmp_path)
    try:
        got, usage2 = turn(server, second)
        metrics = requests.get(f"{server.url}/metrics", timeout=10).text
    finally:
        server.stop()
    # everything up to this turn's new message comes from the file
    assert usage2["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"]
    assert "strata_conversation_files_read_total 1.0" in metrics
    assert "strata_conversation_files 1.0" in metrics
    plain = serve(model_path)
    try:
        want, usage3 = turn(plain, second)
    finally:
        plain.stop()
    assert usage3["prompt_tokens_details"]["cached_tokens"] == 0
    assert got == want
