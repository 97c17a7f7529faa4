"""Validation of OpenAI Responses API bodies (`/v1/responses`, as Codex CLI sends them): each
error names the field, and the request becomes the chat endpoint's ChatRequest (input items
become messages, function_call / function_call_output items tool calls and tool messages)."""
from __future__ import annotations

import json
import logging
from typing import Any

from strata.engine.logprobs import MAX_TOP_LOGPROBS
from strata.server.api_error import ApiError, invalid, missing
from strata.server.chat_schema import (flat_function_tool, hold_json_answer, parse_tool_choice,
                                       reasoning_effort_thinking)
from strata.server.custom_tools import (CUSTOM_INPUT, custom_tool, custom_tool_grammars,
                                        custom_tool_names)
from strata.server.media import is_media, omitted_note
from strata.server.schema import (ChatRequest, _boolean, _integer, _object, _objects, _string,
                                  _wrong_type, check_object_schema, parse_options)

log = logging.getLogger("strata.server")

_TEXT_PARTS = ("input_text", "output_text", "text", "refusal")
# Tools OpenAI's servers run themselves (Codex sends web_search on every turn by default): this
# server runs none, so the model is offered none of them; the rest of the request is served
HOSTED_TOOLS = ("web_search", "web_search_preview", "web_search_preview_2025_03_11",
                "web_search_2025_08_26", "file_search", "code_interpreter", "image_generation",
                "mcp")
# input items of those tools' calls: they hold no text the model wrote or read (the results
# stay on OpenAI's servers), so they are left out of the conversation
HOSTED_CALL_ITEMS = ("web_search_call", "file_search_call", "code_interpreter_call",
                     "image_generation_call", "mcp_list_tools", "mcp_call",
                     "mcp_approval_request", "mcp_approval_response")
_MISSING = object()
LOGPROBS_INCLUDE = "message.output_text.logprobs"  # `include`: the answer's token logprobs


def _unsupported(param: str, value: Any, what: str) -> ApiError:
    return invalid(f"'{param}' is {value!r}; {what}", param, "unsupported_value")


def _parts_text(content: Any, param: str) -> str:
    """A message's content or a tool output: a string, or text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _wrong_type(param, content, "a string or an array of content parts")
    texts = []
    for where, part in _objects(content, param):
        kind = part.get("type")
        if is_media(kind):
            texts.append(omitted_note(kind, where))
            continue
        if kind not in _TEXT_PARTS:
            raise _unsupported(f"{where}.type", kind, "this server reads text parts "
                               "(input_text, output_text), and tells the model of images, "
                               "audio and files, which it cannot read.")
        key = "refusal" if kind == "refusal" else "text"
        text = part.get(key)
        if not isinstance(text, str):
            raise _wrong_type(f"{where}.{key}", text, "a string")
        texts.append(text)
    return "".join(texts)


def _reasoning_text(item: dict, where: str) -> str:
    """A reasoning item's text: its reasoning_text content, else what this server kept in its
    encrypted_content (responses_format.REASONING_MARK: Codex sends the field back and drops
    the content), else its summary. Another server's encrypted_content is left out."""
    from strata.server.responses_format import REASONING_MARK

    kept = item.get("encrypted_content")
    if not item.get("content") and isinstance(kept, str) and kept.startswith(REASONING_MARK):
        return kept[len(REASONING_MARK):]
    texts = []
    for key in ("content", "summary"):
        parts = item.get(key)
        if parts is None:
            continue
        for part_where, part in _objects(parts, f"{where}.{key}"):
            text = part.get("text")
            if not isinstance(text, str):
                raise _wrong_type(f"{part_where}.text", text, "a string")
            texts.append(text)
        if texts:
            break
    return "\n\n".join(texts)


class _Conversation:
    """Input items folded into chat messages: an assistant message, the function calls after it
    and the reasoning before each of them make one assistant turn (a reasoning item that no
    assistant item follows, before a user message or a tool output, belongs to none)."""

    def __init__(self):
        self.messages: list[dict] = []
        self.reasoning = ""  # of the assistant turn that comes next

    def _assistant_turn(self, is_new: bool) -> dict:
        last = self.messages[-1] if self.messages else None
        if is_new or last is None or last["role"] != "assistant":
            last = {"role": "assistant", "content": ""}
            self.messages.append(last)
        if self.reasoning:
            before = last.get("reasoning_content")
            last["reasoning_content"] = (before + "\n\n" if before else "") + self.reasoning
            self.reasoning = ""
        return last

    def message(self, item: dict, where: str) -> None:
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise invalid(f"'{where}.role' is {role!r}; use user, assistant, system or "
                          "developer.", f"{where}.role")
        content = item.get("content", _MISSING)
        if content is _MISSING or content is None:
            raise missing(f"{where}.content", "a string or an array of content parts")
        text = _parts_text(content, f"{where}.content")
        if role == "assistant":
            self._assistant_turn(is_new=True)["content"] = text
        else:
            self.reasoning = ""
            self.messages.append({"role": "system" if role == "developer" else role,
                                  "content": text})

    def function_call(self, item: dict, where: str) -> None:
        name = item.get("name")
        if not isinstance(name, str) or not name:
            raise _wrong_type(f"{where}.name", name, "a non-empty string")
        call_id = _string(item, "call_id", param=f"{where}.call_id")
        if not call_id:
            raise missing(f"{where}.call_id", "the id its function_call_output answers")
        arguments = item.get("arguments", "{}")
        if not isinstance(arguments, str):
            raise _wrong_type(f"{where}.arguments", arguments, "a JSON string")
        try:
            decoded = json.loads(arguments or "{}")
        except ValueError:
            raise invalid(f"'{where}.arguments' is not valid JSON: {arguments[:80]!r}.",
                          f"{where}.arguments") from None
        turn = self._assistant_turn(is_new=False)
        turn.setdefault("tool_calls", []).append(
            {"id": call_id, "type": "function", "function": {"name": name,
                                                             "arguments": decoded}})

    def custom_tool_call(self, item: dict, where: str) -> None:
        """A custom tool's call: the function call of its one string argument."""
        text = item.get("input")
        if not isinstance(text, str):
            raise _wrong_type(f"{where}.input", text, "a string")
        self.function_call(dict(item, arguments=json.dumps({CUSTOM_INPUT: text})), where)

    def function_call_output(self, item: dict, where: str) -> None:
        call_id = _string(item, "call_id", param=f"{where}.call_id")
        if not call_id:
            raise missing(f"{where}.call_id", "the call_id of the function_call it answers")
        output = item.get("output", _MISSING)
        if output is _MISSING or output is None:
            raise missing(f"{where}.output", "the function's output as text")
        self.reasoning = ""
        self.messages.append({"role": "tool", "tool_call_id": call_id,
                              "content": _parts_text(output, f"{where}.output")})


def parse_input(value: Any, instructions: str | None) -> list[dict]:
    """`input` (a string or an array of items) and `instructions` as chat messages; the
    instructions and the system / developer messages at the start make one system message."""
    if value is _MISSING or value is None:
        raise missing("input", "a string or an array of input items")
    conversation = _Conversation()
    if isinstance(value, str):
        conversation.messages.append({"role": "user", "content": value})
    else:
        items = _objects(value, "input") if isinstance(value, list) else None
        if items is None:
            raise _wrong_type("input", value, "a string or an array of input items")
        for where, item in items:
            kind = item.get("type", "message")
            if kind == "message":
                conversation.message(item, where)
            elif kind == "function_call":
                conversation.function_call(item, where)
            elif kind == "custom_tool_call":
                conversation.custom_tool_call(item, where)
            elif kind in ("function_call_output", "custom_tool_call_output"):
                conversation.function_call_output(item, where)
            elif kind == "reasoning":
                conversation.reasoning = _reasoning_text(item, where)
            elif kind in HOSTED_CALL_ITEMS:
                log.debug("left out %s: a call of a tool OpenAI's servers run", where)
            elif kind == "item_reference":
                raise _unsupported(f"{where}.type", kind, "this server keeps no items: send "
                                   "the whole conversation in 'input'.")
            else:
                raise _unsupported(f"{where}.type", kind, "this server reads message, "
                                   "function_call, function_call_output, custom_tool_call, "
                                   "custom_tool_call_output and reasoning items.")
    messages = conversation.messages
    if not messages:
        raise invalid("'input' holds no message: send at least one.", "input")
    lead = [] if instructions is None else [instructions]
    while messages and messages[0]["role"] == "system":
        lead.append(messages.pop(0)["content"])
    system = "\n\n".join(text for text in lead if text)
    return ([{"role": "system", "content": system}] if system else []) + messages


def parse_responses_tools(tools: Any) -> list[dict] | None:
    """Function tools `{type, name, description, parameters, strict}` and custom tools
    (`custom_tools.custom_tool`) in the chat form."""
    if tools is None:
        return None
    out = []
    for where, tool in _objects(tools, "tools"):
        kind = tool.get("type")
        if kind in HOSTED_TOOLS:
            log.debug("%s (%s) left out: this server runs no hosted tools", where, kind)
            continue
        if kind == "custom":
            out.append(custom_tool(tool, where))
        elif kind == "function":
            out.append(flat_function_tool(tool, where, "parameters"))
        else:
            raise _unsupported(f"{where}.type", kind, "this server takes 'function' and "
                               "'custom' tools (hosted ones, such as web_search, it leaves "
                               "out).")
    names = [tool["function"]["name"] for tool in out]
    for name in custom_tool_names(tools):  # its calls are told apart by name
        if names.count(name) > 1:
            raise invalid(f"'tools' names {name!r} twice: a custom tool needs a name of its "
                          "own.", "tools")
    return out or None


def _tool_choice(choice: Any, tools: list[dict] | None) -> str | dict:
    if isinstance(choice, dict) and choice.get("type") in ("function", "custom") \
            and "name" in choice:
        choice = {"type": "function", "function": {"name": choice["name"]}}
    elif isinstance(choice, dict) and choice.get("type") != "function":
        hosted = ("this server runs no hosted tools, so it cannot call one; "
                  if choice.get("type") in HOSTED_TOOLS else "")
        raise _unsupported("tool_choice.type", choice.get("type"), f"{hosted}use 'none', "
                           "'auto', 'required' or {\"type\": \"function\" or \"custom\", "
                           "\"name\": ...}.")
    return parse_tool_choice(choice, tools)


def _text_format(body: dict) -> dict | None:
    """`text.format` as the chat endpoint's response_format (None for plain text)."""
    fmt = _object(_object(body, "text", param="text") or {}, "format", param="text.format")
    kind = None if fmt is None else fmt.get("type")
    if kind not in (None, "text", "json_object", "json_schema"):
        raise invalid(f"'text.format.type' is {kind!r}; use 'text', 'json_object' or "
                      "'json_schema'.", "text.format.type")
    if kind != "json_schema":
        return {"type": kind} if kind == "json_object" else None
    schema = _object(fmt, "schema", param="text.format.schema")
    if schema is None:
        raise missing("text.format.schema", "the JSON schema of the answer")
    check_object_schema(schema, "text.format.schema")
    return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": schema}}


def _include(body: dict) -> list[str]:
    """The `include` list: extra output asked for. LOGPROBS_INCLUDE and
    responses_format.REASONING_INCLUDE change what is answered; the others name output this
    server never makes (search results, images), so they are accepted and add nothing."""
    value = body.get("include")
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _wrong_type("include", value, "an array of strings")
    return value


def parse_responses_request(body: dict, max_tokens_limit: int) -> ChatRequest:
    """A Responses API body as a ChatRequest. `max_output_tokens` may exceed the context: it
    is clipped to the room the prompt leaves. The chat endpoint's sampling fields (top_k,
    min_p, seed, stop, the penalties, logit_bias, chat_template_kwargs) are taken as
    extensions."""
    for key, what in (("previous_response_id", "an earlier response"),
                      ("conversation", "a conversation")):
        if body.get(key) is not None:
            raise _unsupported(key, body[key], f"this server keeps no responses, so it cannot "
                               f"continue {what}: send the whole conversation in 'input' "
                               "(with store: false).")
    if body.get("background"):
        raise _unsupported("background", True, "this server answers in the request.")
    metadata = _object(body, "metadata") or {}  # echoed in the response: strings only
    for key, value in metadata.items():
        if not isinstance(value, str):
            raise _wrong_type(f"metadata.{key}", value, "a string")
    options = parse_options({k: v for k, v in body.items()
                             if k not in ("max_tokens", "max_completion_tokens", "n")},
                            max_tokens_limit)
    max_output = _integer(body, "max_output_tokens", 1, 2**31 - 1)
    options.max_tokens = None if max_output is None else min(max_output, max_tokens_limit)
    tools = parse_responses_tools(body.get("tools"))
    grammars = custom_tool_grammars(body.get("tools"))
    tool_choice = _tool_choice(body.get("tool_choice"), tools)
    response_format = _text_format(body)
    hold_json_answer(options, response_format, tools, tool_choice)
    options.is_parallel_tool_calls = _boolean(body, "parallel_tool_calls", default=True)
    # logprobs on the answer's text: asked by `include` or by a count of alternatives
    top = _integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if LOGPROBS_INCLUDE in _include(body) or top:
        options.logprobs = top or 0
    kwargs = dict(_object(body, "chat_template_kwargs") or {})
    kwargs.update(reasoning_effort_thinking(
        _string(_object(body, "reasoning") or {}, "effort", param="reasoning.effort"),
        "reasoning.effort"))
    return ChatRequest(model=_string(body, "model"),
                       messages=parse_input(body.get("input", _MISSING),
                                            _string(body, "instructions")),
                       options=options, tools=tools, tool_choice=tool_choice,
                       response_format=response_format, chat_template_kwargs=kwargs,
                       input_grammars=grammars)
