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

    # One upload and one read-back per request (each small copy costs a round trip on the
    # stream): the request [5] int32 and its temperature (float64 at byte 24) in one block;
    # the results as [mass float64, nan int32, pad, ids [C] int32, values [C] float32].
    _REQ_BYTES, _TEMP_AT = 32, 24
    _OUT_HEAD = 16  # mass, nan, pad

    def _alloc(self):
        rt, V = self._rt, self._vocab
        self._bufs = {
            "scratch": rt.alloc(4 * V),           # [V] the penalised row
            "req": rt.alloc(self._REQ_BYTES),
            "out": rt.alloc(self._OUT_HEAD + 8 * CAND_MAX),
        }
        self._grow_penalties(4096)
        self._host = {
            "req": rt.pinned((self._REQ_BYTES // 4,), np.int32),
            "out": rt.pinned(((self._OUT_HEAD + 8 * CAND_MAX) // 4,), np.int32),
        }
        self._stream = rt.drv.Stream()

    def _grow_penalties(self, num_entries: int) -> None:
        # a request's n entries as [ids [n] int32, repetition factors [n] float32, subtractions
        # [n] float32], one upload
        self._pen_capacity = num_entries
        self._bufs["pen"] = self._rt.alloc(3 * 4 * num_entries)
        self._pen_host = self._rt.pinned((3 * num_entries,), np.int32)

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
            drv, stream = rt.drv, self._stream
            num_pen = 0 if penalties is None else int(penalties[0].shape[0])
            if num_pen > self._pen_capacity:
                self._grow_penalties(max(num_pen, 2 * self._pen_capacity))
            b, h = self._bufs, self._host
            if num_pen:
                staged = self._pen_host[:3 * num_pen]  # int32 bits: ids, factors, subtractions
                for i, (values, dtype) in enumerate(zip(penalties,
                                                        (np.int32, np.float32, np.float32))):
                    staged[i * num_pen:(i + 1) * num_pen] = np.ascontiguousarray(
                        values, dtype=dtype).view(np.int32)
                drv.memcpy_htod_async(b["pen"], staged, stream)
            req = h["req"]
            req[:5] = (row, num, 0, num_pen, int(want_mass))
            req.view(np.float64)[self._TEMP_AT // 8] = temperature
            drv.memcpy_htod_async(b["req"], req, stream)
            pen, out = int(b["pen"]), int(b["out"])
            ids_at = out + self._OUT_HEAD
            rt.kernel("logit_candidates").prepare(
                (1,), (1024,), "PiiPPPPPPPPPP",
                [self._logits_ptr(), self._vocab, min(num_valid, self._vocab), int(b["req"]),
                 int(b["req"]) + self._TEMP_AT, pen, pen + 4 * num_pen, pen + 8 * num_pen,
                 int(b["scratch"]), ids_at, ids_at + 4 * num, out, out + 8]).launch(
                     int(stream.handle))
            got = h["out"][:(self._OUT_HEAD + 8 * num) // 4]
            drv.memcpy_dtoh_async(got, out, stream)
            stream.synchronize()
        if got[2]:  # nan
            return None
        head = self._OUT_HEAD // 4
        ids = got[head:head + num]
        values = got[head + num:head + 2 * num].view(np.float32)
        num = min(num, num_valid)
        return Candidates(ids[:num].copy(), values[:num].copy(), float(got[:2].view(np.float64)[0]))

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

    def value(self, row: int, token: int, generation: int) -> float:
        """One logit: row `row`'s value at `token` (4 bytes back, one round trip)."""
        self._check(generation)
        rt = self._rt
        with rt.active():
            if self._bufs is None:
                self._alloc()
            got = self._host["out"][:1]
            rt.drv.memcpy_dtoh_async(got, self._logits_ptr() + 4 * (row * self._vocab + token),
                                     self._stream)
            self._stream.synchronize()
        return float(got.view(np.float32)[0])

    def _check(self, generation: int) -> None:
        if generation != self.generation:
            raise RequestError("these logits belong to an earlier pass of the CUDA model; "
                               "a later pass has overwritten them on the device")


class DeviceLogits:
    """Rows [first, stop) of a pass's logits on the device, sliced like an [N, V] array:
    `logits[a:b]` gives rows, `logits[i]` one `DeviceLogitRow`, `np.asarray` copies them."""

    def __init__(self, reader: LogitReader, first: int, stop: int, generation: int,
                 greedy_ids: np.ndarray | None = None):
        self._reader, self._first, self._stop, self._gen = reader, first, stop, generation
        # [stop - first] int32: each row's argmax from the pass (-1: a NaN), or None
        self._greedy = greedy_ids

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
            greedy = None if self._greedy is None else self._greedy[
                rows.start - self._first:max(rows.stop, rows.start) - self._first]
            return DeviceLogits(self._reader, rows.start, max(rows.stop, rows.start),
                                self._gen, greedy)
        greedy = None if self._greedy is None else int(self._greedy[rows - self._first])
        return DeviceLogitRow(self._reader, rows, self._gen, greedy)

    def __array__(self, dtype=None, copy=None):
        out = self._reader.rows(self._first, self._stop, self._gen)
        return out if dtype is None else out.astype(dtype)


class DeviceLogitRow:
    """One logit row [V] on the device (what the sampler receives)."""

    max_candidates = CAND_MAX

    def __init__(self, reader: LogitReader, row: int, generation: int,
                 greedy_id: int | None = None):
        self._reader, self._row, self._gen = reader, row, generation
        # the row's argmax over every id, computed by the pass (-1: the row holds a NaN), or
        # None: ask candidates(1)
        self.greedy_id = greedy_id

    @property
    def shape(self) -> tuple[int]:
        return (self._reader._vocab,)

    def candidates(self, num: int, temperature: float, penalties, num_valid: int,
                   want_mass: bool) -> Candidates | None:
        return self._reader.candidates(self._row, self._gen, num, temperature, penalties,
                                       num_valid, want_mass)

    def value(self, token: int) -> float:
        """The logit of `token` alone."""
        return self._reader.value(self._row, token, self._gen)

    def __array__(self, dtype=None, copy=None):
        out = self._reader.rows(self._row, self._row + 1, self._gen)[0]
        return out if dtype is None else out.astype(dtype)
