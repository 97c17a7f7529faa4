"""Speculative decoding (--spec-type ngram-simple) with what else a request asks for: the
drafter's cost at a large --draft-max, and drafted runs against the same requests decoded one
token per window (logprobs, constraints, a thinking budget, stops, the next turn's reuse)."""
from __future__ import annotations

import numpy as np
import pytest

from strata.engine import drafts
from strata.engine.drafts import NgramDrafter, best_length


class CountedCalls:
    """expected_tokens itself, counting its calls and refusing more than `most`."""

    def __init__(self, most: int):
        self.real, self.most, self.num_calls = drafts.expected_tokens, most, 0

    def __call__(self, rate, length):
        self.num_calls += 1
        if self.num_calls > self.most:
            raise AssertionError(f"more than {self.most} lengths weighed")
        return self.real(rate, length)


@pytest.mark.parametrize("draft_max", [16, 10**12])
def test_a_huge_draft_max_costs_only_the_lengths_it_could_use(monkeypatch, draft_max):
    """The length rule weighs lengths up to the best one and the room left, not every length
    up to --draft-max (which every decode window of every slot asked: a --draft-max of 10^9
    froze the engine)."""
    counted = CountedCalls(most=101)  # lengths 1..100 and the fall after the best

    def propose(drafter, limit):
        counted.num_calls = 0
        return drafter.propose(limit)
    monkeypatch.setattr(drafts, "expected_tokens", counted)
    drafter = NgramDrafter([1, 2, 3, 4] * 10, 2, draft_max=draft_max)
    assert len(propose(drafter, 10**12)) == 1  # acceptance 0.5: one token
    for _ in range(8):  # whole drafts accepted: the drafts grow
        n = len(propose(drafter, 100))
        drafter.observe(n, n)
    assert 6 <= len(propose(drafter, 100)) <= 100
    assert len(propose(drafter, 40)) <= 40
    counted.num_calls = 0
    assert best_length(0.5, draft_max) == 1 and best_length(1.0, draft_max) == draft_max


def test_a_long_prompt_is_indexed_as_a_short_one():
    """A prompt of thousands of tokens (indexed in one go, in numpy) gives the guesses of the
    same tokens indexed a few at a time, and of a brute-force search."""
    from test_drafts import reference_guess

    rng = np.random.default_rng(0)
    seq = rng.integers(0, 6, 3000).tolist()  # few distinct ids: keys recur
    for n in (1, 3, 12):
        whole = NgramDrafter(seq, n, draft_max=16)
        stepped = NgramDrafter(seq[:5], n, draft_max=16)
        for i in range(5, len(seq), 7):
            stepped.extend(seq[i:i + 7])
        assert whole._ends == stepped._ends
        for cut in (n, 1000, 2999):
            head = NgramDrafter(seq[:cut], n, draft_max=16)
            assert head.guess(9) == reference_guess(seq[:cut], n, 9)


def test_a_long_key_keeps_the_index_small():
    """The index holds one number per key, not the key's tokens: a key of 2048 tokens over a
    prompt of 18k tokens took 2048 references per token (270 MB)."""
    import tracemalloc

    first = np.random.default_rng(1).integers(0, 50, 16000).tolist()
    tracemalloc.start()
    try:
        drafter = NgramDrafter(first + first[:2500], 2048, draft_max=16)
        drafter.extend(first[2500:2600])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 40 * 2**20, peak
    assert drafter.guess(4) == first[2600:2604]  # the key recurs


class SoftLoop:
    """The real CPU model, its logits nudged (by `bias`) towards a loop of tokens: drafts are
    often, not always, what the sampler draws. The KV and every pass are the real model's."""

    LOOP = [40, 41, 42, 43, 44, 45]

    def __init__(self, model, bias: float):
        self.model, self.bias = model, bias

    def __getattr__(self, name):
        return getattr(self.model, name)

    def forward_window(self, window, **kwargs):
        logits = np.array(self.model.forward_window(window, **kwargs))
        for j, row in enumerate(window.logit_rows):
            token = int(window.tokens[row])
            loop = self.LOOP
            logits[j, loop[(loop.index(token) + 1) % 6] if token in loop else loop[0]] += \
                self.bias
        return logits


def two_turns(path, spec: str, prompts, params) -> list:
    """Every request's events (id, text, finish, logprob) and reused tokens, then a second turn
    of each conversation (greedy), all in one engine of 2 slots with prompt chunks of 8."""
    from strata import Engine, EngineConfig, SamplingParams

    out = []
    with Engine(EngineConfig(path, n_ctx=160, threads=2, parallel=2, prompt_chunk_tokens=8,
                             spec_type=spec, spec_ngram_size_n=2)) as engine:
        engine.scheduler.model = SoftLoop(engine.model, 6.0)
        for _ in range(2):
            handles = [engine.submit(p, sp) for p, sp in zip(prompts, params)]
            while not all(h.is_finished for h in handles):
                engine.step()
            prompts = []
            for h in handles:
                events = h.pop_events()
                assert h.error is None, h.error
                out.append(([(e.token_id, e.text, e.finish_reason, e.logprob) for e in events],
                            h.stats.num_cached_tokens))
                prompts.append(h.prompt_tokens + [e.token_id for e in events] + [9, 8])
            params = [SamplingParams(max_tokens=12, temperature=0.0, logprobs=2)] * len(prompts)
        drafted = sum(h.stats.num_accepted_draft_tokens for h in handles)
    return out, drafted


def test_drafted_requests_of_every_kind_equal_undrafted_ones(tiny_model_path):
    """Drafts on and off give the same events (tokens, text, finish, logprobs) for greedy and
    seeded requests with logprobs, stop strings inside looping stretches, a grammar, a JSON
    schema, a thinking budget and a required tool call; and the conversations' next turns
    (the cells of rejected drafts left behind would change them) reuse and say the same."""
    from strata import SamplingParams

    weather = {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
    think = [4092]  # <think>: the answer starts in reasoning
    prompts = [[5, 6, 7], [1, 2, 3, 4] + think, [40, 41, 42], [9, 9, 9, 9, 9] * 3,
               [11, 12] + think, [5, 40]]
    params = [
        SamplingParams(max_tokens=40, temperature=0.0, logprobs=3, stop=["MNIJK"]),
        SamplingParams(max_tokens=30, temperature=0.9, seed=3, thinking_budget=6,
                       json_object=True, logprobs=1),
        SamplingParams(max_tokens=30, temperature=0.8, seed=2, top_p=0.9,
                       grammar='root ::= ("IJ" | "KL" | "MN" | [0-9])+ "."'),
        SamplingParams(max_tokens=30, temperature=0.7, seed=5, json_object=True,
                       json_schema={"type": "object", "properties": {
                           "a": {"type": "array", "items": {"type": "integer"}}}}),
        SamplingParams(max_tokens=30, temperature=0.0, thinking_budget=4, ignore_eos=True,
                       held_tool_calls=[weather], tool_call_required=True),
        SamplingParams(max_tokens=35, temperature=1.0, seed=7, stop=["KLMN"],
                       repetition_penalty=1.1, logprobs=0),
    ]
    plain, _ = two_turns(tiny_model_path, "none", prompts, params)
    drafted, num_accepted = two_turns(tiny_model_path, "ngram-simple", prompts, params)
    assert num_accepted > 0
    assert drafted == plain
