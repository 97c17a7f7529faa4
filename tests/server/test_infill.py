"""Code completion against a live server on a tiny synth model with Qwen's FIM tokens:
llama.cpp's /infill (whole and streamed, its limits and fields) and OpenAI's `suffix`, each
equal to what the engine generates for the same fill-in-the-middle prompt."""
import json

import openai
import pytest
import requests
from hypothesis import given, settings
from hypothesis import strategies as st

from strata.config import EngineConfig
from strata.engine.engine import Engine
from strata.engine.sampling import SamplingParams
from strata.model.fim import InfillText, build_infill
from strata.server.app import ServerConfig
from strata.server.line_limits import LineLimits

from conftest import start_live_server

N_CTX_TOKENS = 512
FIM_VOCAB = 4160  # the synth tokenizer's 4096 tokens, Qwen's six FIM tokens, padding
PREFIX = "def area(r):\n    "
SUFFIX = "\n\nprint(area(2))\n"
EXTRA = [{"filename": "util.py", "text": "import math\n"}]


@pytest.fixture(scope="module")
def fim_model(tmp_path_factory):
    from strata.tool.synth import synth_model

    path = tmp_path_factory.mktemp("models") / "tiny-fim.gguf"
    synth_model(path, shape="tiny", weight_type="f32", seed=7, vocab=FIM_VOCAB)
    return path


@pytest.fixture(scope="module")
def fim_server(fim_model):
    server = start_live_server(Engine(EngineConfig(fim_model, n_ctx=N_CTX_TOKENS, threads=2)),
                               ServerConfig(model_id="tiny-fim", keepalive_s=0.2))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def fim_reference(fim_model):
    engine = Engine(EngineConfig(fim_model, n_ctx=N_CTX_TOKENS, threads=2))
    yield engine
    engine.close()


def reference_infill(engine, text: InfillText, max_tokens: int, **params):
    """(prompt tokens, the generated events) for `text`, greedy."""
    engine.reset()
    fim = engine.tokenizer.fim
    tokens = build_infill(engine.tokenizer, fim, text).tokens
    events = list(engine.generate(tokens, SamplingParams(
        temperature=0, max_tokens=max_tokens, stop_token_ids=sorted(fim.ids), **params)))
    return tokens, events


def infill(server, body, **kwargs):
    return requests.post(server.url + "/infill", json=body, timeout=60, **kwargs)


def sse_events(response):
    frames = response.text.split("\n\n")
    assert frames[-1] == ""
    assert all(f.startswith("data: ") for f in frames[:-1]), frames
    return [json.loads(f[len("data: "):]) for f in frames[:-1]]


def test_infill_equals_the_engine(fim_server, fim_reference):
    tokens, events = reference_infill(
        fim_reference, InfillText(PREFIX, SUFFIX, extra=[("util.py", "import math\n")]), 10)
    reply = infill(fim_server, {"input_prefix": PREFIX, "input_suffix": SUFFIX,
                                "input_extra": EXTRA, "n_predict": 10, "temperature": 0})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["content"] == "".join(e.text for e in events)
    assert (body["tokens_predicted"], body["tokens_evaluated"]) == (len(events), len(tokens))
    assert (body["stop"], body["stop_type"], body["truncated"]) == (True, "limit", False)
    assert body["model"] == "tiny-fim"
    timings = body["timings"]
    assert timings["predicted_n"] == len(events) and 0 < timings["prompt_n"] <= len(tokens)
    assert body["tokens_cached"] == len(tokens) + len(events) - 1  # the last is not read back


def test_streamed_infill_equals_the_whole_answer(fim_server, fim_reference):
    _, events = reference_infill(fim_reference, InfillText(PREFIX, SUFFIX, "re"), 8)
    reply = infill(fim_server, {"input_prefix": PREFIX, "input_suffix": SUFFIX, "prompt": "re",
                                "n_predict": 8, "temperature": 0, "stream": True})
    frames = sse_events(reply)
    assert [f["stop"] for f in frames] == [False] * (len(frames) - 1) + [True]
    assert "".join(f["content"] for f in frames) == "".join(e.text for e in events)
    assert frames[-1]["tokens_predicted"] == len(events) and frames[-1]["stop_type"] == "limit"
    # the ids: in every piece of a stream, and with return_tokens (it was ignored here)
    assert [t for f in frames for t in f["tokens"]] == [e.token_id for e in events]
    whole = infill(fim_server, {"input_prefix": PREFIX, "input_suffix": SUFFIX, "prompt": "re",
                                "n_predict": 8, "temperature": 0, "return_tokens": True})
    assert whole.json()["tokens"] == [e.token_id for e in events]


def test_a_fim_token_ends_the_middle(fim_server, fim_reference):
    pad = fim_reference.tokenizer.fim.pad
    reply = infill(fim_server, {"input_prefix": PREFIX, "n_predict": 8, "temperature": 0,
                                "logit_bias": {str(pad): 100}}).json()
    assert (reply["content"], reply["stop_type"]) == ("", "eos")


def test_a_stop_string_is_a_word_stop(fim_server, fim_reference):
    _, events = reference_infill(fim_reference, InfillText(PREFIX, SUFFIX), 12)
    text = "".join(e.text for e in events)
    word = text[3:6]
    reply = infill(fim_server, {"input_prefix": PREFIX, "input_suffix": SUFFIX,
                                "n_predict": 12, "temperature": 0, "stop": [word]}).json()
    assert (reply["content"], reply["stop_type"], reply["stopping_word"]) == (
        text[:text.index(word)], "word", word)


def test_openai_suffix_is_a_fill_in_the_middle_completion(fim_server, fim_reference):
    tokens, events = reference_infill(fim_reference, InfillText(PREFIX, SUFFIX), 9)
    with openai.OpenAI(base_url=fim_server.url + "/v1", api_key="unused",
                       max_retries=0) as client:
        reply = client.completions.create(model="tiny-fim", prompt=PREFIX, suffix=SUFFIX,
                                          max_tokens=9, temperature=0)
    assert reply.choices[0].text == "".join(e.text for e in events)
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(tokens),
                                                                          len(events))


def _cut_by_indent(events, min_indent):
    """(the text LineLimits lets through, the index of the event that ended it or None)."""
    limits = LineLimits(min_indent=min_indent)
    out = []
    for i, event in enumerate(events):
        out.append(limits.feed(event.text))
        if limits.is_cut:
            return "".join(out), i
    return "".join(out), None


def test_n_indent_ends_the_block(fim_server, fim_reference):
    newline = fim_reference.tokenizer.encode("\n")[0]
    for bias in (3.0, 2.5, 3.5, 2.0):  # favour line breaks until a line starts unindented
        _, events = reference_infill(fim_reference, InfillText(PREFIX, SUFFIX), 24,
                                     logit_bias={newline: bias})
        expected, cut_at = _cut_by_indent(events, 1)
        if cut_at is not None:
            break
    assert cut_at is not None, "no bias made this model write an unindented line"
    reply = infill(fim_server, {"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_indent": 1,
                                "n_predict": 24, "temperature": 0,
                                "logit_bias": {str(newline): bias}}).json()
    assert (reply["content"], reply["stop_type"]) == (expected, "limit")
    assert reply["has_new_line"] and reply["tokens_predicted"] == cut_at + 1 < 24


def test_a_warm_up_reads_the_files_and_the_next_completion_reuses_them(fim_server):
    body = {"input_prefix": "x = 1\n" * 30, "input_suffix": "", "input_extra": EXTRA * 3}
    warm = infill(fim_server, dict(body, n_predict=0)).json()
    assert (warm["content"], warm["tokens_predicted"], warm["stop_type"]) == ("", 0, "limit")
    again = infill(fim_server, dict(body, n_predict=2, temperature=0)).json()
    assert again["tokens_evaluated"] == warm["tokens_evaluated"]
    assert again["timings"]["prompt_n"] <= 2  # everything read before is reused


def test_a_long_file_is_cut_to_fit(fim_server, caplog):
    prefix = "".join(f"value_{i} = {i}\n" for i in range(400))
    with caplog.at_level("INFO", logger="strata.server"):
        reply = infill(fim_server, {"input_prefix": prefix, "input_suffix": "end()\n" * 100,
                                    "input_extra": EXTRA, "n_predict": 16, "temperature": 0})
    body = reply.json()
    assert reply.status_code == 200 and body["truncated"] is True
    assert body["tokens_evaluated"] <= N_CTX_TOKENS - 16
    assert f"cut to {body['tokens_evaluated']} prompt tokens to leave 16 for the middle" in (
        caplog.text)


def test_response_fields_pick_nested_ones_by_path(fim_server):
    reply = infill(fim_server, {"input_prefix": "a", "n_predict": 2, "response_fields": [
        "content", "timings/prompt_n", "truncated", "no_such_field", "timings/nope"]}).json()
    assert list(reply) == ["content", "timings/prompt_n", "truncated"]


def test_a_model_without_fim_tokens_says_so(live):
    reply = requests.post(live.url + "/infill", json={"input_prefix": "a"}, timeout=30)
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["code"] == "model_not_supported"
    assert error["param"] == "input_prefix" and "<|fim_prefix|>" in error["message"]
    reply = requests.post(live.url + "/v1/completions", json={"prompt": "a", "suffix": "b"},
                          timeout=30)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "suffix"


@pytest.mark.parametrize("body,param,words", [
    ({"input_prefix": 5}, "input_prefix", ["a string"]),
    ({"input_extra": "x"}, "input_extra", ["an array"]),
    ({"input_extra": [{"filename": "a"}]}, "input_extra[0].text", ["a string"]),
    ({"input_extra": [{"text": "a", "filename": 3}]}, "input_extra[0].filename", ["string"]),
    ({"n_indent": -1}, "n_indent", ["-1"]),
    ({"n_predict": -2}, "n_predict", ["-2"]),
    ({"t_max_predict_ms": "5"}, "t_max_predict_ms", ["an integer"]),
    ({"response_fields": "content"}, "response_fields", ["array of field names"]),
    ({"repeat_penalty": 0}, "repeat_penalty", ["range"]),
    ({"prompt": " word" * 600}, "prompt", ["does not fit", "--ctx-size"]),
    ({"model": "other"}, "model", ["tiny-fim"]),
])
def test_bad_infill_requests_name_the_field(fim_server, body, param, words):
    reply = infill(fim_server, body)
    assert 400 <= reply.status_code < 500
    error = reply.json()["error"]
    assert error["param"] == param
    assert all(w in error["message"] for w in words), error["message"]


def test_a_suffix_needs_a_text_prompt(fim_server):
    reply = requests.post(fim_server.url + "/v1/completions",
                          json={"prompt": [1, 2], "suffix": "b"}, timeout=30)
    assert reply.status_code == 400 and "as text" in reply.json()["error"]["message"]


json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.text(max_size=4))
infill_body = st.fixed_dictionaries({}, optional={
    "input_prefix": st.one_of(st.text(max_size=40), json_scalars),
    "input_suffix": st.one_of(st.text(max_size=40), json_scalars),
    "prompt": st.one_of(st.text(max_size=8), json_scalars),
    "input_extra": st.one_of(st.lists(st.fixed_dictionaries({}, optional={
        "filename": json_scalars, "text": st.one_of(st.text(max_size=20), json_scalars)}),
        max_size=3), json_scalars),
    "n_predict": st.one_of(st.integers(-2, 4), json_scalars),
    "n_indent": st.one_of(st.integers(-1, 4), json_scalars),
    "t_max_predict_ms": st.one_of(st.integers(-1, 50), json_scalars),
    "stream": st.one_of(st.booleans(), json_scalars),
    "response_fields": st.one_of(st.lists(st.sampled_from(
        ["content", "timings/prompt_n", "stop", "x/y"]), max_size=3), json_scalars),
    "temperature": st.one_of(st.floats(0, 2), json_scalars),
})


@settings(max_examples=80, deadline=None, derandomize=True)
@given(body=infill_body)
def test_random_infill_requests_never_get_a_5xx(fim_server, body):
    if not isinstance(body.get("n_predict"), int) or body["n_predict"] < 0:
        body["max_tokens"] = 3  # keep each example short
    reply = infill(fim_server, body)
    assert reply.status_code < 500, (body, reply.text)
    if reply.status_code >= 400:
        assert reply.json()["error"]["message"]
    elif body.get("stream") is True:
        frames = sse_events(reply)
        assert frames[-1].get("stop") is True, frames[-1]


# What llama.vscode sends (its completion and its ring-buffer warm-up), field for field.
VSCODE_FIELDS = ["content", "timings/prompt_n", "timings/prompt_ms", "timings/prompt_per_second",
                 "timings/predicted_n", "timings/predicted_ms", "timings/predicted_per_second",
                 "truncated", "tokens_cached"]


def test_an_editor_plugins_requests(fim_server):
    chunks = [{"text": "import os\nimport sys\n", "time": 1733000000.5, "filename": "a.py"},
              {"text": "def helper():\n    pass\n", "time": 1733000001.25, "filename": "b.py"}]
    warm = infill(fim_server, {"input_extra": chunks, "input_prefix": "", "input_suffix": "",
                               "n_predict": 0, "samplers": [], "cache_prompt": True,
                               "t_max_prompt_ms": 1, "response_fields": []})
    assert warm.status_code == 200 and warm.json()["content"] == ""  # [] names every field
    reply = infill(fim_server, {
        "input_prefix": "def main():\n    ", "input_suffix": "\n\nif __name__ == '__main__':\n",
        "input_extra": chunks, "prompt": "    ", "n_predict": 16, "top_k": 40, "top_p": 0.99,
        "stream": False, "n_indent": 4, "samplers": ["top_k", "top_p", "infill"],
        "cache_prompt": True, "t_max_prompt_ms": 500, "t_max_predict_ms": 1000,
        "response_fields": VSCODE_FIELDS})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert list(body) == VSCODE_FIELDS
    assert body["timings/predicted_n"] <= 16 and body["truncated"] is False
    # the files were read by the warm-up: only the current file's part is read now
    assert body["timings/prompt_n"] < body["tokens_cached"] - len(chunks) * 8
