"""Logit rows left on the device after a CUDA pass. The sampler asks each row for its best
candidates (`sample.cu`: penalties, the C largest values, the softmax mass) instead of copying
[N, V] floats to the host; `np.asarray(rows)` still copies them when something needs them all.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from strata.errors import RequestError

CAND_MAX = 1024  # sample.cu's CAND_MAX: candidates per row at most


class Candidates(NamedTuple):
    ids: np.ndarray      # [C] int32, best first (ties: lowest id)
    values: np.ndarray   # [C] float32 penalised logits
    mass: float          # sum over valid ids of exp((x - x_max) / temperature), when asked


class LogitReader:
    """Runs `logit_candidates` on the model's logits buffer and copies rows back. Its scratch
    row, pinned buffers and stream are made at first use. Engine thread only.

    It works on a stream of its own with asynchronous copies only: the pass that wrote the
    logits has finished when a row is read (the model waited for it), and a layer split's
    other slot groups may have passes queued on the compute streams meanwhile (pipelined
    decode), which neither a synchronous copy nor a kernel on those streams may wait for."""

    def __init__(self, runtime, logits_ptr_fn, vocab: int):
        self._rt = runtime
        self._logits_ptr = logits_ptr_fn  # () -> device address of the [N, V] logits
        self._vocab = vocab
        self._bufs = None
        self._pen_capacity = 0
        self._rows_host = None  # pinned [n, V] for rows()
        self.generation = 0  # bumped by every pass: rows of older passes are gone

    def _alloc(self):
        rt, V = self._rt, self._vocab
        self._bufs = {
            "scratch": rt.alloc(4 * V),           # [V] the penalised row
            "req": rt.alloc(4 * 5), "temp": rt.alloc(8),
            "ids": rt.alloc(4 * CAND_MAX), "x": rt.alloc(4 * CAND_MAX),
            "mass": rt.alloc(8), "nan": rt.alloc(4),
        }
        self._grow_penalties(4096)
        self._host = {
            "ids": rt.pinned((CAND_MAX,), np.int32), "x": rt.pinned((CAND_MAX,), np.float32),
            "mass": rt.pinned((1,), np.float64), "nan": rt.pinned((1,), np.int32),
            "req": rt.pinned((5,), np.int32), "temp": rt.pinned((1,), np.float64),
        }
        self._stream = rt.drv.Stream()

    def _grow_penalties(self, num_entries: int) -> None:
        # [P] ids int32, repetition factors float32, subtractions float32 (and pinned staging)
        self._pen_capacity = num_entries
        for name in ("pen_ids", "pen_rep", "pen_sub"):
            self._bufs[name] = self._rt.alloc(4 * num_entries)
        self._pen_host = self._rt.pinned((3, num_entries), np.int32)

    def candidates(self, row: int, generation: int, num: int, temperature: float, penalties,
                   num_valid: int, want_mass: bool) -> Candidates | None:
        """Row `row`'s best `num` candidates (None when the row holds a NaN)."""
        self._check(generation)
        if not 1 <= num <= CAND_MAX:
            raise ValueError(f"candidates: num must be in 1..{CAND_MAX}, got {num}")
        rt = self._rt
        with rt.active():
            if self._bufs is None:
                self._alloc()
            b, h, drv, stream = self._bufs, self._host, rt.drv, self._stream
            num_pen = 0 if penalties is None else int(penalties[0].shape[0])
            if num_pen > self._pen_capacity:
                self._grow_penalties(max(num_pen, 2 * self._pen_capacity))
            if num_pen:
                staged = self._pen_host  # [3, P] int32 bits: ids, factors, subtractions
                for i, (name, values, dtype) in enumerate(zip(
                        ("pen_ids", "pen_rep", "pen_sub"), penalties,
                        (np.int32, np.float32, np.float32))):
                    staged[i, :num_pen] = np.ascontiguousarray(values, dtype=dtype).view(
                        np.int32)
                    drv.memcpy_htod_async(b[name], staged[i, :num_pen], stream)
            h["req"][:] = (row, num, 0, num_pen, int(want_mass))
            h["temp"][0] = temperature
            drv.memcpy_htod_async(b["req"], h["req"], stream)
            drv.memcpy_htod_async(b["temp"], h["temp"], stream)
            rt.kernel("logit_candidates").prepare(
                (1,), (1024,), "PiiPPPPPPPPPP",
                [self._logits_ptr(), self._vocab, min(num_valid, self._vocab), int(b["req"]),
                 int(b["temp"]), int(b["pen_ids"]), int(b["pen_rep"]), int(b["pen_sub"]),
                 int(b["scratch"]), int(b["ids"]),
                 int(b["x"]), int(b["mass"]), int(b["nan"])]).launch(int(stream.handle))
            for name in ("ids", "x", "mass", "nan"):
                drv.memcpy_dtoh_async(h[name], b[name], stream)
            stream.synchronize()
        if h["nan"][0]:
            return None
        num = min(num, num_valid)
        return Candidates(h["ids"][:num].copy(), h["x"][:num].copy(), float(h["mass"][0]))

    def rows(self, first: int, stop: int, generation: int) -> np.ndarray:
        """The logits [stop - first, V] as float32 on the host."""
        self._check(generation)
        rt = self._rt
        with rt.active():
            if self._bufs is None:
                self._alloc()
            n = stop - first
            if self._rows_host is None or self._rows_host.shape[0] < n:
                self._rows_host = rt.pinned((max(n, 8), self._vocab), np.float32)
            out = self._rows_host[:n]
            if out.size:
                rt.drv.memcpy_dtoh_async(out, self._logits_ptr() + 4 * first * self._vocab,
                                         self._stream)
                self._stream.synchronize()
        return np.array(out)

    def _check(self, generation: int) -> None:
        if generation != self.generation:
            raise RequestError("these logits belong to an earlier pass of the CUDA model; "
                               "a later pass has overwritten them on the device")


class DeviceLogits:
    """Rows [first, stop) of a pass's logits on the device, sliced like an [N, V] array:
    `logits[a:b]` gives rows, `logits[i]` one `DeviceLogitRow`, `np.asarray` copies them."""

    def __init__(self, reader: LogitReader, first: int, stop: int, generation: int):
        self._reader, self._first, self._stop, self._gen = reader, first, stop, generation

    @property
    def shape(self) -> tuple[int, int]:
        return (self._stop - self._first, self._reader._vocab)

    def __len__(self) -> int:
        return self._stop - self._first

    def __getitem__(self, key):
        rows = range(self._first, self._stop)[key]
        if isinstance(rows, range):
            if rows.step != 1:
                raise IndexError("device logits slice with step 1 only")
            return DeviceLogits(self._reader, rows.start, max(rows.stop, rows.start),
                                self._gen)
        return DeviceLogitRow(self._reader, rows, self._gen)

    def __array__(self, dtype=None, copy=None):
        out = self._reader.rows(self._first, self._stop, self._gen)
        return out if dtype is None else out.astype(dtype)


class DeviceLogitRow:
    """One logit row [V] on the device (what the sampler receives)."""

    max_candidates = CAND_MAX

    def __init__(self, reader: LogitReader, row: int, generation: int):
        self._reader, self._row, self._gen = reader, row, generation

    @property
    def shape(self) -> tuple[int]:
        return (self._reader._vocab,)

    def candidates(self, num: int, temperature: float, penalties, num_valid: int,
                   want_mass: bool) -> Candidates | None:
        return self._reader.candidates(self._row, self._gen, num, temperature, penalties,
                                       num_valid, want_mass)

    def __array__(self, dtype=None, copy=None):
        out = self._reader.rows(self._row, self._row + 1, self._gen)[0]
        return out if dtype is None else out.astype(dtype)
