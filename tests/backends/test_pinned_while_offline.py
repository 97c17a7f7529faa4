"""host_memory.pinned_while without a GPU driver: the pinning is refused, the block runs."""
import numpy as np

from strata.backends.cuda.host_memory import PAGE_BYTES, _page_range, pinned_while


def test_without_a_driver_the_copies_run_unpinned():
    a = np.arange(10.0)
    with pinned_while(a, a[2:5], np.empty(0)):
        a[0] = 5.0
    assert a[0] == 5.0


def test_page_ranges_cover_the_array():
    a = np.empty(3 * PAGE_BYTES + 17, np.uint8)[5:]
    low, high = _page_range(a)
    assert low % PAGE_BYTES == 0 and high % PAGE_BYTES == 0
    assert low <= a.ctypes.data and a.ctypes.data + a.nbytes <= high < low + 5 * PAGE_BYTES
