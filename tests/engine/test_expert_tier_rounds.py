"""Tier rounds with a scripted policy: exact slots and residency after each round (free slots
lowest first, evictions in place), faulty swaps skipped, the counts the policy sees, and an async
round that waits out a pinned reader while the next round is skipped."""
from __future__ import annotations

import logging
import time

import numpy as np
import pytest

from strata.backends.cpu import CpuModel
from strata.backends.window import Window
from strata.config import EngineConfig
from strata.engine.expert_tier import ExpertTier
from strata.experts.tier import FREE_SLOT
from strata.hookspecs import ExpertSwap
from strata.model.gguf_file import GGUFModel

pytestmark = pytest.mark.usefixtures("one_kernel_thread")

N_LAYERS, N_EXPERTS = 2, 8


class ScriptedPolicy:
    """A tier policy that returns the next scripted list of swaps each round and keeps what it
    was shown."""

    name = "scripted"

    def __init__(self, rounds):
        self.rounds = list(rounds)
        self.seen = []

    def plan_swaps(self, counts, residency, min_gain):
        self.seen.append((counts.copy(), residency.copy(), min_gain))
        return self.rounds.pop(0) if self.rounds else []


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    from strata.tool.synth import synth_model

    path = tmp_path_factory.mktemp("rounds") / "tiny.gguf"
    synth_model(path, shape="tiny", weight_type="f32", seed=8)
    return path


def make_tier(model_path, gguf, policy, **options):
    model = CpuModel(gguf)
    config = EngineConfig(model_path, **options)
    tier = ExpertTier.build(config, gguf, model)
    tier.start(policy)
    return tier, model.new_kv(256)


def run_window(tier, kv, tokens=(11, 12, 13)):
    return tier.forward_window(Window.build([(kv, np.array(tokens))]))


def owners(tier):
    table = tier.arena.table
    return [table.slot_owner(s) for s in range(table.n_slots)]


def test_rounds_apply_the_swaps_exactly(model_path, caplog):
    policy = ScriptedPolicy([
        [ExpertSwap(1, 5, FREE_SLOT, FREE_SLOT), ExpertSwap(1, 7, 0, 1)],
        [ExpertSwap(0, 2, FREE_SLOT, FREE_SLOT)],  # into slot 3, the last free one
        [ExpertSwap(0, 0, 1, 5), ExpertSwap(0, 4, 1, 1)],  # (0, 0) resident; (1, 1) missing
        [ExpertSwap(0, 3, 1, 7), ExpertSwap(0, 6, 1, 7)],  # the second evicts (1, 7) again
    ])
    with GGUFModel.open(model_path) as gguf:
        # 4 slots, 2 filled at start-up in layer order: (0, 0) in slot 0, (0, 1) in slot 1.
        tier, kv = make_tier(model_path, gguf, policy, expert_cache=4, adapt_every=2,
                             adapt_async=False, adapt_min_gain=1.5)
        assert owners(tier) == [(0, 0), (0, 1), (0, 2), (0, 3)]
        # Free two slots through the ordered path to give the free-slot swaps room.
        for slot in (3, 2):
            ticket = tier.arena.table.begin_evict(slot)
            assert ticket.evicted == (0, slot)
            tier.arena.table.abort(slot)
        assert owners(tier) == [(0, 0), (0, 1), None, None]
        counts_seen = []
        for _ in range(2):
            run_window(tier, kv)
            counts_seen.append(tier._counts.copy())
        assert owners(tier) == [(0, 0), (1, 7), (1, 5), None]  # (0, 1) evicted in place
        assert tier.last_window.num_swaps == 2
        counts, residency, min_gain = policy.seen[0]
        assert np.array_equal(counts, counts_seen[0] + counts_seen[1])
        assert residency[0, 0] == 0 and residency[0, 1] == 1 and (residency >= 0).sum() == 2
        assert min_gain == 1.5
        with caplog.at_level(logging.WARNING, logger="strata.tier"):
            for _ in range(2):
                run_window(tier, kv)
            assert owners(tier) == [(0, 0), (1, 7), (1, 5), (0, 2)]  # slot 3 was still free
            for _ in range(2):
                run_window(tier, kv)
            assert owners(tier) == [(0, 0), (1, 7), (1, 5), (0, 2)]  # both swaps faulty
            for _ in range(2):
                run_window(tier, kv)
        assert owners(tier) == [(0, 0), (0, 3), (1, 5), (0, 2)]
        assert sum("'scripted' returned 2 swaps that cannot be applied" in r.message
                   for r in caplog.records) == 1
        assert sum("returned 1 swaps" in r.message for r in caplog.records) == 1
        totals = tier.snapshot_totals()
        assert (totals.num_rounds, totals.num_fills, totals.num_evictions) == (4, 2, 2)
        assert totals.num_bytes_moved == 4 * tier.store.layer_expert_nbytes(0)
        expected = np.full((N_LAYERS, N_EXPERTS), -1)
        for slot, (layer, expert) in enumerate(owners(tier)):
            expected[layer, expert] = slot
        assert np.array_equal(tier.arena.table.peek().table, expected)
        tier.close()


def test_async_round_waits_for_a_pinned_reader_and_the_next_round_is_skipped(model_path):
    policy = ScriptedPolicy([[ExpertSwap(1, 4, 0, 0)], [ExpertSwap(1, 6, 0, 1)]])
    with GGUFModel.open(model_path) as gguf:
        tier, kv = make_tier(model_path, gguf, policy, expert_cache=2, adapt_every=1,
                             adapt_async=True)
        reference = CpuModel(gguf)
        ref_kv = reference.new_kv(256)
        assert owners(tier) == [(0, 0), (0, 1)]
        held = tier.arena.table.snapshot()  # a reader of the start-up version
        try:
            assert np.array_equal(run_window(tier, kv), reference.forward(np.array(
                [11, 12, 13]), ref_kv))
            # Round 1 started: slot 0 was published missing, its copy waits for `held`.
            deadline = time.monotonic() + 30
            while not tier.arena.table.is_claimed(0) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert not tier.wait_idle(0.05)
            assert owners(tier) == [None, (0, 1)] and tier.arena.table.is_claimed(0)
            assert held.slot_of(0, 0) == 0  # the reader still sees (0, 0) there, unchanged
            for token in (14, 15):
                assert np.array_equal(run_window(tier, kv, (token,)),
                                      reference.forward(np.array([token]), ref_kv))
            totals = tier.snapshot_totals()
            assert (totals.num_rounds, totals.num_rounds_skipped) == (1, 2)
            assert tier.last_window.num_swaps == 0
        finally:
            held.release()
        assert tier.wait_idle(30)
        assert owners(tier) == [(1, 4), (0, 1)]
        run_window(tier, kv, (16,))  # round 2 sees the counts of the skipped rounds too
        assert tier.wait_idle(30)
        assert owners(tier) == [(1, 4), (1, 6)]
        counts, _, _ = policy.seen[1]
        assert int(counts.sum()) == 3 * 2 * N_LAYERS  # windows 2, 3 and 4: one row, top-2
        tier.close()


class FailingPolicy:
    name = "failing"

    def plan_swaps(self, counts, residency, min_gain):
        raise RuntimeError("policy bug")


def test_a_failing_policy_costs_its_round_not_the_window(model_path, caplog):
    with GGUFModel.open(model_path) as gguf:
        tier, kv = make_tier(model_path, gguf, FailingPolicy(), expert_cache=2, adapt_every=1,
                             adapt_async=False)
        reference = CpuModel(gguf)
        with caplog.at_level(logging.ERROR, logger="strata.tier"):
            logits = run_window(tier, kv)
        assert np.array_equal(logits, reference.forward(np.array([11, 12, 13]),
                                                        reference.new_kv(256)))
        assert "tier policy 'failing' failed; no swaps this round" in caplog.text
        assert owners(tier) == [(0, 0), (0, 1)]
        assert tier.snapshot_totals().num_rounds == 1
        tier.close()


@pytest.mark.parametrize("answer", [
    None,                                            # not a list of swaps
    [ExpertSwap(N_LAYERS, 0, FREE_SLOT, FREE_SLOT)],  # a layer out of range
    [ExpertSwap(0, -1, 0, 0)],                       # negative: numpy would wrap to expert 7
    [ExpertSwap(1, 2, 0, N_EXPERTS)],                # an eviction out of range
    [(1, 2.0, FREE_SLOT, FREE_SLOT)],                # not integers
    [(1, 2)],                                        # not a swap
    [None],
])
def test_malformed_swaps_cost_their_round_not_the_window(model_path, caplog, answer):
    """A plugin's bad answer is skipped with a warning naming it; the window's logits and the
    residency are what they were (it raised IndexError / TypeError out of the window before)."""
    with GGUFModel.open(model_path) as gguf:
        tier, kv = make_tier(model_path, gguf, ScriptedPolicy([answer]), expert_cache=3,
                             adapt_every=1, adapt_async=False)
        reference = CpuModel(gguf)
        with caplog.at_level(logging.WARNING, logger="strata.tier"):
            logits = run_window(tier, kv)
        assert np.array_equal(logits, reference.forward(np.array([11, 12, 13]),
                                                        reference.new_kv(256)))
        assert "'scripted'" in caplog.text and "fix the plugin" in caplog.text
        assert owners(tier) == [(0, 0), (0, 1), (0, 2)]
        assert tier.snapshot_totals().num_evictions == 0
        tier.close()


def test_plain_tuples_of_integers_are_swaps(model_path):
    with GGUFModel.open(model_path) as gguf:
        tier, kv = make_tier(model_path, gguf,
                             ScriptedPolicy([[(1, np.int64(6), 0, 1)]]), expert_cache=3,
                             adapt_every=1, adapt_async=False)
        run_window(tier, kv)
        assert owners(tier) == [(0, 0), (1, 6), (0, 2)]
        tier.close()


def test_a_policy_failing_every_round_is_logged_once_then_now_and_then(model_path, caplog,
                                                                       monkeypatch):
    """Its traceback and an ERROR every 2 rounds here (POLICY_FAILURE_REPEAT), not a traceback
    a round: with --adapt-every 1 that buried the log."""
    import strata.engine.expert_tier as expert_tier

    monkeypatch.setattr(expert_tier, "POLICY_FAILURE_REPEAT", 2)
    with GGUFModel.open(model_path) as gguf:
        tier, kv = make_tier(model_path, gguf, FailingPolicy(), expert_cache=2, adapt_every=1,
                             adapt_async=False)
        with caplog.at_level(logging.WARNING, logger="strata.tier"):
            for _ in range(5):
                kv.truncate(0)
                run_window(tier, kv)
        errors = [r for r in caplog.records if "tier policy 'failing' failed" in r.message]
        assert tier.snapshot_totals().num_rounds == 5
        assert [r.exc_info is not None for r in errors] == [True, False, False]
        assert "(4 failures so far)" in errors[-1].message
        tier.close()
