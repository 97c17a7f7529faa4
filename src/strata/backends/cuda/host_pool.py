"""Pinned host blocks kept for parks (`CudaKV.export_prefix`): a park copies gigabytes of KV
from the GPU into host memory, and fresh memory first has to be faulted in, zeroed and pinned
(~0.4 s of a 2.5 GiB park on the H200 host, the DMA itself ~0.05 s). A block given back (the
parked arrays dropped: restored, evicted or written) is kept pinned for the next park, up to
`max_idle_bytes` of idle blocks; the rest are unpinned and unmapped.

A lease is an ndarray made with `np.frombuffer` straight on the block's mapping, so every view
of it keeps it alive (numpy stops collapsing a view's base at the mapping) and its finalizer
says when the last view is gone.

A block is unpinned before its pages can be unmapped, whatever happens first: a trim, or the
pool going (a finalizer on an array of the block's own, which dies before the mapping it
holds). A mapping unmapped while still registered leaves the driver holding that address
range, and a later pinning that reuses it fails ("resource already mapped").

Made ahead (`MAKE_AHEAD`): a park that finds no kept block needs a new one pinned (0.4-0.5 s
for 2 GiB) before its copies can start. So after every lease a helper thread makes a spare
block, unless an idle one is there already, large enough (and not twice
too large) for the largest recent park grown twice by `GROWTH_HEADROOM` (a conversation that
outgrew its own block, or a new one of the size agents have had). Where the idle limit leaves
no room for it, idle blocks smaller than each recent park (outgrown: agents' conversations
grow) make room; a trim gives them up first too. A lease that finds nothing takes the spare
being made when it will fit, rather than make another. The helper also unpins and unmaps
the blocks a trim drops. Its pinning runs in the pool's context, current in that thread too.

Pinned later (`lease_to_pin`): a park that finds no kept block (the first of a run, a much
longer conversation than the spare was made for) gets a block that is only mapped, with a
function that faults it in and pins it; the copy thread (kv_copies.py) calls it before the
park's copies, so the engine thread and the other slots' windows no longer wait for it (they
did until session 55). A park that takes the spare being made gets a function that waits
for the helper instead. `lease` pins (or waits) before it returns. Where the driver refuses
the pin, the copies still land (through the driver's staging buffers) and the block goes when
given back.
"""
from __future__ import annotations

import collections
import functools
import logging
import mmap
import queue
import threading
import time
import weakref
from collections.abc import Callable

import numpy as np

from strata.model.host_pages import HUGE_PAGE_BYTES

log = logging.getLogger(__name__)

BLOCK_ROUND_BYTES = 64 * 2**20  # block sizes are multiples of this
# A new block holds this much more than the park it is made for: a conversation parks again
# a few turns longer (an agent's turn adds hundreds to thousands of tokens), and a block too
# small for that means a fresh one, faulted in and pinned on the engine thread (0.42-0.46 s
# for 2 GiB on the H200 host, against ~0.04 s for the copy into a kept block)
GROWTH_HEADROOM = 0.25
DEFAULT_MAX_IDLE_BYTES = 4 * 2**30
# a block given back this recently is not unmapped yet (its last view may still be releasing
# its hold on the mapping in another thread)
SETTLE_S = 1.0
MAKE_AHEAD = True  # a spare block made by the helper thread after a lease (above)
# the spare is sized for the largest of these many last parks; an idle block smaller than
# each of them is outgrown (agents taking turns grow their conversations: none of them parks
# into it again) and makes room for the spare
RECENT_LEASES = 4
MADE_AHEAD_WAIT_S = 30.0  # a lease waits at most this long for the spare being made


class _Block:
    """A block's mapping (made at once); `pin` faults it in and pins it (~0.4 s a 2.5 GiB)."""

    def __init__(self, capacity: int, rt):
        self.capacity = capacity
        self.area = mmap.mmap(-1, capacity + HUGE_PAGE_BYTES,
                              flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            self.area.madvise(mmap.MADV_HUGEPAGE)
        if hasattr(mmap, "MADV_DONTFORK"):
            self.area.madvise(mmap.MADV_DONTFORK)
        probe = np.frombuffer(self.area, np.uint8)
        self.offset = -probe.ctypes.data % HUGE_PAGE_BYTES
        self.address = probe.ctypes.data + self.offset
        self._holder = probe  # its finalizer unpins the block before the mapping can go
        self.unpin = None
        self.rt = rt
        self.is_leased = False
        self.is_claimed = False  # a thread pins it (or has)
        self.pinned = threading.Event()  # set once `pin` has run, pinned or refused
        self.is_pinned = False
        self.freed_at = 0.0

    def pin(self) -> None:
        """Fault the pages in (huge ones where the kernel gives them) and pin them in the
        current context; raises what the driver refused."""
        from strata._native import cuda_driver

        try:
            self._holder[self.offset::4096] = 0
            cuda_driver.host_register(self.address, self.capacity)
            self.unpin = weakref.finalize(self._holder, _unregister, self.rt, self.address)
            self.is_pinned = True
        finally:
            self.pinned.set()

    @property
    def is_refused(self) -> bool:
        return self.pinned.is_set() and not self.is_pinned


class PinnedPool:
    """Pinned host blocks of one CUDA context. `lease` and `trim` run on the engine thread; a
    lease's finalizer only marks its block free; a helper thread makes the spare and drops
    what a trim gives up."""

    def __init__(self, rt, max_idle_bytes: int = DEFAULT_MAX_IDLE_BYTES,
                 make_ahead: bool | None = None):
        self.rt = rt  # the context the blocks are pinned in
        self.max_idle_bytes = int(max_idle_bytes)
        self.make_ahead = MAKE_AHEAD if make_ahead is None else bool(make_ahead)
        self._blocks: list[_Block] = []
        self._lock = threading.Lock()
        self._recent = collections.deque(maxlen=RECENT_LEASES)  # the last leases' bytes
        self._making: _Block | None = None  # the spare the helper is pinning
        self._tasks: queue.Queue | None = None  # the helper thread's, made on first use
        self.num_made = self.num_reused = 0
        self.num_made_ahead = 0  # of num_made, by the helper thread
        self.num_made_later = 0  # of num_made, by lease_to_pin's `pin` (the copy thread)
        self.num_waited = 0  # leases that took the spare being made
        self._is_refused = False  # logged once

    def lease(self, nbytes: int) -> np.ndarray | None:
        """`nbytes` of pinned memory (uint8) on a 2 MiB boundary; None when the driver refuses
        to pin a new block (the caller copies through unpinned memory then)."""
        got = self.lease_to_pin(nbytes)
        if got is None:
            return None
        lease, pin = got
        if pin is not None and not pin.func(*pin.args, later=False):
            return None  # the block goes with the lease
        return lease

    def lease_to_pin(self, nbytes: int) -> tuple[np.ndarray, Callable[[], bool] | None] | None:
        """(lease, pin): `nbytes` (uint8) on a 2 MiB boundary of a block that is pinned when
        `pin` is None, else once `pin()` has run, in the pool's context, on any thread (it
        pins the block, or waits for the helper pinning it; False when the driver refused: the
        lease is pageable memory then). None once the driver has refused a block: the caller
        copies through memory of its own."""
        nbytes = int(nbytes)
        if self._is_refused:
            return None
        self.trim()
        block = self._take_kept(nbytes) or self._take_spare_being_made(nbytes)
        if block is None:
            try:
                block = _Block(_capacity_for(nbytes), self.rt)
            except OSError as exc:  # no memory to map
                self._refused(None, _capacity_for(nbytes), exc, ahead=False)
                return None
            block.is_leased = True
            with self._lock:
                self._blocks.append(block)
        lease = np.frombuffer(block.area, np.uint8, count=nbytes, offset=block.offset)
        weakref.finalize(lease, self._give_back, block)
        self._recent.append(nbytes)
        if self.make_ahead:
            self.trim()  # the idle limit and what is outgrown follow the parks
            self._make_spare()
        return lease, (None if block.is_pinned else functools.partial(self._pin, block,
                                                                      later=True))

    def holds(self, *arrays: np.ndarray) -> bool:
        """Whether every one of `arrays` lies in a leased block (pinned, or pinned by the copy
        thread before the copies queued after the lease: DMA can read or write it while the
        engine goes on)."""
        with self._lock:
            spans = [(b.address, b.address + b.capacity) for b in self._blocks if b.is_leased]
        for array in arrays:
            start = array.__array_interface__["data"][0]
            stop = start + array.nbytes
            if not any(lo <= start and stop <= hi for lo, hi in spans):
                return False
        return True

    def _take_kept(self, nbytes: int) -> _Block | None:
        """The smallest idle pinned block that holds `nbytes` without wasting more than as
        much again, leased."""
        with self._lock:
            fits = [b for b in self._blocks if not b.is_leased and b.is_pinned and nbytes
                    <= b.capacity <= 2 * nbytes + BLOCK_ROUND_BYTES]
            block = min(fits, key=lambda b: b.capacity, default=None)
            if block is not None:
                block.is_leased = True
                self.num_reused += 1
        return block

    def _take_spare_being_made(self, nbytes: int) -> _Block | None:
        """The spare the helper is pinning, leased, when it holds `nbytes` (its `pin` waits for
        the helper): rather than make another."""
        with self._lock:
            block = self._making
            if block is None or block.is_leased or not (
                    nbytes <= block.capacity <= 2 * nbytes + BLOCK_ROUND_BYTES):
                return None
            block.is_leased = True
            self.num_waited += 1
            self._making = None  # the next spare is made after it
        return block

    def _pin(self, block: _Block, *, later: bool) -> bool:
        """Pin a leased `block` in this thread, or wait for the helper pinning it; whether it
        is pinned. `later`: after the lease, by the thread that copies into it."""
        with self._lock:
            is_mine = not block.is_claimed
            block.is_claimed = True
        if not is_mine:
            return block.pinned.wait(MADE_AHEAD_WAIT_S) and block.is_pinned
        try:
            with self.rt.active():
                block.pin()
        except Exception as exc:  # noqa: BLE001 - the locked-memory limit, no THP, ...
            self._refused(block, block.capacity, exc, ahead=False)
            return False
        with self._lock:
            self.num_made += 1
            self.num_made_later += later
        return True

    def _refused(self, block: _Block | None, capacity: int, exc: BaseException | str, *,
                 ahead: bool) -> None:
        """The driver refused to pin `block` (None: to map one): logged once; a block no lease
        holds goes at once, a leased one when given back."""
        exc = str(exc)  # not the exception: its traceback would hold the lease's frames
        if ahead:  # the parks still get blocks of their own size
            log.info("no pinned block made ahead of parks from now on: %.2f GiB was refused "
                     "(%s)", capacity / 2**30, exc)
            self.make_ahead = False
        elif not self._is_refused:
            log.info("parks copy through memory pinned for each copy: a pinned block of %.2f "
                     "GiB to keep was refused (%s)", capacity / 2**30, exc)
            self._is_refused = True
        if block is not None:
            block.pinned.set()  # (its context may have failed before `pin` ran)
            with self._lock:
                if not block.is_leased and block in self._blocks:
                    self._blocks.remove(block)

    def _spare_capacity(self) -> int:
        wanted = int(max(self._recent) * (1 + GROWTH_HEADROOM) ** 2)
        return -(-wanted // BLOCK_ROUND_BYTES) * BLOCK_ROUND_BYTES

    def _idle_limit(self) -> int:
        """Idle bytes kept: `max_idle_bytes`, or room for a spare and one park's block."""
        spare = self._spare_capacity() if self.make_ahead and self._recent else 0
        return max(self.max_idle_bytes, 2 * spare)

    def _make_spare(self) -> None:
        capacity = self._spare_capacity()
        with self._lock:
            if self._making is not None or self._spare_locked() is not None:
                return
            excess = self.idle_bytes_locked() + capacity - self._idle_limit()
            outgrown = self._outgrown_locked()
            if excess > sum(b.capacity for b in outgrown):
                return
            try:
                block = _Block(capacity, self.rt)  # mapped here, pinned by the helper
            except OSError:
                return
            dropped = []
            for old in outgrown:  # room for the spare: blocks no recent park fits in
                if excess <= 0:
                    break
                self._blocks.remove(old)
                excess -= old.capacity
                dropped.append(old)
            block.is_claimed = True
            self._blocks.append(block)
            self._making = block

        def make():
            try:
                _drop(dropped)
                with self.rt.active():
                    block.pin()
            except Exception as exc:  # noqa: BLE001 - the locked-memory limit, no THP, ...
                self._refused(block, capacity, exc, ahead=True)
            else:
                with self._lock:
                    self.num_made += 1
                    self.num_made_ahead += 1
                log.debug("a spare pinned block of %.2f GiB made ahead of the next park",
                          capacity / 2**30)
            finally:
                block.pinned.set()
                with self._lock:
                    if self._making is block:
                        self._making = None

        self._run(make)

    def _spare_locked(self) -> _Block | None:
        """The idle block that serves as the spare: the smallest pinned one of the spare's size
        or more that the largest recent park would still be leased (a far larger one, kept from
        longer conversations, is passed by by the parks to come: _take_kept)."""
        capacity, largest = self._spare_capacity(), max(self._recent)
        return min((b for b in self._blocks if not b.is_leased and b.is_pinned
                    and capacity <= b.capacity <= 2 * largest + BLOCK_ROUND_BYTES),
                   key=lambda b: b.capacity, default=None)

    def _outgrown_locked(self) -> list[_Block]:
        """Idle, settled blocks smaller than each recent park, largest first: conversations
        grow, so the parks to come will not fit in them."""
        if not self._recent:
            return []
        smallest, now = min(self._recent), time.monotonic()
        return sorted((b for b in self._blocks if not b.is_leased and b.is_pinned
                       and b.capacity < smallest and now - b.freed_at > SETTLE_S),
                      key=lambda b: b.capacity, reverse=True)

    def _run(self, task) -> None:
        """`task` on the helper thread (started on first use, ended when the pool goes)."""
        if self._tasks is None:
            self._tasks = queue.Queue()
            threading.Thread(target=_serve, args=(self._tasks,), name="pinned-pool",
                             daemon=True).start()
            weakref.finalize(self, self._tasks.put, None)
        self._tasks.put(task)

    def settle(self, timeout: float = 30.0) -> None:
        """Wait until the helper thread has done what it was given (tests, benchmarks)."""
        if self._tasks is not None:
            done = threading.Event()
            self._tasks.put(done.set)
            done.wait(timeout)

    def _give_back(self, block: _Block) -> None:
        with self._lock:
            block.is_leased = False
            block.freed_at = time.monotonic()
            if block.is_refused and block in self._blocks:  # no pin to undo: the mapping
                self._blocks.remove(block)  # goes with its last reference

    def idle_bytes_locked(self) -> int:
        return sum(b.capacity for b in self._blocks if not b.is_leased)

    @property
    def idle_bytes(self) -> int:
        with self._lock:
            return self.idle_bytes_locked()

    @property
    def leased_bytes(self) -> int:
        with self._lock:
            return sum(b.capacity for b in self._blocks if b.is_leased)

    def trim(self, max_idle_bytes: int | None = None) -> None:
        """Give up idle blocks until at most `max_idle_bytes` (default the pool's, or room for
        a spare and one park's block when more) are idle: first the outgrown ones, then largest
        first, the spare last (blocks whose pinning was refused go whatever the limit; the
        spare being pinned stays). The helper thread unpins and unmaps them when it runs (at
        once when `max_idle_bytes` is given)."""
        limit = self._idle_limit() if max_idle_bytes is None else int(max_idle_bytes)
        now = time.monotonic()
        with self._lock:
            # pinning refused: they go whatever the limit
            dropped = [b for b in self._blocks if not b.is_leased and b.is_refused]
            for block in dropped:
                self._blocks.remove(block)
            spare = self._spare_locked() if self.make_ahead and self._recent else None
            outgrown = self._outgrown_locked()
            idle = sorted((b for b in self._blocks if not b.is_leased and b.is_pinned
                           and b not in outgrown and b is not spare
                           and now - b.freed_at > SETTLE_S),
                          key=lambda b: b.capacity, reverse=True)
            if spare is not None and now - spare.freed_at > SETTLE_S:
                idle.append(spare)
            idle = outgrown + idle
            excess = sum(b.capacity for b in idle) - limit
            for block in idle:
                if excess <= 0:
                    break
                self._blocks.remove(block)
                excess -= block.capacity
                dropped.append(block)
        if not dropped:
            return
        if max_idle_bytes is None and self.make_ahead:
            self._run(lambda: _drop(dropped))
        else:
            _drop(dropped)


def _capacity_for(nbytes: int) -> int:
    """A new block's bytes for a park of `nbytes`: with room to grow, rounded up."""
    wanted = int(max(nbytes, 1) * (1 + GROWTH_HEADROOM))
    return -(-wanted // BLOCK_ROUND_BYTES) * BLOCK_ROUND_BYTES


def _drop(blocks: list[_Block]) -> None:
    """Unpin, then unmap, blocks taken out of a pool."""
    for block in blocks:
        if block.unpin is not None:  # pinned
            block.unpin()
        block._holder = None
        try:
            block.area.close()
        except BufferError:  # a view still holds it: the mapping goes with that view
            pass


def _serve(tasks: queue.Queue) -> None:
    """The helper thread: run tasks until a None; one that fails is logged, not fatal."""
    while (task := tasks.get()) is not None:
        try:
            task()
        except Exception:  # noqa: BLE001 - a spare not made is a park made on the engine thread
            log.exception("the pinned pool's helper thread")
        del task  # holds the pool until the next task otherwise


def _unregister(rt, address: int) -> None:
    """Unpin a block, in its context (a finalizer may run on any thread)."""
    from strata._native import cuda_driver

    try:
        with rt.active():
            cuda_driver.host_unregister(address)
    except Exception:  # noqa: BLE001 - the context is gone: the pin went with it
        pass
