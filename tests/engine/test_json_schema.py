"""response_format json_schema: the compiled schema held by SchemaRecognizer (types, keys,
required keys, string enums, $ref, anyOf of types), and the sampler held to it."""
from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strata.engine import json_schema as json_schema_module
from strata.engine.json_constraint import JsonObjectConstraint
from strata.engine.json_schema import SchemaRecognizer, compile_schema
from strata.engine.sampling import Sampler, SamplingParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "score": {"type": "number"},
        "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}},
        "nick": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        "home": {"$ref": "#/$defs/place"},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
    "$defs": {"place": {"type": "object", "properties": {"city": {"const": "Oslo"}},
                        "required": ["city"], "additionalProperties": False}},
}


def accepts(schema, text: str) -> tuple[bool, bool]:
    r = SchemaRecognizer(compile_schema(schema))
    ok = r.feed(text.encode())
    return ok, ok and r.is_done


def valid_person(value) -> bool:
    """PERSON checked by hand (no jsonschema dependency)."""
    props = PERSON["properties"]
    if not isinstance(value, dict) or set(value) - set(props) or {"name", "age"} - set(value):
        return False
    checks = {
        "name": lambda v: isinstance(v, str),
        "age": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "score": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        "tags": lambda v: isinstance(v, list) and all(t in ("a", "bb", "ccc") for t in v),
        "nick": lambda v: v is None or isinstance(v, str),
        "home": lambda v: isinstance(v, dict) and v == {"city": "Oslo"},
        "ok": lambda v: isinstance(v, bool),
    }
    return all(checks[k](v) for k, v in value.items())


TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=8)
PEOPLE = st.fixed_dictionaries(
    {"name": TEXT, "age": st.integers(-10**9, 10**9)},
    optional={"score": st.floats(allow_nan=False, allow_infinity=False) | st.integers(-99, 99),
              "tags": st.lists(st.sampled_from(["a", "bb", "ccc"]), max_size=4),
              "nick": st.none() | TEXT, "home": st.just({"city": "Oslo"}),
              "ok": st.booleans()})


@settings(max_examples=200, deadline=None)
@given(person=PEOPLE, indent=st.sampled_from([None, 1, 2]), ascii_only=st.booleans())
def test_every_instance_is_accepted(person, indent, ascii_only):
    text = json.dumps(person, indent=indent, ensure_ascii=ascii_only)
    assert accepts(PERSON, text) == (True, True), text


@pytest.mark.parametrize("text", [
    '{"name":"x"}',                               # a required key missing
    '{"age":3}',
    '{"name":"x","age":3.5}',                     # integer
    '{"name":"x","age":1e3}',
    '{"name":1,"age":3}',                         # type
    '{"nam":"x","age":3}',                        # undeclared key (a prefix of one)
    '{"name":"x","age":3,"extra":1}',
    '{"name":"x","name":"y","age":1}',            # a key twice
    '{"name":"x","age":3,"tags":["c"]}',          # enum
    '{"name":"x","age":3,"tags":["bbb"]}',
    '{"name":"x","age":3,"nick":5}',              # anyOf string | null
    '{"name":"x","age":3,"home":{"city":"Rome"}}',  # $ref, const
    '{"name":"x","age":3,"home":{}}',
    '{"name":"x","age":3,"ok":null}',
])
def test_refused(text):
    ok, done = accepts(PERSON, text)
    assert not done
    assert not ok


@settings(max_examples=150, deadline=None)
@given(person=PEOPLE, at=st.integers(0, 10**6), char=st.sampled_from(list('{}[]":,.-e019 nt"ax')))
def test_what_it_completes_follows_the_schema(person, at, char):
    text = json.dumps(person, separators=(",", ":"))
    at %= len(text) + 1
    text = text[:at] + char + text[at:]
    if accepts(PERSON, text)[1]:
        assert valid_person(json.loads(text)), text


def test_free_parts_and_open_objects():
    schema = {"type": "object", "properties": {"a": {"type": "object"}, "b": {}},
              "required": ["a"]}  # additional keys allowed, "a" any object, "b" anything
    assert accepts(schema, '{"a":{"x":[1,{"y":null}]},"b":[true],"zz":"q"}') == (True, True)
    assert accepts(schema, '{"a":[1]}')[0] is False
    assert accepts(schema, '{"a":{},"a":{}}')[0] is False  # still each key once
    assert accepts({}, '{"k":1}') == (True, True)
    assert accepts({"type": "object", "additionalProperties": {"type": "integer"}},
                   '{"a":1,"b":2.5}')[0] is False
    closed = {"type": "object", "properties": {"a": {"type": "null"}},
              "additionalProperties": False}
    assert accepts(closed, '{"a":null}') == (True, True)
    assert accepts(closed, '{"a":null,')[0] is False  # no key left to write


def sample_held(tokenizer, schema, seed, temperature, closers, think) -> list[int]:
    """Up to 400 tokens drawn from random logits, nudged more and more towards `closers` and
    the stop tokens, through the sampler held to `schema` (no `<think>`)."""
    V, stops = tokenizer.vocab_size, sorted(tokenizer.stop_ids)
    rng = np.random.default_rng(seed)
    params = SamplingParams(temperature=temperature, top_k=0, top_p=1.0, min_p=0.0, seed=seed,
                            json_object=True, json_schema=schema, logit_bias={think: -100})
    sampler = Sampler(params, constraint=JsonObjectConstraint(tokenizer, tokenizer.stop_ids,
                                                              schema=schema))
    tokens = []
    for step in range(400):
        logits = rng.standard_normal(V).astype(np.float32) * 2
        logits[closers] += min(step / 10, 8)
        logits[stops] += 8
        tokens.append(sampler.sample(logits))
        if tokens[-1] in tokenizer.stop_ids:
            break
    return tokens


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sampler_writes_instances_from_random_logits(tokenizer, temperature):
    """Random logits nudged towards closing: each finished answer is an instance of PERSON."""
    V = tokenizer.vocab_size
    closers = [t for t in range(V) if tokenizer.token_bytes(t) in (b"}", b"]", b'"', b",")]
    think = tokenizer.token_id("<think>")
    finished = 0
    for seed in range(8):
        tokens = sample_held(tokenizer, PERSON, seed, temperature, closers, think)
        text = tokenizer.decode([t for t in tokens if t not in tokenizer.stop_ids])
        assert SchemaRecognizer(compile_schema(PERSON)).feed(text.encode()), text
        if tokens[-1] in tokenizer.stop_ids:
            finished += 1
            assert valid_person(json.loads(text)), text
    assert finished >= 6


def test_a_schema_must_be_a_dict():
    from strata.errors import RequestError

    with pytest.raises(RequestError, match="json_schema"):
        SamplingParams(json_object=True, json_schema=["not", "a", "schema"])
    deep = {}
    for _ in range(5000):
        deep = {"type": "object", "properties": {"a": deep}}
    with pytest.raises(RequestError, match="nested too deeply"):
        SamplingParams(json_object=True, json_schema=deep)


@pytest.mark.parametrize("schema", [
    {"type": 5}, {"properties": [1, 2]}, {"required": "name"}, {"items": "x"}, {"enum": []},
    {"$ref": "#/elsewhere"}, {"anyOf": "x"}, {"additionalProperties": 3},
    {"enum": [{"a": 1}, None]}, {"const": None},
])
def test_odd_schemas_compile_to_what_they_hold(schema):
    """Parts a schema gets wrong are not held (any value there), never an error."""
    r = SchemaRecognizer(compile_schema({"type": "object", "properties": {"v": schema}}))
    assert r.feed(b'{"v":')


NODE = {"type": "object", "properties": {"v": {"type": "integer"},
                                         "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
        "required": ["v", "next"], "additionalProperties": False}
ITEM = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"],
        "additionalProperties": False}


@pytest.mark.parametrize("schema,good,bad", [
    # anyOf / oneOf of structured alternatives: each kind held by its alternative
    (NODE, ['{"v":1,"next":{"v":2,"next":null}}'], ['{"v":1,"next":{}}', '{"v":1,"next":5}']),
    ({"anyOf": [{"$ref": "#/$defs/i"}, {"type": "null"}], "$defs": {"i": ITEM}},
     ['{"x":1}'], ['{"x":"a"}', '{"y":1}']),
    ({"type": "object", "properties": {"c": {"oneOf": [{"enum": ["a"]}, {"type": "integer"}]}}},
     ['{"c":"a"}', '{"c":7}'], ['{"c":"b"}', '{"c":1.5}', '{"c":true}']),
    ({"type": "object", "properties": {"c": {"anyOf": [{"enum": ["a"]}, {"enum": ["b"]}]}}},
     ['{"c":"a"}', '{"c":"b"}'], ['{"c":"c"}']),
    # allOf: its parts merged; $ref as a JSON pointer
    ({"allOf": [{"$ref": "#/$defs/i"}, {"properties": {"y": {"type": "null"}}}],
      "$defs": {"i": ITEM}}, ['{"x":1,"y":null}'], ['{"y":null}', '{"x":1,"y":1}']),
    ({"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"$ref": "#/properties/a"},
                                       "c": {"$ref": "#/$defs/a~1b"}},
      "$defs": {"a/b": {"type": "null"}}}, ['{"b":true,"c":null}'], ['{"b":1}', '{"c":1}']),
    # enums and consts of other values than strings: each value as JSON writes it
    ({"type": "object", "properties": {"c": {"enum": [1, 20, -3.5]}}},
     ['{"c":1}', '{"c":20}', '{"c":-3.5}'], ['{"c":2}', '{"c":12}', '{"c":200}', '{"c":-3}']),
    ({"type": "object", "properties": {"c": {"const": True}}}, ['{"c":true}'], ['{"c":false}']),
    ({"type": "object", "properties": {"c": {"type": ["string", "null"],
                                             "enum": ["red", None]}}},
     ['{"c":"red"}', '{"c":null}'], ['{"c":"blue"}', '{"c":false}']),
    # item counts
    ({"type": "object", "properties": {"c": {"type": "array", "minItems": 2, "maxItems": 3}}},
     ['{"c":[1,2]}', '{"c":[1,[],3]}'], ['{"c":[]}', '{"c":[1]}', '{"c":[1,2,3,4]}']),
    ({"type": "object", "properties": {"c": {"type": "array", "maxItems": 0}}},
     ['{"c":[]}', '{"c":[ ]}'], ['{"c":[1]}']),
])
def test_alternatives_refs_enums_and_counts_are_held(schema, good, bad):
    for text in good:
        assert accepts(schema, text) == (True, True), text
    for text in bad:
        assert not accepts(schema, text)[1], text


@pytest.mark.parametrize("schema,text", [
    ({"type": "object", "properties": {"a": {"type": "int"}}}, '{"a":"x"}'),  # unknown type
    ({"type": "object", "properties": {"a": {"type": []}}}, '{"a":[]}'),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"],
      "additionalProperties": False}, '{"a":1,"b":{}}'),  # a required key left undeclared
    ({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}, '{"k":1}'),  # a loop
])
def test_a_schema_no_value_could_follow_leaves_a_way_to_close(schema, text):
    """A part of a schema that no value could follow is not held: the output can always close
    (a dead end let the sampler draw any token, and the answer was no JSON)."""
    assert accepts(schema, text) == (True, True)


TASK = {"type": "object", "$defs": {"step": {"type": "object", "properties": {
    "kind": {"enum": [1, 2, None]}, "sub": {"anyOf": [{"$ref": "#/$defs/step"},
                                                      {"type": "null"}]}},
    "required": ["kind", "sub"], "additionalProperties": False}},
    "properties": {"steps": {"type": "array", "items": {"$ref": "#/$defs/step"},
                             "minItems": 1, "maxItems": 2},
                   "ok": {"allOf": [{"const": False}]}},
    "required": ["steps", "ok"], "additionalProperties": False}


def valid_task(value) -> bool:
    """TASK checked by hand."""
    def step(s) -> bool:
        return (isinstance(s, dict) and set(s) == {"kind", "sub"} and s["kind"] in (1, 2, None)
                and type(s["kind"]) is not bool and (s["sub"] is None or step(s["sub"])))
    return (isinstance(value, dict) and set(value) == {"steps", "ok"} and value["ok"] is False
            and isinstance(value["steps"], list) and 1 <= len(value["steps"]) <= 2
            and all(step(s) for s in value["steps"]))


def test_sampler_writes_instances_of_alternatives_and_refs(tokenizer):
    V = tokenizer.vocab_size
    closers = [t for t in range(V) if tokenizer.token_bytes(t) in (b"}", b"]", b"null", b",")]
    think = tokenizer.token_id("<think>")
    finished = 0
    for seed in range(6):
        tokens = sample_held(tokenizer, TASK, seed, 1.0, closers, think)
        if tokens[-1] in tokenizer.stop_ids:
            finished += 1
            text = tokenizer.decode(tokens[:-1])
            assert valid_task(json.loads(text)), text
    assert finished >= 5


def test_all_of_takes_each_part_once(monkeypatch):
    """allOf parts reached by several paths (or in a loop) are merged once: 22 levels of two
    paths each compile at once, not in 2**22 merges."""
    defs = {"A22": {"type": "object", "properties": {"x": {"type": "integer"}},
                    "required": ["x"]},
            "L": {"allOf": [{"$ref": "#/$defs/L"}, {"properties": {"y": {"type": "null"}}}]}}
    for i in range(22):
        defs[f"A{i}"] = {"allOf": [{"$ref": f"#/$defs/B{i}"}, {"$ref": f"#/$defs/C{i}"}]}
        defs[f"B{i}"] = defs[f"C{i}"] = {"allOf": [{"$ref": f"#/$defs/A{i + 1}"}]}
    merges = []
    real = json_schema_module._all_of
    monkeypatch.setattr(json_schema_module, "_all_of",
                        lambda *args: merges.append(1) or real(*args))
    root = compile_schema({"$ref": "#/$defs/A0", "$defs": defs})
    assert 0 < len(merges) < 200  # one per node that has an allOf, not one per path
    assert accepts({"$ref": "#/$defs/A0", "$defs": defs}, '{"x":1}') == (True, True)
    assert not accepts({"$ref": "#/$defs/A0", "$defs": defs}, '{"x":"a"}')[0]
    assert SchemaRecognizer(root).feed(b'{"x":1}')
    assert accepts({"$ref": "#/$defs/L", "$defs": defs}, '{"y":null}') == (True, True)
    assert not accepts({"$ref": "#/$defs/L", "$defs": defs}, '{"y":1}')[0]


ENUM_TEXT = st.text(st.sampled_from("ab\u00ff\u0100\U0001f600\"\\"), max_size=4)


@settings(max_examples=150, deadline=None)
@given(st.lists(ENUM_TEXT, min_size=1, max_size=12), ENUM_TEXT)
def test_string_enum_prefixes_are_exact(values, probe):
    """A string enum's bytes are held exactly, whatever the values share as prefixes (the
    recognizer narrows a sorted run of them byte by byte): every value is taken, every other
    string refused, and the next bytes allowed inside the string are those some value has."""
    schema = {"type": "object", "properties": {"f": {"enum": values}}, "required": ["f"],
              "additionalProperties": False}
    for text in values + [probe]:  # held as JSON writes it, non-ASCII unescaped
        assert accepts(schema, json.dumps({"f": text}, ensure_ascii=False))[1] == (text in values)
    encoded = [json.dumps(v, ensure_ascii=False)[1:-1].encode() for v in values]
    r = SchemaRecognizer(compile_schema(schema))
    assert r.feed(b'{"f": "')
    for prefix in [b""] + [e[:n] for e in encoded for n in range(1, len(e) + 1)]:
        state = r.copy()
        assert state.feed(prefix)
        want = {e[len(prefix)] for e in encoded if e.startswith(prefix) and len(e) > len(prefix)}
        if prefix in encoded:
            want.add(ord('"'))
        assert set(np.flatnonzero(state.first_bytes())) == want, prefix


def test_large_enum_is_not_linear_per_byte():
    """5,000 strings: the next bytes inside the string cost about what 50 do (was ~200 ms a
    call, linear in the enum, on every token). Counted in steps of the recognizer, not timed."""
    words = [f"w{n:05d}" for n in range(5000)]
    schema = {"type": "object", "properties": {"f": {"enum": words}}}
    r = SchemaRecognizer(compile_schema(schema))
    assert r.feed(b'{"f": "w012')
    assert len(r.allowed) == 100  # narrowed to the run that shares the prefix
    assert set(np.flatnonzero(r.first_bytes())) == set(b"0123456789")
    assert r.feed(b'34"}') and r.is_done


PETS = {  # Pydantic's discriminated union: Cat | Dog tagged by pet_type
    "type": "object",
    "properties": {"pet": {"oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}],
                           "discriminator": {"propertyName": "pet_type"}}},
    "required": ["pet"], "additionalProperties": False,
    "$defs": {
        "Cat": {"type": "object", "properties": {"pet_type": {"const": "cat"},
                                                 "meows": {"type": "integer"}},
                "required": ["pet_type", "meows"], "additionalProperties": False},
        "Dog": {"type": "object", "properties": {"pet_type": {"const": "dog"},
                                                 "barks": {"type": "number"}},
                "required": ["pet_type", "barks"], "additionalProperties": False}},
}


@pytest.mark.parametrize("text, done", [
    ('{"pet": {"pet_type": "cat", "meows": 3}}', True),
    ('{"pet": {"pet_type": "dog", "barks": 1.5}}', True),
    ('{"pet": {"pet_type": "cat", "barks": 1.5}}', False),   # the dog's key in a cat
    ('{"pet": {"pet_type": "cat", "meows": 1.5}}', False),   # the cat's integer
    ('{"pet": {"pet_type": "dog"}}', False),                 # the dog's required key
    ('{"pet": {"pet_type": "cow", "meows": 1}}', False),     # no such tag
    ('{"pet": {"meows": 3, "pet_type": "cat"}}', False),     # the tag comes first
])
def test_a_tagged_union_holds_the_object_its_tag_names(text, done):
    assert accepts(PETS, text)[1] is done


def test_objects_without_a_tag_stay_loose():
    schema = {"anyOf": [{"type": "object", "properties": {"a": {"type": "integer"}}},
                        {"type": "object", "properties": {"b": {"type": "string"}}}]}
    assert accepts(schema, '{"a": "x", "b": 1}') == (True, True)  # only the type is held


def test_a_pattern_holds_its_strings(caplog):
    code = {"type": "object", "properties": {"code": {"type": "string",
                                                      "pattern": "^[A-Z]{2}[0-9]+$"}}}
    assert accepts(code, '{"code": "AB12"}') == (True, True)
    assert accepts(code, '{"code": "ab"}')[0] is False
    assert accepts(code, '{"code": "AB"}')[0] is False  # no digit before the quote
    contains = {"type": "object", "properties": {"x": {"type": "string", "pattern": "a\\\\b"}}}
    assert accepts(contains, '{"x": "za\\\\by"}') == (True, True)  # a search: "a\b" inside
    assert accepts(contains, '{"x": "zy"}')[0] is False
    # an enum decides where both are given; a pattern no grammar says is not held (logged)
    both = {"type": "object", "properties": {"k": {"enum": ["zz"], "pattern": "^a$"}}}
    assert accepts(both, '{"k": "zz"}') == (True, True)
    with caplog.at_level("INFO", logger="strata.engine"):
        look = {"type": "object", "properties": {"x": {"type": "string", "pattern": "(?=a)"}}}
        assert accepts(look, '{"x": "anything"}') == (True, True)
    assert "not held" in caplog.text and "lookaround" in caplog.text


def test_a_converter_fault_leaves_the_pattern_unheld(monkeypatch, caplog):
    from strata.engine import regex_grammar

    def broken(pattern, search=False):
        raise IndexError("a converter bug")

    monkeypatch.setattr(regex_grammar, "regex_to_gbnf", broken)
    schema = {"type": "object", "properties": {"x": {"type": "string",
                                                     "pattern": "^fault-test-[0-9]$"}}}
    with caplog.at_level("ERROR", logger="strata.engine"):
        assert accepts(schema, '{"x": "anything"}') == (True, True)
    assert "converting it failed" in caplog.text
