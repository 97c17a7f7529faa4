"""A JSON schema's structure held while the answer is written (response_format json_schema):
JsonRecognizer with the schema's types, object keys, required keys and string enums. What is
held, and what is not (docs in README, "Serve"):
- `type` (one or a list), and `properties` / `items` / `additionalProperties` (false: only the
  declared keys), `required` (the object closes only once they are all there), each key once;
- `enum` / `const` of strings (the string must be one of them); an enum of other values holds
  its values' types only;
- `$ref` to `#/$defs/...` or `#/definitions/...`; `anyOf` / `oneOf` whose alternatives only
  name types (e.g. a string or null), as the union of those types;
- not held: patterns, formats, lengths, bounds, and `anyOf` / `oneOf` / `allOf` of structured
  alternatives (their value is any JSON value)."""
from __future__ import annotations

import json

import numpy as np

from strata.engine.json_constraint import JsonRecognizer

_KIND = {ord("{"): "object", ord("["): "array", ord('"'): "string", ord("t"): "boolean",
         ord("f"): "boolean", ord("n"): "null"}
_VALUE_TYPE = {bool: "boolean", int: "integer", float: "number", str: "string",
               type(None): "null", dict: "object", list: "array"}


class SchemaNode:
    """One compiled (sub)schema. types None: any type; additional True: any other key (its
    value any), False: none, or a node for their values; strings: the allowed contents of a
    string, JSON-escaped, or None."""

    __slots__ = ("types", "properties", "required", "additional", "items", "strings")

    def __init__(self):
        self.types: frozenset[str] | None = None
        self.properties: dict[bytes, SchemaNode] = {}
        self.required: frozenset[bytes] = frozenset()
        self.additional: bool | SchemaNode = True
        self.items: SchemaNode | None = None
        self.strings: tuple[bytes, ...] | None = None

    @property
    def is_free(self) -> bool:
        """No key of an object is held (nothing to track per key)."""
        return (not self.properties and not self.required and self.additional is True)


ANY = SchemaNode()


def _key(name: str) -> bytes:
    """A key or string as it appears between the quotes (JSON-escaped, UTF-8)."""
    return json.dumps(name, ensure_ascii=False)[1:-1].encode()


def compile_schema(schema) -> SchemaNode:
    """The root node of a JSON schema (a dict); ANY for anything that is not one."""
    nodes: dict[int, SchemaNode] = {}
    return _compile(schema, schema if isinstance(schema, dict) else {}, nodes)


def _resolve(ref: str, root: dict):
    for prefix in ("#/$defs/", "#/definitions/"):
        if ref.startswith(prefix):
            table = root.get(prefix[2:-1])
            if isinstance(table, dict):
                return table.get(ref[len(prefix):])
    return None


def _compile(schema, root: dict, nodes: dict[int, SchemaNode]) -> SchemaNode:
    if not isinstance(schema, dict):
        return ANY
    if id(schema) in nodes:  # a recursive $ref: the node being built
        return nodes[id(schema)]
    ref = schema.get("$ref")
    if isinstance(ref, str):
        target = _resolve(ref, root)
        return ANY if target is None else _compile(target, root, nodes)
    node = nodes[id(schema)] = SchemaNode()
    kind = schema.get("type")
    if isinstance(kind, str):
        node.types = frozenset((kind,))
    elif isinstance(kind, list) and all(isinstance(k, str) for k in kind):
        node.types = frozenset(kind)
    alternatives = schema.get("anyOf", schema.get("oneOf"))
    if node.types is None and isinstance(alternatives, list) and alternatives:
        parts = [_compile(a, root, nodes) for a in alternatives]
        if all(p.types is not None and p.is_free and p.items is None and p.strings is None
               for p in parts):
            node.types = frozenset().union(*(p.types for p in parts))
    values = schema["enum"] if isinstance(schema.get("enum"), list) else (
        [schema["const"]] if "const" in schema else None)
    if values:
        if all(isinstance(v, str) for v in values):
            node.strings = tuple(_key(v) for v in values)
            node.types = frozenset(("string",))
        else:
            node.types = frozenset(_VALUE_TYPE.get(type(v), "string") for v in values)
    properties = schema.get("properties")
    if isinstance(properties, dict):
        node.properties = {_key(k): _compile(v, root, nodes) for k, v in properties.items()}
        if node.types is None:
            node.types = frozenset(("object",))
    required = schema.get("required")
    if isinstance(required, list):
        node.required = frozenset(_key(k) for k in required if isinstance(k, str))
    additional = schema.get("additionalProperties", True)
    node.additional = (False if additional is False else
                       _compile(additional, root, nodes) if isinstance(additional, dict)
                       else True)
    if isinstance(schema.get("items"), dict):
        node.items = _compile(schema["items"], root, nodes)
    return node


class SchemaRecognizer(JsonRecognizer):
    """JsonRecognizer that also holds a compiled schema (the root node is the object's, or with
    `is_any_value` the value's)."""

    __slots__ = ("frames", "expect", "buf", "allowed", "int_only")

    def __init__(self, root: SchemaNode, is_any_value: bool = False):
        super().__init__(is_any_value)
        self.frames: tuple = ()        # per open container: (node, keys seen)
        self.expect = root             # the node of the next value
        self.buf = b""                 # the string being read, when `allowed` holds it
        self.allowed: tuple[bytes, ...] | None = None  # what that string may be, or None
        self.int_only = False          # the number being read is an integer

    def copy(self) -> "SchemaRecognizer":
        other = super().copy()
        other.frames, other.expect, other.buf = self.frames, self.expect, self.buf
        other.allowed, other.int_only = self.allowed, self.int_only
        return other

    def first_bytes(self) -> np.ndarray:
        """bool [256] (not cached: a state holds the keys and the string read so far)."""
        return np.array([self.copy()._step(b) for b in range(256)])

    # ---- the hooks ----
    def _value_allowed(self, c: int) -> bool:
        node = self.expect
        kind = "number" if c == ord("-") or 0x30 <= c <= 0x39 else _KIND.get(c)
        types = node.types
        if types is not None:
            if kind == "number":
                if "number" not in types and "integer" not in types:
                    return False
                self.int_only = "number" not in types
            elif kind not in types:
                return False
        else:
            self.int_only = False
        self.allowed, self.buf = (node.strings, b"") if kind == "string" else (None, b"")
        return True

    def _key_allowed(self) -> bool:
        node, seen = self.frames[-1]
        if node.additional is False:
            self.allowed = tuple(k for k in node.properties if k not in seen)
            if not self.allowed:
                return False
        else:
            self.allowed = None if node.is_free else ()  # () : track the key, any allowed
        self.buf = b""
        return True

    def _string_byte(self, c: int) -> bool:
        if self.allowed is None:
            return True
        self.buf += bytes((c,))
        return not self.allowed or any(a.startswith(self.buf) for a in self.allowed)

    def _string_end(self) -> bool:
        allowed, key = self.allowed, self.buf
        self.allowed, self.buf = None, b""
        if allowed and key not in allowed:
            return False
        if not self.is_key:
            return True
        node, seen = self.frames[-1]
        if allowed is None:  # a free object: nothing tracked
            self.expect = ANY
            return True
        if key in seen:
            return False
        self.frames = self.frames[:-1] + ((node, seen | {key}),)
        value = node.properties.get(key)
        if value is None:
            value = node.additional if isinstance(node.additional, SchemaNode) else ANY
        self.expect = value
        return True

    def _number_byte_allowed(self, c: int) -> bool:
        return not (self.int_only and c in b".eE")

    def _comma_allowed(self, is_object: bool) -> bool:
        node, seen = self.frames[-1]
        if is_object:
            return node.additional is not False or any(k not in seen for k in node.properties)
        self.expect = node.items or ANY
        return True

    def _close_allowed(self) -> bool:
        node, seen = self.frames[-1]
        return self.stack[-1] != ord("{") or node.required <= seen

    def _opened(self, c: int) -> None:
        node = self.expect
        self.frames = self.frames + ((node, frozenset()),)
        if c == ord("["):
            self.expect = node.items or ANY

    def _closed(self) -> None:
        self.frames = self.frames[:-1]
