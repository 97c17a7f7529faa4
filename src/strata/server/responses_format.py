"""OpenAI Responses API objects: output items from the output parser's events (reasoning,
message, function_call), the response object, usage, and the streamed events that build them
(output_item.added / content_part.added / deltas / done, in OpenAI's order)."""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from strata.server.output_parser import ContentDelta, ReasoningDelta, ToolCall, json_text
from strata.server.custom_tools import CUSTOM_INPUT

# `include: ["reasoning.encrypted_content"]` (Codex, store false): the client sends each
# reasoning item back with this field and without its reasoning_text content, so a reasoning
# item's text rides in the field too, after this mark (no cipher: this server keeps no
# secret and no state), and is read back from it (responses_schema._reasoning_text)
REASONING_INCLUDE = "reasoning.encrypted_content"
REASONING_MARK = "strata-reasoning-v1:"


def _new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


def sse_event(payload: dict) -> str:
    return f"event: {payload['type']}\ndata: " + json_text(payload) + "\n\n"


def usage(num_prompt_tokens: int, num_cached_tokens: int, num_generated_tokens: int,
          num_reasoning_tokens: int) -> dict:
    return {"input_tokens": num_prompt_tokens,
            "input_tokens_details": {"cached_tokens": num_cached_tokens, "cache_write_tokens": 0},
            "output_tokens": num_generated_tokens,
            "output_tokens_details": {"reasoning_tokens": num_reasoning_tokens},
            "total_tokens": num_prompt_tokens + num_generated_tokens}


def _part(kind: str, text: str = "") -> dict:
    if kind == "reasoning":
        return {"type": "reasoning_text", "text": text}
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class OutputItems:
    """The output items of one response, built event by event: runs of reasoning or of text
    make one reasoning or message item (one content part each), every tool call a
    function_call item (a custom_tool_call for a name in `custom_names`). `feed` / `finish`
    return the stream events of what changed (without sequence numbers); `items` holds the
    items so far, each complete once closed."""

    def __init__(self, custom_names: frozenset[str] = frozenset(),
                 is_reasoning_kept: bool = False):
        self.items: list[dict] = []
        self._open: str | None = None  # "reasoning" or "message" while one is open
        self._custom_names = custom_names
        self._is_reasoning_kept = is_reasoning_kept  # REASONING_INCLUDE was asked

    def _at(self) -> dict:
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1}

    def _close(self, status: str = "completed") -> list[dict]:
        if self._open is None:
            return []
        item, kind = self.items[-1], self._open
        self._open = None
        part = item["content"][0]
        item["status"] = status
        if kind == "reasoning" and self._is_reasoning_kept:
            item["encrypted_content"] = REASONING_MARK + part["text"]
        done = "response.reasoning_text.done" if kind == "reasoning" else \
            "response.output_text.done"
        text_done = dict(self._at(), type=done, content_index=0, text=part["text"])
        if kind == "message":
            text_done["logprobs"] = list(part["logprobs"])
        return [text_done,
                dict(self._at(), type="response.content_part.done", content_index=0,
                     part=dict(part)),
                {"type": "response.output_item.done", "output_index": len(self.items) - 1,
                 "item": _copy(item)}]

    def _add(self, item: dict) -> dict:
        self.items.append(item)
        return {"type": "response.output_item.added", "output_index": len(self.items) - 1,
                "item": _copy(item)}

    def feed(self, event, logprobs: list[dict] | None = None) -> list[dict]:
        """`logprobs`: the entries (chat's shape) of the tokens that arrived since the last
        call; kept on a message's text, dropped with reasoning or a tool call."""
        if isinstance(event, ToolCall) and event.name in self._custom_names:
            return self._custom_call(event)
        if isinstance(event, ToolCall):
            out = self._close()
            item = {"type": "function_call", "id": _new_id("fc_"), "call_id": event.id,
                    "name": event.name, "arguments": "", "status": "in_progress"}
            out.append(self._add(item))
            item["arguments"], item["status"] = event.arguments, "completed"
            return out + [
                dict(self._at(), type="response.function_call_arguments.delta",
                     delta=event.arguments),
                dict(self._at(), type="response.function_call_arguments.done",
                     arguments=event.arguments),
                {"type": "response.output_item.done", "output_index": len(self.items) - 1,
                 "item": _copy(item)}]
        kind = "reasoning" if isinstance(event, ReasoningDelta) else "message"
        out = []
        if kind != self._open:
            out += self._close()
            if kind == "reasoning":
                item = {"type": "reasoning", "id": _new_id("rs_"), "summary": [],
                        "content": [], "status": "in_progress"}
            else:
                item = {"type": "message", "id": _new_id("msg_"), "status": "in_progress",
                        "role": "assistant", "content": []}
            out.append(self._add(item))
            item["content"].append(_part(kind))
            out.append(dict(self._at(), type="response.content_part.added", content_index=0,
                            part=_part(kind)))
            self._open = kind
        self.items[-1]["content"][0]["text"] += event.text
        delta = dict(self._at(), content_index=0, delta=event.text,
                     type="response.reasoning_text.delta" if kind == "reasoning" else
                     "response.output_text.delta")
        if kind == "message":
            delta["logprobs"] = list(logprobs or [])
            self.items[-1]["content"][0]["logprobs"] += delta["logprobs"]
        return out + [delta]

    def _custom_call(self, event: ToolCall) -> list[dict]:
        """A custom tool's call: its input is the one string argument the model wrote (the
        arguments' text as they are, if the model wrote something else)."""
        out = self._close()
        try:
            arguments = json.loads(event.arguments)
        except ValueError:
            arguments = None
        text = arguments.get(CUSTOM_INPUT) if isinstance(arguments, dict) else None
        if not isinstance(text, str):
            text = event.arguments
        item = {"type": "custom_tool_call", "id": _new_id("ctc_"), "call_id": event.id,
                "name": event.name, "input": ""}
        out.append(self._add(item))
        item["input"] = text
        return out + [
            dict(self._at(), type="response.custom_tool_call_input.delta", delta=text),
            dict(self._at(), type="response.custom_tool_call_input.done", input=text),
            {"type": "response.output_item.done", "output_index": len(self.items) - 1,
             "item": _copy(item)}]

    def finish(self, is_cut: bool = False) -> list[dict]:
        """Close the open item; `is_cut`: max_output_tokens (or the context) ended the output
        inside it, so it is "incomplete", as the response is."""
        return self._close("incomplete" if is_cut else "completed")


class TextLogprobs:
    """Which generated tokens' logprob entries go with the message text: those of the text the
    output parser passes on as content. A token of a `<think>` block (either tag included), of
    a tool call, or of the whitespace the parser drops after those has none; the tokens of a
    call that comes out as text (unreadable, or cut) go with that text."""

    def __init__(self):
        self._content: list[dict] = []  # entries of content tokens not yet passed on
        self._call: list[dict] = []  # of the tool call being read
        self._is_after_tag = False  # the parser drops whitespace here

    def feed(self, entries: list[dict] | None, text: str, was: tuple[bool, bool], parser,
             events: list) -> list[list[dict]]:
        """Each event's entries, for one token: `entries` its own (None: none), `text` its
        text, `was` whether the parser was in reasoning / inside a call before it, `parser`
        after it, `events` what the parser made of it."""
        entries = entries or []
        if was[0] or parser.is_in_reasoning:
            self._content = []  # only whitespace comes before a <think>: dropped with it
            self._is_after_tag = True
        elif was[1] or parser.is_inside_tool_call:
            self._call += entries
        elif not (self._is_after_tag and not self._content and text and text.isspace()
                  and not any(isinstance(e, ContentDelta) for e in events)):
            self._content += entries
        out = []
        for event in events:
            taken = []
            if isinstance(event, ToolCall):  # the whitespace held before it is dropped too
                self._content, self._call, self._is_after_tag = [], [], True
            elif isinstance(event, ContentDelta):
                taken, self._content, self._call = self._content + self._call, [], []
                self._is_after_tag = False
            out.append(taken)
        return out


def _copy(item: dict) -> dict:
    return json.loads(json.dumps(item))


@dataclass
class ResponseHeader:
    """What the response object echoes of its request, and its id."""
    model: str
    request: dict  # the fields echoed: instructions, tools, tool_choice, temperature, ...
    id: str = field(default_factory=lambda: _new_id("resp_"))
    created_at: int = field(default_factory=lambda: int(time.time()))

    def response(self, status: str, output: list[dict], usage_dict: dict | None,
                 incomplete_reason: str | None = None, error: dict | None = None) -> dict:
        req = self.request
        return {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": status, "model": self.model, "output": output, "error": error,
            "incomplete_details": ({"reason": incomplete_reason} if incomplete_reason
                                   else None),
            "instructions": req.get("instructions"),
            "max_output_tokens": req.get("max_output_tokens"),
            "parallel_tool_calls": req.get("parallel_tool_calls", True),
            "previous_response_id": None, "reasoning": req.get("reasoning"),
            "store": False, "temperature": req.get("temperature"), "top_p": req.get("top_p"),
            "text": req.get("text") or {"format": {"type": "text"}},
            "tool_choice": req.get("tool_choice", "auto"), "tools": req.get("tools") or [],
            "truncation": "disabled", "metadata": req.get("metadata") or {},
            "usage": usage_dict}
