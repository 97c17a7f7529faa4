"""Slot table, the default slot picker and request placement: exact choices and orders."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from strata.engine.conversations import ConversationCache
from strata.engine.slots import (MAX_SLOTS, LongestPrefixPicker, Placement, SlotTable, check_pick,
                                 common_prefix_len, max_reusable, place_request)
from strata.errors import ConfigError
from strata.hookspecs import SlotPicker, SlotView


def make_slot(index: int, tokens=(), is_busy=False, tick=0) -> SlotView:
    return SlotView(index, tuple(tokens), is_busy, tick)


def make_slots(*specs) -> tuple[SlotView, ...]:
    """Each spec: (tokens, is_busy, last_used_tick)."""
    return tuple(make_slot(i, *spec) for i, spec in enumerate(specs))


def make_table(num_slots: int, conversations: list[tuple[int, list[int]]]) -> SlotTable:
    """Run each (slot, tokens) conversation to its end, in order."""
    table = SlotTable(num_slots)
    for index, tokens in conversations:
        table.acquire(index, 0)
        table.extend(index, tokens)
        table.release(index)
    return table


# ---- common prefix ------------------------------------------------------------------------
@pytest.mark.parametrize("a, b, expected", [
    ([], [], 0), ([1], [], 0), ([1, 2, 3], [1, 2, 3], 3), ([1, 2, 3], [1, 2], 2),
    ([1, 2, 3], [1, 9, 3], 1), ([7, 2], [1, 2], 0), ([5] * 1000 + [1], [5] * 1000 + [2], 1000),
])
def test_common_prefix_len(a, b, expected):
    assert common_prefix_len(a, b) == expected
    assert common_prefix_len(b, a) == expected
    assert common_prefix_len(np.asarray(a, dtype=np.int32), b) == expected


def test_common_prefix_len_random_matches_a_loop():
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(0, 40))
        a = rng.integers(0, 3, size=n).tolist()
        b = a[:int(rng.integers(0, n + 1))] + rng.integers(0, 3, size=5).tolist()
        i = 0
        while i < min(len(a), len(b)) and a[i] == b[i]:
            i += 1
        assert common_prefix_len(a, b) == i


@pytest.mark.parametrize("prefix, prompt_len, expected", [(0, 5, 0), (3, 5, 3), (5, 5, 4),
                                                          (9, 5, 4), (1, 1, 0)])
def test_max_reusable_keeps_the_last_prompt_token_to_read(prefix, prompt_len, expected):
    assert max_reusable(prefix, prompt_len) == expected


# ---- default picker -----------------------------------------------------------------------
PICKER = LongestPrefixPicker()


def test_default_picker_implements_the_interface():
    assert isinstance(PICKER, SlotPicker)


def test_picks_the_longest_common_prefix():
    slots = make_slots(([1, 2, 9], False, 5), ([1, 2, 3, 4], False, 1), ([1], False, 9),
                       ((), False, 0))
    assert PICKER.pick([1, 2, 3, 4, 5, 6], slots) == (1, 4)


def test_longest_prefix_ties_go_to_the_lowest_index():
    slots = make_slots(([8], False, 1), ([1, 2, 7], False, 3), ([1, 2, 8], False, 2))
    assert PICKER.pick([1, 2, 3], slots) == (1, 2)


def test_a_busy_slot_is_never_picked_even_with_the_longer_prefix():
    slots = make_slots(([1, 2, 3], True, 1), ([1, 2], False, 2), ((), False, 0))
    assert PICKER.pick([1, 2, 3, 4], slots) == (1, 2)


def test_whole_prompt_cached_still_reads_its_last_token():
    slots = make_slots(([1, 2, 3, 4, 5], False, 1))
    assert PICKER.pick([1, 2, 3], slots) == (0, 2)
    assert PICKER.pick([1], slots) == (0, 0)


def test_no_shared_prefix_takes_an_empty_slot_not_a_cached_one():
    slots = make_slots(([5, 6], False, 1), ([7], True, 2), ((), False, 0), ((), False, 0))
    assert PICKER.pick([1, 2], slots) == (2, 0)


def test_no_prefix_and_no_empty_slot_takes_the_least_recently_used():
    slots = make_slots(([5], False, 4), ([6], False, 2), ([7], True, 1), ([8], False, 3))
    assert PICKER.pick([1, 2], slots) == (1, 0)


def test_lru_ties_go_to_the_lowest_index():
    slots = make_slots(([5], False, 3), ([6], False, 2), ([8], False, 2))
    assert PICKER.pick([1], slots) == (1, 0)


def test_picker_refuses_when_every_slot_is_busy():
    with pytest.raises(ValueError, match="idle"):
        PICKER.pick([1], make_slots(([1], True, 1)))


def test_conversation_turns_return_to_their_slots():
    # Three conversations in three slots; each next turn extends its own history.
    a, b, c = [1, 10, 11], [2, 20], [3, 30, 31, 32]
    table = make_table(3, [(0, a), (1, b), (2, c)])
    choices = []
    for history in (c, a, b):
        prompt = history + [99]
        index, reused = PICKER.pick(prompt, table.views())
        choices.append((index, reused))
        table.acquire(index, reused)
        table.extend(index, prompt[reused:])
        table.release(index)
    assert choices == [(2, 4), (0, 3), (1, 2)]
    # A fourth conversation evicts the least recently used: slot 2 (used before 0 and 1).
    assert PICKER.pick([4, 40], table.views()) == (2, 0)


SLOT_STATES = st.tuples(st.lists(st.integers(0, 2), max_size=6), st.booleans(), st.integers(0, 5))


@given(prompt=st.lists(st.integers(0, 2), min_size=1, max_size=6),
       states=st.lists(SLOT_STATES, min_size=1, max_size=MAX_SLOTS))
def test_default_pick_is_valid_and_takes_the_longest_prefix(prompt, states):
    slots = make_slots(*states)
    if all(s.is_busy for s in slots):
        return
    index, reused = PICKER.pick(prompt, slots)
    assert check_pick(PICKER, (index, reused), prompt, slots) == (index, reused)
    idle = [s for s in slots if not s.is_busy]
    most = max(max_reusable(common_prefix_len(s.tokens, prompt), len(prompt)) for s in idle)
    chosen = max_reusable(common_prefix_len(slots[index].tokens, prompt), len(prompt))
    least_lost = min((s.num_tokens - most for s in idle if s.num_reusable(prompt) == most),
                     default=0)
    # the best slot, unless it would lose more than it keeps while a slot is empty
    if most > 0 and (least_lost <= most or not any(s.is_empty for s in idle)):
        assert chosen == most and reused == most
        assert slots[index].num_tokens - most == least_lost  # cuts the least it can
    elif any(s.is_empty for s in idle):
        assert slots[index].is_empty
    else:
        idle_ticks = [s.last_used_tick for s in slots if not s.is_busy]
        assert slots[index].last_used_tick == min(idle_ticks)


# ---- slot table ---------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [0, MAX_SLOTS + 1, -1, True, 2.0, "2"])
def test_slot_count_must_be_1_to_8(bad):
    with pytest.raises(ConfigError, match="--parallel"):
        SlotTable(bad)


def test_table_ticks_tokens_and_busy_flags():
    table = SlotTable(2)
    assert table.views() == (make_slot(0), make_slot(1))
    table.acquire(1, 0)  # tick 1
    table.extend(1, [5, 6, 7])
    assert table.view(1) == make_slot(1, [5, 6, 7], True, 1)
    assert table.num_idle == 1 and table.has_idle()
    table.acquire(0, 0)  # tick 2
    assert not table.has_idle()
    table.release(1)  # tick 3
    table.release(0)  # tick 4
    assert [(v.is_busy, v.last_used_tick) for v in table.views()] == [(False, 4), (False, 3)]
    table.acquire(1, 2)  # keeps [5, 6], tick 5
    assert table.view(1) == make_slot(1, [5, 6], True, 5)
    table.replace_tokens(1, [9, 9, 9, 9])
    assert table.tokens(1) == [9, 9, 9, 9]
    table.clear(1)
    assert table.view(1).is_empty


def test_table_rejects_misuse():
    table = make_table(2, [(0, [1, 2])])
    with pytest.raises(ValueError, match="cannot reuse 3"):
        table.acquire(0, 3)
    table.acquire(0, 1)
    with pytest.raises(ValueError, match="busy"):
        table.acquire(0, 0)
    with pytest.raises(ValueError, match="already idle"):
        table.release(1)
    with pytest.raises(IndexError, match="slots are 0..1"):
        table.extend(2, [1])


# ---- checking a plugin's answer -----------------------------------------------------------
class FixedPicker:
    name = "fixed"

    def __init__(self, answer):
        self.answer = answer

    def pick(self, prompt_tokens, slots):
        return self.answer


@pytest.mark.parametrize("answer, message", [
    (None, "must return"), ((0,), "must return"), ((5, 0), "not an idle slot"),
    ((1, 0), "not an idle slot"), ((0, 3), "only 2 can be reused"), ((0, -1), "reuses -1"),
    # not integers: int() would have taken them as (0, 1) and (0, 0)
    ("01", "must return"), ((0, 1.5), "must return"), ((0.0, 0), "must return"),
    ((False, 1), "must return"),
])
def test_check_pick_rejects_bad_answers_with_the_plugin_name(answer, message):
    slots = make_slots(([1, 2, 3], False, 1), ((), True, 2))
    with pytest.raises(ConfigError, match=message) as info:
        check_pick(FixedPicker(answer), answer, [1, 2, 3], slots)
    assert "'fixed'" in str(info.value)


def test_check_pick_accepts_a_valid_answer():
    slots = make_slots(([1, 2, 3], False, 1))
    assert check_pick(PICKER, (0, 2), [1, 2, 3], slots) == (0, 2)
    assert check_pick(PICKER, [np.int64(0), np.int32(2)], [1, 2, 3], slots) == (0, 2)


def test_a_picker_that_raises_is_a_config_error_naming_it():
    class Raises:
        name = "raises"

        def pick(self, prompt_tokens, slots):
            raise KeyError("no such slot")

    with pytest.raises(ConfigError, match="slot picker 'raises' failed: KeyError: 'no such "
                                          "slot'; fix or uninstall the plugin"):
        place_request([1, 2, 3], Raises(), make_slots(([1, 2], False, 1)))


# ---- placement: slot picker + parked conversations ----------------------------------------
def make_cache(*parked: list[int]) -> tuple[ConversationCache, list[int]]:
    cache = ConversationCache(budget_mib=1)
    keys = [cache.park(tokens, f"kv{i}", 100) for i, tokens in enumerate(parked)]
    return cache, keys


def test_place_in_an_empty_slot_without_parking():
    slots = make_slots(([1, 2], True, 1), ((), False, 0))
    assert place_request([3, 4], PICKER, slots) == Placement(1, 0, None, False)


def test_parked_conversation_beats_the_slots_own_prefix():
    cache, keys = make_cache([1, 2, 3, 4, 5], [1, 2, 9])
    slots = make_slots(([1, 2], False, 1), ([7, 7], False, 2))
    placement = place_request([1, 2, 3, 4, 5, 6], PICKER, slots, cache)
    # Slot 0 shares 2 tokens, parked key 0 shares 5: restore it into slot 0, whose own tokens
    # are dropped (2 tokens, fully covered by what gets restored, but parked all the same).
    assert placement == Placement(0, 5, keys[0], True)


def test_slot_prefix_beats_a_shorter_parked_one():
    cache, _ = make_cache([1, 2])
    slots = make_slots(([1, 2, 3, 4], False, 1))
    assert place_request([1, 2, 3, 4, 8], PICKER, slots, cache) == Placement(0, 4, None, False)


def test_equal_lengths_keep_the_slot_no_copy():
    cache, _ = make_cache([1, 2, 3])
    slots = make_slots(([1, 2, 3], False, 1))
    assert place_request([1, 2, 3, 4], PICKER, slots, cache) == Placement(0, 3, None, False)


def test_a_parked_match_of_the_whole_prompt_still_reads_the_last_token():
    cache, keys = make_cache([1, 2, 3, 4])
    slots = make_slots(((), False, 0))
    assert place_request([1, 2, 3], PICKER, slots, cache) == Placement(0, 2, keys[0], False)


def test_lru_slot_with_a_foreign_conversation_must_be_parked():
    cache, _ = make_cache([9, 9])
    slots = make_slots(([5, 6, 7], False, 2), ([8], False, 1))
    assert place_request([1, 2], PICKER, slots, cache) == Placement(1, 0, None, True)


def test_divergent_turn_parks_the_slot_tail_it_drops():
    slots = make_slots(([1, 2, 3, 4], False, 1))
    assert place_request([1, 2, 7], PICKER, slots) == Placement(0, 2, None, True)


SLOT = list(range(1, 11))  # a slot's 10 tokens


@pytest.mark.parametrize("prompt,parked", [
    (SLOT[:8] + [99], False),  # keeps 8 of 10: losing 2 (under a quarter) parks nothing
    (SLOT[:7] + [99], True),   # losing 3 is worth the copy of all 10
    (SLOT[:8], True),          # keeps 7 (the last token is read again): loses 3
])
def test_device_kv_parks_only_a_quarters_loss(prompt, parked):
    slots = make_slots((SLOT, False, 1))
    placement = place_request(prompt, PICKER, slots, min_copy_gain=0.25)
    assert (placement.parked_key, placement.is_parking_needed) == (None, parked)
    # host KV: every loss is parked
    assert place_request(prompt, PICKER, slots).is_parking_needed


def test_device_kv_restores_only_a_quarters_gain():
    cache, keys = make_cache(SLOT[:9] + [50], SLOT + [60, 61, 62])
    slots = make_slots((SLOT[:8] + [40], False, 1))
    # the first entry reuses 9 where the slot keeps 8: one cell more is not worth copying 9
    near = place_request(SLOT[:9] + [50, 7], PICKER, slots, cache, min_copy_gain=0.25)
    assert near == Placement(0, 8, None, False)
    assert place_request(SLOT[:9] + [50, 7], PICKER, slots, cache).parked_key == keys[0]
    # the second reuses 13: 5 of them new, over a quarter
    far = place_request(SLOT + [60, 61, 62, 7], PICKER, slots, cache, min_copy_gain=0.25)
    assert far == Placement(0, 13, keys[1], True)


def test_place_request_checks_a_plugin_answer():
    slots = make_slots(([1], True, 1), ((), False, 0))
    with pytest.raises(ConfigError, match="not an idle slot"):
        place_request([1, 2], FixedPicker((0, 0)), slots)


# ---- placement: a busy slot's prefix copied ----------------------------------------------
def test_a_busy_slots_longer_prefix_is_copied():
    """Another request's slot holds the shared system prompt: its cells are copied into the
    idle slot the picker chose (whose own, shorter prefix is parked first)."""
    slots = make_slots(([1, 2, 3, 4, 5, 9], True, 1), ([1, 2, 7], False, 2))
    assert place_request([1, 2, 3, 4, 5, 6], PICKER, slots, copies_slots=True) == Placement(
        1, 5, None, True, 0)
    # without copying: the picker's slot and its own 2 tokens
    assert place_request([1, 2, 3, 4, 5, 6], PICKER, slots) == Placement(1, 2, None, True)


def test_a_busy_prefix_no_longer_than_the_slots_own_is_not_copied():
    slots = make_slots(([1, 2, 3], True, 1), ([1, 2, 3, 8], False, 2))
    assert place_request([1, 2, 3, 4], PICKER, slots, copies_slots=True) == Placement(
        1, 3, None, True)


def test_copy_into_an_empty_slot_parks_nothing_and_ties_go_to_the_lowest_index():
    slots = make_slots(((), False, 0), ([4, 5, 6, 7], True, 1), ([4, 5, 6, 8], True, 2))
    assert place_request([4, 5, 6, 9, 9], PICKER, slots, copies_slots=True) == Placement(
        0, 3, None, False, 1)


def test_the_longest_of_parked_and_busy_wins():
    cache, keys = make_cache([1, 2, 3, 4, 5, 6, 7])
    slots = make_slots(([1, 2, 3, 4], True, 1), ((), False, 0))
    assert place_request([1, 2, 3, 4, 5, 6, 7, 8], PICKER, slots, cache,
                         copies_slots=True) == Placement(1, 7, keys[0], False)
    cache, _ = make_cache([1, 2])
    assert place_request([1, 2, 3, 4, 5], PICKER, slots, cache,
                         copies_slots=True) == Placement(1, 4, None, False, 0)


def test_a_busy_copy_of_the_whole_prompt_still_reads_its_last_token():
    slots = make_slots(([1, 2, 3, 4], True, 1), ((), False, 0))
    assert place_request([1, 2, 3], PICKER, slots, copies_slots=True) == Placement(
        1, 2, None, False, 0)


# ---- the default picker leaves other conversations alone while a slot is empty -------------
def test_an_empty_slot_beats_cutting_another_conversation_whose_prefix_is_copied():
    """Slot 0 holds A (system prompt 1, 2, 3 and A's own 4, 5, 6, 7): B would cut 4 tokens
    to keep 3, so it goes to the empty slot 1, and its system prompt is copied from idle slot
    0, which keeps A."""
    slots = make_slots(([1, 2, 3, 4, 5, 6, 7], False, 1), ((), False, 0))
    assert PICKER.pick([1, 2, 3, 9, 9], slots) == (1, 0)
    assert place_request([1, 2, 3, 9, 9], PICKER, slots, copies_slots=True) == Placement(
        1, 3, None, False, 0)
    # a turn that extends all of A stays in A's slot, and so does one that keeps more of A
    # than it loses (A's next turn, its last answer re-rendered)
    assert PICKER.pick([1, 2, 3, 4, 5, 6, 7, 8], slots) == (0, 7)
    assert PICKER.pick([1, 2, 3, 4, 9], slots) == (0, 4)


def test_hybrid_slots_are_ranked_by_their_reuse_points():
    """Slot 0 shares 4 tokens but its state exists at 5 and 6 only (none of them reusable);
    slot 1 shares 2 and has a checkpoint at 2."""
    slots = (SlotView(0, (1, 2, 3, 4, 5, 6), False, 1, (5, 6)),
             SlotView(1, (1, 2, 7, 8), False, 2, (2, 4)))
    assert [s.num_reusable([1, 2, 3, 4, 9]) for s in slots] == [0, 2]
    assert PICKER.pick([1, 2, 3, 4, 9], slots) == (1, 2)


def test_a_hybrid_slot_that_keeps_more_than_it_loses_beats_an_empty_one():
    """A hybrid slot cannot lend its cells: keeping 4 and losing 2 beats reading all again in
    the empty slot; keeping 2 and losing 4 does not."""
    slots = (SlotView(0, (1, 2, 3, 4, 5, 6), False, 1, (2, 4, 6)), SlotView(1, (), False, 0))
    assert PICKER.pick([1, 2, 3, 4, 9], slots) == (0, 4)
    assert PICKER.pick([1, 2, 3, 9], slots) == (1, 0)
