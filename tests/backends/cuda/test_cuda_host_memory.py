"""The pinned host buffer of the experts in RAM (host_memory.PinnedBuffer): huge pages registered
with cuMemHostRegister by default, cuMemHostAlloc's pages with STRATA_HOST_PAGES=small; either
way the GPU reads the bytes the host wrote through the buffer's device address."""
import numpy as np
import pytest

from strata.backends.cuda.host_memory import ENV_PAGES, PinnedBuffer

MIB = 1 << 20


def _read_back(runtime, buf: PinnedBuffer) -> np.ndarray:
    """The buffer's bytes as a kernel sees them: copied from its device address to VRAM and
    back (a device-to-device copy reads the mapped host memory over PCIe)."""
    drv = runtime.drv
    dev = drv.mem_alloc(buf.array.nbytes)
    drv.memcpy_dtod(dev, buf.device, buf.array.nbytes)
    out = np.empty(buf.array.nbytes, np.uint8)
    drv.memcpy_dtoh(out, dev)
    dev.free()
    return out


@pytest.mark.parametrize("pages", ["huge", "small"])
def test_the_gpu_reads_what_the_host_wrote(runtime, monkeypatch, pages):
    monkeypatch.setenv(ENV_PAGES, pages)
    buf = PinnedBuffer(runtime.drv, (24, 3 * MIB))                # [slots, slot bytes]
    assert buf.array.shape == (24, 3 * MIB) and buf.pages == pages
    rng = np.random.default_rng(0)
    buf.array[:] = rng.integers(0, 256, size=buf.array.shape, dtype=np.uint8)
    assert np.array_equal(_read_back(runtime, buf), buf.array.reshape(-1))
    if pages == "huge":
        assert buf.array.ctypes.data % (2 * MIB) == 0
        backed = buf.huge_page_bytes()
        assert backed is None or 0 <= backed <= buf.array.nbytes


def test_a_dropped_buffer_is_unpinned_and_another_takes_its_place(runtime, monkeypatch):
    """Buffers come and go (one per offloaded model): dropping one unregisters it before its
    memory is unmapped, so many in turn neither fail nor leak the pin."""
    monkeypatch.setenv(ENV_PAGES, "huge")
    for i in range(4):
        buf = PinnedBuffer(runtime.drv, (64 * MIB,))
        buf.array[::4096] = i
        assert np.array_equal(_read_back(runtime, buf)[::4096], buf.array[::4096])
        del buf


def test_pinned_while_pins_touching_ranges_once_and_unpins_them(runtime, monkeypatch):
    from strata._native import cuda_driver
    from strata.backends.cuda import host_memory
    from strata.model.host_pages import anonymous_array

    calls = []
    real = cuda_driver.host_register
    monkeypatch.setattr(cuda_driver, "host_register",
                        lambda ptr, n: calls.append((ptr, n)) or real(ptr, n))
    out = anonymous_array(8 * MIB).view(np.float16).reshape(2, 4, -1)  # [K/V, ...] as a park's
    with runtime.active():
        with host_memory.pinned_while(out[0], out[1]):
            pass
        assert calls == [(out.ctypes.data, 8 * MIB)]  # the two halves touch: one range
        # unpinned after the block: the same range pins again
        with host_memory.pinned_while(out):
            pass
        apart = [np.empty(3 * MIB + 5, np.uint8), np.empty(MIB, np.uint8)]
        with host_memory.pinned_while(*apart):
            pass
        # a range the driver refuses (pinned already) leaves the copies unpinned, no error
        with host_memory.pinned_while(out[0]), host_memory.pinned_while(out[0]):
            pass


def test_the_pool_reuses_a_given_back_block_and_trims_idle_ones(runtime, monkeypatch):
    import gc

    from strata.backends.cuda import host_pool

    monkeypatch.setattr(host_pool, "SETTLE_S", 0.0)
    pool = host_pool.PinnedPool(runtime, max_idle_bytes=200 * MIB, make_ahead=False)
    with runtime.active():
        first = pool.lease(100 * MIB)
        assert first is not None and first.ctypes.data % (2 * MIB) == 0
        view = first.view(np.float16).reshape(2, -1)[1]  # a park's values half
        address = first.ctypes.data
        del first
        gc.collect()
        assert pool.leased_bytes == 128 * MIB  # the view keeps the lease
        view[:] = 1
        del view
        gc.collect()
        assert pool.idle_bytes == 128 * MIB
        again = pool.lease(90 * MIB)  # fits the idle block: the same pinned pages
        assert again.ctypes.data == address and pool.num_reused == 1
        big = pool.lease(300 * MIB)  # a new block, with room to grow: 375 MiB rounded up
        assert pool.num_made == 2 and pool.leased_bytes == 128 * MIB + 384 * MIB
        # the GPU writes a pinned lease by DMA: bytes land exactly
        src = runtime.drv.to_device(np.arange(1000, dtype=np.uint8))
        runtime.drv.memcpy_dtoh(big[:1000], src)
        assert np.array_equal(big[:1000], np.arange(1000, dtype=np.uint8))
        del again, big
        gc.collect()
        pool.trim()  # 512 MiB idle, 200 allowed: the 384 MiB block goes
        assert pool.idle_bytes == 128 * MIB and len(pool._blocks) == 1
        pool.trim(0)
        assert pool._blocks == []


def test_a_conversation_that_grew_parks_into_its_old_block(runtime, monkeypatch):
    import gc

    from strata.backends.cuda import host_pool

    monkeypatch.setattr(host_pool, "SETTLE_S", 0.0)
    pool = host_pool.PinnedPool(runtime, max_idle_bytes=1024 * MIB, make_ahead=False)
    with runtime.active():
        first = pool.lease(300 * MIB)  # made with room to grow: 375 MiB, rounded up to 384
        address = first.ctypes.data
        del first
        gc.collect()
        grown = pool.lease(370 * MIB)  # the same conversation a few turns on
        assert grown.ctypes.data == address and pool.num_made == 1 and pool.num_reused == 1
        del grown
        gc.collect()
        pool.trim(0)


def test_the_spare_pinned_on_the_helper_thread_takes_a_grown_park_by_dma(runtime, monkeypatch):
    import gc

    from strata.backends.cuda import host_pool

    monkeypatch.setattr(host_pool, "SETTLE_S", 0.0)
    pool = host_pool.PinnedPool(runtime, max_idle_bytes=64 * MIB)
    with runtime.active():
        first = pool.lease(100 * MIB)  # 128 MiB; the helper thread pins a 192 MiB spare
        pool.settle()
        assert pool.num_made_ahead == 1 and pool.idle_bytes == 192 * MIB
        del first
        gc.collect()
        grown = pool.lease(150 * MIB)  # outgrew its block: the spare, no wait
        assert pool.num_made - pool.num_made_ahead == 1 and pool.num_waited == 0
        # pinned in the pool's context from the other thread: the GPU writes it by DMA
        data = np.arange(1 << 20, dtype=np.uint8) * 7
        src = runtime.drv.to_device(data)
        runtime.drv.memcpy_dtoh(grown[-(1 << 20):], src)
        assert np.array_equal(grown[-(1 << 20):], data)
        pool.settle()
        del grown
        gc.collect()
        pool.trim(0)
        assert pool._blocks == []
