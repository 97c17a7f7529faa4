"""The default read-interleave policy: which prompt read gets the next chunk, how large, and how
many decode windows run before the next one, so that decoding slots keep their share of speed.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Sequence

from strata.errors import ConfigError


@dataclass(frozen=True)
class PendingRead:
    """A prompt placed in a slot and not yet fully read."""

    slot_index: int
    num_tokens_left: int
    num_tokens_read: int = 0  # > 0 once its first chunk was read


@dataclass(frozen=True)
class WindowTiming:
    """Measured by the engine: a decode window with the slots decoding now, and prompt reading
    per token (from the last chunk window)."""

    decode_window_seconds: float
    prompt_seconds_per_token: float


@dataclass(frozen=True)
class ReadPlan:
    """Read `chunk_tokens` of the prompt in `slot_index`, then run `num_decode_windows_after`
    decode windows before the next chunk. `decode_share` is the expected fraction of their solo
    decode rate the decoding slots keep (None when it cannot be estimated yet)."""

    slot_index: int
    chunk_tokens: int
    num_decode_windows_after: int
    decode_share: float | None


class HalfRateInterleave:
    """The default policy.

    Order: a read that fits in one chunk (a short prompt, or the last chunk of a long one) goes
    before reads that do not, earliest arrival first; otherwise the earliest read continues. A
    short prompt arriving during a long read is thus answered after at most one chunk.

    Size: `read_chunk_tokens` while other slots decode, `solo_chunk_tokens` (default the
    same) while none does.

    Share: with chunk time c = chunk_tokens x seconds per token and decode window time d, a cycle
    of one chunk and k decode windows gives each decoding slot k tokens in k*d + c seconds
    instead of k tokens in k*d. Keeping a share s of the solo rate needs k*d*(1 - s) >= s*c; the
    policy takes the smallest such k (k = ceil(c/d) for s = 1/2). It counts no decode token
    during the chunk window itself, so the real share is at least the estimate. Before the
    first measurement it alternates (k = 1); with nobody decoding it reads back to back (k = 0).
    """

    name = "half-rate"

    def __init__(self, read_chunk_tokens: int = 512, min_decode_share: float = 0.5,
                 solo_chunk_tokens: int | None = None):
        for name, value in (("--read-chunk", read_chunk_tokens),
                            ("solo_chunk_tokens", solo_chunk_tokens)):
            if value is None and name != "--read-chunk":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} {value!r} must be an integer >= 1")
        if not 0.0 <= min_decode_share < 1.0:
            raise ConfigError(f"min_decode_share = {min_decode_share!r} must be in [0, 1): a "
                              "share of 1 would never let a prompt be read")
        self.read_chunk_tokens = read_chunk_tokens
        # chunks while no slot decodes (--read-chunk auto: larger where prompt windows stream
        # their experts from RAM, config.SOLO_STREAMED_CHUNK_TOKENS)
        self.solo_chunk_tokens = solo_chunk_tokens or read_chunk_tokens
        self.min_decode_share = float(min_decode_share)

    def plan(self, reads: Sequence[PendingRead], num_decoding_slots: int,
             timing: WindowTiming | None) -> ReadPlan | None:
        if not reads:
            return None
        read = self.next_read(reads)
        if num_decoding_slots <= 0:
            return ReadPlan(read.slot_index, min(self.solo_chunk_tokens, read.num_tokens_left),
                            0, None)
        chunk_tokens = min(self.read_chunk_tokens, read.num_tokens_left)
        if timing is None:
            return ReadPlan(read.slot_index, chunk_tokens, 1, None)
        chunk_seconds = chunk_tokens * _check_seconds(timing.prompt_seconds_per_token,
                                                      "prompt_seconds_per_token", allow_zero=True)
        window_seconds = _check_seconds(timing.decode_window_seconds, "decode_window_seconds",
                                        allow_zero=False)
        num_windows = self.num_decode_windows(chunk_seconds, window_seconds)
        decode_time = num_windows * window_seconds
        share = 1.0 if chunk_seconds == 0 else decode_time / (decode_time + chunk_seconds)
        return ReadPlan(read.slot_index, chunk_tokens, num_windows, share)

    def next_read(self, reads: Sequence[PendingRead]) -> PendingRead:
        for read in reads:
            if read.num_tokens_left <= self.read_chunk_tokens:
                return read
        return reads[0]

    def num_decode_windows(self, chunk_seconds: float, window_seconds: float) -> int:
        """Smallest k >= 0 with k * window * (1 - s) >= s * chunk: 0 when s or the chunk is 0,
        else at least 1 (s * chunk > 0, even where the float product underflows to 0)."""
        s = self.min_decode_share
        if s == 0 or chunk_seconds <= 0:
            return 0
        need = s * chunk_seconds
        k = max(1, math.ceil(need / ((1.0 - s) * window_seconds)))
        # Float rounding can put ceil() one off either way; settle on the exact inequality.
        while k * window_seconds * (1.0 - s) < need:
            k += 1
        while k > 1 and (k - 1) * window_seconds * (1.0 - s) >= need:
            k -= 1
        return k


class BadReadPlan(ValueError):
    """A ReadInterleave's answer the engine cannot follow."""


def check_read_plan(plan, reads: Sequence[PendingRead]) -> ReadPlan:
    """A ReadInterleave's answer to `reads` (not empty) as a ReadPlan of plain ints: a chunk of
    1 to the tokens left of one of the reads, then >= 0 decode windows. BadReadPlan says what
    is wrong (a chunk of 0 tokens would never finish the read)."""
    fields = ("slot_index", "chunk_tokens", "num_decode_windows_after")
    if not all(hasattr(plan, name) for name in fields):
        raise BadReadPlan(f"returned {plan!r}, not a ReadPlan, for {len(reads)} prompts to read")
    values = []
    for name in fields:
        value = getattr(plan, name)
        try:
            if isinstance(value, bool):
                raise TypeError
            values.append(operator.index(value))
        except TypeError:
            raise BadReadPlan(f"returned {plan!r}: {name} {value!r} is not an integer") from None
    slot_index, chunk_tokens, num_windows = values
    read = next((r for r in reads if r.slot_index == slot_index), None)
    if read is None:
        raise BadReadPlan(f"returned {plan!r}: slot {slot_index} has no prompt to read (the "
                          f"reads are in slots {[r.slot_index for r in reads]})")
    if not 1 <= chunk_tokens <= read.num_tokens_left:
        raise BadReadPlan(f"returned {plan!r}: a chunk of {chunk_tokens} tokens of a read "
                          f"with {read.num_tokens_left} left (1 to {read.num_tokens_left})")
    if num_windows < 0:
        raise BadReadPlan(f"returned {plan!r}: {num_windows} decode windows after the chunk "
                          "(0 or more)")
    return ReadPlan(slot_index, chunk_tokens, num_windows, getattr(plan, "decode_share", None))


def _check_seconds(value: float, name: str, allow_zero: bool) -> float:
    value = float(value)
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name} = {value!r} must be a finite time "
                         f"{'>= 0' if allow_zero else '> 0'} in seconds")
    return value
