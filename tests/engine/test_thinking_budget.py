"""A <think> block held to a token budget (engine/thinking_budget.py): at the budget the
sampler may only spell the block's close, then the answer goes on; inner constraints see
every token."""
from __future__ import annotations

import numpy as np
import pytest

from strata.engine.gbnf import compile_grammar
from strata.engine.generate import collect
from strata.engine.json_constraint import JsonObjectConstraint, TextConstraint
from strata.engine.sampling import Sampler, SamplingParams
from strata.engine.thinking_budget import CLOSE, ThinkingBudget
from strata.errors import RequestError
from strata.server.output_parser import parse_complete

from sampling_ref import HostLogitRow
from test_tool_call_constraint import feed, ids


def test_the_block_closes_at_its_budget(tokenizer):
    c = ThinkingBudget(tokenizer, 3)
    think = tokenizer.token_id("<think>")
    assert c.is_free and c.allows(think)
    c.push(think)
    assert feed(c, ids(tokenizer, " a b"))  # two thinking tokens (" a", " b")
    assert c.num_thinking_tokens == 2 and not c.is_forcing
    assert feed(c, ids(tokenizer, " c"))
    assert c.is_forcing and not c.is_free
    assert not c.allows(ids(tokenizer, " d")[0]) and not c.allows(sorted(tokenizer.stop_ids)[0])
    allowed = {t for t in range(tokenizer.vocab_size) if c.allows(t)}
    assert allowed and allowed <= set(c.candidates().tolist())
    assert all(CLOSE.startswith(tokenizer.token_bytes(t)) for t in allowed)
    assert feed(c, ids(tokenizer, CLOSE.decode()))
    assert not c.is_forcing and c.is_free and feed(c, ids(tokenizer, "The answer."))


def test_a_block_the_model_closes_in_time_is_left_alone(tokenizer):
    c = ThinkingBudget(tokenizer, 10, starts_in_reasoning=True)
    assert feed(c, ids(tokenizer, "short</think>\n\nDone"))
    assert not c.is_forcing and not c.is_thinking and c.num_thinking_tokens < 10


def test_budget_zero_closes_an_open_block_at_once(tokenizer):
    c = ThinkingBudget(tokenizer, 0, starts_in_reasoning=True)
    assert c.is_forcing and not c.allows(ids(tokenizer, "x")[0])
    late = ThinkingBudget(tokenizer, 0)
    late.push(tokenizer.token_id("<think>"))
    assert late.is_forcing


@pytest.mark.parametrize("starts_in_reasoning", [False, True])
def test_a_grammar_that_holds_the_block_is_left_to_hold_it(tokenizer, starts_in_reasoning):
    """A grammar with token items holds the whole output, `<think>` block included: forcing
    the close (its newline here) would take the output out of the grammar's language."""
    grammar = 'root ::= <think> [a-z ]* </think> "ok"'
    inner = TextConstraint(tokenizer, tokenizer.stop_ids,
                           compile_grammar(grammar).bound(tokenizer).recognizer(),
                           starts_in_reasoning=starts_in_reasoning)
    c = ThinkingBudget(tokenizer, 0 if starts_in_reasoning else 2, inner,
                       starts_in_reasoning=starts_in_reasoning)
    assert not c.is_forcing
    assert feed(c, [tokenizer.token_id("<think>")] + ids(tokenizer, " a b c d"))
    assert not c.is_forcing and not c.allows(ids(tokenizer, "\n")[0])
    assert feed(c, [tokenizer.token_id("</think>")] + ids(tokenizer, "ok"))
    assert inner.is_done


def test_an_inner_constraint_sees_the_forced_close(tokenizer):
    json = JsonObjectConstraint(tokenizer, tokenizer.stop_ids, starts_in_reasoning=True)
    c = ThinkingBudget(tokenizer, 2, json, starts_in_reasoning=True)
    assert feed(c, ids(tokenizer, " x y") + ids(tokenizer, CLOSE.decode()))
    assert not json.think.is_thinking and not c.allows(ids(tokenizer, "hello")[0])
    assert feed(c, ids(tokenizer, '{"a": 1}')) and json.is_done


def test_random_draws_spell_the_close(tokenizer):
    """Sampled on random logits from inside an open block: after the budget every draw
    spells CLOSE, then the answer is free again."""
    V = tokenizer.vocab_size
    c = ThinkingBudget(tokenizer, 7, starts_in_reasoning=True)
    sampler = Sampler(SamplingParams(temperature=1.0, seed=4, thinking_budget=7), constraint=c)
    rng = np.random.default_rng(4)
    close = tokenizer.token_id("</think>")
    out = []
    for _ in range(30):
        logits = rng.standard_normal(V).astype(np.float32)
        logits[close] = -30.0  # the model would not close it itself
        out.append(sampler.sample(logits))
    text = b"".join(tokenizer.token_bytes(t) for t in out)
    assert text.index(CLOSE) >= 0 and c.num_thinking_tokens == 7
    assert b"".join(tokenizer.token_bytes(t) for t in out[:7]) + CLOSE == \
        text[:text.index(CLOSE) + len(CLOSE)]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_device_rows_give_the_host_rows_tokens(tokenizer, temperature):
    """On rows left on the device (HostLogitRow stands in) the budget takes the device's
    candidates while the block is open or closed, the whole row only while it spells the
    close; the tokens equal the host path's."""
    V = tokenizer.vocab_size
    params = SamplingParams(temperature=temperature, top_k=40, seed=9, thinking_budget=4)

    def sampler():
        return Sampler(params, constraint=ThinkingBudget(tokenizer, 4, starts_in_reasoning=True))
    on_device, on_host = sampler(), sampler()
    rng = np.random.default_rng(9)
    whole = []
    for step in range(16):
        logits = rng.standard_normal(V).astype(np.float32)
        row = HostLogitRow(logits, with_greedy_id=True)
        forcing = on_device.constraint.is_forcing
        assert on_device.sample_candidates(row, V) == on_host.sample(logits)
        whole.append(row.num_whole_copies > 0)
        assert whole[-1] == forcing, step
    assert any(whole) and not all(whole)


def test_the_engine_closes_the_block(tiny_model_path):
    from strata.config import EngineConfig
    from strata.engine.engine import Engine

    with Engine(EngineConfig(tiny_model_path, n_ctx=256, threads=1)) as engine:
        prompt = engine.tokenize("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
                                 "<think>\n", add_special=False)
        close = engine.tokenizer.token_id("</think>")
        params = dict(temperature=0, max_tokens=24, ignore_eos=True, logit_bias={close: -100})
        free = collect(engine.generate(prompt, SamplingParams(**params)))
        engine.reset()
        held = collect(engine.generate(prompt, SamplingParams(thinking_budget=6, **params)))
    assert "</think>" not in free.text
    reasoning_ids = held.token_ids[:6]
    assert held.token_ids[:6] == free.token_ids[:6]
    reasoning, content = parse_complete(held.text, starts_in_reasoning=True)[1::-1][:2]
    assert reasoning == engine.detokenize(reasoning_ids, skip_special=True).strip()
    assert "\n</think>\n\n" in held.text and content


def test_the_budget_is_checked():
    with pytest.raises(RequestError, match="thinking_budget"):
        SamplingParams(thinking_budget=-1)


def test_the_forced_close_is_its_one_token(tokenizer):
    """At the budget `</think>` is forced as the vocabulary's one token, never spelled in
    pieces (`<`, `</`, ...): the inner constraint knows the close by that token only."""
    json = JsonObjectConstraint(tokenizer, tokenizer.stop_ids, starts_in_reasoning=True)
    c = ThinkingBudget(tokenizer, 1, json, starts_in_reasoning=True)
    assert feed(c, ids(tokenizer, " x") + ids(tokenizer, "\n"))
    close = tokenizer.token_id("</think>")
    pieces = [t for t in range(tokenizer.vocab_size) if t != close
              and tokenizer.token_bytes(t) and c.forced.startswith(tokenizer.token_bytes(t))]
    assert pieces  # "<", "</": bytes of the close, but not all of it
    assert not any(c.allows(t) for t in pieces) and c.allows(close)
    c.push(close)
    assert not json.think.is_thinking and c.allows(ids(tokenizer, "\n\n")[0])


def test_a_json_answer_after_the_forced_close(tiny_model_path):
    """json_object with a budget, sampled: the answer after the forced close is the object
    (the close spelled in pieces left the JSON constraint inside the block: free text)."""
    from strata.config import EngineConfig
    from strata.engine.engine import Engine

    with Engine(EngineConfig(tiny_model_path, n_ctx=256, threads=1)) as engine:
        prompt = engine.tokenize("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
                                 "<think>\n", add_special=False)
        for seed, budget in [(4, 2), (0, 5), (9, 5)]:
            held = collect(engine.generate(prompt, SamplingParams(
                max_tokens=40, temperature=1.0, seed=seed, thinking_budget=budget,
                json_object=True)))
            assert engine.tokenizer.token_id("</think>") in held.token_ids
            answer = held.text.split("\n</think>\n\n", 1)[1]
            assert answer.lstrip().startswith("{"), (seed, budget, held.text)
