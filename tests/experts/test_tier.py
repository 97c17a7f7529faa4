"""DecayedCountTier: exact swaps on hand-made count matrices; the built-in tier default."""
import types

import numpy as np
import pytest

from strata.experts.tier import FREE_SLOT, DecayedCountTier
from strata.hookspecs import ExpertSwap, TierPolicy
from strata.plugins import BUILTIN_PLUGIN_NAME, get_plugin_manager, resolve_choosers


def make_residency(n_layers, n_experts, resident):
    """[L, E] int32: slot i holds resident[i] = (layer, expert); everything else -1."""
    table = np.full((n_layers, n_experts), -1, dtype=np.int32)
    for slot, (layer, expert) in enumerate(resident):
        table[layer, expert] = slot
    return table


def test_free_slots_are_filled_first_hottest_first():
    tier = DecayedCountTier(num_cache_slots=3)
    counts = np.array([[5, 0, 1], [0, 4, 2]])
    residency = make_residency(2, 3, [(0, 0)])
    assert tier.plan_swaps(counts, residency, 0.0) == [
        ExpertSwap(1, 1, FREE_SLOT, FREE_SLOT), ExpertSwap(1, 2, FREE_SLOT, FREE_SLOT)]


def test_free_slots_then_swaps_in_one_round():
    tier = DecayedCountTier(num_cache_slots=2)
    counts = np.array([[0, 9, 8, 1]])
    residency = make_residency(1, 4, [(0, 3)])
    # One free slot takes expert 1; then expert 2 (8) replaces expert 3 (1): gain 7.
    assert tier.plan_swaps(counts, residency, 0.0) == [
        ExpertSwap(0, 1, FREE_SLOT, FREE_SLOT), ExpertSwap(0, 2, 0, 3)]


def test_swaps_pair_hottest_missing_with_coldest_resident_above_min_gain():
    counts = np.array([[1, 6, 0], [7, 0, 3]])
    residency = make_residency(2, 3, [(0, 0), (1, 1)])
    both = [ExpertSwap(1, 0, 1, 1), ExpertSwap(0, 1, 0, 0)]  # gains 7 and 5
    assert DecayedCountTier(2).plan_swaps(counts, residency, 4.9) == both
    assert DecayedCountTier(2).plan_swaps(counts, residency, 5.0) == both[:1]  # 5 does not clear 5
    assert DecayedCountTier(2).plan_swaps(counts, residency, 7.0) == []
    assert DecayedCountTier(2, max_swaps=1).plan_swaps(counts, residency, 0.0) == both[:1]


def test_min_gain_applies_to_free_slot_loads():
    tier = DecayedCountTier(num_cache_slots=4)
    counts = np.array([[3, 1, 0, 2]])
    assert tier.plan_swaps(counts, make_residency(1, 4, []), 1.0) == [
        ExpertSwap(0, 0, FREE_SLOT, FREE_SLOT), ExpertSwap(0, 3, FREE_SLOT, FREE_SLOT)]


def test_scores_decay_between_rounds():
    tier = DecayedCountTier(num_cache_slots=1, decay=0.5)
    residency = make_residency(1, 2, [(0, 0)])
    assert tier.plan_swaps(np.array([[4, 0]]), residency, 0.0) == []
    assert tier.scores.tolist() == [[4.0, 0.0]]
    # Scores [2, 3]: expert 1 now beats expert 0 by 1.
    assert tier.plan_swaps(np.array([[0, 3]]), residency, 0.0) == [ExpertSwap(0, 1, 0, 0)]
    assert tier.scores.tolist() == [[2.0, 3.0]]
    tier = DecayedCountTier(num_cache_slots=1, decay=0.5)
    tier.plan_swaps(np.array([[4, 0]]), residency, 0.0)
    assert tier.plan_swaps(np.array([[0, 3]]), residency, 1.0) == []  # gain 1 does not clear 1


def test_without_a_slot_count_only_swaps_are_planned():
    tier = DecayedCountTier()
    counts = np.array([[1, 5, 2]])
    assert tier.plan_swaps(counts, make_residency(1, 3, [(0, 0)]), 0.0) == [
        ExpertSwap(0, 1, 0, 0)]


def test_arguments_are_not_modified():
    counts = np.array([[1, 5, 2]])
    residency = make_residency(1, 3, [(0, 0)])
    DecayedCountTier(2).plan_swaps(counts, residency, 0.0)
    assert counts.tolist() == [[1, 5, 2]] and residency.tolist() == [[0, -1, -1]]


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="decay"):
        DecayedCountTier(decay=1.0)
    with pytest.raises(ValueError, match="max_swaps"):
        DecayedCountTier(max_swaps=0)


def test_builtin_default_answers_strata_tier_policy():
    pm = get_plugin_manager(autoload=False)
    config = types.SimpleNamespace(expert_cache_slots=12, adapt_swaps=5)
    choosers = resolve_choosers(pm, config=config, spec=None, num_slots=1)
    policy = choosers.tier_policy
    assert isinstance(policy, DecayedCountTier) and isinstance(policy, TierPolicy)
    assert (policy.num_cache_slots, policy.max_swaps) == (12, 5)
    assert choosers.sources["strata_tier_policy"] == BUILTIN_PLUGIN_NAME
