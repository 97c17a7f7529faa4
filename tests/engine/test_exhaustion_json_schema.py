"""A JSON schema (response_format, a tool's parameters, /completion's json_schema) cannot make
the engine thread recurse out of its stack, expand without end, or spend per token in
proportion to a huge enum: a clear RequestError (a 400) names the limit."""
from __future__ import annotations

import pytest

from strata.engine import json_schema
from strata.engine.json_schema import SchemaRecognizer, compile_schema
from strata.engine.tool_call_constraint import ToolCallConstraint
from strata.errors import RequestError


def _nested(depth: int) -> dict:
    schema = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def test_a_schema_nested_too_deep_is_a_request_error_naming_the_limit():
    compile_schema(_nested(100))  # held
    with pytest.raises(RequestError, match=r"more than 128 deep"):
        compile_schema(_nested(2000))  # was a RecursionError (a 500 for a tool's schema)


def test_a_tools_schema_nested_too_deep_is_a_request_error(tokenizer):
    functions = [{"name": "f", "parameters": _nested(2000)}]
    for xml in (False, True):
        with pytest.raises(RequestError, match=r"more than 128 deep"):
            ToolCallConstraint(tokenizer, functions, xml=xml)


def test_an_allof_that_refers_to_itself_through_a_copy_is_bounded():
    # a property merged from two parts is a new {"allOf": [...]} each time it is met: it
    # recursed without end (a RecursionError)
    schema = {"type": "object", "properties": {"x": {"$ref": "#"}},
              "allOf": [{"$ref": "#"}, {"properties": {"x": {"$ref": "#"}}}]}
    with pytest.raises(RequestError, match=r"more than 128 deep"):
        compile_schema(schema)


def test_a_schema_that_expands_to_too_many_subschemas_is_refused(monkeypatch):
    monkeypatch.setattr(json_schema, "MAX_SCHEMA_NODES", 1000)
    # each level's two properties merged from two parts: new {"allOf": [...]} copies, twice
    # as many at each level (2^30 written out)
    defs = {}
    for i in range(30):
        two = {"x": {"$ref": f"#/$defs/d{i + 1}"}, "y": {"$ref": f"#/$defs/d{i + 1}"}}
        defs[f"d{i}"] = {"type": "object", "properties": two, "allOf": [{"properties": two}]}
    defs["d30"] = {"type": "string"}
    with pytest.raises(RequestError, match=r"more than 1000 subschemas"):
        compile_schema({"$defs": defs, "$ref": "#/$defs/d0"})


def test_a_huge_numeric_enum_costs_a_few_comparisons_a_byte():
    node = compile_schema({"type": "object", "additionalProperties": False,
                           "properties": {"a": {"enum": list(range(100_000)) + [True]}},
                           "required": ["a"]})

    class Counted(bytes):  # counts the comparisons a byte's check makes
        comparisons = 0

        def __lt__(self, other):
            Counted.comparisons += 1
            return bytes.__lt__(self, other)

        def startswith(self, prefix):
            Counted.comparisons += 1
            return bytes.startswith(self, prefix)

    held = node.properties[b"a"]
    held.scalars = tuple(Counted(v) for v in held.scalars)
    r = SchemaRecognizer(node)
    assert r.feed(b'{"a":')
    assert r.copy().feed(b"1")  # the enum's numbers are sorted once, here
    Counted.comparisons = 0
    assert r.copy().feed(b"9876") and not r.copy().feed(b"09")
    assert r.copy().feed(b"true") and not r.copy().feed(b"false")
    assert Counted.comparisons < 500  # was a scan of the 100 000 values for every byte
    assert r.feed(b"99999}") and r.is_done
    r = SchemaRecognizer(node)
    assert not r.feed(b'{"a":100000}')
