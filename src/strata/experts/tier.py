"""The default tier policy: decayed routing counts per (layer, expert); each round fills free
cache slots with the hottest missing experts, then swaps hot missing for cold resident ones.
"""
from __future__ import annotations

import numpy as np

from strata.hookspecs import ExpertSwap

# A swap into a free slot evicts nobody: ExpertSwap(layer, expert, FREE_SLOT, FREE_SLOT).
FREE_SLOT = -1


class DecayedCountTier:
    """Scores every (layer, expert) with `score = decay * score + counts` once per round.

    A round returns, best first and at most `max_swaps` in all: loads of the hottest missing
    experts into the free slots (gain = its score), then pairs of the hottest missing and the
    coldest resident expert while the gain (score difference) is above `min_gain`. Free slots
    are known only when `num_cache_slots` is given (else only swaps are planned). The policy
    assumes the engine applies every swap it returns before the next round.
    """

    name = "decayed-count"

    def __init__(self, num_cache_slots: int | None = None, decay: float = 0.7,
                 max_swaps: int = 64):
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must lie in [0, 1), not {decay}")
        if max_swaps < 1:
            raise ValueError(f"max_swaps must be at least 1, not {max_swaps}")
        self.num_cache_slots = num_cache_slots
        self.decay = decay
        self.max_swaps = max_swaps
        self.scores: np.ndarray | None = None  # [L, E] float64

    def plan_swaps(self, counts: np.ndarray, residency: np.ndarray,
                   min_gain: float) -> list[ExpertSwap]:
        if self.scores is None or self.scores.shape != counts.shape:
            self.scores = np.zeros(counts.shape, dtype=np.float64)
        self.scores = self.decay * self.scores + counts  # new array: counts stays untouched
        n_experts = counts.shape[1]
        flat_scores = self.scores.reshape(-1)
        is_resident = residency.reshape(-1) >= 0
        missing = np.flatnonzero(~is_resident)
        resident = np.flatnonzero(is_resident)
        # Hottest missing first, coldest resident first; ties by (layer, expert) order.
        missing = missing[np.argsort(-flat_scores[missing], kind="stable")]
        resident = resident[np.argsort(flat_scores[resident], kind="stable")]

        swaps: list[ExpertSwap] = []
        num_free = 0 if self.num_cache_slots is None else self.num_cache_slots - len(resident)
        next_missing = 0
        while (len(swaps) < min(num_free, self.max_swaps) and next_missing < len(missing)
               and flat_scores[missing[next_missing]] > min_gain):
            layer, expert = divmod(int(missing[next_missing]), n_experts)
            swaps.append(ExpertSwap(layer, expert, FREE_SLOT, FREE_SLOT))
            next_missing += 1
        for victim in resident:
            if len(swaps) >= self.max_swaps or next_missing >= len(missing):
                break
            load = missing[next_missing]
            if flat_scores[load] - flat_scores[victim] <= min_gain:
                break  # pairs only get worse from here
            swaps.append(ExpertSwap(*divmod(int(load), n_experts), *divmod(int(victim),
                                                                          n_experts)))
            next_missing += 1
        return swaps
