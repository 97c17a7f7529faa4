"""Anthropic Messages API objects: the message, its content blocks from the output parser's
events, stop reasons, usage, errors, and the named Server-Sent Events of a streamed message."""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from strata.server.api_error import ApiError
from strata.server.output_parser import ContentDelta, ReasoningDelta, ToolCall, json_text

SSE_PING = "event: ping\ndata: {\"type\": \"ping\"}\n\n"

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error", 503: "overloaded_error"}


def sse_event(payload: dict) -> str:
    return f"event: {payload['type']}\ndata: " + json_text(payload) + "\n\n"


def error_body(err: ApiError) -> dict:
    """Anthropic's error shape; the OpenAI-style `param` and `code` ride along as extras."""
    kind = _ERROR_TYPES.get(err.status, "api_error" if err.status >= 500 else
                            "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": err.message, "param": err.param,
                                       "code": err.code}}


def new_tool_use_id() -> str:
    return "toolu_" + uuid.uuid4().hex[:24]


def usage(num_prompt_tokens: int, num_cached_tokens: int, num_generated_tokens: int) -> dict:
    """`input_tokens` are the prompt tokens read now; those reused from a parked conversation
    are `cache_read_input_tokens` (Anthropic counts the three apart)."""
    return {"input_tokens": num_prompt_tokens - num_cached_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": num_cached_tokens,
            "output_tokens": num_generated_tokens}


def stop_reason(engine_finish: str | None, num_tool_calls: int, stop_string: str | None,
                is_context_full: bool = False) -> str:
    """`is_context_full`: the output ended short of the client's max_tokens for want of room
    in the context."""
    if engine_finish == "length" or engine_finish is None:
        return "model_context_window_exceeded" if is_context_full else "max_tokens"
    if num_tool_calls:
        return "tool_use"
    return "stop_sequence" if stop_string is not None else "end_turn"


def _new_block(event) -> dict:
    if isinstance(event, ReasoningDelta):
        return {"type": "thinking", "thinking": "", "signature": ""}
    if isinstance(event, ContentDelta):
        return {"type": "text", "text": ""}
    return {"type": "tool_use", "id": event.id, "name": event.name, "input": {}}


def _delta(event) -> dict:
    if isinstance(event, ReasoningDelta):
        return {"type": "thinking_delta", "thinking": event.text}
    if isinstance(event, ContentDelta):
        return {"type": "text_delta", "text": event.text}
    return {"type": "input_json_delta", "partial_json": event.arguments}


def content_blocks(events: list, is_thinking_omitted: bool = False) -> list[dict]:
    """The parser's events as a message's content: runs of text or of reasoning make one text
    or thinking block each, every tool call a tool_use block. `is_thinking_omitted`: thinking
    blocks stay empty (`thinking.display` "omitted")."""
    blocks: list[dict] = []
    for event in events:
        if isinstance(event, ToolCall):
            blocks.append(dict(_new_block(event), input=json.loads(event.arguments)))
            continue
        key = "thinking" if isinstance(event, ReasoningDelta) else "text"
        if not blocks or blocks[-1]["type"] != key:
            blocks.append(_new_block(event))
        if not (key == "thinking" and is_thinking_omitted):
            blocks[-1][key] += event.text
    return blocks


@dataclass
class MessageHeader:
    model: str
    id: str = field(default_factory=lambda: "msg_" + uuid.uuid4().hex[:24])

    def message(self, content: list[dict], reason: str | None, stop_string: str | None,
                usage_dict: dict) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": reason, "stop_sequence": stop_string,
                "usage": usage_dict}


class BlockStream:
    """The events of a streamed message's content: a block opens with the first event of its
    kind and closes when another kind comes or the message ends; a tool call is one block."""

    def __init__(self, is_thinking_omitted: bool = False):
        self._open: str | None = None  # "text" or "thinking" while such a block is open
        self._index = -1
        self._is_thinking_omitted = is_thinking_omitted

    def _close(self) -> list[dict]:
        if self._open is None:
            return []
        self._open = None
        return [{"type": "content_block_stop", "index": self._index}]

    def feed(self, event) -> list[dict]:
        kind = ("tool_use" if isinstance(event, ToolCall) else
                "thinking" if isinstance(event, ReasoningDelta) else "text")
        out = []
        if kind != self._open:
            out += self._close()
            self._index += 1
            out.append({"type": "content_block_start", "index": self._index,
                        "content_block": _new_block(event)})
            self._open = kind
        if not (kind == "thinking" and self._is_thinking_omitted):
            out.append({"type": "content_block_delta", "index": self._index,
                        "delta": _delta(event)})
        if kind == "tool_use":
            out += self._close()
        return out

    def finish(self) -> list[dict]:
        return self._close()
