"""The CPU pool: a thread that serves, beside each GPU window, the routed pairs whose expert the
where table gives the CPU, through the exchange buffer (native loop: _native/cpu_pool.pxi).
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import numpy as np

from strata._native import kernels
from strata.backends.cuda.exchange import WHERE_CPU, Exchange
from strata.errors import ConfigError, StrataError

DEFAULT_TIMEOUT_S = 10.0


def default_pool_threads() -> int:
    """All cores but one: the engine thread that drives the GPU spins while its window runs,
    and an OpenMP team sharing its core waits at every barrier."""
    return max(1, (os.cpu_count() or 1) - 1)


class CpuPoolError(StrataError):
    """The CPU pool could not serve a window (the device never published a layer, or the pool
    ran out of memory)."""


@dataclass(frozen=True)
class PoolWindowStats:
    """What the pool did for one window: routed entries ((row, top-k pick) pairs) and distinct
    (layer, expert)s it computed, its compute time, and its time spent waiting for the GPU."""

    seq: int
    num_rows: int
    num_entries: int
    num_experts: int
    pool_ms: float
    wait_ms: float


class CpuPool:
    """start() / submit(seq, num_rows) / wait() -> PoolWindowStats / stop(). One window in flight
    at a time; `set_where` only between windows. `pointers` [L, 3, E] uint64 are the experts'
    host addresses (ExpertStore.expert_pointers), `types` [L, 3] their ggml types; `threads` sets
    the CPU kernels' thread count at start (None: default_pool_threads())."""

    def __init__(self, exchange: Exchange, pointers: np.ndarray, types, expert_width: int, *,
                 threads: int | None = None, timeout_s: float = DEFAULT_TIMEOUT_S):
        layout = exchange.layout
        pointers = np.ascontiguousarray(pointers, dtype=np.uint64)
        types = np.ascontiguousarray(types, dtype=np.int32)
        if pointers.ndim != 3 or pointers.shape[:2] != (layout.num_layers, 3):
            raise ConfigError(f"expert pointers {pointers.shape} must be [L, 3, E] with L = "
                              f"{layout.num_layers} (the exchange's layers)")
        if types.shape != (layout.num_layers, 3):
            raise ConfigError(f"expert types {types.shape} must be [{layout.num_layers}, 3]")
        if not timeout_s > 0:
            raise ConfigError(f"the CPU pool's timeout must be > 0 s, got {timeout_s}")
        if threads is not None and threads < 1:
            raise ConfigError(f"the CPU pool's threads must be >= 1, got {threads}")
        self.exchange = exchange
        self.pointers, self.types = pointers, types
        try:
            self.row_bytes = kernels.pool_row_bytes(types, layout.hidden, int(expert_width))
        except ValueError as exc:
            raise ConfigError(f"the CPU pool cannot read these experts: {exc}") from None
        self.expert_width = int(expert_width)
        self.threads = int(threads) if threads is not None else default_pool_threads()
        self.timeout_s = float(timeout_s)
        self.num_experts = pointers.shape[2]
        self._where = np.full((layout.num_layers, self.num_experts), WHERE_CPU, dtype=np.uint8)
        self._abort = np.zeros(1, dtype=np.int64)
        self._cond = threading.Condition()
        self._job: tuple[int, int] | None = None
        self._result = None
        self._in_flight = False
        self._stopping = False
        self._thread: threading.Thread | None = None
        # totals since construction, for logs and metrics; last_stats: the last served window
        self.num_windows = 0
        self.total_entries = 0
        self.total_experts = 0
        self.total_pool_ms = 0.0
        self.total_wait_ms = 0.0
        self.last_stats: PoolWindowStats | None = None

    # ---- between windows ------------------------------------------------------------------
    @property
    def where(self) -> np.ndarray:
        return self._where

    def set_where(self, where: np.ndarray) -> None:
        """Which experts are the pool's (where[l, e] == 2); copied, used from the next window."""
        where = np.ascontiguousarray(where, dtype=np.uint8)
        if where.shape != self._where.shape:
            raise ConfigError(f"the where table {where.shape} must be {self._where.shape} "
                              "(layers x experts)")
        if self._in_flight:
            raise CpuPoolError("set_where during a window: the pool is serving window "
                               f"{self._job[0] if self._job else '?'}; call it after wait()")
        self._where = where.copy()

    # ---- the thread -----------------------------------------------------------------------
    def start(self) -> "CpuPool":
        if self._thread is not None:
            return self
        self._threads_before = kernels.get_num_threads()
        kernels.set_num_threads(self.threads)
        self._abort[0] = 0
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="strata-cpu-pool", daemon=True)
        self._thread.start()
        return self

    def submit(self, seq: int, num_rows: int) -> None:
        """Serve window `seq` (> 0, increasing) of `num_rows` rows: the pool waits for each
        layer's ready word, so call this before (or while) the GPU runs the window."""
        if self._thread is None:
            raise CpuPoolError("submit before start(): start the CPU pool first")
        if self._in_flight:
            raise CpuPoolError(f"submit({seq}) while window {self._job[0]} is in flight; "
                               "wait() for it first")
        if not 0 <= num_rows <= self.exchange.layout.max_rows:
            raise CpuPoolError(f"a window of {num_rows} rows does not fit the exchange's "
                               f"{self.exchange.layout.max_rows}")
        with self._cond:
            self._job = (int(seq), int(num_rows))
            self._result = None
            self._in_flight = True
            self._cond.notify_all()

    def wait(self) -> PoolWindowStats:
        """The submitted window's stats once the pool has served every layer; CpuPoolError when
        it could not."""
        with self._cond:
            while self._result is None:
                if self._thread is None:
                    raise CpuPoolError("wait() with no window submitted to a running pool")
                self._cond.wait()
            result, self._result, self._job = self._result, None, None
            self._in_flight = False
        if isinstance(result, BaseException):
            raise result
        return result

    def stop(self) -> None:
        """Stop the thread (a window still waiting for the device is abandoned) and give the
        CPU kernels back their thread count."""
        thread = self._thread
        if thread is None:
            return
        self._abort[0] = 1
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        thread.join()
        kernels.set_num_threads(self._threads_before)
        self._thread = None
        self._in_flight = False
        self._job = self._result = None

    def __enter__(self) -> "CpuPool":
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and (self._job is None or self._result is not None):
                    self._cond.wait()
                if self._stopping:
                    return
                seq, num_rows = self._job
            try:
                result = self._serve(seq, num_rows)
            except BaseException as exc:  # handed to wait() in the engine thread
                result = exc
            with self._cond:
                self._result = result
                self._cond.notify_all()

    def _serve(self, seq: int, num_rows: int) -> PoolWindowStats:
        ex = self.exchange
        status, layer, entries, experts, wait_ns, compute_ns = kernels.pool_run_window(
            ex.ready, ex.done, ex.x, ex.ids, ex.wts, ex.y, seq, num_rows, self._where,
            self.pointers, self.types, self.row_bytes, self.expert_width, self.timeout_s,
            self._abort)
        if status == kernels.POOL_TIMEOUT:
            raise CpuPoolError(
                f"the CPU pool waited {self.timeout_s:g} s for the GPU to publish layer {layer} "
                f"of window {seq} and gave up: the GPU window failed or stalled (see the "
                "device's error), or the exchange buffer is not the one the device writes")
        if status == kernels.POOL_ABORTED:
            raise CpuPoolError(f"the CPU pool was stopped while waiting for layer {layer} of "
                               f"window {seq}")
        if status == kernels.POOL_NO_MEMORY:
            raise CpuPoolError(f"the CPU pool ran out of memory computing layer {layer} of "
                               f"window {seq} ({num_rows} rows); free RAM or lower --parallel")
        stats = PoolWindowStats(seq, num_rows, int(entries), int(experts),
                                compute_ns / 1e6, wait_ns / 1e6)
        self.num_windows += 1
        self.total_entries += stats.num_entries
        self.total_experts += stats.num_experts
        self.total_pool_ms += stats.pool_ms
        self.total_wait_ms += stats.wait_ms
        self.last_stats = stats
        return stats

