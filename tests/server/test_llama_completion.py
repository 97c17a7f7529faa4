"""llama.cpp's native /completion (and /completions) against a live server on a tiny synth
model: text, token-id and mixed prompts, whole and streamed, `n_probs`, `return_tokens`,
`response_fields`, and bad requests naming the field; each answer equal to what the engine
generates for the same tokens."""
import json

import pytest
import requests

from strata.engine.sampling import SamplingParams

PROMPT = "Colours: red, green,"


def post(live, body, path="/completion"):
    return requests.post(live.url + path, json=body, timeout=60)


def engine_events(engine, tokens, max_tokens, **params):
    engine.reset()
    return list(engine.generate(tokens, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                       **params)))


def test_a_text_prompt_equals_the_engine(live, reference):
    tokens = reference.tokenize(PROMPT, add_special=True)
    events = engine_events(reference, tokens, 8)
    for path in ("/completion", "/completions"):
        reply = post(live, {"prompt": PROMPT, "n_predict": 8, "temperature": 0}, path)
        assert reply.status_code == 200, reply.text
        out = reply.json()
        assert out["content"] == "".join(e.text for e in events)
        assert out["stop"] is True and out["prompt"] == PROMPT
        assert out["tokens_predicted"] == len(events)
        assert out["tokens_evaluated"] == len(tokens)
        assert out["stop_type"] == {"length": "limit", "stop": "eos"}[events[-1].finish_reason]
        assert out["timings"]["predicted_n"] == len(events)
        assert "completion_probabilities" not in out


def test_token_and_mixed_prompts(live, reference):
    head = reference.tokenize("Colours:", add_special=True)
    tail = reference.tokenize(" red, green,", add_special=False)
    events = engine_events(reference, head + tail, 6)
    want = "".join(e.text for e in events)
    for prompt in (head + tail, ["Colours:", *tail], [head + tail],
                   {"prompt_string": ["Colours:", *tail]}):
        out = post(live, {"prompt": prompt, "n_predict": 6, "temperature": 0}).json()
        assert out["content"] == want, prompt
        assert out["tokens_evaluated"] == len(head + tail)


def test_a_list_of_prompts_is_refused_and_a_list_of_one_is_that_prompt(live):
    """llama.cpp reads an array without a token id at its top as a list of prompts: two
    strings are two prompts (they were answered as one, their concatenation); one is that
    prompt, as is llama.cpp's {"prompt_string": ...}."""
    body = {"n_predict": 4, "temperature": 0}
    reply = post(live, dict(body, prompt=["Colours:", " red, green,"]))
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "prompt" and "several prompts (2" in error["message"]
    want = post(live, dict(body, prompt=PROMPT)).json()["content"]
    for prompt in ([PROMPT], {"prompt_string": PROMPT}, [{"prompt_string": PROMPT}]):
        reply = post(live, dict(body, prompt=prompt))
        assert reply.status_code == 200, (prompt, reply.text)
        assert reply.json()["content"] == want and reply.json()["prompt"] == PROMPT
    reply = post(live, dict(body, prompt={"prompt_string": PROMPT, "multimodal_data": ["x"]}))
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "prompt.multimodal_data"


def test_llama_cpp_spellings_of_seed_temperature_and_logit_bias(live, reference):
    """What llama.cpp's front ends send: `seed` -1 (or 4294967295) for a random seed, a
    negative `temperature` for greedy, `logit_bias` as [[token, bias]] pairs (a token by id or
    by text, false: banned) or an object keyed by text; each was a 400."""
    tokens = reference.tokenize(PROMPT, add_special=True)
    first = engine_events(reference, tokens, 1)[0].token_id
    text_ids = reference.tokenizer.encode_plain(" blue")
    banned = {first: -100.0, **{t: -100.0 for t in text_ids}}
    want = "".join(e.text for e in engine_events(reference, tokens, 6, logit_bias=banned))
    for bias in ([[first, False], [" blue", False]], {str(first): False, " blue": -100}):
        reply = post(live, {"prompt": PROMPT, "n_predict": 6, "temperature": -1, "seed": -1,
                            "logit_bias": bias})
        assert reply.status_code == 200, (bias, reply.text)
        assert reply.json()["content"] == want
        assert reply.json()["generation_settings"]["logit_bias"] == [
            {"bias": -100.0, "token": t} for t in sorted(banned)]
    sampled = {"prompt": PROMPT, "n_predict": 6, "temperature": 1.0}
    for seed in (-1, 2**32 - 1):
        assert post(live, dict(sampled, seed=seed)).status_code == 200
    for bias, param in (([[first]], "logit_bias[0]"), ([[first, True]], "logit_bias[0][1]"),
                        ([[-3, 1]], "logit_bias[0][0]"), ([[None, 1]], "logit_bias[0][0]"),
                        ({"": 1}, "logit_bias.")):
        reply = post(live, {"prompt": PROMPT, "logit_bias": bias})
        assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text


def test_generation_settings_as_llama_cpp_names_them(live):
    """The answer's `generation_settings` (llama.cpp's own response_fields example names
    "generation_settings/n_predict"; it was left out)."""
    out = post(live, {"prompt": PROMPT, "n_predict": 3, "temperature": 0, "top_k": 5,
                      "stop": ["zz"], "n_probs": 2}).json()
    settings = out["generation_settings"]
    assert (settings["n_predict"], settings["temperature"], settings["top_k"],
            settings["stop"], settings["n_probs"]) == (3, 0.0, 5, ["zz"], 2)
    picked = post(live, {"prompt": PROMPT, "n_predict": 3, "response_fields":
                         ["content", "generation_settings/n_predict"]}).json()
    assert set(picked) == {"content", "generation_settings/n_predict"}
    assert picked["generation_settings/n_predict"] == 3
    assert post(live, {"prompt": PROMPT}).json()["generation_settings"]["n_predict"] == -1


def test_stream_pieces_make_the_content(live):
    body = {"prompt": PROMPT, "n_predict": 10, "temperature": 0}
    whole = post(live, body).json()
    response = requests.post(live.url + "/completion", json=dict(body, stream=True),
                             timeout=60, stream=True)
    lines = [line for line in response.iter_lines(decode_unicode=True) if line]
    assert "data: [DONE]" not in lines  # llama-server's stream ends with its last chunk
    chunks = [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: {")]
    assert "".join(c["content"] for c in chunks) == whole["content"]
    assert [c["stop"] for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1]["tokens_predicted"] == whole["tokens_predicted"]
    # as llama.cpp's, a stream's pieces carry their token ids without return_tokens
    ids = [t for c in chunks for t in c["tokens"]]
    assert len(ids) == whole["tokens_predicted"] and whole["tokens"] == []
    assert post(live, dict(body, return_tokens=True)).json()["tokens"] == ids


def test_n_probs_and_return_tokens(live, reference):
    tokens = reference.tokenize(PROMPT, add_special=True)
    events = engine_events(reference, tokens, 5, logprobs=2)
    out = post(live, {"prompt": PROMPT, "n_predict": 5, "temperature": 0, "n_probs": 2,
                      "return_tokens": True}).json()
    assert out["tokens"] == [e.token_id for e in events]
    probs = out["completion_probabilities"]
    wanted = [e for e in events if e.logprob is not None]
    assert [p["id"] for p in probs] == [e.token_id for e in wanted]
    for p, event in zip(probs, wanted):
        assert p["logprob"] == pytest.approx(event.logprob.logprob, abs=1e-6)
        assert [t["id"] for t in p["top_logprobs"]] == [t for t, _ in event.logprob.top]
        assert p["token"] == reference.tokenizer.token_bytes(p["id"]).decode(
            "utf-8", errors="replace")
    # streamed: the same entries and ids, piece by piece
    response = requests.post(live.url + "/completion", timeout=60, stream=True, json={
        "prompt": PROMPT, "n_predict": 5, "temperature": 0, "n_probs": 2, "stream": True,
        "return_tokens": True})
    chunks = [json.loads(line[len("data: "):]) for line in
              response.iter_lines(decode_unicode=True) if line.startswith("data: {")]
    assert [p for c in chunks for p in c.get("completion_probabilities", [])] == probs
    assert [t for c in chunks for t in c["tokens"]] == out["tokens"]


def test_response_fields(live):
    out = post(live, {"prompt": PROMPT, "n_predict": 2,
                      "response_fields": ["content", "timings/predicted_n"]}).json()
    assert set(out) == {"content", "timings/predicted_n"} and out["timings/predicted_n"] == 2


@pytest.mark.parametrize("body,param,words", [
    ({}, "prompt", ["'prompt' is required"]),
    ({"prompt": ["a", ["b"]]}, "prompt", ["several prompts"]),
    ({"prompt": ["a", 1.5]}, "prompt[1]", ["a string or a token id"]),
    ({"prompt": [1, 10**7]}, "prompt", ["10000000", "vocabulary"]),
    ({"prompt": 5}, "prompt", ["a string or an array"]),
    ({"prompt": []}, "prompt", ["empty"]),
    ({"prompt": "x", "n_probs": 21}, "n_probs", ["21", "[0, 20]"]),
    ({"prompt": "x", "n_predict": -2}, "n_predict", ["-2"]),
    ({"prompt": " ".join(["word"] * 600)}, "prompt", ["512"]),
])
def test_bad_requests_name_the_field(live, body, param, words):
    reply = post(live, body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param
    assert all(w in error["message"] for w in words), error["message"]
    assert post(live, {"prompt": "still serving", "n_predict": 1}).status_code == 200


def test_a_grammar_holds_the_answer(live, reference):
    """`grammar` (GBNF) on /completion and on the chat endpoint: the answer follows it and
    equals the engine's own run held to it; a fault is a 400 naming its line and column."""
    import re

    gbnf = 'root ::= " " [0-9]{1,3} ("%" | " apples")'
    think = reference.tokenizer.token_id("<think>")  # random weights would think on
    tokens = reference.tokenize(PROMPT, add_special=True)
    events = engine_events(reference, tokens, 32, grammar=gbnf, logit_bias={think: -100})
    reply = post(live, {"prompt": PROMPT, "n_predict": 32, "temperature": 0, "grammar": gbnf,
                        "logit_bias": {str(think): -100}})
    assert reply.status_code == 200, reply.text
    out = reply.json()
    assert out["content"] == "".join(e.text for e in events)
    assert re.fullmatch(r" [0-9]{1,3}(?:%| apples)", out["content"]), out["content"]
    assert out["stop_type"] == "eos"
    chat = post(live, {"messages": [{"role": "user", "content": "How many?"}],
                       "max_tokens": 32, "temperature": 0, "grammar": gbnf,
                       "logit_bias": {str(think): -100}}, "/v1/chat/completions")
    assert chat.status_code == 200, chat.text
    content = chat.json()["choices"][0]["message"]["content"]
    assert re.fullmatch(r" [0-9]{1,3}(?:%| apples)", content), content
    bad = post(live, {"prompt": PROMPT, "grammar": 'root ::= " " [0-9'})
    assert bad.status_code == 400
    err = bad.json()["error"]
    assert err["param"] == "grammar" and "not closed at line 1, column 14" in err["message"]
    unknown = post(live, {"prompt": PROMPT, "grammar": 'root ::= <nope> "a"'})
    assert unknown.status_code == 400  # a token item that is not one token of the vocabulary
    assert "<nope> is not one token" in unknown.json()["error"]["message"]
    assert post(live, {"prompt": PROMPT, "n_predict": 2}).status_code == 200  # still serving


def test_a_json_schema_holds_the_answer(live, reference):
    """llama.cpp's `json_schema` on /completion: the answer is a JSON object following it,
    equal to the engine's run held to it; a schema that is not an object's is refused."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    think = reference.tokenizer.token_id("<think>")
    tokens = reference.tokenize(PROMPT, add_special=True)
    events = engine_events(reference, tokens, 48, json_object=True, json_schema=schema,
                           logit_bias={think: -100})
    reply = post(live, {"prompt": PROMPT, "n_predict": 48, "temperature": 0,
                        "json_schema": schema, "logit_bias": {str(think): -100}})
    assert reply.status_code == 200, reply.text
    content = reply.json()["content"]
    assert content == "".join(e.text for e in events)
    assert json.loads(content) in ({"ok": True}, {"ok": False}), content
    for body, words in (({"json_schema": {"type": "array"}}, "of type 'object'"),
                        ({"json_schema": "x"}, "must be a JSON schema"),
                        ({"json_schema": {}, "grammar": 'root ::= "a"'}, "send one of them")):
        bad = post(live, dict(body, prompt=PROMPT))
        assert bad.status_code == 400 and words in bad.json()["error"]["message"], bad.text


def test_tokens_cached_is_what_the_slot_keeps(live):
    # llama.cpp's n_past: the slot's KV after the answer (the last token not read back); it
    # counted that token too, n_ctx + 1 for a prompt that filled the context
    out = post(live, {"prompt": PROMPT, "n_predict": 6, "temperature": 0}).json()
    slots = requests.get(live.url + "/slots", timeout=30).json()
    assert out["tokens_cached"] in [s["n_kv_tokens"] for s in slots]
    assert out["tokens_cached"] == out["tokens_evaluated"] + out["tokens_predicted"] - 1
