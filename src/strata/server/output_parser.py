"""Incremental parser of a chat model's output: `<think>` reasoning, Qwen `<tool_call>` blocks
(JSON or `<function=...>` XML form) and plain content. Pure: feed text pieces, get events."""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Callable

from strata.model.tokenizer import LONE_SURROGATE, valid_text

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
TOOL_OPEN = "<tool_call>"
TOOL_CLOSE = "</tool_call>"


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ToolCall:
    """A complete call: `arguments` is a JSON object in a string, as OpenAI sends it."""
    index: int
    id: str
    name: str
    arguments: str


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _held_prefix_len(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `tags`: those
    characters may become a tag with the next piece, so they are held back."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:n]):
                best = n
                break
    return best


_FUNCTION_RE = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.DOTALL)
_PARAMETER_RE = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


def _strip_one_newline(value: str) -> str:
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def _xml_value(raw: str, declared_type: str | tuple | None):
    """A parameter value of the XML form: kept as a string where the tool declares a string
    (or the text is not JSON), else the JSON value it spells (numbers, booleans, objects); a
    type list with "string" keeps a string too, but for `null` where it also takes null."""
    if declared_type == "string":
        return raw
    if isinstance(declared_type, tuple) and "string" in declared_type:
        return None if raw == "null" and "null" in declared_type else raw
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def parse_tool_call_body(body: str,
                         param_types: dict[str, dict] | None = None
                         ) -> tuple[str, dict] | None:
    """(name, arguments) of the text between `<tool_call>` and `</tool_call>`, or None when it is
    neither a JSON call `{"name": ..., "arguments": {...}}` nor the `<function=NAME>` XML form."""
    text = body.strip()
    match = _FUNCTION_RE.fullmatch(text)
    if match:
        name = match.group(1).strip()
        types = (param_types or {}).get(name, {})
        arguments = {}
        rest = _PARAMETER_RE.sub("", match.group(2))
        if rest.strip():
            return None
        for param in _PARAMETER_RE.finditer(match.group(2)):
            key = param.group(1).strip()
            arguments[key] = _xml_value(_strip_one_newline(param.group(2)), types.get(key))
        return (name, arguments) if name else None
    try:
        call = json.loads(text)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):
        # Some models send the arguments already encoded as a JSON string.
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return valid_text(call["name"]), arguments  # a name escaping half a UTF-16 pair: U+FFFD


class OutputParser:
    """Splits streamed model text into content, reasoning and tool calls.

    Invariants: a piece of text that may still become a tag (`<tool_` at the end of a piece) is
    held back until the next piece decides it; a tool call is emitted whole once its closing tag
    arrives, so a call is never half-sent: one the output ended inside (check
    `is_inside_tool_call` before `finish()` to report it) or one that cannot be read comes out
    as the text the model wrote. Only a `<think>` that opens the output (after whitespace at
    most) starts a reasoning block, as the engine's constraints and thinking budget read it;
    a later one (an answer about the tags) is text. Whitespace right after `<think>`,
    `</think>` and a tool call is dropped, and so is whitespace right before `</think>` and
    before a tool call (kept where the call comes out as text).
    """

    def __init__(self, *, starts_in_reasoning: bool = False, parse_tools: bool = True,
                 param_types: dict[str, dict[str, str]] | None = None,
                 new_id: Callable[[], str] = new_call_id):
        self._state = "reasoning" if starts_in_reasoning else "content"
        self._parse_tools = parse_tools
        self._param_types = param_types
        self._new_id = new_id
        self._buffer = ""          # text not yet decided (partial tags, a tool call's body)
        self._held_space = ""      # whitespace that is dropped if a tag follows it
        self._strip_leading = starts_in_reasoning
        self._space_before_call = ""  # whitespace before the open `<tool_call>`
        self._may_open_reasoning = not starts_in_reasoning  # nothing but whitespace so far
        self.num_tool_calls = 0
        self.num_invalid_tool_calls = 0

    @property
    def is_inside_tool_call(self) -> bool:
        return self._state == "tool_call"

    @property
    def is_in_reasoning(self) -> bool:
        """The text fed next belongs to a `<think>` block (until its `</think>`)."""
        return self._state == "reasoning"

    def _open_tags(self) -> tuple[str, ...]:
        if self._state == "reasoning":
            return (THINK_CLOSE,)
        think = (THINK_OPEN,) if self._may_open_reasoning else ()
        return think + (TOOL_OPEN,) if self._parse_tools else think

    def _emit_text(self, text: str, out: list) -> None:
        """Emits plain text of the current state, holding back trailing whitespace."""
        if self._strip_leading:
            text = text.lstrip()
            if not text:
                return
            self._strip_leading = False
        body = text.rstrip()
        if body:
            kind = ReasoningDelta if self._state == "reasoning" else ContentDelta
            out.append(kind(self._held_space + body))
            self._held_space = ""
            self._may_open_reasoning = False
        self._held_space += text[len(body):]

    def feed(self, text: str) -> list:
        """Events (ContentDelta, ReasoningDelta, ToolCall) decided by this piece of text."""
        out: list = []
        self._buffer += text
        while self._buffer:
            if self._state == "tool_call":
                end = self._buffer.find(TOOL_CLOSE)
                if end < 0:
                    break
                body = self._buffer[:end]
                self._buffer = self._buffer[end + len(TOOL_CLOSE):]
                self._state = "content"
                self._close_tool_call(body, out)
                continue
            tags = self._open_tags()
            positions = [(self._buffer.find(tag), tag) for tag in tags]
            positions = [(pos, tag) for pos, tag in positions if pos >= 0]
            if positions:
                pos, tag = min(positions)
                if tag == THINK_OPEN and self._buffer[:pos].strip():
                    self._may_open_reasoning = False  # text came first: this one is text
                    continue
                self._emit_text(self._buffer[:pos], out)
                self._buffer = self._buffer[pos + len(tag):]
                self._space_before_call = self._held_space if tag == TOOL_OPEN else ""
                self._held_space = ""
                self._may_open_reasoning = False
                self._strip_leading = tag != TOOL_OPEN
                self._state = {THINK_OPEN: "reasoning", THINK_CLOSE: "content",
                               TOOL_OPEN: "tool_call"}[tag]
                continue
            keep = _held_prefix_len(self._buffer, tags)
            self._emit_text(self._buffer[:len(self._buffer) - keep], out)
            self._buffer = self._buffer[len(self._buffer) - keep:]
            break
        return out

    def _close_tool_call(self, body: str, out: list) -> None:
        parsed = parse_tool_call_body(body, self._param_types)
        self._strip_leading = True
        if parsed is None:
            # Not a call we can read: the client sees it as text rather than losing it.
            self.num_invalid_tool_calls += 1
            self._emit_call_as_text(TOOL_OPEN + body + TOOL_CLOSE, out)
            return
        name, arguments = parsed
        out.append(ToolCall(self.num_tool_calls, self._new_id(), name,
                            json_text(arguments)))
        self.num_tool_calls += 1

    def _emit_call_as_text(self, text: str, out: list) -> None:
        """A `<tool_call>` block that is no call, as content: with the whitespace before it."""
        self._strip_leading = False
        self._held_space = self._space_before_call
        self._emit_text(text, out)

    def finish(self) -> list:
        """Events of the text still held at the end of the output. A tool call the output ended
        inside comes out as its text (check `is_inside_tool_call` first to report it)."""
        out: list = []
        if self._state == "tool_call":
            self._state = "content"
            self._buffer, pending = "", self._buffer
            self._emit_call_as_text(TOOL_OPEN + pending, out)
        pending = self._buffer
        self._buffer = ""
        if pending:
            self._emit_text(pending, out)
        if self._held_space:
            kind = ReasoningDelta if self._state == "reasoning" else ContentDelta
            out.append(kind(self._held_space))
            self._held_space = ""
        return out


def json_text(value) -> str:
    """`value` as JSON text that has UTF-8 (a call's arguments, an SSE event's data): half of
    a UTF-16 pair the model escaped alone ("\\ud800", kept in a string it parsed) stays
    escaped, as Flask's jsonify writes it; as a character it would fail the answer."""
    text = json.dumps(value, ensure_ascii=False)
    return LONE_SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def parse_complete(text: str, **kwargs) -> tuple[str, str, list[ToolCall], bool]:
    """(content, reasoning, tool calls, ended inside a call) of a whole output."""
    parser = OutputParser(**kwargs)
    events = parser.feed(text)
    is_cut = parser.is_inside_tool_call
    events += parser.finish()
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    return content, reasoning, [e for e in events if isinstance(e, ToolCall)], is_cut
