"""Coding-agent workloads: more conversations than slots, sharing a system prompt, taking turns
in a seeded random order (sometimes two at once). Every answer equals a fresh engine's, and each
turn reuses what a user expects: its whole previous turn while that is in a slot or parked."""
from __future__ import annotations

import logging

import numpy as np
import pytest

from strata import Engine, EngineConfig, SamplingParams
from strata.engine.generate import collect
from strata.engine.slots import common_prefix_len

GREEDY = dict(temperature=0.0, ignore_eos=True)
PARAMS = SamplingParams(max_tokens=4, **GREEDY)


def new_engine(path, parallel=2, **options) -> Engine:
    return Engine(EngineConfig(path, n_ctx=1024, threads=2, parallel=parallel, **options))


def words(rng, n: int) -> list[int]:
    return [int(t) for t in rng.integers(10, 4000, n)]


def run_turns(engine: Engine, prompts: list[list[int]]):
    """Submit `prompts` together, step until all finished: [(answer, cached tokens), ...]."""
    handles = [engine.submit(p, PARAMS) for p in prompts]
    answers = [[] for _ in handles]
    while not all(h.is_finished for h in handles):
        assert engine.step()
        for out, h in zip(answers, handles):
            out += [e.token_id for e in h.pop_events()]
    for h in handles:
        assert h.error is None
    return [(a, h.stats.num_cached_tokens) for a, h in zip(answers, handles)]


@pytest.fixture(scope="module")
def fresh(tiny_model_path):
    """A fresh engine's greedy answer to a prompt (nothing cached)."""
    answers = {}
    with new_engine(tiny_model_path, parallel=1) as engine:
        def answer(prompt: list[int]) -> list[int]:
            if tuple(prompt) not in answers:
                engine.reset()
                res = collect(engine.generate(prompt, PARAMS))
                assert res.stats.num_cached_tokens == 0
                answers[tuple(prompt)] = res.token_ids
            return answers[tuple(prompt)]

        yield answer


def test_a_parked_conversation_that_lends_its_system_prompt_stays_parked(tiny_model_path,
                                                                         fresh, caplog):
    """Conversation A is parked; B's first turn shares only the system prompt with it and
    restores that prefix from A's entry. A's entry must stay: A's next turn reuses all of A."""
    caplog.set_level(logging.INFO, logger="strata.engine")
    rng = np.random.default_rng(3)
    system = words(rng, 40)
    a1, b1, other = system + words(rng, 12), system + words(rng, 9), words(rng, 20)
    with new_engine(tiny_model_path, parallel=1) as engine:
        [(ra, _)] = run_turns(engine, [a1])
        run_turns(engine, [other])  # parks A
        [(rb, cached_b)] = run_turns(engine, [b1])  # the system prompt from A's entry
        assert cached_b == len(system)
        a2 = a1 + ra + words(rng, 7)
        [(ra2, cached_a2)] = run_turns(engine, [a2])
        assert cached_a2 == len(a1) + len(ra) - 1
    assert (ra2, rb) == (fresh(a2), fresh(b1))


def test_a_new_conversation_takes_an_empty_slot_not_anothers(tiny_model_path, fresh,
                                                             monkeypatch, caplog):
    """Two agents with one system prompt, two slots: B's first turn goes to the empty slot
    (the system prompt copied from A's idle slot) instead of cutting A's conversation, which
    a device KV (min_copy_gain 0.25, set here on the host KV) would not even park."""
    from strata.engine.kv import KVCache

    monkeypatch.setattr(KVCache, "min_copy_gain", 0.25)
    caplog.set_level(logging.INFO, logger="strata.engine")
    rng = np.random.default_rng(4)
    system = words(rng, 40)
    a1, b1 = system + words(rng, 48), system + words(rng, 6)  # A would lose more than B keeps
    with new_engine(tiny_model_path, parallel=2) as engine:
        [(ra, _)] = run_turns(engine, [a1])
        [(rb, cached_b)] = run_turns(engine, [b1])
        assert cached_b == len(system)
        assert "request 2: slot 1 copied the first 40 cells of idle slot 0's KV" in caplog.text
        a2 = a1 + ra + words(rng, 5)
        [(ra2, cached_a2)] = run_turns(engine, [a2])
        assert cached_a2 == len(a1) + len(ra) - 1
        assert engine.scheduler.conversations.num_parked == 0  # nothing displaced
    assert (rb, ra2) == (fresh(b1), fresh(a2))


def random_agents(engine, rng, num_agents: int, num_turns: int, system: list[int]):
    """Agents sharing `system` take turns in a seeded random order, sometimes two at once;
    yield (prompt, answer, cached tokens, the most a cache could give) per turn."""
    prompts = {a: system + words(rng, int(rng.integers(5, 20))) for a in range(num_agents)}
    in_kv: dict[int, list[int]] = {}  # what each agent's last finished turn left in a KV
    for _ in range(num_turns):
        agents = [int(a) for a in rng.choice(num_agents, 1 + (rng.random() < 0.3), False)]
        best = [max((min(common_prefix_len(kv, prompts[a]), len(prompts[a]) - 1)
                     for kv in in_kv.values()), default=0) for a in agents]
        for a, (answer, cached), most in zip(agents, run_turns(
                engine, [prompts[a] for a in agents]), best):
            yield prompts[a], answer, cached, most
            in_kv[a] = prompts[a] + answer[:-1]  # the last answer token is never read back
            prompts[a] = prompts[a] + answer + words(rng, int(rng.integers(5, 20)))


def test_five_agents_in_two_slots_reuse_every_previous_turn(tiny_model_path, fresh):
    rng = np.random.default_rng(5)
    with new_engine(tiny_model_path, parallel=2) as engine:
        turns = list(random_agents(engine, rng, 5, 16, words(rng, 40)))
    for prompt, answer, cached, most in turns:
        assert cached == most
        assert answer == fresh(prompt)


def test_a_hybrid_slot_is_picked_by_what_it_can_keep(hybrid_path, caplog):
    """Qwen3-Next: slot 0 shares 30 tokens with the prompt but has no recurrent state there
    (its checkpoint is at 39); slot 1 shares 10 and has one at 9. The picker ranks the slots
    by what their reuse points let the prompt keep: slot 1, 9 tokens (not slot 0, cut to 0)."""
    caplog.set_level(logging.INFO, logger="strata.engine")
    rng = np.random.default_rng(6)
    base = words(rng, 30)
    a, b, q = base + words(rng, 10), base[:10], base + words(rng, 5)
    with Engine(EngineConfig(hybrid_path, n_ctx=160, threads=2, parallel=2)) as engine:
        run_turns(engine, [a, b])
        assert [s.reuse_points for s in engine.scheduler.table.views(
            [kv.reuse_points() for kv in engine.scheduler.kvs])] == [(39, 43), (9, 13)]
        [(answer, cached)] = run_turns(engine, [q])
        assert cached == 9
        assert "slot 1 kept its KV (9 tokens reused)" in caplog.text
    with Engine(EngineConfig(hybrid_path, n_ctx=160, threads=2)) as alone:
        assert collect(alone.generate(q, PARAMS)).token_ids == answer


def test_a_next_turn_that_drops_the_last_answer_keeps_its_slot(tiny_model_path, fresh,
                                                               caplog):
    """The same conversation's next turn re-rendered without its last answer's tokens (a
    template that drops the reasoning): the slot keeps far more than it loses, so it stays
    there (no copy of the long prefix into the empty slot, no second copy of the conversation
    left behind)."""
    caplog.set_level(logging.INFO, logger="strata.engine")
    rng = np.random.default_rng(6)
    a1 = words(rng, 60)
    with new_engine(tiny_model_path, parallel=2) as engine:
        run_turns(engine, [a1])
        a2 = a1 + words(rng, 7)  # not the answer: it was re-rendered
        [(ra2, cached)] = run_turns(engine, [a2])
        assert cached == len(a1)
        assert "copied the first" not in caplog.text
        assert engine.scheduler.table.tokens(1) == []  # the other slot still empty
    assert ra2 == fresh(a2)
