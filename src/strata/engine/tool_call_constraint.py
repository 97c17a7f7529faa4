"""Tool calls held to JSON while the model writes them: outside a `<tool_call>` block anything
goes; inside one, the block is `{"name": <a declared function>, "arguments": {...}}` (Qwen's
JSON call form, as the chat template asks), whitespace around it, then `</tool_call>`. With one
function its `parameters` schema holds the arguments too (json_schema.py says what is held),
only its declared parameters unless it sets `additionalProperties` itself.
Only for templates whose calls are JSON: Qwen3-Coder's XML `<function=...>` form is not held
(server/prompting.py decides)."""
from __future__ import annotations

import numpy as np

from strata.engine.json_schema import SchemaRecognizer, compile_schema

TOOL_OPEN, TOOL_CLOSE = b"<tool_call>", b"</tool_call>"
MAX_TRAILING = 2  # spaces or newlines between the object and </tool_call>


def call_schema(functions: list[dict]) -> dict:
    """The JSON schema of one call of any of `functions` ({"name", "parameters"} dicts)."""
    arguments = {"type": "object"}
    if len(functions) == 1 and isinstance(functions[0].get("parameters"), dict):
        arguments = dict(functions[0]["parameters"])
        if isinstance(arguments.get("properties"), dict):
            arguments.setdefault("additionalProperties", False)
    return {"type": "object",
            "properties": {"name": {"enum": [f["name"] for f in functions]},
                           "arguments": arguments},
            "required": ["name", "arguments"], "additionalProperties": False}


class _Call:
    """One block being read: the object, then the whitespace and `</tool_call>` after it."""

    __slots__ = ("json", "closed", "trailing")

    def __init__(self, root):
        self.json = SchemaRecognizer(root)
        self.closed = 0    # bytes of TOOL_CLOSE read
        self.trailing = 0  # whitespace bytes after the object

    def copy(self) -> "_Call":
        other = _Call.__new__(_Call)
        other.json, other.closed, other.trailing = self.json.copy(), self.closed, self.trailing
        return other

    def feed(self, data: bytes) -> int:
        """Bytes read until the block closed (len(data) + 1 while it is open), -1 if refused."""
        for i, c in enumerate(data):
            if not self.json.is_done:
                if not self.json.feed(bytes((c,))):
                    return -1
            elif self.closed == 0 and c in b" \n" and self.trailing < MAX_TRAILING:
                self.trailing += 1
            elif c == TOOL_CLOSE[self.closed]:
                self.closed += 1
                if self.closed == len(TOOL_CLOSE):
                    return i + 1
            else:
                return -1
        return len(data) + 1


class ToolCallConstraint:
    """The sampler's constraint (allows / push / candidates, as JsonObjectConstraint) for a
    request whose tool calls are held: free text, and each `<tool_call>` block a valid call."""

    def __init__(self, tokenizer, functions: list[dict]):
        self._tokenizer = tokenizer
        self._special = tokenizer.special_ids
        self._added = tokenizer.added_ids  # tags: none inside a block but its closing one
        self._root = compile_schema(call_schema(functions))
        self.call: _Call | None = None  # the block being written, None outside one
        self._tail = b""                # the text's last bytes: an opening tag may span tokens

    def _after(self, data: bytes) -> tuple[_Call | None, bytes, int]:
        """(the block state after `data`, the new tail, -1 if refused)."""
        call, tail = self.call, self._tail
        if call is not None:
            call = call.copy()
        while data:
            if call is None:
                text = tail + data
                at = text.find(TOOL_OPEN)
                if at < 0:
                    return None, text[-(len(TOOL_OPEN) - 1):], 0
                data = text[at + len(TOOL_OPEN):]
                call, tail = _Call(self._root), b""
                continue
            used = call.feed(data)
            if used < 0:
                return call, tail, -1
            if used > len(data):
                return call, tail, 0
            call, data = None, data[used:]
        return call, tail, 0

    def allows(self, token: int) -> bool:
        data = self._tokenizer.token_bytes(token)
        if self.call is None:  # free text, unless the token opens a block
            return TOOL_OPEN not in self._tail + data or self._after(data)[2] == 0
        if not data or (token in self._added and data != TOOL_CLOSE):
            return False
        return self._after(data)[2] == 0

    @property
    def is_free(self) -> bool:
        """Outside a block, with no part of an opening tag at the text's end: every token but
        one that holds a whole tag is allowed (the sampler may skip asking)."""
        return self.call is None and not any(
            self._tail.endswith(TOOL_OPEN[:n]) for n in range(1, len(TOOL_OPEN)))

    def push(self, token: int) -> None:
        """Take `token` (one `allows` accepted)."""
        data = self._tokenizer.token_bytes(token)
        if self.call is None and token in self._special and data != TOOL_OPEN:
            self._tail = b""  # a special token's text does not join a tag
            return
        self.call, self._tail, status = self._after(data)
        if status < 0:  # a token `allows` did not see (a whole tag in one text token)
            self.call = _Call(self._root)

    def candidates(self) -> np.ndarray:
        """Ids that may pass `allows` (a superset): outside a block every id; inside, those
        whose first byte the block may take next."""
        first = self._tokenizer.first_byte_table()
        if self.call is None:
            return np.arange(first.shape[0])
        call = self.call
        if not call.json.is_done:
            ok = call.json.first_bytes()
        else:
            ok = np.zeros(256, dtype=bool)
            ok[TOOL_CLOSE[call.closed]] = True
            if call.closed == 0 and call.trailing < MAX_TRAILING:
                ok[list(b" \n")] = True
        return np.flatnonzero(np.append(ok, False)[first])
