"""A string argument held to a grammar (engine/held_text.py): inside a JSON string (its
escapes decoded, one spelling per text) and as an XML value of Qwen3-Coder's form."""
from __future__ import annotations

import json
import re

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from strata.engine.gbnf import compile_grammar
from strata.engine.held_text import JsonText, XmlText
from strata.engine.json_schema import GRAMMAR_KEY, SchemaRecognizer, compile_schema
from strata.engine.sampling import Sampler, SamplingParams
from strata.engine.tool_call_constraint import ToolCallConstraint
from strata.server.output_parser import OutputParser, ToolCall

# a word, then lines of "+" or "-" and text, each ending in a newline
PATCHY = r'root ::= "go" ("\n" [+-] [^\n]*)* "\n"'
PATCHY_RE = re.compile(r"go(\n[+-][^\n]*)*\n")


def json_accepts(grammar: str, body: str) -> tuple[bool, bool]:
    """(the bytes of `{"input": <body>}` were all taken, the object is whole)."""
    schema = {"type": "object", "properties": {"input": {"type": "string", GRAMMAR_KEY: grammar}},
              "required": ["input"], "additionalProperties": False}
    rec = SchemaRecognizer(compile_schema(schema))
    ok = rec.feed(b'{"input": ' + body.encode() + b"}")
    return ok, ok and rec.is_done


def test_a_json_string_is_held_by_its_decoded_text():
    assert json_accepts(PATCHY, json.dumps("go\n+a\n-b \"q\" \\ \t\n")) == (True, True)
    assert json_accepts(PATCHY, json.dumps("go\n")) == (True, True)
    assert json_accepts(PATCHY, json.dumps("go\n*x\n"))[0] is False  # not + or -
    assert json_accepts(PATCHY, json.dumps("go\n+a"))[0] is False    # no last newline
    assert json_accepts(PATCHY, '"gone"')[0] is False


def test_only_the_escapes_json_dumps_writes():
    grammar = r'root ::= [a-z/\x0b\n]*'
    assert json_accepts(grammar, r'"a\nb/\u000b"') == (True, True)
    for other in (r'"a\/"', r'"\u000a"', r'"\u0061"', r'"\u000B"'):
        assert json_accepts(grammar, other)[0] is False, other


def test_no_byte_starts_what_cannot_end():
    """A backslash where no escaped character may come, and \\u digits that lead to none, are
    refused at once (the sampler would otherwise write itself into a dead end)."""
    text = JsonText(compile_grammar(r'root ::= [a-z]+'))
    assert not text.copy().byte(ord("\\"))
    text = JsonText(compile_grammar(r'root ::= "\x02"'))
    assert text.byte(ord("\\")) and not text.copy().byte(ord("n"))
    assert text.byte(ord("u")) and text.byte(ord("0")) and text.byte(ord("0"))
    assert not text.copy().byte(ord("1"))  # \u001x: no such character is allowed
    assert text.byte(ord("0")) and text.byte(ord("2")) and text.is_done


ALPHABET = 'go\n+-a"\\\t\x01é'


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=ALPHABET, max_size=14))
def test_the_json_form_accepts_exactly_the_grammar_texts(value):
    ok, whole = json_accepts(PATCHY, json.dumps(value, ensure_ascii=False))
    assert whole == bool(PATCHY_RE.fullmatch(value))


def xml_reads(grammar: str, raw: bytes) -> list[int]:
    """XmlText.byte of each byte of `raw`, up to the first that is not 0."""
    text, out = XmlText(compile_grammar(grammar), b"</parameter>"), []
    for c in raw:
        out.append(text.byte(c))
        if out[-1]:
            break
    return out


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=ALPHABET + "<>/pr", max_size=14), st.booleans())
def test_the_xml_form_ends_where_the_reader_ends_it(value, lead):
    """A value is taken, with its closing tag, exactly when it is a text of the grammar, as
    server/output_parser reads it back (one newline stripped at each end)."""
    raw = ("\n" if lead else "") + value + "\n</parameter>"
    got = xml_reads(PATCHY, raw.encode())
    read = re.match(r"(.*?)</parameter>", raw, re.DOTALL).group(1)
    read = read[1:] if read.startswith("\n") else read
    read = read[:-1] if read.endswith("\n") else read
    takes = bool(PATCHY_RE.fullmatch(read)) and (lead or not value.startswith("\n")) \
        and "</parameter>" not in ("\n" if lead else "") + value
    assert (got[-1] == 1 and len(got) == len(raw.encode())) == takes, got


def test_a_tag_inside_the_text_is_refused_where_the_text_cannot_end():
    # "go\n</parameter>" closes the value at "go"? no: "go" alone is not a text
    assert xml_reads(PATCHY, b"go\n</parameter>")[-1] == -1
    assert xml_reads(PATCHY, b"go\n\n</parameter>")[-1] == 1


PATCH_TOOL = {"name": "apply_patch", "parameters": {
    "type": "object", "required": ["input"], "additionalProperties": False,
    "properties": {"input": {"type": "string", GRAMMAR_KEY: PATCHY}}}}


def test_sampled_calls_follow_the_grammar(tokenizer):
    """Random logits with the opening tag favoured: every call closed is one whose input
    the grammar takes, in the JSON and the XML form."""
    V = tokenizer.vocab_size
    open_tag = tokenizer.token_id("<tool_call>")
    nudged = [t for t in range(V) if tokenizer.token_bytes(t) in
              (b"\n", b"+", b"-", b"go", b'"', b"}", b"</", b"parameter", b">")]
    found = {False: 0, True: 0}
    for xml in (False, True):
        for seed in range(4):
            rng = np.random.default_rng(seed)
            sampler = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0,
                                             seed=seed, held_tool_calls=[PATCH_TOOL],
                                             tool_call_form="xml" if xml else "json"),
                              constraint=ToolCallConstraint(tokenizer, [PATCH_TOOL], xml=xml))
            tokens = []
            for step in range(300):
                logits = rng.standard_normal(V).astype(np.float32) * 2
                logits[open_tag] += 6
                logits[nudged] += min(step % 50 / 5, 8)
                tokens.append(sampler.sample(logits))
            parser = OutputParser(parse_tools=True, param_types={"apply_patch":
                                                                 {"input": "string"}})
            calls = [e for e in parser.feed(tokenizer.decode(tokens)) if isinstance(e, ToolCall)]
            assert parser.num_invalid_tool_calls == 0, tokenizer.decode(tokens)
            for call in calls:
                assert PATCHY_RE.fullmatch(json.loads(call.arguments)["input"]), call.arguments
            found[xml] += len(calls)
    assert found[False] >= 1 and found[True] >= 4, found
