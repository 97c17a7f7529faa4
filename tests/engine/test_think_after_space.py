"""A `<think>` block after leading whitespace under a held answer (json_constraint.py's
TextConstraint): the output parser and the thinking budget read "\\n" then `<think>` as the
block's opening, so the constraint lets it open too, and the answer after `</think>` starts
where the whitespace did (the parser drops it). Whitespace the held text refuses stays
refused, and once other text came no block opens."""
from __future__ import annotations

import json

import numpy as np
import pytest

from strata.engine.gbnf import compile_grammar
from strata.engine.json_constraint import JsonObjectConstraint, TextConstraint
from strata.engine.sampling import Sampler, SamplingParams
from strata.engine.thinking_budget import ThinkingBudget
from strata.model.tokenizer import Tokenizer
from strata.server.output_parser import parse_complete
from strata.tool.synth import synth_tokenizer_meta

from test_candidates_cover_allows import DOUBLES, missed
from test_best_allowed_fast import ODD, reference
from test_tool_call_constraint import feed, ids

POINT = {"type": "object", "required": ["x"], "properties": {"x": {"type": "integer"}}}
SPACE_SELECT = 'root ::= [ \\n]? "SELECT " [a-z]+ ";"'  # one leading space or newline at most
SELECT = 'root ::= "SELECT " [a-z]+ ";"'  # no leading whitespace
ANSWERS = {"json": '{"a": [1, true]}', "schema": '{"x": 12}', "space select": "SELECT ab;"}


def held(tokenizer, kind: str, **kw):
    if kind == "json":
        return JsonObjectConstraint(tokenizer, tokenizer.stop_ids, **kw)
    if kind == "schema":
        return JsonObjectConstraint(tokenizer, tokenizer.stop_ids, schema=POINT, **kw)
    grammar = {"space select": SPACE_SELECT, "select": SELECT}[kind]
    return TextConstraint(tokenizer, tokenizer.stop_ids,
                          compile_grammar(grammar).bound(tokenizer).recognizer(), **kw)


@pytest.fixture(scope="module")
def doubles() -> Tokenizer:
    """test_candidates_cover_allows's vocabulary: `<think>` spelled by a plain token too, and
    a plain `<think>\\n`."""
    meta = synth_tokenizer_meta(4200)
    extra = ODD + DOUBLES
    meta["tokenizer.ggml.tokens"] = list(meta["tokenizer.ggml.tokens"]) + extra
    meta["tokenizer.ggml.token_type"] = list(meta["tokenizer.ggml.token_type"]) + [1] * len(extra)
    return Tokenizer.from_gguf_metadata(meta)


@pytest.mark.parametrize("kind", ["json", "schema", "space select"])
def test_a_block_after_a_leading_newline(tokenizer, kind):
    """"\\n", `<think>`, reasoning, `</think>`, the answer and the stop: each is allowed; the
    answer's own leading newline is read from before the first one (the grammar takes one,
    the JSON two: the lead took them all)."""
    c = held(tokenizer, kind)
    newlines = 1 if kind == "space select" else 2
    stop = sorted(tokenizer.stop_ids)[0]
    assert feed(c, ids(tokenizer, "\n") * newlines)
    assert not c.allows(ids(tokenizer, "\n")[0])  # the leading whitespace is all taken
    think = tokenizer.token_id("<think>")
    assert c.allows(think) and think in c.candidates()
    assert feed(c, [think] + ids(tokenizer, " let me see"))
    assert c.think.is_thinking and not c.allows(stop)
    assert feed(c, [tokenizer.token_id("</think>")]) and not c.think.is_thinking
    assert feed(c, ids(tokenizer, "\n" * newlines + ANSWERS[kind]))
    assert c.is_done and c.allows(stop)


def test_a_token_of_think_and_more_after_a_newline(doubles):
    """A plain `<think>\\n` after "\\n" opens the block as the added `<think>` does."""
    tok = doubles
    longer = tok.vocab_size - len(DOUBLES) + DOUBLES.index("<think>Ċ")
    c = held(tok, "json")
    assert feed(c, ids(tok, "\n") + [longer] + ids(tok, "hm"))
    assert c.think.is_thinking
    assert feed(c, [tok.token_id("</think>")] + ids(tok, "\n\n{}")) and c.is_done


def test_whitespace_the_grammar_refuses_stays_refused(tokenizer):
    """A grammar without leading whitespace: "\\n" is refused, with or without a block after
    it (a model that does not reason is not led into one); `<think>` first opens as before."""
    c = held(tokenizer, "select")
    assert not c.allows(ids(tokenizer, "\n")[0])
    assert c.allows(tokenizer.token_id("<think>"))


@pytest.mark.parametrize("kind", ["json", "schema", "space select"])
def test_no_block_after_other_text(tokenizer, kind):
    """After "\\n" and the answer's first token, and in a grammar that holds the whole output,
    no `<think>` opens."""
    think = tokenizer.token_id("<think>")
    c = held(tokenizer, kind)
    first = ids(tokenizer, ANSWERS[kind])[0]
    assert feed(c, ids(tokenizer, "\n") + [first])
    assert not c.allows(think) and think not in c.candidates()
    whole = held(tokenizer, kind, reasoning_lead=False)
    assert feed(whole, ids(tokenizer, "\n"))
    assert not whole.allows(think) and think not in whole.candidates()


@pytest.mark.parametrize("kind", ["json", "schema", "space select"])
def test_candidates_hold_what_is_allowed_around_the_lead(doubles, kind):
    """At each step of a whitespace-led block, under the constraint and under a thinking
    budget over it, every allowed id is a candidate; both spellings of `<think>` open."""
    tok = doubles
    plain_think = tok.vocab_size - len(DOUBLES) + DOUBLES.index("<think>")
    newline = ids(tok, "\n")
    steps = newline + [tok.token_id("<think>")] + ids(tok, "a</think>") + newline + ids(
        tok, ANSWERS[kind])
    for make in (lambda: held(tok, kind), lambda: ThinkingBudget(tok, 8, held(tok, kind))):
        c = make()
        for at, token in enumerate(steps):
            assert not missed(tok, c), (kind, steps[:at])
            if at == 1:  # after the "\n": both `<think>` open
                assert c.allows(plain_think) and plain_think in c.candidates()
            assert c.allows(token), (kind, tok.token_bytes(token))
            c.push(token)
        assert not missed(tok, c)


def test_a_budget_closes_a_block_after_whitespace(tokenizer):
    """A thinking budget of 2 over the JSON: after "\\n" and `<think>` it forces the close
    (which the JSON takes: its "\\n\\n" reads from before the "\\n"), and the whole output
    parses into the reasoning and the JSON answer."""
    inner = held(tokenizer, "json")
    c = ThinkingBudget(tokenizer, 2, inner)
    taken = ids(tokenizer, "\n") + [tokenizer.token_id("<think>")] + ids(tokenizer, " a b")
    assert feed(c, taken) and c.is_forcing
    for _ in range(8):
        if not c.is_forcing:
            break
        allowed = [int(t) for t in c.candidates() if c.allows(int(t))]
        assert allowed
        c.push(allowed[0])
        taken.append(allowed[0])
    assert not c.is_forcing and not inner.think.is_thinking
    answer = ids(tokenizer, '{"a": 1}')
    assert feed(c, answer) and inner.is_done
    text = tokenizer.decode(taken + answer, skip_special=True)
    assert "</think>\n\n{" in text, text
    content, reasoning, calls, _ = parse_complete(text)
    assert reasoning == "a b" and json.loads(content) == {"a": 1} and not calls, text


def test_a_close_in_the_opening_token_after_whitespace():
    """A token spelled `<think></think>\\n\\n{` after "\\n\\n": its answer ("\\n\\n{") is
    checked from before the lead's newlines, as it is then read."""
    meta = synth_tokenizer_meta(4200)
    meta["tokenizer.ggml.tokens"] = list(meta["tokenizer.ggml.tokens"]) + ["<think></think>ĊĊ{"]
    meta["tokenizer.ggml.token_type"] = list(meta["tokenizer.ggml.token_type"]) + [1]
    tok = Tokenizer.from_gguf_metadata(meta)
    both = tok.vocab_size - 1
    c = held(tok, "json")
    assert feed(c, ids(tok, "\n") * 2 + [both]) and not c.think.is_thinking
    assert feed(c, ids(tok, '"a": 1}')) and c.is_done


@pytest.mark.parametrize("think", ["<think>", "<think>Ċ"], ids=["think", "think and newline"])
def test_the_sampler_picks_think_after_a_newline(doubles, think):
    """The argmax refused, a plain `<think>` (or `<think>\\n`) next best after "\\n": the
    sampler's prefix-tree search takes it, greedy and as the draw after a refusal."""
    tok = doubles
    favoured = tok.vocab_size - len(DOUBLES) + DOUBLES.index(think)
    c = held(tok, "json")
    assert feed(c, ids(tok, "\n"))
    rng = np.random.default_rng(5)
    logits = (rng.standard_normal(tok.vocab_size) * 3).astype(np.float32)
    refused = tok.token_id("<|im_start|>")
    logits[favoured] = logits.max() + 1
    logits[refused] = logits[favoured] + 1
    assert reference(c, logits) == favoured
    assert Sampler(SamplingParams(temperature=0.0), constraint=c)._best_allowed(
        logits) == favoured
    logits[refused] += 50
    sampled = Sampler(SamplingParams(temperature=1.0, top_k=2, top_p=1.0, min_p=0.0, seed=3),
                      constraint=c)
    assert sampled.sample(logits) == favoured
