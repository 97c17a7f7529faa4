"""A JSON schema's structure held while the answer is written (response_format json_schema):
JsonRecognizer with the schema's types, object keys, required keys and enums. What is held,
and what is not (docs in README, "Serve"):
- `type` (one or a list; unknown names are not held), and `properties` / `items` /
  `additionalProperties` (false: only the declared keys, and any required ones), `required`
  (the object closes only once they are all there), each key once; `minItems` / `maxItems`;
- `enum` / `const`: each string, number, boolean or null value as JSON writes it (an object or
  array value holds its type only);
- local `$ref` ("#", "#/$defs/...", any JSON pointer); `allOf` (its parts merged); `anyOf` /
  `oneOf` told apart by their value's kind (an object or null, a string or a number, ...;
  alternatives of one kind hold only that kind, except objects told apart by one key whose
  value is a different string constant in each: that key comes first, then its object is
  held);
- `pattern` (a regex the string contains a match of, as JSON Schema reads it), in the forms
  engine/regex_grammar.py turns into a grammar (a string's text then held by it,
  held_text.py); a pattern it cannot convert (lookarounds, backreferences, ...) is not held
  (logged once per pattern);
- not held: formats, string lengths, numeric bounds, `prefixItems`, `not`.
A string schema may also carry GRAMMAR_KEY, a GBNF grammar its text follows in full (a custom
tool's input: server/responses_schema.py), which takes the place of a `pattern`."""
from __future__ import annotations

import bisect
import functools
import json
import logging
from urllib.parse import unquote

import numpy as np

from strata.engine.gbnf import Grammar, GrammarError, compiled_grammar
from strata.engine.held_text import JsonText
from strata.engine.json_constraint import VALUE_OR_END, JsonRecognizer
from strata.errors import RequestError

log = logging.getLogger("strata.engine")
GRAMMAR_KEY = "x-strata-grammar"  # a string schema's GBNF grammar (see the docstring)
_KIND = {ord("{"): "object", ord("["): "array", ord('"'): "string", ord("t"): "boolean",
         ord("f"): "boolean", ord("n"): "null"}
_VALUE_TYPE = {bool: "boolean", int: "integer", float: "number", str: "string",
               type(None): "null", dict: "object", list: "array"}


class SchemaNode:
    """One compiled (sub)schema. types None: any type; additional True: any other key (its
    value any), False: none, or a node for their values; strings: the allowed contents of a
    string, JSON-escaped, or None."""

    __slots__ = ("types", "properties", "required", "additional", "items", "strings",
                 "variants", "scalars", "min_items", "max_items", "by_value",
                 "held_scalars", "grammar")

    def __init__(self):
        self.types: frozenset[str] | None = None
        self.properties: dict[bytes, SchemaNode] = {}
        self.required: frozenset[bytes] = frozenset()
        self.additional: bool | SchemaNode = True
        self.items: SchemaNode | None = None
        self.strings: tuple[bytes, ...] | None = None
        # anyOf / oneOf: the node that holds a value of each kind (see _dispatch), or None
        self.variants: dict[str, SchemaNode] | None = None
        # an enum's numbers, booleans and null, as JSON writes them (None: not held)
        self.scalars: tuple[bytes, ...] | None = None
        self.held_scalars = None  # (sorted numbers, first bytes) of `scalars`: _held_scalars
        self.min_items, self.max_items = 0, None  # an array's item count
        # a discriminated union of objects (see _discriminated): its one key's value -> the
        # object's node, which holds the object from that value on; None otherwise
        self.by_value: dict[bytes, SchemaNode] | None = None
        self.grammar: Grammar | None = None  # what a string's text follows (held_text.py)

    @property
    def is_free(self) -> bool:
        """No key of an object is held (nothing to track per key)."""
        return (not self.properties and not self.required and self.additional is True)


ANY = SchemaNode()


def _key(name: str) -> bytes:
    """A key or string as it appears between the quotes (JSON-escaped, UTF-8)."""
    return json.dumps(name, ensure_ascii=False)[1:-1].encode()


class SchemaError(RequestError):
    """A schema too deep or too large to hold; the message names the limit."""


MAX_SCHEMA_DEPTH = 128       # subschemas inside subschemas (each a recursion of the compiler)
MAX_SCHEMA_NODES = 1 << 14   # subschemas compiled for one schema, $ref and allOf copies included


def compile_schema(schema) -> SchemaNode:
    """The root node of a JSON schema (a dict); ANY for anything that is not one. SchemaError
    (a 400) for one nested deeper than MAX_SCHEMA_DEPTH or of more than MAX_SCHEMA_NODES
    subschemas, as written or as its $ref and allOf expand."""
    nodes: dict[int, tuple[dict, SchemaNode]] = {}
    return _compile(schema, schema if isinstance(schema, dict) else {}, nodes, 0)


_TYPES = frozenset(_VALUE_TYPE.values())
_NUMBER_START = frozenset(b"-0123456789")
_NUMBER_BYTES = frozenset(b"-+.eE0123456789")
_MAX_REFS = 64  # $ref hops followed in a row (a chain that loops is not held)


def _resolve(ref: str, root: dict):
    """The schema a local `$ref` points to ("#", "#/$defs/x", any JSON pointer), or None."""
    if not ref.startswith("#"):
        return None
    target = root
    for part in ref[1:].split("/")[1:] if ref != "#" else ():
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(target, dict) and part in target:
            target = target[part]
        elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
            target = target[int(part)]
        else:
            return None
    return target


def _dereferenced(schema, root: dict):
    """`schema` with its `$ref` chain followed (None where it leads nowhere)."""
    for _ in range(_MAX_REFS):
        if not isinstance(schema, dict) or not isinstance(schema.get("$ref"), str):
            return schema
        schema = _resolve(schema["$ref"], root)
    return None


def _types(kind) -> frozenset[str] | None:
    """The known type names of a `type` (a name or a list); None (not held) for none known."""
    names = [kind] if isinstance(kind, str) else kind if isinstance(kind, list) else []
    known = frozenset(k for k in names if isinstance(k, str) and k in _TYPES)
    return known or None


def _all_of(schema: dict, root: dict, merged_ids: set | None = None) -> dict:
    """`schema` with the parts of its `allOf` merged in: their properties, required keys, type
    (the shared names), `additionalProperties` false if one says so, else the first value of
    each other keyword. Each part is taken once (one met again, in a loop or by another path,
    adds nothing)."""
    merged = {k: v for k, v in schema.items() if k != "allOf"}
    merged_ids = {id(schema)} if merged_ids is None else merged_ids
    for part in schema["allOf"]:
        part = _dereferenced(part, root)
        if not isinstance(part, dict) or id(part) in merged_ids:
            continue
        merged_ids.add(id(part))
        if isinstance(part.get("allOf"), list):
            part = _all_of(part, root, merged_ids)
        for key, value in part.items():
            if key == "properties" and isinstance(value, dict):
                props = dict(merged.get("properties") or {})
                for name, sub in value.items():
                    props[name] = {"allOf": [props[name], sub]} if name in props else sub
                merged["properties"] = props
            elif key == "required" and isinstance(value, list):
                merged["required"] = list(merged.get("required") or []) + value
            elif key == "type" and "type" in merged:
                mine, theirs = _types(merged["type"]), _types(value)
                if mine and theirs:
                    merged["type"] = sorted(mine & theirs) or sorted(mine)
            elif key == "additionalProperties" and value is False:
                merged[key] = False
            else:
                merged.setdefault(key, value)
    return merged


def _kinds(types: frozenset[str]) -> set[str]:
    """The kinds of a value's first byte (see _KIND) that `types` takes."""
    return {"number" if t == "integer" else t for t in types}


def _dispatch(node: SchemaNode, parts: list[SchemaNode]) -> None:
    """anyOf / oneOf: the alternatives told apart by their value's kind (an object or null, a
    string or a number, ...). A kind that one alternative takes is held by it; one that several
    take only by its type (their strings, if each is an enum). An alternative of any type
    leaves the value free."""
    if any(p.types is None for p in parts):
        return
    node.types = frozenset().union(*(p.types for p in parts))
    node.variants = {}
    for kind in _kinds(node.types):
        takers = [p for p in parts if kind in _kinds(p.types)]
        if len(takers) == 1:
            node.variants[kind] = takers[0]
            continue
        if kind == "object":
            union = _discriminated(takers)
            if union is not None:
                node.variants[kind] = union
                continue
        loose = node.variants[kind] = SchemaNode()
        loose.types = frozenset(t for p in takers for t in p.types if _kinds({t}) == {kind})
        if kind == "string" and all(p.strings is not None for p in takers):
            loose.strings = tuple(sorted({v for p in takers for v in p.strings}))
        elif kind != "string" and all(p.scalars is not None for p in takers):
            loose.scalars = tuple(dict.fromkeys(v for p in takers for v in p.scalars))


def _discriminated(parts: list[SchemaNode]) -> SchemaNode | None:
    """Objects told apart by one key whose value is a different string constant in each (a
    tagged union: Pydantic's discriminator, a tool call's name), as one node: that key first,
    then the object its value names (with the key seen); None when no key tells them apart."""
    for key in parts[0].properties:
        values = []
        for part in parts:
            sub = part.properties.get(key)
            if sub is None or sub.types != {"string"} or sub.strings is None \
                    or len(sub.strings) != 1:
                break
            values.append(sub.strings[0])
        else:
            if len(set(values)) < len(parts):
                continue
            tag = SchemaNode()
            tag.types, tag.strings = frozenset(("string",)), tuple(sorted(values))
            union = SchemaNode()
            union.types, union.additional = frozenset(("object",)), False
            union.properties, union.required = {key: tag}, frozenset((key,))
            union.by_value = dict(zip(values, parts))
            return union
    return None


def _compile(schema, root: dict, nodes: dict[int, tuple[dict, SchemaNode]],
             depth: int) -> SchemaNode:
    if not isinstance(schema, dict):
        return ANY
    if id(schema) in nodes:  # a recursive $ref: the node being built
        return nodes[id(schema)][1]
    if depth > MAX_SCHEMA_DEPTH:
        raise SchemaError(f"the JSON schema is nested too deeply: subschemas more than "
                          f"{MAX_SCHEMA_DEPTH} deep (properties, items, anyOf, allOf and $ref "
                          "each count); flatten it, or $ref an outer schema for recursion")
    if len(nodes) >= MAX_SCHEMA_NODES:
        raise SchemaError(f"the JSON schema has more than {MAX_SCHEMA_NODES} subschemas (its "
                          "$ref and allOf written out); send a smaller one")
    depth += 1
    if isinstance(schema.get("$ref"), str):  # what it refers to (its other keywords aside)
        target = _dereferenced(schema, root)
        return _compile(target, root, nodes, depth) if isinstance(target, dict) else ANY
    node = SchemaNode()
    nodes[id(schema)] = (schema, node)  # (the schema kept: a copy allOf made keeps its id)
    if isinstance(schema.get("allOf"), list):
        schema = _all_of(schema, root)
    node.types = _types(schema.get("type"))
    properties = schema.get("properties")
    if node.types is None and isinstance(properties, dict):
        node.types = frozenset(("object",))  # before the properties: one may refer back
    values = schema["enum"] if isinstance(schema.get("enum"), list) else (
        [schema["const"]] if "const" in schema else None)
    alternatives = schema.get("anyOf", schema.get("oneOf"))
    if values:
        strings = [v for v in values if isinstance(v, str)]
        node.types = frozenset(_VALUE_TYPE.get(type(v), "string") for v in values)
        if strings:
            node.strings = tuple(sorted({_key(v) for v in strings}))
        node.scalars = tuple(json.dumps(v).encode() for v in values
                             if v is None or isinstance(v, (bool, int, float)))
    elif node.types is None and isinstance(alternatives, list) and alternatives:
        _dispatch(node, [_compile(a, root, nodes, depth) for a in alternatives])
    if isinstance(properties, dict):
        node.properties = {_key(k): _compile(v, root, nodes, depth)
                           for k, v in properties.items()}
    required = schema.get("required")
    if isinstance(required, list):
        node.required = frozenset(_key(k) for k in required if isinstance(k, str))
    additional = schema.get("additionalProperties", True)
    node.additional = (False if additional is False else
                       _compile(additional, root, nodes, depth) if isinstance(additional, dict)
                       else True)
    if node.additional is False:  # a required key left undeclared may still be written
        for key in node.required - node.properties.keys():
            node.properties[key] = ANY
    if isinstance(schema.get("items"), dict):
        node.items = _compile(schema["items"], root, nodes, depth)
    if node.types is None or "string" in node.types:
        node.grammar = _string_grammar(schema)
    low, high = schema.get("minItems", 0), schema.get("maxItems")
    if _is_count(low) and (high is None or _is_count(high) and high >= low):
        node.min_items, node.max_items = low, high
    return node


def _string_grammar(schema: dict) -> Grammar | None:
    """The grammar a string's text follows: GRAMMAR_KEY's, else the `pattern`'s (None where
    there is neither, or the pattern is not one regex_grammar can turn into a grammar)."""
    text = schema.get(GRAMMAR_KEY)
    if isinstance(text, str):
        return compiled_grammar(text)
    pattern = schema.get("pattern")
    return _pattern_grammar(pattern) if isinstance(pattern, str) else None


@functools.lru_cache(maxsize=64)
def _pattern_grammar(pattern: str) -> Grammar | None:
    from strata.engine.regex_grammar import regex_to_gbnf

    try:
        return compiled_grammar(regex_to_gbnf(pattern, search=True))
    except GrammarError as exc:
        log.info("a JSON schema's pattern %r is not held: %s", pattern[:200], exc)
        return None
    except Exception:  # noqa: BLE001 - a converter's fault must not fail the request
        log.exception("a JSON schema's pattern %r is not held: converting it failed",
                      pattern[:200])
        return None


def _held_scalars(node: SchemaNode) -> tuple[tuple[bytes, ...], frozenset[int]]:
    """(an enum's numbers, sorted; the first bytes of its scalars), made once per node: a
    number is then read as a string is, a byte costing log n however long the enum."""
    if node.held_scalars is None:
        numbers = tuple(sorted({v for v in node.scalars if v[0] in _NUMBER_START}))
        node.held_scalars = (numbers, frozenset(v[0] for v in node.scalars))
    return node.held_scalars


def _prefix_run(items: tuple[bytes, ...], prefix: bytes) -> tuple[int, int]:
    """[lo, hi) of the sorted `items` that start with `prefix`."""
    lo = bisect.bisect_left(items, prefix)
    stem = prefix.rstrip(b"\xff")  # the least bytes above every string with the prefix
    if not stem:
        return lo, len(items)
    return lo, bisect.bisect_left(items, stem[:-1] + bytes((stem[-1] + 1,)), lo)


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class SchemaRecognizer(JsonRecognizer):
    """JsonRecognizer that also holds a compiled schema (the root node is the object's, or with
    `is_any_value` the value's)."""

    __slots__ = ("frames", "expect", "buf", "allowed", "int_only", "numbers", "text")

    def __init__(self, root: SchemaNode, is_any_value: bool = False):
        super().__init__(is_any_value)
        self.frames: tuple = ()        # per open container: (node, keys seen or items read)
        self.expect = root             # the node of the next value
        self.buf = b""                 # the string being read, when `allowed` holds it
        self.allowed: tuple[bytes, ...] | None = None  # what that string may be, or None
        self.int_only = False          # the number being read is an integer
        self.numbers: tuple[bytes, ...] | None = None  # what it may be (in `buf`), or None
        self.text: JsonText | None = None  # the string being read, held to a grammar

    def copy(self) -> "SchemaRecognizer":
        other = super().copy()
        other.frames, other.expect, other.buf = self.frames, self.expect, self.buf
        other.allowed, other.int_only = self.allowed, self.int_only
        other.numbers = self.numbers
        other.text = None if self.text is None else self.text.copy()
        return other

    def first_bytes(self) -> np.ndarray:
        """bool [256] (not cached: a state holds the keys and the string read so far)."""
        return np.array([self.copy()._step(b) for b in range(256)])

    # ---- the hooks ----
    def _value_allowed(self, c: int) -> bool:
        node = self.expect
        kind = "number" if c == ord("-") or 0x30 <= c <= 0x39 else _KIND.get(c)
        if node.variants is not None and kind in node.variants:
            node = self.expect = node.variants[kind]
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
        if self.mode == VALUE_OR_END and self.frames[-1][0].max_items == 0:
            return False  # an array's first item, where none may be
        self.allowed, self.buf = (node.strings, b"") if kind == "string" else (None, b"")
        self.text = (JsonText(node.grammar) if kind == "string" and node.strings is None
                     and node.grammar is not None else None)
        self.numbers = None
        if node.scalars is not None and kind != "string":  # an enum's number, true, ...
            numbers, firsts = _held_scalars(node)
            if kind == "number":
                self.numbers = numbers
                self.buf = b""
                return self._number_byte_allowed(c)
            return c in firsts
        return True

    def _key_allowed(self) -> bool:
        node, seen = self.frames[-1]
        if node.additional is False:
            self.allowed = tuple(sorted(k for k in node.properties if k not in seen))
            if not self.allowed:
                return False
        else:
            self.allowed = None if node.is_free else ()  # () : track the key, any allowed
        self.buf = b""
        return True

    def _string_byte(self, c: int) -> bool:
        if self.text is not None:
            return self.text.byte(c)
        if self.allowed is None:
            return True
        self.buf += bytes((c,))
        if not self.allowed:  # (): a key tracked, any allowed
            return True
        # `allowed` is sorted and every item starts with the bytes before c: those that also
        # start with c are one run of it (bisect: an enum of thousands costs log n a byte)
        lo, hi = _prefix_run(self.allowed, self.buf)
        if lo == hi:
            return False
        self.allowed = self.allowed[lo:hi]
        return True

    def _string_end(self) -> bool:
        if self.text is not None:
            text, self.text = self.text, None
            if not text.is_done:
                return False
        allowed, key = self.allowed, self.buf
        self.allowed, self.buf = None, b""
        if allowed and key not in allowed:
            return False
        if not self.is_key:
            if self.frames and self.frames[-1][0].by_value is not None:  # a union's tag
                node, seen = self.frames[-1]
                self.frames = self.frames[:-1] + ((node.by_value[key], seen),)
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
        if self.int_only and c in b".eE":
            return False
        if self.numbers is None or c not in _NUMBER_BYTES:
            return True
        self.buf += bytes((c,))
        # sorted, each starting with the bytes before c: a run of them goes on (as strings)
        lo, hi = _prefix_run(self.numbers, self.buf)
        self.numbers = self.numbers[lo:hi]
        return lo < hi

    def _number_end(self) -> bool:
        numbers, text = self.numbers, self.buf
        self.numbers, self.buf = None, b""
        return numbers is None or (bool(numbers) and numbers[0] == text)  # the least: itself

    def _comma_allowed(self, is_object: bool) -> bool:
        node, seen = self.frames[-1]
        if is_object:
            return node.additional is not False or any(k not in seen for k in node.properties)
        if node.max_items is not None and seen + 2 > node.max_items:
            return False
        self.frames = self.frames[:-1] + ((node, seen + 1),)
        self.expect = node.items or ANY
        return True

    def _close_allowed(self) -> bool:
        node, seen = self.frames[-1]
        if self.stack[-1] == ord("{"):
            return node.required <= seen
        return (0 if self.mode == VALUE_OR_END else seen + 1) >= node.min_items

    def _opened(self, c: int) -> None:
        node = self.expect
        if node.variants is not None:  # the root object (no value step before it)
            node = node.variants.get("object" if c == ord("{") else "array", node)
        self.frames = self.frames + ((node, frozenset() if c == ord("{") else 0),)
        if c == ord("["):
            self.expect = node.items or ANY

    def _closed(self) -> None:
        self.frames = self.frames[:-1]
