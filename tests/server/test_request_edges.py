"""Edge cases of request fields found by auditing (session 63): each is a 400 naming the
field, never a 500, on every API that takes the field."""
import json

import pytest
import requests

from strata.server.anthropic_schema import parse_anthropic_request
from strata.server.api_error import ApiError
from strata.server.chat_schema import parse_chat_request
from strata.server.openai_format import chat_deltas, sse
from strata.server.output_parser import OutputParser, ToolCall
from strata.server.responses_schema import parse_responses_request
from strata.server.schema import parse_json_body

USER = [{"role": "user", "content": "hi"}]


def _error(parse, body) -> ApiError:
    with pytest.raises(ApiError) as caught:
        parse(body, 512)
    assert caught.value.status == 400
    return caught.value


@pytest.mark.parametrize("parse,body", [
    (parse_chat_request, {"messages": USER}),
    (parse_responses_request, {"input": "hi"}),
    (parse_anthropic_request, {"messages": USER, "max_tokens": 4}),
])
@pytest.mark.parametrize("key", ["9" * 5000, "1" + "0" * 4400, "7" * 13])
def test_a_logit_bias_key_of_many_digits_is_a_400(parse, body, key):
    # int() refuses strings of over 4300 digits: that was a ValueError, answered 500
    error = _error(parse, {**body, "logit_bias": {key: 1}})
    assert "outside any vocabulary" in error.message
    assert error.param.startswith("logit_bias.") and len(error.param) < 40


def test_a_logit_bias_key_with_leading_zeros_is_its_token():
    req = parse_chat_request({"messages": USER, "logit_bias": {"0" * 5000 + "17": 3}}, 512)
    assert req.options.logit_bias == {17: 3.0}


@pytest.mark.parametrize("schema", ["bad", 5, ["type", "object"], True])
def test_a_json_schema_that_is_no_object_is_a_400(schema):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "strict": True,
                                                  "schema": schema}}
    error = _error(parse_chat_request, {"messages": USER, "response_format": fmt})
    assert error.param == "response_format.json_schema.schema"
    assert "an object" in error.message


def test_a_null_json_schema_is_as_if_left_out():
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": None}}
    req = parse_chat_request({"messages": USER, "response_format": fmt}, 512)
    assert req.options.json_object
    assert req.options.json_schema == {"name": "x"}


@pytest.mark.parametrize("stop", ["", 0, False, "abc", {}])
def test_anthropic_stop_sequences_that_are_no_array_are_a_400(stop):
    # "", 0 and false were read as no stop sequences at all
    error = _error(parse_anthropic_request, {"messages": USER, "max_tokens": 4,
                                             "stop_sequences": stop})
    assert error.param == "stop_sequences" and "an array of strings" in error.message


@pytest.mark.parametrize("parse, key", [(parse_anthropic_request, "stop_sequences"),
                                        (parse_chat_request, "stop")])
def test_a_stop_array_names_its_item_that_is_no_string(parse, key):
    # the whole array's type was named ("got an array"), not the item at fault
    body = {"messages": USER, "max_tokens": 4, key: ["a", 5]}
    error = _error(parse, body)
    assert error.param == f"{key}[1]", error.message
    assert error.message == f"'{key}[1]' must be a string, got a number.", error.message


def test_a_template_refusing_responses_input_names_input(live_one_system):
    # the chat template refuses a system message after a user one: on the Responses API the
    # conversation is 'input' (there is no 'messages' field to fix)
    body = {"input": [{"role": "user", "content": "hi"}, {"role": "system", "content": "s"}],
            "max_output_tokens": 16}
    response = requests.post(live_one_system.url + "/v1/responses", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "template_error" and error["param"] == "input"


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-32"])
def test_a_lone_surrogate_in_a_utf16_body_becomes_a_replacement(encoding):
    # json.loads reads UTF-16 and -32 bodies too; the scan for lone surrogates read only
    # UTF-8's bytes, so one passed through to the answer, whose encoding then failed
    raw = '{"a": "x\\ud800y", "b": ["\\udfff"], "\\udc00": 1}'.encode(encoding)
    body = parse_json_body(raw)
    assert body == {"a": "x\ufffdy", "b": ["\ufffd"], "\ufffd": 1}


def test_a_utf16_body_with_a_lone_surrogate_is_answered_whole(live):
    raw = ('{"input": "hi", "instructions": "x\\ud800y", "metadata": {"k": "\\udc00"}, '
           '"max_output_tokens": 4, "stream": true}').encode("utf-16")
    response = requests.post(live.url + "/v1/responses", data=raw, timeout=60,
                             headers={"Content-Type": "application/json"})
    assert response.status_code == 200, response.text
    assert response.text.rstrip().splitlines()[-1].startswith("data: ")
    assert "response.completed" in response.text or "response.incomplete" in response.text
    assert '"instructions": "x\ufffdy"' in response.text


def test_a_tool_call_escaping_half_a_utf16_pair_streams():
    # the model writes JSON: "\ud800" in a call's arguments decoded to a lone surrogate, which
    # the arguments' JSON kept raw, and the streamed chunk then failed to encode (a cut stream)
    parser = OutputParser(parse_tools=True)
    text = ('<tool_call>{"name": "f\\ud800", "arguments": {"a": "x\\ud800", '
            '"\\udc00": ["\\udfff", "\\ud83d\\ude00"]}}</tool_call>')
    events = parser.feed(text) + parser.finish()
    calls = [e for e in events if isinstance(e, ToolCall)]
    assert len(calls) == 1
    call = calls[0]
    assert call.name == "f\ufffd"
    # the arguments mean what the model wrote, and their text is UTF-8 as it is
    assert json.loads(call.arguments) == {"a": "x\ud800", "\udc00": ["\udfff", "\U0001f600"]}
    for delta in chat_deltas(call):
        sse({"choices": [{"delta": delta}]}).encode("utf-8")
