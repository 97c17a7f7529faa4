"""Replay a routing trace through an expert cache of N slots under a tier policy, LRU, LFU, a
static profile cache and Belady's optimum. An access is one distinct (window, layer, expert), as
the engine reads each routed expert once per window; a hit is an access to a resident expert.
"""
from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from strata.errors import ConfigError
from strata.experts.profile import RoutingProfile, build_profile
from strata.experts.tier import FREE_SLOT
from strata.experts.trace import RoutingTrace
from strata.hookspecs import TierPolicy


@dataclass(frozen=True)
class ReplayResult:
    name: str
    num_hits: int
    num_accesses: int
    num_loads: int  # experts copied into the cache (misses that insert, or swaps)
    num_admissions: int = 0  # missed experts kept by free admission (no copy of their own)

    @property
    def hit_rate(self) -> float:
        return self.num_hits / self.num_accesses if self.num_accesses else 0.0


def access_ids(trace: RoutingTrace) -> np.ndarray:
    """[N] int64: layer * n_experts + expert of every access, in window, layer, expert order."""
    return trace.records["layer"].astype(np.int64) * trace.n_experts + trace.records["expert"]


def _check_slots(trace: RoutingTrace, num_slots: int) -> None:
    if not 0 <= num_slots <= trace.n_layers * trace.n_experts:
        raise ConfigError(f"--slots {num_slots} must lie in 0..{trace.n_layers * trace.n_experts}"
                          f" (the trace's {trace.n_layers} layers x {trace.n_experts} experts)")


def replay_lru(trace: RoutingTrace, num_slots: int) -> ReplayResult:
    """Least recently used: a miss loads the expert, evicting the least recently accessed."""
    _check_slots(trace, num_slots)
    cache: OrderedDict[int, None] = OrderedDict()
    num_hits = num_loads = 0
    for key in access_ids(trace).tolist():
        if key in cache:
            num_hits += 1
            cache.move_to_end(key)
        elif num_slots:
            if len(cache) >= num_slots:
                cache.popitem(last=False)
            cache[key] = None
            num_loads += 1
    return ReplayResult("lru", num_hits, len(trace.records), num_loads)


def replay_lfu(trace: RoutingTrace, num_slots: int) -> ReplayResult:
    """Least frequently used (counts since the start): a miss loads the expert, evicting the
    resident one with the fewest accesses, the least recently accessed among equals."""
    _check_slots(trace, num_slots)
    counts: dict[int, int] = {}
    last_tick: dict[int, int] = {}
    resident: set[int] = set()
    heap: list[tuple[int, int, int]] = []  # (count, tick, key); stale entries skipped on pop
    num_hits = num_loads = 0
    for tick, key in enumerate(access_ids(trace).tolist()):
        counts[key] = counts.get(key, 0) + 1
        last_tick[key] = tick
        if key in resident:
            num_hits += 1
        elif num_slots:
            while len(resident) >= num_slots:
                count, when, victim = heapq.heappop(heap)
                if victim in resident and counts[victim] == count and last_tick[victim] == when:
                    resident.discard(victim)
            resident.add(key)
            num_loads += 1
        else:
            continue
        heapq.heappush(heap, (counts[key], tick, key))
    return ReplayResult("lfu", num_hits, len(trace.records), num_loads)


def replay_static(trace: RoutingTrace, num_slots: int,
                  profile: RoutingProfile | None = None) -> ReplayResult:
    """The `num_slots` hottest experts of `profile` (default: the trace's own profile, the best
    static choice in hindsight) stay resident throughout."""
    _check_slots(trace, num_slots)
    profile = build_profile(trace) if profile is None else profile
    if (profile.n_layers, profile.n_experts) != (trace.n_layers, trace.n_experts):
        raise ConfigError(f"the profile is for {profile.n_layers} x {profile.n_experts} "
                          f"experts, the trace {trace.n_layers} x {trace.n_experts}; use a "
                          "profile made from traces of the same model")
    is_resident = np.zeros(trace.n_layers * trace.n_experts, dtype=bool)
    top = profile.ranking[:num_slots]
    is_resident[top[:, 0] * trace.n_experts + top[:, 1]] = True
    return ReplayResult("static-profile", int(is_resident[access_ids(trace)].sum()),
                        len(trace.records), num_slots)


def replay_belady(trace: RoutingTrace, num_slots: int) -> ReplayResult:
    """Belady's optimum with bypass: on a miss keep whichever of the resident experts and the
    requested one are needed soonest. No policy that loads an expert only when it is routed to
    (LRU, LFU, any demand cache) gets more hits; a tier that loads ahead can (its first access
    after a load is a hit), so replay_round_oracle bounds those."""
    _check_slots(trace, num_slots)
    keys = access_ids(trace).tolist()
    never = len(keys)
    next_use = [never] * len(keys)
    seen: dict[int, int] = {}
    for i in range(len(keys) - 1, -1, -1):
        next_use[i] = seen.get(keys[i], never)
        seen[keys[i]] = i
    resident: dict[int, int] = {}  # key -> its next use
    heap: list[tuple[int, int]] = []  # (-next use, key); stale entries skipped on pop
    num_hits = num_loads = 0
    for i, key in enumerate(keys):
        if key in resident:
            num_hits += 1
        elif num_slots == 0 or next_use[i] == never:
            continue
        elif len(resident) >= num_slots:
            while True:
                negative_use, victim = heap[0]
                if resident.get(victim) == -negative_use:
                    break
                heapq.heappop(heap)
            if -negative_use <= next_use[i]:
                continue  # every resident expert is needed before this one: bypass
            heapq.heappop(heap)
            del resident[victim]
            num_loads += 1
        else:
            num_loads += 1
        resident[key] = next_use[i]
        heapq.heappush(heap, (-next_use[i], key))
    return ReplayResult("belady", num_hits, len(trace.records), num_loads)


def replay_round_oracle(trace: RoutingTrace, num_slots: int, adapt_every: int = 4) -> ReplayResult:
    """The best a tier could do that changes residency only between rounds of `adapt_every`
    windows, as every TierPolicy does: each round, in hindsight, the `num_slots` experts that
    round accesses most. An upper bound for replay_tier; Belady's bounds every policy."""
    _check_slots(trace, num_slots)
    if adapt_every < 1:
        raise ConfigError(f"--adapt-every must be at least 1, not {adapt_every}")
    total = trace.n_layers * trace.n_experts
    rounds = trace.records["window"].astype(np.int64) // adapt_every
    counts = np.bincount(rounds * total + access_ids(trace),
                         minlength=(int(rounds[-1]) + 1) * total if len(rounds) else 0)
    per_round = np.sort(counts.reshape(-1, total), axis=1)[:, ::-1]  # [rounds, L*E]
    num_hits = int(per_round[:, :num_slots].sum())
    num_loads = int((per_round[:, :num_slots] > 0).sum())  # at most: loads it keeps are free
    return ReplayResult("round-oracle", num_hits, len(trace.records), num_loads)


def replay_tier(trace: RoutingTrace, num_slots: int, policy: TierPolicy, adapt_every: int = 4,
                min_gain: float = 0.0, *, free_admission: bool = False) -> ReplayResult:
    """Run `policy` as the engine does: the cache starts empty, misses are served without
    loading; after every window the policy's optional `observe` gets that window's routed rows;
    after every `adapt_every` windows `plan_swaps` gets the counts (rows) since its last round
    and the residency, and its swaps are applied before the next window.

    `free_admission` models a backend whose misses move the expert's bytes over the link anyway
    (GPU reach over PCIe): after every window (before a round) the policy's `admit` may keep
    experts that window missed, each into a free slot or in place of an expert it did not route
    to; they count as admissions, not loads (no copy of their own). The result is named
    `<policy>+admit`."""
    _check_slots(trace, num_slots)
    if adapt_every < 1:
        raise ConfigError(f"--adapt-every must be at least 1, not {adapt_every}")
    if free_admission and not callable(getattr(policy, "admit", None)):
        raise ConfigError(f"tier policy {policy.name!r} has no `admit` method, so free "
                          "admission cannot be replayed with it; leave free admission off")
    observe = getattr(policy, "observe", None)
    shape = (trace.n_layers, trace.n_experts)
    residency = np.full(shape, -1, dtype=np.int32)  # [L, E] slot or -1
    free_slots = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first
    counts = np.zeros(shape, dtype=np.int64)  # [L, E] rows since the last round
    window_counts = np.zeros(shape, dtype=np.int64)  # [L, E] rows of this window
    windows = trace.records["window"]
    bounds = np.searchsorted(windows, np.arange(trace.num_windows + 1))
    keys = access_ids(trace)
    rows = trace.records["rows"].astype(np.int64)
    num_hits = num_loads = num_admissions = 0
    for window in range(trace.num_windows):
        start, stop = bounds[window], bounds[window + 1]
        num_hits += int((residency.reshape(-1)[keys[start:stop]] >= 0).sum())
        window_counts[:] = 0
        window_counts.reshape(-1)[keys[start:stop]] = rows[start:stop]  # distinct per window
        counts += window_counts
        if callable(observe):
            observe(window_counts.copy())
        if free_admission:
            admissions = policy.admit(window_counts.copy(), residency.copy())
            _check_admissions(window_counts, admissions, policy.name)
            num_admissions += _apply_swaps(residency, free_slots, admissions, policy.name)
        if (window + 1) % adapt_every == 0:
            swaps = policy.plan_swaps(counts.copy(), residency.copy(), min_gain)
            num_loads += _apply_swaps(residency, free_slots, swaps, policy.name)
            counts[:] = 0
    name = f"{policy.name}+admit" if free_admission else policy.name
    return ReplayResult(name, num_hits, len(trace.records), num_loads, num_admissions)


def _check_admissions(window_counts: np.ndarray, admissions, policy_name: str) -> None:
    """Free admission keeps bytes this window read: loads it routed to, evictions it did not."""
    for swap in admissions:
        if window_counts[swap.load_layer, swap.load_expert] == 0:
            raise ConfigError(f"tier policy {policy_name!r} admits ({swap.load_layer}, "
                              f"{swap.load_expert}), which the window did not route to (its "
                              "bytes were not read); fix the plugin")
        if swap.evict_layer != FREE_SLOT and window_counts[swap.evict_layer,
                                                           swap.evict_expert] > 0:
            raise ConfigError(f"tier policy {policy_name!r} evicts ({swap.evict_layer}, "
                              f"{swap.evict_expert}) on admission, but the window routed to "
                              "it; fix the plugin")


def _apply_swaps(residency: np.ndarray, free_slots: list[int], swaps, policy_name: str) -> int:
    for swap in swaps:
        if residency[swap.load_layer, swap.load_expert] >= 0:
            raise ConfigError(f"tier policy {policy_name!r} loads ({swap.load_layer}, "
                              f"{swap.load_expert}), which is resident already; fix the plugin")
        if swap.evict_layer == FREE_SLOT:
            if not free_slots:
                raise ConfigError(f"tier policy {policy_name!r} asked for a free slot, but "
                                  "every slot is taken; fix the plugin")
            slot = free_slots.pop()
        else:
            slot = int(residency[swap.evict_layer, swap.evict_expert])
            if slot < 0:
                raise ConfigError(f"tier policy {policy_name!r} evicts ({swap.evict_layer}, "
                                  f"{swap.evict_expert}), which is not resident; fix the plugin")
            residency[swap.evict_layer, swap.evict_expert] = -1
        residency[swap.load_layer, swap.load_expert] = slot
    return len(swaps)


def replay_all(trace: RoutingTrace, num_slots: int, policy: TierPolicy, adapt_every: int = 4,
               min_gain: float = 0.0, profile: RoutingProfile | None = None,
               progress=None) -> list[ReplayResult]:
    """The policy, then LRU, LFU, the static profile cache, the round oracle and Belady. (The
    free-admission row is `replay_tier(..., free_admission=True)` with a fresh policy.)
    `progress`: a tqdm bar advanced by one as each row is done."""
    rows = (lambda: replay_tier(trace, num_slots, policy, adapt_every, min_gain),
            lambda: replay_lru(trace, num_slots), lambda: replay_lfu(trace, num_slots),
            lambda: replay_static(trace, num_slots, profile),
            lambda: replay_round_oracle(trace, num_slots, adapt_every),
            lambda: replay_belady(trace, num_slots))
    results = []
    for row in rows:
        results.append(row())
        if progress is not None:
            progress.update(1)
    return results
