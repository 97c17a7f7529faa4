"""host_pool.PinnedPool without a GPU driver: a lease is refused (the park copies through
memory of its own), once logged; and, over a stand-in for the driver's pinning calls, the
spare block the helper thread makes ahead of the next park."""
import contextlib
import gc
import logging
import threading
import time

import pytest

from strata.backends.cuda import host_pool
from strata.backends.cuda.host_pool import PinnedPool

MIB = 2**20


def test_without_a_driver_a_lease_is_refused_and_logged_once(caplog):
    pool = PinnedPool(rt=None)
    with caplog.at_level(logging.INFO, "strata.backends.cuda.host_pool"):
        assert pool.lease(1 << 20) is None and pool.lease(1 << 20) is None
        assert pool.lease_to_pin(1 << 20) is None
        pool.settle()  # the spare the first lease asked for: refused too
    assert caplog.text.count("parks copy through memory pinned for each copy") == 1
    assert caplog.text.count("no pinned block made ahead") <= 1
    assert pool.idle_bytes == pool.leased_bytes == 0 and pool.num_made == 0


class FakeDriver:
    """cuMemHostRegister / Unregister stand-ins: which ranges are pinned, by which thread; a
    registration of `gate_bytes` waits for `gate`, one over `refuse_over` bytes fails."""

    def __init__(self):
        self.pinned = {}  # address -> bytes
        self.threads = []  # the thread of each registration
        self.gate = threading.Event()
        self.gate.set()
        self.gate_bytes = None
        self.refuse_over = None
        self.unpinned = []

    def host_register(self, address, nbytes):
        if self.refuse_over is not None and nbytes > self.refuse_over:
            raise RuntimeError("cuMemHostRegister: out of memory")
        if nbytes == self.gate_bytes:
            assert self.gate.wait(10)
        assert address % (2 * MIB) == 0 and address not in self.pinned
        self.pinned[address] = nbytes
        self.threads.append(threading.current_thread().name)
        return address

    def host_unregister(self, address):
        self.unpinned.append(self.pinned.pop(address))


class FakeRuntime:
    @contextlib.contextmanager
    def active(self):
        yield


@pytest.fixture
def driver(monkeypatch):
    from strata._native import cuda_driver

    fake = FakeDriver()
    monkeypatch.setattr(cuda_driver, "host_register", fake.host_register)
    monkeypatch.setattr(cuda_driver, "host_unregister", fake.host_unregister)
    monkeypatch.setattr(host_pool, "SETTLE_S", 0.0)
    return fake


def test_a_spare_is_made_ahead_and_a_grown_conversation_parks_into_it(driver):
    pool = PinnedPool(FakeRuntime(), max_idle_bytes=64 * MIB)
    first = pool.lease(100 * MIB)  # its own block: 125 MiB rounded up to 128
    own = first.ctypes.data
    pool.settle()
    # the spare: the largest recent park grown twice by the headroom, 156.25 -> 192 MiB
    assert sorted(driver.pinned.values()) == [128 * MIB, 192 * MIB]
    assert sorted(driver.threads) == ["MainThread", "pinned-pool"]  # (the two run side by side)
    assert pool.num_made == 2 and pool.num_made_ahead == 1 and pool.idle_bytes == 192 * MIB
    spare = next(a for a, n in driver.pinned.items() if n == 192 * MIB)
    del first
    gc.collect()
    grown = pool.lease(150 * MIB)  # outgrew its 128 MiB block: the spare holds it
    assert grown.ctypes.data == spare and pool.num_made - pool.num_made_ahead == 1
    pool.settle()
    # the next spare is sized for 150 MiB: 234.4 -> 256; the idle limit grew to two of them
    assert pool.num_made_ahead == 2 and pool.idle_bytes == 128 * MIB + 256 * MIB
    again = pool.lease(120 * MIB)  # a park the old block holds: no spare needed
    pool.settle()
    assert again.ctypes.data == own and pool.num_made == 3 and pool.num_reused == 2
    del grown, again
    gc.collect()
    pool.trim(0)
    pool.settle()
    assert pool._blocks == [] and driver.pinned == {}


def test_a_park_waits_for_the_spare_being_made_instead_of_making_another(driver):
    pool = PinnedPool(FakeRuntime(), max_idle_bytes=64 * MIB)
    driver.gate.clear()
    driver.gate_bytes = 192 * MIB  # the spare's registration waits
    first = pool.lease(100 * MIB)
    threading.Timer(0.2, driver.gate.set).start()
    t0 = time.monotonic()
    second = pool.lease(110 * MIB)  # nothing idle; the spare being made will hold it
    assert time.monotonic() - t0 >= 0.15
    assert pool.num_waited == 1 and pool.num_made == 2 and pool.num_made_ahead == 1
    assert driver.pinned[second.ctypes.data] == 192 * MIB
    del first, second
    gc.collect()
    pool.trim(0)


def test_a_park_that_the_spare_would_not_fit_makes_its_own_block_at_once(driver):
    pool = PinnedPool(FakeRuntime(), max_idle_bytes=64 * MIB)
    driver.gate.clear()
    driver.gate_bytes = 192 * MIB
    first = pool.lease(100 * MIB)
    big = pool.lease(400 * MIB)  # over the spare's 192 MiB: no wait
    assert pool.num_waited == 0 and driver.pinned[big.ctypes.data] == 512 * MIB
    driver.gate.set()
    pool.settle()
    del first, big
    gc.collect()
    pool.trim(0)


def test_a_trim_keeps_the_spare_last_and_the_helper_thread_unpins(driver):
    pool = PinnedPool(FakeRuntime(), max_idle_bytes=64 * MIB)
    a = pool.lease(100 * MIB)
    pool.settle()  # spare of 192 MiB
    b = pool.lease(60 * MIB)  # its own block, 128 MiB (75 rounded up); no new spare
    pool.settle()
    assert pool.num_made == 3 and pool.num_made_ahead == 1
    del a, b
    gc.collect()  # idle: 128 + 128 + 192 MiB; the limit is 2 x 192 = 384
    pool.trim()
    pool.settle()
    assert driver.unpinned == [128 * MIB]  # a 128 MiB block, not the spare
    assert sorted(b.capacity for b in pool._blocks) == [128 * MIB, 192 * MIB]
    pool.trim(0)
    assert driver.pinned == {}


def test_outgrown_blocks_make_room_for_the_spare_and_a_trim_gives_them_up_first(
        driver, monkeypatch):
    monkeypatch.setattr(host_pool, "RECENT_LEASES", 2)
    pool = PinnedPool(FakeRuntime(), max_idle_bytes=600 * MIB)
    first = [pool.lease(100 * MIB) for _ in range(4)]  # 128 MiB, then four 192 MiB spares
    pool.settle()
    assert pool.num_made_ahead == 4 and pool.idle_bytes == 192 * MIB
    del first
    gc.collect()
    grown = pool.lease(250 * MIB)  # the trim leaves 192 + 192 + 128 idle; its own 320 MiB
    pool.settle()
    # a spare for 250 (390.6 -> 448 MiB) would put 960 idle over the limit (2 x 448), and no
    # idle block is under both last parks (100, 250): none is made
    assert pool.num_made_ahead == 4 and sorted(driver.unpinned) == [192 * MIB] * 2
    other = pool.lease(260 * MIB)  # nothing idle holds it: its own 384 MiB
    pool.settle()
    # the spare for 260 (448 MiB): the blocks under 250 and 260 are outgrown, and the largest
    # of them, 192 MiB, makes room for it
    assert pool.num_made == 8 and pool.num_made_ahead == 5
    assert sorted(driver.unpinned) == [192 * MIB] * 3
    assert pool.idle_bytes == (192 + 128 + 448) * MIB
    address = grown.ctypes.data
    del grown
    gc.collect()
    third = pool.lease(280 * MIB)  # the trim gives up an outgrown 192 first; 320 holds it
    pool.settle()
    assert third.ctypes.data == address and pool.num_made == 8
    assert sorted(driver.unpinned) == [192 * MIB] * 4
    pool.trim(448 * MIB)  # outgrown first: the 128, not the spare
    assert [b.capacity for b in pool._blocks if not b.is_leased] == [448 * MIB]
    del other, third
    gc.collect()
    pool.trim(0)
    assert driver.pinned == {}


def test_a_block_kept_from_longer_conversations_is_no_spare_for_shorter_ones(
        driver, monkeypatch):
    monkeypatch.setattr(host_pool, "RECENT_LEASES", 2)
    pool = PinnedPool(FakeRuntime(), max_idle_bytes=64 * MIB)
    big = pool.lease(400 * MIB)  # its own 512 MiB; the spare for 400: 640
    pool.settle()
    del big
    gc.collect()
    small = [pool.lease(100 * MIB)]  # neither idle block takes it (over 2 x 100): own 128
    pool.settle()
    assert pool.num_made == 3 and driver.unpinned == []  # 640 is still the 400's spare
    small.append(pool.lease(100 * MIB))
    pool.settle()
    # the last two parks are of 100 MiB: the 512 and 640 blocks are too large to be leased
    # by them, so no spare; over the idle limit (2 x 192), they go, and a 192 spare is made
    assert sorted(driver.unpinned) == [512 * MIB, 640 * MIB]
    assert pool.num_made == 5 and pool.num_made_ahead == 2 and pool.idle_bytes == 192 * MIB
    del small
    gc.collect()
    pool.trim(0)
    assert driver.pinned == {}


def test_a_refused_spare_stops_making_ahead_but_parks_keep_their_blocks(driver, caplog):
    pool = PinnedPool(FakeRuntime(), max_idle_bytes=64 * MIB)
    driver.refuse_over = 160 * MIB
    with caplog.at_level(logging.INFO, "strata.backends.cuda.host_pool"):
        first = pool.lease(100 * MIB)
        pool.settle()
        second = pool.lease(100 * MIB)
    assert "no pinned block made ahead" in caplog.text and not pool.make_ahead
    assert first is not None and second is not None and pool.num_made == 2
    del first, second
    gc.collect()
    pool.trim(0)


def test_without_making_ahead_there_is_no_helper_thread(driver):
    pool = PinnedPool(FakeRuntime(), max_idle_bytes=64 * MIB, make_ahead=False)
    lease = pool.lease(100 * MIB)
    del lease
    gc.collect()
    pool.trim()  # 128 idle, 64 allowed: dropped at once
    assert pool._tasks is None and pool.num_made == 1 and driver.pinned == {}


def test_the_helper_thread_ends_with_its_pool(driver):
    def helpers():
        return [t for t in threading.enumerate() if t.name == "pinned-pool"]

    before = len(helpers())
    pool = PinnedPool(FakeRuntime(), max_idle_bytes=64 * MIB)
    lease = pool.lease(10 * MIB)
    pool.settle()
    assert len(helpers()) == before + 1
    pool.trim(0)
    del pool
    del lease
    gc.collect()
    deadline = time.monotonic() + 5
    while len(helpers()) > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(helpers()) == before


def _pin_on(pin, name="kv-copies") -> bool:
    """Run a lease's `pin` on another thread (as the copy thread does); its result."""
    result = []
    worker = threading.Thread(target=lambda: result.append(pin()), name=name)
    worker.start()
    worker.join(10)
    return result[0]


def test_a_block_made_for_a_park_is_pinned_by_the_thread_that_copies_into_it(driver):
    pool = PinnedPool(FakeRuntime(), max_idle_bytes=256 * MIB, make_ahead=False)
    lease, pin = pool.lease_to_pin(100 * MIB)
    assert lease.nbytes == 100 * MIB and driver.pinned == {}  # only mapped so far
    assert pool.holds(lease) and pool.num_made == 0
    lease[:] = 7  # usable at once (the copies come after `pin`)
    assert _pin_on(pin) and driver.threads == ["kv-copies"]
    assert driver.pinned == {lease.ctypes.data: 128 * MIB}
    assert pool.num_made == pool.num_made_later == 1
    address = lease.ctypes.data
    del lease, pin
    gc.collect()
    again, pin = pool.lease_to_pin(110 * MIB)  # kept, pinned: nothing to do
    assert pin is None and again.ctypes.data == address and pool.num_reused == 1
    del again
    gc.collect()
    pool.trim(0)
    assert driver.pinned == {}


def test_a_park_takes_the_spare_being_made_and_its_pin_waits_for_the_helper(driver):
    pool = PinnedPool(FakeRuntime(), max_idle_bytes=64 * MIB)
    driver.gate.clear()
    driver.gate_bytes = 192 * MIB  # the spare's registration waits
    first, pin = pool.lease_to_pin(100 * MIB)
    assert _pin_on(pin)
    t0 = time.monotonic()
    second, pin = pool.lease_to_pin(110 * MIB)  # the spare being made: taken, not waited for
    # (waiting would last until the gate opens, which nothing here does: 1 s is room for a
    # loaded CI machine, not a bound on the lease)
    assert time.monotonic() - t0 < 1.0 and pin is not None and pool.num_waited == 1
    threading.Timer(0.2, driver.gate.set).start()
    t0 = time.monotonic()
    assert _pin_on(pin) and time.monotonic() - t0 >= 0.15
    assert driver.pinned[second.ctypes.data] == 192 * MIB
    assert driver.threads.count("pinned-pool") >= 1 and driver.threads.count("kv-copies") == 1
    pool.settle()
    assert pool.num_made_ahead >= 1 and pool.num_made_later == 1
    del first, second, pin
    gc.collect()
    pool.trim(0)
    pool.settle()
    assert driver.pinned == {}


def test_a_pin_refused_on_the_copy_thread_leaves_pageable_memory_and_parks_their_own(
        driver, caplog):
    pool = PinnedPool(FakeRuntime(), max_idle_bytes=64 * MIB, make_ahead=False)
    driver.refuse_over = 50 * MIB
    with caplog.at_level(logging.INFO, "strata.backends.cuda.host_pool"):
        lease, pin = pool.lease_to_pin(100 * MIB)
        assert not _pin_on(pin)
    assert "was refused" in caplog.text and driver.pinned == {}
    lease[:] = 1  # still memory the copies can land in
    assert pool.lease_to_pin(10 * MIB) is None  # the parks copy through memory of their own
    del lease, pin
    gc.collect()
    assert pool._blocks == [] and pool.num_made == 0
