"""KV grow, exactly: the built-in policy's lending costs and refill order, the lender's eviction
and refill order through the residency table's ordered path (a grow, a grow that moves to a
larger run, a trim), a slot with a copy in flight not lent before it lands, refused answers,
and the KV's cells moved exactly (CPU)."""
from __future__ import annotations

import logging
import threading
import time

import numpy as np
import pytest

from strata._native.kernels import KV_KEY_TILE
from strata.backends.cpu import CpuModel
from strata.config import EngineConfig
from strata.engine.expert_tier import ExpertTier
from strata.engine.kv import KVCache
from strata.errors import ConfigError
from strata.experts import kv_grow
from strata.experts.kv_grow import KVLender, LeastValuedKVGrow, LendView
from strata.experts.residency import ResidencyTable
from strata.model.gguf_file import GGUFModel
from strata.tool.synth import synth_model

# [2, 8] tier scores: the least valued residents of a layer-order fill are (0,4), (0,2), (0,3)
SCORES = np.array([[9, 8, 0, 1, 0, 9, 9, 9],
                   [9, 9, 9, 9, 5, 5, 5, 5]], dtype=float)


class FixedScores:
    """A tier policy that never swaps and exposes fixed scores (the cache stays as filled)."""

    name = "fixed-scores"
    scores = SCORES

    def plan_swaps(self, counts, residency, min_gain):
        return []


class FixedRun:
    name = "fixed-run"

    def __init__(self, run):
        self.run = run

    def grow(self, slot_index, num_cells_needed, cells_per_expert_slot, residency):
        return list(self.run)

    def give_back(self, slot_index, expert_slots):
        return []


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(gguf, CpuModel) of the tiny F32 model: 2 layers x 8 experts of 24576 bytes (48 f32
    cells of this model's KV per expert slot)."""
    path = tmp_path_factory.mktemp("kvgrow") / "tiny.gguf"
    synth_model(path, shape="tiny", weight_type="f32", seed=3)
    gguf = GGUFModel.open(path)
    yield gguf, CpuModel(gguf)
    gguf.close()


def make_lender(tiny, policy, is_async=False, adapt_every=0):
    """A 12-slot cache filled in layer order (slot i: (0, i) for i < 8, then (1, i - 8)) and a
    lender with base 64 cells; every table change is logged in `tier.events`."""
    gguf, model = tiny
    config = EngineConfig(gguf.path, n_ctx=512, expert_cache=12, adapt_every=adapt_every,
                          adapt_async=is_async, kv_grow=64)
    tier = ExpertTier.build(config, gguf, model)
    tier.start(FixedScores())
    table, events = tier.arena.table, []
    begin_evict, land, abort = table.begin_evict, table.land, table.abort

    def logged_evict(slot):
        ticket = begin_evict(slot)
        events.append(("evict", slot, ticket.evicted))
        return ticket

    def logged_land(slot, layer, expert):
        events.append(("land", slot, layer, expert))
        return land(slot, layer, expert)

    def logged_abort(slot):
        events.append(("abort", slot))
        return abort(slot)

    table.begin_evict, table.land, table.abort = logged_evict, logged_land, logged_abort
    tier.events = events
    lender = KVLender(tier, policy, 512, 64, KVCache, np.dtype(np.float32), KV_KEY_TILE)
    return tier, lender


def owners(table):
    return [table.slot_owner(s) for s in range(table.n_slots)]


def filled_kv(model, num_tokens, rng, kv_class=None):
    """A base KV (the model's, or a `kv_class` KVCache) whose first `num_tokens` cells hold
    fresh random values."""
    kv = model.new_kv(64) if kv_class is None else kv_class(model.spec, 64, np.float32)
    k, v = kv.cells
    k[:] = rng.standard_normal(k.shape)
    v[:] = rng.standard_normal(v.shape)
    kv.commit(num_tokens)
    return kv


def test_policy_costs_and_runs_without_a_view():
    policy = LeastValuedKVGrow()
    residency = np.array([[0, 3, -1], [1, -1, 2]])  # slots 0..3 hold (0,0) (1,0) (1,2) (0,1)
    # no scores: ties go to the highest (layer, expert) first: (1,2) (1,0) (0,1) (0,0)
    assert list(policy.slot_costs(residency)) == [4.0, 2.0, 1.0, 3.0]
    assert policy.grow(0, 96, 48, residency) == [1, 2]
    assert policy.grow(0, 200, 48, residency) == []  # 5 slots: more than the cache
    assert policy.give_back(0, [1, 2]) == [(0, 2), (1, 1)]


def test_policy_skips_reserved_and_claimed_slots_and_lends_free_ones_first():
    table = ResidencyTable(2, 4, 6)
    for slot, (layer, expert) in enumerate([(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]):
        table.begin_evict(slot)
        table.land(slot, layer, expert)
    table.begin_evict(1)  # a copy in flight into slot 1: claimed
    scores = np.array([[3.0, 0.0, 1.0, 0.0], [2.0, 5.0, 0.0, 0.0]])
    policy = LeastValuedKVGrow()
    policy.attach(LendView(table, frozenset({4}), lambda: scores, None))
    # slot 5 is free (0); residents by score (0,2) (1,0) (0,0) (1,1): 1 2 3, and slot 4's
    # (1,1) reserved; slot 1 claimed
    assert list(policy.slot_costs(table.peek().table)) == [3.0, np.inf, 1.0, 2.0, np.inf, 0.0]
    assert policy.grow(0, 2, 1, table.peek().table) == [2, 3]
    assert policy.grow(0, 1, 1, table.peek().table) == [5]
    # refills: the best experts not resident ((0,1): its slot is claimed), ties by (layer, expert)
    assert policy.give_back(0, [2, 3, 5]) == [(0, 1), (0, 3), (1, 2)]


def test_profile_rank_breaks_ties_between_equal_scores():
    table = ResidencyTable(1, 4, 4)
    for slot in range(4):
        table.begin_evict(slot)
        table.land(slot, 0, slot)
    rank = np.array([[2, 0, 3, 1]])
    policy = LeastValuedKVGrow()
    policy.attach(LendView(table, frozenset(), lambda: None, rank))
    assert list(policy.slot_costs(table.peek().table)) == [2.0, 4.0, 1.0, 3.0]
    assert policy.grow(0, 1, 1, table.peek().table) == [2]


def test_grow_move_and_trim_evict_and_refill_in_exact_order(tiny):
    tier, lender = make_lender(tiny, LeastValuedKVGrow())
    table, events = tier.arena.table, tier.events
    kv = filled_kv(tiny[1], 60, np.random.default_rng(0))
    keys, values = kv.keys(1).copy(), kv.values(1).copy()
    assert lender.cells_per_slot == 48
    tier.policy.num_cache_slots = 12  # as the built-in policies keep it: lent slots are taken off
    try:
        # 100 cells: double the base (128 = 3 slots); costs 12 4 2 3 1 11 10 9 8 7 6 5
        assert lender.grow(0, kv, 100)
        assert events == [("evict", 2, (0, 2)), ("evict", 3, (0, 3)), ("evict", 4, (0, 4))]
        assert [table.is_claimed(s) for s in (2, 3, 4)] == [True] * 3
        assert kv.capacity == 128 and lender.lent == {0: [2, 3, 4]}
        assert tier.policy.num_cache_slots == 9
        assert np.shares_memory(kv.cells[1], tier.arena.buffer)
        assert np.array_equal(kv.keys(1), keys) and np.array_equal(kv.values(1), values)

        events.clear()
        kv.commit(68)  # 128 cells in use; grow to 256 (6 slots): the KV's own slots cost 0, so
        # the run 1-6 (4 + 0 + 0 + 0 + 11 + 10) wins: only slots 1, 5 and 6 are lent
        assert lender.grow(0, kv, 129)
        assert events == [("evict", 1, (0, 1)), ("evict", 5, (0, 5)), ("evict", 6, (0, 6))]
        assert kv.capacity == 256 and lender.lent == {0: [1, 2, 3, 4, 5, 6]}
        assert tier.policy.num_cache_slots == 6
        assert np.array_equal(kv.keys(1)[:, :60], keys)
        assert np.array_equal(kv.values(1)[:, :60], values)

        events.clear()
        assert lender.trim(0, kv) == 64
        # refills: the best experts not resident, (0,5) (0,6) (0,1) (1,4) (1,5) (1,6)
        assert events == [("abort", s) for s in range(1, 7)] + [
            ("evict", 1, None), ("land", 1, 0, 5), ("evict", 2, None), ("land", 2, 0, 6),
            ("evict", 3, None), ("land", 3, 0, 1), ("evict", 4, None), ("land", 4, 1, 4),
            ("evict", 5, None), ("land", 5, 1, 5), ("evict", 6, None), ("land", 6, 1, 6)]
        assert owners(table) == [(0, 0), (0, 5), (0, 6), (0, 1), (1, 4), (1, 5), (1, 6), (0, 7),
                                 (1, 0), (1, 1), (1, 2), (1, 3)]
        assert kv.capacity == 64 and kv.num_tokens == 64 and lender.lent == {}
        assert tier.policy.num_cache_slots == 12
        assert not np.shares_memory(kv.cells[1], tier.arena.buffer)
        assert np.array_equal(kv.keys(1)[:, :60], keys)
        assert (lender.num_grows, lender.num_trims, lender.num_refills) == (2, 1, 6)
    finally:
        tier.close()


class Runs:
    """Lends the given runs one grow after the other; records what it was asked and offered."""

    name = "runs"

    def __init__(self, *runs):
        self.runs, self.asked, self.view = list(runs), [], None

    def attach(self, view):
        self.view = view

    def grow(self, slot_index, num_cells_needed, cells_per_expert_slot, residency):
        self.asked.append((slot_index, num_cells_needed, tuple(self.view.own_run(slot_index)),
                           tuple(self.view.own_run(0))))
        return self.runs.pop(0)

    def give_back(self, slot_index, expert_slots):
        return []


def test_a_grow_that_moves_to_a_disjoint_run_gives_the_old_one_back(tiny):
    policy = Runs([2, 3, 4], [6, 7, 8, 9, 10, 11])
    tier, lender = make_lender(tiny, policy)
    table, events = tier.arena.table, tier.events
    kv = filled_kv(tiny[1], 60, np.random.default_rng(0))
    keys, values = kv.keys(1).copy(), kv.values(1).copy()
    try:
        assert lender.grow(0, kv, 100)
        events.clear()
        kv.commit(68)
        assert lender.grow(0, kv, 129)
        assert policy.asked == [(0, 128, (), ()), (0, 256, (2, 3, 4), (2, 3, 4))]
        assert events == [("evict", 6, (0, 6)), ("evict", 7, (0, 7)), ("evict", 8, (1, 0)),
                          ("evict", 9, (1, 1)), ("evict", 10, (1, 2)), ("evict", 11, (1, 3)),
                          ("abort", 2), ("abort", 3), ("abort", 4)]
        assert kv.capacity == 256 and lender.lent == {0: [6, 7, 8, 9, 10, 11]}
        assert table.free_slots() == [2, 3, 4]
        assert np.array_equal(kv.keys(1)[:, :60], keys)
        assert np.array_equal(kv.values(1)[:, :60], values)
        assert policy.view.own_run(0) == ()  # offered only during the grow
    finally:
        tier.close()


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("second, lent, freed", [
    (range(3, 9), [6, 7, 8], []),  # the same start: extended after its end
    (range(0, 6), [0, 1, 2], []),  # extended before its start (the cells move up)
    (range(1, 7), [1, 2, 6], []),  # both
    (range(5, 11), [6, 7, 8, 9, 10], [3, 4]),  # overlapping its end: the rest given back
    (range(0, 12), [0, 1, 2, 6, 7, 8, 9, 10, 11], []),  # the whole cache
])
def test_a_kv_that_grows_again_into_a_run_overlapping_its_own_keeps_its_cells(
        tiny, dtype, second, lent, freed):
    policy = Runs([3, 4, 5], list(second))
    tier, lender = make_lender(tiny, policy)
    table, events = tier.arena.table, tier.events
    rng = np.random.default_rng(6)
    spec = tiny[1].spec
    kv = KVCache(spec, 64, dtype)
    for layer in range(kv.num_layers):
        kv.append(layer, rng.standard_normal((2, 60, 16)), rng.standard_normal((2, 60, 16)))
    kv.commit(60)
    try:
        assert lender.grow(0, kv, 65)  # 128 cells: 3 slots
        for layer in range(kv.num_layers):  # cells past the base, in the lent slots
            kv.append(layer, rng.standard_normal((2, 68, 16)), rng.standard_normal((2, 68, 16)))
        kv.commit(68)
        want = [(kv.keys(layer), kv.values(layer).copy()) for layer in range(kv.num_layers)]
        events.clear()
        assert lender.grow(0, kv, 129)
        assert policy.asked[1] == (0, 256, (3, 4, 5), (3, 4, 5))
        assert [e for e in events if e[0] == "evict"] == [
            ("evict", s, divmod(s, 8)) for s in lent]  # only the new slots
        assert [e for e in events if e[0] == "abort"] == [("abort", s) for s in freed]
        assert lender.lent == {0: list(second)} and table.free_slots() == freed
        assert all(table.is_claimed(s) for s in second)
        k, _ = kv.cells
        start = second[0] * tier.arena.slot_bytes
        assert k.__array_interface__["data"][0] == \
            tier.arena.buffer.__array_interface__["data"][0] + start
        for layer, (keys, values) in enumerate(want):
            assert np.array_equal(kv.keys(layer), keys)
            assert np.array_equal(kv.values(layer), values)
        assert lender.trim(0, kv) == 64 and lender.lent == {}
        assert not any(table.is_claimed(s) for s in range(table.n_slots))
        for layer, (keys, values) in enumerate(want):
            assert np.array_equal(kv.keys(layer), keys[:, :64])
            assert np.array_equal(kv.values(layer), values[:, :64])
    finally:
        tier.close()


def test_another_slots_run_is_never_offered(tiny):
    policy = Runs([3, 4, 5], [3, 4, 5, 6, 7, 8])
    tier, lender = make_lender(tiny, policy)
    rng = np.random.default_rng(7)
    kv0, kv1 = filled_kv(tiny[1], 64, rng), filled_kv(tiny[1], 64, rng)
    try:
        assert lender.grow(0, kv0, 65)
        assert not lender.grow(1, kv1, 65)  # slot 0's run: lent, refused
        assert policy.asked[1] == (1, 128, (), ())  # slot 0's run is not slot 1's to keep
        assert lender.lent == {0: [3, 4, 5]} and lender.num_refused == 1
    finally:
        tier.close()


def copy_held_into_slot_4(tier):
    """Slot 4 freed, then refilled with (1, 7) by a copy that waits for the reader returned
    (a window still reading the version before it); the tier's events cleared before it."""
    table = tier.arena.table
    table.begin_evict(4)
    table.abort(4)  # slot 4 free
    reader = table.snapshot()  # pins the version the copy into slot 4 must wait out
    tier.events.clear()
    tier.refill([(4, 1, 7)])
    return reader


def test_a_slot_with_a_copy_in_flight_is_lent_only_after_it_lands(tiny):
    tier, lender = make_lender(tiny, FixedRun([3, 4, 5]), is_async=True, adapt_every=1)
    table, events = tier.arena.table, tier.events
    kv = filled_kv(tiny[1], 64, np.random.default_rng(1))
    try:
        reader = copy_held_into_slot_4(tier)
        result = {}
        grower = threading.Thread(target=lambda: result.update(ok=lender.grow(0, kv, 65)))
        grower.start()
        time.sleep(0.3)
        assert grower.is_alive() and table.is_claimed(4)  # waiting for the copy to land
        assert events == [("evict", 4, None)] and lender.num_grows == 0
        reader.release()
        grower.join(30)
        assert result == {"ok": True}
        assert events == [("evict", 4, None), ("land", 4, 1, 7), ("evict", 3, (0, 3)),
                          ("evict", 4, (1, 7)), ("evict", 5, (0, 5))]
    finally:
        tier.close()


@pytest.fixture
def short_lend_timeout(monkeypatch):
    """Copies in flight and old readers are waited out for 0.05 s, not a minute (what the
    tests below keep busy stays busy until they let it go)."""
    monkeypatch.setattr(kv_grow, "LEND_TIMEOUT_S", 0.05)


def test_a_grow_while_a_copy_stays_in_flight_is_refused(tiny, short_lend_timeout):
    tier, lender = make_lender(tiny, FixedRun([6, 7, 8]), is_async=True, adapt_every=1)
    table, events = tier.arena.table, tier.events
    kv = filled_kv(tiny[1], 64, np.random.default_rng(8))
    try:
        reader = copy_held_into_slot_4(tier)
        assert not lender.grow(0, kv, 65)  # no slot is lent while a copy is in flight
        assert lender.num_refused == 1 and lender.lent == {} and kv.capacity == 64
        assert [table.slot_owner(s) for s in (6, 7, 8)] == [(0, 6), (0, 7), (1, 0)]
        assert all(e[1] == 4 for e in events)
        reader.release()
        assert tier.wait_idle(30)
        assert lender.grow(0, kv, 65) and lender.lent == {0: [6, 7, 8]}
        assert events == [("evict", 4, None), ("land", 4, 1, 7), ("evict", 6, (0, 6)),
                          ("evict", 7, (0, 7)), ("evict", 8, (1, 0))]
    finally:
        tier.close()


def test_a_trim_while_a_copy_stays_in_flight_returns_the_slots_empty(tiny, short_lend_timeout,
                                                                     caplog):
    tier, lender = make_lender(tiny, LeastValuedKVGrow(), is_async=True, adapt_every=1)
    table = tier.arena.table
    kv = filled_kv(tiny[1], 64, np.random.default_rng(9))
    try:
        assert lender.grow(0, kv, 65) and lender.lent == {0: [2, 3, 4]}
        table.begin_evict(11)
        table.abort(11)  # (1, 3) evicted, slot 11 free
        reader = table.snapshot()
        tier.refill([(11, 1, 3)])  # in flight: (1, 3), the best expert not resident
        assert lender.trim(0, kv) == 64 and lender.lent == {}
        reader.release()
        assert tier.wait_idle(30)
        # the refills were not picked against a table a copy was changing: (1, 3) again
        # into slot 2 failed the copier's round
        assert table.slot_owner(11) == (1, 3) and table.free_slots() == [2, 3, 4]
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert "still in flight" in caplog.text
    finally:
        tier.close()


def test_a_reader_that_keeps_its_snapshot_refuses_the_grow_and_keeps_no_slot(
        tiny, short_lend_timeout):
    tier, lender = make_lender(tiny, FixedRun([6, 7, 8]))
    table = tier.arena.table
    kv = filled_kv(tiny[1], 64, np.random.default_rng(10))
    try:
        reader = table.snapshot()  # may read slots 6-8's experts: they cannot be written
        assert not lender.grow(0, kv, 65)
        assert lender.num_refused == 1 and lender.lent == {} and kv.capacity == 64
        assert not any(table.is_claimed(s) for s in range(table.n_slots))
        assert table.free_slots() == [6, 7, 8]  # published missing, returned free
        reader.release()
        assert lender.grow(0, kv, 65) and lender.lent == {0: [6, 7, 8]}
    finally:
        tier.close()


class NoRoomKV(KVCache):
    """A KV whose cells cannot move into lent memory (as a device KV out of memory to stage
    them would fail)."""

    def rehome(self, capacity_tokens, memory=None):
        if memory is not None:
            raise MemoryError("no memory to stage the cells")
        super().rehome(capacity_tokens, memory)


def test_a_kv_whose_cells_cannot_move_refuses_the_grow_and_keeps_no_slot(tiny, caplog):
    tier, lender = make_lender(tiny, FixedRun([6, 7, 8]))
    table = tier.arena.table
    kv = filled_kv(tiny[1], 64, np.random.default_rng(11), NoRoomKV)
    want = kv.keys(1)
    try:
        assert not lender.grow(0, kv, 65)
        assert lender.num_refused == 1 and lender.lent == {} and lender.num_grows == 0
        assert not any(table.is_claimed(s) for s in range(table.n_slots))
        assert table.free_slots() == [6, 7, 8]
        assert kv.capacity == 64 and np.array_equal(kv.keys(1), want)
        assert "its cells could not move" in caplog.text
    finally:
        tier.close()


class StuckKV(KVCache):
    """A KV that cannot move back into its own memory (a device error at trim)."""

    def rehome(self, capacity_tokens, memory=None):
        if memory is None and self.capacity > capacity_tokens:
            raise RuntimeError("device error")
        super().rehome(capacity_tokens, memory)


def test_a_trim_whose_move_fails_keeps_the_run_lent(tiny):
    tier, lender = make_lender(tiny, FixedRun([6, 7, 8]))
    table = tier.arena.table
    kv = filled_kv(tiny[1], 64, np.random.default_rng(12), StuckKV)
    try:
        assert lender.grow(0, kv, 65) and lender.lent == {0: [6, 7, 8]}
        with pytest.raises(RuntimeError, match="device error"):
            lender.trim(0, kv)
        # the KV's cells are still in slots 6-8: lent, claimed, not refilled under it
        assert lender.lent == {0: [6, 7, 8]} and lender.num_trims == 0
        assert all(table.is_claimed(s) for s in (6, 7, 8))
    finally:
        tier.close()


@pytest.mark.parametrize("run, why", [
    ([3, 5, 6], "not one run"), ([3], "1 slots, 3 needed"), ([10, 11, 12], "outside 0..11"),
    ([], None)])
def test_refused_answers_leave_the_cache_unchanged(tiny, caplog, run, why):
    tier, lender = make_lender(tiny, FixedRun(run))
    kv = filled_kv(tiny[1], 64, np.random.default_rng(2))
    version = tier.arena.table.version
    try:
        assert not lender.grow(0, kv, 65)  # doubled to 128 cells: 3 slots of 48
    finally:
        tier.close()
    assert lender.num_refused == 1 and kv.capacity == 64 and lender.lent == {}
    assert tier.arena.table.version == version and tier.events == []
    if why is not None:
        assert any(why in r.getMessage() for r in caplog.records)


def test_a_claimed_slot_is_refused(tiny):
    tier, lender = make_lender(tiny, FixedRun([0, 1, 2]))
    kv = filled_kv(tiny[1], 64, np.random.default_rng(3))
    try:
        tier.arena.table.begin_evict(1)
        assert not lender.grow(0, kv, 65) and lender.num_refused == 1
        assert tier.arena.table.slot_owner(0) == (0, 0)
    finally:
        tier.close()


def test_kv_rehome_moves_cells_exactly():
    from strata.tool.synth import get_preset

    spec = get_preset("tiny")
    rng = np.random.default_rng(4)
    for dtype in (np.float32, np.float16):
        kv = KVCache(spec, 64, dtype)
        for layer in range(spec.n_layers):
            kv.append(layer, rng.standard_normal((2, 50, 16)), rng.standard_normal((2, 50, 16)))
        kv.commit(50)
        want = [(kv.keys(layer), kv.values(layer).copy()) for layer in range(spec.n_layers)]
        region = np.zeros(KVCache.nbytes_for(spec, 192, dtype) + 7, dtype=np.uint8)
        kv.rehome(192, region)
        assert kv.capacity == 192 and np.shares_memory(kv.cells[0], region)
        kv.rehome(64)
        assert kv.capacity == 64 and not np.shares_memory(kv.cells[0], region)
        for layer, (k, v) in enumerate(want):
            assert np.array_equal(kv.keys(layer), k) and np.array_equal(kv.values(layer), v)
        with pytest.raises(ValueError, match="cannot move a KV of 50 tokens into 32"):
            kv.rehome(32)


@pytest.mark.parametrize("options, message", [
    (dict(kv_grow=64), "--kv-grow lends expert-cache slots"),
    (dict(kv_grow=0, expert_cache=4), "--kv-grow is 0"),
    (dict(kv_grow="lots", expert_cache=4), "--kv-grow is 'lots'"),
])
def test_config_errors(tiny, options, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig(tiny[0].path, **options)


def test_base_cells(tiny):
    path = tiny[0].path
    assert EngineConfig(path, expert_cache=4).kv_base_cells(512) == 512
    assert EngineConfig(path, expert_cache=4, kv_grow="auto",
                        prompt_chunk_tokens=96).kv_base_cells(512) == 96
    assert EngineConfig(path, expert_cache=4, kv_grow="1000").kv_base_cells(512) == 512


class AtMost:
    """Lends the next slots for requests of at most `limit` cells; records the requests."""

    name = "at-most"

    def __init__(self, limit):
        self.limit, self.requests, self.first = limit, [], 0

    def grow(self, slot_index, num_cells_needed, cells_per_expert_slot, residency):
        self.requests.append(num_cells_needed)
        if num_cells_needed > self.limit:
            return []
        num = -(-num_cells_needed // cells_per_expert_slot)
        self.first += num
        return list(range(self.first - num, self.first))

    def give_back(self, slot_index, expert_slots):
        return []


def test_a_refused_doubling_falls_back_to_just_enough(tiny):
    policy = AtMost(200)
    tier, lender = make_lender(tiny, policy)
    kv = filled_kv(tiny[1], 64, np.random.default_rng(5))
    try:
        assert lender.grow(0, kv, 65)  # doubled: 128 cells, 3 slots of 48
        assert kv.capacity == 128 and lender.lent == {0: [0, 1, 2]}
        kv.commit(64)
        assert not lender.grow(0, kv, 329)  # 384 cells (whole tiles) either way: refused
        assert lender.grow(0, kv, 129)  # 256 refused, then 129 -> 192 cells (4 slots)
        assert policy.requests == [128, 384, 256, 192]
        assert kv.capacity == 192 and lender.lent == {0: [3, 4, 5, 6]}
        assert lender.num_refused == 1
    finally:
        tier.close()


def test_profile_rank_is_the_profile_order(tmp_path):
    from strata.experts.kv_grow import profile_rank
    from strata.experts.profile import RoutingProfile, read_profile, write_profile

    ranking = np.array([[1, 2], [0, 0], [1, 0], [0, 2], [0, 1], [1, 1]])
    path = tmp_path / "p.profile"
    write_profile(path, RoutingProfile(2, 3, ranking, np.zeros(6, int), np.zeros(6, int)))
    assert profile_rank(read_profile(path), 2, 3).tolist() == [[1, 4, 3], [2, 5, 0]]
    assert profile_rank(None, 2, 3) is None
