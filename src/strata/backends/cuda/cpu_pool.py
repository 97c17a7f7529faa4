"""The CPU pool: a thread that serves, beside each GPU window, the routed pairs whose expert the
where table gives the CPU, through the exchange buffer. The thread stays in one native loop
(_native/pool_window.c) for the pool's life: a window is posted and waited for through control
words, so neither side needs the GIL or a lock between the GPU's launch and the pool's start.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass

import numpy as np

from strata._native import kernels
from strata.backends.cuda.exchange import WHERE_CPU, Exchange
from strata.errors import ConfigError, StrataError

DEFAULT_TIMEOUT_S = 10.0
_log = logging.getLogger("strata.pool")


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity: taskset, a container's cpuset), else the
    machine's count."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_pool_threads() -> int:
    """All usable cores but one: the engine thread that drives the GPU spins while its window
    runs, and an OpenMP team sharing its core waits at every barrier."""
    return max(1, usable_cpus() - 1)


# OpenMP settings that pin threads: the process's first thread is bound at start, and the pool's
# thread (started from it) inherits that one core. Measured on the H200 host (16 cores, -t 15):
# OMP_PROC_BIND=close OMP_PLACES=cores decoded 37-41 tokens/s at 0% against 81-85 without.
BINDING_VARIABLES = ("OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY", "KMP_AFFINITY")


def thread_warnings(threads: int, env=None, cpus: int | None = None) -> list[str]:
    """What in the environment will slow a CPU pool of `threads` threads, in words (empty: none).
    On the H200 host -t 16 of 16 cores (the engine thread spinning beside the team) did not
    finish a 64-token decode in 50 s; -t 13, 14 and 15 all decoded 78-85 tokens/s."""
    env = os.environ if env is None else env
    cpus = usable_cpus() if cpus is None else cpus
    out = []
    bound = [f"{k}={env[k]}" for k in BINDING_VARIABLES
             if env.get(k, "").strip().lower() not in ("", "false", "disabled", "none")]
    if bound:
        out.append(f"{', '.join(bound)} pins OpenMP threads: the CPU pool's thread inherits the "
                   "first thread's core and its team squeezes onto it (about half the decode "
                   "speed measured); unset it")
    if threads >= cpus:
        out.append(f"the CPU pool's {threads} threads and the engine thread that drives the GPU "
                   f"share {cpus} usable cores: every layer waits while one of them is "
                   f"descheduled; use --threads {max(1, cpus - 1)} or fewer")
    return out


class CpuPoolError(StrataError):
    """The CPU pool could not serve a window (the device never published a layer, or the pool
    ran out of memory)."""


@dataclass(frozen=True)
class PoolWindowStats:
    """What the pool did for one window: routed entries ((row, top-k pick) pairs) and distinct
    (layer, expert)s it computed, its compute time, its time spent waiting for the GPU, and how
    long after the post it saw the window."""

    seq: int
    num_rows: int
    num_entries: int
    num_experts: int
    pool_ms: float
    wait_ms: float
    start_lag_ms: float = 0.0


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
        try:
            kernels.pool_check_where(self._where, pointers)
        except ValueError as exc:
            raise ConfigError(f"the CPU pool cannot read these experts: {exc}") from None
        self._ctl = np.zeros(kernels.POOL_CTL_WORDS, dtype=np.int64)
        self._seq = 0                      # the window in flight (posted, not yet waited for)
        self._in_flight = False
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        # totals since construction, for logs and metrics (busy_*: over the windows that gave
        # the pool work); last_stats: the last served window
        self.num_windows = 0
        self.total_entries = 0
        self.total_experts = 0
        self.total_pool_ms = 0.0
        self.total_wait_ms = 0.0
        self.busy_windows = 0
        self.busy_pool_ms = 0.0
        self.busy_wait_ms = 0.0
        self.last_stats: PoolWindowStats | None = None

    # ---- between windows ------------------------------------------------------------------
    @property
    def where(self) -> np.ndarray:
        return self._where

    def set_where(self, where: np.ndarray) -> None:
        """Which experts are the pool's (where[l, e] == 2); copied in place (the loop reads it
        during each window), used from the next window."""
        where = np.ascontiguousarray(where, dtype=np.uint8)
        if where.shape != self._where.shape:
            raise ConfigError(f"the where table {where.shape} must be {self._where.shape} "
                              "(layers x experts)")
        if self._in_flight:
            raise CpuPoolError(f"set_where during a window: the pool is serving window "
                               f"{self._seq}; call it after wait()")
        try:
            kernels.pool_check_where(where, self.pointers)
        except ValueError as exc:
            raise ConfigError(f"the CPU pool's where table: {exc}") from None
        self._where[...] = where

    # ---- the thread -----------------------------------------------------------------------
    def start(self) -> "CpuPool":
        if self._thread is not None:
            return self
        for warning in thread_warnings(self.threads):
            _log.warning("CPU pool: %s", warning)
        self._threads_before = kernels.get_num_threads()
        kernels.set_num_threads(self.threads)   # the loop's team takes this many at its start
        self._reserve()
        ctl = self._ctl
        ctl[kernels.POOL_CTL_STOP] = ctl[kernels.POOL_CTL_EXITED] = 0
        ctl[kernels.POOL_CTL_SERVED] = ctl[kernels.POOL_CTL_SEQ]   # nothing left pending
        self._error = None
        self._thread = threading.Thread(target=self._run, name="strata-cpu-pool", daemon=True)
        self._thread.start()
        return self

    def _reserve(self) -> None:
        """Fault in the work buffers of the pool's largest call now (kernels.pool_reserve), not
        in its first windows' calls as they grow (docs/offload.md, "Session 81")."""
        layout = self.exchange.layout
        start = time.perf_counter()
        try:
            kept = kernels.pool_reserve(layout.max_rows, layout.hidden, self.expert_width,
                                        layout.top_k, self.pointers, self.types, self.row_bytes)
        except MemoryError as exc:  # the windows then allocate as they go, or fail clearly
            _log.warning("CPU pool: %s; its calls allocate them as they go", exc)
            return
        if kept:
            _log.info("CPU pool: %.0f MiB of work buffers for windows of up to %d rows faulted "
                      "in (%.0f ms)", kept / 2**20, layout.max_rows,
                      (time.perf_counter() - start) * 1e3)

    def submit(self, seq: int, num_rows: int) -> None:
        """Serve window `seq` (> 0, increasing) of `num_rows` rows: the pool waits for each
        layer's ready word, so call this before (or while) the GPU runs the window."""
        if self._thread is None:
            raise CpuPoolError("submit before start(): start the CPU pool first")
        if self._in_flight:
            raise CpuPoolError(f"submit({seq}) while window {self._seq} is in flight; "
                               "wait() for it first")
        if not 0 <= num_rows <= self.exchange.layout.max_rows:
            raise CpuPoolError(f"a window of {num_rows} rows does not fit the exchange's "
                               f"{self.exchange.layout.max_rows}")
        try:
            kernels.pool_post(self._ctl, int(seq), int(num_rows))
        except ValueError as exc:
            raise CpuPoolError(f"window {seq}: {exc}") from None
        self._seq, self._in_flight = int(seq), True

    def wait(self) -> PoolWindowStats:
        """The submitted window's stats once the pool has served every layer; CpuPoolError when
        it could not."""
        if not self._in_flight:
            raise CpuPoolError("wait() with no window submitted to a running pool")
        seq, num_rows = self._seq, int(self._ctl[kernels.POOL_CTL_ROWS])
        layers = self.exchange.layout.num_layers
        try:
            status, layer, entries, experts, wait_ns, compute_ns, lag_ns, _ = \
                kernels.pool_wait_served(self._ctl, seq, self.timeout_s * (layers + 1) + 10.0)
        finally:
            self._in_flight = False
        if status == kernels.POOL_TIMEOUT and layer < 0:
            raise CpuPoolError(f"the CPU pool did not finish window {seq} in "
                               f"{self.timeout_s * (layers + 1) + 10.0:g} s")
        if status == kernels.POOL_TIMEOUT:
            raise CpuPoolError(
                f"the CPU pool waited {self.timeout_s:g} s for the GPU to publish layer {layer} "
                f"of window {seq} and gave up: the GPU window failed or stalled (see the "
                "device's error), or the exchange buffer is not the one the device writes")
        if status == kernels.POOL_ABORTED and layer < 0:
            raise CpuPoolError(f"the CPU pool stopped before serving window {seq}"
                               + (f": {self._error}" if self._error else ""))
        if status == kernels.POOL_ABORTED:
            raise CpuPoolError(f"the CPU pool was stopped while waiting for layer {layer} of "
                               f"window {seq}")
        if status == kernels.POOL_NO_MEMORY:
            raise CpuPoolError(f"the CPU pool ran out of memory computing layer {layer} of "
                               f"window {seq} ({num_rows} rows); free RAM or lower --parallel")
        stats = PoolWindowStats(seq, num_rows, int(entries), int(experts), compute_ns / 1e6,
                                wait_ns / 1e6, lag_ns / 1e6)
        self.num_windows += 1
        self.total_entries += stats.num_entries
        self.total_experts += stats.num_experts
        self.total_pool_ms += stats.pool_ms
        self.total_wait_ms += stats.wait_ms
        if stats.num_entries:
            self.busy_windows += 1
            self.busy_pool_ms += stats.pool_ms
            self.busy_wait_ms += stats.wait_ms
        self.last_stats = stats
        return stats

    def stop(self) -> None:
        """Stop the thread (a window still waiting for the device is abandoned) and give the
        CPU kernels back their thread count."""
        thread = self._thread
        if thread is None:
            return
        self._ctl[kernels.POOL_CTL_STOP] = 1
        thread.join()
        kernels.set_num_threads(self._threads_before)
        self._thread = None
        self._in_flight = False

    def __enter__(self) -> "CpuPool":
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def _run(self) -> None:
        ex = self.exchange
        try:
            kernels.pool_serve(self._ctl, ex.ready, ex.done, ex.x, ex.ids, ex.wts, ex.y,
                               ex.split, self._where, self.pointers, self.types, self.row_bytes,
                               self.expert_width, self.timeout_s)
        except BaseException as exc:  # wait() names it
            self._error = exc
            self._ctl[kernels.POOL_CTL_EXITED] = 1
