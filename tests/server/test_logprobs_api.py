"""`logprobs` / `top_logprobs` on /v1/chat/completions and `logprobs` / `echo` on
/v1/completions, whole and streamed, through the `openai` client too: the figures are the
engine's (tests/engine/test_logprobs.py checks those against torch), in OpenAI's shapes."""
import json

import openai
import pytest
import requests

from strata.engine.sampling import SamplingParams

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "List three colours, then three animals."}]


def post(live, path, body):
    return requests.post(live.url + path, json=body, timeout=60)


def stream(live, path, body):
    response = requests.post(live.url + path, json=dict(body, stream=True), timeout=60,
                             stream=True)
    assert response.status_code == 200, response.text
    out = []
    for line in response.iter_lines(decode_unicode=True):
        if line.startswith("data: {"):
            out.append(json.loads(line[len("data: "):]))
    return out


def engine_events(engine, tokens, max_tokens, top):
    engine.reset()
    return list(engine.generate(tokens, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                       logprobs=top)))


def chat_tokens(engine):
    text = engine.render_chat(MESSAGES, add_generation_prompt=True)
    return engine.tokenize(text, add_special=False)


def token_entry(engine, token_id, logprob):
    raw = engine.tokenizer.token_bytes(token_id)
    return raw.decode("utf-8", errors="replace"), list(raw), logprob


def test_chat_logprobs_equal_the_engine(live, reference):
    events = engine_events(reference, chat_tokens(reference), 10, 3)
    body = {"messages": MESSAGES, "max_tokens": 10, "temperature": 0, "logprobs": True,
            "top_logprobs": 3}
    reply = post(live, CHAT, body).json()
    content = reply["choices"][0]["logprobs"]["content"]
    wanted = [e for e in events if e.logprob is not None]
    assert len(content) == len(wanted) >= 1
    for entry, event in zip(content, wanted):
        text, raw, logprob = token_entry(reference, event.token_id, event.logprob.logprob)
        assert (entry["token"], entry["bytes"]) == (text, raw)
        assert entry["logprob"] == pytest.approx(logprob, abs=1e-6)
        assert len(entry["top_logprobs"]) == 3
        for alt, (token_id, value) in zip(entry["top_logprobs"], event.logprob.top):
            assert (alt["token"], alt["bytes"]) == token_entry(reference, token_id, 0)[:2]
            assert alt["logprob"] == pytest.approx(value, abs=1e-6)
        assert entry["top_logprobs"][0]["token"] == entry["token"]  # greedy: the best one
    # without a stop string cutting it, the tokens' bytes are the answer's
    message = reply["choices"][0]["message"]
    if reply["choices"][0]["finish_reason"] == "length" and not message.get("reasoning_content"):
        raw = bytes(b for e in content for b in e["bytes"])
        assert raw.decode("utf-8", errors="replace") == message["content"]


def test_chat_stream_carries_the_same_entries(live):
    body = {"messages": MESSAGES, "max_tokens": 10, "temperature": 0, "logprobs": True,
            "top_logprobs": 2}
    whole = post(live, CHAT, body).json()["choices"][0]["logprobs"]["content"]
    chunks = stream(live, CHAT, body)
    streamed = [e for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
                for e in c["choices"][0]["logprobs"]["content"]]
    assert streamed == whole
    assert chunks[0]["choices"][0]["logprobs"] is None  # the role chunk carries no token


def test_chat_without_logprobs_has_none(live):
    body = {"messages": MESSAGES, "max_tokens": 4, "temperature": 0}
    assert post(live, CHAT, body).json()["choices"][0]["logprobs"] is None
    assert post(live, CHAT, dict(body, logprobs=False)).json()["choices"][0]["logprobs"] is None
    bare = post(live, CHAT, dict(body, logprobs=True)).json()["choices"][0]["logprobs"]
    assert bare["content"] and all(e["top_logprobs"] == [] for e in bare["content"])


def test_completion_logprobs_lists(live, reference):
    prompt = "Colours: red, green,"
    events = engine_events(reference, reference.tokenize(prompt), 8, 2)
    reply = post(live, COMPLETIONS, {"prompt": prompt, "max_tokens": 8, "temperature": 0,
                                     "logprobs": 2}).json()
    lists = reply["choices"][0]["logprobs"]
    wanted = [e for e in events if e.logprob is not None]
    assert len(lists["tokens"]) == len(lists["token_logprobs"]) == len(wanted)
    offset = 0
    for i, event in enumerate(wanted):
        text, _, logprob = token_entry(reference, event.token_id, event.logprob.logprob)
        assert lists["tokens"][i] == text
        assert lists["token_logprobs"][i] == pytest.approx(logprob, abs=1e-6)
        assert lists["text_offset"][i] == offset
        offset += len(text)
        top = lists["top_logprobs"][i]
        assert text in top and 2 <= len(top) <= 3  # the two best and the chosen token
    whole = reply["choices"][0]["text"]
    if reply["choices"][0]["finish_reason"] == "length":
        assert "".join(lists["tokens"]) == whole
    # streamed: the same lists, split over the chunks, offsets running on
    chunks = stream(live, COMPLETIONS, {"prompt": prompt, "max_tokens": 8, "temperature": 0,
                                        "logprobs": 2})
    parts = [c["choices"][0]["logprobs"] for c in chunks
             if c["choices"] and c["choices"][0]["logprobs"]]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [v for p in parts for v in p[key]] == lists[key]


def test_echo(live):
    prompt = "Colours: red, green,"
    plain = post(live, COMPLETIONS, {"prompt": prompt, "max_tokens": 6, "temperature": 0})
    echoed = post(live, COMPLETIONS, {"prompt": prompt, "max_tokens": 6, "temperature": 0,
                                      "echo": True})
    assert echoed.json()["choices"][0]["text"] == prompt + plain.json()["choices"][0]["text"]
    assert echoed.json()["usage"] == plain.json()["usage"]
    chunks = stream(live, COMPLETIONS, {"prompt": prompt, "max_tokens": 6, "temperature": 0,
                                        "echo": True})
    assert chunks[0]["choices"][0]["text"] == prompt
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == \
        echoed.json()["choices"][0]["text"]


def test_echo_of_token_ids(live, reference):
    ids = reference.tokenize("Colours: red,")
    reply = post(live, COMPLETIONS, {"prompt": ids, "max_tokens": 2, "echo": True})
    assert reply.json()["choices"][0]["text"].startswith(reference.detokenize(ids))


def test_the_openai_client_reads_them(live):
    with openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0,
                       timeout=60) as client:
        reply = client.chat.completions.create(model="tiny-server", messages=MESSAGES,
                                               max_tokens=5, temperature=0, logprobs=True,
                                               top_logprobs=2)
        content = reply.choices[0].logprobs.content
        assert content and all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in content)
        legacy = client.completions.create(model="tiny-server", prompt="Colours:",
                                           max_tokens=4, temperature=0, logprobs=1)
        assert len(legacy.choices[0].logprobs.tokens) >= 1
        assert all(v <= 0 for v in legacy.choices[0].logprobs.token_logprobs)


def output_text_part(reply):
    messages = [item for item in reply["output"] if item["type"] == "message"]
    return messages[0]["content"][0] if messages else None


def test_responses_logprobs(live):
    body = {"input": "List three colours.", "max_output_tokens": 10, "temperature": 0,
            "chat_template_kwargs": {"enable_thinking": False}}
    plain = post(live, "/v1/responses", body).json()
    part = output_text_part(plain)
    assert part is None or part["logprobs"] == []
    for asked in ({"include": ["message.output_text.logprobs"]}, {"top_logprobs": 2},
                  {"include": ["reasoning.encrypted_content", "message.output_text.logprobs"],
                   "top_logprobs": 2}):
        reply = post(live, "/v1/responses", dict(body, **asked)).json()
        part = output_text_part(reply)
        assert part is not None, reply
        entries = part["logprobs"]
        assert entries and all(e["logprob"] <= 0 for e in entries)
        assert all(len(e["top_logprobs"]) == asked.get("top_logprobs", 0) for e in entries)
        raw = bytes(b for e in entries for b in e["bytes"])
        assert raw.decode("utf-8", errors="replace").startswith(part["text"])
        # streamed: the deltas carry the same entries, the done event all of them
        response = requests.post(live.url + "/v1/responses",
                                 json=dict(body, stream=True, **asked), timeout=60,
                                 stream=True)
        events = [json.loads(line[len("data: "):])
                  for line in response.iter_lines(decode_unicode=True)
                  if line.startswith("data: {")]
        deltas = [e for e in events if e["type"] == "response.output_text.delta"]
        assert [x for d in deltas for x in d["logprobs"]] == entries
        done = [e for e in events if e["type"] == "response.output_text.done"]
        assert done[0]["logprobs"] == entries


def test_echo_with_logprobs_scores_the_prompt(live, reference):
    """As evaluation harnesses ask (echo, logprobs, one token): every prompt token after the
    first with its figure, then the generated token's."""
    prompt = "Colours: red, green, blue. Animals: cat,"
    ids = reference.tokenize(prompt)
    reference.reset()
    events = list(reference.generate(ids, SamplingParams(temperature=0, max_tokens=1,
                                                         logprobs=1, prompt_logprobs=1)))
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 1}
    reply = post(live, COMPLETIONS, body).json()
    lists = reply["choices"][0]["logprobs"]
    figures = list(events[0].prompt_logprobs) + [e.logprob for e in events if e.logprob]
    assert len(figures) == len(ids)  # prompt tokens 1..n-1 and the generated one
    assert len(lists["tokens"]) == len(ids) + 1
    assert lists["token_logprobs"][0] is None and lists["top_logprobs"][0] is None
    assert lists["tokens"][0] == token_entry(reference, ids[0], 0)[0]
    for i, lp in enumerate(figures, start=1):
        assert lists["tokens"][i] == token_entry(reference, lp.token_id, 0)[0]
        assert lists["token_logprobs"][i] == pytest.approx(lp.logprob, abs=1e-6)
        assert len(lists["top_logprobs"][i]) in (1, 2)
    assert reply["choices"][0]["text"].startswith(prompt)
    assert lists["text_offset"][len(ids)] == len(prompt)  # the answer's first token
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # again: the prompt's cells are cached now, and still every figure comes back; streamed
    chunks = stream(live, COMPLETIONS, body)
    parts = [c["choices"][0]["logprobs"] for c in chunks
             if c["choices"] and c["choices"][0]["logprobs"]]
    assert chunks[0]["choices"][0]["text"] == prompt
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [v for p in parts for v in p[key]] == lists[key]


def test_text_offsets_count_the_characters_of_split_ones(live, reference):
    """Byte-level tokens split 'é', '🎉' and '日' over several tokens (each token's text then
    reads U+FFFD): a token's text_offset is the answer's character its first byte belongs
    to, whole and streamed, and after an echo too."""
    answer = "héllo 🎉 日本 end"
    grammar = f'root ::= "{answer}"'
    ids = reference.tokenize("x")
    reference.reset()
    events = list(reference.generate(ids, SamplingParams(temperature=0, max_tokens=40,
                                                         logprobs=1, grammar=grammar)))
    raws = [reference.tokenizer.token_bytes(e.token_id) for e in events if e.logprob]
    assert any(len(raw) == 1 and raw[0] >= 0x80 for raw in raws)  # a character is split
    # the characters whole before each token's first byte
    offsets = [len(b"".join(raws[:i]).decode("utf-8", errors="ignore"))
               for i in range(len(raws))]
    body = {"prompt": "x", "max_tokens": 40, "temperature": 0, "logprobs": 1,
            "grammar": grammar}
    for echo in ("", "x"):
        reply = post(live, COMPLETIONS, dict(body, echo=bool(echo))).json()
        lists = reply["choices"][0]["logprobs"]
        assert reply["choices"][0]["text"] == echo + answer
        assert lists["text_offset"] == [0] * bool(echo) + [len(echo) + o for o in offsets]
        chunks = stream(live, COMPLETIONS, dict(body, echo=bool(echo)))
        parts = [c["choices"][0]["logprobs"] for c in chunks
                 if c["choices"] and c["choices"][0]["logprobs"]]
        assert [v for p in parts for v in p["text_offset"]] == lists["text_offset"]
