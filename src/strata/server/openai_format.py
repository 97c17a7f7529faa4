"""OpenAI response objects and Server-Sent Events framing (chunks, usage, keep-alive, [DONE])."""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from strata.server.custom_tools import custom_input
from strata.server.output_parser import ContentDelta, ReasoningDelta, ToolCall, json_text

SSE_DONE = "data: [DONE]\n\n"
SSE_KEEPALIVE = ": keep-alive\n\n"


def sse(payload: dict) -> str:
    return "data: " + json_text(payload) + "\n\n"


def usage(num_prompt_tokens: int, num_generated_tokens: int, num_cached_tokens: int,
          num_reasoning_tokens: int = 0) -> dict:
    """`num_reasoning_tokens`: those generated inside `<think>` (0 where nothing parsed them)."""
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_generated_tokens,
            "total_tokens": num_prompt_tokens + num_generated_tokens,
            "prompt_tokens_details": {"cached_tokens": num_cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": num_reasoning_tokens}}


@dataclass
class ResponseHeader:
    """What every object of one response shares."""
    kind: str  # "chat" or "completion"
    model: str
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    custom_tools: frozenset[str] = frozenset()  # tools whose calls are custom calls (chat)

    def __post_init__(self):
        if not self.id:
            prefix = "chatcmpl-" if self.kind == "chat" else "cmpl-"
            self.id = prefix + uuid.uuid4().hex[:24]

    def _base(self, object_name: str) -> dict:
        return {"id": self.id, "object": object_name, "created": self.created,
                "model": self.model, "system_fingerprint": None}

    def chunk(self, delta_or_text, finish_reason: str | None = None,
              is_usage_streamed: bool = False, logprobs: dict | None = None,
              index: int = 0) -> dict:
        """One streamed chunk of choice `index`: a chat delta dict, or a completion's text;
        `logprobs`: the choice's logprobs object for the tokens this chunk carries
        (logprobs_format.py)."""
        if self.kind == "chat":
            payload = self._base("chat.completion.chunk")
            choice = {"index": index, "delta": delta_or_text, "logprobs": logprobs,
                      "finish_reason": finish_reason}
        else:
            payload = self._base("text_completion")
            choice = {"index": index, "text": delta_or_text, "logprobs": logprobs,
                      "finish_reason": finish_reason}
        payload["choices"] = [choice]
        if is_usage_streamed:
            payload["usage"] = None
        return payload

    def usage_chunk(self, usage_dict: dict) -> dict:
        payload = self._base("chat.completion.chunk" if self.kind == "chat"
                             else "text_completion")
        payload["choices"] = []
        payload["usage"] = usage_dict
        return payload

    def chat_choice(self, index: int, content: str, reasoning: str, tool_calls: list[ToolCall],
                    finish_reason: str, logprobs: dict | None = None) -> dict:
        message: dict = {"role": "assistant",
                         "content": content if content or not tool_calls else None}
        if reasoning:
            message["reasoning_content"] = reasoning
        if tool_calls:
            message["tool_calls"] = [tool_call_dict(call, self.custom_tools)
                                     for call in tool_calls]
        return {"index": index, "message": message, "logprobs": logprobs,
                "finish_reason": finish_reason}

    def chat_completion(self, choices: list[dict], usage_dict: dict) -> dict:
        payload = self._base("chat.completion")
        payload["choices"] = choices
        payload["usage"] = usage_dict
        return payload

    @staticmethod
    def text_choice(index: int, text: str, finish_reason: str,
                    logprobs: dict | None = None) -> dict:
        return {"index": index, "text": text, "logprobs": logprobs,
                "finish_reason": finish_reason}

    def text_completion(self, choices: list[dict], usage_dict: dict) -> dict:
        payload = self._base("text_completion")
        payload["choices"] = choices
        payload["usage"] = usage_dict
        return payload


def tool_call_dict(call: ToolCall, custom_tools: frozenset[str] = frozenset()) -> dict:
    """A chat message's tool call: a function's, or a custom tool's with its input."""
    if call.name in custom_tools:
        return {"id": call.id, "type": "custom",
                "custom": {"name": call.name, "input": custom_input(call.arguments)}}
    return {"id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def chat_deltas(event, custom_tools: frozenset[str] = frozenset()) -> list[dict]:
    """The chat deltas of one parser event: a tool call goes out as a first delta with its id
    and name, then one with its arguments (a custom tool's: its input, in the shape OpenAI's
    stream has, which its SDK types only in whole messages)."""
    if isinstance(event, ContentDelta):
        return [{"content": event.text}]
    if isinstance(event, ReasoningDelta):
        return [{"reasoning_content": event.text}]
    assert isinstance(event, ToolCall)
    if event.name in custom_tools:
        return [
            {"tool_calls": [{"index": event.index, "id": event.id, "type": "custom",
                             "custom": {"name": event.name, "input": ""}}]},
            {"tool_calls": [{"index": event.index,
                             "custom": {"input": custom_input(event.arguments)}}]},
        ]
    return [
        {"tool_calls": [{"index": event.index, "id": event.id, "type": "function",
                         "function": {"name": event.name, "arguments": ""}}]},
        {"tool_calls": [{"index": event.index, "function": {"arguments": event.arguments}}]},
    ]
