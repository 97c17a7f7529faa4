"""Validation of Anthropic Messages API bodies (`/v1/messages`): each error names the field, and
the request becomes the chat endpoint's ChatRequest (tool_use / tool_result blocks become tool
calls and tool messages, `thinking` the template's `enable_thinking`)."""
from __future__ import annotations

from typing import Any

from strata.server.api_error import ApiError, invalid, missing
from strata.server.chat_schema import flat_function_tool, hold_json_answer
from strata.server.media import is_media, omitted_note
from strata.server.schema import (MAX_STOP_STRINGS, ChatRequest, GenerationOptions, _boolean,
                                  _integer, _logit_bias, _number, _object, _objects,
                                  _string, _wrong_type, check_object_schema, check_stop_lengths,
                                  check_strings)

ROLES = ("user", "assistant")
_MISSING = object()


def _blocks(content: Any, param: str) -> list[dict]:
    """A message's content as a list of blocks (a string is one text block)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise _wrong_type(param, content, "a string or an array of content blocks")
    return [block for _, block in _objects(content, param)]


def _text_of(block: dict, param: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise _wrong_type(f"{param}.text", text, "a string")
    return text


def _unsupported_block(kind: Any, param: str, allowed: str) -> ApiError:
    return invalid(f"'{param}.type' is {kind!r}; this server reads {allowed} blocks here (it "
                   "serves a text-only model).", f"{param}.type", "unsupported_value")


def _media_text(block: dict, param: str) -> str:
    """An image or document block: a plain-text document's text, else the note saying it was
    left out."""
    source = block.get("source")
    if block.get("type") == "document" and isinstance(source, dict):
        if source.get("type") == "text" and isinstance(source.get("data"), str):
            return source["data"]
        content = source.get("content")
        if source.get("type") == "content" and isinstance(content, str):
            return content
        if source.get("type") == "content" and isinstance(content, list) and all(
                isinstance(b, dict) and b.get("type") == "text" for b in content):
            return "\n\n".join(_text_of(b, f"{param}.source.content[{i}]")
                               for i, b in enumerate(content))
    return omitted_note(block.get("type"), param)


def _tool_result_text(block: dict, param: str) -> str:
    content = block.get("content", "")
    if isinstance(content, str):
        text = content
    else:
        parts = []
        for i, part in enumerate(_blocks(content, f"{param}.content")):
            if is_media(part.get("type")):
                parts.append(_media_text(part, f"{param}.content[{i}]"))
                continue
            if part.get("type") != "text":
                raise _unsupported_block(part.get("type"), f"{param}.content[{i}]",
                                         "'text', 'image' and 'document'")
            parts.append(_text_of(part, f"{param}.content[{i}]"))
        text = "\n\n".join(parts)
    if _boolean(block, "is_error", param=f"{param}.is_error"):
        text = "Error: " + text
    return text


def _user_messages(blocks: list[dict], param: str) -> list[dict]:
    """A user turn: each tool_result becomes a tool message, runs of text one user message."""
    out: list[dict] = []
    texts: list[str] = []

    def flush_text():
        if texts:
            out.append({"role": "user", "content": "\n\n".join(texts)})
            texts.clear()

    for i, block in enumerate(blocks):
        where = f"{param}[{i}]"
        kind = block.get("type")
        if kind == "text":
            texts.append(_text_of(block, where))
        elif is_media(kind):
            texts.append(_media_text(block, where))
        elif kind == "tool_result":
            flush_text()
            tool_use_id = _string(block, "tool_use_id", param=f"{where}.tool_use_id")
            if not tool_use_id:
                raise missing(f"{where}.tool_use_id", "the id of the tool_use it answers")
            out.append({"role": "tool", "tool_call_id": tool_use_id,
                        "content": _tool_result_text(block, where)})
        else:
            raise _unsupported_block(kind, where, "'text', 'image', 'document' and "
                                     "'tool_result'")
    flush_text()
    return out


def _assistant_message(blocks: list[dict], param: str) -> dict:
    """An assistant turn: text, thinking (the template's reasoning_content) and tool_use."""
    texts, thoughts, calls = [], [], []
    for i, block in enumerate(blocks):
        where = f"{param}[{i}]"
        kind = block.get("type")
        if kind == "text":
            texts.append(_text_of(block, where))
        elif kind == "thinking":
            thinking = block.get("thinking")
            if not isinstance(thinking, str):
                raise _wrong_type(f"{where}.thinking", thinking, "a string")
            thoughts.append(thinking)
        elif kind == "redacted_thinking":
            continue  # another server's encrypted reasoning: nothing a template can show
        elif kind == "tool_use":
            name = block.get("name")
            if not isinstance(name, str) or not name:
                raise _wrong_type(f"{where}.name", name, "a non-empty string")
            arguments = block.get("input", {})
            if not isinstance(arguments, dict):
                raise _wrong_type(f"{where}.input", arguments, "an object")
            call_id = _string(block, "id", param=f"{where}.id") or f"toolu_{i}"
            calls.append({"id": call_id, "type": "function",
                          "function": {"name": name, "arguments": arguments}})
        else:
            raise _unsupported_block(kind, where,
                                     "'text', 'thinking', 'redacted_thinking' and 'tool_use'")
    message: dict = {"role": "assistant", "content": "\n\n".join(texts)}
    if calls:
        message["tool_calls"] = calls
    if thoughts:
        message["reasoning_content"] = "\n\n".join(thoughts)
    return message


def parse_anthropic_messages(messages: Any) -> tuple[list[dict], str]:
    """The chat messages, and the text of a last assistant turn the answer continues (a
    prefill; "" when the last turn is the user's)."""
    if messages is _MISSING or messages is None:
        raise missing("messages", "an array of {role, content} objects")
    items = _objects(messages, "messages")
    if not items:
        raise invalid("'messages' is empty: send at least one message.", "messages")
    out: list[dict] = []
    for where, message in items:
        role = message.get("role")
        if role not in ROLES:
            raise invalid(f"'{where}.role' is {role!r}; use 'user' or 'assistant' (the system "
                          "prompt goes in the top-level 'system' field).", f"{where}.role")
        content = message.get("content", _MISSING)
        if content is _MISSING or content is None:
            raise missing(f"{where}.content", "a string or an array of content blocks")
        blocks = _blocks(content, f"{where}.content")
        if role == "user":
            if not blocks:
                raise invalid(f"'{where}.content' is empty: a user turn needs a text or "
                              "tool_result block.", f"{where}.content")
            out += _user_messages(blocks, f"{where}.content")
        else:
            out.append(_assistant_message(blocks, f"{where}.content"))
    prefill = ""
    last = out[-1]
    if last["role"] == "assistant":
        if last.get("tool_calls"):
            raise invalid("The last message is an assistant turn with tool_use blocks; send the "
                          "tool_result blocks in a user turn after it.",
                          f"messages[{len(messages) - 1}].content")
        prefill = last["content"]
        out.pop()
    if not out:
        raise invalid("'messages' holds only an assistant turn; start with a user turn.",
                      "messages")
    return out, prefill


def _system_text(system: Any) -> str | None:
    if system is None or isinstance(system, str):
        return system
    texts = []
    for i, block in enumerate(_blocks(system, "system")):
        if block.get("type") != "text":
            raise _unsupported_block(block.get("type"), f"system[{i}]", "'text'")
        texts.append(_text_of(block, f"system[{i}]"))
    return "\n\n".join(texts)


def parse_anthropic_tools(tools: Any) -> list[dict] | None:
    """Client tools `{name, description, input_schema}` as the template's function tools."""
    if tools is None:
        return None
    out = []
    for where, tool in _objects(tools, "tools"):
        if tool.get("type", "custom") != "custom":
            raise invalid(f"'{where}.type' is {tool.get('type')!r}; this server runs no tools "
                          "itself: send client tools ({name, description, input_schema}).",
                          f"{where}.type", "unsupported_value")
        out.append(flat_function_tool(tool, where, "input_schema", is_schema_required=True))
    return out or None


def parse_anthropic_tool_choice(choice: Any, tools: list[dict] | None) -> str | dict:
    if choice is None:
        return "auto"
    if not isinstance(choice, dict):
        raise _wrong_type("tool_choice", choice, "an object")
    kind = choice.get("type")
    if kind not in ("auto", "any", "tool", "none"):
        raise invalid(f"'tool_choice.type' is {kind!r}; use 'auto', 'any', 'tool' or 'none'.",
                      "tool_choice.type")
    if kind in ("any", "tool") and not tools:
        raise invalid(f"'tool_choice.type' is {kind!r} but no 'tools' were sent.",
                      "tool_choice")
    if kind != "tool":
        return {"auto": "auto", "any": "required", "none": "none"}[kind]
    name = choice.get("name")
    if not isinstance(name, str):
        raise _wrong_type("tool_choice.name", name, "a string")
    names = [tool["function"]["name"] for tool in tools]
    if name not in names:
        raise invalid(f"'tool_choice' names the tool {name!r}, which is not among the tools "
                      f"sent ({', '.join(names)}).", "tool_choice.name")
    return {"type": "function", "function": {"name": name}}


THINKING_TYPES = ("enabled", "adaptive", "between_tools", "disabled")


def parse_thinking(thinking: Any) -> tuple[dict, bool, int | None]:
    """`thinking` as the chat template's `enable_thinking` (Qwen3's switch; absent: the
    template's own default), whether the reasoning's text is left out of the answer
    (`display: "omitted"`), and the `<think>` block's token budget (`enabled` with
    `budget_tokens`; else None)."""
    if thinking is None:
        return {}, False, None
    if not isinstance(thinking, dict):
        raise _wrong_type("thinking", thinking, "an object")
    kind = thinking.get("type")
    if kind not in THINKING_TYPES:
        raise invalid(f"'thinking.type' is {kind!r}; use one of {', '.join(THINKING_TYPES)}.",
                      "thinking.type")
    budget = _integer(thinking, "budget_tokens", 0, 2**31, param="thinking.budget_tokens")
    display = _string(thinking, "display", param="thinking.display")
    if display not in (None, "summarized", "omitted"):
        raise invalid(f"'thinking.display' is {display!r}; use 'summarized' or 'omitted'.",
                      "thinking.display")
    return ({"enable_thinking": kind != "disabled"}, display == "omitted",
            budget if kind == "enabled" else None)


def _output_format(body: dict) -> dict | None:
    """`output_config.format` (structured outputs) as the chat endpoint's response_format."""
    config = _object(body, "output_config") or {}
    effort = config.get("effort")
    if effort is not None and effort not in ("low", "medium", "high", "xhigh", "max"):
        raise invalid(f"'output_config.effort' is {effort!r}; use low, medium, high, xhigh or "
                      "max.", "output_config.effort")
    fmt = _object(config, "format", param="output_config.format")
    if fmt is None:
        return None
    if fmt.get("type") != "json_schema":
        raise invalid(f"'output_config.format.type' is {fmt.get('type')!r}; use 'json_schema'.",
                      "output_config.format.type")
    schema = _object(fmt, "schema", param="output_config.format.schema")
    if schema is None:
        raise missing("output_config.format.schema", "the JSON schema of the answer")
    check_object_schema(schema, "output_config.format.schema")
    return {"type": "json_schema", "json_schema": {"schema": schema}}


def parse_anthropic_request(body: dict, max_tokens_limit: int, *,
                            is_count_only: bool = False) -> ChatRequest:
    """A Messages API body as a ChatRequest. `max_tokens` is required (as Anthropic's API has
    it) but may exceed the context: it is clipped to the room the prompt leaves. The chat
    endpoint's `seed`, `logit_bias`, `ignore_eos` and `chat_template_kwargs` are taken as
    extensions.
    `is_count_only`: /v1/messages/count_tokens, which takes no generation fields."""
    options = GenerationOptions()
    if not is_count_only:
        if body.get("max_tokens") is None:
            raise missing("max_tokens", "the most tokens to generate")
        options.max_tokens = min(_integer(body, "max_tokens", 1, 2**31 - 1), max_tokens_limit)
        stop = body.get("stop_sequences")
        stop = [] if stop is None else stop
        if not isinstance(stop, list):
            raise _wrong_type("stop_sequences", stop, "an array of strings")
        check_strings(stop, "stop_sequences")
        if len(stop) > MAX_STOP_STRINGS or any(not s for s in stop):
            raise invalid(f"'stop_sequences' must hold at most {MAX_STOP_STRINGS} non-empty "
                          f"strings, got {len(stop)} with {sum(not s for s in stop)} empty.",
                          "stop_sequences")
        check_stop_lengths(stop, "stop_sequences")
        top_k = _integer(body, "top_k", 0, 2**31)
        options.stop = list(stop)
        options.temperature = _number(body, "temperature", 0.0, 1.0)
        options.top_p = _number(body, "top_p", 0.0, 1.0, low_open=True)
        options.top_k = top_k
        options.is_stream = _boolean(body, "stream")
        # extensions, as on the chat endpoint (Anthropic's API has neither)
        options.seed = _integer(body, "seed", 0, 2**63 - 1)
        options.logit_bias = _logit_bias(body)
        options.is_eos_ignored = _boolean(body, "ignore_eos")
    kwargs = dict(_object(body, "chat_template_kwargs") or {})
    thinking_kwargs, _, options.thinking_budget = parse_thinking(body.get("thinking"))
    kwargs.update(thinking_kwargs)
    tools = parse_anthropic_tools(body.get("tools"))
    tool_choice = parse_anthropic_tool_choice(body.get("tool_choice"), tools)
    choice = body.get("tool_choice")
    options.is_parallel_tool_calls = not (isinstance(choice, dict) and _boolean(
        choice, "disable_parallel_tool_use", param="tool_choice.disable_parallel_tool_use"))
    response_format = _output_format(body)
    hold_json_answer(options, response_format, tools, tool_choice)
    messages, prefill = parse_anthropic_messages(body.get("messages", _MISSING))
    if prefill and options.json_object:
        # the held answer is the whole object, which a started one would break ("{{...")
        raise invalid("A last assistant turn (prefill) cannot be combined with "
                      "'output_config.format': the format holds the whole answer to the "
                      "schema; drop the prefill.", "messages", "unsupported_value")
    system = _system_text(body.get("system"))
    if system:
        messages = [{"role": "system", "content": system}] + messages
    return ChatRequest(model=_string(body, "model"), messages=messages, options=options,
                       tools=tools, tool_choice=tool_choice, response_format=response_format,
                       chat_template_kwargs=kwargs,
                       assistant_prefill=prefill)
