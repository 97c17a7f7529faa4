"""Ranked routing profiles (`strata-tool profile`): every (layer, expert) of one or more traces,
hottest first, in a small text file the expert cache fills its slots from at start-up.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from strata.errors import ModelFormatError
from strata.experts.trace import RoutingTrace, merge_traces

PROFILE_HEADER = "# strata routing profile v1"


@dataclass(frozen=True)
class RoutingProfile:
    """`ranking` [L*E, 2] int64 (layer, expert) hottest first; `accesses` and `rows` [L*E]
    in the same order: windows routed to it, rows routed to it."""

    n_layers: int
    n_experts: int
    ranking: np.ndarray
    accesses: np.ndarray
    rows: np.ndarray

    def top(self, num_slots: int) -> list[tuple[int, int]]:
        """The `num_slots` hottest (layer, expert) pairs."""
        return [(int(layer), int(expert)) for layer, expert in self.ranking[:num_slots]]

    def rows_by_expert(self) -> np.ndarray:
        """[L, E] int64: the rows routed to each (layer, expert)."""
        out = np.zeros((self.n_layers, self.n_experts), dtype=np.int64)
        out[self.ranking[:, 0], self.ranking[:, 1]] = self.rows
        return out


def build_profile(traces: RoutingTrace | list[RoutingTrace]) -> RoutingProfile:
    """Rank every (layer, expert) by window accesses, then rows, then (layer, expert) order."""
    trace = merge_traces(traces) if isinstance(traces, list) else traces
    accesses = trace.accesses_per_expert().reshape(-1)  # [L*E]
    rows = trace.rows_per_expert().reshape(-1)
    flat = np.arange(trace.n_layers * trace.n_experts)
    order = np.lexsort((flat, -rows, -accesses))  # the last key is the primary one
    ranking = np.stack(np.divmod(flat[order], trace.n_experts), axis=1)
    return RoutingProfile(trace.n_layers, trace.n_experts, ranking, accesses[order], rows[order])


def write_profile(path: str | os.PathLike, profile: RoutingProfile) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(f"{PROFILE_HEADER} n_layers={profile.n_layers} "
                f"n_experts={profile.n_experts}\n# rank layer expert accesses rows\n")
        for rank, ((layer, expert), accesses, rows) in enumerate(
                zip(profile.ranking, profile.accesses, profile.rows)):
            f.write(f"{rank} {layer} {expert} {accesses} {rows}\n")


def read_profile(path: str | os.PathLike) -> RoutingProfile:
    with open(path, encoding="utf-8") as f:
        first = f.readline()
        if not first.startswith(PROFILE_HEADER):
            raise ModelFormatError(f"{path} is not a Strata routing profile (first line "
                                   f"{first.strip()[:60]!r}); make one with `strata-tool "
                                   "profile TRACE... -o FILE`")
        try:
            sizes = dict(item.split("=") for item in first[len(PROFILE_HEADER):].split())
            n_layers, n_experts = int(sizes["n_layers"]), int(sizes["n_experts"])
            table = np.loadtxt(f, dtype=np.int64, comments="#", ndmin=2)
        except (KeyError, ValueError) as exc:
            raise ModelFormatError(f"{path}: damaged routing profile ({exc}); make it "
                                   "again with `strata-tool profile`") from None
    if table.shape != (n_layers * n_experts, 5) or not np.array_equal(
            table[:, 0], np.arange(len(table))):
        raise ModelFormatError(f"{path}: expected {n_layers * n_experts} ranked rows of 5 "
                               f"numbers, found {table.shape}; make it again with "
                               "`strata-tool profile`")
    return RoutingProfile(n_layers, n_experts, table[:, 1:3].copy(), table[:, 3].copy(),
                          table[:, 4].copy())
