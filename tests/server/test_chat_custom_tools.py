"""Custom tools on /v1/chat/completions (`{"type": "custom", "custom": {name, description,
format}}`, its grammar under format.grammar): offered as a function of one string argument,
the input held to the grammar, answered as custom tool calls (whole: the SDK's
ChatCompletionMessageCustomToolCall; streamed: `{"type": "custom", "custom": {name, input}}`
deltas, the shape OpenAI's stream has), and read back from the conversation."""
import json
import re

import openai
import pytest
import requests

from strata.server.chat_schema import parse_tools

MODEL_ID = "tiny-server"
CODE = {"type": "custom", "custom": {
    "name": "code", "description": "A code.",
    "format": {"type": "grammar", "grammar": {"syntax": "regex",
                                              "definition": r"[0-9]{3}-[a-z]{2}"}}}}
SHELL = {"type": "function", "function": {"name": "shell", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}


@pytest.fixture(scope="module")
def client(live):
    with openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0,
                       timeout=60) as client:
        yield client


def forced(reference, **extra) -> dict:
    tok = reference.tokenizer  # the tiny model's text is random: a closing quote ends it
    bias = {str(tok.token_id(t)): b for t, b in (('"', 8), ("}", 4))}
    return dict(model=MODEL_ID, messages=[{"role": "user", "content": "A code, please."}],
                tools=[CODE, SHELL], tool_choice={"type": "custom", "custom": {"name": "code"}},
                max_tokens=60, temperature=0, logit_bias=bias, reasoning_effort="none", **extra)


def test_a_forced_custom_call_is_a_custom_tool_call(client, reference):
    reply = client.chat.completions.create(**forced(reference))
    calls = reply.choices[0].message.tool_calls
    assert len(calls) == 1, reply.choices[0].message
    call = calls[0]
    assert call.type == "custom" and call.custom.name == "code"
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", call.custom.input), call.custom.input
    assert call.id.startswith("call_")


def test_a_streamed_custom_call_comes_in_custom_deltas(live, client, reference):
    whole = client.chat.completions.create(**forced(reference)).choices[0].message.tool_calls[0]
    with requests.post(live.url + "/v1/chat/completions", json=forced(reference, stream=True),
                       stream=True, timeout=60) as raw:
        chunks = [json.loads(line[len("data: "):]) for line in raw.iter_lines(
            decode_unicode=True) if line.startswith("data: ") and line != "data: [DONE]"]
    deltas = [d for c in chunks for choice in c["choices"]
              for d in choice["delta"].get("tool_calls", [])]
    assert deltas[0]["type"] == "custom" and deltas[0]["custom"]["name"] == "code"
    assert all("function" not in d for d in deltas)
    assert "".join(d["custom"]["input"] for d in deltas) == whole.custom.input


def test_a_custom_call_and_its_output_render_as_a_function_turn(client):
    """The history's custom call is its function's call of its input, as the template sees
    it: the same prompt as the function form sends."""
    def prompt_tokens(tools, call):
        return client.chat.completions.create(
            model=MODEL_ID, max_tokens=1, temperature=0, tools=tools, messages=[
                {"role": "user", "content": "A code."},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "Done."}]
        ).usage.prompt_tokens

    as_function = parse_tools([CODE])[0]  # what the template is given for CODE
    custom = prompt_tokens([CODE], {"id": "call_1", "type": "custom",
                                    "custom": {"name": "code", "input": "123-ab"}})
    function = prompt_tokens([as_function], {
        "id": "call_1", "type": "function",
        "function": {"name": "code", "arguments": json.dumps({"input": "123-ab"})}})
    assert custom == function


@pytest.mark.parametrize("tools, param", [
    ([{"type": "custom"}], "tools[0].custom"),
    ([{"type": "custom", "custom": {"name": "c", "format": {"type": "grammar"}}}],
     "tools[0].custom.format.grammar"),
    ([{"type": "custom", "custom": {"name": "c", "format": {
        "type": "grammar", "grammar": {"syntax": "ebnf", "definition": "x"}}}}],
     "tools[0].custom.format.syntax"),
    ([{"type": "custom", "custom": {"name": ""}}], "tools[0].custom.name"),
    ([{"type": "retrieval"}], "tools[0].type"),
])
def test_bad_custom_tools_name_the_field(live, tools, param):
    response = requests.post(live.url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "tools": tools})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_a_custom_call_without_input_is_refused(live):
    response = requests.post(live.url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL_ID, "tools": [CODE], "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "tool_calls": [{"id": "c", "type": "custom",
                                                  "custom": {"name": "code"}}]}]})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "messages[1].tool_calls[0].custom.input"
