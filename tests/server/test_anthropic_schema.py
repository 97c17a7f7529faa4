"""Anthropic Messages bodies become the chat endpoint's requests, field by field; the parser's
events become content blocks and stream events in Anthropic's order."""
import pytest

from strata.server.anthropic_format import (BlockStream, content_blocks, error_body,
                                            stop_reason, usage)
from strata.server.anthropic_schema import parse_anthropic_request
from strata.server.api_error import ApiError
from strata.server.output_parser import ContentDelta, ReasoningDelta, ToolCall

N_CTX = 4096
TOOL = {"name": "read_file", "description": "Read a file",
        "input_schema": {"type": "object", "properties": {"path": {"type": "string"}},
                         "required": ["path"]}}


def parse(**body):
    body.setdefault("max_tokens", 64)
    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    return parse_anthropic_request(body, N_CTX)


def refused(param=None, words=(), **body):
    with pytest.raises(ApiError) as info:
        parse(**body)
    assert info.value.status == 400
    if param is not None:
        assert info.value.param == param
    for word in words:
        assert word in info.value.message, info.value.message
    return info.value


def test_a_tool_round_trip_becomes_tool_calls_and_tool_messages():
    req = parse(system=[{"type": "text", "text": "You code."},
                        {"type": "text", "text": "Be brief.", "cache_control": {"type": "x"}}],
                tools=[TOOL], messages=[
                    {"role": "user", "content": [{"type": "text", "text": "Show a.py"}]},
                    {"role": "assistant", "content": [
                        {"type": "thinking", "thinking": "Read it.", "signature": "s"},
                        {"type": "text", "text": "Reading."},
                        {"type": "tool_use", "id": "toolu_1", "name": "read_file",
                         "input": {"path": "a.py"}}]},
                    {"role": "user", "content": [
                        {"type": "tool_result", "tool_use_id": "toolu_1",
                         "content": [{"type": "text", "text": "print(1)"}]},
                        {"type": "text", "text": "Explain."},
                        {"type": "text", "text": "Briefly."}]}])
    assert req.messages == [
        {"role": "system", "content": "You code.\n\nBe brief."},
        {"role": "user", "content": "Show a.py"},
        {"role": "assistant", "content": "Reading.", "reasoning_content": "Read it.",
         "tool_calls": [{"id": "toolu_1", "type": "function",
                         "function": {"name": "read_file", "arguments": {"path": "a.py"}}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "print(1)"},
        {"role": "user", "content": "Explain.\n\nBriefly."}]
    assert req.tools == [{"type": "function", "function": {
        "name": "read_file", "description": "Read a file", "parameters": TOOL["input_schema"]}}]
    assert req.tool_choice == "auto" and req.assistant_prefill == ""


def test_a_failed_tool_result_says_so_and_a_string_result_is_kept():
    req = parse(tools=[TOOL], messages=[
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "read_file",
                                           "input": {}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t", "content": "no such file",
             "is_error": True},
            {"type": "tool_result", "tool_use_id": "t"}]}])
    assert req.messages[2:] == [{"role": "tool", "tool_call_id": "t",
                                 "content": "Error: no such file"},
                                {"role": "tool", "tool_call_id": "t", "content": ""}]


def test_a_last_assistant_turn_is_the_start_of_the_answer():
    req = parse(messages=[{"role": "user", "content": "Count"},
                          {"role": "assistant", "content": "One, two,"}])
    assert req.messages == [{"role": "user", "content": "Count"}]
    assert req.assistant_prefill == "One, two,"
    refused("messages[1].content", ["tool_result"], tools=[TOOL], messages=[
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "read_file",
                                           "input": {}}]}])
    refused("messages", ["start with a user turn"],
            messages=[{"role": "assistant", "content": "Hi"}])


@pytest.mark.parametrize("choice,expected", [
    (None, "auto"), ({"type": "auto"}, "auto"), ({"type": "any"}, "required"),
    ({"type": "none"}, "none"),
    ({"type": "tool", "name": "read_file"}, {"type": "function",
                                             "function": {"name": "read_file"}})])
def test_tool_choice(choice, expected):
    assert parse(tools=[TOOL], tool_choice=choice).tool_choice == expected


def test_generation_fields_and_extensions():
    req = parse(max_tokens=100000, stop_sequences=["\n\nHuman:"], temperature=0.5, top_p=0.9,
                top_k=20, stream=True, seed=3, logit_bias={"7": -100},
                thinking={"type": "disabled"}, chat_template_kwargs={"x": 1})
    options = req.options
    assert options.max_tokens == N_CTX  # clipped to the context, not refused
    assert options.stop == ["\n\nHuman:"] and options.temperature == 0.5
    assert (options.top_p, options.top_k, options.is_stream) == (0.9, 20, True)
    assert options.seed == 3 and options.logit_bias == {7: -100.0}
    assert req.chat_template_kwargs == {"x": 1, "enable_thinking": False}
    assert parse(thinking={"type": "adaptive", "display": "omitted"}).chat_template_kwargs == \
        {"enable_thinking": True}
    assert parse().chat_template_kwargs == {}
    budgets = [parse(thinking=t).options.thinking_budget for t in (
        {"type": "enabled", "budget_tokens": 2048}, {"type": "enabled"},
        {"type": "adaptive", "budget_tokens": 9}, {"type": "disabled"}, None)]
    assert budgets == [2048, None, None, None, None]


def test_output_config_holds_the_answer_to_its_schema_unless_tools_may_answer():
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    config = {"format": {"type": "json_schema", "schema": schema}, "effort": "low"}
    req = parse(output_config=config)
    assert req.options.json_object and req.options.json_schema == schema
    assert req.response_format == {"type": "json_schema", "json_schema": {"schema": schema}}
    assert not parse(output_config=config, tools=[TOOL]).options.json_object
    assert parse(output_config=config, tools=[TOOL],
                 tool_choice={"type": "none"}).options.json_object


def test_a_prefill_cannot_start_a_held_json_answer():
    config = {"format": {"type": "json_schema", "schema": {"type": "object"}}}
    prefilled = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "{"}]
    refused("messages", ["prefill", "output_config.format"], output_config=config,
            messages=prefilled)
    assert parse(output_config=config, tools=[TOOL], messages=prefilled).assistant_prefill == "{"


def test_count_tokens_needs_no_max_tokens():
    body = {"messages": [{"role": "user", "content": "hi"}], "model": "m"}
    req = parse_anthropic_request(body, N_CTX, is_count_only=True)
    assert req.model == "m" and req.options.max_tokens is None


@pytest.mark.parametrize("body,param,words", [
    ({"max_tokens": None}, "max_tokens", ["required"]),
    ({"max_tokens": "8"}, "max_tokens", ["an integer"]),
    ({"max_tokens": 0}, "max_tokens", ["outside"]),
    ({"messages": None}, "messages", ["required"]),
    ({"messages": []}, "messages", ["empty"]),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role", ["'system'"]),
    ({"messages": [{"role": "user"}]}, "messages[0].content", ["required"]),
    ({"messages": [{"role": "user", "content": []}]}, "messages[0].content", ["empty"]),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content",
     ["a string or an array of content blocks"]),
    ({"messages": [{"role": "user", "content": [{"type": "video", "source": {}}]}]},
     "messages[0].content[0].type", ["'video'", "text-only"]),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]},
     "messages[0].content[0].text", ["a string"]),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
     "messages[0].content[0].tool_use_id", ["required"]),
    ({"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t",
         "content": [{"type": "video", "source": {}}]}]}]},
     "messages[0].content[0].content[0].type", ["'video'"]),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": [
        {"type": "tool_use", "name": "f", "input": "{}"}]}, {"role": "user", "content": "y"}]},
     "messages[1].content[0].input", ["an object"]),
    ({"system": [{"type": "image"}]}, "system[0].type", ["'image'"]),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type",
     ["runs no tools itself"]),
    ({"tools": [{"name": "f"}]}, "tools[0].input_schema", ["required"]),
    ({"tools": [{"name": "", "input_schema": {}}]}, "tools[0].name", ["non-empty"]),
    ({"tool_choice": {"type": "any"}}, "tool_choice", ["no 'tools'"]),
    ({"tool_choice": {"type": "tool", "name": "g"}, "tools": [TOOL]}, "tool_choice.name",
     ["'g'", "read_file"]),
    ({"tool_choice": {"type": "maybe"}}, "tool_choice.type", ["'maybe'"]),
    ({"stop_sequences": "x"}, "stop_sequences", ["an array of strings"]),
    ({"stop_sequences": [""]}, "stop_sequences", ["non-empty"]),
    ({"stop_sequences": ["x" * 5000]}, "stop_sequences[0]", ["5000 characters", "at most 4096"]),
    ({"temperature": 1.5}, "temperature", ["outside"]),
    ({"thinking": {"type": "on"}}, "thinking.type", ["'on'"]),
    ({"thinking": {"type": "adaptive", "display": "full"}}, "thinking.display", ["'full'"]),
    ({"output_config": {"format": {"type": "regex"}}}, "output_config.format.type",
     ["json_schema"]),
    ({"output_config": {"format": {"type": "json_schema"}}}, "output_config.format.schema",
     ["required"]),
    ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "string"}}}},
     "output_config.format.schema", ["'string'", "of type 'object'"]),
    ({"output_config": {"effort": "huge"}}, "output_config.effort", ["'huge'"]),
    ({"logit_bias": {"x": 1}}, "logit_bias.x", ["token ids"]),
    # a nested field is named by its path, in the message too
    ({"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "is_error": "yes"}]}]},
     "messages[0].content[0].is_error", ["'messages[0].content[0].is_error'", "a boolean"]),
    ({"thinking": {"type": "enabled", "budget_tokens": -1}}, "thinking.budget_tokens",
     ["'thinking.budget_tokens' is -1"]),
    ({"thinking": {"type": "enabled", "budget_tokens": "many"}}, "thinking.budget_tokens",
     ["'thinking.budget_tokens'", "an integer"]),
    ({"tool_choice": {"type": "auto", "disable_parallel_tool_use": "yes"}},
     "tool_choice.disable_parallel_tool_use",
     ["'tool_choice.disable_parallel_tool_use'", "a boolean"]),
])
def test_bad_fields_name_the_field(body, param, words):
    refused(param, words, **body)


def test_content_blocks_group_runs_and_keep_tool_inputs():
    events = [ReasoningDelta("Let me "), ReasoningDelta("look."), ContentDelta("Sure."),
              ToolCall(0, "toolu_a", "read_file", '{"path": "a.py"}'), ContentDelta(" Done")]
    assert content_blocks(events) == [
        {"type": "thinking", "thinking": "Let me look.", "signature": ""},
        {"type": "text", "text": "Sure."},
        {"type": "tool_use", "id": "toolu_a", "name": "read_file", "input": {"path": "a.py"}},
        {"type": "text", "text": " Done"}]
    assert content_blocks(events[:2], is_thinking_omitted=True) == [
        {"type": "thinking", "thinking": "", "signature": ""}]


def test_block_stream_events_in_order():
    stream = BlockStream()
    out = []
    for event in [ReasoningDelta("a"), ReasoningDelta("b"), ContentDelta("c"),
                  ToolCall(0, "toolu_a", "f", "{}"), ToolCall(1, "toolu_b", "g", '{"x": 1}')]:
        out += stream.feed(event)
    out += stream.finish()
    assert [(e["type"], e["index"]) for e in out] == [
        ("content_block_start", 0), ("content_block_delta", 0), ("content_block_delta", 0),
        ("content_block_stop", 0), ("content_block_start", 1), ("content_block_delta", 1),
        ("content_block_stop", 1), ("content_block_start", 2), ("content_block_delta", 2),
        ("content_block_stop", 2), ("content_block_start", 3), ("content_block_delta", 3),
        ("content_block_stop", 3)]
    assert out[0]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}
    assert out[2]["delta"] == {"type": "thinking_delta", "thinking": "b"}
    assert out[5]["delta"] == {"type": "text_delta", "text": "c"}
    assert out[10]["content_block"] == {"type": "tool_use", "id": "toolu_b", "name": "g",
                                        "input": {}}
    assert out[11]["delta"] == {"type": "input_json_delta", "partial_json": '{"x": 1}'}
    hidden = BlockStream(is_thinking_omitted=True)
    assert [e["type"] for e in hidden.feed(ReasoningDelta("a")) + hidden.finish()] == [
        "content_block_start", "content_block_stop"]
    assert BlockStream().finish() == []


@pytest.mark.parametrize("finish,calls,stop,full,expected", [
    ("length", 0, None, False, "max_tokens"),
    ("length", 0, None, True, "model_context_window_exceeded"),
    ("stop", 0, None, False, "end_turn"),
    ("stop", 0, "END", False, "stop_sequence"),
    ("stop", 2, "END", False, "tool_use"),
    (None, 0, None, False, "max_tokens")])
def test_stop_reasons(finish, calls, stop, full, expected):
    assert stop_reason(finish, calls, stop, full) == expected


def test_usage_counts_cached_tokens_apart():
    assert usage(100, 60, 7) == {"input_tokens": 40, "cache_creation_input_tokens": 0,
                                 "cache_read_input_tokens": 60, "output_tokens": 7}


@pytest.mark.parametrize("status,kind", [
    (400, "invalid_request_error"), (401, "authentication_error"), (404, "not_found_error"),
    (405, "invalid_request_error"), (413, "request_too_large"), (500, "api_error"),
    (503, "overloaded_error")])
def test_error_types(status, kind):
    body = error_body(ApiError(status, "what went wrong", param="p", code="c"))
    assert body == {"type": "error", "error": {"type": kind, "message": "what went wrong",
                                               "param": "p", "code": "c"}}
