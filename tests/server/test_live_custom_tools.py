"""Custom tools on /v1/responses (`{"type": "custom"}`: free-form input, as Codex CLI sends
apply_patch when its config asks for the freeform tool): offered to the template as a function
of one string argument, answered as custom_tool_call items, and their calls and outputs read
back from the conversation."""
import json
import re

import openai
import pytest
import requests

from strata.server.responses_schema import parse_responses_request

MODEL_ID = "tiny-server"
GRAMMAR = 'start: "*** Begin Patch" LF body "*** End Patch" LF?\nbody: /(.|\\n)*/\nLF: "\\n"'
PATCH = {"type": "custom", "name": "apply_patch", "description": "Edit files with a patch.",
         "format": {"type": "grammar", "syntax": "lark", "definition": GRAMMAR}}
# a grammar whose every text ends soon: the random model's forced input is held to it
SHORT = 'start: "*** Begin Patch" LF ("+" /[a-z]{0,6}/ LF) ~ 1..2 "*** End Patch"\nLF: "\\n"'
SHORT_RE = r"\*\*\* Begin Patch\n(\+[a-z]{0,6}\n){1,2}\*\*\* End Patch"
SHORT_PATCH = dict(PATCH, format={"type": "grammar", "syntax": "lark", "definition": SHORT})
SHELL = {"type": "function", "name": "shell", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}


@pytest.fixture(scope="module")
def client(live):
    with openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0,
                       timeout=60) as client:
        yield client


def test_a_custom_tool_is_a_function_of_its_input():
    req = parse_responses_request({"input": "hi", "tools": [PATCH, SHELL],
                                   "tool_choice": {"type": "custom", "name": "apply_patch"}},
                                  512)
    patch = req.tools[0]["function"]
    assert patch["name"] == "apply_patch" and patch["description"] == PATCH["description"]
    assert patch["parameters"]["required"] == ["input"]
    assert GRAMMAR in patch["parameters"]["properties"]["input"]["description"]
    assert req.tools[1]["function"]["name"] == "shell"
    assert req.tool_choice == {"type": "function", "function": {"name": "apply_patch"}}


def test_a_forced_custom_call_is_a_custom_tool_call_item(client, live, reference):
    tok = reference.tokenizer  # the tiny model's text is random: a closing quote ends it
    bias = {str(tok.token_id(t)): b for t, b in (('"', 8), ("}", 4))}
    kwargs = dict(model=MODEL_ID, input="Add a README.", tools=[SHORT_PATCH, SHELL],
                  tool_choice={"type": "custom", "name": "apply_patch"},
                  max_output_tokens=200, temperature=0, reasoning={"effort": "none"},
                  extra_body={"logit_bias": bias})
    reply = client.responses.create(**kwargs)
    calls = [item for item in reply.output if item.type == "custom_tool_call"]
    assert len(calls) == 1, reply.output
    call = calls[0]
    assert call.name == "apply_patch" and re.fullmatch(SHORT_RE, call.input), call.input
    assert call.call_id.startswith("call_") and call.id.startswith("ctc_")
    assert not [item for item in reply.output if item.type == "function_call"]
    # streamed: the same item, its input in delta / done events
    body = dict(kwargs, stream=True, logit_bias=bias)
    del body["extra_body"]
    with requests.post(live.url + "/v1/responses", json=body, stream=True, timeout=60) as raw:
        payloads = [json.loads(line[len("data: "):]) for line in
                    raw.iter_lines(decode_unicode=True) if line.startswith("data: ")]
    kinds = [p["type"] for p in payloads]
    assert "response.function_call_arguments.delta" not in kinds
    deltas = [p["delta"] for p in payloads
              if p["type"] == "response.custom_tool_call_input.delta"]
    done = [p for p in payloads if p["type"] == "response.custom_tool_call_input.done"]
    assert "".join(deltas) == done[0]["input"] == call.input
    items = [p["item"] for p in payloads if p["type"] == "response.output_item.done"
             and p["item"]["type"] == "custom_tool_call"]
    assert [(item["name"], item["input"]) for item in items] == [("apply_patch", call.input)]
    final = [item for item in payloads[-1]["response"]["output"]
             if item["type"] == "custom_tool_call"]
    assert [item["input"] for item in final] == [call.input]


def test_custom_calls_and_outputs_render_as_function_turns(client):
    patch = "*** Begin Patch\n*** Add File: a.txt\n+hi\n*** End Patch\n"
    as_custom = client.responses.create(
        model=MODEL_ID, tools=[PATCH], max_output_tokens=1, temperature=0, input=[
            {"role": "user", "content": "Add a.txt."},
            {"type": "custom_tool_call", "call_id": "call_1", "name": "apply_patch",
             "input": patch},
            {"type": "custom_tool_call_output", "call_id": "call_1", "output": "Done."}])
    tool = parse_responses_request({"input": "x", "tools": [PATCH]}, 512).tools[0]["function"]
    as_function = client.responses.create(
        model=MODEL_ID, max_output_tokens=1, temperature=0,
        tools=[{"type": "function", **tool}], input=[
            {"role": "user", "content": "Add a.txt."},
            {"type": "function_call", "call_id": "call_1", "name": "apply_patch",
             "arguments": json.dumps({"input": patch})},
            {"type": "function_call_output", "call_id": "call_1", "output": "Done."}])
    assert as_custom.usage.input_tokens == as_function.usage.input_tokens


@pytest.mark.parametrize("tools, param, words", [
    ([dict(PATCH, format={"type": "json"})], "tools[0].format.type", "'json'"),
    ([dict(PATCH, format={"type": "grammar", "syntax": "ebnf", "definition": "x"})],
     "tools[0].format.syntax", "'ebnf'"),
    ([dict(PATCH, format={"type": "grammar", "syntax": "lark"})],
     "tools[0].format.definition", "grammar"),
    ([{"type": "custom"}], "tools[0].name", "non-empty string"),
    ([PATCH, dict(SHELL, name="apply_patch")], "tools", "twice"),
])
def test_bad_custom_tools_name_the_field(live, tools, param, words):
    response = requests.post(live.url + "/v1/responses", timeout=60, json={
        "model": MODEL_ID, "input": "hi", "tools": tools})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"]


def test_a_custom_call_item_without_input_is_refused(live):
    response = requests.post(live.url + "/v1/responses", timeout=60, json={
        "model": MODEL_ID, "tools": [PATCH], "input": [
            {"role": "user", "content": "hi"},
            {"type": "custom_tool_call", "call_id": "c", "name": "apply_patch"}]})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "input[1].input"


@pytest.mark.parametrize("syntax, definition", [("regex", r"[0-9]{3}-[a-z]{2}"),
                                                ("regex", r"(?=x)[0-9]+"),  # shown only
                                                ("lark", 'start: N "-" N\nN: /[0-9]/')])
def test_a_custom_tools_input_is_held_to_its_grammar(live, reference, caplog, syntax,
                                                     definition):
    """Where the grammar converts, the forced input is a text of it (the random model would
    write anything else); where it does not, the request is served and the log says so."""
    tok = reference.tokenizer
    bias = {str(tok.token_id(t)): b for t, b in (('"', 8), ("}", 4))}
    tool = dict(PATCH, name="code", format={"type": "grammar", "syntax": syntax,
                                            "definition": definition})
    body = {"model": MODEL_ID, "input": "Write a code.", "tools": [tool],
            "tool_choice": {"type": "custom", "name": "code"}, "max_output_tokens": 60,
            "temperature": 0, "reasoning": {"effort": "none"}, "logit_bias": bias}
    with caplog.at_level("WARNING", logger="strata.server"):
        reply = requests.post(live.url + "/v1/responses", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    calls = [item for item in reply.json()["output"] if item["type"] == "custom_tool_call"]
    if "(?=" in definition:
        assert "not held" in caplog.text and "lookaround" in caplog.text
        return
    assert len(calls) == 1, reply.json()["output"]
    expected = definition if syntax == "regex" else r"[0-9]-[0-9]"
    assert re.fullmatch(expected, calls[0]["input"]), calls[0]["input"]


def test_a_converter_fault_leaves_the_tool_shown_only(monkeypatch, caplog):
    from strata.engine import lark_grammar
    from strata.server.responses_schema import custom_tool_grammars

    def broken(text):
        raise IndexError("a converter bug")

    monkeypatch.setattr(lark_grammar, "lark_to_gbnf", broken)
    with caplog.at_level("ERROR", logger="strata.server"):
        assert custom_tool_grammars([PATCH]) == {}
    assert "converting its lark grammar failed" in caplog.text
    assert parse_responses_request({"input": "hi", "tools": [PATCH]}, 512).input_grammars == {}
