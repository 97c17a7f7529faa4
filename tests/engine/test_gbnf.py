"""GBNF grammars (engine/gbnf.py): the recognizer against Python's re and json modules, its
UTF-8 reading, the first bytes it offers, the faults it names, and the token constraint and the
engine held to a grammar."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strata import Engine, EngineConfig
from strata.engine.gbnf import GrammarError, compile_grammar
from strata.engine.generate import collect
from strata.engine.json_constraint import TextConstraint
from strata.engine.sampling import Sampler, SamplingParams
from strata.errors import RequestError

# llama.cpp's grammars/json.gbnf, as its users send it
JSON_GBNF = r'''
root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws

object ::=
  "{" ws (
            string ":" ws value
    ("," ws string ":" ws value)*
  )? "}" ws

array  ::=
  "[" ws (
            value
    ("," ws value)*
  )? "]" ws

string ::=
  "\"" (
    [^"\\\x7F\x00-\x1F] |
    "\\" (["\\bfnrt] | "u" [0-9a-fA-F]{4}) # escapes
  )* "\"" ws

number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9] [1-9]{0,15})? ws

# Optional space: by convention, applied in this grammar after literal chars when allowed
ws ::= | " " | "\n" [ \t]{0,20}
'''

# (GBNF, the same language as a Python regular expression)
PAIRS = [
    ('root ::= "yes" | "no"', r"yes|no"),
    ('root ::= ("ab" | [c-e]+)* "x"?', r"(?:ab|[c-e]+)*x?"),
    ('root ::= [a-c]{2,3} d{0,2}\nd ::= "d"', r"[a-c]{2,3}d{0,2}"),
    ('root ::= [^ab] . "a"{2}', r"[^ab].a{2}"),
    ('root ::= a b | b\na ::= "a"+\nb ::= "b" a?', r"a+ba*|ba*"),
    ('root ::= ("a" ("b" | "c")?)+ # a comment\n', r"(?:a(?:b|c)?)+"),
    ('root ::= x{3,}\nx ::= [bd]', r"[bd]{3,}"),
    ('root ::= "" | "e"', r"|e"),
]
ALPHABET = "abcdex"


def run(grammar, data: bytes):
    r = grammar.recognizer()
    return r, r.feed(data)


@pytest.mark.parametrize("gbnf,regex", PAIRS)
@settings(max_examples=150, deadline=None)
@given(text=st.text(ALPHABET, max_size=8))
def test_sentences_are_the_regular_expressions(gbnf, regex, text):
    """A string is a whole sentence exactly when the equivalent regex matches it; every prefix
    of a sentence is read."""
    grammar = compile_grammar(gbnf)
    r, ok = run(grammar, text.encode())
    matches = re.fullmatch(regex, text) is not None
    assert (ok and r.is_done) == matches, (gbnf, text)
    if matches:
        for i in range(len(text)):
            assert run(grammar, text[:i].encode())[1]


# json.gbnf's strings refuse a raw DEL (\x7f), which json.dumps writes as it is
KEYS = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",),
                             exclude_characters="\x7f"), max_size=6)
SCALARS = st.none() | st.booleans() | st.integers(-10**15 + 1, 10**15 - 1) | KEYS
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(KEYS, inner, max_size=4), max_leaves=10)


@settings(max_examples=150, deadline=None)
@given(obj=st.dictionaries(KEYS, VALUES, max_size=4), ascii_only=st.booleans(),
       compact=st.booleans())
def test_the_json_grammar_reads_what_json_dumps_writes(obj, ascii_only, compact):
    """llama.cpp's json.gbnf against json.dumps (raw UTF-8 too), byte by byte."""
    grammar = compile_grammar(JSON_GBNF)
    data = json.dumps(obj, ensure_ascii=ascii_only,
                      separators=(",", ":") if compact else None).encode()
    r = grammar.recognizer()
    for i, b in enumerate(data):
        assert r.feed(bytes((b,))), (data, i)
    assert r.is_done
    assert not run(grammar, data[:-1] + b"]")[1]


@pytest.mark.parametrize("gbnf,prefix", [
    (JSON_GBNF, b'{"a'), (JSON_GBNF, b'{"a": [1, '), (JSON_GBNF, b'{"k": "\xc3'),
    ('root ::= [a-z\u00e9\u20ac-\u20af\U0001F600] "!"', b""),
    ('root ::= [^a\u00e9]', b""), ('root ::= "\u20ac" | "\u00e9"', b"\xe2"),
    ('root ::= "x"', b"x"),
])
def test_first_bytes_are_the_bytes_it_reads(gbnf, prefix):
    r, ok = run(compile_grammar(gbnf), prefix)
    assert ok
    first = r.first_bytes()
    for b in range(256):
        assert first[b] == r.copy().feed(bytes((b,))), (gbnf, prefix, hex(b))


def test_a_character_may_be_split_between_tokens():
    grammar = compile_grammar('root ::= "\u20ac" [\u00e0-\u00ff]')
    euro, a_grave = "\u20ac".encode(), "\u00e0".encode()
    r = grammar.recognizer()
    assert r.feed(euro[:1]) and not r.is_done and r.feed(euro[1:2]) and r.feed(euro[2:])
    assert not r.copy().feed(b"a")  # ASCII is outside [à-ÿ]
    assert not r.copy().feed("\u0100".encode()[:1])  # Ā's lead byte: no character of the class
    assert r.feed(a_grave[:1]) and not r.is_done and r.feed(a_grave[1:]) and r.is_done
    assert grammar.recognizer().feed(b"\xe2\x82")  # the start of the euro sign
    assert not grammar.recognizer().feed(b"\xe2\x41")  # not a continuation byte
    assert not grammar.recognizer().feed(b"\xc0\x80")  # an overlong form
    assert not grammar.recognizer().feed(b"\xff")


def test_a_start_only_an_overlong_form_or_a_surrogate_could_finish_is_refused_at_once():
    """Each such start used to be taken, leaving no byte to follow it: a sampler held to
    [^\n]* wrote b"\xf0\x8d\xab" and was stuck (every next token refused)."""
    anything = compile_grammar(r'root ::= [^\n]*')
    for start in (b"\xf0\x8d", b"\xe0\x9f", b"\xed\xa0", b"\xf4\x90"):
        assert not anything.recognizer().feed(start), start
    for start in (b"\xf0\x90", b"\xe0\xa0", b"\xed\x9f", b"\xf4\x8f", b"\xed"):
        assert anything.recognizer().feed(start), start


def test_is_done_and_can_continue():
    r = compile_grammar('root ::= "a" "b"?').recognizer()
    assert not r.is_done and r.can_continue
    r.feed(b"a")
    assert r.is_done and r.can_continue
    r.feed(b"b")
    assert r.is_done and not r.can_continue


@pytest.mark.parametrize("text,words", [
    ('root ::= a', ["'a' is used but not defined", "line 1, column 10"]),
    ('x ::= "a"', ["no 'root' rule"]),
    ('root ::= "a', ["literal is not closed"]),
    ('root ::= [a', ["character class is not closed"]),
    ('root ::= ("a"', ["group is not closed"]),
    ('root ::= "a")', ["unexpected ')'"]),
    ('root ::= root "a" | "b"', ["'root' can reach itself", "left recursion"]),
    ('root ::= x\nx ::= y? x "a"\ny ::= "b"', ["'x' can reach itself"]),
    ('root ::= ("a"?)*', ["can reach itself"]),
    ('root ::= "a"{3,1}', ["bounds"]),
    ('root ::= "a"{2000}', ["bounds"]),
    ('root ::= ("' + "x" * 1000 + '"{1000}){1000}', ["more than 262144 items"]),
    ('root ::= "a"{x}', ["{m}, {m,} or {m,n}"]),
    ('root ::= "\\q"', ["unknown escape"]),
    ('root ::= "\\x4"', ["takes 2 hex digits"]),
    ('root ::= [z-a]', ["ends below its start"]),
    ('root ::= <[12', ["<[ID]>, ID a number", "column 10"]),
    ('root ::= <[x]>', ["<[ID]>"]),
    ('root ::= <think', ["not closed on its line"]),
    ('root ::= <\n>', ["not closed on its line"]),
    ('root ::= !"a"', ["'!' must be followed by a token reference"]),
    ('root ::= (<[1]>?)*', ["can reach itself"]),
    ('root ::= "a"\nroot ::= "b"', ["defined twice", "line 2, column 1"]),
    ('root = "a"', ["expected '::='"]),
    ('::= "a"', ["expected a rule's name"]),
    ('root ::= "a" $', ["unexpected '$'"]),
    ('root ::= ' + "(" * 500 + '"a"' + ")" * 500, ["nest more than 100 deep", "column 110"]),
])
def test_faults_are_named_with_their_place(text, words):
    with pytest.raises(GrammarError) as info:
        compile_grammar(text)
    assert isinstance(info.value, RequestError)
    for w in words:
        assert w in str(info.value), str(info.value)


def test_sampling_params_check_the_grammar():
    SamplingParams(grammar='root ::= "a"')
    with pytest.raises(GrammarError, match="not defined"):
        SamplingParams(grammar="root ::= b")
    with pytest.raises(RequestError, match="must be a GBNF"):
        SamplingParams(grammar=["root"])
    with pytest.raises(RequestError, match="excludes json_object"):
        SamplingParams(grammar='root ::= "a"', json_object=True)


# ---- held to a grammar on a real vocabulary --------------------------------------------------
ANSWER = 'root ::= ("yes" | "no") ("." | "!") [ a-z]{0,12}'


def test_constraint_against_the_recognizer_on_a_vocabulary(tokenizer):
    """allows(t) is the recognizer's answer on t's bytes; candidates() holds every allowed id;
    stop tokens only where a sentence may end."""
    grammar = compile_grammar(ANSWER)
    V = tokenizer.vocab_size
    rng = np.random.default_rng(0)
    for text in ["", "y", "no", "yes.", "no! an"]:
        c = TextConstraint(tokenizer, tokenizer.stop_ids, grammar.recognizer())
        for t in tokenizer.encode(text, add_special=False):
            assert c.allows(t)
            c.push(t)
        allowed = {t for t in range(V) if c.allows(t)}
        assert allowed <= set(c.candidates().tolist())
        for t in rng.choice(V, 300):
            t = int(t)
            data = tokenizer.token_bytes(t)
            want = (t not in tokenizer.special_ids and bool(data)
                    and grammar.recognizer().feed(text.encode() + data))
            if t in tokenizer.stop_ids:
                want = text in ("yes.", "no! an")
            assert c.allows(t) == want, (text, data)


def test_a_finished_sentence_leaves_only_the_stop_tokens(tokenizer):
    grammar = compile_grammar('root ::= "no"')
    c = TextConstraint(tokenizer, tokenizer.stop_ids, grammar.recognizer())
    for t in tokenizer.encode("no", add_special=False):
        c.push(t)
    assert sorted(c.candidates().tolist()) == sorted(tokenizer.stop_ids)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sampler_writes_sentences_from_random_logits(tokenizer, temperature):
    V = tokenizer.vocab_size
    grammar = compile_grammar(ANSWER)
    pattern = re.compile(r"(?:yes|no)[.!][ a-z]{0,12}")
    stops = sorted(tokenizer.stop_ids)
    think = tokenizer.token_id("<think>")  # a reasoning block may come first: not here
    for seed in range(8):
        rng = np.random.default_rng(seed)
        params = SamplingParams(temperature=temperature, top_k=0, top_p=1.0, min_p=0.0,
                                seed=seed, grammar=ANSWER, logit_bias={think: -100})
        sampler = Sampler(params, constraint=TextConstraint(tokenizer, tokenizer.stop_ids,
                                                            grammar.recognizer()))
        tokens = []
        for step in range(40):
            logits = rng.standard_normal(V).astype(np.float32) * 2
            logits[stops] += step / 4
            token = sampler.sample(logits)
            tokens.append(token)
            if token in tokenizer.stop_ids:
                break
        assert tokens[-1] in tokenizer.stop_ids  # the class allows 12 at most, then only stops
        text = tokenizer.decode(tokens[:-1])
        assert pattern.fullmatch(text), text


def test_without_a_reasoning_lead_the_grammar_holds_the_first_token(tiny_model_path):
    """A raw prompt's grammar (reasoning_lead False: /completion, /infill, /v1/completions,
    `strata run --raw`) holds the whole output: a <think> the model favours cannot open a
    free block before it (the default model's README grammar came back as `<think> who ...`)."""
    gbnf = 'root ::= " " [0-9]{1,2} "%"'
    with Engine(EngineConfig(tiny_model_path, n_ctx=256)) as engine:
        prompt = engine.tokenize("Share:", add_special=True)
        think = engine.tokenizer.token_id("<think>")
        for lead in (True, False):
            params = SamplingParams(temperature=0.0, max_tokens=24, grammar=gbnf,
                                    logit_bias={think: 100}, reasoning_lead=lead)
            result = collect(engine.generate(prompt, params))
            if lead:  # a chat prompt's reasoning block may come first
                assert result.token_ids[0] == think
            else:
                assert think not in result.token_ids
                assert re.fullmatch(r" [0-9]{1,2}%", result.text), result.text


def test_engine_answers_with_a_sentence_of_the_grammar(tiny_model_path):
    """Greedy and sampled generations follow the grammar and stop at its end."""
    gbnf = 'root ::= "The answer is " [0-9]{1,3} ("%" | " apples")'
    with Engine(EngineConfig(tiny_model_path, n_ctx=256)) as engine:
        prompt = engine.tokenize("How many?", add_special=True)
        think = engine.tokenizer.token_id("<think>")
        for temperature in (0.0, 1.0):
            params = SamplingParams(temperature=temperature, seed=4, max_tokens=64,
                                    grammar=gbnf, logit_bias={think: -100})
            result = collect(engine.generate(prompt, params))
            assert re.fullmatch(r"The answer is [0-9]{1,3}(?:%| apples)", result.text), \
                result.text
            assert result.finish_reason == "stop"


# ---- token references (<[id]>, <text>, !) ------------------------------------------------------
def test_token_items_take_whole_tokens_beside_characters():
    g = compile_grammar('root ::= <[5]> [a-z]+ <[7]> | !<[9]> "x"')
    assert g.has_tokens
    r = g.recognizer()
    assert r.token_candidates() == (frozenset({5, 9}), True)  # !<[9]>: any token may come
    assert not r.copy().feed(b"x")            # no character may come first
    assert not r.copy().feed_token(9, b"x")   # 9 is the one token the negated item refuses
    a = r.copy()
    assert a.feed_token(5, b"<five>") and not a.is_done  # by the token item, bytes unread
    assert a.token_candidates() == (frozenset(), False)  # characters now
    assert a.feed_token(100, b"ab") and a.feed_token(101, b"c")
    assert a.token_candidates() == (frozenset({7}), False)  # [a-z]+ may end: <[7]> may come
    assert not a.copy().feed_token(8, b"")    # a special token (no bytes) only by its item
    assert a.feed_token(7, b"") and a.is_done and not a.can_continue
    b = r.copy()
    assert b.feed_token(3, "\u00e9".encode()[:1]) and not b.is_done  # any token, whole
    assert b.feed_token(4, b"x") and b.is_done


def test_a_token_ending_inside_a_character_keeps_the_token_reading():
    # `.` reads the lead byte of a two-byte character, while !<[1]> takes the token whole:
    # one partial character is shared by all stacks, so the token items' reading is kept
    g = compile_grammar('root ::= . "z" | !<[1]> "y"')
    r = g.recognizer()
    assert r.feed_token(2, "\u00e9".encode()[:1])
    assert r.feed(b"y") and r.is_done
    r = g.recognizer()  # a whole character and the token: both readings go on
    assert r.feed_token(2, b"a")
    assert r.copy().feed(b"z") and r.copy().feed(b"y")


def test_text_token_items_are_bound_to_the_vocabulary(tokenizer):
    g = compile_grammar('root ::= <think> [a-z ]* </think> "ok" | !<|im_end|> <[17]>')
    bound = g.bound(tokenizer)
    assert g.bound(tokenizer) is bound and compile_grammar('root ::= "a"').bound(tokenizer) \
        .has_tokens is False
    think, close, end = (tokenizer.token_id(t) for t in ("<think>", "</think>", "<|im_end|>"))
    r = bound.recognizer()
    ids, negated = r.token_candidates()
    assert ids == {think, end} and negated
    outside = f'root ::= <[{tokenizer.vocab_size}]>'
    for text, words in (('root ::= <nope>', ["<nope> is not one token", "<[ID]>"]),
                        (outside, ["outside this model's vocabulary"])):
        with pytest.raises(GrammarError) as info:
            compile_grammar(text).bound(tokenizer)
        assert all(w in str(info.value) for w in words), str(info.value)


def test_the_token_constraint_reads_token_items(tokenizer):
    gbnf = 'root ::= <think> [a-z ]* </think> "yes"'
    think, close = tokenizer.token_id("<think>"), tokenizer.token_id("</think>")
    stops = tokenizer.stop_ids
    c = TextConstraint(tokenizer, stops, compile_grammar(gbnf).bound(tokenizer).recognizer(),
                       starts_in_reasoning=True)  # the grammar holds the whole output
    assert c.candidates().tolist() == [think]
    assert c.allows(think) and not c.allows(close)
    assert not any(c.allows(t) for t in tokenizer.encode("no", add_special=False))
    c.push(think)
    words = tokenizer.encode("so on", add_special=False)
    assert all(c.allows(t) for t in words[:1]) and c.allows(close)
    assert close in c.candidates()
    for t in words:
        c.push(t)
    c.push(close)
    assert not c.allows(close) and not c.is_done
    for t in tokenizer.encode("yes", add_special=False):
        assert c.allows(t)
        c.push(t)
    assert c.is_done and sorted(c.candidates().tolist()) == sorted(stops)
    # a special token's bytes never pass as characters, even where the characters would
    chars = TextConstraint(tokenizer, stops, compile_grammar(
        'root ::= "<" [a-z/]+ ">" | <[17]>').bound(tokenizer).recognizer())
    assert not chars.allows(think) and not chars.allows(close) and chars.allows(17)


def test_the_engine_answers_with_token_items_and_refuses_an_unknown_one(tiny_model_path):
    gbnf = 'root ::= <think> "hm" </think> "The answer is " [0-9]{1,2}'
    with Engine(EngineConfig(tiny_model_path, n_ctx=256)) as engine:
        tok = engine.tokenizer
        prompt = engine.tokenize("How many?", add_special=True)
        params = SamplingParams(temperature=0.0, max_tokens=32, grammar=gbnf)
        result = collect(engine.generate(prompt, params))
        assert result.token_ids[0] == tok.token_id("<think>")
        assert tok.token_id("</think>") in result.token_ids
        text = tok.decode([t for t in result.token_ids if t not in tok.stop_ids])
        assert re.fullmatch(r"<think>hm</think>The answer is [0-9]{1,2}", text), text
        with pytest.raises(RequestError, match="<nope> is not one token"):
            engine.submit(prompt, SamplingParams(max_tokens=4, grammar='root ::= <nope>'))
