"""host_memory.huge_page_bytes, which the experts-in-RAM log line reads (no GPU needed): it
counts the huge pages of the mappings inside a range from /proc/self/smaps."""
import mmap
import sys

import numpy as np
import pytest

from strata.backends.cuda.host_memory import HUGE_PAGE_BYTES, huge_page_bytes

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


def test_a_range_no_mapping_holds_counts_nothing():
    assert huge_page_bytes(0, 4096) == 0


def test_a_private_mapping_asked_for_huge_pages_gets_them_where_the_kernel_gives_them():
    nbytes = 16 * HUGE_PAGE_BYTES
    area = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    area.madvise(mmap.MADV_HUGEPAGE)
    raw = np.frombuffer(area, np.uint8)
    at = -raw.ctypes.data % HUGE_PAGE_BYTES
    view = raw[at:at + nbytes]
    start = view.ctypes.data
    assert huge_page_bytes(start, start + nbytes) == 0           # nothing touched yet
    view[::4096] = 1
    backed = huge_page_bytes(start, start + nbytes)
    assert 0 <= backed <= nbytes + 2 * HUGE_PAGE_BYTES           # whole mappings are counted
    if _thp_mode() in ("always", "madvise"):
        if backed == 0 and _rollup_huge_bytes() < nbytes // 2:
            pytest.skip("THP is on but the kernel gave no huge page (fragmented memory?)")
        assert backed >= HUGE_PAGE_BYTES and backed % HUGE_PAGE_BYTES == 0
    del view, raw
