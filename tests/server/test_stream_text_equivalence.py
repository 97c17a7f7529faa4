"""What a client reads of a streamed answer equals the whole answer, on every endpoint: the
deltas concatenated (content, reasoning, tool-call arguments, per choice of n), the finish and
stop fields, the logprobs; every event is whole UTF-8. A grammar makes the tiny model spell
'a中é😀b' in byte tokens (each multi-byte character split over several), so max_tokens and stop
strings fall inside characters."""
import json

import pytest
import requests

from strata.config import EngineConfig
from strata.engine.engine import Engine
from strata.model.chat import ChatTemplate, default_template
from strata.server.anthropic_format import sse_event as anthropic_event
from strata.server.app import ServerConfig
from strata.server.openai_format import sse
from strata.server.output_parser import parse_complete
from strata.server.responses_format import OutputItems, sse_event as responses_event

from conftest import N_CTX_TOKENS
from live_server import start_live_server

CHAT, COMPLETIONS, RESPONSES = "/v1/chat/completions", "/v1/completions", "/v1/responses"
MESSAGES, LLAMA = "/v1/messages", "/completion"
SPELLED = "a中é😀b"
GRAMMAR = f'root ::= "{SPELLED}" [x-z]*'
# max_tokens -> the text: a character cut by it ends in one U+FFFD, its bytes not lost
CUTS = {1: "a", 2: "a\ufffd", 3: "a\ufffd", 4: "a中", 5: "a中\ufffd", 6: "a中é",
        7: "a中é\ufffd", 9: "a中é\ufffd", 10: "a中é😀", 11: "a中é😀by"}
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


def post(live, path, body) -> dict:
    reply = requests.post(live.url + path, json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()


def stream(live, path, body) -> list[dict]:
    """The events' payloads; each event must be whole UTF-8 on its own."""
    reply = requests.post(live.url + path, json=dict(body, stream=True), timeout=60)
    assert reply.status_code == 200, reply.text
    out = []
    for block in reply.content.split(b"\n\n"):
        for line in block.decode("utf-8").split("\n"):  # strict: no event splits a char
            if line.startswith("data: {"):
                out.append(json.loads(line[len("data: "):]))
    return out


# ---- what a client makes of each endpoint's answer, whole and streamed --------------------
def completion_whole(reply):
    return [(c["index"], c["text"], c["finish_reason"], c["logprobs"])
            for c in sorted(reply["choices"], key=lambda c: c["index"])]


def completion_streamed(chunks):
    got = {}
    for chunk in chunks:
        for c in chunk["choices"]:
            text, finish, lists = got.get(c["index"], ("", None, None))
            assert finish is None  # nothing after a choice's last chunk
            if c["logprobs"]:
                lists = {k: (lists or {}).get(k, []) + v for k, v in c["logprobs"].items()}
            got[c["index"]] = (text + c["text"], c["finish_reason"], lists)
    return [(i, *got[i]) for i in sorted(got)]


def chat_whole(reply):
    out = []
    for c in sorted(reply["choices"], key=lambda c: c["index"]):
        m = c["message"]
        calls = [(t["id"][:len("call_")], t["function"]["name"], t["function"]["arguments"])
                 for t in m.get("tool_calls") or []]  # each call's id is its own
        out.append((c["index"], m["content"] or "", m.get("reasoning_content", ""), calls,
                    c["finish_reason"], c["logprobs"] and c["logprobs"]["content"]))
    return out


def chat_streamed(chunks):
    got = {}
    for chunk in chunks:
        for c in chunk["choices"]:
            s = got.setdefault(c["index"], {"content": "", "reasoning": "", "calls": {},
                                            "finish": None, "logprobs": None})
            assert s["finish"] is None
            delta = c["delta"]
            s["content"] += delta.get("content") or ""
            s["reasoning"] += delta.get("reasoning_content") or ""
            for call in delta.get("tool_calls") or []:
                one = s["calls"].setdefault(call["index"], ["", "", ""])
                one[0] += call.get("id", "")
                one[1] += call.get("function", {}).get("name", "")
                one[2] += call["function"].get("arguments") or ""
            s["finish"] = c["finish_reason"]
            if c["logprobs"]:
                s["logprobs"] = (s["logprobs"] or []) + c["logprobs"]["content"]
    return [(i, s["content"], s["reasoning"],
             [(v[0][:len("call_")], v[1], v[2]) for _, v in sorted(s["calls"].items())],
             s["finish"], s["logprobs"]) for i, s in sorted(got.items())]


def _without_ids(item: dict) -> dict:
    return {k: v for k, v in item.items() if k not in ("id", "call_id")}


def response_whole(reply):
    return reply["status"], reply["incomplete_details"], [_without_ids(i) for i in reply["output"]]


def response_streamed(events):
    """The deltas rebuilt into items, checked against each item's done event; then what the
    last event (response.completed / .incomplete) says."""
    texts = {}
    for e in events:
        if e["type"] in ("response.output_text.delta", "response.reasoning_text.delta",
                         "response.function_call_arguments.delta"):
            texts[e["output_index"]] = texts.get(e["output_index"], "") + e["delta"]
        elif e["type"] == "response.output_item.done":
            item = e["item"]
            whole = item.get("arguments", item.get("content", [{}])[0].get("text"))
            assert texts.get(e["output_index"], "") == whole
    return response_whole(events[-1]["response"])


def message_whole(reply):
    return reply["stop_reason"], reply["stop_sequence"], [_without_ids(b) for b in reply["content"]]


def message_streamed(events):
    blocks, reason, sequence = {}, None, None
    for e in events:
        if e["type"] == "content_block_start":
            blocks[e["index"]] = dict(e["content_block"], partial_json="")
        elif e["type"] == "content_block_delta":
            block, delta = blocks[e["index"]], e["delta"]
            key = {"text_delta": "text", "thinking_delta": "thinking",
                   "input_json_delta": "partial_json"}[delta["type"]]
            block[key] += delta[key]
        elif e["type"] == "message_delta":
            reason, sequence = e["delta"]["stop_reason"], e["delta"]["stop_sequence"]
    out = []
    for _, block in sorted(blocks.items()):
        partial = block.pop("partial_json")
        if block["type"] == "tool_use":
            block["input"] = json.loads(partial)
        out.append(_without_ids(block))
    return reason, sequence, out


def llama_whole(reply):
    return (reply["content"], reply["stop_type"], reply["stopping_word"],
            reply.get("completion_probabilities"), reply["tokens_predicted"])


def llama_streamed(chunks):
    assert [c["stop"] for c in chunks] == [False] * (len(chunks) - 1) + [True]
    probs = [p for c in chunks for p in c.get("completion_probabilities", [])]
    last = chunks[-1]
    return ("".join(c["content"] for c in chunks), last["stop_type"], last["stopping_word"],
            probs or last.get("completion_probabilities"), last["tokens_predicted"])


READERS = {COMPLETIONS: (completion_whole, completion_streamed), CHAT: (chat_whole, chat_streamed),
           RESPONSES: (response_whole, response_streamed),
           MESSAGES: (message_whole, message_streamed), LLAMA: (llama_whole, llama_streamed)}


def both(live, path, body):
    """The answer read whole, after checking the stream reads the same."""
    whole_of, streamed_of = READERS[path]
    whole = whole_of(post(live, path, body))
    assert streamed_of(stream(live, path, body)) == whole
    return whole


def spelled_body(path, max_tokens, **extra):
    """A request whose answer the grammar spells (SPELLED, then x-z)."""
    if path == LLAMA:
        return dict({"prompt": "Hi", "n_predict": max_tokens, "temperature": 0,
                     "grammar": GRAMMAR, "n_probs": 2}, **extra)
    body = {"max_tokens": max_tokens, "temperature": 0, "grammar": GRAMMAR, **extra}
    if path == COMPLETIONS:
        return dict(body, prompt="Hi", logprobs=2)
    if path == CHAT:
        return dict(body, messages=[{"role": "user", "content": "Hi"}], logprobs=True,
                    top_logprobs=2, **NO_THINKING)
    body["max_output_tokens"] = body.pop("max_tokens")
    return dict(body, input="Hi", top_logprobs=2, **NO_THINKING)


def spelled_text(path, whole) -> tuple[str, str]:
    """(text, finish field) of an answer of `both`."""
    if path == COMPLETIONS:
        return whole[0][1], whole[0][2]
    if path == CHAT:
        return whole[0][1], whole[0][4]
    if path == LLAMA:
        return whole[0], whole[1]
    status, _, items = whole
    return "".join(i["content"][0]["text"] for i in items), status


# ---- UTF-8 ----------------------------------------------------------------------------------
@pytest.mark.parametrize("path", [COMPLETIONS, CHAT, RESPONSES, LLAMA])
@pytest.mark.parametrize("max_tokens", sorted(CUTS))
def test_a_character_cut_by_max_tokens_is_one_replacement_at_the_end(live, path, max_tokens):
    whole = both(live, path, spelled_body(path, max_tokens))
    text, finish = spelled_text(path, whole)
    assert text == CUTS[max_tokens]
    assert finish in ("length", "incomplete", "limit")


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT, RESPONSES, MESSAGES, LLAMA])
def test_a_lone_lead_byte_at_the_end_is_flushed_once(live, reference, path):
    lead = next(i for i in range(reference.tokenizer.vocab_size)
                if reference.tokenizer.token_bytes(i) == "中".encode()[:1])
    body = {"logit_bias": {str(lead): 100}, "temperature": 0}
    body.update({COMPLETIONS: {"prompt": "Hi", "max_tokens": 2},
                 CHAT: {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                        **NO_THINKING},
                 RESPONSES: {"input": "Hi", "max_output_tokens": 2, **NO_THINKING},
                 MESSAGES: {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                            "thinking": {"type": "disabled"}},
                 LLAMA: {"prompt": "Hi", "n_predict": 2}}[path])
    whole = both(live, path, body)
    # two lead bytes: the first is cut by the second, the second by the end
    text = {COMPLETIONS: lambda: whole[0][1], CHAT: lambda: whole[0][1],
            RESPONSES: lambda: whole[2][0]["content"][0]["text"],
            MESSAGES: lambda: whole[2][0]["text"], LLAMA: lambda: whole[0]}[path]()
    assert text == "\ufffd\ufffd"


# ---- stop strings ---------------------------------------------------------------------------
@pytest.mark.parametrize("stop, text, word", [
    (["é"], "a中", "é"),  # a stop of a character split over two tokens
    (["é😀"], "a中", "é😀"),  # one over six tokens
    (["中é", "中"], "a", "中"),  # one a prefix of another: the first seen ends it
    (["中", "中é"], "a", "中"),
    (["a"], "", "a"),  # at the very first token
    (["y", "b"], "a中é😀", "b"),  # begins inside the last token ("by")
])
@pytest.mark.parametrize("path", [COMPLETIONS, CHAT, RESPONSES, LLAMA])
def test_stop_strings_inside_and_across_characters(live, path, stop, text, word):
    whole = both(live, path, spelled_body(path, 16, stop=stop))
    got, finish = spelled_text(path, whole)
    assert got == text
    assert finish == {COMPLETIONS: "stop", CHAT: "stop", RESPONSES: "completed",
                      LLAMA: "word"}[path]
    if path == LLAMA:
        assert whole[2] == word


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT, RESPONSES, LLAMA])
def test_a_stop_that_never_completes_is_released_whole(live, path):
    """'😀bx' is held back while '😀b' may start it: the 'y' after shows it is text, and so
    does max_tokens ending the answer there (or at '😀', which may start it too)."""
    whole = both(live, path, spelled_body(path, 16, stop=["😀bx"]))
    assert spelled_text(path, whole)[0].startswith(SPELLED + "y")
    for max_tokens in (10, 11):
        whole = both(live, path, spelled_body(path, max_tokens, stop=["😀bx"]))
        assert spelled_text(path, whole) == (CUTS[max_tokens], {
            COMPLETIONS: "length", CHAT: "length", RESPONSES: "incomplete",
            LLAMA: "limit"}[path])


def natural_stops(live) -> list[list[str]]:
    """Stop strings from the tiny model's own chat answer: across tokens, at its start, and
    two where one is a prefix of the other."""
    reply = post(live, CHAT, {"messages": [{"role": "user", "content": "Count to five."}],
                              "max_tokens": 24, "temperature": 0, **NO_THINKING})
    text = reply["choices"][0]["message"]["content"]
    assert len(text) > 12
    return [[text[5:9]], [text[:1]], [text[3:6], text[3:5]], [text[-3:]]]


@pytest.mark.parametrize("path", [CHAT, RESPONSES, MESSAGES])
def test_natural_stops_on_the_chat_shaped_endpoints(live, path):
    for stop in natural_stops(live):
        body = {"temperature": 0, **NO_THINKING}
        if path == MESSAGES:
            body = {"temperature": 0, "thinking": {"type": "disabled"}, "max_tokens": 24,
                    "stop_sequences": stop}
        elif path == RESPONSES:
            body.update(max_output_tokens=24, stop=stop)
        else:
            body.update(max_tokens=24, stop=stop, n=2, seed=5, logprobs=True)
        key = "input" if path == RESPONSES else "messages"
        body[key] = [{"role": "user", "content": "Count to five."}]
        whole = both(live, path, body)
        if path == MESSAGES:
            reason, sequence, blocks = whole
            assert reason == "stop_sequence" and sequence in stop
            texts = [b["text"] for b in blocks]
        elif path == RESPONSES:
            assert whole[0] == "completed"
            texts = [i["content"][0]["text"] for i in whole[2]]
        else:
            assert [c[4] for c in whole] == ["stop", "stop"]
            texts = [c[1] for c in whole]
        assert not any(s in t for t in texts for s in stop)


@pytest.mark.parametrize("extra", [
    {"n": 3, "temperature": 0.9, "seed": 11},
    {"echo": True, "n": 2, "temperature": 0.9, "seed": 3},
    {"prompt": [[15, 16, 17], "中文 text é"], "echo": True},
    {"logit_bias": {"104": 40}},  # a lone continuation byte (invalid UTF-8) now and then
])
def test_completions_choices_and_echo_stream_as_whole(live, extra):
    body = dict({"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0,
                 "logprobs": 2, "stop": [" t"]}, **extra)
    answers = both(live, COMPLETIONS, body)
    assert len(answers) == body.get("n", 1) * (len(body["prompt"]) if isinstance(
        body["prompt"], list) else 1)


# ---- logprobs -------------------------------------------------------------------------------
def test_legacy_lists_name_each_split_token_by_its_bytes(live):
    """A token that is part of a character reads 'bytes:\\xe4' as in OpenAI's API: under
    U+FFFD every such alternative was one key of top_logprobs, which then held another
    token's figure for the chosen one (and fewer alternatives than asked)."""
    body = {"prompt": "x", "max_tokens": 24, "temperature": 0, "logprobs": 20,
            "grammar": 'root ::= "中文日本語éü🎉"'}
    (_, text, _, lists), = both(live, COMPLETIONS, body)
    assert text == "中文日本語éü🎉"
    assert lists["tokens"][0] == "bytes:\\xe4"  # 中 is e4 b8 ad
    for token, value, top in zip(lists["tokens"], lists["token_logprobs"], lists["top_logprobs"]):
        assert token.startswith("bytes:\\x")
        assert top[token] == value
        assert len(top) in (20, 21)  # the 20 best, and the chosen token where it is not
        best = list(top.values())[:20]
        assert best == sorted(best, reverse=True)


# ---- reasoning and tool calls ---------------------------------------------------------------
@pytest.fixture(scope="module")
def live_thinking(model_path):
    """A template that opens the <think> block (as DeepSeek-R1's does) and a 6-token reasoning
    budget: the tiny model's answer is reasoning, `</think>`, then content."""
    engine = Engine(EngineConfig(model_path, n_ctx=N_CTX_TOKENS, threads=2))
    opening = "'<|im_start|>assistant\\n'"
    assert opening in default_template()
    engine.chat_template = ChatTemplate(default_template().replace(
        opening, "'<|im_start|>assistant\\n<think>\\n'"))
    server = start_live_server(engine, ServerConfig(model_id="tiny-server", reasoning_budget=6))
    yield server
    server.stop()


@pytest.mark.parametrize("max_tokens", [3, 7, 8, 9, 10, 11, 16])
def test_the_reasoning_split_is_the_same_streamed_and_on_every_endpoint(live_thinking,
                                                                        max_tokens):
    """Cut inside the block, at its whitespace, at `</think>`, after it."""
    messages = [{"role": "user", "content": "Hi"}]
    (_, content, reasoning, _, _, _), = both(live_thinking, CHAT, {
        "messages": messages, "max_tokens": max_tokens, "temperature": 0})
    assert reasoning and (content or max_tokens < 16)
    _, _, items = both(live_thinking, RESPONSES, {"input": messages, "temperature": 0,
                                                  "max_output_tokens": max_tokens})
    assert [i["content"][0]["text"] for i in items] == [reasoning] + [content] * bool(content)
    _, _, blocks = both(live_thinking, MESSAGES, {"messages": messages, "temperature": 0,
                                                  "max_tokens": max_tokens})
    assert [b.get("thinking", b.get("text")) for b in blocks] == \
        [reasoning] + [content] * bool(content)


def test_tool_call_arguments_stream_per_choice(live, reference):
    tok = reference.tokenizer  # the tiny model's text is random: a closing quote ends it
    bias = {str(tok.token_id(t)): b for t, b in (('"', 8), ("}", 4))}
    body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER],
            "tool_choice": "required", "max_tokens": 120, "temperature": 0.9, "seed": 4,
            "n": 2, "logit_bias": bias, **NO_THINKING}
    answers = both(live, CHAT, body)
    for _, _, _, calls, finish, _ in answers:
        assert calls and finish in ("tool_calls", "length")  # text may follow the call
        for call_id, name, arguments in calls:
            assert call_id == "call_" and name == "get_weather"
            assert set(json.loads(arguments)) == {"city"}


# ---- framing --------------------------------------------------------------------------------
def test_half_a_utf16_pair_in_a_call_streams_escaped():
    """A custom tool's input is the string the model's call escaped: "\\ud800" alone is no
    character, and its event could not be encoded (the stream broke off there)."""
    _, _, calls, _ = parse_complete('<tool_call>\n{"name": "apply_patch", "arguments": '
                                    '{"input": "a\\ud800b"}}\n</tool_call>')
    items = OutputItems(frozenset({"apply_patch"}))
    events = [responses_event(e) for e in items.feed(calls[0])]
    done = json.loads(events[-1].encode("utf-8").split(b"data: ", 1)[1])
    assert done["item"]["input"] == "a\ud800b"  # read back as the client's JSON reads it
    payload = {"type": "content_block_delta", "text": "x\udfff"}
    for frame in (sse(payload), anthropic_event(payload)):
        assert "\\udfff" in frame and frame.encode("utf-8")
