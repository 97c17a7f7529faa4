"""The tier's part of a CUDA window: routing counts per (layer, expert) gathered on the device
after the pair grouping, the where table (VRAM / PCIe / CPU pool) that takes CPU-assigned experts
out of the grouped products, and the hand-off of those experts' rows to the CPU pool (offload.cu).
"""
from __future__ import annotations

import numpy as np

from strata.errors import ConfigError

WHERE_VRAM, WHERE_PCIE, WHERE_CPU = 0, 1, 2  # as backends/cuda/exchange.py


class DeviceTier:
    """Device buffers of the tier: counts int32 [L, E] (rows routed per expert in the last
    window), where uint8 [L, E], the window's seq int64 and, with a CPU pool, the mapped
    exchange buffer (layout: exchange.py)."""

    def __init__(self, model):
        rt, spec = model.runtime, model.spec
        self.model, self._rt = model, rt
        self.num_layers, self.num_experts = L, E = spec.n_layers, spec.n_experts
        self._counts = rt.alloc(4 * L * E)
        self.counts_host = rt.pinned((L, E), np.int32)
        self._where = rt.alloc(L * E)
        self.where_host = rt.pinned((L, E), np.uint8)
        self.where_host[:] = WHERE_PCIE
        rt.drv.memcpy_htod(self._where, self.where_host)
        self._seq = rt.alloc(8)
        self.seq_host = rt.pinned((1,), np.int64)
        self.seq_host[0] = 0
        self._arrived = rt.alloc(4 * L)
        rt.drv.memset_d32(self._arrived, 0, L)
        self.pool = None
        self._pool_window = False  # did the running window hand rows to the pool (before_run)
        self.exchange = None
        self._exchange_device = 0

    # ---- pointers the plan's launches take ----------------------------------------------
    def counts_ptr(self, layer: int) -> int:
        return int(self._counts) + 4 * layer * self.num_experts

    def where_ptr(self, layer: int) -> int:
        return int(self._where) + layer * self.num_experts

    @property
    def has_pool(self) -> bool:
        return self.pool is not None

    def exchange_ptr(self, field: str) -> int:
        return self._exchange_device + self.exchange.layout.offsets[field]

    # ---- the where table ----------------------------------------------------------------
    def set_where(self, where: np.ndarray) -> None:
        """Upload `where` [L, E] uint8 for the next window (between windows; the compute stream
        is idle, so the pinned copy may change again after the window)."""
        where = np.asarray(where, dtype=np.uint8)
        if where.shape != self.where_host.shape:
            raise ValueError(f"where must be [L, E] = {self.where_host.shape}, got {where.shape}")
        if np.array_equal(where, self.where_host):
            return
        self.where_host[:] = where
        self._rt.drv.memcpy_htod_async(self._where, self.where_host, self._rt.stream)

    # ---- the CPU pool -------------------------------------------------------------------
    def attach_pool(self, pool, exchange, exchange_device_ptr: int) -> None:
        """Hand CPU-assigned experts to `pool` (submit(seq, num_rows) / wait()) through
        `exchange` (mapped at `exchange_device_ptr`); the plans are rebuilt with the hand-off."""
        if exchange.layout.num_layers != self.num_layers:
            raise ConfigError(f"the exchange buffer is laid out for {exchange.layout.num_layers} "
                              f"layers, the model has {self.num_layers}")
        self.pool, self.exchange = pool, exchange
        self._exchange_device = int(exchange_device_ptr)
        exchange.reset()
        self.model.drop_plans()

    def detach_pool(self) -> None:
        """Back to no pool (every miss read over PCIe); the plans are rebuilt without it."""
        if self.pool is not None:
            self.pool = self.exchange = None
            self._exchange_device = 0
            self.model.drop_plans()

    def pools(self, num_rows: int) -> bool:
        """Does a window of `num_rows` rows hand rows to the CPU pool? With a pool, up to
        share.POOL_MAX_ROWS rows; a larger window has no CPU-assigned expert (window_share), so
        its plan has no hand-off at all: no publish, no wait for the pool, the plain (fused)
        combine instead of one reading the pool's y [R, H] over PCIe every layer."""
        from strata.backends.cuda.share import POOL_MAX_ROWS

        return self.pool is not None and num_rows <= POOL_MAX_ROWS

    def add_after_grouping(self, plan, layer: int) -> None:
        """Launches after group_pairs: the layer's counts (and CPU groups out), rows to the pool."""
        ws, R, E = plan._ws, plan.num_rows, self.num_experts
        spec = self.model.spec
        pooled = self.pools(R)
        plan._add("tier_groups", (1,), (256,), "PPiPP",
                  [ws.ptr("groups"), ws.ptr("num_groups"), E, self.counts_ptr(layer),
                   self.where_ptr(layer) if pooled else 0])
        if not pooled:
            return
        if R > self.exchange.layout.max_rows:
            raise ConfigError(f"a window of {R} rows exceeds the CPU pool's exchange buffer of "
                              f"{self.exchange.layout.max_rows} rows")
        H, K = spec.hidden, spec.n_experts_used
        plan._add("pool_publish", ((R * H + 255) // 256,), (256,), "PPPiiiPiiPPPPPP",
                  [ws.ptr("hf"), ws.ptr("ids"), ws.ptr("wts"), R, K, H, self.where_ptr(layer), E,
                   layer, int(self._seq), self.exchange_ptr("x"), self.exchange_ptr("ids"),
                   self.exchange_ptr("wts"), self.exchange_ptr("ready"), int(self._arrived)])

    def add_combine(self, plan, layer: int, shared: tuple[int, int]) -> None:
        """The pool's wait and the combine that leaves CPU pairs out and adds the pool's y."""
        ws, R, E = plan._ws, plan.num_rows, self.num_experts
        spec = self.model.spec
        H, K = spec.hidden, spec.n_experts_used
        plan._add("pool_wait", (1,), (1,), "PPiiPP",
                  [self.exchange_ptr("done"), self.where_ptr(layer), E, layer, int(self._seq),
                   self.exchange_ptr("status")])
        plan._add("moe_combine_pool", ((R * H + 255) // 256,), (256,), "PPPPiiiPPPiP",
                  [ws.ptr("x"), ws.ptr("ybuf"), ws.ptr("wts"), ws.ptr("ids"), R, K, H, *shared,
                   self.where_ptr(layer), E, self.exchange_ptr("y")])

    # ---- per window ---------------------------------------------------------------------
    def before_run(self, num_rows: int) -> None:
        """Upload the window's seq and start the pool on it (compute stream, before the plan),
        when the window hands rows to the pool (pools)."""
        self._pool_window = self.pools(num_rows)
        if not self._pool_window:
            return
        self.seq_host[0] += 1
        self._rt.drv.memcpy_htod_async(self._seq, self.seq_host, self._rt.stream)
        self.pool.submit(int(self.seq_host[0]), num_rows)

    def after_run(self) -> None:
        """Queue the counts' read-back behind the plan (before the window's synchronize)."""
        self._rt.drv.memcpy_dtoh_async(self.counts_host, self._counts, self._rt.stream)

    def finish(self, routing_counts: np.ndarray | None) -> None:
        """After the synchronize: add the counts, wait for the pool, raise on a failed hand-off."""
        if routing_counts is not None:
            routing_counts += self.counts_host
        if not self._pool_window:
            return
        from strata.backends.cuda.cpu_pool import CpuPoolError

        try:
            self.pool.wait()  # raises CpuPoolError when the pool failed
        finally:
            failed = self.exchange.device_error()
            what = ("reported a failure" if int(self.exchange.status[2]) == 2
                    else "did not answer within 10 s")
            if failed is not None:
                self.exchange.reset()  # the next window's waits start clean
        if failed is not None:
            layer, seq = failed
            raise CpuPoolError(
                f"the CPU pool {what} on layer {layer} of window {seq}; this window's results "
                "are invalid. Check the log for the pool's error, or run with --pcie-frac 1 "
                "(no CPU pool)")
