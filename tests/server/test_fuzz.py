"""Property: no request body, however wrong its fields and types, gets a 5xx."""
import json

import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                         st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12))
json_values = st.recursive(json_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=8)
roles = st.sampled_from(["system", "developer", "user", "assistant", "tool", "bot", ""])
content = st.one_of(st.text(max_size=40), json_values,
                    st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image"]),
                                                    "text": st.one_of(st.text(max_size=10),
                                                                      json_scalars)}),
                             max_size=2))
tool_call = st.fixed_dictionaries({"id": json_scalars, "type": st.just("function"),
                                   "function": st.fixed_dictionaries({
                                       "name": st.one_of(st.text(max_size=8), json_scalars),
                                       "arguments": st.one_of(st.just('{"a": 1}'),
                                                              st.text(max_size=8),
                                                              json_values)})})
message = st.fixed_dictionaries({"role": roles}, optional={
    "content": content, "tool_calls": st.one_of(st.lists(tool_call, max_size=2), json_values),
    "tool_call_id": json_scalars, "name": json_scalars})
tool = st.fixed_dictionaries({"type": st.sampled_from(["function", "other"]),
                              "function": st.fixed_dictionaries(
                                  {"name": st.one_of(st.text(min_size=1, max_size=8),
                                                     json_scalars)},
                                  optional={"parameters": json_values,
                                            "description": json_scalars})})
small_tokens = st.one_of(st.integers(1, 4), st.integers(-3, 0), json_scalars)
fields = {
    "model": st.one_of(st.just("tiny-server"), json_scalars),
    "temperature": st.one_of(st.floats(0, 2), st.floats(0, 1e-300), json_values),
    "top_p": st.one_of(st.floats(0, 1), json_scalars),
    "top_k": st.one_of(st.integers(-2, 100), json_scalars),
    "min_p": st.one_of(st.floats(0, 1), json_scalars),
    "seed": st.one_of(st.integers(-5, 2**64), json_scalars),
    "stop": st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=5),
                      json_values),
    "presence_penalty": st.one_of(st.floats(-3, 3), json_scalars),
    "frequency_penalty": st.one_of(st.floats(-3, 3), json_scalars),
    "repetition_penalty": st.one_of(st.floats(-1, 3), json_scalars),
    "n": st.one_of(st.integers(0, 3), json_scalars),
    "stream": st.one_of(st.booleans(), json_scalars),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": json_scalars}),
                                json_values),
    "tools": st.one_of(st.lists(tool, max_size=2), json_values),
    "tool_choice": st.one_of(st.sampled_from(["none", "auto", "required", "x"]), json_values,
                             st.just({"type": "function", "function": {"name": "f"}})),
    "response_format": st.one_of(st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "json_object", "json_schema", "yaml"])},
        optional={"json_schema": json_values}), json_values),
    "chat_template_kwargs": st.one_of(st.dictionaries(st.sampled_from(
        ["enable_thinking", "tools", "x"]), json_scalars, max_size=2), json_values),
    "logprobs": json_scalars,
    "top_logprobs": st.one_of(st.integers(-1, 22), json_scalars),
    "echo": json_scalars,
    "suffix": json_scalars,
    "best_of": json_scalars,
    "ignore_eos": json_scalars,
}
chat_body = st.fixed_dictionaries(
    {"max_tokens": small_tokens},
    optional=dict(fields, messages=st.one_of(st.lists(message, max_size=3), json_values),
                  max_completion_tokens=small_tokens))
completion_body = st.fixed_dictionaries(
    {"max_tokens": small_tokens},
    optional=dict(fields, prompt=st.one_of(st.text(max_size=30),
                                           st.lists(st.integers(-5, 5000), max_size=5),
                                           json_values)))

SETTINGS = settings(max_examples=120, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])


def check(live, path, body):
    # No token limit means "up to the context": keep such examples quick.
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_completion_tokens"] = 3
    response = requests.post(live.url + path, data=json.dumps(body), timeout=60,
                             headers={"Content-Type": "application/json"})
    assert response.status_code < 500, (body, response.text)
    if response.status_code >= 400:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["message"]
    elif body.get("stream") is True:
        frames = response.text.split("\n\n")
        assert frames[-2:] == ["data: [DONE]", ""]
        assert not any(f.startswith('data: {"error"') for f in frames)


@SETTINGS
@given(body=chat_body)
def test_random_chat_requests_never_get_a_5xx(live, body):
    check(live, "/v1/chat/completions", body)


@SETTINGS
@given(body=completion_body)
def test_random_completion_requests_never_get_a_5xx(live, body):
    check(live, "/v1/completions", body)


# llama-server's native /completion: random prompts (text, ids, mixes) and its own fields
llama_body = st.fixed_dictionaries(
    {"n_predict": small_tokens},
    optional=dict(fields, prompt=st.one_of(
        st.text(max_size=30), st.lists(st.one_of(st.integers(-5, 5000), st.text(max_size=6)),
                                       max_size=5), json_values),
        n_probs=st.one_of(st.integers(-1, 22), json_scalars), return_tokens=json_scalars,
        n_indent=json_scalars, t_max_predict_ms=json_scalars, response_fields=json_values,
        repeat_penalty=json_scalars))


@SETTINGS
@given(body=llama_body)
def test_random_llama_completion_requests_never_get_a_5xx(live, body):
    response = requests.post(live.url + "/completion", data=json.dumps(body), timeout=60,
                             headers={"Content-Type": "application/json"})
    assert response.status_code < 500, (body, response.text)
    if response.status_code >= 400:
        assert response.json()["error"]["message"]
    elif body.get("stream") is True:
        frames = [f for f in response.text.split("\n\n") if f.startswith("data: {")]
        assert frames and all('"error"' not in f[:20] for f in frames)
        assert json.loads(frames[-1][len("data: "):]).get("stop", True) is True


# Anthropic's Messages API: random blocks, tools and fields
block = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["text", "image", "thinking", "x"])},
                          optional={"text": st.one_of(st.text(max_size=10), json_scalars),
                                    "thinking": json_scalars}),
    st.fixed_dictionaries({"type": st.just("tool_use")},
                          optional={"id": json_scalars, "name": json_scalars,
                                    "input": json_values}),
    st.fixed_dictionaries({"type": st.just("tool_result")},
                          optional={"tool_use_id": json_scalars, "is_error": json_scalars,
                                    "content": st.one_of(st.text(max_size=8), json_values)}),
    json_values)
anthropic_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", ""])},
    optional={"content": st.one_of(st.text(max_size=30), st.lists(block, max_size=3),
                                   json_values)})
anthropic_tool = st.fixed_dictionaries(
    {"name": st.one_of(st.text(min_size=1, max_size=8), json_scalars)},
    optional={"type": st.sampled_from(["custom", "web_search_20250305"]),
              "input_schema": json_values, "description": json_scalars})
messages_body = st.fixed_dictionaries({"max_tokens": small_tokens}, optional={
    "model": fields["model"], "stream": fields["stream"],
    "messages": st.one_of(st.lists(anthropic_message, min_size=1, max_size=3), json_values),
    "system": st.one_of(st.text(max_size=10), st.lists(block, max_size=2), json_values),
    "tools": st.one_of(st.lists(anthropic_tool, max_size=2), json_values),
    "tool_choice": st.one_of(st.fixed_dictionaries(
        {"type": st.sampled_from(["auto", "any", "tool", "none", "x"])},
        optional={"name": json_scalars}), json_values),
    "thinking": st.one_of(st.fixed_dictionaries(
        {"type": st.sampled_from(["enabled", "disabled", "adaptive", "on"])},
        optional={"budget_tokens": json_scalars, "display": json_scalars}), json_values),
    "output_config": st.one_of(st.fixed_dictionaries({}, optional={
        "format": st.one_of(st.fixed_dictionaries({"type": st.just("json_schema")},
                                                  optional={"schema": json_values}),
                            json_values),
        "effort": json_scalars}), json_values),
    "stop_sequences": fields["stop"], "temperature": fields["temperature"],
    "top_p": fields["top_p"], "top_k": fields["top_k"], "seed": fields["seed"],
})

# OpenAI's Responses API: random input items and fields
response_item = st.one_of(
    st.fixed_dictionaries({}, optional={
        "type": st.sampled_from(["message", "reasoning", "item_reference", "x"]),
        "role": roles, "content": content, "summary": json_values}),
    st.fixed_dictionaries({"type": st.just("function_call")}, optional={
        "call_id": json_scalars, "name": json_scalars,
        "arguments": st.one_of(st.just('{"a": 1}'), st.text(max_size=8), json_values)}),
    st.fixed_dictionaries({"type": st.just("function_call_output")}, optional={
        "call_id": json_scalars, "output": st.one_of(st.text(max_size=8), json_values)}),
    json_values)
responses_tool = st.fixed_dictionaries(
    {"type": st.sampled_from(["function", "web_search"])},
    optional={"name": st.one_of(st.text(min_size=1, max_size=8), json_scalars),
              "parameters": json_values, "description": json_scalars})
responses_body = st.fixed_dictionaries({}, optional={
    "model": fields["model"], "stream": fields["stream"],
    "input": st.one_of(st.text(max_size=30), st.lists(response_item, max_size=3), json_values),
    "instructions": json_scalars, "max_output_tokens": small_tokens,
    "tools": st.one_of(st.lists(responses_tool, max_size=2), json_values),
    "tool_choice": st.one_of(st.sampled_from(["none", "auto", "required", "x"]), json_values,
                             st.just({"type": "function", "name": "f"})),
    "text": st.one_of(st.fixed_dictionaries({"format": st.one_of(st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "json_object", "json_schema", "grammar"])},
        optional={"schema": json_values}), json_values)}), json_values),
    "reasoning": st.one_of(st.fixed_dictionaries({}, optional={"effort": json_scalars}),
                           json_values),
    "previous_response_id": json_scalars, "top_logprobs": json_scalars,
    "temperature": fields["temperature"], "top_p": fields["top_p"],
})


def check_named_stream(text: str, last: tuple[str, ...]):
    """A stream of named events that ends with one of `last` and holds no error event."""
    frames = [f for f in text.split("\n\n") if f and not f.startswith(":")]
    names = [f.split("\n")[0][len("event: "):] for f in frames]
    assert names and names[-1] in last, names
    assert "error" not in names and "response.failed" not in names


@SETTINGS
@given(body=messages_body)
def test_random_messages_requests_never_get_a_5xx(live, body):
    response = requests.post(live.url + "/v1/messages", data=json.dumps(body), timeout=60,
                             headers={"Content-Type": "application/json"})
    assert response.status_code < 500, (body, response.text)
    if response.status_code >= 400:
        error = response.json()
        assert error["type"] == "error" and error["error"]["message"]
    elif body.get("stream") is True:
        check_named_stream(response.text, ("message_stop",))


@SETTINGS
@given(body=responses_body)
def test_random_responses_requests_never_get_a_5xx(live, body):
    if body.get("max_output_tokens") is None:
        body["max_output_tokens"] = 3
    response = requests.post(live.url + "/v1/responses", data=json.dumps(body), timeout=60,
                             headers={"Content-Type": "application/json"})
    assert response.status_code < 500, (body, response.text)
    if response.status_code >= 400:
        assert response.json()["error"]["message"]
    elif body.get("stream") is True:
        check_named_stream(response.text, ("response.completed", "response.incomplete"))


# Well-formed bodies of random shape: these reach the engine (the wild ones above mostly stop
# at validation), so the conversion of every block and item kind runs to an answer.
words = st.text(st.sampled_from("abc xyz<>{}\"\n"), max_size=12)
good_block = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": words}),
    st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": st.just("t1"),
                           "content": st.one_of(words, st.lists(st.fixed_dictionaries(
                               {"type": st.just("text"), "text": words}), max_size=2))},
                          optional={"is_error": st.booleans()}))
good_assistant_block = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": words}),
    st.fixed_dictionaries({"type": st.just("thinking"), "thinking": words,
                           "signature": st.just("")}),
    st.fixed_dictionaries({"type": st.just("tool_use"), "id": st.just("t1"),
                           "name": st.sampled_from(["f", "g"]),
                           "input": st.dictionaries(st.sampled_from("ab"), json_scalars,
                                                    max_size=2)}))
FIRST, LAST = {"role": "user", "content": "go"}, {"role": "user", "content": "on"}
good_user_turn = st.fixed_dictionaries({"role": st.just("user"), "content": st.one_of(
    words, st.lists(good_block, min_size=1, max_size=3))})
good_assistant_turn = st.fixed_dictionaries({"role": st.just("assistant"), "content": st.lists(
    good_assistant_block, max_size=3)})
good_turns = st.lists(st.one_of(good_user_turn, good_assistant_turn), min_size=1,
                      max_size=4).map(lambda turns: [FIRST] + turns + [LAST])
# (the user turn last: a last turn with tool_use is refused, rightly)
good_schema = st.sampled_from([{"type": "object"}, {"type": "object", "properties": {
    "a": {"type": "integer"}, "b": {"type": "string"}}, "required": ["a"]}])
good_messages_body = st.fixed_dictionaries(
    {"max_tokens": st.integers(1, 6), "messages": good_turns},
    optional={"stream": st.booleans(), "system": st.one_of(words, st.lists(
        st.fixed_dictionaries({"type": st.just("text"), "text": words}), max_size=2)),
        "tools": st.lists(st.fixed_dictionaries({"name": st.sampled_from(["f", "g"]),
                                                 "input_schema": good_schema}),
                          min_size=1, max_size=2),
        "thinking": st.fixed_dictionaries({"type": st.sampled_from(
            ["enabled", "disabled", "adaptive"])}),
        "output_config": st.fixed_dictionaries({"format": st.fixed_dictionaries(
            {"type": st.just("json_schema"), "schema": good_schema})}),
        "stop_sequences": st.lists(st.text(min_size=1, max_size=2), max_size=2),
        "temperature": st.floats(0, 1), "top_k": st.integers(0, 50)})
good_item = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]),
                           "content": st.one_of(words, st.lists(st.fixed_dictionaries(
                               {"type": st.sampled_from(["input_text", "output_text"]),
                                "text": words}), max_size=2))}),
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": st.just("c1"),
                           "name": st.sampled_from(["f", "g"]),
                           "arguments": st.sampled_from(["{}", '{"a": 1}', ""])}),
    st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": st.just("c1"),
                           "output": words}),
    st.fixed_dictionaries({"type": st.just("reasoning"), "summary": st.lists(
        st.fixed_dictionaries({"type": st.just("summary_text"), "text": words}),
        max_size=2)}))
# a developer message leads (the synth models' template, as Strata's default one, refuses a
# system message after the first turn; Qwen3's render it)
DEVELOPER = st.fixed_dictionaries({"role": st.just("developer"), "content": words})
good_responses_body = st.fixed_dictionaries(
    {"max_output_tokens": st.integers(1, 6),
     "input": st.one_of(words, st.tuples(st.lists(DEVELOPER, max_size=1),
                                         st.lists(good_item, max_size=4)).map(
         lambda parts: parts[0] + [FIRST] + parts[1]))},
    optional={"stream": st.booleans(), "instructions": words,
              "tools": st.lists(st.fixed_dictionaries({
                  "type": st.just("function"), "name": st.sampled_from(["f", "g"]),
                  "parameters": good_schema}), min_size=1, max_size=2),
              "reasoning": st.fixed_dictionaries({"effort": st.sampled_from(
                  ["none", "low", "high"])}),
              "text": st.fixed_dictionaries({"format": st.one_of(
                  st.just({"type": "json_object"}),
                  st.fixed_dictionaries({"type": st.just("json_schema"),
                                         "name": st.just("x"), "schema": good_schema}))}),
              "temperature": st.floats(0, 2), "top_p": st.floats(0.1, 1)})


@SETTINGS
@given(body=good_messages_body)
def test_well_formed_messages_requests_are_answered(live, body):
    response = requests.post(live.url + "/v1/messages", json=body, timeout=60)
    assert response.status_code == 200, (body, response.text)
    if body.get("stream"):
        check_named_stream(response.text, ("message_stop",))
    else:
        message = response.json()
        assert message["type"] == "message" and message["stop_reason"] in (
            "end_turn", "max_tokens", "stop_sequence", "tool_use",
            "model_context_window_exceeded")


@SETTINGS
@given(body=good_responses_body)
def test_well_formed_responses_requests_are_answered(live, body):
    response = requests.post(live.url + "/v1/responses", json=body, timeout=60)
    assert response.status_code == 200, (body, response.text)
    if body.get("stream"):
        check_named_stream(response.text, ("response.completed", "response.incomplete"))
    else:
        assert response.json()["status"] in ("completed", "incomplete")


PARSER_SETTINGS = settings(max_examples=1500, deadline=None, derandomize=True)


def _corrupt(body: dict, pick: int, value, depth: int) -> dict:
    """`body` with one value replaced: a field's (depth 0), or one inside a list field's item
    (depth 1: the item, 2: one of its fields)."""
    key = sorted(body)[pick % len(body)]
    items = body[key]
    if depth == 0 or not isinstance(items, list) or not items:
        return dict(body, **{key: value})
    items = list(items)
    i = pick % len(items)
    if depth == 1 or not isinstance(items[i], dict) or not items[i]:
        items[i] = value
    else:
        items[i] = dict(items[i], **{sorted(items[i])[pick % len(items[i])]: value})
    return dict(body, **{key: items})


def corrupted(bodies):
    """Well-formed bodies with one value anywhere made wrong: each reaches the validation of
    the part it breaks (the wild bodies mostly stop at their first field)."""
    return st.tuples(bodies, st.integers(0, 2**16), st.one_of(json_values, st.just([])),
                     st.integers(0, 2)).map(lambda t: _corrupt(*t))


@PARSER_SETTINGS
@given(body=st.one_of(chat_body, messages_body, responses_body,
                      corrupted(good_messages_body), corrupted(good_responses_body)))
def test_the_parsers_raise_nothing_but_request_errors(body):
    """Each API's parser on wild and on corrupted bodies, far more of them than the live tests
    send: an ApiError naming the problem, or a request; any other exception would be a 500."""
    from strata.server.anthropic_schema import parse_anthropic_request
    from strata.server.api_error import ApiError
    from strata.server.responses_schema import parse_responses_request
    from strata.server.chat_schema import parse_chat_request

    for parse in (parse_chat_request, parse_anthropic_request, parse_responses_request):
        try:
            parse(dict(body), 512)
        except ApiError as exc:
            assert exc.status == 400 and exc.message
