"""Replay: exact hits on hand-made traces for every policy, the per-window observe hook and free
admission; Belady and the round oracle bound the others on random traces."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from routing_helpers import make_trace

from strata.errors import ConfigError
from strata.experts.profile import build_profile
from strata.experts.replay import (replay_all, replay_belady, replay_lfu, replay_lru,
                                   replay_round_oracle, replay_static, replay_tier)
from strata.experts.tier import DecayedCountTier
from strata.experts.tier_window import WindowScoreTier
from strata.hookspecs import ExpertSwap


def _one_layer(experts_per_window, n_experts=4):
    return make_trace(1, n_experts, [[[e]] for e in experts_per_window])


SEQUENCE = [0, 1, 0, 2, 0, 1, 3, 1]  # one expert per window, one layer


def _hits_loads(result):
    return result.num_hits, result.num_loads


def test_lru_exact():
    # 0 1 0(hit) 2(evicts 1) 0(hit) 1(evicts 2) 3(evicts 0) 1(hit)
    assert _hits_loads(replay_lru(_one_layer(SEQUENCE), 2)) == (3, 5)


def test_lfu_exact():
    # 0 1 0(hit) 2(evicts 1: 1 use) 0(hit) 1(evicts 2) 3(evicts 1: 2 uses < 3) 1(evicts 3)
    assert _hits_loads(replay_lfu(_one_layer(SEQUENCE), 2)) == (2, 6)


def test_belady_exact():
    # Loads 0 and 1 and keeps them; 2 and 3 are never needed again: bypassed.
    assert _hits_loads(replay_belady(_one_layer(SEQUENCE), 2)) == (4, 2)
    # One slot: 0 (needed at 2, 4) beats 1 (needed at 5) until 0 is done, then 1 replaces it.
    assert _hits_loads(replay_belady(_one_layer(SEQUENCE), 1)) == (3, 2)


def test_static_exact():
    trace = _one_layer(SEQUENCE)
    assert _hits_loads(replay_static(trace, 2)) == (6, 2)  # 0 and 1 resident from the start
    profile = build_profile(_one_layer([2, 3, 3]))
    assert _hits_loads(replay_static(trace, 2, profile)) == (2, 2)  # 3 and 2 resident


def test_round_oracle_exact():
    trace = _one_layer(SEQUENCE)
    assert replay_round_oracle(trace, 1, adapt_every=2).num_hits == 4  # 1 per 2-window round
    assert replay_round_oracle(trace, 2, adapt_every=2).num_hits == 8
    assert replay_round_oracle(trace, 1, adapt_every=4).num_hits == 4  # 0 twice, then 1 twice


def test_tier_exact():
    trace = _one_layer(SEQUENCE)
    # Rounds after windows 1, 3, 5, 7 (decay 0.5, fast decay 0, fast weight 0.5, hysteresis
    # 0.5). Round 1: counts [1, 1, 0, 0] set both averages: load 0 and 1 into the free slots.
    # Windows 2-3 (0, 2): 1 hit. Round 2: slow [1, .5, .5, 0], fast [1, 0, 1, 0], scores
    # [1, .25, .75, 0]: 2 replaces 1 (gain .5 > .5 * .25). Windows 4-5 (0, 1): 1 hit.
    # Round 3: slow [1, .75, .25, 0], fast [1, 1, 0, 0], scores [1, .875, .125, 0]: 1 replaces
    # 2 (gain .75). Windows 6-7 (3, 1): 1 hit. Round 4: scores [.25, .9375, .0625, .75]:
    # 3 replaces 0 (gain .5 > .125). 3 hits, 2 + 3 loads.
    result = replay_tier(trace, 2, DecayedCountTier(2, decay=0.5), adapt_every=2)
    assert _hits_loads(result) == (3, 5)
    # Min gain 0.6 stops rounds 2 and 4 (gains .5 do not clear .6 + the margin): 0 and 1 stay,
    # windows 4-5 hit twice and window 7 once.
    result = replay_tier(trace, 2, DecayedCountTier(2, decay=0.5), adapt_every=2, min_gain=0.6)
    assert _hits_loads(result) == (4, 2)
    # Frequency only, no margin: round 2's scores [1, .5, .5, 0] tie 2 with 1; nothing moves.
    frequency_only = DecayedCountTier(2, decay=0.5, fast_weight=0.0, hysteresis=0.0)
    assert _hits_loads(replay_tier(trace, 2, frequency_only, adapt_every=2)) == (4, 2)


class RecordingPolicy:
    """Keeps what observe and plan_swaps were shown; swaps nothing."""

    name = "recording"

    def __init__(self):
        self.windows, self.rounds = [], []

    def observe(self, counts):
        self.windows.append(counts.tolist())

    def plan_swaps(self, counts, residency, min_gain):
        self.rounds.append((len(self.windows), counts.tolist()))
        return []


def test_observe_gets_every_windows_rows_before_the_round():
    trace = make_trace(1, 3, [[{0: 2}], [{1: 1, 2: 3}], [[0]], [{2: 4}]])
    policy = RecordingPolicy()
    replay_tier(trace, 2, policy, adapt_every=2)
    assert policy.windows == [[[2, 0, 0]], [[0, 1, 3]], [[1, 0, 0]], [[0, 0, 4]]]
    assert policy.rounds == [(2, [[2, 1, 3]]), (4, [[1, 0, 4]])]


def test_window_score_tier_exact():
    trace = _one_layer(SEQUENCE)
    # Rounds after windows 1, 3, 5, 7 (decay 0.5, recency weight 1, hysteresis 0.5). Round 1:
    # scores [.5, 1.5, 0, 0]: 1 then 0 into the free slots. Windows 2-3 (0, 2): 1 hit. Round 2:
    # scores [.375, .125, 1.5, 0]: 2 replaces 1 (gain 1.375). Windows 4-5 (0, 1): 1 hit.
    # Round 3: [.34375, 1.53125, .125, 0]: 1 replaces 2. Windows 6-7 (3, 1): 1 hit. Round 4:
    # [.0859375, 1.6328125, .03125, .25]: 3 replaces 0 (gain .1640625 > .5 * .0859375).
    result = replay_tier(trace, 2, WindowScoreTier(2, decay=0.5), adapt_every=2)
    assert (result.name, result.num_hits, result.num_loads, result.num_admissions) == (
        "window-score", 3, 5, 0)


def test_free_admission_exact():
    trace = _one_layer(SEQUENCE)
    # Every miss is kept: 0 and 1 take the free slots (windows 0, 1); 0 hits (2); 2 replaces 1
    # (.125 < .375, window 3); 0 hits (4); 1 replaces 2 (5); 3 replaces 0 (.17 < .27, 6);
    # 1 hits (7). No round finds a gain: 3 hits, no loads, 5 admissions.
    result = replay_tier(trace, 2, WindowScoreTier(2, decay=0.5), adapt_every=2,
                         free_admission=True)
    assert (result.name, result.num_hits, result.num_loads, result.num_admissions) == (
        "window-score+admit", 3, 0, 5)


class ScriptedAdmit(RecordingPolicy):
    name = "scripted-admit"

    def __init__(self, admissions):
        super().__init__()
        self.admissions = list(admissions)

    def admit(self, counts, residency):
        return self.admissions.pop(0) if self.admissions else []


def test_free_admission_refuses_what_the_window_did_not_read():
    trace = make_trace(1, 4, [[[0]], [[0, 1]]])
    with pytest.raises(ConfigError, match="admits \\(0, 3\\), which the window did not route"):
        replay_tier(trace, 2, ScriptedAdmit([[ExpertSwap(0, 3, -1, -1)]]), 1,
                    free_admission=True)
    keep_0_then_evict_it = ScriptedAdmit([[ExpertSwap(0, 0, -1, -1)], [ExpertSwap(0, 1, 0, 0)]])
    with pytest.raises(ConfigError, match="evicts \\(0, 0\\) on admission, but the window"):
        replay_tier(trace, 2, keep_0_then_evict_it, 1, free_admission=True)
    with pytest.raises(ConfigError, match="'recording' has no `admit` method"):
        replay_tier(trace, 2, RecordingPolicy(), 1, free_admission=True)


def test_hits_count_distinct_experts_per_window_and_layer():
    # Rows do not matter: expert 0 with 5 rows is one access per window.
    trace = make_trace(2, 2, [[{0: 5}, {1: 2}], [{0: 1}, {1: 7}]])
    assert [(r.name, r.num_hits, r.num_accesses) for r in replay_all(
        trace, 2, DecayedCountTier(2), adapt_every=1)] == [
        ("decayed-count", 2, 4), ("lru", 2, 4), ("lfu", 2, 4), ("static-profile", 4, 4),
        ("round-oracle", 4, 4), ("belady", 2, 4)]


def test_a_policy_that_breaks_the_rules_is_named():
    class Greedy:
        name = "greedy"

        def plan_swaps(self, counts, residency, min_gain):
            return [ExpertSwap(0, 0, -1, -1)]

    with pytest.raises(ConfigError, match="'greedy' loads \\(0, 0\\), which is resident"):
        replay_tier(_one_layer([0, 0, 0]), 2, Greedy(), adapt_every=1)
    with pytest.raises(ConfigError, match="--slots 9"):
        replay_lru(_one_layer([0]), 9)


def _random_trace(data):
    n_layers = data.draw(st.integers(1, 3))
    n_experts = data.draw(st.integers(1, 6))
    num_windows = data.draw(st.integers(1, 12))
    windows = [[data.draw(st.sets(st.integers(0, n_experts - 1))) for _ in range(n_layers)]
               for _ in range(num_windows)]
    windows[-1][0] = windows[-1][0] | {0}  # the last window is not empty
    return make_trace(n_layers, n_experts, windows)


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_belady_beats_every_demand_policy(data):
    trace = _random_trace(data)
    num_slots = data.draw(st.integers(0, trace.n_layers * trace.n_experts))
    best = replay_belady(trace, num_slots).num_hits
    assert best >= replay_lru(trace, num_slots).num_hits
    assert best >= replay_lfu(trace, num_slots).num_hits


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_round_oracle_beats_every_round_policy(data):
    trace = _random_trace(data)
    num_slots = data.draw(st.integers(0, trace.n_layers * trace.n_experts))
    adapt_every = data.draw(st.integers(1, 4))
    decay = data.draw(st.sampled_from([0.0, 0.5, 0.9]))
    oracle = replay_round_oracle(trace, num_slots, adapt_every).num_hits
    assert oracle >= replay_static(trace, num_slots).num_hits
    tier = replay_tier(trace, num_slots, DecayedCountTier(num_slots, decay), adapt_every)
    assert oracle >= tier.num_hits
    window = replay_tier(trace, num_slots, WindowScoreTier(num_slots, decay=decay), adapt_every)
    assert oracle >= window.num_hits


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_belady_is_the_demand_optimum_on_tiny_traces(data):
    """Exhaustive search over every demand policy (keep or bypass, which victim) agrees."""
    trace = _random_trace(data)
    num_slots = data.draw(st.integers(1, min(3, trace.n_layers * trace.n_experts)))
    keys = (trace.records["layer"].astype(int) * trace.n_experts + trace.records["expert"])
    best = _best_demand_hits(tuple(keys.tolist()), 0, frozenset(), num_slots, {})
    assert replay_belady(trace, num_slots).num_hits == best


def _best_demand_hits(keys, i, resident, num_slots, memo):
    if i == len(keys):
        return 0
    if (i, resident) in memo:
        return memo[(i, resident)]
    key = keys[i]
    if key in resident:
        best = 1 + _best_demand_hits(keys, i + 1, resident, num_slots, memo)
    else:
        options = [resident]  # bypass
        if len(resident) < num_slots:
            options.append(resident | {key})
        else:
            options += [(resident - {victim}) | {key} for victim in resident]
        best = max(_best_demand_hits(keys, i + 1, option, num_slots, memo) for option in options)
    memo[(i, resident)] = best
    return best


def test_empty_cache_hits_nothing():
    trace = _one_layer(SEQUENCE)
    results = replay_all(trace, 0, DecayedCountTier(0))
    assert [r.num_hits for r in results] == [0] * 6
    assert np.isclose(results[0].hit_rate, 0.0)
