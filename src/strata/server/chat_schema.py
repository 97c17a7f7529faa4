"""Validation of the chat endpoint's body (POST /v1/chat/completions, and the fields the
Responses and Anthropic schemas share with it): messages, tools, the tool choice and the
response format; the generation fields are schema.py's."""
from __future__ import annotations

import json
import logging
from typing import Any

from strata.engine.logprobs import MAX_TOP_LOGPROBS
from strata.server.api_error import ApiError, invalid, missing
from strata.server.custom_tools import (CUSTOM_INPUT, chat_custom_tool, custom_tool,
                                        custom_tool_grammars)
from strata.server.media import is_media, omitted_note
from strata.server.schema import (_MISSING, ChatRequest, GenerationOptions, _boolean, _integer,
                                  _object, _objects, _string, _wrong_type, check_object_schema,
                                  llama_json_schema, parse_choice_counts, parse_options)

log = logging.getLogger("strata.server")

ROLES = ("system", "developer", "user", "assistant", "tool")


def _content_text(content: Any, param: str) -> str | None:
    """A message's content as text: a string, or an array of text parts joined."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _wrong_type(param, content, "a string or an array of content parts")
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict):
            raise _wrong_type(f"{param}[{i}]", part, "an object")
        kind = part.get("type")
        if is_media(kind):
            texts.append(omitted_note(kind, f"{param}[{i}]"))
            continue
        if kind not in ("text", "refusal"):  # an assistant's refusal (OpenAI's) is its text
            raise invalid(f"'{param}[{i}].type' is {kind!r}; this server reads 'text' parts "
                          "(and tells the model of images, audio and files, which it cannot "
                          "read).", f"{param}[{i}].type", "unsupported_value")
        text = part.get(kind)
        if not isinstance(text, str):
            raise _wrong_type(f"{param}[{i}].{kind}", text, "a string")
        texts.append(text)
    return "".join(texts)


def _tool_calls(calls: Any, param: str) -> list[dict]:
    """Assistant tool calls in the template's form (arguments decoded to an object)."""
    out = []
    for i, (where, call) in enumerate(_objects(calls, param)):
        if call.get("type") == "custom":  # a custom tool's call: its function's, of its input
            custom = call.get("custom")
            text = custom.get("input") if isinstance(custom, dict) else None
            if not isinstance(text, str):
                raise _wrong_type(f"{where}.custom.input", text, "a string")
            call = {**call, "function": {"name": custom.get("name"),
                                         "arguments": {CUSTOM_INPUT: text}}}
        function = call.get("function")
        if not isinstance(function, dict):
            raise _wrong_type(f"{where}.function", function, "an object")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise _wrong_type(f"{where}.function.name", name, "a non-empty string")
        arguments = function.get("arguments")
        if isinstance(arguments, dict):  # decoded already (Ollama's form, some proxies')
            decoded = arguments
        elif arguments is not None and not isinstance(arguments, str):
            raise _wrong_type(f"{where}.function.arguments", arguments, "a JSON string")
        else:
            try:  # "" (or none): a call without arguments, as servers stream some
                decoded = json.loads(arguments or "{}")
            except ValueError:
                raise invalid(f"'{where}.function.arguments' is not valid JSON: "
                              f"{arguments[:80]!r}.", f"{where}.function.arguments") from None
        call_id = _string(call, "id", param=f"{where}.id") or f"call_{i}"
        out.append({"id": call_id, "type": "function",
                    "function": {"name": name, "arguments": decoded}})
    return out


def parse_messages(messages: Any) -> list[dict]:
    if messages is _MISSING or messages is None:
        raise ApiError(400, "'messages' is required: an array of {role, content} objects.",
                       param="messages", code="missing_required_parameter")
    items = _objects(messages, "messages")
    if not items:
        raise invalid("'messages' is empty: send at least one message.", "messages")
    out = []
    for where, message in items:
        role = message.get("role")
        if role not in ROLES:
            raise invalid(f"'{where}.role' is {role!r}; use one of {', '.join(ROLES)}.",
                          f"{where}.role")
        content = _content_text(message.get("content"), f"{where}.content")
        item: dict = {"role": "system" if role == "developer" else role,
                      "content": content or ""}
        if role == "assistant" and message.get("tool_calls") is not None:
            item["tool_calls"] = _tool_calls(message["tool_calls"], f"{where}.tool_calls")
        elif content is None and role != "assistant":  # an answer all reasoning: no content
            raise ApiError(400, f"'{where}.content' is required for a {role} message.",
                           param=f"{where}.content", code="missing_required_parameter")
        reasoning = _string(message, "reasoning_content", param=f"{where}.reasoning_content")
        if reasoning is None and isinstance(message.get("reasoning"), str):
            reasoning = message["reasoning"]  # vLLM's and OpenRouter's name for it
        if role == "assistant" and reasoning:
            item["reasoning_content"] = reasoning
        if role == "tool":
            item["tool_call_id"] = _string(message, "tool_call_id",
                                           param=f"{where}.tool_call_id") or ""
        name = _string(message, "name", param=f"{where}.name")
        if name:
            item["name"] = name
        out.append(item)
    return out


def parse_tools(tools: Any) -> list[dict] | None:
    if tools is None:
        return None
    out = []
    for where, tool in _objects(tools, "tools"):
        if tool.get("type") == "custom":
            out.append(custom_tool(chat_custom_tool(tool, where), f"{where}.custom"))
            continue
        if tool.get("type", "function") != "function":
            raise invalid(f"'{where}.type' is {tool.get('type')!r}; use 'function' or "
                          "'custom'.", f"{where}.type", "unsupported_value")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise _wrong_type(f"{where}.function", function, "an object")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise _wrong_type(f"{where}.function.name", name, "a non-empty string")
        _string(function, "description", param=f"{where}.function.description")
        _object(function, "parameters", param=f"{where}.function.parameters")
        out.append({"type": "function", "function": function})
    return out or None


def flat_function_tool(tool: dict, where: str, schema_key: str,
                       is_schema_required: bool = False) -> dict:
    """A tool written flat, `{name, description, <schema_key>}` (Anthropic's `input_schema`,
    the Responses API's `parameters`), as the chat template's function tool."""
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise _wrong_type(f"{where}.name", name, "a non-empty string")
    function = {"name": name}
    description = _string(tool, "description", param=f"{where}.description")
    if description is not None:
        function["description"] = description
    schema = _object(tool, schema_key, param=f"{where}.{schema_key}")
    if schema is not None:
        function["parameters"] = schema
    elif is_schema_required:
        raise missing(f"{where}.{schema_key}", "the JSON schema of the tool's input")
    return {"type": "function", "function": function}


def parse_tool_choice(choice: Any, tools: list[dict] | None) -> str | dict:
    if choice is None:
        return "auto"
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise invalid(f"'tool_choice' is {choice!r}; use 'none', 'auto', 'required' or "
                          "{\"type\": \"function\", \"function\": {\"name\": ...}}.",
                          "tool_choice")
        if choice == "required" and not tools:
            raise invalid("'tool_choice' is 'required' but no 'tools' were sent.", "tool_choice")
        return choice
    if not isinstance(choice, dict):
        raise _wrong_type("tool_choice", choice, "a string or an object")
    function = choice.get("custom" if choice.get("type") == "custom" else "function")
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise _wrong_type("tool_choice.function.name", name, "a string")
    names = [tool["function"]["name"] for tool in tools or []]
    if name not in names:
        raise invalid(f"'tool_choice' names the function {name!r}, which is not among the "
                      f"tools sent ({', '.join(names) or 'none'}).", "tool_choice")
    return {"type": "function", "function": {"name": name}}


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


def reasoning_effort_thinking(effort: str | None, param: str) -> dict:
    """A reasoning effort (OpenAI's `reasoning_effort`, the Responses API's `reasoning.effort`)
    as the template's `enable_thinking`: "none" turns it off, any other effort on; absent, the
    template's default."""
    if effort is None:
        return {}
    if effort not in REASONING_EFFORTS:
        raise invalid(f"'{param}' is {effort!r}; use one of {', '.join(REASONING_EFFORTS)}.",
                      param)
    return {"enable_thinking": effort != "none"}


def parse_response_format(value: Any) -> dict | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _wrong_type("response_format", value, "an object")
    kind = value.get("type")
    if kind not in ("text", "json_object", "json_schema"):
        raise invalid(f"'response_format.type' is {kind!r}; use 'text', 'json_object' or "
                      "'json_schema'.", "response_format.type")
    if kind == "json_schema":
        schema = _object(value, "json_schema", param="response_format.json_schema")
        if schema is None:
            raise ApiError(400, "'response_format.json_schema' is required with type "
                           "'json_schema'.", param="response_format.json_schema",
                           code="missing_required_parameter")
        if "schema" in schema and schema["schema"] is None:  # as if left out
            schema = {k: v for k, v in schema.items() if k != "schema"}
            value = dict(value, json_schema=schema)
        inner = schema.get("schema", schema)
        if not isinstance(inner, dict):
            raise _wrong_type("response_format.json_schema.schema", inner,
                              "an object (a JSON schema)")
        check_object_schema(inner, "response_format.json_schema.schema"
                            if "schema" in schema else "response_format.json_schema")
    return None if kind == "text" else value


def hold_json_answer(options: GenerationOptions, response_format: dict | None,
                     tools: list[dict] | None, tool_choice: str | dict) -> None:
    """A JSON response format holds the answer to JSON (and to the schema's structure) unless
    the model may answer with a tool call instead."""
    options.json_object = response_format is not None and (not tools or tool_choice == "none")
    if options.json_object and response_format["type"] == "json_schema":
        schema = response_format["json_schema"].get("schema", response_format["json_schema"])
        options.json_schema = schema if isinstance(schema, dict) else None


def parse_chat_request(body: dict, max_tokens_limit: int) -> ChatRequest:
    options = parse_options(body, max_tokens_limit, is_best_of_read=True)
    n, best_of = parse_choice_counts(body, options.is_stream)
    tools = parse_tools(body.get("tools"))
    kwargs = dict(_object(body, "chat_template_kwargs") or {})
    effort = _string(body, "reasoning_effort")
    if effort not in REASONING_EFFORTS + (None,):
        # another provider's level (the chat endpoint ignored the field before it was read):
        # the template's default, rather than a 400 on every turn of a client that sends it
        log.debug("reasoning_effort %r is none of %s; left to the template", effort,
                  ", ".join(REASONING_EFFORTS))
        effort = None
    thinking = reasoning_effort_thinking(effort, "reasoning_effort")
    kwargs = {**thinking, **kwargs}  # the template's own switch, where sent, wins
    tool_choice = parse_tool_choice(body.get("tool_choice"), tools)
    response_format = parse_response_format(body.get("response_format"))
    schema = llama_json_schema(body, options)  # llama-server takes it here too
    if schema is not None:
        if response_format is not None:
            raise invalid("'json_schema' and 'response_format' both say what the answer "
                          "holds; send one of them.", "json_schema")
        response_format = {"type": "json_schema", "json_schema": {"schema": schema}}
    hold_json_answer(options, response_format, tools, tool_choice)
    options.is_parallel_tool_calls = _boolean(body, "parallel_tool_calls", default=True)
    top = _integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if _boolean(body, "logprobs"):
        options.logprobs = top or 0
    elif top is not None:
        raise invalid("'top_logprobs' needs 'logprobs': true.", "top_logprobs")
    customs = [chat_custom_tool(tool, where) for where, tool in _objects(body.get("tools"), "tools")
               if tool.get("type") == "custom"] if body.get("tools") is not None else []
    return ChatRequest(
        input_grammars=custom_tool_grammars(customs),
        custom_tools=frozenset(tool["name"] for tool in customs),
        n=n,
        best_of=best_of,
        model=_string(body, "model"),
        messages=parse_messages(body.get("messages", _MISSING)),
        options=options,
        tools=tools,
        tool_choice=tool_choice,
        response_format=response_format,
        chat_template_kwargs=dict(kwargs),
    )
