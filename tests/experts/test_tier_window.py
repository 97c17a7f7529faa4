"""WindowScoreTier: exact scores after each observed window, loads, evictions and their order on
hand-made counts (per-window recency beats round sums, hysteresis, max swaps, the fallback
without `observe`), free admission's exact choices."""
import numpy as np
import pytest
from test_tier import apply_swaps, make_residency

from strata.experts.tier import FREE_SLOT, DecayedCountTier
from strata.experts.tier_window import WindowScoreTier
from strata.hookspecs import ExpertSwap


def observe_all(tier, windows):
    for counts in windows:
        tier.observe(np.array(counts))


def test_observe_keeps_a_decayed_frequency_and_the_last_windows_rows():
    tier = WindowScoreTier(decay=0.5)
    assert tier.scores is None
    tier.observe(np.array([[2, 0, 1]]))
    # The first window sets the frequency to "routed or not".
    assert tier.frequency.tolist() == [[1.0, 0.0, 1.0]]
    assert tier.scores.tolist() == [[3.0, 0.0, 2.0]]
    tier.observe(np.array([[0, 3, 0]]))
    assert tier.frequency.tolist() == [[0.5, 0.5, 0.5]]
    assert tier.recent_rows.tolist() == [[0.0, 3.0, 0.0]]
    assert tier.scores.tolist() == [[0.5, 3.5, 0.5]]
    tier.observe(np.array([[1, 1, 0]]))
    assert tier.frequency.tolist() == [[0.75, 0.75, 0.25]]
    assert tier.scores.tolist() == [[1.75, 1.75, 0.25]]
    assert tier.num_windows_observed == 3


def test_the_last_window_beats_a_round_sum():
    """Round of two windows: expert 0 took 4 rows in the first, expert 1 one row in the second.
    Summed per round expert 0 wins; per window expert 1, the one the current tokens use."""
    windows = [[[4, 0]], [[0, 1]]]
    round_counts = np.array([[4, 1]])
    empty = make_residency(1, 2, [])
    tier = WindowScoreTier(1, decay=0.5)
    observe_all(tier, windows)
    assert tier.scores.tolist() == [[0.5, 1.5]]
    assert tier.plan_swaps(round_counts, empty, 0.0) == [ExpertSwap(0, 1, FREE_SLOT, FREE_SLOT)]
    assert DecayedCountTier(1, decay=0.5).plan_swaps(round_counts, empty, 0.0) == [
        ExpertSwap(0, 0, FREE_SLOT, FREE_SLOT)]


def test_best_missing_replaces_worst_resident_in_order_across_layers():
    tier = WindowScoreTier(3, decay=0.5, hysteresis=0.0)
    observe_all(tier, [[[1, 0, 0], [0, 0, 1]], [[0, 2, 0], [1, 0, 0]]])
    # frequency [[.5, .5, 0], [.5, 0, .5]], rows [[0, 2, 0], [1, 0, 0]]:
    # scores [[.5, 2.5, 0], [1.5, 0, .5]].
    residency = make_residency(2, 3, [(0, 0), (0, 2), (1, 2)])
    # Missing best first: (0,1)=2.5, (1,0)=1.5, (1,1)=0; resident worst first: (0,2)=0,
    # (0,0)=.5, (1,2)=.5. Gains 2.5 and 1; the third pair (0 vs .5) fails.
    assert tier.plan_swaps(np.zeros((2, 3)), residency, 0.0) == [
        ExpertSwap(0, 1, 0, 2), ExpertSwap(1, 0, 0, 0)]


def test_hysteresis_min_gain_and_max_swaps():
    def plan(**knobs):
        min_gain = knobs.pop("min_gain", 0.0)
        tier = WindowScoreTier(2, decay=0.5, **knobs)
        observe_all(tier, [[[1, 1, 0, 0]], [[1, 0, 2, 1]]])
        # scores: (0,0) 1 + 1 = 2, (0,1) .5, (0,2) .5 + 2 = 2.5, (0,3) .5 + 1 = 1.5
        return tier.plan_swaps(np.zeros((1, 4)), make_residency(1, 4, [(0, 0), (0, 1)]),
                               min_gain)

    both = [ExpertSwap(0, 2, 0, 1), ExpertSwap(0, 3, 0, 0)]  # gains 2 and -0.5: one only
    assert plan(hysteresis=0.0) == both[:1]
    assert plan(hysteresis=3.0) == both[:1]  # 2 > 3 * .5
    assert plan(hysteresis=4.0) == []  # 2 does not clear 4 * .5
    assert plan(hysteresis=0.0, min_gain=2.0) == []
    assert plan(hysteresis=0.0, min_gain=1.9) == both[:1]


def test_free_slots_first_then_swaps_capped_by_max_swaps():
    tier = WindowScoreTier(3, max_swaps=2, decay=0.5, hysteresis=0.0)
    tier.observe(np.array([[0, 3, 2, 1, 0]]))
    residency = make_residency(1, 5, [(0, 4)])
    assert tier.plan_swaps(np.zeros((1, 5)), residency, 0.0) == [
        ExpertSwap(0, 1, FREE_SLOT, FREE_SLOT), ExpertSwap(0, 2, FREE_SLOT, FREE_SLOT)]
    tier = WindowScoreTier(3, max_swaps=3, decay=0.5, hysteresis=0.0)
    tier.observe(np.array([[0, 3, 2, 1, 0]]))
    assert tier.plan_swaps(np.zeros((1, 5)), residency, 0.0) == [
        ExpertSwap(0, 1, FREE_SLOT, FREE_SLOT), ExpertSwap(0, 2, FREE_SLOT, FREE_SLOT),
        ExpertSwap(0, 3, 0, 4)]


def test_without_observe_each_round_counts_as_one_window():
    tier = WindowScoreTier(1, decay=0.5, hysteresis=0.0)
    residency = make_residency(1, 3, [])
    assert tier.plan_swaps(np.array([[0, 3, 1]]), residency, 0.0) == [
        ExpertSwap(0, 1, FREE_SLOT, FREE_SLOT)]
    assert tier.scores.tolist() == [[0.0, 4.0, 2.0]] and tier.num_windows_observed == 0
    residency = make_residency(1, 3, [(0, 1)])
    # Second round: frequency [0, .5, 1], rows [0, 0, 2]: scores [0, .5, 3]: 2 replaces 1.
    assert tier.plan_swaps(np.array([[0, 0, 2]]), residency, 0.0) == [ExpertSwap(0, 2, 0, 1)]
    # With observed windows the round's counts are not folded in again.
    tier.observe(np.array([[5, 0, 0]]))
    tier.plan_swaps(np.array([[5, 0, 0]]), make_residency(1, 3, [(0, 2)]), 0.0)
    assert tier.frequency.tolist() == [[0.5, 0.25, 0.5]]


def test_rounds_follow_the_current_tokens_exactly():
    """One slot, rounds after every window: the expert of the last window is loaded, except
    when the resident one's margin holds it."""
    tier = WindowScoreTier(1, decay=0.5)
    residency = make_residency(1, 3, [])
    resident = []
    for counts in ([[1, 0, 0]], [[0, 2, 0]], [[0, 0, 1]], [[0, 3, 2]]):
        tier.observe(np.array(counts))
        apply_swaps(residency, tier.plan_swaps(np.array(counts), residency, 0.0))
        resident.append(np.flatnonzero(residency[0] >= 0).tolist())
    # Window 2: scores [.5, 2.5, 0]: 1 replaces 0. Window 3: [.25, .25, 1.5]: gain 1.25 >
    # .5 * .25 loads 2. Window 4: [.125, 3.625, 2.75]: gain .875 does not clear .5 * 2.75.
    assert resident == [[0], [1], [2], [2]]


def test_admit_keeps_missed_experts_free_slots_first_then_worst_unrouted_victims():
    tier = WindowScoreTier(4, decay=0.5, recency_weight=0.0)
    observe_all(tier, [[[1, 1, 0, 0, 1, 0]], [[1, 0, 1, 0, 0, 0]], [[0, 1, 1, 1, 0, 1]]])
    # Frequency only (recency weight 0): [.5, .75, .75, .5, .25, .5].
    assert tier.scores.tolist() == [[0.5, 0.75, 0.75, 0.5, 0.25, 0.5]]
    counts = np.array([[0, 1, 1, 1, 0, 1]])
    residency = make_residency(1, 6, [(0, 0), (0, 4), (0, 1)])
    # Missed (routed, not resident), best first: 2 (.75), 3 (.5), 5 (.5). One free slot takes
    # 2; victims not routed now, worst first: 4 (.25), 0 (.5); 3 beats 4; 5 does not beat 0.
    # Expert 1 was routed and hit: never a victim, though cheap enough.
    assert tier.admit(counts, residency) == [
        ExpertSwap(0, 2, FREE_SLOT, FREE_SLOT), ExpertSwap(0, 3, 0, 4)]
    # Default weight: missed experts carry their rows and beat every unrouted resident.
    tier = WindowScoreTier(4, decay=0.5)
    observe_all(tier, [[[1, 1, 0, 0, 1, 0]], [[1, 0, 1, 0, 0, 0]], [[0, 1, 1, 1, 0, 1]]])
    assert tier.admit(counts, residency) == [
        ExpertSwap(0, 2, FREE_SLOT, FREE_SLOT), ExpertSwap(0, 3, 0, 4),
        ExpertSwap(0, 5, 0, 0)]
    assert counts.tolist() == [[0, 1, 1, 1, 0, 1]] and (residency >= 0).sum() == 3


def test_admit_without_a_slot_count_only_swaps():
    tier = WindowScoreTier(decay=0.5)
    tier.observe(np.array([[0, 2, 0]]))
    assert tier.admit(np.array([[0, 2, 0]]), make_residency(1, 3, [(0, 0)])) == [
        ExpertSwap(0, 1, 0, 0)]


def test_victims_are_the_lowest_scored_residents():
    tier = WindowScoreTier(4)
    assert tier.victims(make_residency(1, 4, [(0, 0)]), 2) == []  # no scores yet
    tier.observe(np.array([[3, 0, 1, 0]]))
    tier.observe(np.array([[0, 2, 0, 0]]))
    # scores 0.98, 2.02, 0.98, 0 (frequency + the last window's rows): ties in key order
    residency = make_residency(1, 4, [(0, 0), (0, 1), (0, 2), (0, 3)])
    assert tier.victims(residency, 3) == [(0, 3), (0, 0), (0, 2)]
    assert tier.victims(residency, 0) == []
    residency = make_residency(1, 4, [(0, 1), (0, 2)])  # only residents are named
    assert tier.victims(residency, 8) == [(0, 2), (0, 1)]


@pytest.mark.parametrize("knobs, message", [
    ({"decay": 1.0}, "decay must lie in"), ({"recency_weight": -1.0}, "recency_weight"),
    ({"hysteresis": -1.0}, "hysteresis"), ({"max_swaps": 0}, "max_swaps"),
    ({"num_cache_slots": -1}, "num_cache_slots")])
def test_bad_settings_are_refused(knobs, message):
    with pytest.raises(ValueError, match=message):
        WindowScoreTier(**knobs)
