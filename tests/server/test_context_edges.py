"""The context's edge on every endpoint: a prompt over it is refused in the words agents match
to compact a conversation; a context that KV grow caps below --ctx-size is the one refused and
told (/v1/models)."""
import re

import pytest
import requests

from strata.config import EngineConfig
from strata.engine.engine import Engine
from strata.server.app import ServerConfig

from conftest import N_CTX_TOKENS
from live_server import start_live_server

# what agents match in an error's message to compact their conversation: LiteLLM (aider),
# opencode, pi and others (OpenAI's and vLLM's wording, and llama-server's)
OVERFLOW_WORDS = [r"This model's maximum context length is (\d+) tokens",
                  r"exceeds the available context size"]
LONG_IDS = [(7 * i) % 3000 + 10 for i in range(N_CTX_TOKENS + 1)]  # one token too many


def post(url, path, body):
    return requests.post(url + path, json=body, timeout=60)


def overflow_error(response, param):
    """The error of a prompt over the context; its message's context size."""
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == param
    message = error["message"]
    for words in OVERFLOW_WORDS:
        assert re.search(words, message), message
    assert "--ctx-size" in message
    return message, int(re.search(OVERFLOW_WORDS[0], message).group(1))


@pytest.mark.parametrize("path,body,param,field", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 600}]},
     "messages", "messages"),
    ("/v1/responses", {"input": "word " * 600}, "input", "input"),
    ("/v1/completions", {"prompt": LONG_IDS}, "prompt", "prompt"),
    ("/v1/completions", {"prompt": ["hi", LONG_IDS]}, "prompt[1]", "prompt"),
    ("/completion", {"prompt": LONG_IDS}, "prompt", "prompt"),
])
def test_a_prompt_over_the_context_is_refused_in_the_words_agents_match(
        live, path, body, param, field):
    message, n_ctx = overflow_error(post(live.url, path, body), param)
    assert n_ctx == N_CTX_TOKENS
    num_tokens = int(re.search(r"resulted in (\d+) tokens", message).group(1))
    assert num_tokens > N_CTX_TOKENS
    if isinstance(body.get("prompt"), list):
        assert num_tokens == len(LONG_IDS)
    assert f"reduce the length of the {field}" in message
    # one token less fits, and the server goes on serving
    ok = post(live.url, "/v1/completions", {"prompt": LONG_IDS[:-1], "max_tokens": 4,
                                            "temperature": 0})
    assert ok.status_code == 200, ok.text
    choice, usage = ok.json()["choices"][0], ok.json()["usage"]
    assert choice["finish_reason"] == "length" and usage["completion_tokens"] == 1


def test_the_anthropic_endpoint_keeps_its_own_words(live):
    response = post(live.url, "/v1/messages", {
        "model": "tiny-server", "max_tokens": 8,
        "messages": [{"role": "user", "content": "word " * 600}]})
    assert response.status_code == 400
    assert re.search(r"prompt is too long: \d+ tokens > 512 maximum",
                     response.json()["error"]["message"])


# ---- --kv-grow: slots that can never grow to n_ctx --------------------------------------
@pytest.fixture(scope="module")
def wide_path(tmp_path_factory):
    """32 experts of width 64 (Q8_0): 25 f32 KV cells an expert-cache slot, so 4 slots lend
    at most 64 cells (whole key tiles)."""
    from strata.tool.synth import synth_model

    path = tmp_path_factory.mktemp("wide") / "tiny-wide.gguf"
    synth_model(path, shape="tiny", weight_type="q8_0", seed=5, routing_skew=1.0, n_experts=32,
                expert_ffn=64)
    return path


@pytest.fixture(scope="module")
def live_capped(wide_path):
    engine = Engine(EngineConfig(wide_path, n_ctx=512, expert_cache=4, adapt_every=0,
                                 kv_grow=24, threads=2))
    server = start_live_server(engine, ServerConfig(model_id="tiny-wide"))
    yield server
    server.stop()


def test_a_context_capped_by_kv_grow_is_the_one_refused_and_told(live_capped):
    url = live_capped.url
    ids = [(7 * i) % 3000 + 10 for i in range(100)]
    # 100 tokens fit --ctx-size 512, but no slot's KV can ever hold them: refused as a prompt
    # over the context (which agents compact on), not as a failed placement
    _, n_ctx = overflow_error(post(url, "/v1/completions", {"prompt": ids}), "prompt")
    assert n_ctx == 64
    model = requests.get(url + "/v1/models", timeout=10).json()["data"][0]
    assert model["max_input_tokens"] == 64
    assert requests.get(url + "/props", timeout=10).json()[
        "default_generation_settings"]["n_ctx"] == 64
    # what fits runs to the context's end
    reply = post(url, "/v1/completions", {"prompt": ids[:60], "temperature": 0,
                                          "ignore_eos": True})
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["finish_reason"] == "length"
    assert reply.json()["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize("n_predict,truncated", [(None, True), (100, True), (2, False)])
def test_completion_says_truncated_when_the_context_cut_it(live, n_predict, truncated):
    """llama.cpp's `truncated`: the answer stopped for want of room in the context, short of
    n_predict (it was always false)."""
    body = {"prompt": LONG_IDS[:N_CTX_TOKENS - 3], "temperature": 0, "ignore_eos": True}
    if n_predict is not None:
        body["n_predict"] = n_predict
    out = post(live.url, "/completion", body)
    assert out.status_code == 200, out.text
    answer = out.json()
    assert answer["truncated"] is truncated and answer["stop_type"] == "limit"
    assert answer["tokens_predicted"] == (2 if n_predict == 2 else 3)


def test_slots_report_the_context_requests_get(live):
    n_ctx = requests.get(live.url + "/props", timeout=30).json()["default_generation_settings"]
    slots = requests.get(live.url + "/slots", timeout=30).json()
    assert all(s["n_ctx"] == n_ctx["n_ctx"] for s in slots)


@pytest.mark.parametrize("path,field", [("/v1/chat/completions", "max_tokens"),
                                        ("/v1/chat/completions", "max_completion_tokens"),
                                        ("/v1/completions", "max_tokens")])
def test_max_tokens_over_the_context_is_clipped_to_it(live, path, field):
    """An agent configured with a large output limit (opencode asks 32000) gets its answer up
    to the context's end, as from llama-server, not a 400 on every turn."""
    body = {field: 32000, "temperature": 0, "ignore_eos": True}
    if path == "/v1/completions":
        body["prompt"] = LONG_IDS[:N_CTX_TOKENS - 4]
    else:
        body["messages"] = [{"role": "user", "content": "word " * 490}]
    out = post(live.url, path, body)
    assert out.status_code == 200, out.text
    answer = out.json()
    usage = answer["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == N_CTX_TOKENS
    assert answer["choices"][0]["finish_reason"] == "length"
