"""`n` answers to one prompt on /v1/chat/completions and /v1/completions: each choice is a
request of its own to the engine (seeded choices take the request's seed + their index), whole
and streamed, with the usage of the whole request."""
import json

import openai
import requests

from strata.engine.sampling import SamplingParams

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "Name three colours."}]
SAMPLED = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0}


def post(live, path, body):
    response = requests.post(live.url + path, json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def stream(live, path, body):
    response = requests.post(live.url + path, json=dict(body, stream=True), timeout=60,
                             stream=True)
    assert response.status_code == 200, response.text
    return [json.loads(line[len("data: "):]) for line in response.iter_lines(decode_unicode=True)
            if line.startswith("data: {")]


def engine_text(engine, tokens, max_tokens, **params):
    engine.reset()
    events = list(engine.generate(tokens, SamplingParams(max_tokens=max_tokens, **params)))
    return "".join(e.text for e in events), len(events)


def chat_tokens(engine):
    return engine.tokenize(engine.render_chat(MESSAGES, add_generation_prompt=True),
                           add_special=False)


def test_greedy_choices_are_the_same_answer(live, reference):
    text, num = engine_text(reference, chat_tokens(reference), 8, temperature=0)
    reply = post(live, CHAT, {"messages": MESSAGES, "max_tokens": 8, "temperature": 0, "n": 3})
    assert [c["index"] for c in reply["choices"]] == [0, 1, 2]
    assert all(c["message"]["content"] == text for c in reply["choices"])
    usage = reply["usage"]
    assert usage["prompt_tokens"] == len(chat_tokens(reference))
    assert usage["completion_tokens"] == 3 * num
    assert usage["total_tokens"] == usage["prompt_tokens"] + 3 * num


def test_seeded_choices_take_the_seed_plus_their_index(live, reference):
    tokens = chat_tokens(reference)
    want = [engine_text(reference, tokens, 10, seed=40 + i, **SAMPLED)[0] for i in range(3)]
    assert len(set(want)) > 1  # the seeds do draw other answers here
    body = {"messages": MESSAGES, "max_tokens": 10, "seed": 40, "n": 3, **SAMPLED}
    reply = post(live, CHAT, body)
    assert [c["message"]["content"] for c in reply["choices"]] == want
    # n=1 with seed 41 is choice 1's answer
    one = post(live, CHAT, dict(body, n=1, seed=41))
    assert one["choices"][0]["message"]["content"] == want[1]


def test_streamed_choices_equal_the_whole_ones(live):
    body = {"messages": MESSAGES, "max_tokens": 10, "seed": 7, "n": 2, **SAMPLED,
            "logprobs": True, "stream_options": {"include_usage": True}}
    whole = post(live, CHAT, body)
    chunks = stream(live, CHAT, body)
    texts, finishes, entries = {0: "", 1: ""}, {0: [], 1: []}, {0: [], 1: []}
    for chunk in chunks:
        for choice in chunk["choices"]:
            i = choice["index"]
            texts[i] += choice["delta"].get("content") or ""
            if choice["finish_reason"]:
                finishes[i].append(choice["finish_reason"])
            if choice["logprobs"]:
                entries[i] += choice["logprobs"]["content"]
    for c in whole["choices"]:
        i = c["index"]
        assert texts[i] == c["message"]["content"]
        assert finishes[i] == [c["finish_reason"]]  # one last chunk per choice
        assert entries[i] == c["logprobs"]["content"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]


def test_completion_choices(live, reference):
    prompt = "Colours: red,"
    tokens = reference.tokenize(prompt)
    want = [engine_text(reference, tokens, 6, seed=3 + i, **SAMPLED)[0] for i in range(2)]
    body = {"prompt": prompt, "max_tokens": 6, "seed": 3, "n": 2, "echo": True,
            "logprobs": 1, **SAMPLED}
    reply = post(live, COMPLETIONS, body)
    assert [c["text"] for c in reply["choices"]] == [prompt + w for w in want]
    for c in reply["choices"]:
        lists = c["logprobs"]
        assert lists["token_logprobs"][0] is None and len(lists["tokens"]) > len(tokens)
    chunks = stream(live, COMPLETIONS, body)
    texts = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk["choices"]:
            texts[choice["index"]] += choice["text"]
    assert [texts[0], texts[1]] == [c["text"] for c in reply["choices"]]


def test_the_openai_client_reads_them(live):
    with openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0,
                       timeout=60) as client:
        reply = client.chat.completions.create(model="tiny-server", messages=MESSAGES,
                                               max_tokens=4, n=2, seed=1, temperature=1.0)
        assert [c.index for c in reply.choices] == [0, 1]
        legacy = client.completions.create(model="tiny-server", prompt="Colours:",
                                           max_tokens=4, n=2, temperature=0)
        assert legacy.choices[0].text == legacy.choices[1].text
