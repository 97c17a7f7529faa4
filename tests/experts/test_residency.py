"""ResidencyTable: exact tables and versions after sequences of changes, the order of the change
path (claim, wait out older readers, land), and snapshots that cannot change under a reader."""
import threading

import numpy as np
import pytest

from strata.experts.residency import MISSING, EvictTicket, ResidencyTable


def make_table(n_layers=2, n_experts=4, n_slots=3):
    return ResidencyTable(n_layers, n_experts, n_slots)


def make_resident(table, slot, layer, expert):
    """The whole path with no reader in between: claim, (copy), land."""
    ticket = table.begin_evict(slot)
    assert table.is_overwritable(ticket)
    table.land(slot, layer, expert)
    return ticket


def expected_table(n_layers, n_experts, resident):
    out = np.full((n_layers, n_experts), MISSING, dtype=np.int32)
    for (layer, expert), slot in resident.items():
        out[layer, expert] = slot
    return out


def test_new_table_is_empty_at_version_zero():
    table = make_table()
    snap = table.snapshot()
    assert snap.version == table.version == 0
    assert np.array_equal(snap.table, expected_table(2, 4, {}))
    assert table.free_slots() == [0, 1, 2]
    assert table.num_resident == 0
    snap.release()


def test_exact_tables_and_versions_after_a_sequence():
    table = make_table()
    assert make_resident(table, 0, 0, 1) == EvictTicket(0, 1, None)
    assert table.version == 2
    make_resident(table, 1, 1, 3)
    make_resident(table, 2, 0, 0)
    assert table.version == 6
    assert np.array_equal(table.peek().table,
                          expected_table(2, 4, {(0, 1): 0, (1, 3): 1, (0, 0): 2}))
    assert [table.slot_owner(s) for s in range(3)] == [(0, 1), (1, 3), (0, 0)]
    assert table.free_slots() == []

    ticket = table.begin_evict(1)
    assert ticket == EvictTicket(1, 7, (1, 3))
    # evicted: missing at once, slot claimed, owned by nobody
    assert np.array_equal(table.peek().table, expected_table(2, 4, {(0, 1): 0, (0, 0): 2}))
    assert table.is_claimed(1) and table.slot_owner(1) is None
    assert table.land(1, 1, 2) == 8
    assert np.array_equal(table.peek().table,
                          expected_table(2, 4, {(0, 1): 0, (1, 2): 1, (0, 0): 2}))
    assert table.num_resident == 3

    ticket = table.begin_evict(0)
    assert ticket.evicted == (0, 1)
    table.abort(0)
    assert table.free_slots() == [0]
    assert table.version == 9  # abort publishes nothing: the expert was already missing
    assert np.array_equal(table.peek().table,
                          expected_table(2, 4, {(1, 2): 1, (0, 0): 2}))


def test_order_violations_are_refused():
    table = make_table()
    with pytest.raises(RuntimeError, match="without begin_evict"):
        table.land(0, 0, 0)
    make_resident(table, 0, 0, 0)
    with pytest.raises(RuntimeError, match="without begin_evict"):
        table.land(0, 0, 1)  # resident slot: must be evicted first
    table.begin_evict(1)
    with pytest.raises(RuntimeError, match="already claimed"):
        table.begin_evict(1)
    with pytest.raises(ValueError, match=r"\(0, 0\) is already resident in slot 0"):
        table.land(1, 0, 0)
    with pytest.raises(RuntimeError, match="not claimed"):
        table.abort(0)
    with pytest.raises(IndexError, match="slot 3 is out of range: the cache has 3 slots"):
        table.begin_evict(3)
    with pytest.raises(IndexError, match=r"expert \(0, 4\) is out of range"):
        table.land(1, 0, 4)
    with pytest.raises(ValueError, match="n_experts > 0"):
        ResidencyTable(2, 0, 1)


def test_batched_claims_and_lands_publish_one_version_each():
    """begin_evict_many / land_many: the tables of the one-by-one path, one version per batch,
    every load checked before any is published, and an older reader still holds the batch."""
    table = make_table(n_slots=4)
    assert table.begin_evict_many([]) == [] and table.version == 0  # nothing: no version
    tickets = table.begin_evict_many([0, 1, 2])
    assert tickets == [EvictTicket(0, 1, None), EvictTicket(1, 1, None), EvictTicket(2, 1, None)]
    assert table.land_many([(0, 0, 1), (1, 1, 3), (2, 0, 0)]) == 2
    assert np.array_equal(table.peek().table,
                          expected_table(2, 4, {(0, 1): 0, (1, 3): 1, (0, 0): 2}))
    reader = table.snapshot()  # version 2: shows (0, 1) in slot 0 and (1, 3) in slot 1
    tickets = table.begin_evict_many([1, 0, 3])
    assert [t.evicted for t in tickets] == [(1, 3), (0, 1), None]
    assert {t.version for t in tickets} == {3} and table.version == 3
    assert np.array_equal(table.peek().table, expected_table(2, 4, {(0, 0): 2}))
    assert not any(table.is_overwritable(t) for t in tickets)
    with pytest.raises(RuntimeError, match="still pins version 2"):
        table.land_many([(1, 1, 0)])
    reader.release()
    with pytest.raises(ValueError, match=r"\(0, 0\) is already resident in slot 2"):
        table.land_many([(1, 1, 0), (0, 0, 0)])  # the bad load stops the whole batch
    assert table.version == 3 and table.is_claimed(1) and table.is_claimed(0)
    with pytest.raises(ValueError, match="repeats"):
        table.land_many([(1, 1, 0), (0, 1, 0)])
    with pytest.raises(RuntimeError, match="without begin_evict"):
        table.land_many([(1, 1, 0), (2, 1, 1)])
    with pytest.raises(RuntimeError, match="already claimed"):
        table.begin_evict_many([3])
    with pytest.raises(ValueError, match="repeat"):
        table.begin_evict_many([2, 2])
    assert table.land_many([(1, 1, 0), (0, 1, 1), (3, 0, 3)]) == 4
    assert np.array_equal(table.peek().table,
                          expected_table(2, 4, {(1, 0): 1, (1, 1): 0, (0, 0): 2, (0, 3): 3}))
    assert [table.slot_owner(s) for s in range(4)] == [(1, 1), (1, 0), (0, 0), (0, 3)]


def test_snapshot_never_changes_and_is_read_only():
    table = make_table()
    make_resident(table, 0, 1, 1)
    snap = table.snapshot()
    before = snap.table.copy()
    snap.release()
    make_resident(table, 1, 1, 2)
    table.begin_evict(0)
    assert np.array_equal(snap.table, before)
    with pytest.raises(ValueError):
        snap.table[0, 0] = 5


def test_reader_sees_the_last_completed_change():
    table = make_table(n_slots=2)
    resident = {}
    for step, (slot, layer, expert) in enumerate([(0, 0, 0), (1, 1, 1), (0, 0, 2), (1, 0, 0),
                                                  (0, 1, 3)]):
        ticket = table.begin_evict(slot)
        if ticket.evicted:
            del resident[ticket.evicted]
        with table.snapshot() as snap:  # between claim and land: missing, not resident
            assert snap.version == table.version == 2 * step + 1
            assert np.array_equal(snap.table, expected_table(2, 4, resident))
        table.land(slot, layer, expert)
        resident[(layer, expert)] = slot
        with table.snapshot() as snap:
            assert snap.version == 2 * step + 2
            assert np.array_equal(snap.table, expected_table(2, 4, resident))


def test_older_reader_holds_the_overwrite_newer_reader_does_not():
    table = make_table()
    make_resident(table, 0, 0, 3)
    old = table.snapshot()  # shows (0, 3) in slot 0
    ticket = table.begin_evict(0)
    newer = table.snapshot()  # shows slot 0 empty
    assert old.slot_of(0, 3) == 0 and newer.slot_of(0, 3) == MISSING
    assert not table.is_overwritable(ticket)
    with pytest.raises(RuntimeError, match="overwritten too early"):
        table.land(0, 1, 1)
    with pytest.raises(TimeoutError, match="was not released"):
        table.wait_overwritable(ticket, timeout_s=0.01)
    old.release()
    assert table.is_overwritable(ticket)  # `newer` is no obstacle
    table.wait_overwritable(ticket, timeout_s=0)
    old.release()  # releasing twice is harmless
    table.land(0, 1, 1)
    newer.release()
    assert table.slot_owner(0) == (1, 1)


def test_wait_overwritable_returns_when_a_reader_thread_releases():
    table = make_table()
    make_resident(table, 2, 1, 0)
    snap = table.snapshot()
    ticket = table.begin_evict(2)
    released = threading.Event()

    def reader():
        released.wait(5)
        snap.release()

    thread = threading.Thread(target=reader)
    thread.start()
    assert not table.is_overwritable(ticket)
    released.set()
    table.wait_overwritable(ticket, timeout_s=5)
    thread.join()
    assert table.land(2, 0, 0) == table.version
