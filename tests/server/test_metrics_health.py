"""/health through loading, ok and error; /metrics counters against the requests made; the
`serve` command's own errors."""
import threading

import pytest
import requests
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families

from strata.server.app import ServerConfig, create_app
from strata.server.command import serve


def scrape(live) -> dict:
    response = requests.get(live.url + "/metrics", timeout=10)
    assert response.status_code == 200
    assert response.headers["Content-Type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def delta(after, before, name, **labels):
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_metrics_count_the_requests_made(live):
    before = scrape(live)
    usages = []
    for body in ({"messages": [{"role": "user", "content": "one"}], "max_tokens": 3},
                 {"messages": [{"role": "user", "content": "two"}], "max_tokens": 2,
                  "stream": True, "stream_options": {"include_usage": True}}):
        response = requests.post(live.url + "/v1/chat/completions", json=body, timeout=60)
        assert response.status_code == 200
        if body.get("stream"):
            last = [line for line in response.text.split("\n\n") if '"usage": {' in line][-1]
            import json
            usages.append(json.loads(last[len("data: "):])["usage"])
        else:
            usages.append(response.json()["usage"])
    response = requests.post(live.url + "/v1/completions", json={"prompt": "x",
                                                                 "max_tokens": 2}, timeout=60)
    usages.append(response.json()["usage"])
    assert requests.post(live.url + "/v1/completions", json={"prompt": 3},
                         timeout=10).status_code == 400
    assert requests.get(live.url + "/nope", timeout=10).status_code == 404
    assert requests.get(live.url + "/v1/models", timeout=10).status_code == 200
    after = scrape(live)
    total = "strata_requests_total"
    assert delta(after, before, total, endpoint="/v1/chat/completions", status="200") == 2
    assert delta(after, before, total, endpoint="/v1/completions", status="200") == 1
    assert delta(after, before, total, endpoint="/v1/completions", status="400") == 1
    assert delta(after, before, total, endpoint="other", status="404") == 1
    assert delta(after, before, total, endpoint="/v1/models", status="200") == 1
    assert delta(after, before, total, endpoint="/metrics", status="200") == 1  # the first
    assert delta(after, before, "strata_prompt_tokens_total") == sum(
        u["prompt_tokens"] for u in usages)
    assert delta(after, before, "strata_generated_tokens_total") == sum(
        u["completion_tokens"] for u in usages)
    assert delta(after, before, "strata_prompt_tokens_cached_total") == sum(
        u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    assert delta(after, before, "strata_time_to_first_token_seconds_count") == 3
    assert delta(after, before, "strata_time_per_output_token_seconds_count") == sum(
        u["completion_tokens"] - 1 for u in usages)
    assert after[("strata_requests_running", ())] == 0
    assert after[("strata_requests_queued", ())] == 0


def test_metrics_follow_the_parked_conversations(live):
    """The live server has one slot: each new conversation parks the one before it, and the
    first one's next turn restores it."""
    def ask(text):
        body = {"prompt": text, "max_tokens": 2, "temperature": 0}
        reply = requests.post(live.url + "/v1/completions", json=body, timeout=60)
        assert reply.status_code == 200
        return reply.json()["choices"][0]["text"]

    ask(" ".join(f"gamma{i}" for i in range(30)))  # the slot holds a conversation of its own
    before = scrape(live)
    first = " ".join(f"alpha{i}" for i in range(30))
    answer = ask(first)  # parks the gamma conversation
    ask(" ".join(f"beta{i}" for i in range(30)))  # parks the first conversation
    ask(first + answer + " and more")  # restores it, parking the second
    after = scrape(live)
    assert delta(after, before, "strata_conversations_parked_total") == 3
    assert delta(after, before, "strata_conversations_restored_total") == 1
    assert after[("strata_conversation_cache_entries", ())] >= 1
    assert after[("strata_conversation_cache_bytes", ())] > 0
    state = live.state.worker.engine.scheduler.conversations
    assert after[("strata_conversation_cache_budget_bytes", ())] == state.budget_bytes
    assert after[("strata_conversations_evicted_total", ())] == state.num_evicted


def test_each_app_has_its_own_registry(live, live_keyed):
    from conftest import API_KEY

    requests.get(live_keyed.url + "/v1/models", timeout=10,
                 headers={"Authorization": f"Bearer {API_KEY}"})
    text_a = requests.get(live.url + "/metrics", timeout=10).text
    assert "strata_requests_total" in text_a
    assert live.state.metrics.registry is not live_keyed.state.metrics.registry


def test_health_loading_then_ok():
    release = threading.Event()

    class Ready:
        n_ctx = 16

    def load():
        release.wait(10)
        return Ready()

    app = create_app(load, ServerConfig(model_id="m"))
    try:
        client = app.test_client()
        response = client.get("/health")
        assert (response.status_code, response.json) == (503, {"status": "loading"})
        response = client.post("/v1/chat/completions",
                               json={"messages": [{"role": "user", "content": "x"}]})
        assert response.status_code == 503
        assert response.json["error"]["code"] == "model_loading"
        release.set()
        assert app.extensions["strata"].worker.wait_loaded(10)
        response = client.get("/health")
        assert (response.status_code, response.json) == (200, {"status": "ok"})
    finally:
        release.set()
        app.extensions["strata"].close()


def test_health_error_when_the_model_fails_to_load():
    def load():
        raise OSError("model.gguf: truncated")

    app = create_app(load, ServerConfig(model_id="m"))
    try:
        assert app.extensions["strata"].worker.wait_loaded(10)
        client = app.test_client()
        response = client.get("/health")
        assert response.status_code == 503
        assert response.json == {"status": "error", "message": "model.gguf: truncated"}
        response = client.post("/v1/completions", json={"prompt": "x"})
        assert response.status_code == 503
        assert "truncated" in response.json["error"]["message"]
        assert response.json["error"]["type"] == "server_error"
    finally:
        app.extensions["strata"].close()


def test_serve_rejects_a_missing_model(tmp_path):
    result = CliRunner().invoke(serve, ["--model", str(tmp_path / "none.gguf")])
    assert result.exit_code == 2
    assert "does not exist" in result.output


def test_serve_rejects_a_bad_context_size(model_path):
    result = CliRunner().invoke(serve, ["--model", str(model_path), "--ctx-size", "-1"])
    assert result.exit_code == 2  # (0 is the model's whole context, as llama.cpp's -c 0)
    assert "'--ctx-size' / '-c': -1 is not in the range x>=0" in result.output


def test_serve_reports_a_busy_port(model_path):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = CliRunner().invoke(serve, ["--model", str(model_path), "--port", str(port)])
    assert result.exit_code == 2
    assert f"cannot listen on 127.0.0.1:{port}" in result.output


@pytest.mark.parametrize("key", ["", "   "])
def test_serve_rejects_an_empty_api_key(model_path, key):
    result = CliRunner().invoke(serve, ["--model", str(model_path), "--api-key", key])
    assert result.exit_code == 2
    assert "--api-key is empty" in result.output


@pytest.mark.parametrize("alias", ["", " , "])
def test_serve_rejects_an_empty_alias(model_path, alias):
    result = CliRunner().invoke(serve, ["--model", str(model_path), "--alias", alias])
    assert result.exit_code == 2
    assert "--alias is empty" in result.output


def test_aliases_are_listed_and_answered(model_path):
    """Every alias is a model name requests may give (an agent's main and small model); the
    first is the id; any other name gets a 404 that lists them."""
    from conftest import new_engine, start_live_server

    live = start_live_server(new_engine(model_path), ServerConfig(
        model_id="coder", aliases=("claude-haiku-4-5", "coder")))
    try:
        import requests

        models = requests.get(live.url + "/v1/models", timeout=30).json()
        assert [m["id"] for m in models["data"]] == ["coder", "claude-haiku-4-5"]
        assert (models["first_id"], models["last_id"]) == ("coder", "claude-haiku-4-5")
        card = requests.get(live.url + "/v1/models/claude-haiku-4-5", timeout=30).json()
        assert card["id"] == "claude-haiku-4-5"
        for name in ("coder", "claude-haiku-4-5"):
            reply = requests.post(live.url + "/v1/messages", timeout=60, json={
                "model": name, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})
            assert reply.status_code == 200 and reply.json()["model"] == "coder"
        wrong = requests.post(live.url + "/v1/chat/completions", timeout=60, json={
            "model": "gpt-5", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})
        assert wrong.status_code == 404
        assert "'coder' or 'claude-haiku-4-5'" in wrong.json()["error"]["message"]
    finally:
        live.stop()


def test_the_servers_reasoning_budget_closes_an_open_block(model_path):
    """--reasoning-budget 3: a prompt that opens <think> gets the close after 3 tokens."""
    from conftest import new_engine, start_live_server

    live = start_live_server(new_engine(model_path), ServerConfig(reasoning_budget=3))
    try:
        import requests

        engine = live.state.worker.engine
        close = engine.tokenizer.token_id("</think>")
        reply = requests.post(live.url + "/v1/completions", timeout=60, json={
            "prompt": "<|im_start|>assistant\n<think>\n", "max_tokens": 12, "temperature": 0,
            "ignore_eos": True, "logit_bias": {str(close): -100}}).json()
        text = reply["choices"][0]["text"]
        assert "\n</think>\n\n" in text
        before = text[:text.index("\n</think>")]
        assert len(engine.tokenize(before, add_special=False)) <= 3
    finally:
        live.stop()
