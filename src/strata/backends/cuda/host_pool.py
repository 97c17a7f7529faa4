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
"""
from __future__ import annotations

import logging
import mmap
import threading
import time
import weakref

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


class _Block:
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
        probe[self.offset::4096] = 0  # the pages come in (huge ones where the kernel gives them)
        self._holder = probe  # its finalizer unpins the block before the mapping can go
        self.unpin = None
        self.rt = rt
        self.is_leased = False
        self.freed_at = 0.0


class PinnedPool:
    """Pinned host blocks of one CUDA context. `lease` and `trim` run with the context current
    (the engine thread); a lease's finalizer only marks its block free."""

    def __init__(self, rt, max_idle_bytes: int = DEFAULT_MAX_IDLE_BYTES):
        self.rt = rt  # the context the blocks are pinned in
        self.max_idle_bytes = int(max_idle_bytes)
        self._blocks: list[_Block] = []
        self._lock = threading.Lock()
        self.num_made = self.num_reused = 0
        self._is_refused = False  # logged once

    def lease(self, nbytes: int) -> np.ndarray | None:
        """`nbytes` of pinned memory (uint8) on a 2 MiB boundary; None when the driver refuses
        to pin a new block (the caller copies through unpinned memory then)."""
        from strata._native import cuda_driver

        nbytes = int(nbytes)
        if self._is_refused:
            return None
        self.trim()
        with self._lock:
            fits = [b for b in self._blocks if not b.is_leased and nbytes <= b.capacity
                    <= 2 * nbytes + BLOCK_ROUND_BYTES]
            block = min(fits, key=lambda b: b.capacity, default=None)
            if block is not None:
                block.is_leased = True
                self.num_reused += 1
        if block is None:
            wanted = int(max(nbytes, 1) * (1 + GROWTH_HEADROOM))
            capacity = -(-wanted // BLOCK_ROUND_BYTES) * BLOCK_ROUND_BYTES
            try:
                block = _Block(capacity, self.rt)
                cuda_driver.host_register(block.address, capacity)
                block.unpin = weakref.finalize(block._holder, _unregister, self.rt,
                                               block.address)
            except Exception as exc:  # noqa: BLE001 - the locked-memory limit, no THP, ...
                if not self._is_refused:
                    log.info("parks copy through memory pinned for each copy: a pinned block "
                             "of %.2f GiB to keep was refused (%s)", capacity / 2**30, exc)
                    self._is_refused = True
                return None
            block.is_leased = True
            with self._lock:
                self._blocks.append(block)
                self.num_made += 1
        lease = np.frombuffer(block.area, np.uint8, count=nbytes, offset=block.offset)
        weakref.finalize(lease, self._give_back, block)
        return lease

    def _give_back(self, block: _Block) -> None:
        with self._lock:
            block.is_leased = False
            block.freed_at = time.monotonic()

    @property
    def idle_bytes(self) -> int:
        with self._lock:
            return sum(b.capacity for b in self._blocks if not b.is_leased)

    @property
    def leased_bytes(self) -> int:
        with self._lock:
            return sum(b.capacity for b in self._blocks if b.is_leased)

    def trim(self, max_idle_bytes: int | None = None) -> None:
        """Unpin and unmap idle blocks, largest first, until at most `max_idle_bytes` (default
        the pool's) are idle."""
        limit = self.max_idle_bytes if max_idle_bytes is None else int(max_idle_bytes)
        now = time.monotonic()
        with self._lock:
            idle = sorted((b for b in self._blocks
                           if not b.is_leased and now - b.freed_at > SETTLE_S),
                          key=lambda b: b.capacity, reverse=True)
            excess = sum(b.capacity for b in idle) - limit
            dropped = []
            for block in idle:
                if excess <= 0:
                    break
                self._blocks.remove(block)
                excess -= block.capacity
                dropped.append(block)
        for block in dropped:
            block.unpin()
            block._holder = None
            try:
                block.area.close()
            except BufferError:  # a view still holds it: the mapping goes with that view
                pass


def _unregister(rt, address: int) -> None:
    """Unpin a block, in its context (a finalizer may run on any thread)."""
    from strata._native import cuda_driver

    try:
        with rt.active():
            cuda_driver.host_unregister(address)
    except Exception:  # noqa: BLE001 - the context is gone: the pin went with it
        pass
