"""DecayedCountTier: exact loads, evictions and their order on hand-made count matrices (free
slots first, min gain, max swaps, hysteresis, the slow/fast blend); the built-in tier default."""
import types

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strata.experts.tier import FREE_SLOT, DecayedCountTier, plan_by_scores, smallest_first
from strata.hookspecs import ExpertSwap, TierPolicy
from strata.plugins import BUILTIN_PLUGIN_NAME, get_plugin_manager, resolve_choosers


def make_residency(n_layers, n_experts, resident):
    """[L, E] int32: slot i holds resident[i] = (layer, expert); everything else -1."""
    table = np.full((n_layers, n_experts), -1, dtype=np.int32)
    for slot, (layer, expert) in enumerate(resident):
        table[layer, expert] = slot
    return table


def apply_swaps(residency, swaps):
    """The engine's side: evictions free their slot; FREE_SLOT loads take the lowest free one."""
    for swap in swaps:
        if swap.evict_layer == FREE_SLOT:
            slot = min(set(range(residency.size)) - set(residency[residency >= 0].tolist()))
        else:
            slot = residency[swap.evict_layer, swap.evict_expert]
            residency[swap.evict_layer, swap.evict_expert] = -1
        residency[swap.load_layer, swap.load_expert] = slot


def test_free_slots_are_filled_first_best_first():
    tier = DecayedCountTier(num_cache_slots=3)
    counts = np.array([[5, 0, 1], [0, 4, 2]])
    residency = make_residency(2, 3, [(0, 0)])
    assert tier.plan_swaps(counts, residency, 0.0) == [
        ExpertSwap(1, 1, FREE_SLOT, FREE_SLOT), ExpertSwap(1, 2, FREE_SLOT, FREE_SLOT)]


def test_free_slots_then_swaps_in_one_round():
    tier = DecayedCountTier(num_cache_slots=2)
    counts = np.array([[0, 9, 8, 1]])
    residency = make_residency(1, 4, [(0, 3)])
    # One free slot takes expert 1; then expert 2 (8) replaces expert 3 (1): gain 7 > 0.5 * 1.
    assert tier.plan_swaps(counts, residency, 0.0) == [
        ExpertSwap(0, 1, FREE_SLOT, FREE_SLOT), ExpertSwap(0, 2, 0, 3)]


def test_best_missing_replaces_worst_resident_in_order_across_layers():
    counts = np.array([[1, 6, 0], [7, 0, 3]])
    residency = make_residency(2, 3, [(0, 0), (1, 1)])
    # Missing by score: (1,0)=7, (0,1)=6, (1,2)=3; resident worst first: (1,1)=0, (0,0)=1.
    both = [ExpertSwap(1, 0, 1, 1), ExpertSwap(0, 1, 0, 0)]  # gains 7 and 5

    def tier(**knobs):
        return DecayedCountTier(2, hysteresis=0.0, **knobs)

    assert tier().plan_swaps(counts, residency, 4.9) == both
    assert tier().plan_swaps(counts, residency, 5.0) == both[:1]  # 5 does not clear 5
    assert tier().plan_swaps(counts, residency, 7.0) == []
    assert tier(max_swaps=1).plan_swaps(counts, residency, 0.0) == both[:1]


def test_max_swaps_counts_free_slot_loads_and_swaps_together():
    counts = np.array([[9, 8, 7, 6, 1]])
    residency = make_residency(1, 5, [(0, 4)])
    tier = DecayedCountTier(num_cache_slots=3, max_swaps=3)
    assert tier.plan_swaps(counts, residency, 0.0) == [
        ExpertSwap(0, 0, FREE_SLOT, FREE_SLOT), ExpertSwap(0, 1, FREE_SLOT, FREE_SLOT),
        ExpertSwap(0, 2, 0, 4)]
    tier = DecayedCountTier(num_cache_slots=3, max_swaps=1)
    assert tier.plan_swaps(counts, residency, 0.0) == [ExpertSwap(0, 0, FREE_SLOT, FREE_SLOT)]


def test_min_gain_applies_to_free_slot_loads():
    tier = DecayedCountTier(num_cache_slots=4)
    counts = np.array([[3, 1, 0, 2]])
    assert tier.plan_swaps(counts, make_residency(1, 4, []), 1.0) == [
        ExpertSwap(0, 0, FREE_SLOT, FREE_SLOT), ExpertSwap(0, 3, FREE_SLOT, FREE_SLOT)]


def test_hysteresis_margin_grows_with_the_victims_score():
    residency = make_residency(1, 2, [(0, 0)])

    def plan(counts, min_gain=0.0):
        tier = DecayedCountTier(num_cache_slots=1, hysteresis=0.5)
        return tier.plan_swaps(np.array([counts]), residency, min_gain)

    assert plan([4, 6]) == []  # gain 2 does not clear 0.5 * 4
    assert plan([4, 7]) == [ExpertSwap(0, 1, 0, 0)]
    assert plan([4, 7], min_gain=1.0) == []  # gain 3 does not clear 1 + 0.5 * 4
    assert plan([4, 8], min_gain=1.0) == [ExpertSwap(0, 1, 0, 0)]


def test_hysteresis_stops_near_ties_from_thrashing():
    """Two experts trade places by one row every round for one slot: without hysteresis every
    round swaps them; with it the first one loaded stays."""
    rounds = [[5, 4], [4, 5], [5, 4], [4, 5]]

    def residents_per_round(hysteresis):
        tier = DecayedCountTier(1, fast_weight=1.0, hysteresis=hysteresis)
        residency, out = make_residency(1, 2, []), []
        for counts in rounds:
            apply_swaps(residency, tier.plan_swaps(np.array([counts]), residency, 0.0))
            out.append(np.flatnonzero(residency[0] >= 0).tolist())
        return out

    assert residents_per_round(0.0) == [[0], [1], [0], [1]]
    assert residents_per_round(0.25) == [[0], [0], [0], [0]]


def test_scores_blend_a_slow_and_a_fast_average():
    residency = make_residency(1, 2, [(0, 0)])
    tier = DecayedCountTier(num_cache_slots=1, decay=0.5, fast_weight=0.5, hysteresis=0.0)
    assert tier.plan_swaps(np.array([[4, 0]]), residency, 0.0) == []
    assert tier.scores.tolist() == [[4.0, 0.0]]  # the first round sets both averages
    # slow [2, 1.5], fast [0, 3]: scores [1, 2.25]; expert 1 (recent) beats expert 0 by 1.25.
    assert tier.plan_swaps(np.array([[0, 3]]), residency, 0.0) == [ExpertSwap(0, 1, 0, 0)]
    assert tier.slow.tolist() == [[2.0, 1.5]] and tier.fast.tolist() == [[0.0, 3.0]]
    assert tier.scores.tolist() == [[1.0, 2.25]]
    # Frequency only (fast_weight 0): scores [2, 1.5], the resident expert stays.
    tier = DecayedCountTier(num_cache_slots=1, decay=0.5, fast_weight=0.0, hysteresis=0.0)
    tier.plan_swaps(np.array([[4, 0]]), residency, 0.0)
    assert tier.plan_swaps(np.array([[0, 3]]), residency, 0.0) == []
    # The same round with min gain 1.25: the gain does not clear it.
    tier = DecayedCountTier(num_cache_slots=1, decay=0.5, fast_weight=0.5, hysteresis=0.0)
    tier.plan_swaps(np.array([[4, 0]]), residency, 0.0)
    assert tier.plan_swaps(np.array([[0, 3]]), residency, 1.25) == []


def test_fast_decay_keeps_some_history_in_the_fast_average():
    tier = DecayedCountTier(decay=0.5, fast_decay=0.5, fast_weight=1.0)
    residency = make_residency(1, 2, [(0, 0)])
    tier.plan_swaps(np.array([[8, 0]]), residency, 0.0)
    tier.plan_swaps(np.array([[0, 4]]), residency, 0.0)
    assert tier.fast.tolist() == [[4.0, 2.0]] and tier.scores.tolist() == [[4.0, 2.0]]


def test_has_no_per_window_hook():
    """Its averages are per round: the engine must not feed it every window's counts."""
    tier = DecayedCountTier(2)
    assert not hasattr(tier, "observe") and not hasattr(tier, "admit")


def test_without_a_slot_count_only_swaps_are_planned():
    tier = DecayedCountTier()
    counts = np.array([[1, 5, 2]])
    assert tier.plan_swaps(counts, make_residency(1, 3, [(0, 0)]), 0.0) == [
        ExpertSwap(0, 1, 0, 0)]


def test_arguments_are_not_modified():
    counts = np.array([[1, 5, 2]])
    residency = make_residency(1, 3, [(0, 0)])
    tier = DecayedCountTier(2)
    tier.plan_swaps(counts, residency, 0.0)
    tier.plan_swaps(counts, residency, 0.0)
    assert counts.tolist() == [[1, 5, 2]] and residency.tolist() == [[0, -1, -1]]


def _plan_by_full_sort(scores, residency, num_cache_slots, max_swaps, min_gain, hysteresis):
    """plan_by_scores' rule with both candidate lists fully sorted (stable): the reference."""
    flat, E = scores.reshape(-1), scores.shape[1]
    is_resident = residency.reshape(-1) >= 0
    missing, resident = np.flatnonzero(~is_resident), np.flatnonzero(is_resident)
    missing = missing[np.argsort(-flat[missing], kind="stable")]
    resident = resident[np.argsort(flat[resident], kind="stable")]
    swaps, at = [], 0
    num_free = 0 if num_cache_slots is None else num_cache_slots - len(resident)
    while (len(swaps) < min(num_free, max_swaps) and at < len(missing)
           and flat[missing[at]] > min_gain):
        swaps.append(ExpertSwap(*divmod(int(missing[at]), E), FREE_SLOT, FREE_SLOT))
        at += 1
    for victim in resident:
        if len(swaps) >= max_swaps or at >= len(missing):
            break
        if flat[missing[at]] - flat[victim] <= min_gain + hysteresis * flat[victim]:
            break
        swaps.append(ExpertSwap(*divmod(int(missing[at]), E), *divmod(int(victim), E)))
        at += 1
    return swaps


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 5), st.integers(1, 24), st.integers(0, 2**32 - 1), st.booleans(),
       st.integers(1, 9), st.sampled_from([0.0, 0.5, 1.0]), st.sampled_from([0.0, 0.5]),
       st.integers(-1, 4))
def test_partial_sort_plans_as_a_full_sort(num_layers, num_experts, seed, ties, max_swaps,
                                           min_gain, hysteresis, extra_slots):
    """plan_by_scores sorts only the max_swaps best missing / worst resident experts
    (smallest_first): the same swaps as fully sorted lists, ties (few distinct scores) too."""
    rng = np.random.default_rng(seed)
    n = num_layers * num_experts
    num_resident = int(rng.integers(0, n + 1))
    residency = np.full(n, -1)
    residency[rng.permutation(n)[:num_resident]] = np.arange(num_resident)
    residency = residency.reshape(num_layers, num_experts)
    shape = (num_layers, num_experts)
    scores = rng.integers(0, 4, shape).astype(float) if ties else rng.random(shape)
    slots = None if extra_slots < 0 else num_resident + extra_slots
    assert plan_by_scores(scores, residency, slots, max_swaps, min_gain, hysteresis) == \
        _plan_by_full_sort(scores, residency, slots, max_swaps, min_gain, hysteresis)
    keys = -scores.reshape(-1)
    candidates = np.flatnonzero(residency.reshape(-1) < 0)
    full = candidates[np.argsort(keys[candidates], kind="stable")]
    np.testing.assert_array_equal(smallest_first(candidates, keys, max_swaps), full[:max_swaps])


@pytest.mark.parametrize("knobs, message", [
    ({"decay": 1.0}, "decay must lie in"), ({"fast_decay": -0.1}, "fast_decay must lie in"),
    ({"fast_weight": 1.5}, "fast_weight must lie in"), ({"hysteresis": -1.0}, "hysteresis"),
    ({"max_swaps": 0}, "max_swaps"), ({"num_cache_slots": -1}, "num_cache_slots")])
def test_bad_settings_are_refused(knobs, message):
    with pytest.raises(ValueError, match=message):
        DecayedCountTier(**knobs)


def test_builtin_default_answers_strata_tier_policy():
    pm = get_plugin_manager(autoload=False)
    config = types.SimpleNamespace(expert_cache_slots=12, adapt_swaps=5)
    choosers = resolve_choosers(pm, config=config, spec=None, num_slots=1)
    policy = choosers.tier_policy
    assert isinstance(policy, DecayedCountTier) and isinstance(policy, TierPolicy)
    assert (policy.num_cache_slots, policy.max_swaps) == (12, 5)
    assert (policy.decay, policy.fast_weight, policy.hysteresis) == (0.9, 0.5, 0.5)
    assert choosers.sources["strata_tier_policy"] == BUILTIN_PLUGIN_NAME
