"""The official `anthropic` client against a live server on a tiny synth model (/v1/messages):
answers equal what the engine itself generates for the template's rendering of the same turns,
and bad requests get Anthropic-shaped errors while the server keeps serving."""
import json

import anthropic
import pytest
import requests

from strata.engine.sampling import SamplingParams
from strata.server.output_parser import parse_complete

from conftest import API_KEY, N_CTX_TOKENS, reference_chat

MODEL_ID = "tiny-server"
GREEDY = {"temperature": 0}  # Anthropic's clients no longer send it; the API still takes it
TOOL = {"name": "get_weather", "description": "Current weather of a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                         "required": ["city"]}}
OPENAI_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": TOOL["input_schema"]}}


@pytest.fixture(scope="module")
def client(live):
    with anthropic.Anthropic(base_url=live.url, api_key="unused", max_retries=0,
                             timeout=60) as client:
        yield client  # closed: its pooled sockets would warn when collected


def create(client, **kwargs):
    kwargs.setdefault("model", MODEL_ID)
    extra = dict(GREEDY, **kwargs.pop("extra_body", {}))
    return client.messages.create(extra_body=extra, **kwargs)


def text_of(message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def test_message_equals_the_engine(client, reference):
    messages = [{"role": "user", "content": "Name three colours."}]
    tokens, content, _, num_generated, finish = reference_chat(
        reference, [{"role": "system", "content": "You are terse."}] + messages, 12)
    reply = create(client, system="You are terse.", messages=messages, max_tokens=12)
    assert reply.type == "message" and reply.role == "assistant"
    assert reply.id.startswith("msg_") and reply.model == MODEL_ID
    assert text_of(reply) == content
    assert reply.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[finish]
    assert reply.stop_sequence is None
    usage = reply.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == len(tokens)
    assert usage.cache_creation_input_tokens == 0
    assert usage.output_tokens == num_generated


def test_streamed_message_equals_the_whole_answer(client, live):
    kwargs = dict(system=[{"type": "text", "text": "Count."}], max_tokens=10,
                  messages=[{"role": "user", "content": "Count to five."}])
    whole = create(client, **kwargs)
    with client.messages.stream(model=MODEL_ID, extra_body=GREEDY, **kwargs) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert [(b.type, b.text) for b in streamed.content] == [
        (b.type, b.text) for b in whole.content]
    assert (streamed.stop_reason, streamed.usage.output_tokens) == (
        whole.stop_reason, whole.usage.output_tokens)
    assert streamed.usage.input_tokens + streamed.usage.cache_read_input_tokens == \
        whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    # the raw wire: named events, each data line's type equal to its event name
    body = dict(kwargs, model=MODEL_ID, stream=True, **GREEDY)
    with requests.post(live.url + "/v1/messages", json=body, stream=True, timeout=60) as raw:
        assert raw.headers["Content-Type"].startswith("text/event-stream")
        lines = [line for line in raw.iter_lines(decode_unicode=True) if line]
    names = [line[len("event: "):] for line in lines[0::2]]
    payloads = [json.loads(line[len("data: "):]) for line in lines[1::2]]
    assert names == [p["type"] for p in payloads]
    assert names[:2] == ["message_start", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_tool_turns_render_as_on_the_chat_endpoint(client, live):
    """tool_use and tool_result blocks reach the template as the chat endpoint's tool calls and
    tool messages: both endpoints count the same prompt, and count_tokens agrees."""
    turns = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
             "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1",
             "content": [{"type": "text", "text": "18 C, sunny"}]}]}]
    reply = create(client, system="Be brief.", messages=turns, tools=[TOOL], max_tokens=2)
    chat = requests.post(live.url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL_ID, "max_tokens": 2, "temperature": 0, "tools": [OPENAI_TOOL],
        "messages": [
            {"role": "system", "content": "Be brief."}, turns[0],
            {"role": "assistant", "content": "Let me look.", "tool_calls": [
                {"id": "toolu_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "18 C, sunny"}]}).json()
    num_prompt = reply.usage.input_tokens + reply.usage.cache_read_input_tokens
    assert num_prompt == chat["usage"]["prompt_tokens"]
    counted = client.messages.count_tokens(model=MODEL_ID, system="Be brief.", messages=turns,
                                           tools=[TOOL])
    assert counted.input_tokens == num_prompt


def test_stop_sequence_ends_the_answer_and_is_named(client, reference):
    messages = [{"role": "user", "content": "Tell a story."}]
    _, content, _, _, _ = reference_chat(reference, messages, 24)
    stop = content[len(content) // 2:len(content) // 2 + 2]
    assert len(stop) == 2 and stop.strip()
    reply = create(client, messages=messages, max_tokens=24, stop_sequences=["\x00", stop])
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == stop
    assert text_of(reply) == content[:content.find(stop)]


def test_a_last_assistant_turn_is_continued(client, reference):
    messages = [{"role": "user", "content": "Count to ten."}]
    _, content, _, num_generated, _ = reference_chat(reference, messages, 8,
                                                     prefill="One, two,")
    reply = create(client, messages=messages + [{"role": "assistant", "content": "One, two,"}],
                   max_tokens=8)
    assert text_of(reply) == content and reply.usage.output_tokens == num_generated


def test_tool_calls_are_tool_use_blocks_held_to_the_schema(client, reference):
    """The served tool_use blocks are the engine's own held run (the opening tag favoured
    through the logit_bias extension so that random weights write calls)."""
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    tok = reference.tokenizer
    bias = {tok.token_id("<tool_call>"): 100, tok.token_id("}"): 4, tok.token_id('"'): 4}
    reply = create(client, messages=messages, tools=[TOOL], max_tokens=80,
                   thinking={"type": "disabled"},
                   extra_body={"logit_bias": {str(t): b for t, b in bias.items()}})
    reference.reset()
    text = reference.render_chat(messages, tools=[OPENAI_TOOL], add_generation_prompt=True,
                                 enable_thinking=False)
    events = list(reference.generate(tok.encode(text, add_special=False), SamplingParams(
        temperature=0, max_tokens=80, logit_bias=bias,
        held_tool_calls=[OPENAI_TOOL["function"]])))
    _, _, calls, _ = parse_complete("".join(e.text for e in events), parse_tools=True)
    served = [block for block in reply.content if block.type == "tool_use"]
    assert calls and [(b.name, b.input) for b in served] == [
        (c.name, json.loads(c.arguments)) for c in calls]
    assert all(b.id.startswith("toolu_") and isinstance(b.input["city"], str) for b in served)
    # a run cut by max_tokens (inside a further call, sent as text) says max_tokens, as Anthropic's
    assert reply.stop_reason == {"length": "max_tokens", "stop": "tool_use"}[
        events[-1].finish_reason]


def test_output_config_holds_the_answer_to_its_schema(client, reference):
    schema = {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"],
              "additionalProperties": False}
    messages = [{"role": "user", "content": "Give me a point."}]
    think = reference.tokenizer.token_id("<think>")
    note = ("Answer with one valid JSON object that follows this JSON schema, and nothing "
            "else: " + json.dumps(schema))
    _, content, _, _, finish = reference_chat(
        reference, [{"role": "system", "content": note}] + messages, 60,
        template_kwargs={"enable_thinking": False}, json_object=True, json_schema=schema,
        logit_bias={think: -100})
    reply = create(client, messages=messages, max_tokens=60, thinking={"type": "disabled"},
                   output_config={"format": {"type": "json_schema", "schema": schema}},
                   extra_body={"logit_bias": {str(think): -100}})
    assert text_of(reply) == content
    if finish == "stop":
        assert set(json.loads(content)) <= {"x"}


def test_an_answer_cut_by_the_context_says_so(client, reference):
    """max_tokens beyond the room the prompt leaves is clipped to it, and an answer that fills
    the context ends with model_context_window_exceeded (the stop tokens banned here)."""
    messages = [{"role": "user", "content": "word " * 200}]
    text = reference.render_chat(messages, add_generation_prompt=True)
    num_prompt_tokens = len(reference.tokenize(text, add_special=False))
    ban = {str(t): -100 for t in reference.tokenizer.stop_ids}
    reply = create(client, messages=messages, max_tokens=10**6, extra_body={"logit_bias": ban})
    assert reply.stop_reason == "model_context_window_exceeded"
    assert reply.usage.output_tokens == N_CTX_TOKENS - num_prompt_tokens
    short = create(client, messages=messages, max_tokens=3, extra_body={"logit_bias": ban})
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3


def test_models_list_for_anthropic_clients(client):
    models = client.models.list()
    assert [(m.id, m.type, m.display_name) for m in models.data] == [
        (MODEL_ID, "model", MODEL_ID)]
    assert models.data[0].max_input_tokens == N_CTX_TOKENS


def test_x_api_key_is_accepted(live_keyed):
    with anthropic.Anthropic(base_url=live_keyed.url, api_key="wrong", max_retries=0) as bad, \
            pytest.raises(anthropic.AuthenticationError) as info:
        bad.messages.create(model=MODEL_ID, max_tokens=1,
                            messages=[{"role": "user", "content": "hi"}])
    assert info.value.body["error"]["type"] == "authentication_error"
    with anthropic.Anthropic(base_url=live_keyed.url, api_key=API_KEY, max_retries=0) as good:
        reply = good.messages.create(model=MODEL_ID, max_tokens=2,
                                     messages=[{"role": "user", "content": "hi"}])
    assert reply.usage.output_tokens >= 1


def post(live, body=None, data=None, path="/v1/messages"):
    data = json.dumps(body) if data is None else data
    return requests.post(live.url + path, data=data, timeout=60,
                         headers={"Content-Type": "application/json"})


@pytest.mark.parametrize("body,data,status,kind,words", [
    (None, "{oops", 400, "invalid_request_error", ["not valid JSON"]),
    ({"messages": [{"role": "user", "content": "hi"}]}, None, 400, "invalid_request_error",
     ["'max_tokens' is required"]),
    ({"model": "claude-opus-4-5", "max_tokens": 1,
      "messages": [{"role": "user", "content": "hi"}]}, None, 404, "not_found_error",
     ["'claude-opus-4-5'", MODEL_ID]),
    ({"max_tokens": 1, "messages": [{"role": "user", "content": "word " * 600}]}, None, 400,
     "invalid_request_error", ["prompt is too long:", f"> {N_CTX_TOKENS} maximum"]),
    ({"max_tokens": 1, "messages": [{"role": "user", "content": [
        {"type": "video", "source": {"type": "base64", "media_type": "video/mp4",
                                     "data": "AA=="}}]}]},
     None, 400, "invalid_request_error", ["'video'"]),
])
def test_bad_requests_get_anthropic_errors(live, client, body, data, status, kind, words):
    response = post(live, body, data)
    assert response.status_code == status, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == kind
    for word in words:
        assert word in error["error"]["message"], error["error"]["message"]
    assert create(client, max_tokens=1,
                  messages=[{"role": "user", "content": "still there?"}]).usage.output_tokens


def test_count_tokens_counts_a_prompt_over_the_context(client):
    """A count is answered even past the context (a client compacts on it), while the same
    messages sent to /v1/messages say the prompt is too long."""
    messages = [{"role": "user", "content": "word " * 600}]
    assert client.messages.count_tokens(model=MODEL_ID, messages=messages).input_tokens > \
        N_CTX_TOKENS
    with pytest.raises(anthropic.BadRequestError, match="prompt is too long"):
        client.messages.create(model=MODEL_ID, max_tokens=1, messages=messages)


def test_wrong_method_and_count_tokens_errors(live):
    response = requests.get(live.url + "/v1/messages", timeout=60)
    assert response.status_code == 405
    assert response.json()["error"]["type"] == "invalid_request_error"
    response = post(live, {"messages": "hi"}, path="/v1/messages/count_tokens")
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "messages"


def test_tool_choice_any_is_held_to_a_tool_use(client, reference):
    tok = reference.tokenizer
    reply = create(client, messages=[{"role": "user", "content": "Weather in Oslo?"}],
                   tools=[TOOL], tool_choice={"type": "any"}, max_tokens=80,
                   thinking={"type": "disabled"},
                   extra_body={"logit_bias": {str(tok.token_id("}")): 4,
                                              str(tok.token_id('"')): 4}})
    # the answer opens with the call (random weights then write on to max_tokens)
    assert reply.content[0].type == "tool_use" and reply.content[0].name == "get_weather"
    assert isinstance(reply.content[0].input["city"], str)


def test_thinking_budget_tokens_close_the_block(client, reference):
    """An answer that starts inside <think> (the prefill opens it) closes the block after
    budget_tokens tokens, as the engine's own run with that budget does."""
    close = reference.tokenizer.token_id("</think>")
    messages = [{"role": "user", "content": "Think first."}]
    _, content, reasoning, _, _ = reference_chat(
        reference, messages, 20, prefill="<think>\n", thinking_budget=5, ignore_eos=True,
        logit_bias={close: -100})
    reply = create(client, messages=messages + [{"role": "assistant", "content": "<think>\n"}],
                   max_tokens=20, thinking={"type": "enabled", "budget_tokens": 5},
                   extra_body={"ignore_eos": True, "logit_bias": {str(close): -100}})
    blocks = [(b.type, b.thinking if b.type == "thinking" else b.text) for b in reply.content]
    assert blocks == [("thinking", reasoning), ("text", content)] and reasoning and content
