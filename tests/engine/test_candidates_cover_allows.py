"""Every token a constraint allows is among its candidates() (the ids the sampler draws from
after a refusal, engine/sampling.py and best_allowed.py; one missing there is never picked
after a refusal, so the odds change): at random reachable states of each kind of held output,
on a vocabulary that spells `<think>` and the tags twice and has empty tokens."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strata.engine.gbnf import compile_grammar
from strata.engine.json_constraint import JsonObjectConstraint, TextConstraint
from strata.engine.regex_grammar import regex_to_gbnf
from strata.engine.sampling import Sampler, SamplingParams
from strata.engine.thinking_budget import ThinkingBudget
from strata.engine.tool_call_constraint import ToolCallConstraint
from strata.engine.tool_call_required import RequiredToolCallConstraint
from strata.model.tokenizer import Tokenizer
from strata.tool.synth import synth_tokenizer_meta

from test_best_allowed_fast import CITY, ODD, PATCH, SQL, TIME, WEATHER, reference

# plain tokens spelled as the tags (a vocabulary's added `<think>` and a BPE spelling of it:
# the model may write either), a plain empty one and one spelled `<think>\n` (as the first
# token it opens the block too), after test_best_allowed_fast's ODD
DOUBLES = ["<think>", "</think>", "<tool_call>", "</tool_call>", "", "<think>Ċ"]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    """The synth vocabulary (its added tags, FIM tokens and empty [PAD] ones), ODD, DOUBLES."""
    meta = synth_tokenizer_meta(4200)
    extra = ODD + DOUBLES
    meta["tokenizer.ggml.tokens"] = list(meta["tokenizer.ggml.tokens"]) + extra
    meta["tokenizer.ggml.token_type"] = list(meta["tokenizer.ggml.token_type"]) + [1] * len(extra)
    return Tokenizer.from_gguf_metadata(meta)


def plain(tok, text: str) -> int:
    """The plain (DOUBLES) token spelled `text`."""
    return tok.vocab_size - len(DOUBLES) + DOUBLES.index(text)


def irregular(tok) -> list[int]:
    """The tokens a constraint may judge by more than their first byte: added, special, empty,
    the plain doubles and ODD, the pieces of a tag."""
    ids = {t for t in range(tok.vocab_size) if t in tok.added_ids or not tok.token_bytes(t)}
    ids |= set(range(tok.vocab_size - len(ODD) - len(DOUBLES), tok.vocab_size))
    for piece in ("<", "</", "\n", "\n\n", "think", ">"):
        ids.update(tok.encode(piece, add_special=False))
    return sorted(ids)


NUMBERS = {"type": "object", "required": ["n"], "properties": {
    "n": {"type": "integer", "minimum": -3, "maximum": 250},
    "x": {"anyOf": [{"type": "number"}, {"type": "null"}, {"type": "array",
                                                           "items": {"type": "boolean"}}]},
    "id": {"type": "string", "pattern": "^[a-c]{2}[0-9]?$"}}}
CITY_JSON = '{"city": "Zagreb", "code": "AB-12", "rank": 12, "tags": ["x", "y"]}'
CALL_JSON = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zwolle", '
             '"code": "ZW-7"}}\n</tool_call>')
CALL_XML = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nZwolle\n</parameter>\n"
            "<parameter=code>\nZW-7\n</parameter>\n</function>\n</tool_call>")
PATCH_BODY = "*** Begin Patch\n*** Update File: a.py\n@@\n-x\n+y\n*** End Patch"
TOKEN_ITEMS = 'root ::= <think> [a-z ]* </think> "ok" [a-z]* "."'


def text_held(grammar: str, **kw):
    return lambda tok: TextConstraint(tok, tok.stop_ids,
                                      compile_grammar(grammar).bound(tok).recognizer(), **kw)


def json_held(**kw):
    return lambda tok: JsonObjectConstraint(tok, tok.stop_ids, **kw)


def budget(tokens: int, inner=None, starts_in_reasoning: bool = False):
    return lambda tok: ThinkingBudget(tok, tokens, None if inner is None else inner(tok),
                                      starts_in_reasoning=starts_in_reasoning)


def required(functions, **kw):
    return lambda tok: RequiredToolCallConstraint(tok, functions, tok.stop_ids, **kw)


# kind -> (the constraint, a text it takes: the walk's guide into deep states)
KINDS = {
    "json": (json_held(), '<think>so</think>\n{"a": [1.5e3, "x\\u00e9", {"b": null}]}'),
    "json, reasoning left free": (json_held(starts_in_reasoning=True),
                                  'hm </think>\n\n{"a": true}'),
    "json, no reasoning lead": (json_held(reasoning_lead=False), '{"a": -0.25}'),
    "json schema": (json_held(schema=CITY), "<think>a</think>\n" + CITY_JSON),
    "json schema, reasoning left free": (json_held(schema=NUMBERS, starts_in_reasoning=True),
                                         'b</think>{"n": 12, "x": [true], "id": "ab3"}'),
    "gbnf": (text_held(SQL), "<think>q</think>SELECT ab FROM cd WHERE x = 12;"),
    "gbnf, reasoning left free": (text_held(SQL, starts_in_reasoning=True),
                                  "x</think>SELECT a FROM b;"),
    "gbnf token items": (text_held(TOKEN_ITEMS), "<think>ab c</think>okay."),
    "gbnf negated token item": (text_held('root ::= !<think> "ok" [a-z]* "."'), "xok."),
    "gbnf of only the empty text": (text_held('root ::= ""'), "<think>a</think>"),
    "regex": (text_held(regex_to_gbnf(r"(<t|[a-c]+)(x|yz)\d{1,3}")), "abyz12"),
    "tool calls": (lambda tok: ToolCallConstraint(tok, [WEATHER, TIME], max_calls=2),
                   "Let me see.\n" + CALL_JSON + CALL_JSON),
    "tool calls xml": (lambda tok: ToolCallConstraint(tok, [WEATHER, TIME], xml=True),
                       "Now.\n" + CALL_XML),
    "tool call grammar": (lambda tok: ToolCallConstraint(tok, [PATCH]),
                          '<tool_call>\n{"name": "apply_patch", "arguments": {"input": "'
                          + PATCH_BODY.replace("\n", "\\n") + '"}}\n</tool_call>'),
    "tool call grammar xml": (lambda tok: ToolCallConstraint(tok, [PATCH], xml=True),
                              "<tool_call>\n<function=apply_patch>\n<parameter=input>\n"
                              + PATCH_BODY + "\n</parameter>\n</function>\n</tool_call>"),
    "tool call required": (required([WEATHER, TIME]), "<think>a</think>\n" + CALL_JSON),
    "tool call required xml, reasoning left free": (
        required([WEATHER], xml=True, starts_in_reasoning=True), "b</think>\n\n" + CALL_XML),
    "tool call named": (required([WEATHER], max_calls=1), CALL_JSON),
    "thinking budget": (budget(2), "<think>a b\n</think>\n\nHi"),
    "thinking budget, reasoning": (budget(3, starts_in_reasoning=True), "a b c\n</think>\n\nok"),
    "thinking budget over json": (budget(2, json_held()), "<think>a b\n</think>\n\n{}"),
    "thinking budget over json, reasoning": (
        budget(1, json_held(starts_in_reasoning=True), True), 'a\n</think>\n\n{"a": 1}'),
    "thinking budget over a grammar": (budget(2, text_held(SQL)), "<think>a b"),
    "thinking budget over tool calls": (
        budget(2, lambda tok: ToolCallConstraint(tok, [WEATHER])),
        "<think>a b\n</think>\n\n" + CALL_JSON),
    "thinking budget over a required call, reasoning": (
        budget(2, required([WEATHER], starts_in_reasoning=True), True),
        "a b\n</think>\n\n" + CALL_JSON),
    "thinking budget over token items": (budget(0, text_held(TOKEN_ITEMS)), "<think>a</think>"),
}


def missed(tok, c) -> list[int]:
    """The ids `c` allows that its candidates() leave out (every id outside them asked)."""
    ids = c.candidates()
    is_candidate = np.zeros(tok.vocab_size, dtype=bool)
    is_candidate[ids[ids < tok.vocab_size]] = True
    return [t for t in np.flatnonzero(~is_candidate).tolist() if c.allows(t)]


def next_tokens(c, how: str, n: int, guide: list[int], at: int, odd: list[int]) -> list[int]:
    """The walk's next move: up to n % 8 + 1 of the guide's tokens from its `at`-th (taken
    while `c` allows them), an irregular token, or the first allowed candidate from the n-th
    on (200 asked at most, else none)."""
    if how == "guide":
        return guide[at:at + n % 8 + 1]
    if how == "odd":
        return [odd[n % len(odd)]]
    ids = c.candidates().tolist()
    picks = (ids[(n + k) % len(ids)] for k in range(min(200, len(ids))))
    return [t for t in picks if c.allows(t)][:1]


MOVES = st.lists(st.tuples(st.sampled_from(["guide", "odd", "any", "any"]),
                           st.integers(0, 1 << 16)), max_size=6)


@pytest.mark.parametrize("kind", sorted(KINDS))
@settings(max_examples=10, deadline=None, derandomize=True)
@given(cut=st.integers(0, 1 << 8), moves=MOVES)
def test_candidates_hold_every_allowed_token(tok, kind, cut, moves):
    """At the start, at a cut of the guide, and after each move of a walk from there."""
    make, text = KINDS[kind]
    c = make(tok)
    guide = tok.encode(text, add_special=False)
    odd = irregular(tok)
    assert not missed(tok, c)
    at = cut % (len(guide) + 1)
    for token in guide[:at]:
        c.push(token)
    taken = [tok.token_bytes(t) for t in guide[:at]]
    assert not missed(tok, c), taken
    for how, n in moves:
        for token in next_tokens(c, how, n, guide, at, odd):
            if not c.allows(token):
                break
            c.push(token)
            taken.append(tok.token_bytes(token))
            at += how == "guide"
        bad = missed(tok, c)
        assert not bad, (taken, [(t, tok.token_bytes(t)) for t in bad[:6]])


def test_the_guides_are_taken_whole(tok):
    """Each guide is a text its constraint takes (else the walks would not reach deep)."""
    for kind, (make, text) in KINDS.items():
        c = make(tok)
        for token in tok.encode(text, add_special=False):
            assert c.allows(token), (kind, tok.token_bytes(token))
            c.push(token)


def test_think_and_more_opens_where_think_does(tok):
    """A first token spelled `<think>\n` is taken wherever the plain `<think>` is (both open
    the block, as the output parser reads the text), and is among the candidates there."""
    longer, think = plain(tok, "<think>Ċ"), plain(tok, "<think>")
    for kind, (make, _) in KINDS.items():
        c = make(tok)
        assert c.allows(longer) == c.allows(think), kind
        assert not c.allows(longer) or longer in c.candidates(), kind
    assert JsonObjectConstraint(tok, tok.stop_ids).allows(longer)


# ---- the disagreements found, each through the sampler: the best allowed token is picked ----
FAVOURED = {
    # a plain token spelled `<think>` opens the block as the added one does (the output parser
    # reads the text): it may come first where `<` may not
    "plain <think>": (json_held(), "", lambda tok: plain(tok, "<think>")),
    "plain <think> under a budget": (budget(4, text_held(SQL)), "",
                                     lambda tok: plain(tok, "<think>")),
    "plain <think> before a required call": (required([WEATHER]), "",
                                             lambda tok: plain(tok, "<think>")),
    # an empty token writes nothing: free reasoning takes it (the held text does not)
    "empty [PAD] in reasoning": (json_held(schema=CITY), "<think>a",
                                 lambda tok: tok.vocab_size - len(ODD) - len(DOUBLES) - 1),
    "plain empty token in reasoning": (text_held(SQL, starts_in_reasoning=True), "so",
                                       lambda tok: plain(tok, "")),
    "empty token in budgeted reasoning": (budget(5, json_held(starts_in_reasoning=True), True), "a",
                                          lambda tok: plain(tok, "")),
    # a grammar of only the empty text still lets a reasoning block come first
    "<think> before the empty text": (text_held('root ::= ""'), "",
                                      lambda tok: tok.token_id("<think>")),
}


@pytest.mark.parametrize("case", sorted(FAVOURED))
def test_the_best_allowed_token_may_be_one_candidates_missed(tok, case):
    """The argmax is refused and the favoured token, allowed, has the next best logit: the
    sampler takes it, greedy and as the draw after a refusal."""
    make, text, favoured = FAVOURED[case]
    c = make(tok)
    for token in tok.encode(text, add_special=False):
        c.push(token)
    favoured = favoured(tok)
    assert tok.token_bytes(favoured) in (b"", b"<think>") and c.allows(favoured)
    rng = np.random.default_rng(len(case))
    logits = (rng.standard_normal(tok.vocab_size) * 3).astype(np.float32)
    refused = tok.token_id("<|im_start|>")
    assert not c.allows(refused)
    logits[favoured] = logits.max() + 1
    logits[refused] = logits[favoured] + 1
    assert reference(c, logits) == favoured
    assert Sampler(SamplingParams(temperature=0.0), constraint=c)._best_allowed(
        logits) == favoured
    # sampled: the draw after the refusal keeps the candidates only (top_k 2: these two)
    logits[refused] += 50
    sampled = Sampler(SamplingParams(temperature=1.0, top_k=2, top_p=1.0, min_p=0.0, seed=3),
                      constraint=c)
    assert sampled.sample(logits) == favoured
