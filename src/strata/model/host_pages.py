"""Anonymous host memory asked for transparent huge pages: the model's tensors read into RAM
(`--no-mmap`, gguf_file.GGUFModel.load_into_memory) and the pinned experts in RAM of the CUDA
backend (backends/cuda/host_memory.py).

A decode token reads every weight byte once, so the CPU kernels walk gigabytes of weights per
second; 2 MiB pages need fewer TLB entries and page walks for that than the 4 KiB pages of a
file's mapping (measured gains: docs/DEVELOPING.md, "Weights in RAM").
"""
from __future__ import annotations

import mmap

import numpy as np

HUGE_PAGE_BYTES = 2 << 20


def anonymous_array(nbytes: int, *, dontfork: bool = False) -> np.ndarray:
    """`nbytes` of private anonymous memory as a uint8 array starting on a 2 MiB boundary, asked
    for huge pages (the kernel backs them where THP is `always` or `madvise`); the array keeps
    the mapping alive, and its pages come in as they are first written. `dontfork`: a forked
    child does not get the pages (pinned memory must not be shared copy-on-write). Where the
    platform has no anonymous mappings, numpy's own memory."""
    if not hasattr(mmap, "MAP_ANONYMOUS"):
        return np.empty(nbytes, np.uint8)
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    if nbytes < HUGE_PAGE_BYTES:
        # Less than a huge page (a short conversation's park): 4 KiB pages of a mapping of its
        # own. A huge page would hold 2 MiB of RAM for it: a conversation cache full of short
        # ones took over ten times its --cache-ram budget.
        area = mmap.mmap(-1, max(nbytes, 1), flags=flags)
        if hasattr(mmap, "MADV_NOHUGEPAGE"):
            area.madvise(mmap.MADV_NOHUGEPAGE)
        if dontfork and hasattr(mmap, "MADV_DONTFORK"):
            area.madvise(mmap.MADV_DONTFORK)
        return np.frombuffer(area, np.uint8)[:nbytes]         # keeps `area` alive
    # private: a shared anonymous mapping is shmem, which THP leaves alone by default
    area = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=flags)
    raw = np.frombuffer(area, np.uint8)                       # keeps `area` alive
    at = -raw.ctypes.data % HUGE_PAGE_BYTES                   # the first 2 MiB boundary
    if hasattr(mmap, "MADV_HUGEPAGE"):
        # whole huge pages only: a tail short of one stays in 4 KiB pages, not 2 MiB of RAM
        area.madvise(mmap.MADV_HUGEPAGE, at, nbytes // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES)
    if dontfork and hasattr(mmap, "MADV_DONTFORK"):
        area.madvise(mmap.MADV_DONTFORK)
    return raw[at:at + nbytes]


def owns_pages(array: np.ndarray) -> bool:
    """Whether `array` lies in a memory mapping of its own (`anonymous_array`'s, or a file's
    mapping), where no other object shares its pages: pinning whole pages around it (the CUDA
    backend's queued copies) then touches nothing else. Numpy's own memory comes from the
    heap, where a page may also hold another array that is being copied meanwhile."""
    root = array
    while isinstance(root, np.ndarray) and root.base is not None:
        root = root.base
    if isinstance(root, memoryview):
        root = root.obj
    return isinstance(root, mmap.mmap)


def huge_page_bytes(start: int, stop: int) -> int | None:
    """AnonHugePages of the mappings of this process inside [start, stop), from
    /proc/self/smaps (None where that file cannot be read). A mapping that reaches past the
    range (the kernel merges neighbouring mappings of the same kind) counts at most its
    overlap with it: smaps does not say where in a mapping its huge pages lie."""
    try:
        with open("/proc/self/smaps") as smaps:
            lines = smaps.read().splitlines()
    except OSError:
        return None
    total, overlap = 0, 0
    for line in lines:
        head = line.split(" ", 1)[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(v, 16) for v in head.split("-"))
            overlap = max(0, min(hi, stop) - max(lo, start))
        elif overlap and line.startswith("AnonHugePages:"):
            total += min(int(line.split()[1]) * 1024, overlap)
    return total


def available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo: what the kernel can hand out without swapping, the page
    cache it can drop included (None where that file cannot be read)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
