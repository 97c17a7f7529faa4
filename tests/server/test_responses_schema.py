"""Responses API bodies become the chat endpoint's requests, item by item; the parser's events
become output items and stream events in OpenAI's order."""
import json

import pytest

from strata.server.api_error import ApiError
from strata.server.output_parser import ContentDelta, OutputParser, ReasoningDelta, ToolCall
from strata.server.responses_format import OutputItems, TextLogprobs, usage
from strata.server.responses_schema import parse_responses_request

N_CTX = 4096
TOOL = {"type": "function", "name": "shell", "description": "Run a command",
        "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}},
                       "required": ["cmd"]}, "strict": False}


def parse(**body):
    body.setdefault("input", "hi")
    return parse_responses_request(body, N_CTX)


def refused(param, words=(), **body):
    with pytest.raises(ApiError) as info:
        parse(**body)
    assert info.value.status == 400 and info.value.param == param, info.value.message
    for word in words:
        assert word in info.value.message, info.value.message


def test_a_codex_style_conversation_becomes_chat_messages():
    req = parse(instructions="You are a coding agent.", tools=[TOOL], input=[
        {"type": "message", "role": "developer",
         "content": [{"type": "input_text", "text": "Sandbox: read-only."}]},
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "List "}, {"type": "input_text", "text": "files"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text",
                                                         "text": "Use ls."}]},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Running ls."}]},
        {"type": "function_call", "call_id": "call_1", "name": "shell",
         "arguments": "{\"cmd\": \"ls\"}"},
        {"type": "function_call", "call_id": "call_2", "name": "shell", "arguments": ""},
        {"type": "function_call_output", "call_id": "call_1", "output": "a.py"},
        {"type": "function_call_output", "call_id": "call_2",
         "output": [{"type": "input_text", "text": "b.py"}]},
        {"role": "user", "content": "Thanks"}])
    assert req.messages == [
        {"role": "system", "content": "You are a coding agent.\n\nSandbox: read-only."},
        {"role": "user", "content": "List files"},
        {"role": "assistant", "content": "Running ls.", "reasoning_content": "Use ls.",
         "tool_calls": [
             {"id": "call_1", "type": "function",
              "function": {"name": "shell", "arguments": {"cmd": "ls"}}},
             {"id": "call_2", "type": "function",
              "function": {"name": "shell", "arguments": {}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "a.py"},
        {"role": "tool", "tool_call_id": "call_2", "content": "b.py"},
        {"role": "user", "content": "Thanks"}]
    assert req.tools == [{"type": "function", "function": {
        "name": "shell", "description": "Run a command", "parameters": TOOL["parameters"]}}]


def test_a_function_call_without_a_message_opens_an_assistant_turn():
    req = parse(input=[{"role": "user", "content": "go"},
                       {"type": "function_call", "call_id": "c", "name": "f",
                        "arguments": "{}"}])
    assert req.messages[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": {}}}]}


def test_each_reasoning_item_stays_with_the_assistant_turn_after_it():
    def reasoning(text):
        return {"type": "reasoning", "summary": [{"type": "summary_text", "text": text}]}

    req = parse(input=[
        {"role": "user", "content": "a"}, reasoning("R1"),
        {"role": "assistant", "content": "Looking."}, reasoning("R2"),
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c", "output": "x"}, reasoning("R3"),
        {"role": "user", "content": "b"}, {"role": "assistant", "content": "B"}])
    turns = [m for m in req.messages if m["role"] == "assistant"]
    # both of the first turn's; none of the last (R3 was followed by no assistant item)
    assert turns[0]["reasoning_content"] == "R1\n\nR2" and turns[0]["tool_calls"]
    assert "reasoning_content" not in turns[1]


def test_generation_fields_and_extensions():
    req = parse(max_output_tokens=10**6, temperature=0.2, top_p=0.5, stream=True, top_k=7,
                seed=4, stop=["END"], logit_bias={"3": 5}, reasoning={"effort": "none"},
                text={"format": {"type": "json_schema", "name": "p",
                                 "schema": {"type": "object"}}})
    options = req.options
    assert options.max_tokens == N_CTX and options.is_stream
    assert (options.temperature, options.top_p, options.top_k, options.seed) == (0.2, 0.5, 7, 4)
    assert options.stop == ["END"] and options.logit_bias == {3: 5.0}
    assert req.chat_template_kwargs == {"enable_thinking": False}
    assert options.json_object and options.json_schema == {"type": "object"}
    assert parse(reasoning={"effort": "high"}).chat_template_kwargs == {"enable_thinking": True}
    assert parse(text={"format": {"type": "json_object"}}).options.json_object
    assert not parse(text={"format": {"type": "text"}}).options.json_object


@pytest.mark.parametrize("choice,expected", [
    (None, "auto"), ("required", "required"), ("none", "none"),
    ({"type": "function", "name": "shell"},
     {"type": "function", "function": {"name": "shell"}})])
def test_tool_choice(choice, expected):
    assert parse(tools=[TOOL], tool_choice=choice).tool_choice == expected


@pytest.mark.parametrize("body,param,words", [
    ({"input": None}, "input", ["required"]),
    ({"input": 5}, "input", ["a string or an array"]),
    ({"input": []}, "input", ["no message"]),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role", ["'robot'"]),
    ({"input": [{"role": "user"}]}, "input[0].content", ["required"]),
    ({"input": [{"role": "user", "content": [{"type": "input_video", "video_url": "x"}]}]},
     "input[0].content[0].type", ["'input_video'", "images, audio and files"]),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type", ["keeps no"]),
    ({"input": [{"type": "computer_call", "id": "c"}]}, "input[0].type", ["function_call"]),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
     "input[0].call_id", ["required"]),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{x"}]},
     "input[0].arguments", ["not valid JSON"]),
    ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input[0].output",
     ["required"]),
    ({"previous_response_id": "resp_1"}, "previous_response_id", ["whole conversation"]),
    ({"conversation": "conv_1"}, "conversation", ["whole conversation"]),
    ({"background": True}, "background", []),
    ({"top_logprobs": 21}, "top_logprobs", ["21", "[0, 20]"]),
    ({"include": "message.output_text.logprobs"}, "include", ["an array of strings"]),
    ({"max_output_tokens": 0}, "max_output_tokens", ["outside"]),
    ({"temperature": 3}, "temperature", ["outside"]),
    ({"tools": [{"type": "local_shell"}]}, "tools[0].type", ["'function' and 'custom' tools"]),
    ({"tools": [{"type": "function", "name": ""}]}, "tools[0].name", ["non-empty"]),
    ({"tool_choice": {"type": "function", "name": "nope"}, "tools": [TOOL]}, "tool_choice",
     ["'nope'", "shell"]),
    ({"tool_choice": {"type": "allowed_tools"}}, "tool_choice.type", ["'allowed_tools'"]),
    ({"text": {"format": {"type": "grammar"}}}, "text.format.type", ["'grammar'"]),
    ({"text": {"format": {"type": "json_schema"}}}, "text.format.schema", ["required"]),
    ({"text": {"format": {"type": "json_schema", "schema": {"type": "array"}}}},
     "text.format.schema", ["'array'", "of type 'object'"]),
    ({"reasoning": {"effort": "max"}}, "reasoning.effort", ["'max'"]),
    # echoed in the response object, whose metadata maps strings to strings
    ({"metadata": 5}, "metadata", ["an object"]),
    ({"metadata": {"run": 7}}, "metadata.run", ["a string"]),
])
def test_bad_fields_name_the_field(body, param, words):
    refused(param, words, **body)


def test_output_items_and_their_events():
    items = OutputItems()
    events = []
    for event in [ReasoningDelta("Think"), ReasoningDelta("ing."), ContentDelta("Hi"),
                  ContentDelta("!"), ToolCall(0, "call_a", "shell", '{"cmd": "ls"}'),
                  ContentDelta("Done")]:
        events += items.feed(event)
    events += items.finish()
    assert [(e["type"], e.get("output_index")) for e in events] == [
        ("response.output_item.added", 0), ("response.content_part.added", 0),
        ("response.reasoning_text.delta", 0), ("response.reasoning_text.delta", 0),
        ("response.reasoning_text.done", 0), ("response.content_part.done", 0),
        ("response.output_item.done", 0),
        ("response.output_item.added", 1), ("response.content_part.added", 1),
        ("response.output_text.delta", 1), ("response.output_text.delta", 1),
        ("response.output_text.done", 1), ("response.content_part.done", 1),
        ("response.output_item.done", 1),
        ("response.output_item.added", 2), ("response.function_call_arguments.delta", 2),
        ("response.function_call_arguments.done", 2), ("response.output_item.done", 2),
        ("response.output_item.added", 3), ("response.content_part.added", 3),
        ("response.output_text.delta", 3), ("response.output_text.done", 3),
        ("response.content_part.done", 3), ("response.output_item.done", 3)]
    reasoning, message, call, last = items.items
    assert reasoning["type"] == "reasoning" and reasoning["id"].startswith("rs_")
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "Thinking."}]
    assert message["content"] == [{"type": "output_text", "text": "Hi!", "annotations": [],
                                   "logprobs": []}]
    assert (message["role"], message["status"]) == ("assistant", "completed")
    assert {k: call[k] for k in ("type", "call_id", "name", "arguments", "status")} == {
        "type": "function_call", "call_id": "call_a", "name": "shell",
        "arguments": '{"cmd": "ls"}', "status": "completed"}
    assert events[7]["item"]["status"] == "in_progress" and events[7]["item"]["content"] == []
    assert events[14]["item"]["arguments"] == ""  # added empty, then its delta
    # each event's item_id names its item; the done event carries the whole item
    assert all(e["item_id"] == items.items[e["output_index"]]["id"]
               for e in events if "item_id" in e)
    assert events[13]["item"] == message and last["content"][0]["text"] == "Done"
    assert json.loads(json.dumps(events)) == events


@pytest.mark.parametrize("pieces,message", [
    (["<think>", "Hm", " ", "</think>", "\n\n", "Hi", " ", "there"], "Hi there"),
    (["Sure", " ", "<tool_call>", '{"name": "f", "arguments": {}}', "</tool_call>", "\n\n",
      "Done", " ", "<tool_call>", "{bad"], "SureDone <tool_call>{bad")])
def test_text_logprobs_are_those_of_the_text_passed_on(pieces, message):
    """Each token one piece (its entry names it): the message's entries spell its text,
    without the reasoning, the tool call or the whitespace the parser drops; a call cut off
    comes out as text with its tokens."""
    parser, text_logprobs = OutputParser(parse_tools=True), TextLogprobs()
    text = spelled = ""
    for i, piece in enumerate(pieces):
        was = (parser.is_in_reasoning, parser.is_inside_tool_call)
        events = parser.feed(piece) + (parser.finish() if i == len(pieces) - 1 else [])
        taken = text_logprobs.feed([{"token": piece}], piece, was, parser, events)
        for event, entries in zip(events, taken, strict=True):
            if isinstance(event, ContentDelta):
                text += event.text
                spelled += "".join(entry["token"] for entry in entries)
            else:
                assert entries == []
    assert text == spelled == message


def test_usage():
    assert usage(100, 60, 7, 3) == {
        "input_tokens": 100, "input_tokens_details": {"cached_tokens": 60,
                                                      "cache_write_tokens": 0},
        "output_tokens": 7, "output_tokens_details": {"reasoning_tokens": 3},
        "total_tokens": 107}
