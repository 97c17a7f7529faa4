"""llama.cpp's endpoints as its clients expect them: repeat_penalty's window of 64 tokens by
default, post_sampling_probs' figures and field names."""
import json
import math

import requests

from strata.engine.sampling import SamplingParams

PROMPT = "The quick brown fox jumps over the lazy dog. " * 3 + "Once upon a time " * 12


def post(live, path, **body):
    reply = requests.post(live.url + path, json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()


def reference_ids(engine, tokens, **params) -> list[int]:
    engine.reset()
    return [e.token_id for e in engine.generate(tokens, SamplingParams(temperature=0,
                                                                       **params))]


def test_repeat_penalty_looks_back_64_tokens_by_default(live, reference):
    tokens = reference.tokenize(PROMPT)
    assert len(tokens) > 64  # tokens seen only before the window are not penalised
    windowed = reference_ids(reference, tokens, max_tokens=16, repetition_penalty=1.5,
                             repeat_last_n=64)
    assert windowed != reference_ids(reference, tokens, max_tokens=16,
                                     repetition_penalty=1.5)  # the window matters here
    reply = post(live, "/completion", prompt=tokens, n_predict=16, temperature=0,
                 repeat_penalty=1.5, return_tokens=True)
    assert reply["tokens"] == windowed
    assert reply["generation_settings"]["repeat_last_n"] == 64
    whole = post(live, "/completion", prompt=tokens, n_predict=16, temperature=0,
                 repeat_penalty=1.5, repeat_last_n=-1, return_tokens=True)
    assert whole["generation_settings"]["repeat_last_n"] == -1 and whole["tokens"] != windowed


def test_props_show_the_default_window(live):
    props = requests.get(live.url + "/props", timeout=60).json()
    assert props["default_generation_settings"]["params"]["repeat_last_n"] == 64


def test_the_openai_endpoints_penalise_every_token(live, reference):
    tokens = reference.tokenize(PROMPT)
    reply = post(live, "/v1/completions", prompt=tokens, max_tokens=16, temperature=0,
                 repetition_penalty=1.5)
    reference.reset()
    events = list(reference.generate(tokens, SamplingParams(
        temperature=0, max_tokens=16, repetition_penalty=1.5)))
    assert reply["choices"][0]["text"] == "".join(e.text for e in events)


def probability_entries(live, **body) -> list[dict]:
    body = dict(dict(prompt=PROMPT, n_predict=6, n_probs=3, post_sampling_probs=True), **body)
    return post(live, "/completion", **body)["completion_probabilities"]


def test_post_sampling_probs_of_a_greedy_pick(live):
    entries = probability_entries(live, temperature=0)
    assert len(entries) == 6
    for entry in entries:
        assert list(entry) == ["id", "token", "bytes", "prob", "top_probs"]
        assert entry["prob"] == 1.0  # the chain left the greedy pick alone
        assert entry["top_probs"] == [{k: entry[k] for k in ("id", "token", "bytes", "prob")}]


def test_post_sampling_probs_stream_in_each_piece(live):
    body = dict(prompt=PROMPT, n_predict=4, n_probs=2, post_sampling_probs=True,
                temperature=0, stream=True)
    with requests.post(live.url + "/completion", json=body, timeout=60) as reply:
        chunks = [json.loads(line[len("data: "):]) for line in reply.iter_lines(
            decode_unicode=True) if line.startswith("data: ")]
    entries = [e for c in chunks for e in c.get("completion_probabilities", [])]
    assert len(entries) == 4
    assert all(e["prob"] == 1.0 and "logprob" not in e for e in entries)


def test_post_sampling_probs_false_keeps_log_probabilities(live):
    entries = probability_entries(live, temperature=0, post_sampling_probs=False)
    assert all(math.isfinite(e["logprob"]) and "prob" not in e and len(e["top_logprobs"]) == 3
               for e in entries)


def test_post_sampling_probs_must_be_a_boolean(live):
    reply = requests.post(live.url + "/completion", json=dict(
        prompt="hi", n_probs=1, post_sampling_probs="yes"), timeout=60)
    assert reply.status_code == 400 and "post_sampling_probs" in reply.text
