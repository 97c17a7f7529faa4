"""host_pages: anonymous memory asked for huge pages (the CPU's weights read into RAM, the
pinned experts in RAM), huge_page_bytes, which the experts-in-RAM log line reads (it counts the
huge pages of the mappings inside a range from /proc/self/smaps), and available_bytes."""
import sys

import pytest

from strata.model.host_pages import (HUGE_PAGE_BYTES, anonymous_array, available_bytes,
                                     huge_page_bytes, owns_pages)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="reads /proc/self/smaps")


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return "absent"
    return text.split("[", 1)[1].split("]", 1)[0]


def _rollup_huge_bytes() -> int:
    """The process's AnonHugePages in all, from smaps_rollup: a check independent of ranges."""
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) * 1024
    return 0


def test_memory_of_its_own_mapping_is_told_from_the_heap(tmp_path):
    import numpy as np

    from strata.engine.kv_file import read_kv_file, write_kv_file

    cells = anonymous_array(3 * 4096).view(np.float16).reshape(2, 3, -1)
    assert owns_pages(cells) and owns_pages(cells[1, :, 5:])      # views of it too
    heap = np.zeros(3 * 4096, np.float16)
    assert not owns_pages(heap) and not owns_pages(heap[10:].reshape(-1, 2))
    assert not owns_pages(np.array(cells))                        # a copy is the heap's
    # a conversation file's arrays of over 1 MiB come back in mappings of their own; the
    # small ones (whole pages there would take in the heap's neighbours) in the heap
    big, small = np.arange(2**19, dtype=np.float32), np.arange(7, dtype=np.float32)
    write_kv_file(tmp_path / "c.kv", [1, 2], (big, small), {})
    _, (big_read, small_read) = read_kv_file(tmp_path / "c.kv")
    assert np.array_equal(big_read, big) and np.array_equal(small_read, small)
    assert owns_pages(big_read) and not owns_pages(small_read)


def test_a_range_no_mapping_holds_counts_nothing():
    assert huge_page_bytes(0, 4096) == 0


def test_a_private_mapping_asked_for_huge_pages_gets_them_where_the_kernel_gives_them():
    nbytes = 16 * HUGE_PAGE_BYTES
    view = anonymous_array(nbytes)
    start = view.ctypes.data
    assert view.nbytes == nbytes and start % HUGE_PAGE_BYTES == 0
    assert huge_page_bytes(start, start + nbytes) == 0           # nothing touched yet
    view[::4096] = 1
    backed = huge_page_bytes(start, start + nbytes)
    assert 0 <= backed <= nbytes + 2 * HUGE_PAGE_BYTES           # whole mappings are counted
    if _thp_mode() in ("always", "madvise"):
        if backed == 0 and _rollup_huge_bytes() < nbytes // 2:
            pytest.skip("THP is on but the kernel gave no huge page (fragmented memory?)")
        assert backed >= HUGE_PAGE_BYTES and backed % HUGE_PAGE_BYTES == 0
    del view


def test_anonymous_memory_is_private_writable_and_kept_by_its_views():
    view = anonymous_array(3 * 4096 + 5)
    view[:] = 7
    part = view[4096:8192]
    del view
    assert part.sum() == 7 * 4096                                 # the view keeps the mapping


def test_available_memory_is_a_positive_byte_count():
    available = available_bytes()
    assert available is not None and 0 < available < 1 << 50


def test_a_range_inside_a_mapping_counts_at_most_its_own_bytes():
    view = anonymous_array(8 * HUGE_PAGE_BYTES)
    view[::4096] = 1
    start = view.ctypes.data + 2 * HUGE_PAGE_BYTES
    assert 0 <= huge_page_bytes(start, start + HUGE_PAGE_BYTES) <= HUGE_PAGE_BYTES
    del view


def test_memory_under_a_huge_page_takes_only_its_own_pages():
    """A park of a short conversation (a few KiB) held a whole 2 MiB huge page: a conversation
    cache of short ones took over ten times its --cache-ram budget in RSS."""
    view = anonymous_array(64 * 1024)
    view[:] = 1
    start = view.ctypes.data
    assert huge_page_bytes(start, start + view.nbytes) == 0   # not a 2 MiB page for 64 KiB
    big = anonymous_array(3 * HUGE_PAGE_BYTES + 4096)
    big[::4096] = 1
    tail = big.ctypes.data + 3 * HUGE_PAGE_BYTES
    assert huge_page_bytes(tail, tail + 4096) == 0            # nor for a tail under one
