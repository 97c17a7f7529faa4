"""Ranked routing profiles (`strata-tool profile`): every (layer, expert) of one or more traces,
hottest first, in a small text file the expert cache fills its slots from at start-up.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

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
        return self._by_expert(self.rows)

    def accesses_by_expert(self) -> np.ndarray:
        """[L, E] int64: the windows that routed to each (layer, expert)."""
        return self._by_expert(self.accesses)

    def _by_expert(self, values: np.ndarray) -> np.ndarray:
        out = np.zeros((self.n_layers, self.n_experts), dtype=np.int64)
        out[self.ranking[:, 0], self.ranking[:, 1]] = values
        return out


def build_profile(traces: RoutingTrace | list[RoutingTrace]) -> RoutingProfile:
    """Rank every (layer, expert) by window accesses, then rows, then (layer, expert) order."""
    trace = merge_traces(traces) if isinstance(traces, list) else traces
    return profile_from_counts(trace.accesses_per_expert(), trace.rows_per_expert())


def profile_from_counts(accesses: np.ndarray, rows: np.ndarray) -> RoutingProfile:
    """The profile of `accesses` (windows routed to each expert) and `rows` [L, E]: ranked by
    accesses, then rows, then (layer, expert) order."""
    n_layers, n_experts = accesses.shape
    accesses = np.asarray(accesses, dtype=np.int64).reshape(-1)  # [L*E]
    rows = np.asarray(rows, dtype=np.int64).reshape(-1)
    flat = np.arange(n_layers * n_experts)
    order = np.lexsort((flat, -rows, -accesses))  # the last key is the primary one
    ranking = np.stack(np.divmod(flat[order], n_experts), axis=1)
    return RoutingProfile(n_layers, n_experts, ranking, accesses[order], rows[order])


def write_profile(path: str | os.PathLike, profile: RoutingProfile) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(f"{PROFILE_HEADER} n_layers={profile.n_layers} "
                f"n_experts={profile.n_experts}\n# rank layer expert accesses rows\n")
        for rank, ((layer, expert), accesses, rows) in enumerate(
                zip(profile.ranking, profile.accesses, profile.rows)):
            f.write(f"{rank} {layer} {expert} {accesses} {rows}\n")


def read_profile(path: str | os.PathLike) -> RoutingProfile:
    with open(path, encoding="utf-8", errors="replace") as f:  # a binary file fails the header
        first = f.readline()
        if not first.startswith(PROFILE_HEADER):
            raise ModelFormatError(f"{path} is not a Strata routing profile (first line "
                                   f"{first.strip()[:60]!r}); make one with `strata-tool "
                                   "profile TRACE... -o FILE`")
        try:
            sizes = dict(item.split("=") for item in first[len(PROFILE_HEADER):].split())
            n_layers, n_experts = int(sizes["n_layers"]), int(sizes["n_experts"])
            if n_layers <= 0 or n_experts <= 0:
                raise ValueError(f"it ranks {n_layers} layers x {n_experts} experts")
            table = np.loadtxt(f, dtype=np.int64, comments="#", ndmin=2)
        except (KeyError, ValueError) as exc:
            raise ModelFormatError(f"{path}: damaged routing profile ({exc}); make it "
                                   "again with `strata-tool profile`") from None
    if table.shape != (n_layers * n_experts, 5) or not np.array_equal(
            table[:, 0], np.arange(len(table))):
        raise ModelFormatError(f"{path}: expected {n_layers * n_experts} ranked rows of 5 "
                               f"numbers, found {table.shape}; make it again with "
                               "`strata-tool profile`")
    ranking = table[:, 1:3]
    in_range = (ranking >= 0).all(axis=1) & (ranking[:, 0] < n_layers) & (
        ranking[:, 1] < n_experts)
    if not in_range.all():
        layer, expert = ranking[np.argmin(in_range)]
        raise ModelFormatError(f"{path}: ranked expert ({layer}, {expert}) is out of range "
                               f"for {n_layers} layers x {n_experts} experts; make it again "
                               "with `strata-tool profile`")
    flat = ranking[:, 0] * n_experts + ranking[:, 1]
    if len(np.unique(flat)) != len(flat):
        layer, expert = np.divmod(int(np.argmax(np.bincount(flat))), n_experts)
        raise ModelFormatError(f"{path}: expert ({layer}, {expert}) is ranked twice; make it "
                               "again with `strata-tool profile`")
    return RoutingProfile(n_layers, n_experts, ranking.copy(), table[:, 3].copy(),
                          table[:, 4].copy())


# ---- the stored profile (`--expert-profile auto`) ---------------------------------------------
# At each save the stored counts are multiplied by this before this run's are added, so the
# profile follows what the server is used for now: a run's traffic weighs half at the next save.
STORED_KEEP = 0.5


def stored_profile_path(model_path) -> Path:
    """Where `--expert-profile auto` keeps the routing profile of this model file: the user cache
    folder (strata.user_cache), named by the file's name and a digest of its resolved path and
    size."""
    from strata.user_cache import cache_dir

    path = Path(model_path).resolve()
    digest = hashlib.sha256(f"{path}|{path.stat().st_size}".encode()).hexdigest()[:16]
    return cache_dir() / "profiles" / f"{path.stem}-{digest}.profile"


def save_stored_profile(path, accesses: np.ndarray, rows: np.ndarray) -> RoutingProfile:
    """Fold this run's `accesses` and `rows` [L, E] into the stored profile at `path` (its counts
    x STORED_KEEP first; a missing, damaged or other-shaped one counts as empty) and write it
    whole (a reader never sees half a file). Returns what was written."""
    path = Path(path)
    accesses = np.asarray(accesses, dtype=np.int64)
    rows = np.asarray(rows, dtype=np.int64)
    try:
        old = read_profile(path)
    except (OSError, ModelFormatError):
        old = None
    if old is not None and (old.n_layers, old.n_experts) == accesses.shape:
        accesses = accesses + np.floor(old.accesses_by_expert() * STORED_KEEP).astype(np.int64)
        rows = rows + np.floor(old.rows_by_expert() * STORED_KEEP).astype(np.int64)
    profile = profile_from_counts(accesses, rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    write_profile(tmp, profile)
    os.replace(tmp, path)
    return profile


class StoredProfileRecorder:
    """The routing of a run, for `--expert-profile auto`: `add(counts)` after every window (its
    rows [L, E]); `save()` at close folds it into the stored profile (save_stored_profile) and
    logs where, or why not (a folder it cannot write: the run is not failed for it)."""

    def __init__(self, path, n_layers: int, n_experts: int):
        self.path = Path(path)
        self.accesses = np.zeros((n_layers, n_experts), dtype=np.int64)
        self.rows = np.zeros((n_layers, n_experts), dtype=np.int64)
        self.num_windows = 0

    def add(self, counts: np.ndarray) -> None:
        self.rows += counts
        self.accesses += counts > 0
        self.num_windows += 1

    def save(self) -> None:
        import logging

        log = logging.getLogger("strata.tier")
        if not self.num_windows:
            return
        try:
            save_stored_profile(self.path, self.accesses, self.rows)
        except OSError as exc:
            log.warning("routing profile not stored (%s: %s); the next start fills the cache "
                        "as this one did", self.path, exc.strerror or exc)
            return
        log.info("routing profile stored in %s (this run's %d windows added to it); "
                 "--expert-profile auto fills the cache from it at the next start", self.path,
                 self.num_windows)
