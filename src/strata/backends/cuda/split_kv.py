"""The KV of one sequence over a layer split (each stage holds its layers' cells on its GPU) with
the KVCache interface, and the windows a split pass runs: one per stage (the stage's KVs) and
one per slot group (contiguous runs, balanced by rows).
"""
from __future__ import annotations

import numpy as np

from strata.backends.window import Window
from strata.engine.kv import SequenceReuse
from strata.engine.recurrent import RecurrentState
from strata.errors import ConfigError


class _SplitState:
    """A hybrid model's recurrent state over a split: each part (stage) with recurrent layers
    holds theirs in its own KV; a window's commit flips them together."""

    def __init__(self, parts: list):
        self.parts = [part for part in parts if part.state is not None]

    nbytes_per_state = staticmethod(RecurrentState.nbytes_per_state)  # of the whole model

    @property
    def max_checkpoints(self) -> int:
        return self.parts[0].state.max_checkpoints

    @property
    def checkpoints(self):
        """The positions kept (every part keeps the same ones), each with the first part's
        copy; `SplitKV.export_state` takes every part's."""
        return self.parts[0].state.checkpoints

    def positions(self) -> tuple[int, ...]:
        return self.parts[0].state.positions()

    def flip(self) -> None:
        for part in self.parts:
            part.state.flip()


class SplitKV(SequenceReuse):
    """KV cells of one sequence, stage i's layers in `parts[i]` (global layer l lives in the
    part whose first layer is the largest <= l, as its local layer l - first). Every part
    holds the same tokens: `commit`, `truncate` and `clear` move them together. A hybrid
    model's parts also hold their layers' recurrent state, with checkpoints kept and taken
    back together, so every part can go back to the same lengths."""

    min_copy_gain = 0.1  # parks and restores cross PCIe: as CudaKV.min_copy_gain

    def __init__(self, spec, parts: list, first_layers: list[int]):
        if not parts or len(parts) != len(first_layers) or first_layers[0] != 0:
            raise ConfigError(f"a split KV needs one part per stage, the first from layer 0; "
                              f"got {len(parts)} parts for first layers {first_layers}")
        self.spec = spec
        self.parts = list(parts)
        self._firsts = [int(f) for f in first_layers]
        p = self.parts[0]
        self.dtype, self.host_dtype = p.dtype, getattr(p, "host_dtype", p.dtype)
        self.is_int8 = getattr(p, "is_int8", False)
        self.capacity = p.capacity
        self.state = _SplitState(self.parts) if spec.recurrent_layers else None

    @property
    def num_tokens(self) -> int:
        return self.parts[0].num_tokens

    @property
    def num_layers(self) -> int:
        """Layers with cells (a hybrid model's attention layers)."""
        return sum(part.num_layers for part in self.parts)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def can_append(self, num_new_tokens: int) -> bool:
        return self.parts[0].can_append(num_new_tokens)

    def check_room(self, num_new_tokens: int) -> None:
        self.parts[0].check_room(num_new_tokens)

    def part_of(self, layer: int) -> tuple[object, int]:
        """(the part holding the cells of `layer`, its index there). Layers count those with
        cells, as `num_layers` does: every layer, or a hybrid model's attention layers."""
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} is outside the {self.num_layers} with cells")
        for part in self.parts:
            if layer < part.num_layers:
                return part, layer
            layer -= part.num_layers
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

    def copy_prefix(self, source, num_tokens: int) -> None:
        """Part by part (each stage's cells on its own GPU) when `source` is split alike."""
        if not (isinstance(source, SplitKV) and source._firsts == self._firsts):
            super().copy_prefix(source, num_tokens)
            return
        for part, src in zip(self.parts, source.parts):
            part.copy_prefix(src, num_tokens)

    def truncate(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= self.num_tokens:
            raise ValueError(
                f"cannot truncate a KV cache of {self.num_tokens} tokens to {num_tokens}")
        for part in self.parts:
            part.truncate(num_tokens)

    def clear(self) -> None:
        for part in self.parts:
            part.clear()

    # the reuse side: the parts with a state agree on the lengths they can go back to
    @property
    def _lead(self):
        return self.state.parts[0] if self.state is not None else self.parts[0]

    def reusable(self, num_tokens: int) -> int:
        return self._lead.reusable(num_tokens)

    def reuse_points(self):
        return self._lead.reuse_points()

    def export_state(self):
        if self.state is None:
            return None
        return tuple(part.export_state() for part in self.parts)

    def import_state(self, exported, num_tokens: int) -> None:
        if self.state is None:
            return
        if not isinstance(exported, tuple) or len(exported) != len(self.parts):
            raise ValueError(f"a split KV of {len(self.parts)} stages restores a state "
                             "parked from a split of as many stages")
        for part, one in zip(self.parts, exported):
            part.import_state(one, num_tokens)

    def keep_checkpoint(self) -> bool:
        return self.state is not None and all([part.keep_checkpoint()
                                               for part in self.state.parts])

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
