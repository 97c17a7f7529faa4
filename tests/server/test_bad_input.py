"""Every kind of bad request gets a 4xx with an OpenAI-style error body naming the problem,
and the server keeps serving."""
import json

import pytest
import requests

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]


def post(live, path, body=None, data=None, headers=None):
    if data is None:
        data = json.dumps(body)
    headers = {"Content-Type": "application/json", **(headers or {})}
    return requests.post(live.url + path, data=data, headers=headers, timeout=60)


def assert_error(response, status, code=None, param=None, words=()):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    if code is not None:
        assert error["code"] == code
    if param is not None:
        assert error["param"] == param
    for word in words:
        assert word in error["message"], error["message"]
    return error


@pytest.mark.parametrize("data,words", [
    ("{not json", ["not valid JSON"]),
    ("", ["not valid JSON"]),
    ('{"messages": NaN}', ["not valid JSON"]),
    ("[1, 2]", ["must be a JSON object", "an array"]),
    ('"text"', ["must be a JSON object"]),
    ("\xff\xfe", ["not valid JSON"]),
])
def test_malformed_json(live, data, words):
    assert_error(post(live, CHAT, data=data.encode("latin-1")), 400, "invalid_json",
                 words=words)


@pytest.mark.parametrize("field,value,expected", [
    ("messages", "hi", "an array"),
    ("messages", [1], "an object"),
    ("messages", [{"role": "user", "content": 5}], "a string or an array of content parts"),
    ("messages", [{"role": "user", "content": [{"type": "text", "text": 3}]}], "a string"),
    ("max_tokens", "8", "an integer"),
    ("max_tokens", 2.5, "an integer"),
    ("max_tokens", True, "an integer"),
    ("max_completion_tokens", [], "an integer"),
    ("temperature", "hot", "a number"),
    ("top_p", False, "a number"),
    ("top_k", 1.5, "an integer"),
    ("min_p", {}, "a number"),
    ("seed", "1", "an integer"),
    ("stop", 5, "a string or an array of strings"),
    ("stop", ["a", 1], "'stop[1]' must be a string"),
    ("presence_penalty", "x", "a number"),
    ("frequency_penalty", [1], "a number"),
    ("repetition_penalty", "1", "a number"),
    ("stream", "yes", "a boolean"),
    ("ignore_eos", 1, "a boolean"),
    ("stream_options", 1, "an object"),
    ("tools", {}, "an array"),
    ("tools", [{"type": "function", "function": {"name": 3}}], "a non-empty string"),
    ("tool_choice", 3, "a string or an object"),
    ("response_format", "json", "an object"),
    ("chat_template_kwargs", [], "an object"),
    ("model", 7, "a string"),
    ("n", "1", "an integer"),
    ("best_of", "2", "an integer"),
    ("best_of", 1.5, "an integer"),
    ("logit_bias", [1], "an object"),
    ("logit_bias", {"5": "x"}, "a number"),
])
def test_wrong_types(live, field, value, expected):
    body = {"messages": USER, "max_tokens": 2, field: value}
    error = assert_error(post(live, CHAT, body), 400, "invalid_type", words=[expected])
    assert error["param"].split("[")[0].split(".")[0] == field


@pytest.mark.parametrize("field,value,words", [
    ("max_tokens", 0, ["'max_tokens' is 0", "[1, "]),
    ("max_tokens", 2**31, ["2147483648"]),
    ("max_completion_tokens", -3, ["-3"]),
    ("temperature", -0.1, ["temperature", "-0.1"]),
    ("temperature", 1e400, ["temperature"]),
    ("top_p", 10**400, ["top_p", "inf"]),  # an integer past float's range was a 500
    ("top_p", -0.1, ["top_p"]),
    ("min_p", 1.5, ["min_p"]),
    ("presence_penalty", 3, ["presence_penalty"]),
    ("seed", -2, ["seed"]),
    ("n", 17, ["'n' is 17", "[1, 16]"]),
    ("n", 0, ["'n' is 0"]),
    ("best_of", 17, ["'best_of' is 17", "[1, 16]"]),
    ("best_of", 0, ["'best_of' is 0", "[1, 16]"]),
    ("stop", [""], ["stop"]),
    ("stop", ["s"] * 17, ["stop"]),
    ("stop", ["ok", "s" * 4097], ["'stop[1]' holds 4097 characters", "at most 4096"]),
    ("tool_choice", "always", ["tool_choice"]),
    ("tool_choice", "required", ["no 'tools'"]),
    ("tool_choice", {"type": "function", "function": {"name": "nope"}}, ["nope"]),
    ("response_format", {"type": "xml"}, ["response_format.type"]),
    ("logprobs", "yes", ["'logprobs'", "a boolean"]),
    ("top_logprobs", 21, ["'top_logprobs' is 21", "[0, 20]"]),
    ("top_logprobs", 2, ["'top_logprobs' needs 'logprobs': true"]),
    ("chat_template_kwargs", {"messages": []}, ["messages"]),
    ("logit_bias", {"5": 101}, ["'logit_bias.5' is 101.0", "[-100.0, 100.0]"]),
    ("logit_bias", {"abc": 1}, ["'abc'", "token ids"]),
    ("logit_bias", {"-3": 1}, ["'-3'", "token ids"]),
    ("logit_bias", {"10000000": -100}, ["10000000", "vocabulary"]),
    ("logit_bias", {str(i): 1 for i in range(1025)}, ["1025 tokens", "1024"]),
])
def test_values_out_of_range(live, field, value, words):
    body = {"messages": USER, "max_tokens": 2, field: value}
    if field == "temperature" and value == 1e400:
        data = json.dumps(body).replace("Infinity", "1e400")
        assert_error(post(live, CHAT, data=data), 400, words=words)
        return
    assert_error(post(live, CHAT, body), 400, words=words)


@pytest.mark.parametrize("messages,words", [
    ([], ["empty"]),
    (None, ["required"]),
    ([{"role": "wizard", "content": "hi"}], ["wizard", "system, developer, user"]),
    ([{"content": "hi"}], ["role"]),
    ([{"role": "user"}], ["content", "required"]),
    ([{"role": "user", "content": [{"type": "video_url", "video_url": {}}]}], ["video_url"]),
    ([{"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{oops"}}]}],
     ["not valid JSON"]),
])
def test_bad_messages(live, messages, words):
    body = {"max_tokens": 2}
    if messages is not None:
        body["messages"] = messages
    assert_error(post(live, CHAT, body), 400, words=words)


def test_a_message_the_template_refuses_is_named(live_one_system):
    body = {"max_tokens": 2, "messages": [{"role": "user", "content": "a"},
                                          {"role": "system", "content": "late"}]}
    assert_error(post(live_one_system, CHAT, body), 400, words=["system message"])


def test_prompt_longer_than_the_context(live):
    long_text = " ".join(f"word{i}" for i in range(400))
    error = assert_error(post(live, CHAT, {"messages": [{"role": "user", "content": long_text}]}),
                         400, "context_length_exceeded", words=["512", "--ctx-size"])
    assert error["param"] == "messages"
    error = assert_error(post(live, COMPLETIONS, {"prompt": long_text}), 400,
                         "context_length_exceeded")
    assert error["param"] == "prompt"


@pytest.mark.parametrize("body,words", [
    ({}, ["'prompt' is required"]),
    ({"prompt": ""}, ["empty"]),
    ({"prompt": 5}, ["a string or an array of token ids"]),
    ({"prompt": ["a", 5]}, ["array of token ids"]),
    ({"prompt": [1, -5]}, ["-5", "vocabulary"]),
    ({"prompt": [1, 10**6]}, ["1000000"]),
    ({"prompt": "x", "echo": True, "logprobs": -1}, ["'logprobs' is -1"]),
    ({"prompt": "x", "echo": "yes"}, ["'echo'", "a boolean"]),
    ({"prompt": "x", "logprobs": 21}, ["'logprobs' is 21", "[0, 20]"]),
    ({"prompt": "x", "logprobs": True}, ["'logprobs'", "an integer"]),
    ({"prompt": "x", "n": 3, "best_of": 2}, ["'best_of' is 2", "below 'n' (3)", "[3, 16]"]),
    ({"prompt": "x", "best_of": 3, "stream": True}, ["'best_of' is 3", "'stream': true"]),
    ({"prompt": "x", "best_of": 17}, ["'best_of' is 17", "[1, 16]"]),
    ({"prompt": "x", "suffix": "y"}, ["suffix"]),
])
def test_bad_completions(live, body, words):
    assert_error(post(live, COMPLETIONS, body), 400, words=words)


def test_unknown_model(live):
    for path, body in ((CHAT, {"messages": USER}), (COMPLETIONS, {"prompt": "hi"})):
        error = assert_error(post(live, path, dict(body, model="gpt-9")), 404,
                             "model_not_found", "model", ["gpt-9", "tiny-server"])
        assert error
    assert_error(requests.get(live.url + "/v1/models/gpt-9", timeout=10), 404,
                 "model_not_found")


def test_body_over_the_limit(live):
    body = {"messages": [{"role": "user", "content": "x" * (70 * 1024)}]}
    assert_error(post(live, CHAT, body), 413, "request_too_large", words=["64 KiB"])


def test_unknown_endpoint_and_wrong_method(live):
    assert_error(requests.get(live.url + "/v1/embeddings", timeout=10), 404, "not_found",
                 words=["/v1/embeddings"])
    assert_error(requests.post(live.url + "/files/etc/passwd", timeout=10), 404, "not_found")
    response = requests.get(live.url + CHAT, timeout=10)
    assert_error(response, 405, "method_not_allowed", words=["GET"])
    assert "POST" in response.headers["Allow"]
    assert_error(requests.delete(live.url + "/v1/models", timeout=10), 405)


@pytest.mark.parametrize("path,body", [
    (CHAT, '{"messages": [{"role": "user", "content": "a\\ud83d b \\udc00"}], "max_tokens": 2}'),
    (COMPLETIONS, '{"prompt": "\\uD800", "max_tokens": 2, "stop": ["\\udfff"]}'),
    ("/v1/messages", '{"model": "tiny-server", "max_tokens": 2, "messages": [{"role": "user", '
                     '"content": [{"type": "text", "text": "x\\ud800"}]}]}'),
    ("/v1/responses", '{"input": "half \\ud83d of a pair", "max_output_tokens": 2}'),
])
def test_half_a_utf16_pair_is_read_as_a_replacement_character(live, path, body):
    # JSON may escape one half of a surrogate pair alone: no character, but no reason to fail
    response = post(live, path, data=body)
    assert response.status_code == 200, response.text


def test_server_still_serves_after_bad_input(live):
    response = post(live, CHAT, {"messages": USER, "max_tokens": 2, "temperature": 0})
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] >= 1
    assert requests.get(live.url + "/health", timeout=10).json() == {"status": "ok"}


def test_api_key_rejections(live_keyed):
    from conftest import API_KEY

    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": API_KEY},
                    {"Authorization": "Basic " + API_KEY}, {"Authorization": "Bearer é"}):
        for method, path in (("get", "/v1/models"), ("post", CHAT), ("get", "/metrics"),
                             ("get", "/nowhere")):
            response = requests.request(method, live_keyed.url + path, headers=headers,
                                        json={"messages": USER}, timeout=10)
            assert_error(response, 401, "invalid_api_key", words=["Authorization: Bearer"])
    assert requests.get(live_keyed.url + "/health", timeout=10).status_code == 200
    ok = requests.get(live_keyed.url + "/metrics", timeout=10,
                      headers={"Authorization": f"Bearer {API_KEY}"})
    assert ok.status_code == 200


def test_chunked_body_over_the_limit(live):
    def chunks():
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(80):
            yield b"x" * 1024
        yield b'"}]}'
    response = requests.post(live.url + CHAT, data=chunks(), timeout=30,
                             headers={"Content-Type": "application/json"})
    assert_error(response, 413, "request_too_large")


def test_huge_body_is_refused_by_waitress_before_buffering(live):
    response = requests.post(live.url + CHAT, data=b"x" * (300 * 1024), timeout=30)
    assert response.status_code == 413
