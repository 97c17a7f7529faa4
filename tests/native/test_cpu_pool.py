"""The CPU pool against a float64 reference: a Python thread plays the GPU's part of the exchange
protocol (x/ids/wts then ready[l], wait for done[l]) and the pool serves the CPU-assigned pairs."""
import os
import threading
import time

import numpy as np
import pytest

from strata._native import kernels
from strata.backends.cuda.cpu_pool import CpuPool, CpuPoolError
from strata.backends.cuda.exchange import (WHERE_CPU, WHERE_PCIE, WHERE_VRAM, Exchange,
                                           ExchangeLayout)

from .helpers import T
from .test_moe import make_moe, reference, scaled_x

# Legend: L = layers, E = experts, H = hidden, F = expert width, K = experts per row, R = rows.
L, E, H, F, K, R_MAX = 3, 8, 64, 96, 3, 6
LAYER_TYPES = [(T.Q8_0, T.Q8_0, T.Q8_0), (T.Q4_0, T.F16, T.Q8_0), (T.F32, T.F32, T.F32)]


def make_experts(rng):
    """Per-layer expert tensors [E, rows, row_bytes] and their pointer table [L, 3, E]."""
    layers = [make_moe(rng, qtypes, E, H, F) for qtypes in LAYER_TYPES]
    pointers = np.zeros((L, 3, E), dtype=np.uint64)
    for layer, mats in enumerate(layers):
        for part, stack in enumerate(mats):
            pointers[layer, part] = stack.ctypes.data + np.arange(E, dtype=np.uint64) * \
                np.uint64(stack.strides[0])
    types = np.array(LAYER_TYPES, dtype=np.int32)
    return layers, pointers, types


class FakeDevice(threading.Thread):
    """The GPU's side of one window: per layer fresh x/ids/wts, ready[l] = seq, then wait for
    done[l] and keep a copy of y (the next layer reuses the buffers, as on the device)."""

    def __init__(self, exchange, seq, num_rows, inputs, delay_s=0.002, layers=L):
        super().__init__(daemon=True)
        self.ex, self.seq, self.num_rows, self.inputs = exchange, seq, num_rows, inputs
        self.delay_s, self.layers = delay_s, layers
        self.outputs, self.error = [], None

    def run(self):
        ex, n = self.ex, self.num_rows
        for layer in range(self.layers):
            x, ids, wts, *split = self.inputs[layer]
            time.sleep(self.delay_s)  # the pool must really wait for ready
            ex.x[:n], ex.ids[:n], ex.wts[:n] = x, ids, wts
            ex.split[:] = split[0] if split else (0, 0)
            ex.ready[layer] = self.seq
            deadline = time.monotonic() + 20
            while ex.done[layer] != self.seq:
                if ex.done[layer] == -self.seq or time.monotonic() > deadline:
                    self.error = f"layer {layer}: done = {ex.done[layer]}"
                    return
                time.sleep(0.0002)
            self.outputs.append(ex.y[:n].copy())


def window_inputs(rng, layers, num_rows):
    inputs = []
    for layer in range(L):
        gate = layers[layer][0]
        x = scaled_x(rng, num_rows, H, gate, LAYER_TYPES[layer][0])
        ids = np.stack([rng.permutation(E)[:K] for _ in range(num_rows)]).astype(np.int32)
        wts = rng.random((num_rows, K)).astype(np.float32)
        inputs.append((x, ids, wts))
    return inputs


def serve(pool, ex, seq, inputs, num_rows, delay_s=0.0):
    """One window: the fake device publishes `inputs` layer by layer while the pool serves it;
    (the pool's stats, y of every layer)."""
    device = FakeDevice(ex, seq, num_rows, inputs, delay_s=delay_s)
    pool.submit(seq, num_rows)
    device.start()
    stats = pool.wait()
    device.join()
    assert device.error is None
    return stats, device.outputs


def check_window(layers, where, inputs, outputs):
    """y equals the float64 reference over the CPU-assigned pairs, and is exactly 0 in rows
    without one. Returns (entries, distinct experts) the pool should have counted."""
    entries = experts = 0
    for layer in range(L):
        x, ids, wts = inputs[layer]
        masked = np.where(where[layer][ids] == WHERE_CPU, ids, -1).astype(np.int32)
        zeros = np.zeros((len(x), H), dtype=np.float32)
        expected, bound = reference(x, *layers[layer], LAYER_TYPES[layer], masked, wts, zeros)
        y = outputs[layer]
        assert np.all(np.abs(y - expected) <= bound), f"layer {layer}"
        no_pair = (masked < 0).all(axis=1)
        assert np.all(y[no_pair] == 0.0), f"layer {layer}: rows without a CPU pair"
        entries += int((masked >= 0).sum())
        experts += len(np.unique(masked[masked >= 0]))
    return entries, experts


def test_pool_serves_cpu_pairs_layer_by_layer():
    rng = np.random.default_rng(71)
    layers, pointers, types = make_experts(rng)
    ex = Exchange.in_host_memory(ExchangeLayout(L, R_MAX, K, H))
    where = rng.choice([WHERE_VRAM, WHERE_PCIE, WHERE_CPU], size=(L, E)).astype(np.uint8)
    where[0, :4] = WHERE_CPU
    where[1] = WHERE_VRAM        # a layer with nothing for the pool: y all zeros
    where[2] = WHERE_CPU         # a layer that is all the pool's
    with CpuPool(ex, pointers, types, F, timeout_s=20) as pool:
        pool.set_where(where)
        for seq, num_rows in ((1, 5), (2, R_MAX), (3, 1)):
            inputs = window_inputs(rng, layers, num_rows)
            stats, outputs = serve(pool, ex, seq, inputs, num_rows, delay_s=0.002)
            assert np.array_equal(ex.done, np.full(L, seq))
            entries, experts = check_window(layers, where, inputs, outputs)
            assert (stats.seq, stats.num_rows) == (seq, num_rows)
            assert (stats.num_entries, stats.num_experts) == (entries, experts)
            assert stats.wait_ms > 0 and stats.pool_ms >= 0
            assert np.all(outputs[1] == 0.0)
            # a new where table between windows
            where = np.roll(where, 1, axis=1)
            where[1] = WHERE_VRAM
            pool.set_where(where)
        assert pool.num_windows == 3 and pool.last_stats.seq == 3
        assert pool.busy_windows == 3 and pool.busy_pool_ms == pytest.approx(pool.total_pool_ms)
        assert pool.total_entries >= pool.total_experts > 0


@pytest.mark.parametrize("threads", [1, 3])
def test_pool_serves_many_windows_of_every_size(threads):
    # the serve loop's team keeps each layer's call by parity and crosses 3 barriers per layer:
    # windows of every size (the weighted sum in the single and on the team), where tables that
    # leave layers empty, and a device that is sometimes late, all checked against the reference
    rng = np.random.default_rng(79 + threads)
    layers, pointers, types = make_experts(rng)
    ex = Exchange.in_host_memory(ExchangeLayout(L, R_MAX, K, H))
    with CpuPool(ex, pointers, types, F, threads=threads) as pool:
        for seq in range(1, 41):
            where = rng.choice([WHERE_PCIE, WHERE_CPU], size=(L, E)).astype(np.uint8)
            where[rng.integers(L)] = WHERE_VRAM
            pool.set_where(where)
            num_rows = int(rng.integers(1, R_MAX + 1))
            inputs = window_inputs(rng, layers, num_rows)
            delay = float(rng.choice([0.0, 0.0005]))
            stats, outputs = serve(pool, ex, seq, inputs, num_rows, delay_s=delay)
            entries, experts = check_window(layers, where, inputs, outputs)
            assert (stats.num_entries, stats.num_experts) == (entries, experts), seq


def test_pool_leaves_zeros_in_rows_without_its_pairs_across_windows_and_layers():
    # y is zeroed only where it may be non-zero (layer_begin's y_dirty) or set by the team's sum:
    # windows of many rows with the pool's pairs in a few of them, layers with none, a small
    # window after a big one and the reverse; every output checked, zeros included
    rng = np.random.default_rng(73)
    layers, pointers, types = make_experts(rng)
    ex = Exchange.in_host_memory(ExchangeLayout(L, R_MAX, K, H))
    ex.y[:] = 3.0
    with CpuPool(ex, pointers, types, F, threads=2) as pool:
        for seq, num_rows, cpu_experts in ((1, R_MAX, 1), (2, 2, 3), (3, R_MAX, 0), (4, 5, 1),
                                           (5, R_MAX, E), (6, 1, 0), (7, R_MAX, 2)):
            where = np.full((L, E), WHERE_PCIE, np.uint8)
            where[:, :cpu_experts] = WHERE_CPU
            where[seq % L] = WHERE_VRAM  # one layer with nothing for the pool
            pool.set_where(where)
            inputs = window_inputs(rng, layers, num_rows)
            stats, outputs = serve(pool, ex, seq, inputs, num_rows)
            entries, experts = check_window(layers, where, inputs, outputs)
            assert (stats.num_entries, stats.num_experts) == (entries, experts), seq
            assert np.all(outputs[seq % L] == 0.0)


def test_pool_with_nothing_routed_to_it_zeroes_y():
    rng = np.random.default_rng(72)
    layers, pointers, types = make_experts(rng)
    ex = Exchange.in_host_memory(ExchangeLayout(L, R_MAX, K, H))
    ex.y[:] = 7.0  # stale values of an earlier window must not leak
    with CpuPool(ex, pointers, types, F) as pool:
        pool.set_where(np.full((L, E), WHERE_PCIE, np.uint8))
        inputs = window_inputs(rng, layers, 4)
        stats, outputs = serve(pool, ex, 5, inputs, 4)
    assert (stats.num_entries, stats.num_experts) == (0, 0)
    assert (pool.num_windows, pool.busy_windows, pool.busy_wait_ms) == (1, 0, 0.0)
    assert all(np.all(y == 0.0) for y in outputs)


def test_pool_times_out_when_ready_never_comes():
    rng = np.random.default_rng(73)
    _, pointers, types = make_experts(rng)
    ex = Exchange.in_host_memory(ExchangeLayout(L, R_MAX, K, H))
    with CpuPool(ex, pointers, types, F, timeout_s=0.3) as pool:
        # layer 0 is published, layer 1 never is
        ex.ids[:2] = 0
        ex.ready[0] = 9
        start = time.monotonic()
        pool.submit(9, 2)
        with pytest.raises(CpuPoolError, match=r"waited 0.3 s for the GPU to publish layer 1 "
                                               r"of window 9"):
            pool.wait()
        assert 0.25 < time.monotonic() - start < 5
        assert ex.done[0] == 9 and ex.done[1] == -9  # the device may stop waiting
        # a stale ready of an earlier window does not count
        ex.ready[:] = 9
        pool.submit(10, 2)
        with pytest.raises(CpuPoolError, match="layer 0 of window 10"):
            pool.wait()


def test_pool_stop_abandons_a_waiting_window():
    rng = np.random.default_rng(74)
    _, pointers, types = make_experts(rng)
    ex = Exchange.in_host_memory(ExchangeLayout(L, R_MAX, K, H))
    pool = CpuPool(ex, pointers, types, F, timeout_s=60).start()
    pool.submit(3, 1)
    time.sleep(0.05)
    start = time.monotonic()
    pool.stop()
    assert time.monotonic() - start < 2
    assert ex.done[0] == -3


def test_pool_serves_after_a_long_idle_and_stops_at_once():
    # past 1 s without a window the loop naps 1 ms at a time: it still serves the next window,
    # and stop() does not wait out a series of naps
    rng = np.random.default_rng(78)
    layers, pointers, types = make_experts(rng)
    ex = Exchange.in_host_memory(ExchangeLayout(L, R_MAX, K, H))
    where = np.full((L, E), WHERE_CPU, np.uint8)
    pool = CpuPool(ex, pointers, types, F).start()
    try:
        pool.set_where(where)
        time.sleep(1.2)
        inputs = window_inputs(rng, layers, 2)
        stats, outputs = serve(pool, ex, 1, inputs, 2)
        assert stats.start_lag_ms < 50
        assert check_window(layers, where, inputs, outputs)[0] == stats.num_entries
        time.sleep(1.2)
    finally:
        start = time.monotonic()
        pool.stop()
    assert time.monotonic() - start < 0.5


def test_pool_refuses_misuse():
    rng = np.random.default_rng(75)
    _, pointers, types = make_experts(rng)
    ex = Exchange.in_host_memory(ExchangeLayout(L, R_MAX, K, H))
    pool = CpuPool(ex, pointers, types, F, timeout_s=0.2)
    with pytest.raises(CpuPoolError, match="start the CPU pool first"):
        pool.submit(1, 1)
    with pool:
        with pytest.raises(CpuPoolError, match="does not fit the exchange's 6"):
            pool.submit(1, R_MAX + 1)
        pool.submit(1, 1)
        with pytest.raises(CpuPoolError, match="while window 1 is in flight"):
            pool.submit(2, 1)
        with pytest.raises(CpuPoolError, match="call it after wait"):
            pool.set_where(np.zeros((L, E), np.uint8))
        with pytest.raises(CpuPoolError):
            pool.wait()
    bad = pointers.copy()
    bad[1, 2, 5] = 0
    where = np.full((L, E), WHERE_CPU, np.uint8)
    rb = kernels.pool_row_bytes(types, H, F)
    assert rb[0].tolist() == [H // 32 * 34, H // 32 * 34, F // 32 * 34]   # Q8_0
    assert rb[1].tolist() == [H // 32 * 18, H * 2, F // 32 * 34]         # Q4_0, F16, Q8_0
    with pytest.raises(ValueError, match="null address for an expert the where table gives"):
        kernels.pool_check_where(where, bad)
    with pytest.raises(Exception, match="null address for an expert the where table gives"):
        CpuPool(ex, bad, types, F)
    where[1, 5] = WHERE_VRAM
    kernels.pool_check_where(where, bad)  # the null expert is not the CPU's
    ctl = np.zeros(kernels.POOL_CTL_WORDS, np.int64)
    args = (ex.ready, ex.done, ex.x, ex.ids, ex.wts, ex.y, ex.split)
    with pytest.raises(ValueError, match=r"must be \[L, 3, E\]"):
        kernels.pool_serve(ctl, *args, where, np.ascontiguousarray(pointers[:, :2]), types, rb,
                           F, 1.0)
    with pytest.raises(ValueError, match=r"must be pool_row_bytes\(types, H, F\)"):
        kernels.pool_serve(ctl, *args, where, pointers, types, rb[:2].copy(), F, 1.0)
    with pytest.raises(ValueError, match="POOL_CTL_WORDS"):
        kernels.pool_serve(ctl[:3].copy(), *args, where, pointers, types, rb, F, 1.0)
    kernels.pool_post(ctl, 4, 1)
    with pytest.raises(ValueError, match=r"seq = 4 must be > the last posted window's \(4\)"):
        kernels.pool_post(ctl, 4, 1)
    # nothing serves ctl: the wait times out, and ends at once once the loop has exited
    assert kernels.pool_wait_served(ctl, 4, 0.01)[0] == kernels.POOL_TIMEOUT
    ctl[kernels.POOL_CTL_EXITED] = 1
    assert kernels.pool_wait_served(ctl, 4, 10.0)[0] == kernels.POOL_ABORTED
    with pytest.raises(ValueError, match="expert type 4"):
        kernels.pool_row_bytes(np.full((1, 3), 4, np.int32), H, F)


def test_exchange_layout_is_aligned_and_carves_views():
    layout = ExchangeLayout(num_layers=48, max_rows=16, top_k=8, hidden=2048)
    offsets = layout.offsets
    assert list(offsets) == ["ready", "done", "status", "split", "x", "ids", "wts", "y"]
    assert all(at % 256 == 0 for at in offsets.values())
    # ready: 48 int64 = 384 bytes, rounded up to 512
    assert offsets["done"] == 512 and offsets["status"] == 1024 and offsets["split"] == 1280
    assert offsets["x"] == 1536 and offsets["ids"] == 1536 + 16 * 2048 * 4
    assert offsets["wts"] == offsets["ids"] + 512
    assert layout.nbytes == offsets["y"] + 16 * 2048 * 4
    ex = Exchange.in_host_memory(layout)
    assert ex.x.shape == (16, 2048) and ex.ids.dtype == np.int32 and ex.wts.shape == (16, 8)
    assert ex.field_address("y") - ex.address == offsets["y"]
    assert ex.y.ctypes.data == ex.field_address("y")
    ex.ready[3], ex.status[:2] = 5, (4, 17)
    assert ex.device_error() == (3, 17)
    ex.reset()
    assert ex.device_error() is None and not ex.ready.any()
    backing = np.zeros(layout.nbytes + 4096, np.uint8)
    with pytest.raises(Exception, match="not aligned to 256 bytes"):
        Exchange(layout, backing.ctypes.data + 8, layout.nbytes)
    with pytest.raises(Exception, match=f"needs {layout.nbytes}"):
        Exchange(layout, backing.ctypes.data - backing.ctypes.data % 256 + 256, 1000)
    with pytest.raises(Exception, match="top_k = 0 must be an integer >= 1"):
        ExchangeLayout(2, 2, 0, 64)


def test_pool_sets_its_threads_and_gives_them_back():
    rng = np.random.default_rng(76)
    _, pointers, types = make_experts(rng)
    ex = Exchange.in_host_memory(ExchangeLayout(L, R_MAX, K, H))
    before = kernels.get_num_threads()
    with CpuPool(ex, pointers, types, F, threads=3) as pool:
        assert kernels.get_num_threads() == 3 == pool.threads
    assert kernels.get_num_threads() == before
    assert CpuPool(ex, pointers, types, F).threads == max(1, (os.cpu_count() or 1) - 1)
    with pytest.raises(Exception, match="threads must be >= 1, got 0"):
        CpuPool(ex, pointers, types, F, threads=0)


def test_pool_skips_ids_outside_the_experts():
    # ids the pool cannot use (-1, >= E) are left out, not read
    rng = np.random.default_rng(77)
    layers, pointers, types = make_experts(rng)
    ex = Exchange.in_host_memory(ExchangeLayout(L, R_MAX, K, H))
    where = np.full((L, E), WHERE_CPU, np.uint8)
    inputs = window_inputs(rng, layers, 3)
    for _, ids, _ in inputs:
        ids[0, 0], ids[1, 1], ids[2, :] = -1, E + 90, -1
    with CpuPool(ex, pointers, types, F) as pool:
        pool.set_where(where)
        stats, outputs = serve(pool, ex, 4, inputs, 3)
    for _, ids, _ in inputs:
        ids[ids >= E] = -1
    entries, _ = check_window(layers, where, inputs, outputs)
    assert stats.num_entries == entries == L * (3 * K - 2 - K)


def test_pool_threads_follow_the_processs_cpus(monkeypatch):
    # a container's cpuset or taskset: the default leaves one of the usable cores to the engine
    from strata.backends.cuda import cpu_pool

    monkeypatch.setattr(cpu_pool.os, "sched_getaffinity", lambda pid: {2, 3, 5, 7}, raising=False)
    assert cpu_pool.usable_cpus() == 4
    assert cpu_pool.default_pool_threads() == 3
    monkeypatch.setattr(cpu_pool.os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert cpu_pool.default_pool_threads() == 1


def test_pool_warns_about_pinned_or_oversubscribed_threads(caplog):
    from strata.backends.cuda.cpu_pool import thread_warnings

    assert thread_warnings(15, env={}, cpus=16) == []
    assert thread_warnings(15, env={"OMP_PROC_BIND": "false", "OMP_PLACES": ""}, cpus=16) == []
    [pinned] = thread_warnings(15, env={"OMP_PROC_BIND": "close", "OMP_PLACES": "cores"}, cpus=16)
    assert "OMP_PROC_BIND=close" in pinned and "OMP_PLACES=cores" in pinned
    [over] = thread_warnings(16, env={}, cpus=16)
    assert "16 threads" in over and "--threads 15" in over
    assert len(thread_warnings(8, env={"GOMP_CPU_AFFINITY": "0-7"}, cpus=4)) == 2
    # the pool says so in the log when it starts
    rng = np.random.default_rng(5)
    _, pointers, types = make_experts(rng)
    ex = Exchange.in_host_memory(ExchangeLayout(L, R_MAX, K, H))
    threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    with caplog.at_level("WARNING", logger="strata.pool"):
        with CpuPool(ex, pointers, types, F, threads=threads):
            pass
    assert any("engine thread that drives the GPU" in r.getMessage() for r in caplog.records)


def test_pool_computes_its_part_of_a_split_expert():
    # the device splits a layer's boundary expert: split = (e, c) gives the pool gate/up rows
    # and down columns [0, c) of e (its part of e's output), the other experts whole; a split
    # that is not whole blocks of the down's type, or not inside (0, F), is no split
    rng = np.random.default_rng(83)
    layers, pointers, types = make_experts(rng)
    ex = Exchange.in_host_memory(ExchangeLayout(L, R_MAX, K, H))
    where = np.full((L, E), WHERE_CPU, np.uint8)
    with CpuPool(ex, pointers, types, F, timeout_s=20, threads=2) as pool:
        pool.set_where(where)
        windows = ((1, (32, 64, 48)), (4, (64, 40, 96)), (R_MAX, (0, 32, 95)))
        for seq, (num_rows, cols) in enumerate(windows, start=1):
            inputs = window_inputs(rng, layers, num_rows)
            split = []
            for layer, (x, ids, wts) in enumerate(inputs):
                e = int(ids[0, 1])
                inputs[layer] = (x, ids, wts, (e, cols[layer]))
                block = 1 if LAYER_TYPES[layer][2] == T.F32 else 32
                is_split = 0 < cols[layer] < F and cols[layer] % block == 0
                split.append((e, cols[layer]) if is_split else None)
            _, outputs = serve(pool, ex, seq, inputs, num_rows)
            for layer, (x, ids, wts, _) in enumerate(inputs):
                gate, up, down = layers[layer]
                if split[layer] is not None:  # rows [c, F) of e's gate zero: h[c:] = 0
                    e, c = split[layer]
                    gate = gate.copy()
                    gate[e, c:] = 0
                zeros = np.zeros((num_rows, H), dtype=np.float32)
                expected, bound = reference(x, gate, up, down, LAYER_TYPES[layer], ids, wts,
                                            zeros)
                assert np.all(np.abs(outputs[layer] - expected) <= bound), (seq, layer)
                whole, _ = reference(x, *layers[layer], LAYER_TYPES[layer], ids, wts, zeros)
                if split[layer] is not None:  # the part differs from the whole expert
                    assert (np.abs(whole - expected) > 2 * bound).any(), (seq, layer)
