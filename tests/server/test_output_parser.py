"""The incremental output parser: reasoning, tool calls (JSON and XML forms), partial tags, and
the same result at every split point of sample outputs."""
import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strata.server.output_parser import (ContentDelta, OutputParser, ReasoningDelta, ToolCall,
                                         parse_complete, parse_tool_call_body)


def ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def run_pieces(pieces, **kwargs):
    """Feeds pieces one by one; returns (events merged by kind, is_cut)."""
    parser = OutputParser(new_id=ids(), **kwargs)
    events = []
    for piece in pieces:
        events += parser.feed(piece)
    is_cut = parser.is_inside_tool_call
    events += parser.finish()
    return merge(events), is_cut


def merge(events):
    """Adjacent deltas of one kind joined: the form in which splits must agree."""
    out = []
    for event in events:
        is_text = isinstance(event, (ContentDelta, ReasoningDelta))
        if out and type(event) is type(out[-1]) and is_text:
            out[-1] = type(event)(out[-1].text + event.text)
        else:
            out.append(event)
    return out


SAMPLES = [
    # (output text, kwargs, expected merged events, ended inside a call)
    ("Hello world", {}, [ContentDelta("Hello world")], False),
    ("<think>\nI should greet.\n</think>\n\nHello!", {},
     [ReasoningDelta("I should greet."), ContentDelta("Hello!")], False),
    ("I should greet.\n</think>\n\nHi", {"starts_in_reasoning": True},
     [ReasoningDelta("I should greet."), ContentDelta("Hi")], False),
    ("Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
     "{\"city\": \"Paris\"}}\n</tool_call>",
     {}, [ContentDelta("Let me check."),
          ToolCall(0, "call_0", "get_weather", '{"city": "Paris"}')], False),
    ("<tool_call>\n{\"name\": \"a\", \"arguments\": {}}\n</tool_call>\n<tool_call>\n"
     "{\"name\": \"b\", \"arguments\": {\"x\": [1, 2]}}\n</tool_call>", {},
     [ToolCall(0, "call_0", "a", "{}"), ToolCall(1, "call_1", "b", '{"x": [1, 2]}')], False),
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco\n</parameter>\n"
     "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>", {},
     [ToolCall(0, "call_0", "get_weather", '{"city": "San Francisco", "days": 3}')], False),
    ("<think>plan</think>ok <tool_call>\n{\"name\": \"f\", \"arguments\": {\"q\": \"<b>\"}}",
     {}, [ReasoningDelta("plan"),
          ContentDelta("ok <tool_call>\n{\"name\": \"f\", \"arguments\": {\"q\": \"<b>\"}}")],
     True),
    ("a < b and c <tool d", {}, [ContentDelta("a < b and c <tool d")], False),
    ("text ends with <tool_", {}, [ContentDelta("text ends with <tool_")], False),
    ("<tool_call>{\"name\": \"f\"}</tool_call> x", {"parse_tools": False},
     [ContentDelta("<tool_call>{\"name\": \"f\"}</tool_call> x")], False),
    ("<tool_call>not json</tool_call>", {}, [ContentDelta("<tool_call>not json</tool_call>")],
     False),
    ("Text\n\n<tool_call>\nnot json\n</tool_call>\n\nmore", {},
     [ContentDelta("Text\n\n<tool_call>\nnot json\n</tool_call>\n\nmore")], False),
    ("Write `<tool_call>` then the JSON.\nDone.", {},
     [ContentDelta("Write `<tool_call>` then the JSON.\nDone.")], True),
    ("Strip them: re.sub(r'<think>.*?</think>', '', s)", {},
     [ContentDelta("Strip them: re.sub(r'<think>.*?</think>', '', s)")], False),
    ("\n<think>\nhm\n</think>\n\nok <think>x</think>", {},
     [ReasoningDelta("hm"), ContentDelta("ok <think>x</think>")], False),
    ("plan</think>\n\n<think>more</think>", {"starts_in_reasoning": True},
     [ReasoningDelta("plan"), ContentDelta("<think>more</think>")], False),
    ("line\n\n", {}, [ContentDelta("line\n\n")], False),
    ("<think>\nunfinished thought", {}, [ReasoningDelta("unfinished thought")], False),
]


@pytest.mark.parametrize("text,kwargs,expected,is_cut", SAMPLES)
def test_whole_output(text, kwargs, expected, is_cut):
    assert run_pieces([text], **kwargs) == (expected, is_cut)


@pytest.mark.parametrize("text,kwargs,expected,is_cut", SAMPLES)
def test_every_single_split_point(text, kwargs, expected, is_cut):
    for i in range(len(text) + 1):
        assert run_pieces([text[:i], text[i:]], **kwargs) == (expected, is_cut), i


@pytest.mark.parametrize("text,kwargs,expected,is_cut", SAMPLES)
def test_every_pair_of_split_points(text, kwargs, expected, is_cut):
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            pieces = [text[:i], text[i:j], text[j:]]
            assert run_pieces(pieces, **kwargs) == (expected, is_cut), (i, j)


@pytest.mark.parametrize("text,kwargs,expected,is_cut", SAMPLES)
def test_character_by_character(text, kwargs, expected, is_cut):
    assert run_pieces(list(text), **kwargs) == (expected, is_cut)


def test_partial_tag_is_held_back_until_decided():
    parser = OutputParser(new_id=ids())
    assert parser.feed("Sure <tool_") == [ContentDelta("Sure")]
    assert parser.feed("call>\n{\"name\": \"f\", ") == []
    assert parser.is_inside_tool_call
    assert parser.feed("\"arguments\": {\"a\": 1}}\n</tool_call>") == [
        ToolCall(0, "call_0", "f", '{"a": 1}')]
    assert parser.finish() == []
    assert parser.num_tool_calls == 1


def test_held_prefix_that_is_not_a_tag_is_released():
    parser = OutputParser()
    assert parser.feed("x <thi") == [ContentDelta("x")]
    assert parser.feed("s is fine") == [ContentDelta(" <this is fine")]


def test_finish_sends_a_cut_call_as_text_and_reports_it():
    parser = OutputParser()
    assert parser.feed("Sure.\n<tool_call>\n{\"name\": \"f\", \"argu") == [
        ContentDelta("Sure.")]
    assert parser.is_inside_tool_call
    assert parser.finish() == [ContentDelta("\n<tool_call>\n{\"name\": \"f\", \"argu")]
    assert not parser.is_inside_tool_call and parser.num_tool_calls == 0


def test_reasoning_close_tag_in_content_is_plain_text():
    assert parse_complete("a </think> b") == ("a </think> b", "", [], False)


def test_xml_string_parameters_keep_their_text_when_declared_strings():
    body = "<function=f>\n<parameter=zip>\n01234\n</parameter>\n</function>"
    assert parse_tool_call_body(body, {"f": {"zip": "string"}}) == ("f", {"zip": "01234"})
    assert parse_tool_call_body(body) == ("f", {"zip": "01234"})  # not JSON: stays text
    body = "<function=f>\n<parameter=n>\n42\n</parameter>\n</function>"
    assert parse_tool_call_body(body, {"f": {"n": "string"}}) == ("f", {"n": "42"})
    assert parse_tool_call_body(body, {"f": {"n": "integer"}}) == ("f", {"n": 42})


@pytest.mark.parametrize("body", [
    "", "{}", "[1]", '{"name": 3}', '{"name": ""}', '{"name": "f", "arguments": [1]}',
    '{"name": "f", "arguments": "not json"}',
    "<function=f>junk<parameter=a>\n1\n</parameter>\n</function>", "<function=>\n</function>",
])
def test_unreadable_call_bodies(body):
    assert parse_tool_call_body(body) is None


def test_arguments_given_as_a_json_string_are_decoded():
    body = json.dumps({"name": "f", "arguments": json.dumps({"a": "b"})})
    assert parse_tool_call_body(body) == ("f", {"a": "b"})


def test_unicode_and_ids_are_stable():
    parser = OutputParser()
    events = parser.feed("<tool_call>{\"name\": \"f\", \"arguments\": {\"t\": \"héllo ☃\"}}"
                         "</tool_call>")
    (call,) = events
    assert call.id.startswith("call_") and len(call.id) == 29
    assert json.loads(call.arguments) == {"t": "héllo ☃"}


# pieces of model output that make tags, near-tags, calls and text when joined
FRAGMENTS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "\n", " ", "\n\n", "a",
             "é☃", "<", "<tool_", "</thi", "<th", '{"name": "f", "arguments": {"x": 1}}',
             "not json", "<function=g>", "<parameter=p>", "</parameter>", "</function>",
             "x <think>"]


@settings(max_examples=400, deadline=None, derandomize=True)
@given(st.lists(st.sampled_from(FRAGMENTS), max_size=14), st.data(), st.booleans(),
       st.booleans())
def test_any_split_gives_the_whole_outputs_events(parts, data, starts_in_reasoning, tools):
    text = "".join(parts)
    kwargs = {"starts_in_reasoning": starts_in_reasoning, "parse_tools": tools}
    whole = run_pieces([text], **kwargs)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    assert run_pieces(pieces, **kwargs) == whole
    assert run_pieces(list(text), **kwargs) == whole


@settings(max_examples=400, deadline=None, derandomize=True)
@given(st.lists(st.sampled_from(FRAGMENTS[:13] + ["not json", "<function=g>"]), max_size=14))
def test_an_answer_without_a_call_or_a_leading_think_comes_back_whole(parts):
    """Tags in an answer's text (a `<tool_call>` never closed or holding no call, a `<think>`
    after the answer began) and the whitespace around them are the client's text."""
    text = "x" + "".join(parts)
    assert parse_complete(text, parse_tools=True)[:3] == (text, "", [])


def test_xml_values_of_a_nullable_string_stay_strings():
    """A parameter typed ["string", "null"] keeps `123` as the string it is (it was decoded to
    the number 123), and `null` as null."""
    from strata.server.prompting import _param_types

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"properties": {
        "s": {"type": ["string", "null"]}, "n": {"type": ["integer", "null"]}}}}}]
    types = _param_types(tools)
    body = ("<function=f>\n<parameter=s>\n123\n</parameter>\n<parameter=n>\n7\n</parameter>"
            "\n</function>")
    assert parse_tool_call_body(body, types) == ("f", {"s": "123", "n": 7})
    body = "<function=f>\n<parameter=s>\nnull\n</parameter>\n</function>"
    assert parse_tool_call_body(body, types) == ("f", {"s": None})
