"""Request fields that become engine parameters (server/schema.py, server/prompting.py)."""
import pytest

from strata.server.api_error import ApiError
from strata.server.prompting import sampling_params
from strata.server.anthropic_schema import parse_anthropic_request
from strata.server.responses_schema import parse_responses_request
from strata.server.chat_schema import parse_chat_request

USER = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("extra,held", [
    ({}, False),
    ({"response_format": {"type": "text"}}, False),
    ({"response_format": {"type": "json_object"}}, True),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, True),
    ({"response_format": {"type": "json_object"}, "tools": [TOOL]}, False),
    ({"response_format": {"type": "json_object"}, "tools": [TOOL], "tool_choice": "none"}, True),
    ({"response_format": {"type": "json_object"}, "tools": [TOOL],
      "tool_choice": "required"}, False),
])
def test_json_formats_hold_the_answer_unless_a_tool_may_answer(extra, held):
    req = parse_chat_request({"messages": USER, **extra}, 512)
    assert req.options.json_object is held
    assert sampling_params(req.options, 10, 512, 1000).json_object is held


def test_logit_bias_reaches_the_engine_and_ids_are_checked():
    req = parse_chat_request({"messages": USER, "logit_bias": {"7": -100, "12": 2.5}}, 512)
    assert sampling_params(req.options, 10, 512, 1000).logit_bias == {7: -100.0, 12: 2.5}
    with pytest.raises(ApiError) as info:
        sampling_params(req.options, 10, 512, 10)
    assert info.value.param == "logit_bias.12"


def test_json_schema_reaches_the_engine():
    schema = {"type": "object", "properties": {"x": {"type": "number"}}}
    req = parse_chat_request({"messages": USER, "response_format": {
        "type": "json_schema", "json_schema": {"name": "p", "schema": schema}}}, 512)
    assert sampling_params(req.options, 10, 512, 1000).json_schema == schema
    req = parse_chat_request({"messages": USER, "response_format": {"type": "json_object"}}, 512)
    assert sampling_params(req.options, 10, 512, 1000).json_schema is None


@pytest.mark.parametrize("body,parse", [
    ({"messages": USER, "tools": [TOOL]}, parse_chat_request),
    ({"input": "hi", "tools": [{"type": "function", "name": "f"}]}, parse_responses_request),
    ({"max_tokens": 8, "messages": USER, "tools": [{"name": "f", "input_schema": {}}]},
     parse_anthropic_request),
])
def test_one_call_when_calls_are_not_parallel(body, parse):
    """parallel_tool_calls false (Anthropic: tool_choice.disable_parallel_tool_use) holds an
    answer with held tool calls to one call; with calls not held there is nothing to limit."""
    def serial(value):
        if parse is parse_anthropic_request:
            return dict(body, tool_choice={"type": "auto", "disable_parallel_tool_use": value})
        return dict(body, parallel_tool_calls=not value if isinstance(value, bool) else value)

    for request, expected in ((body, None), (serial(False), None), (serial(True), 1)):
        options = parse(request, 512).options
        options.held_tool_calls = [{"name": "f"}]
        assert sampling_params(options, 10, 512, 1000).max_tool_calls == expected
        options.held_tool_calls = None
        assert sampling_params(options, 10, 512, 1000).max_tool_calls is None
    with pytest.raises(ApiError) as info:
        parse(serial("no"), 512)
    assert "a boolean" in info.value.message


def test_a_grammar_reaches_the_engine_and_its_faults_are_named():
    """llama.cpp's `grammar` on OpenAI's endpoints as llama-server takes it (and on its own,
    test_llama_completion.py); "" is none; a fault is a 400 naming its place; a JSON format or
    held tool calls exclude it."""
    gbnf = 'root ::= "yes" | "no"'
    for body, parse in (({"messages": USER}, parse_chat_request),
                        ({"input": "hi"}, parse_responses_request)):
        options = parse(dict(body, grammar=gbnf), 512).options
        assert sampling_params(options, 10, 512, 1000).grammar == gbnf
        assert parse(dict(body, grammar=""), 512).options.grammar is None
        with pytest.raises(ApiError) as info:
            parse(dict(body, grammar="root ::= yes"), 512)
        assert info.value.param == "grammar"
        assert "'yes' is used but not defined at line 1, column 10" in info.value.message
    options = parse_chat_request({"messages": USER, "grammar": gbnf,
                                  "response_format": {"type": "json_object"}}, 512).options
    with pytest.raises(ApiError) as info:
        sampling_params(options, 10, 512, 1000)
    assert info.value.param == "grammar" and "send one of them" in info.value.message
    options = parse_chat_request({"messages": USER, "grammar": gbnf, "tools": [TOOL]},
                                 512).options
    options.held_tool_calls = [{"name": "f"}]  # as the template's rendering sets them
    with pytest.raises(ApiError):
        sampling_params(options, 10, 512, 1000)


def test_repeat_last_n_reaches_the_engine():
    """llama.cpp's repeat_last_n (the repetition penalty's window) on every endpoint that
    takes its sampling fields; below -1 is a 400 naming it."""
    req = parse_chat_request({"messages": USER, "repeat_last_n": 64,
                              "repetition_penalty": 1.1}, 512)
    assert sampling_params(req.options, 10, 512, 1000).repeat_last_n == 64
    assert sampling_params(parse_chat_request({"messages": USER}, 512).options,
                           10, 512, 1000).repeat_last_n == -1
    with pytest.raises(ApiError) as info:
        parse_chat_request({"messages": USER, "repeat_last_n": -2}, 512)
    assert info.value.param == "repeat_last_n"


@pytest.mark.parametrize("key,off,on", [
    ("typical_p", 1.0, 0.9), ("mirostat", 0, 2), ("dry_multiplier", 0.0, 0.8),
    ("xtc_probability", 0, 0.5), ("dynatemp_range", 0.0, 0.5), ("top_n_sigma", -1.0, 1.5),
])
def test_samplers_it_lacks_are_refused_only_when_turned_on(key, off, on):
    """llama.cpp's samplers this server has not: their off values (what front ends send by
    default) pass; a value that turns one on is a 400 naming it, on every endpoint."""
    for body, parse in (({"messages": USER}, parse_chat_request),
                        ({"input": "hi"}, parse_responses_request)):
        parse(dict(body, **{key: off}), 512)
        with pytest.raises(ApiError) as info:
            parse(dict(body, **{key: on}), 512)
        assert info.value.param == key and "no such sampler" in info.value.message
        with pytest.raises(ApiError) as info:
            parse(dict(body, **{key: "x"}), 512)
        assert info.value.param == key and "a number" in info.value.message


def test_llama_json_schema_on_the_chat_endpoint():
    """llama-server's top-level `json_schema` on /v1/chat/completions: a json_schema response
    format; beside a response_format or a grammar, or of another root type, a 400."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}}
    req = parse_chat_request({"messages": USER, "json_schema": schema}, 512)
    assert req.response_format == {"type": "json_schema", "json_schema": {"schema": schema}}
    params = sampling_params(req.options, 10, 512, 1000)
    assert params.json_object and params.json_schema == schema
    for extra, words in (({"response_format": {"type": "json_object"}}, "send one of them"),
                         ({"grammar": 'root ::= "a"'}, "send one of them"),
                         ({"json_schema": {"type": "array"}}, "of type 'object'")):
        with pytest.raises(ApiError) as info:
            parse_chat_request(dict({"messages": USER, "json_schema": schema}, **extra), 512)
        assert info.value.param == "json_schema" and words in info.value.message


@pytest.mark.parametrize("response_format, param", [
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "array"}}},
     "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"type": ["string", "null"]}},
     "response_format.json_schema"),
])
def test_a_response_format_whose_root_is_not_an_object_is_refused(response_format, param):
    """The answer is held to a JSON object (as OpenAI's structured outputs): another root type
    was answered with an object the schema refuses."""
    with pytest.raises(ApiError) as info:
        parse_chat_request({"messages": USER, "response_format": response_format}, 512)
    assert info.value.param == param and "of type 'object'" in info.value.message
    fine = {"type": "json_schema", "json_schema": {"schema": {"type": ["object", "null"]}}}
    assert parse_chat_request({"messages": USER, "response_format": fine}, 512).options.json_object


def test_top_p_zero_keeps_the_most_likely_token():
    """OpenAI and llama.cpp take top_p 0 (the smallest set whose mass reaches it: one token);
    it was a 400 here."""
    options = parse_chat_request({"messages": USER, "top_p": 0, "top_k": 40}, 512).options
    assert options.top_k == 1 and options.top_p is None
    params = sampling_params(options, 10, 512, 1000)
    assert params.top_k == 1
