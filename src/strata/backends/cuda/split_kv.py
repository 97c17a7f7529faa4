"""The KV of one sequence over a layer split (each stage holds its layers' cells on its GPU) with
the KVCache interface, and the windows a split pass runs: one per stage (the stage's KVs) and
one per slot group (contiguous runs, balanced by rows).
"""
from __future__ import annotations

import numpy as np

from strata.backends.window import Window
from strata.engine.kv import SequenceReuse
from strata.errors import ConfigError


class SplitKV(SequenceReuse):
    """KV cells of one sequence, stage i's layers in `parts[i]` (global layer l lives in the
    part whose first layer is the largest <= l, as its local layer l - first). Every part
    holds the same tokens: `commit`, `truncate` and `clear` move them together."""

    def __init__(self, spec, parts: list, first_layers: list[int]):
        if not parts or len(parts) != len(first_layers) or first_layers[0] != 0:
            raise ConfigError(f"a split KV needs one part per stage, the first from layer 0; "
                              f"got {len(parts)} parts for first layers {first_layers}")
        self.spec = spec
        self.parts = list(parts)
        self._firsts = [int(f) for f in first_layers]
        self._stops = self._firsts[1:] + [spec.n_layers]
        p = self.parts[0]
        self.dtype, self.host_dtype = p.dtype, getattr(p, "host_dtype", p.dtype)
        self.is_int8 = getattr(p, "is_int8", False)
        self.capacity = p.capacity

    @property
    def num_tokens(self) -> int:
        return self.parts[0].num_tokens

    @property
    def num_layers(self) -> int:
        return self.spec.n_layers  # every layer has cells: a split refuses hybrid models

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def room_tokens(self) -> int:
        return self.capacity - self.num_tokens

    def can_append(self, num_new_tokens: int) -> bool:
        return self.parts[0].can_append(num_new_tokens)

    def check_room(self, num_new_tokens: int) -> None:
        self.parts[0].check_room(num_new_tokens)

    def part_of(self, layer: int) -> tuple[object, int]:
        """(the part holding global `layer`, its local layer index)."""
        if not 0 <= layer < self.spec.n_layers:
            raise IndexError(f"layer {layer} is outside the model's {self.spec.n_layers}")
        for part, first, stop in zip(self.parts, self._firsts, self._stops):
            if first <= layer < stop:
                return part, layer - first
        raise IndexError(f"layer {layer} is in no stage ({self._firsts})")

    def keys(self, layer: int) -> np.ndarray:
        part, local = self.part_of(layer)
        return part.keys(local)

    def values(self, layer: int) -> np.ndarray:
        part, local = self.part_of(layer)
        return part.values(local)

    def append(self, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        part, local = self.part_of(layer)
        part.append(local, k, v)

    def commit(self, num_new_tokens: int) -> None:
        self.check_room(num_new_tokens)
        for part in self.parts:
            part.commit(num_new_tokens)

    def truncate(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= self.num_tokens:
            raise ValueError(
                f"cannot truncate a KV cache of {self.num_tokens} tokens to {num_tokens}")
        for part in self.parts:
            part.truncate(num_tokens)

    def clear(self) -> None:
        for part in self.parts:
            part.clear()

    def __repr__(self) -> str:
        return (f"SplitKV({self.num_tokens}/{self.capacity} tokens over {len(self.parts)} "
                f"stages, layers from {self._firsts})")


def stage_window(window: Window, stage: int) -> Window:
    """`window` with each SplitKV replaced by its part on `stage` (same rows and logit rows)."""
    return Window(tuple(kv.parts[stage] for kv in window.kvs), window.tokens, window.positions,
                  window.slots, window.run_starts, window.start_tokens, window.logit_rows,
                  window.logit_starts)


def sub_window(window: Window, first_run: int, stop_run: int) -> Window:
    """Runs [first_run, stop_run) of `window` as a window of their own (rows renumbered)."""
    r0, r1 = int(window.run_starts[first_run]), int(window.run_starts[stop_run])
    l0, l1 = int(window.logit_starts[first_run]), int(window.logit_starts[stop_run])
    return Window(window.kvs[first_run:stop_run], window.tokens[r0:r1],
                  window.positions[r0:r1], window.slots[r0:r1] - first_run,
                  window.run_starts[first_run:stop_run + 1] - r0,
                  window.start_tokens[first_run:stop_run], window.logit_rows[l0:l1] - r0,
                  window.logit_starts[first_run:stop_run + 1] - l0)


def group_bounds(run_lengths: np.ndarray, num_groups: int) -> list[int]:
    """Run indices [0, b1, .., S] cutting the runs into at most `num_groups` contiguous groups
    of about equal rows, each with at least one run: group g ends at the first run whose
    cumulative rows reach (g + 1) / G of the total."""
    S = len(run_lengths)
    G = max(1, min(int(num_groups), S))
    ends = np.cumsum(run_lengths)  # [S]
    bounds = [0]
    for g in range(1, G):
        target = ends[-1] * g / G
        cut = int(np.searchsorted(ends, target, side="left")) + 1
        # leave at least one run for each later group, and take at least one
        cut = min(max(cut, bounds[-1] + 1), S - (G - g))
        bounds.append(cut)
    bounds.append(S)
    return bounds


def group_windows(window: Window, num_groups: int) -> list[Window]:
    """The window's runs as `num_groups` contiguous slot groups (the window itself for one);
    logit rows keep their order: group g's are rows [l_g, l_g+1) of the whole window's."""
    if num_groups <= 1 or window.num_slots <= 1:
        return [window]
    bounds = group_bounds(window.run_lengths(), num_groups)
    return [sub_window(window, a, b) for a, b in zip(bounds, bounds[1:])]
