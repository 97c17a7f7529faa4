"""The tier policy `window-score` (not the default: docs/tier.md says why): scores updated
every window (how often an expert is routed, plus how many rows it took in the last window);
rounds swap by score, and with free admission (a missed expert's bytes crossed the link anyway)
missed experts may stay resident.
"""
from __future__ import annotations

import numpy as np

from strata.experts.tier import FREE_SLOT, check_knobs, plan_by_scores
from strata.hookspecs import ExpertSwap


class WindowScoreTier:
    """Scores every (layer, expert) after every window (the optional `observe` hook) with
    `score = frequency + recency_weight * recent_rows`: `frequency` is the share of recent
    windows that routed to it (decayed by `decay` per window: a memory of about
    `1 / (1 - decay)` = 50 windows), `recent_rows` the rows it took in the last window. On
    synth traces the chance that an expert is routed again next window grows with both: with
    the default weight 1 every expert routed in the last window outranks every one that was
    not, and frequency orders each group (LRFU-like, at window granularity).

    A round (`plan_swaps`, every `--adapt-every` windows) plans as DecayedCountTier does: free
    slots first, then best missing for worst resident while the gain clears
    `min_gain + hysteresis * score[victim]`, at most `max_swaps`. `min_gain` is in score units
    (about expected accesses in the next window). A caller that never calls `observe` still
    works: a round without an observed window folds its summed counts in as one window.

    `admit` is the free-admission hook: after a window, which experts it missed to keep in the
    cache, each into a free slot or in place of the lowest-scored resident expert that window
    did not route to, while the missed expert's score is higher. With the default weight a
    just-routed expert always scores higher, so it admits every miss it has a victim for and
    evicts the least frequent unrouted expert (a TinyLFU-style filter on frequency alone,
    admitting only a miss more frequent than its victim, replayed worse: docs/tier.md). Only
    worth calling where the miss already moved the bytes (GPU reach over PCIe). `victims` is
    its form in the engine, where the kernels keep misses as they read them and so need the
    slots before the window: the lowest-scored residents, which `admit` would evict first.
    """

    name = "window-score"

    def __init__(self, num_cache_slots: int | None = None, max_swaps: int = 64, *,
                 decay: float = 0.98, recency_weight: float = 1.0, hysteresis: float = 0.5):
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must lie in [0, 1), not {decay}")
        if recency_weight < 0.0:
            raise ValueError(f"recency_weight must be >= 0 (0 = frequency only), not "
                             f"{recency_weight}")
        check_knobs(num_cache_slots, max_swaps, hysteresis)
        self.num_cache_slots = num_cache_slots
        self.max_swaps = max_swaps
        self.decay = decay
        self.recency_weight = recency_weight
        self.hysteresis = hysteresis
        self.frequency: np.ndarray | None = None  # [L, E] float64, share of windows routed
        self.recent_rows: np.ndarray | None = None  # [L, E] float64, rows of the last window
        self.num_windows_observed = 0  # since the last round

    @property
    def scores(self) -> np.ndarray | None:
        """[L, E] float64: `frequency + recency_weight * recent_rows` (None before any window)."""
        if self.frequency is None:
            return None
        return self.frequency + self.recency_weight * self.recent_rows

    def observe(self, counts: np.ndarray) -> None:
        """One window's routed rows `counts` [L, E] (read only, not kept)."""
        is_routed = (counts > 0).astype(np.float64)  # [L, E]
        if self.frequency is None or self.frequency.shape != counts.shape:
            self.frequency = is_routed  # the first window is the best estimate there is
        else:
            self.frequency = self.decay * self.frequency + (1.0 - self.decay) * is_routed
        self.recent_rows = counts.astype(np.float64)
        self.num_windows_observed += 1

    def plan_swaps(self, counts: np.ndarray, residency: np.ndarray,
                   min_gain: float) -> list[ExpertSwap]:
        if self.num_windows_observed == 0:
            self.observe(counts)  # a caller without the per-window hook: the round as a window
        self.num_windows_observed = 0
        return plan_by_scores(self.scores, residency, self.num_cache_slots, self.max_swaps,
                              min_gain, self.hysteresis)

    def admit(self, counts: np.ndarray, residency: np.ndarray) -> list[ExpertSwap]:
        """Free admission after the window whose routed rows are `counts` [L, E] (already
        observed): swaps that keep missed experts, best first. A load is always an expert this
        window routed to and missed; an eviction never an expert it routed to."""
        scores = self.scores.reshape(-1)
        is_routed = counts.reshape(-1) > 0
        is_resident = residency.reshape(-1) >= 0
        missed = np.flatnonzero(is_routed & ~is_resident)
        missed = missed[np.argsort(-scores[missed], kind="stable")]
        victims = np.flatnonzero(is_resident & ~is_routed)
        victims = victims[np.argsort(scores[victims], kind="stable")]
        n_experts = counts.shape[1]
        num_free = (0 if self.num_cache_slots is None
                    else self.num_cache_slots - int(is_resident.sum()))
        swaps = [ExpertSwap(*divmod(int(load), n_experts), FREE_SLOT, FREE_SLOT)
                 for load in missed[:max(num_free, 0)]]
        for load, victim in zip(missed[len(swaps):], victims):
            if scores[load] <= scores[victim]:
                break  # pairs only get worse from here
            swaps.append(ExpertSwap(*divmod(int(load), n_experts), *divmod(int(victim),
                                                                           n_experts)))
        return swaps

    def victims(self, residency: np.ndarray, n: int) -> list[tuple[int, int]]:
        """Up to `n` resident (layer, expert)s, lowest score first: whose slots a window may
        take for the experts it misses (free admission in the engine). None before the first
        observed window (no scores yet)."""
        if self.frequency is None or n <= 0:
            return []
        resident = np.flatnonzero(residency.reshape(-1) >= 0)
        scores = self.scores.reshape(-1)[resident]
        if n < len(resident):  # the n lowest (ties by key), then in order
            cut = np.partition(scores, n - 1)[n - 1]
            pick = np.flatnonzero(scores <= cut)
            resident, scores = resident[pick], scores[pick]
        worst = resident[np.argsort(scores, kind="stable")[:n]]
        n_experts = residency.shape[1]
        return [divmod(int(key), n_experts) for key in worst]
