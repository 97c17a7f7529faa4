"""Requests shaped as coding agents send them (written here after the shapes Claude Code and
Codex CLI send: system blocks with cache_control, tool schemas with $schema and
additionalProperties, a tool round trip in the history, thinking / reasoning items, extra
fields the server does not use) go through /v1/messages and /v1/responses streamed, end with
their last event, and reach the template whole."""
import json

import pytest
import requests

from strata.config import EngineConfig
from strata.engine.engine import Engine
from strata.server.app import ServerConfig

from conftest import start_live_server

BASH = {"name": "Bash", "description": "Run a shell command.", "input_schema": {
    "$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
    "properties": {"command": {"type": "string", "description": "The command"},
                   "timeout": {"type": "number"},
                   "run_in_background": {"type": "boolean"}},
    "required": ["command"], "additionalProperties": False}}
EDIT = {"name": "Edit", "description": "Replace text in a file.", "input_schema": {
    "type": "object", "properties": {
        "file_path": {"type": "string"}, "old_string": {"type": "string"},
        "new_string": {"type": "string"}, "replace_all": {"type": "boolean", "default": False},
        "edits": {"type": "array", "items": {"type": "object", "properties": {
            "old": {"type": "string"}, "new": {"type": "string"}}}}},
    "required": ["file_path", "old_string", "new_string"], "additionalProperties": False}}

CLAUDE_CODE_LIKE = {
    "model": "tiny-server", "max_tokens": 32000, "stream": True,
    "metadata": {"user_id": "user_abc_account_1_session_2"},
    "system": [{"type": "text", "text": "You are an interactive CLI coding agent.",
                "cache_control": {"type": "ephemeral"}},
               {"type": "text", "text": "Working directory: /repo"}],
    "tools": [BASH, EDIT],
    "tool_choice": {"type": "auto"},
    "thinking": {"type": "enabled", "budget_tokens": 4000},
    "messages": [
        {"role": "user", "content": [
            {"type": "text", "text": "<system-reminder>Be careful.</system-reminder>"},
            {"type": "text", "text": "Run the tests.", "cache_control": {"type": "ephemeral"}}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Run pytest.", "signature": "c2ln"},
            {"type": "text", "text": "Running them."},
            {"type": "tool_use", "id": "toolu_01", "name": "Bash",
             "input": {"command": "pytest -q", "timeout": 120000}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_01",
             "content": [{"type": "text", "text": "3 passed"}]},
            {"type": "text", "text": "Now fix the warning.",
             "cache_control": {"type": "ephemeral"}}]}],
}

CODEX_LIKE = {
    "model": "tiny-server", "instructions": "You are Codex, a coding agent.", "stream": True,
    "store": False, "parallel_tool_calls": False, "tool_choice": "auto",
    "reasoning": {"effort": "medium", "summary": "auto"},
    "include": ["reasoning.encrypted_content"], "prompt_cache_key": "0193-session",
    "text": {"verbosity": "medium"},
    "tools": [{"type": "function", "name": "shell", "description": "Runs a command.",
               "strict": False, "parameters": {
                   "type": "object", "properties": {
                       "command": {"type": "array", "items": {"type": "string"}},
                       "workdir": {"type": "string"}, "timeout_ms": {"type": "number"}},
                   "required": ["command"], "additionalProperties": False}}],
    "input": [
        {"type": "message", "role": "developer",
         "content": [{"type": "input_text", "text": "<permissions>sandboxed</permissions>"}]},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "<environment_context>/repo"
                      "</environment_context>"}]},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "List the files."}]},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "encrypted_content": "gAAAAB-opaque"},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "shell",
         "arguments": "{\"command\": [\"ls\"]}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "a.py\nb.py"},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Two files."}]},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "Open a.py."}]}],
    "max_output_tokens": 24,
}


@pytest.fixture(scope="module")
def agent_server(model_path):
    """A server with room for an agent's prompt (its tools' schemas alone take hundreds of
    tokens)."""
    server = start_live_server(Engine(EngineConfig(model_path, n_ctx=2048, threads=2)),
                               ServerConfig(model_id="tiny-server"))
    yield server
    server.stop()


def named_events(text: str) -> list[tuple[str, dict]]:
    frames = [f for f in text.split("\n\n") if f and not f.startswith(":")]
    return [(f.split("\n")[0][len("event: "):], json.loads(f.split("\n")[1][len("data: "):]))
            for f in frames]


@pytest.mark.parametrize("max_tokens", [24, 32000])
def test_a_claude_code_shaped_request(agent_server, reference, max_tokens):
    body = dict(CLAUDE_CODE_LIKE, max_tokens=max_tokens)
    response = requests.post(agent_server.url + "/v1/messages", json=body, timeout=120)
    assert response.status_code == 200, response.text
    events = named_events(response.text)
    assert events[0][0] == "message_start" and events[-1][0] == "message_stop"
    usage = events[-2][1]["usage"]
    # the template saw the whole conversation: the same prompt as the chat-form messages
    messages = [
        {"role": "system", "content": "You are an interactive CLI coding agent.\n\n"
                                      "Working directory: /repo"},
        {"role": "user", "content": "<system-reminder>Be careful.</system-reminder>\n\n"
                                    "Run the tests."},
        {"role": "assistant", "content": "Running them.", "reasoning_content": "Run pytest.",
         "tool_calls": [{"id": "toolu_01", "type": "function", "function": {
             "name": "Bash", "arguments": {"command": "pytest -q", "timeout": 120000}}}]},
        {"role": "tool", "tool_call_id": "toolu_01", "content": "3 passed"},
        {"role": "user", "content": "Now fix the warning."}]
    tools = [{"type": "function", "function": {"name": t["name"], "description":
                                               t["description"],
                                               "parameters": t["input_schema"]}}
             for t in (BASH, EDIT)]
    text = reference.render_chat(messages, tools=tools, add_generation_prompt=True,
                                 enable_thinking=True)
    num_tokens = len(reference.tokenize(text, add_special=False))
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == num_tokens


def test_a_codex_shaped_request(agent_server):
    response = requests.post(agent_server.url + "/v1/responses", json=CODEX_LIKE, timeout=120)
    assert response.status_code == 200, response.text
    events = named_events(response.text)
    assert [name for name, _ in events[:2]] == ["response.created", "response.in_progress"]
    last, payload = events[-1]
    assert last in ("response.completed", "response.incomplete")
    final = payload["response"]
    assert final["parallel_tool_calls"] is False and final["store"] is False
    assert final["usage"]["output_tokens"] <= 24
    assert [p["sequence_number"] for _, p in events] == list(range(len(events)))
