"""Tool calls held while the model writes them: outside a `<tool_call>` block anything goes;
inside one, the block is a call of a declared function in the form the chat template asks
(server/prompting.py decides which), then `</tool_call>`:
- JSON (Qwen's form): `{"name": <a declared function>, "arguments": {...}}` with whitespace
  around it. With one function its `parameters` schema holds the arguments too (json_schema.py
  says what is held), only its declared parameters unless it sets `additionalProperties`.
- XML (Qwen3-Coder's form): `<function=NAME>`, then `<parameter=KEY>VALUE</parameter>` for
  declared parameters of that function (each once; the required ones before
  `</function>`), whitespace between them. A VALUE is held by the parameter's declared type:
  a string (or any type, or a type list with a string) is free text up to its `</parameter>`;
  a string enum is one of its values, as raw text; a string with a grammar (a `pattern`, or a
  custom tool's grammar: json_schema.GRAMMAR_KEY) is a text of it (held_text.XmlText); any
  other type (integer, number, boolean,
  null, object, array, or a list of them) is one JSON value of it, as json_schema.py holds
  it, after at most one newline and before at most 4 whitespace bytes (what
  server/output_parser reads with json.loads). A function that declares no parameters takes
  any keys."""
from __future__ import annotations

import bisect
import json

import numpy as np

from strata.engine.gbnf import Grammar
from strata.engine.held_text import XmlText
from strata.engine.json_constraint import DONE
from strata.engine.json_schema import (MAX_SCHEMA_DEPTH, SchemaNode, SchemaRecognizer, _key,
                                       compile_schema)

TOOL_OPEN, TOOL_CLOSE = b"<tool_call>", b"</tool_call>"
MAX_TRAILING = 2  # spaces or newlines between the object and </tool_call>


def call_schema(functions: list[dict]) -> dict:
    """The JSON schema of one call of any of `functions` ({"name", "parameters"} dicts): with
    several, a union tagged by the name (json_schema holds "name" first, then that function's
    arguments)."""
    where = (["#/properties/arguments"] if len(functions) == 1 else
             [f"#/anyOf/{i}/properties/arguments" for i in range(len(functions))])
    calls = [{"type": "object",
              "properties": {"name": {"const": f["name"]},
                             "arguments": _rebased(_arguments(f), at)},
              "required": ["name", "arguments"], "additionalProperties": False}
             for f, at in zip(functions, where)]
    if len(calls) == 1:
        return calls[0]
    if len({f["name"] for f in functions}) < len(functions):  # a name twice: the name only
        return {**calls[0], "properties": {"name": {"enum": [f["name"] for f in functions]},
                                           "arguments": {"type": "object"}}}
    return {"anyOf": calls}


# keywords whose values are data, not subschemas: a "$ref" key in them is not a reference
_DATA_KEYWORDS = frozenset(("const", "enum", "default", "examples"))


def _rebased(schema, at: str, depth: int = 0):
    """`schema` with its local references (`#`, `#/$defs/X`: a tool's parameters as their own
    document, as Pydantic writes them) pointing where the call schema holds it (`at`). They
    resolved against the call schema, so such a tool's arguments were held to nothing.
    Deeper than json_schema would compile, the rest is left as it is."""
    if depth > 4 * MAX_SCHEMA_DEPTH:
        return schema
    if isinstance(schema, list):
        return [_rebased(item, at, depth + 1) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = at + value[1:]
        elif key in _DATA_KEYWORDS:
            out[key] = value
        else:
            out[key] = _rebased(value, at, depth + 1)
    return out


def _arguments(function: dict) -> dict:
    """The schema of `function`'s arguments: its parameters, no undeclared key where it
    declares its properties (a model's invented key would fail the call)."""
    arguments = function.get("parameters")
    if not isinstance(arguments, dict):
        return {"type": "object"}
    arguments = dict(arguments)
    if isinstance(arguments.get("properties"), dict):
        arguments.setdefault("additionalProperties", False)
    return arguments


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


_WS = b" \t\n\r"
FUNCTION_OPEN, FUNCTION_CLOSE = b"<function=", b"</function>"
PARAMETER_OPEN, PARAMETER_CLOSE = b"<parameter=", b"</parameter>"
MAX_XML_WHITESPACE = 4  # between two elements of an XML call


class _XmlCall:
    """One XML block being read (Qwen3-Coder): the same feed() as _Call."""

    __slots__ = ("functions", "state", "literals", "at", "name", "key", "seen", "ws", "value",
                 "json", "text")

    def __init__(self, functions: "_Names"):
        # name -> (required keys, declared keys (_Names) or None: any, key -> how its value is
        # held: absent for free text, a tuple of the raw strings it may be, a Grammar its
        # text follows, or a SchemaNode)
        self.functions = functions
        self.state = "open"         # which part is read next (see _step)
        self.literals = (FUNCTION_OPEN,)  # what the bytes being matched may become
        self.at = 0                 # bytes of it matched
        self.name = b""             # the function's name, read so far
        self.key = b""              # the parameter's key, read so far
        self.seen = frozenset()     # the parameters written
        self.ws = 0                 # whitespace bytes in a row
        self.value = b""            # the value's last bytes (its closing tag may be coming)
        self.json = None            # a typed value's SchemaRecognizer while it is read
        self.text = None            # a grammar's value (XmlText) while it is read

    def copy(self) -> "_XmlCall":
        other = _XmlCall.__new__(_XmlCall)
        for name in _XmlCall.__slots__:
            setattr(other, name, getattr(self, name))
        if self.json is not None:
            other.json = self.json.copy()
        if self.text is not None:
            other.text = self.text.copy()
        return other

    def feed(self, data: bytes) -> int:
        for i, c in enumerate(data):
            done = self._step(c)
            if done < 0:
                return -1
            if done:
                return i + 1
        return len(data) + 1

    def _literal(self, c: int) -> int:
        """Match the next byte of one of `literals`: 0 partway, 1 one matched whole, -1 none."""
        at = self.at
        left = tuple(lit for lit in self.literals if len(lit) > at and lit[at] == c)
        if not left:
            return -1
        self.literals, self.at = left, at + 1
        return 1 if len(left) == 1 and len(left[0]) == at + 1 else 0

    def _space(self, c: int) -> bool:
        if self.at == 0 and c in _WS and self.ws < MAX_XML_WHITESPACE:
            self.ws += 1
            return True
        return False

    def _step(self, c: int) -> int:
        """0 to go on, 1 when the block closed, -1 refused."""
        state = self.state
        if state in ("name", "key"):
            return self._read_name(c, state)
        if state == "value":
            self.value = (self.value + bytes((c,)))[-len(PARAMETER_CLOSE):]
            if self.value == PARAMETER_CLOSE:
                self._expect("body", self._body_literals())
            return 0
        if state == "text":
            done = self.text.byte(c)
            if done > 0:
                self.text = None
                self._expect("body", self._body_literals())
            return min(done, 0)
        if state == "json":
            if self.json.feed(bytes((c,))):
                if self.json.is_done:
                    self._expect("end", (PARAMETER_CLOSE,))
                return 0
            if self.json.mode != DONE:  # DONE: a number ended at `c`, read next
                return -1
            self._expect("end", (PARAMETER_CLOSE,))
        if self._space(c):
            return 0
        got = self._literal(c)
        if got <= 0:
            return got
        lit = self.literals[0]
        if self.state in ("end", "enum"):  # the value and its </parameter> are read
            self._expect("body", self._body_literals())
        elif lit == FUNCTION_OPEN:
            self.state, self.name = "name", b""
        elif lit == PARAMETER_OPEN:
            self.state, self.key = "key", b""
        elif lit == FUNCTION_CLOSE:
            self._expect("close", (TOOL_CLOSE,))
        elif lit == TOOL_CLOSE:
            return 1
        return 0

    def _read_name(self, c: int, state: str) -> int:
        sofar = self.name if state == "name" else self.key
        if state == "name":
            choices = self.functions
        else:
            choices = self.functions[self.name][1]
        if c == ord(">"):
            if choices is None:
                ok = bool(sofar) and sofar not in self.seen
            else:
                ok = sofar in choices and (state == "name" or sofar not in self.seen)
            if not ok:
                return -1
            if state == "name":
                self._expect("body", self._body_literals())
            else:
                self.seen = self.seen | {sofar}
                self._start_value(sofar)
            return 0
        if c in b"\n<>":
            return -1
        sofar += bytes((c,))
        if choices is not None and not choices.has_prefix(sofar):
            return -1
        if state == "name":
            self.name = sofar
        else:
            self.key = sofar
        return 0

    def _start_value(self, key: bytes) -> None:
        held = self.functions[self.name][2].get(key)
        if held is None:
            self.state, self.value = "value", b""
        elif isinstance(held, SchemaNode):
            self.state, self.json = "json", SchemaRecognizer(held, is_any_value=True)
        elif isinstance(held, Grammar):
            self.state, self.text = "text", XmlText(held, PARAMETER_CLOSE)
        else:  # a string enum: one of its values, then the closing tag
            self._expect("enum", tuple(v + end for v in held
                                       for end in (PARAMETER_CLOSE, b"\n" + PARAMETER_CLOSE)))

    def _body_literals(self) -> tuple:
        required, declared, _ = self.functions[self.name]
        out = ()
        if declared is None or any(k not in self.seen for k in declared):
            out += (PARAMETER_OPEN,)
        if required <= self.seen:
            out += (FUNCTION_CLOSE,)
        return out

    def _expect(self, state: str, literals: tuple) -> None:
        self.state, self.literals, self.at, self.ws = state, literals, 0, 0


class _Names(dict):
    """Names (bytes) -> what each holds, with a prefix test by binary search in the names sorted
    once: an agent may declare thousands of tools, and each byte of a name is checked for every
    candidate token (3,000 tools: ~0.12 s a token scanning them all)."""

    def __init__(self, items):
        super().__init__(items)
        self._sorted = sorted(self)

    def has_prefix(self, prefix: bytes) -> bool:
        at = bisect.bisect_left(self._sorted, prefix)
        return at < len(self._sorted) and self._sorted[at].startswith(prefix)


def _held_value(node: SchemaNode):
    """How an XML value of a parameter with this compiled schema is held (see _XmlCall)."""
    if node.strings is not None:
        return tuple(json.loads(b'"' + v + b'"').encode() for v in node.strings)
    if node.grammar is not None and (node.types is None or node.types == {"string"}):
        return node.grammar
    if node.types is None or "string" in node.types:
        return None  # free text: a string can be any text, so any text is a value
    return node


def _xml_functions(functions: list[dict]) -> _Names:
    out = {}
    for f in functions:
        params = f.get("parameters") if isinstance(f.get("parameters"), dict) else {}
        props = params.get("properties")
        required = params.get("required") if isinstance(params.get("required"), list) else []
        required = [k for k in required if isinstance(k, str)]
        declared = (_Names(dict.fromkeys(k.encode() for k in [*props, *required]))  # a
                    if isinstance(props, dict) and props else None)  # required key may be
        # left undeclared
        root = compile_schema(params)
        values = {}
        for key in props if declared else ():
            held = _held_value(root.properties[_key(key)])
            if held is not None:
                values[key.encode()] = held
        out[f["name"].encode()] = (frozenset(k.encode() for k in required), declared, values)
    return _Names(out)


class ToolCallConstraint:
    """The sampler's constraint (allows / push / candidates, as JsonObjectConstraint) for a
    request whose tool calls are held: free text, and each `<tool_call>` block a valid call,
    JSON or (`xml`) Qwen3-Coder's form."""

    def __init__(self, tokenizer, functions: list[dict], xml: bool = False,
                 max_calls: int | None = None):
        self._tokenizer = tokenizer
        self.max_calls = max_calls  # blocks the answer may hold (None: any number)
        self._special = tokenizer.special_ids
        self._added = tokenizer.added_ids  # tags: none inside a block but its closing one
        if xml:
            table = _xml_functions(functions)
            self._new_call = lambda: _XmlCall(table)
        else:
            root = compile_schema(call_schema(functions))
            self._new_call = lambda: _Call(root)
        self.call: _Call | None = None  # the block being written, None outside one
        self._tail = b""                # the text's last bytes: an opening tag may span tokens
        self.num_closed = 0             # blocks closed so far

    def _after(self, data: bytes) -> tuple[_Call | None, bytes, int]:
        """(the block state after `data`, the new tail, -1 if refused)."""
        return self._run(self.call, self._tail, data)[:3]

    def _run(self, call, tail: bytes, data: bytes) -> tuple[_Call | None, bytes, int, int]:
        """From the block state `call` (not changed) and `tail`: (the state after `data`, the
        new tail, -1 if refused, the blocks it closed). `tail`: outside a block the text's
        last bytes (an opening tag may span tokens), inside one the block's last bytes: the
        reader ends a block at the first `</tool_call>` in its text, so that text may hold
        one only at the block's end (a string value spelling it cut the call short)."""
        if call is not None:
            call = call.copy()
        closed = 0
        keep = len(TOOL_CLOSE) - 1
        while data:
            if call is None:
                text = tail + data
                at = text.find(TOOL_OPEN)
                if at < 0:
                    return None, text[-(len(TOOL_OPEN) - 1):], 0, closed
                data = text[at + len(TOOL_OPEN):]
                call, tail = self._new_call(), b""
                continue
            used = call.feed(data)
            if used < 0:
                return call, tail, -1, closed
            if used > len(data):
                body = tail + data
                if TOOL_CLOSE in body:
                    return call, tail, -1, closed
                return call, body[-keep:], 0, closed
            if TOOL_CLOSE in (tail + data[:used])[:-len(TOOL_CLOSE)]:
                return call, tail, -1, closed
            call, tail, data, closed = None, b"", data[used:], closed + 1
        return call, tail, 0, closed

    @property
    def is_full(self) -> bool:
        """max_calls blocks are closed: no other may open."""
        return self.max_calls is not None and self.num_closed >= self.max_calls

    def allows(self, token: int) -> bool:
        data = self._tokenizer.token_bytes(token)
        if self.call is None and TOOL_OPEN not in self._tail + data:
            return True  # free text
        if self.call is not None and (not data or (token in self._added and
                                                   data != TOOL_CLOSE)):
            return False
        call, _, status, closed = self._run(self.call, self._tail, data)
        if status < 0:
            return False
        # every block it leaves opened, closed ones included, counts against max_calls
        return self.max_calls is None or (
            self.num_closed + closed + (call is not None) <= self.max_calls)

    @property
    def is_free(self) -> bool:
        """Outside a block, with no part of an opening tag at the text's end: every token but
        one that holds a whole tag is allowed (the sampler may skip asking). Not once the
        blocks are full: then a whole tag is refused too, so every token is asked."""
        return self.call is None and not self.is_full and not any(
            self._tail.endswith(TOOL_OPEN[:n]) for n in range(1, len(TOOL_OPEN)))

    def push(self, token: int) -> None:
        """Take `token` (one `allows` accepted)."""
        data = self._tokenizer.token_bytes(token)
        if self.call is None and token in self._special and data != TOOL_OPEN:
            self._tail = b""  # a special token's text does not join a tag
            return
        self.call, self._tail, status, closed = self._run(self.call, self._tail, data)
        self.num_closed += closed
        if status < 0:  # a token `allows` did not see (a whole tag in one text token)
            self.call = self._new_call()

    def candidates(self) -> np.ndarray:
        """Ids that may pass `allows` (a superset): outside a block every id; inside, those
        whose first byte the block may take next."""
        first = self._tokenizer.first_byte_table()
        if self.call is None:
            return np.arange(first.shape[0])
        call = self.call
        if isinstance(call, _XmlCall):
            ok = np.array([call.copy()._step(b) >= 0 for b in range(256)])
        elif not call.json.is_done:
            ok = call.json.first_bytes()
        else:
            ok = np.zeros(256, dtype=bool)
            ok[TOOL_CLOSE[call.closed]] = True
            if call.closed == 0 and call.trailing < MAX_TRAILING:
                ok[list(b" \n")] = True
        return np.flatnonzero(np.append(ok, False)[first])
