"""Pinned host memory that the GPU reads over PCIe and the CPU pool computes from: the experts in
RAM (offload.HostExperts).

Where the kernel gives transparent huge pages (Linux, THP `always` or `madvise`) the buffer is
anonymous memory asked for them (madvise) and then pinned and mapped by cuMemHostRegister;
elsewhere, or when the driver refuses that, cuMemHostAlloc's memory (4 KiB pages). The CPU
pool reads its experts faster from huge pages: fewer TLB misses and page walks in 1 GB of
expert bytes per decode token (docs/offload.md, "Huge pages"). STRATA_HOST_PAGES=small keeps
cuMemHostAlloc's pages (to measure one against the other).
"""
from __future__ import annotations

import contextlib
import logging
import mmap
import os
import weakref

import numpy as np
from numpy.lib.array_utils import byte_bounds

from strata.model.host_pages import anonymous_array, huge_page_bytes

log = logging.getLogger(__name__)

ENV_PAGES = "STRATA_HOST_PAGES"
PAGE_BYTES = mmap.PAGESIZE


class PinnedBuffer:
    """`nbytes` of pinned host memory mapped into the current context: `array` (uint8, shaped
    as asked), `device` (its device address) and `pages` ("huge" or "small")."""

    def __init__(self, drv, shape, *, progress_name: str = "buffer"):
        nbytes = int(np.prod(shape))
        self.array, self.device, self.pages = None, 0, "small"
        if os.environ.get(ENV_PAGES, "huge") != "small" and hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                self._huge(nbytes)
            except Exception as exc:  # mmap / madvise / cuMemHostRegister refused
                log.info("%s: huge pages not used (%s); cuMemHostAlloc's pages instead",
                         progress_name, exc)
                self.array = None
        if self.array is None:
            buf = drv.pagelocked_empty(nbytes, np.uint8, mem_flags=drv.host_alloc_flags.DEVICEMAP)
            self.array, self._owner = buf, buf
            try:
                self.device = int(buf.base.get_device_pointer())
            except Exception:  # without the allocation object: unified addressing maps 1:1
                self.device = int(buf.ctypes.data)
        self.array = self.array.reshape(shape)

    def _huge(self, nbytes: int) -> None:
        from strata._native import cuda_driver

        view = anonymous_array(nbytes, dontfork=True)
        raw = view.base                                           # owns the mapping
        # the pages come in here (huge ones where the kernel gives them), then are pinned
        view[::4096] = 0
        address = int(view.ctypes.data)
        self.device = int(cuda_driver.host_register(address, nbytes))
        # unpinned when the last view of the memory goes (before it is unmapped)
        weakref.finalize(raw, _unregister, address).atexit = False
        self.array, self._owner, self.pages = view, raw, "huge"

    def huge_page_bytes(self) -> int | None:
        """Bytes of the buffer the kernel backs with huge pages now (None: not known here)."""
        start = int(self.array.ctypes.data)
        return huge_page_bytes(start, start + self.array.nbytes)


@contextlib.contextmanager
def pinned_while(*arrays: np.ndarray):
    """Pin the pages under `arrays` for a block of copies, so that cuMemcpy moves them by DMA
    instead of through the driver's staging buffer (pageable memory copied at ~2-6 GB/s on the
    H200 host). Ranges that touch are pinned as one. Where the driver refuses (the locked-memory
    limit, a range pinned already) the copies run as they would have, unpinned."""
    from strata._native import cuda_driver

    merged: list[list[int]] = []
    for low, high in sorted(_page_range(a) for a in arrays if a.nbytes):
        if merged and low <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], high)
        else:
            merged.append([low, high])
    pinned = []
    try:
        for low, high in merged:
            try:
                cuda_driver.host_register(low, high - low)
                pinned.append(low)
            except Exception as exc:  # noqa: BLE001 - the copies run unpinned then
                log.debug("host copies unpinned (%.1f MiB): %s", (high - low) / 2**20, exc)
        yield
    finally:
        for low in pinned:
            _unregister(low)


def _page_range(array: np.ndarray) -> tuple[int, int]:
    low, high = byte_bounds(array)
    return low - low % PAGE_BYTES, -(-high // PAGE_BYTES) * PAGE_BYTES


def _unregister(address: int) -> None:
    from strata._native import cuda_driver

    try:
        cuda_driver.host_unregister(address)
    except Exception:  # the context is gone already: the driver released the pin with it
        pass
