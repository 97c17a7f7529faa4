"""Codex CLI's freeform apply_patch flow on /v1/responses, end to end on the packaged default
model: a turn forced to call the custom tool (its input held to Codex's Lark grammar), the next
turn carrying that turn's items back as Codex sends them, a long held patch, and a patch cut by
max_output_tokens. The requests are built as Codex builds them (the shapes below)."""
from __future__ import annotations

import json

import openai
import pytest
import requests
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from strata.config import EngineConfig
from strata.data import default_model_path
from strata.engine.engine import Engine
from strata.engine.gbnf import compiled_grammar
from strata.engine.lark_grammar import lark_to_gbnf
from strata.server.app import ServerConfig

from codex_apply_patch import APPLY_PATCH_LARK
from live_server import start_live_server

MODEL_ID = "default-model"
APPLY_PATCH_TOOL = {
    "type": "custom", "name": "apply_patch",
    "description": "Use the `apply_patch` tool to edit files. This is a FREEFORM tool, so do "
                   "not wrap the patch in JSON.",
    "format": {"type": "grammar", "syntax": "lark", "definition": APPLY_PATCH_LARK}}
# Codex's default shell tool (codex-rs/core/src/tools/spec.rs, create_shell_tool)
SHELL_TOOL = {
    "type": "function", "name": "shell", "strict": False,
    "description": "Runs a shell command and returns its output.",
    "parameters": {"type": "object", "required": ["command"], "additionalProperties": False,
                   "properties": {
                       "command": {"type": "array", "items": {"type": "string"},
                                   "description": "The command to execute"},
                       "workdir": {"type": "string", "description":
                                   "The working directory to execute the command in"},
                       "timeout_ms": {"type": "number", "description":
                                      "The timeout for the command in milliseconds"}}}}
# Codex's user turn: a message of input_text parts (codex-rs/protocol/src/models.rs,
# ResponseInputItem::Message); its base instructions are ~10k tokens, more than the default
# model's 1024-token context, so a short stand-in is sent in their place
INSTRUCTIONS = "You are Codex, a coding agent. Edit files with apply_patch."
USER_TURN = {"type": "message", "role": "user",
             "content": [{"type": "input_text", "text": "Add a file hello.txt saying hi."}]}


def codex_body(input_items: list[dict], **fields) -> dict:
    """A body as Codex's ResponsesApiRequest serializes it (codex-rs/core/src/client.rs,
    build_responses_request; codex-rs/codex-api/src/common.rs): tool_choice auto, store
    false, streamed, encrypted reasoning asked for where reasoning is."""
    return {"model": MODEL_ID, "instructions": INSTRUCTIONS, "input": input_items,
            "tools": [SHELL_TOOL, APPLY_PATCH_TOOL], "tool_choice": "auto",
            "parallel_tool_calls": False, "reasoning": {"effort": "medium", "summary": "auto"},
            "store": False, "stream": True, "include": ["reasoning.encrypted_content"],
            "prompt_cache_key": "0199a0c4-codex-conversation", **fields}


@pytest.fixture(scope="module")
def engine():
    return Engine(EngineConfig(default_model_path(), threads=2))


@pytest.fixture(scope="module")
def live(engine):
    server = start_live_server(engine, ServerConfig(model_id=MODEL_ID))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def patch_grammar():
    return compiled_grammar(lark_to_gbnf(APPLY_PATCH_LARK))


def token_bias(engine, **bias_by_text: int) -> dict[str, int]:
    """logit_bias by token text (the default model's ids): the model writes prose, so what
    ends a patch line, the patch and the reply is pushed up."""
    tokenizer = engine.tokenizer
    out = {}
    for text, bias in bias_by_text.items():
        [token] = tokenizer.encode(text, add_special=False) if text != "<|im_end|>" else \
            [tokenizer.token_id(text)]
        out[str(token)] = bias
    return out


def forced_bias(engine) -> dict[str, int]:
    # '"' ends the input where the grammar allows; "\\n" (a JSON-escaped newline) ends patch
    # lines; "**" and " En" start "*** End Patch"; <|im_end|> ends the reply after the call.
    # The newline's push is what ends the patch's first line: at 8 it was enough on AVX-512 hosts
    # but not on an AVX2 EPYC, whose logits differ from theirs in the last bits (other vector
    # widths), so greedy decoding ran the "*** Add File:" line past 300 tokens there.
    return token_bias(engine, **{'"': 20, "\\n": 12, "**": 8, " En": 12, "<|im_end|>": 30})


def post_stream(live, body: dict) -> list[dict]:
    """The stream's events; each `event:` line names its data's type."""
    with requests.post(live.url + "/v1/responses", json=body, stream=True, timeout=300) as raw:
        assert raw.status_code == 200, raw.text
        lines = [line for line in raw.iter_lines(decode_unicode=True) if line]
    names = [line[len("event: "):] for line in lines if line.startswith("event: ")]
    payloads = [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: ")]
    assert names == [p["type"] for p in payloads]
    return payloads


def sdk_events(payloads: list[dict]) -> list:
    """The events as the openai SDK's types read them (strictly: a field of the wrong type or
    a missing one fails), numbered from 0 without a gap."""
    adapter = TypeAdapter(ResponseStreamEvent)
    events = [adapter.validate_python(p) for p in payloads]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events


def codex_patch_hunks(text: str) -> list[tuple[str, str]]:
    """What Codex's parser (codex-rs/apply-patch/src/parser.rs) needs of a patch: its first
    line `*** Begin Patch`, its last `*** End Patch` (both trimmed), and between them hunks,
    each opened by an Add / Delete / Update File line: (kind, path) of each."""
    lines = text.strip().split("\n")
    assert lines[0].strip() == "*** Begin Patch" and lines[-1].strip() == "*** End Patch", text
    hunks = [(line[4:].split(" File: ")[0], line.split(" File: ", 1)[1])
             for line in lines[1:-1]
             if line.startswith(("*** Add File: ", "*** Delete File: ", "*** Update File: "))]
    assert hunks and lines[1].startswith("*** "), text
    return hunks


def held_input_prefix(text: str) -> str:
    """The input written so far in a tool call's JSON cut inside its string: the text after
    `"input":` up to the end, JSON's escapes decoded (a cut escape left out)."""
    start = text.index('"input":') + len('"input":')
    start = text.index('"', start) + 1
    body, i = [], start
    while i < len(text):
        c = text[i]
        if c == '"':
            raise AssertionError(f"the input's string is closed: {text[i - 40:i + 40]!r}")
        if c == "\\":
            escape = text[i:i + 6] if text[i + 1:i + 2] == "u" else text[i:i + 2]
            if len(escape) < (6 if escape[1:2] == "u" else 2):
                break
            body.append(json.loads(f'"{escape}"'))
            i += len(escape)
            continue
        body.append(c)
        i += 1
    return "".join(body)


def test_a_forced_patch_is_one_codex_reads(live, engine, patch_grammar):
    """Forced (tool_choice custom), streamed: every event is one of the SDK's, the call's
    events come in OpenAI's order, and its input is a text of the grammar that Codex parses
    as a patch; not streamed: the same call."""
    body = codex_body([USER_TURN], tool_choice={"type": "custom", "name": "apply_patch"},
                      temperature=0, max_output_tokens=300, logit_bias=forced_bias(engine))
    payloads = post_stream(live, body)
    events = sdk_events(payloads)
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed", kinds
    at = kinds.index("response.custom_tool_call_input.done")
    item_id = events[at].item_id
    call_kinds = [e.type for e in events if getattr(e, "item_id", None) == item_id
                  or getattr(getattr(e, "item", None), "id", None) == item_id]
    assert call_kinds[0] == "response.output_item.added" and \
        call_kinds[-2:] == ["response.custom_tool_call_input.done", "response.output_item.done"]
    assert set(call_kinds[1:-2]) == {"response.custom_tool_call_input.delta"}
    deltas = "".join(e.delta for e in events
                     if e.type == "response.custom_tool_call_input.delta")
    [call] = [e.item for e in events if e.type == "response.output_item.done"
              and e.item.type == "custom_tool_call"]
    assert call.name == "apply_patch" and call.input == deltas == events[at].input
    recognizer = patch_grammar.recognizer()
    assert recognizer.feed(call.input.encode()) and recognizer.is_done, call.input
    assert codex_patch_hunks(call.input)
    final = Response.model_validate(payloads[-1]["response"])
    assert [i.input for i in final.output if i.type == "custom_tool_call"] == [call.input]
    assert final.status == "completed" and final.parallel_tool_calls is False

    with openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0,
                       timeout=300) as client:
        fields = {k: v for k, v in body.items() if k not in ("stream", "logit_bias",
                                                             "prompt_cache_key")}
        reply = client.responses.create(**fields, extra_body={"logit_bias": body["logit_bias"]})
    assert [(i.type, i.call_id[:5], i.input) for i in reply.output
            if i.type == "custom_tool_call"] == [("custom_tool_call", "call_", call.input)]


def as_codex_sends(item: dict) -> dict:
    """An output item as Codex sends it back in the next turn's input: its ResponseItem
    serialized (codex-rs/protocol/src/models.rs): no ids, a reasoning item without its
    reasoning_text content (skipped when serializing) but with encrypted_content (null if
    none), output_text parts as {type, text}, a custom call's status only where it had one."""
    kind = item["type"]
    if kind == "reasoning":
        return {"type": "reasoning", "summary": item.get("summary") or [],
                "encrypted_content": item.get("encrypted_content")}
    if kind == "message":
        return {"type": "message", "role": item["role"],
                "content": [{"type": p["type"], "text": p["text"]} for p in item["content"]]}
    if kind == "custom_tool_call":
        return {"type": kind, **({"status": item["status"]} if "status" in item else {}),
                **{k: item[k] for k in ("call_id", "name", "input")}}
    assert kind == "function_call", item
    return {"type": kind, **{k: item[k] for k in ("name", "arguments", "call_id")}}


def test_the_next_turn_carries_the_items_back(live, engine):
    """Turn 2 as Codex sends it: the first turn's input (with an earlier reasoning item, shell
    call and output), the patch turn's items as Codex serializes them (no ids, store false),
    the custom call's output, the same instructions and tools, tool_choice auto: it is
    served, and its events are the SDK's, and it reads again none of the forced first turn's
    prompt (forcing a tool changes no prompt token: test_forced_tool_prefix.py)."""
    earlier = [
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "List files."}],
         "encrypted_content": None},
        {"type": "function_call", "name": "shell", "call_id": "call_shell_1",
         "arguments": json.dumps({"command": ["ls"]})},
        {"type": "function_call_output", "call_id": "call_shell_1", "output": "README.md\n"}]
    first_input = [USER_TURN, *earlier]
    first = codex_body(first_input, tool_choice={"type": "custom", "name": "apply_patch"},
                       temperature=0, max_output_tokens=300, logit_bias=forced_bias(engine))
    turn1 = post_stream(live, first)[-1]["response"]
    assert turn1["status"] == "completed", turn1["output"]
    [call] = [i for i in turn1["output"] if i["type"] == "custom_tool_call"]
    # Codex runs the patch and answers with its output (codex-rs/core/src/tools/handlers/
    # apply_patch.rs): a custom_tool_call_output of the same call_id
    second_input = first_input + [as_codex_sends(i) for i in turn1["output"]] + [
        {"type": "custom_tool_call_output", "call_id": call["call_id"],
         "output": "Success. Updated the following files:\nA hello.txt\n"}]
    second = codex_body(second_input, temperature=0, max_output_tokens=8)
    payloads = post_stream(live, second)
    sdk_events(payloads)
    final = Response.model_validate(payloads[-1]["response"])
    assert final.status in ("completed", "incomplete") and final.error is None
    assert final.usage.input_tokens > turn1["usage"]["input_tokens"]
    assert final.usage.input_tokens_details.cached_tokens >= turn1["usage"]["input_tokens"]


@pytest.mark.parametrize("max_output_tokens", [24, 1000])  # 1000: clipped to the room left
def test_a_patch_cut_inside_the_grammar(live, engine, patch_grammar, max_output_tokens):
    """max_output_tokens (or the context) ends the forced patch inside its grammar (the model
    is not pushed to end it; the longer case holds over 200 tokens to the grammar):
    the response is incomplete, its one item a message that is incomplete too, holding the
    call's text as written (no custom_tool_call that Codex would run), streamed and not; the
    text so far is a beginning of a patch the grammar takes; the server goes on serving."""
    bias = token_bias(engine, **{'"': 20, "\\n": 8})
    body = codex_body([USER_TURN], tool_choice={"type": "custom", "name": "apply_patch"},
                      temperature=0, max_output_tokens=max_output_tokens, logit_bias=bias)
    payloads = post_stream(live, body)
    events = sdk_events(payloads)
    assert events[-1].type == "response.incomplete"
    final = events[-1].response
    assert final.incomplete_details.reason == "max_output_tokens"
    [item] = final.output
    assert (item.type, item.status) == ("message", "incomplete")
    assert [(e.type, e.item.status) for e in events if e.type == "response.output_item.done"] \
        == [("response.output_item.done", "incomplete")]
    text = item.content[0].text
    assert "<tool_call>" in text
    written = held_input_prefix(text)
    assert written.startswith("*** Begin Patch") or "*** Begin Patch".startswith(written)
    assert patch_grammar.recognizer().feed(written.encode()), written
    if max_output_tokens > 100:  # all the room Codex's forced prompt leaves
        assert final.usage.output_tokens == engine.n_ctx - final.usage.input_tokens > 200
        assert len(written) > 400, written

    reply = requests.post(live.url + "/v1/responses", json=dict(body, stream=False),
                          timeout=300).json()
    assert reply["status"] == "incomplete", reply
    assert [(i["type"], i["status"], i["content"][0]["text"]) for i in reply["output"]] == \
        [("message", "incomplete", text)]
    assert requests.get(live.url + "/health", timeout=10).status_code == 200
