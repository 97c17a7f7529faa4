"""What the expert tier counts (hits, misses, rounds, swaps, bytes moved, wait), the log lines
made of it, and the recent routing that the Belady optimum is computed over for /metrics.
"""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, fields, replace

import numpy as np

from strata.experts.replay import replay_belady
from strata.experts.trace import RECORD_DTYPE, RoutingTrace

OPTIMUM_WINDOWS = 1024  # recent windows the optimum's hit rate is computed over


@dataclass
class TierTotals:
    """Running totals since start-up (the start-up fill not included). A routed entry is one
    (row, top-k pick); an access is one distinct (window, layer, expert), as replay counts."""

    num_windows: int = 0
    num_hits: int = 0  # routed entries whose expert was resident (served by the cache)
    num_misses: int = 0  # routed entries served from the store
    # of the misses, on the GPU with a CPU pool: the entries the pool computed (the rest were
    # read over PCIe), the pool's compute seconds and its seconds waiting for the GPU to publish
    # a layer (its share of the window's time the GPU's dense work and reads took)
    num_pool_entries: int = 0
    pool_s: float = 0.0
    pool_wait_s: float = 0.0
    num_access_hits: int = 0
    num_accesses: int = 0
    num_rounds: int = 0  # rounds that asked the policy
    num_rounds_skipped: int = 0  # async rounds skipped: the previous one was still copying
    num_fills: int = 0  # swaps into a free slot (nothing evicted)
    num_evictions: int = 0  # swaps that evicted a resident expert
    num_admissions: int = 0  # misses kept by their window's kernels (free admission)
    num_bytes_moved: int = 0  # bytes copied into cache slots by swaps
    wait_s: float = 0.0  # time windows spent waiting for the tier (outside the forward pass)
    max_wait_s: float = 0.0  # the longest wait of one window

    @property
    def num_swaps(self) -> int:
        return self.num_fills + self.num_evictions

    @property
    def hit_rate(self) -> float:
        total = self.num_hits + self.num_misses
        return self.num_hits / total if total else 0.0

    def minus(self, earlier: "TierTotals") -> "TierTotals":
        """The counts between `earlier` and now (max_wait_s stays this object's)."""
        diff = {f.name: getattr(self, f.name) - getattr(earlier, f.name) for f in fields(self)}
        diff["max_wait_s"] = self.max_wait_s
        return TierTotals(**diff)

    def copy(self) -> "TierTotals":
        return replace(self)


def format_group(totals: TierTotals, first_window: int, mode: str,
                 misses_on_gpu: bool = False) -> str:
    """One INFO line for a group of windows (`totals` holds that group's counts); `mode` is
    "async", "blocking" or "frozen"; `misses_on_gpu`: the misses were read over PCIe or
    computed by a CPU pool (the offload tiers), which the line splits."""
    num_routed = totals.num_hits + totals.num_misses
    skipped = f" ({totals.num_rounds_skipped} skipped)" if totals.num_rounds_skipped else ""
    served = f"{totals.num_hits} cache + {totals.num_misses} miss"
    admitted = (f", {totals.num_admissions} misses kept by their window (no copy)"
                if totals.num_admissions else "")
    if misses_on_gpu:
        served = (f"{totals.num_hits} VRAM + {totals.num_misses - totals.num_pool_entries} "
                  f"PCIe + {totals.num_pool_entries} CPU pool (pool "
                  f"{totals.pool_s * 1e3:.1f} ms computing, {totals.pool_wait_s * 1e3:.1f} ms "
                  "waiting for the GPU)")
    return (f"expert cache, windows {first_window}-{first_window + totals.num_windows - 1}: "
            f"{num_routed} routed entries = {served} "
            f"({totals.hit_rate:.1%} hit), {totals.num_rounds} rounds{skipped}, "
            f"{totals.num_swaps} swaps ({totals.num_fills} free fills + {totals.num_evictions} "
            f"evictions){admitted}, {totals.num_bytes_moved / 2**20:.1f} MiB moved, tier wait "
            f"{totals.wait_s * 1e3:.2f} ms ({mode}; at most {totals.max_wait_s * 1e3:.2f} ms "
            "in one window)")


@dataclass(frozen=True)
class OptimumResult:
    """Over the last `num_windows` windows: the cache's access hit rate and Belady's."""

    num_windows: int
    num_accesses: int
    cache_hit_rate: float
    optimum_hit_rate: float


class RecentRouting:
    """The routed (layer, expert) keys and cache hits of the last `max_windows` windows; the
    engine thread appends, a metrics scrape computes the optimum (cached per window count)."""

    def __init__(self, n_layers: int, n_experts: int, num_slots: int,
                 max_windows: int = OPTIMUM_WINDOWS):
        self.n_layers, self.n_experts, self.num_slots = n_layers, n_experts, num_slots
        self._windows: deque[tuple[np.ndarray, int]] = deque(maxlen=max_windows)
        self._lock = threading.Lock()
        self._num_appended = 0
        self._cached: tuple[int, OptimumResult] | None = None

    def append(self, keys: np.ndarray, num_hits: int) -> None:
        """One window: `keys` [n] int64 layer * E + expert of its accesses, ascending; how many
        of them hit the cache."""
        with self._lock:
            self._windows.append((keys, num_hits))
            self._num_appended += 1

    def optimum(self) -> OptimumResult:
        """Belady's access hit rate with the cache's slot count over the recent windows, beside
        the cache's own (Belady loads on demand; a tier loads ahead, so it can beat it)."""
        with self._lock:
            stamp = self._num_appended
            if self._cached is not None and self._cached[0] == stamp:
                return self._cached[1]
            windows = list(self._windows)
        parts = []
        for index, (keys, _) in enumerate(windows):
            part = np.empty(len(keys), dtype=RECORD_DTYPE)
            part["window"] = index
            part["layer"], part["expert"] = np.divmod(keys, self.n_experts)
            part["rows"] = 1
            parts.append(part)
        records = np.concatenate(parts) if parts else np.empty(0, dtype=RECORD_DTYPE)
        trace = RoutingTrace(self.n_layers, self.n_experts, records, {})
        best = replay_belady(trace, self.num_slots)
        num_hits = sum(hits for _, hits in windows)
        result = OptimumResult(len(windows), len(records),
                               num_hits / len(records) if len(records) else 0.0, best.hit_rate)
        with self._lock:
            self._cached = (stamp, result)
        return result


@dataclass
class WaitTotals:
    """Windows of one kind and the seconds they waited for the tier (rounds, copies landing)."""

    num_windows: int = 0
    wait_s: float = 0.0
    max_wait_s: float = 0.0

    def add(self, wait_s: float) -> None:
        self.num_windows += 1
        self.wait_s += wait_s
        self.max_wait_s = max(self.max_wait_s, wait_s)

    @property
    def mean_wait_ms(self) -> float:
        return self.wait_s / self.num_windows * 1e3 if self.num_windows else 0.0

    def describe(self, kind: str) -> str:
        return (f"{kind} {self.mean_wait_ms:.3f} ms/window over {self.num_windows} (max "
                f"{self.max_wait_s * 1e3:.2f} ms)")
