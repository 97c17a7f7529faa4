"""Device allocations (runtime.DeviceMemory) are given back to the GPU whichever thread drops
them: a model-like cycle collected by the cyclic GC in a thread where the context is not
current (the HTTP server's, the conversation files' I/O threads) frees its VRAM. With PyCUDA's
own allocations that memory stayed taken ("device_allocation in out-of-thread context could
not be cleaned up")."""
import gc

import numpy as np
import pytest
from gc_threads import collect_in_a_thread

pytestmark = pytest.mark.cuda

GIB = 2**30


class _Holder:
    pass


def test_a_cycle_collected_in_another_thread_gives_its_vram_back(runtime):
    gc.collect()
    free_before, _ = runtime.free_bytes()
    holder = _Holder()
    holder.me = holder
    holder.buf = runtime.alloc(GIB)
    holder.copy = runtime.upload(np.arange(1 << 20, dtype=np.float32))
    assert runtime.free_bytes()[0] <= free_before - GIB
    del holder
    collect_in_a_thread()
    free_after, _ = runtime.free_bytes()
    assert free_after >= free_before - 64 * 2**20, (free_before, free_after)


def test_the_address_works_as_before(runtime):
    buf = runtime.upload(np.arange(1024, dtype=np.int32))
    out = np.empty(512, np.int32)
    runtime.drv.memcpy_dtoh(out, int(buf) + 2048)  # an offset into it
    assert np.array_equal(out, np.arange(512, 1024, dtype=np.int32))
    buf.free()
    buf.free()  # once
