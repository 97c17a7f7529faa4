"""Routing traces (`--dump-routing FILE`): one (window, layer, expert, rows) record per distinct
routed expert per window and layer, in a compact binary file; reader, merge and skew summary.
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass

import numpy as np

from strata.errors import ConfigError, ModelFormatError

TRACE_MAGIC = b"STRTRACE"
TRACE_VERSION = 1
# Header: magic, version, n_layers, n_experts, length of the JSON extra that follows.
_HEADER = struct.Struct("<8sIIII")
RECORD_DTYPE = np.dtype([("window", "<u4"), ("layer", "<u2"), ("expert", "<u2"),
                         ("rows", "<u4")])
_FLUSH_RECORDS = 1 << 14  # buffered records before a write


@dataclass(frozen=True)
class RoutingTrace:
    """A whole trace in memory. `records` is a RECORD_DTYPE array sorted by (window, layer,
    expert), one record per distinct expert a layer routed to in a window; `num_windows` counts
    windows 0..last (windows with no record included)."""

    n_layers: int
    n_experts: int
    records: np.ndarray
    extra: dict

    @property
    def num_windows(self) -> int:
        return int(self.records["window"][-1]) + 1 if len(self.records) else 0

    def accesses_per_expert(self) -> np.ndarray:
        """[L, E] int64: in how many windows each (layer, expert) was routed to."""
        out = np.zeros((self.n_layers, self.n_experts), dtype=np.int64)
        np.add.at(out, (self.records["layer"], self.records["expert"]), 1)
        return out

    def rows_per_expert(self) -> np.ndarray:
        """[L, E] int64: how many rows (token x top-k entries) went to each (layer, expert)."""
        out = np.zeros((self.n_layers, self.n_experts), dtype=np.int64)
        np.add.at(out, (self.records["layer"], self.records["expert"]),
                  self.records["rows"].astype(np.int64))
        return out


class TraceWriter:
    """Appends routing records to `path` while serving. `record()` takes one layer's top-k
    choice of one window; records are buffered and written whole, so the file is a valid trace
    after every flush. Use as a context manager or call close()."""

    def __init__(self, path: str | os.PathLike, n_layers: int, n_experts: int,
                 extra: dict | None = None):
        if not (0 < n_layers < 1 << 16 and 0 < n_experts < 1 << 16):
            raise ValueError(f"a trace holds 1..65535 layers and experts, not n_layers="
                             f"{n_layers}, n_experts={n_experts}")
        self.path = os.fspath(path)
        self.n_layers, self.n_experts = n_layers, n_experts
        extra_bytes = json.dumps(extra or {}, sort_keys=True).encode()
        try:
            self._file = open(self.path, "wb")
        except OSError as e:
            raise ConfigError(f"--dump-routing {self.path!r} cannot be written "
                              f"({e.strerror or e})") from None
        self._file.write(_HEADER.pack(TRACE_MAGIC, TRACE_VERSION, n_layers, n_experts,
                                      len(extra_bytes)) + extra_bytes)
        self._pending: list[np.ndarray] = []
        self._num_pending = 0

    def record(self, window: int, layer: int, expert_ids: np.ndarray) -> None:
        """Record that `layer` routed the rows of `window` to `expert_ids` [T, K]."""
        if not 0 <= layer < self.n_layers:
            raise ValueError(f"layer {layer} is outside 0..{self.n_layers - 1}")
        ids = np.asarray(expert_ids).reshape(-1)
        experts, rows = np.unique(ids, return_counts=True)
        if len(experts) and (experts[0] < 0 or experts[-1] >= self.n_experts):
            raise ValueError(f"expert ids must lie in 0..{self.n_experts - 1}; got "
                             f"{int(experts[0])}..{int(experts[-1])}")
        out = np.empty(len(experts), dtype=RECORD_DTYPE)
        out["window"], out["layer"], out["expert"], out["rows"] = window, layer, experts, rows
        self.record_many(out)

    def record_counts(self, window: int, counts: np.ndarray) -> int:
        """Record a whole window from its rows per (layer, expert) `counts` [L, E] (what the
        forward pass's `routing_counts` gathers); return the number of records."""
        if counts.shape != (self.n_layers, self.n_experts):
            raise ValueError(f"counts has shape {counts.shape}; this trace is "
                             f"{(self.n_layers, self.n_experts)}")
        layers, experts = np.nonzero(counts)  # (layer, expert) order
        out = np.empty(len(layers), dtype=RECORD_DTYPE)
        out["window"], out["layer"], out["expert"] = window, layers, experts
        out["rows"] = counts[layers, experts]
        self.record_many(out)
        return len(out)

    def record_many(self, records: np.ndarray) -> None:
        """Append ready-made RECORD_DTYPE records (e.g. a whole synthetic trace)."""
        self._pending.append(records)
        self._num_pending += len(records)
        if self._num_pending >= _FLUSH_RECORDS:
            self.flush()

    def flush(self) -> None:
        if self._pending:
            self._file.write(np.concatenate(self._pending).tobytes())
            self._pending, self._num_pending = [], 0
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self.flush()
            self._file.close()

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def read_trace(path: str | os.PathLike) -> RoutingTrace:
    """Read a trace file written by TraceWriter (records sorted by window, layer, expert)."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < _HEADER.size or data[:8] != TRACE_MAGIC:
        raise ModelFormatError(f"{path} is not a Strata routing trace (no {TRACE_MAGIC!r} "
                               "header); write one with `strata serve --dump-routing FILE` or "
                               "`strata-tool synth-trace`")
    _, version, n_layers, n_experts, extra_len = _HEADER.unpack_from(data)
    if version != TRACE_VERSION:
        raise ModelFormatError(f"{path} is a version {version} routing trace; this Strata reads "
                               f"version {TRACE_VERSION}: record it again")
    if not (0 < n_layers < 1 << 16 and 0 < n_experts < 1 << 16):
        raise ModelFormatError(f"{path}: damaged header: {n_layers} layers x {n_experts} "
                               "experts (a trace holds 1..65535 of each); record it again")
    if _HEADER.size + extra_len > len(data):
        raise ModelFormatError(f"{path}: damaged or truncated header: its JSON extra of "
                               f"{extra_len} bytes runs past the end of the file "
                               f"({len(data)} bytes); record it again")
    body = memoryview(data)[_HEADER.size + extra_len:]
    if len(body) % RECORD_DTYPE.itemsize:
        raise ModelFormatError(f"{path} ends in a partial record ({len(body)} record bytes, not "
                               f"a multiple of {RECORD_DTYPE.itemsize}): the writer was stopped "
                               "mid-write; truncate it to whole records or record it again")
    try:
        extra = json.loads(bytes(data[_HEADER.size:_HEADER.size + extra_len]) or b"{}")
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError both are
        raise ModelFormatError(f"{path}: damaged header: its {extra_len} bytes of JSON extra "
                               f"cannot be read ({exc}); record it again") from None
    if not isinstance(extra, dict):
        raise ModelFormatError(f"{path}: damaged header: its JSON extra is a "
                               f"{type(extra).__name__}, not an object; record it again")
    records = np.frombuffer(body, dtype=RECORD_DTYPE).copy()
    if len(records) and (records["layer"].max() >= n_layers
                         or records["expert"].max() >= n_experts):
        raise ModelFormatError(f"{path} has records outside its header's {n_layers} layers x "
                               f"{n_experts} experts; the file is damaged")
    records = records[np.lexsort((records["expert"], records["layer"], records["window"]))]
    return RoutingTrace(n_layers, n_experts, records, extra)


def write_trace(path: str | os.PathLike, trace: RoutingTrace) -> None:
    """Write a whole in-memory trace (e.g. a merge or a synthetic one) to `path`."""
    with TraceWriter(path, trace.n_layers, trace.n_experts, trace.extra) as writer:
        writer.record_many(trace.records)


def merge_traces(traces: list[RoutingTrace]) -> RoutingTrace:
    """One trace with the given traces played one after the other (windows renumbered)."""
    if not traces:
        raise ValueError("merge_traces() needs at least one trace")
    first = traces[0]
    parts, offset = [], 0
    for index, trace in enumerate(traces):
        if (trace.n_layers, trace.n_experts) != (first.n_layers, first.n_experts):
            raise ModelFormatError(
                f"trace {index} has {trace.n_layers} layers x {trace.n_experts} experts, trace 0 "
                f"{first.n_layers} x {first.n_experts}: only traces of one model merge")
        if offset + trace.num_windows > 1 << 32:  # window numbers are u32: they would wrap
            raise ModelFormatError(
                f"traces 0..{index} hold {offset + trace.num_windows} windows together, more "
                f"than a trace numbers ({1 << 32}); merge fewer (or check trace {index}: its "
                f"last window is {trace.num_windows - 1})")
        shifted = trace.records.copy()
        shifted["window"] += offset
        parts.append(shifted)
        offset += trace.num_windows
    merged = np.concatenate(parts) if parts else first.records[:0]
    return RoutingTrace(first.n_layers, first.n_experts, merged,
                        {"merged_from": len(traces), **first.extra})


# ---------------------------------------------------------------- skew summary

@dataclass(frozen=True)
class SkewSummary:
    """How concentrated and how repetitive a trace's routing is."""

    num_windows: int
    share_of_top: dict[float, float]  # fraction of experts (per layer) -> share of accesses
    reuse_next_window: float  # P(an expert routed in window w is routed again in w + 1)
    mean_experts_per_window: float  # distinct experts per layer per window


def skew_summary(trace: RoutingTrace, fractions=(0.1, 0.25, 0.5)) -> SkewSummary:
    """Share of window accesses taken by each layer's top `fractions` of experts (averaged over
    layers), and the next-window reuse that tells locality."""
    counts = np.sort(trace.accesses_per_expert(), axis=1)[:, ::-1]  # [L, E] descending
    totals = np.maximum(counts.sum(axis=1), 1)
    shares = {}
    for fraction in fractions:
        num_top = max(1, round(fraction * trace.n_experts))
        shares[fraction] = float(np.mean(counts[:, :num_top].sum(axis=1) / totals))
    rec = trace.records
    key = (rec["window"].astype(np.int64) * trace.n_layers + rec["layer"]) * trace.n_experts \
        + rec["expert"]
    next_key = key + trace.n_layers * trace.n_experts  # same layer and expert, next window
    is_last = rec["window"] == trace.num_windows - 1
    num_reused = int(np.isin(next_key[~is_last], key).sum())
    num_windows_with_layer = max(1, len(np.unique(rec["window"].astype(np.int64)
                                                  * trace.n_layers + rec["layer"])))
    return SkewSummary(trace.num_windows, shares, num_reused / max(1, int((~is_last).sum())),
                       len(rec) / num_windows_with_layer)


def format_skew_summary(trace: RoutingTrace) -> list[str]:
    """Lines for `strata-tool inspect --routing TRACE`."""
    summary = skew_summary(trace)
    shares = ", ".join(f"top {f:.0%} of experts take {s:.1%}"
                       for f, s in summary.share_of_top.items())
    return [f"routing trace: {trace.n_layers} layers x {trace.n_experts} experts, "
            f"{summary.num_windows} windows, {len(trace.records)} records",
            f"  skew: {shares} of window accesses (uniform routing: the fraction itself)",
            f"  locality: {summary.reuse_next_window:.1%} of routed experts are routed again "
            f"in the next window; {summary.mean_experts_per_window:.1f} distinct experts per "
            "layer per window"]
