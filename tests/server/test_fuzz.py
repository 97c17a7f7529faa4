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
