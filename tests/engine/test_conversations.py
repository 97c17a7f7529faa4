"""The parked-conversation cache: byte budget, exact LRU eviction order, the prefix rule."""
from __future__ import annotations

import numpy as np
import pytest

from strata.engine.conversations import ConversationCache, resolve_budget_mib
from strata.errors import ConfigError

MIB = 2**20


def make_cache(budget_bytes: int) -> ConversationCache:
    return ConversationCache(budget_mib=budget_bytes / MIB)


def park_all(cache: ConversationCache, *entries: tuple[list[int], int]) -> list[int | None]:
    return [cache.park(tokens, {"tokens": list(tokens)}, nbytes) for tokens, nbytes in entries]


@pytest.mark.parametrize("budget_mib, budget_bytes", [(0, 0), (1, MIB), (2.5, 2621440),
                                                      (1024, 1024 * MIB)])
def test_budget_is_given_in_mib(budget_mib, budget_bytes):
    assert ConversationCache(budget_mib).budget_bytes == budget_bytes


@pytest.mark.parametrize("bad", [-1, float("nan"), float("inf"), "64", None, True])
def test_bad_budget_is_a_config_error(bad):
    with pytest.raises(ConfigError, match="--conversation-cache-mib"):
        ConversationCache(bad)


def test_park_then_take_returns_the_same_arrays_and_frees_the_bytes():
    cache = make_cache(1000)
    kv = (np.arange(6.0).reshape(2, 3), np.ones((2, 3)))
    key = cache.park([4, 5, 6], kv, 300)
    assert cache.used_bytes == 300 and cache.num_entries == 1 and key in cache
    entry = cache.take(key)
    assert entry.kv_arrays is kv and entry.tokens == (4, 5, 6) and entry.nbytes == 300
    assert entry.num_tokens == 3
    assert cache.used_bytes == 0 and cache.num_entries == 0 and key not in cache
    with pytest.raises(KeyError, match="already taken"):
        cache.take(key)


def test_eviction_drops_least_recently_used_first_until_it_fits():
    cache = make_cache(1000)
    k1, k2, k3, k4 = park_all(cache, ([1], 400), ([2], 300), ([3], 200), ([4], 100))
    assert cache.keys() == [k1, k2, k3, k4] and cache.used_bytes == 1000
    k5, = park_all(cache, ([5], 500))  # needs 500 more: drops k1 (400) then k2 (300)
    assert cache.keys() == [k3, k4, k5] and cache.used_bytes == 800
    assert cache.num_evicted == 2
    k6, = park_all(cache, ([6], 250))  # 1050 > 1000: drops k3 only
    assert cache.keys() == [k4, k5, k6] and cache.used_bytes == 850
    assert cache.num_evicted == 3


def test_refreshing_an_entry_changes_the_eviction_order():
    cache = make_cache(300)
    k1, k2, k3 = park_all(cache, ([1, 1], 100), ([2, 2], 100), ([3, 3], 100))
    # Parking a prefix of k1 again stores nothing and makes k1 the most recent.
    assert cache.park([1], "kv", 100) == k1
    assert cache.keys() == [k2, k3, k1] and cache.used_bytes == 300
    k4, = park_all(cache, ([4], 100))
    assert cache.keys() == [k3, k1, k4]


def test_an_entry_larger_than_the_budget_is_not_kept_and_evicts_nothing():
    cache = make_cache(500)
    k1, = park_all(cache, ([1], 400))
    assert cache.park([2], "kv", 501) is None
    assert cache.keys() == [k1] and cache.used_bytes == 400


def test_zero_budget_turns_parking_off():
    cache = ConversationCache(0)
    assert cache.park([1, 2], "kv", 1) is None
    assert cache.park([1, 2], "kv", 0) == 1  # nothing to hold: an empty KV fits any budget


def test_empty_tokens_are_not_parked():
    assert make_cache(100).park([], "kv", 10) is None


def test_parking_an_extension_replaces_the_shorter_entry():
    cache = make_cache(1000)
    k1, k2 = park_all(cache, ([1, 2, 3], 300), ([9], 100))
    k3 = cache.park([1, 2, 3, 4, 5], "longer", 500)
    assert cache.keys() == [k2, k3] and cache.used_bytes == 600
    assert cache.get(k3).kv_arrays == "longer"
    assert cache.num_evicted == 0  # replaced, not evicted


def test_parking_a_prefix_of_an_entry_keeps_the_longer_one():
    cache = make_cache(1000)
    k1, = park_all(cache, ([1, 2, 3, 4], 400))
    assert cache.park([1, 2], "shorter", 200) == k1
    assert cache.park([1, 2, 3, 4], "same", 400) == k1
    assert cache.park([1, 2, 3], "too big but covered", 5000) == k1
    assert cache.keys() == [k1] and cache.get(k1).kv_arrays == {"tokens": [1, 2, 3, 4]}
    assert cache.used_bytes == 400


def test_parking_a_branch_keeps_both():
    cache = make_cache(1000)
    k1, k2 = park_all(cache, ([1, 2, 3], 300), ([1, 2, 7], 300))
    assert cache.keys() == [k1, k2]


def test_best_match_is_the_longest_shared_prefix():
    cache = make_cache(1000)
    k1, k2, k3 = park_all(cache, ([1, 2, 3], 100), ([1, 2, 3, 4, 5], 100), ([7, 8], 100))
    assert k1 not in cache  # replaced by its extension k2
    assert cache.best_match([1, 2, 3, 4, 9]) == (k2, 4)
    assert cache.best_match([1, 2, 3, 4, 5, 6]) == (k2, 5)
    assert cache.best_match([1, 2]) == (k2, 2)
    assert cache.best_match([7, 8, 9]) == (k3, 2)
    assert cache.best_match([5]) == (None, 0)
    assert cache.best_match([]) == (None, 0)
    assert cache.keys() == [k2, k3]  # matching does not change recency


def test_best_match_ties_go_to_the_most_recently_used():
    cache = make_cache(1000)
    k1, k2 = park_all(cache, ([1, 2, 3], 100), ([1, 2, 4], 100))
    assert cache.best_match([1, 2, 5]) == (k2, 2)
    cache.park([1, 2, 3], "again", 100)  # refresh k1
    assert cache.best_match([1, 2, 5]) == (k1, 2)


def test_keys_are_never_reused():
    cache = make_cache(100)
    k1, = park_all(cache, ([1], 100))
    cache.take(k1)
    k2, = park_all(cache, ([1], 100))
    assert k2 != k1


def test_clear_forgets_everything():
    cache = make_cache(1000)
    park_all(cache, ([1], 100), ([2], 100))
    cache.clear()
    assert cache.num_entries == 0 and cache.used_bytes == 0 and cache.best_match([1]) == (None, 0)


def test_random_operations_keep_the_invariants():
    rng = np.random.default_rng(1)
    cache = make_cache(2000)
    for _ in range(500):
        if cache.num_entries and rng.random() < 0.2:
            cache.take(cache.keys()[int(rng.integers(cache.num_entries))])
        else:
            tokens = rng.integers(0, 3, size=int(rng.integers(1, 6))).tolist()
            cache.park(tokens, None, int(rng.integers(0, 900)))
        entries = [cache.get(k) for k in cache.keys()]
        assert cache.used_bytes == sum(e.nbytes for e in entries) <= cache.budget_bytes
        for a in entries:  # no entry is a prefix of another
            for b in entries:
                assert a is b or b.tokens[:a.num_tokens] != a.tokens


def test_hybrid_entries_restore_only_at_their_reuse_points():
    cache = make_cache(10_000)
    k1 = cache.park([1, 2, 3, 4, 5, 6], "a", 100, reuse_points=(3, 6))
    assert cache.best_match([1, 2, 3, 4, 5, 6, 7]) == (k1, 6)
    assert cache.best_match([1, 2, 3, 4, 5, 6]) == (k1, 3)  # the last token is read again
    assert cache.best_match([1, 2, 3, 4, 9]) == (k1, 3)
    assert cache.best_match([1, 2, 9]) == (None, 0)
    # a longer entry without point 3 does not cover the first one: both stay
    k2 = cache.park([1, 2, 3, 4, 5, 6, 7, 8], "b", 100, reuse_points=(8,))
    assert cache.keys() == [k1, k2]
    # one with every point of the first does, and replaces it
    k3 = cache.park([1, 2, 3, 4, 5, 6, 7, 8, 9], "c", 100, reuse_points=(3, 6, 9))
    assert cache.keys() == [k2, k3]
    # tokens an entry extends, at points it has: nothing new is stored
    assert cache.park([1, 2, 3, 4, 5, 6], "d", 100, reuse_points=(3, 6)) == k3


def test_a_hybrid_entry_is_taken_with_the_points_the_slot_keeps():
    """The slot restores the state at the tokens it keeps, not at the entry's end (a
    checkpoint kept at the end could push out the one it goes back to)."""
    cache = make_cache(10_000)
    k1 = cache.park([1, 2, 3, 4, 5, 6], "a", 100, reuse_points=(3, 5, 6))
    k2 = cache.park([7, 8, 9], "b", 100)
    assert cache.take(k1, 5).reuse_points == (3, 5)
    entry = cache.take(k2, 1)
    assert entry.reuse_points is None and entry.tokens == (7, 8, 9)


@pytest.mark.parametrize("asked,available_mib,budget", [
    (8192, 64 * 1024, 8192), (8192, 4096, 2048), (-1, 4096, 2048), (0, 4096, 0),
    (100, None, 100)])
def test_the_budget_is_at_most_half_the_ram_available(asked, available_mib, budget):
    available = None if available_mib is None else available_mib * 2**20
    assert resolve_budget_mib(asked, available) == budget


def test_no_limit_needs_to_know_the_ram():
    with pytest.raises(ConfigError, match="/proc/meminfo"):
        resolve_budget_mib(-1, None)


def test_counts_of_parks_restores_and_evictions():
    cache = ConversationCache(budget_mib=200 / 2**20)  # 200 bytes
    a = cache.park([1, 2], "kv-a", 100)
    cache.park([1, 2], "kv-a", 100)  # already held: nothing new is stored
    cache.park([3], "kv-b", 100)
    cache.park([4], "kv-c", 100)  # evicts a
    assert (cache.num_parked, cache.num_evicted, cache.num_taken) == (3, 1, 0)
    assert a not in cache
    cache.take(cache.best_match([3, 9])[0])
    assert (cache.num_parked, cache.num_evicted, cache.num_taken) == (3, 1, 1)


def test_a_prefix_lent_to_a_slot_stays_parked_and_evictions_are_logged(caplog):
    """A slot that keeps only a prefix of an entry (another conversation's system prompt)
    leaves the entry parked; one that keeps all of it takes it. An eviction says which entry
    went and why."""
    import logging

    caplog.set_level(logging.INFO, logger="strata.engine")
    cache = make_cache(1000)
    k1, = park_all(cache, ([1, 2, 3, 4], 400))
    assert cache.take(k1, num_used=2).tokens == (1, 2, 3, 4)
    assert cache.keys() == [k1] and cache.used_bytes == 400 and cache.num_taken == 1
    assert "parked entry 1 lends its first 2 of 4 tokens; it stays parked" in caplog.text
    k2, = park_all(cache, ([5, 6], 700))
    assert cache.keys() == [k2]
    assert ("parked entry 1 (4 tokens) evicted, the least recently used, to make room for "
            "entry 2 within 0.0 MiB") in caplog.text
    assert cache.take(k2, num_used=2).tokens == (5, 6) and cache.num_entries == 0
