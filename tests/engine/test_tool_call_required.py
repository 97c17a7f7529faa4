"""A required tool call (engine/tool_call_required.py): the answer opens with a `<tool_call>`
block (after a <think> block and a little whitespace), the stop tokens come only after a call,
and from the first call on the base constraint holds."""
from __future__ import annotations

import numpy as np
import pytest

from strata.engine.generate import collect
from strata.engine.sampling import Sampler, SamplingParams
from strata.engine.tool_call_required import MAX_LEAD, RequiredToolCallConstraint
from strata.errors import RequestError
from strata.server.output_parser import parse_complete

from test_tool_call_constraint import WEATHER, feed, ids

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tiny_engine(tiny_model_path):
    from strata.config import EngineConfig
    from strata.engine.engine import Engine

    with Engine(EngineConfig(tiny_model_path, n_ctx=256, threads=1)) as engine:
        yield engine


def constraint(tokenizer, **kwargs):
    return RequiredToolCallConstraint(tokenizer, [WEATHER], tokenizer.stop_ids, **kwargs)


def test_the_answer_opens_with_a_call_then_is_free(tokenizer):
    c = constraint(tokenizer)
    stop = sorted(tokenizer.stop_ids)[0]
    assert c.is_leading and not c.is_free and not c.allows(stop)
    assert not c.allows(ids(tokenizer, "Sure")[0])
    assert feed(c, ids(tokenizer, "\n\n" + CALL))
    assert not c.is_leading and c.num_closed == 1 and c.allows(stop)
    assert feed(c, ids(tokenizer, " Anything now."))


@pytest.mark.parametrize("text", ["Let me check. " + CALL, " " * (MAX_LEAD + 1) + CALL,
                                  "<tool_call>\nnot json", '<tool_call>{"name": "other"'])
def test_refused_openings(tokenizer, text):
    assert not feed(constraint(tokenizer), ids(tokenizer, text))


def test_a_think_block_may_come_first(tokenizer):
    c = constraint(tokenizer)
    think = tokenizer.token_id("<think>")
    assert c.allows(think)
    c.push(think)
    stop = sorted(tokenizer.stop_ids)[0]
    assert c.think.is_thinking and not c.allows(stop)
    assert feed(c, ids(tokenizer, "I should call it, not chat.</think>\n\n" + CALL))
    assert c.num_closed == 1
    later = constraint(tokenizer)
    assert feed(later, ids(tokenizer, " ")) and not later.allows(think)  # only first
    opened = constraint(tokenizer, starts_in_reasoning=True)  # the prompt opened it
    assert feed(opened, ids(tokenizer, "hmm</think>" + CALL))


@pytest.mark.parametrize("lead", ["", "\n", "<tool", "<tool_call>\n{\"na", "<think>x"])
def test_candidates_hold_every_allowed_token(tokenizer, lead):
    c = constraint(tokenizer)
    assert feed(c, ids(tokenizer, lead))
    allowed = {t for t in range(tokenizer.vocab_size) if c.allows(t)}
    assert allowed and allowed <= set(c.candidates().tolist())


def test_random_draws_always_open_with_a_call(tokenizer):
    """Sampled on random logits (no <think>), every answer opens with a whole call."""
    V = tokenizer.vocab_size
    for seed in range(3):
        c = constraint(tokenizer)
        sampler = Sampler(SamplingParams(temperature=1.0, seed=seed, held_tool_calls=[WEATHER],
                                         tool_call_required=True), constraint=c)
        rng = np.random.default_rng(seed)
        out = []
        for _ in range(300):
            logits = rng.standard_normal(V).astype(np.float32)
            for closer in ("}", '"'):  # so the call closes within the budget
                logits[ids(tokenizer, closer)[0]] += 3
            logits[tokenizer.token_id("<think>")] = -np.inf  # a think block could go on
            out.append(sampler.sample(logits))  # the sampler pushes it
            if c.num_closed:
                break
        text = tokenizer.decode(out)
        assert text.lstrip().startswith("<tool_call>") and c.num_closed == 1, text
        _, _, calls, _ = parse_complete(text, parse_tools=True)
        assert [c.name for c in calls] == ["get_weather"]


def test_the_engine_answers_with_a_call(tiny_engine):
    """Greedy on the tiny model: without the requirement the output holds no call; with it,
    the same prompt answers with one."""
    prompt = tiny_engine.tokenize("Weather in Oslo?")
    bias = {tiny_engine.tokenizer.token_id("}"): 4, tiny_engine.tokenizer.token_id('"'): 4}
    base = dict(temperature=0, max_tokens=80, held_tool_calls=[WEATHER], logit_bias=bias)
    tiny_engine.reset()
    free = collect(tiny_engine.generate(prompt, SamplingParams(**base)))
    assert "<tool_call>" not in free.text
    tiny_engine.reset()
    held = collect(tiny_engine.generate(prompt, SamplingParams(tool_call_required=True, **base)))
    _, _, calls, _ = parse_complete(held.text, parse_tools=True)
    assert held.text.lstrip().startswith("<tool_call>") and calls
    assert calls[0].name == "get_weather"


def test_it_needs_the_functions():
    with pytest.raises(RequestError, match="need held_tool_calls"):
        SamplingParams(tool_call_required=True)
