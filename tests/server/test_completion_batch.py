"""OpenAI's batch of prompts on /v1/completions (`prompt` as an array of strings, or of arrays
of token ids, as lm-evaluation-harness's `local-completions` sends them): each prompt gets its
own `n` choices, indexed prompt * n + choice, each equal to what that prompt alone is answered;
the usage counts every prompt once."""
import json

import openai
import pytest
import requests

from strata.engine.sampling import SamplingParams

COMPLETIONS = "/v1/completions"
MODEL_ID = "tiny-server"
SAMPLED = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0}


def post(live, body):
    return requests.post(live.url + COMPLETIONS, json=body, timeout=60)


def engine_answer(engine, tokens, max_tokens, **params):
    engine.reset()
    events = list(engine.generate(tokens, SamplingParams(max_tokens=max_tokens, **params)))
    return "".join(e.text for e in events), len(events)


@pytest.fixture(scope="module")
def client(live):
    with openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0,
                       timeout=60) as client:
        yield client


def test_a_batch_of_texts_is_answered_prompt_by_prompt(client, reference):
    texts = ["Once upon a time", "The capital of"]
    tokens = [reference.tokenize(t) for t in texts]
    want = [engine_answer(reference, t, 5, temperature=0) for t in tokens]
    reply = client.completions.create(model=MODEL_ID, prompt=texts, max_tokens=5,
                                      temperature=0)
    assert [(c.index, c.text) for c in reply.choices] == [(0, want[0][0]), (1, want[1][0])]
    assert reply.usage.prompt_tokens == sum(len(t) for t in tokens)
    assert reply.usage.completion_tokens == want[0][1] + want[1][1]


def test_a_batch_of_token_arrays_with_echo_and_logprobs(client, reference):
    """lm-evaluation-harness's loglikelihood request: token arrays, echo, logprobs 1."""
    batch = [[11, 12, 13, 14], [21, 22, 23]]
    reply = client.completions.create(model=MODEL_ID, prompt=batch, max_tokens=1,
                                      temperature=0, logprobs=1, echo=True)
    assert [c.index for c in reply.choices] == [0, 1]
    for prompt, choice in zip(batch, reply.choices):
        alone = client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=1,
                                          temperature=0, logprobs=1, echo=True)
        assert choice.text == alone.choices[0].text
        assert choice.text.startswith(reference.tokenizer.decode(prompt))
        assert choice.logprobs.tokens == alone.choices[0].logprobs.tokens
        assert choice.logprobs.text_offset == alone.choices[0].logprobs.text_offset
        assert len(choice.logprobs.token_logprobs) == len(prompt) + 1
        assert choice.logprobs.token_logprobs[0] is None
    # one prompt as an array of one token array is that prompt
    one = client.completions.create(model=MODEL_ID, prompt=[batch[1]], max_tokens=1,
                                    temperature=0, logprobs=1, echo=True)
    assert one.choices[0].text == reply.choices[1].text
    assert one.usage.prompt_tokens == len(batch[1])
    assert reply.usage.prompt_tokens == 7


def test_each_prompt_has_its_n_seeded_choices(live, reference):
    batch = [[5, 6, 7], [8, 9]]
    want = [engine_answer(reference, p, 6, seed=40 + j, **SAMPLED)[0]
            for p in batch for j in range(2)]
    reply = post(live, {"prompt": batch, "max_tokens": 6, "n": 2, "seed": 40, **SAMPLED})
    assert reply.status_code == 200, reply.text
    choices = reply.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert [c["text"] for c in choices] == want


def test_best_of_ranks_each_prompts_candidates(live):
    batch = [[5, 6, 7], [8, 9]]
    body = {"prompt": batch, "max_tokens": 6, "seed": 40, **SAMPLED}
    ranked = post(live, dict(body, n=1, best_of=3)).json()
    assert [c["index"] for c in ranked["choices"]] == [0, 1]
    for i, prompt in enumerate(batch):  # the best of the prompt's own three
        alone = post(live, dict(body, prompt=prompt, n=1, best_of=3)).json()
        assert ranked["choices"][i]["text"] == alone["choices"][0]["text"]
    assert ranked["usage"]["prompt_tokens"] == 5


def test_a_streamed_batch_tags_each_chunk_with_its_choice(live, reference):
    texts = ["Once upon a time", "The capital of"]
    want = [engine_answer(reference, reference.tokenize(t), 4, temperature=0)[0]
            for t in texts]
    response = requests.post(live.url + COMPLETIONS, timeout=60, stream=True, json={
        "prompt": texts, "max_tokens": 4, "temperature": 0, "stream": True, "echo": True,
        "stream_options": {"include_usage": True}})
    assert response.status_code == 200, response.text
    chunks = [json.loads(line[len("data: "):])
              for line in response.iter_lines(decode_unicode=True)
              if line.startswith("data: {")]
    texts_by_index = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            texts_by_index[choice["index"]] = texts_by_index.get(choice["index"], "") + \
                choice["text"]
    assert texts_by_index == {0: texts[0] + want[0], 1: texts[1] + want[1]}
    assert chunks[-1]["usage"]["prompt_tokens"] == sum(len(reference.tokenize(t))
                                                       for t in texts)


@pytest.mark.parametrize("prompt,param,words", [
    (["a", ""], "prompt[1]", ["'prompt[1]' is empty"]),
    ([[1, 2], []], "prompt[1]", ["'prompt[1]' is empty"]),
    ([[1, 2], [3, "x"]], "prompt[1]", ["'prompt[1]'", "array of token ids"]),
    ([[1, 2], [3, 10**6]], "prompt[1]", ["'prompt[1]'", "1000000", "vocabulary"]),
    (["a", 5], "prompt", ["'prompt'", "array of token ids"]),
    ([], "prompt", ["'prompt' is empty"]),
])
def test_a_bad_prompt_of_a_batch_is_named(live, prompt, param, words):
    response = post(live, {"prompt": prompt, "max_tokens": 2})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    for word in words:
        assert word in error["message"], error["message"]


def test_a_batch_asking_too_many_answers_is_refused(live):
    response = post(live, {"prompt": ["a"] * 20, "n": 8, "max_tokens": 2})
    assert response.status_code == 400, response.text
    assert "at most 128 answers" in response.json()["error"]["message"]
