"""Draft tokens for speculative decoding without a draft model (`--spec-type ngram-simple`).

A decoding slot's window carries its next token plus up to `--draft-max` guesses of the tokens
after it; one pass gives logits for every row, and the scheduler keeps the guesses the request's
own sampler would have drawn anyway (scheduler.py, `_after_decode`). A decode window costs about
the same for 1 row as for a few (the weights are read once per window), so every accepted
guess is a token for free, and a rejected one costs a row.

`ngram-simple`: the key is the last `--spec-ngram-size-n` tokens of the sequence (prompt and
generated); the guess is what followed the key's most recent earlier occurrence. It pays where
the model repeats text it has seen: code edits, quoting, a summary of the prompt, a reasoning
model restating its thinking.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from strata.errors import ConfigError

SPEC_TYPES = ("none", "ngram-simple")
DEFAULT_DRAFT_MAX = 16
DEFAULT_NGRAM_SIZE = 12
# A draft row's cost relative to a decode window of one row. Measured with
# tools/bench_drafts.py (one slot at context 256, synth qwen3-30b-a3b Q4_0 on an H200; each row
# routes to 8 more experts per layer; docs/drafts.md): 0.26-0.31 with every expert in VRAM,
# 0.24-0.28 with half of them cached, 0.17-0.24 with every expert in RAM (CPU pool).
DRAFT_ROW_COST = 0.25
# A drafter's acceptance estimate: decayed counts of accepted draft tokens and of misses, the
# past weighing ACCEPT_DECAY per drafted window and the accepted count kept under ACCEPT_CAP,
# so that after a copied stretch ends a few misses bring the drafts back to one token
ACCEPT_DECAY = 0.7
ACCEPT_CAP = 8.0
# multiplier of the n-gram keys' polynomial hash (odd, 64-bit wrap-around); extends of more
# tokens than _NUMPY_FROM are hashed in numpy, fewer (a decode window's) in Python
_HASH_BASE = 0x9E3779B97F4A7C15
_HASH_MASK = 2**64 - 1
_NUMPY_FROM = 64


def expected_tokens(rate: float, length: int) -> float:
    """Tokens a window with `length` drafts gives on average when each draft token is accepted
    with probability `rate` until the first miss: 1 + rate + ... + rate^length."""
    if rate >= 1.0:
        return length + 1.0
    return (1.0 - rate ** (length + 1)) / (1.0 - rate)


def best_length(rate: float, longest: int, row_cost: float = DRAFT_ROW_COST) -> int:
    """The draft length (1..longest) with the most expected tokens per unit of window time,
    a window of 1 + k rows costing 1 + row_cost * k. The speed rises to its peak and then
    falls (a concave gain over a linear cost), so the search stops at the first fall: it costs
    the best length's steps, not `longest`'s (a --draft-max of millions is checked per window)."""
    longest = max(longest, 1)
    if rate >= 1.0 and row_cost < 1.0:
        return longest
    best, best_speed = 1, 0.0
    for k in range(1, longest + 1):
        speed = expected_tokens(rate, k) / (1.0 + row_cost * k)
        if speed <= best_speed:
            break
        best, best_speed = k, speed
    return best


@dataclass(frozen=True)
class DraftSettings:
    """What `--spec-type`, `--draft-max`, `--draft-min` and `--spec-ngram-size-n` asked for."""

    spec_type: str = "none"
    draft_max: int = DEFAULT_DRAFT_MAX
    draft_min: int = 0
    ngram_size: int = DEFAULT_NGRAM_SIZE

    def __post_init__(self):
        if self.spec_type not in SPEC_TYPES:
            raise ConfigError(f"--spec-type {self.spec_type!r} is not one Strata has; give "
                              f"one of {', '.join(SPEC_TYPES)}")
        for name, minimum in (("draft_max", 1), ("draft_min", 0), ("ngram_size", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                flag = {"draft_max": "--draft-max", "draft_min": "--draft-min",
                        "ngram_size": "--spec-ngram-size-n"}[name]
                raise ConfigError(f"{flag} {value!r}: give an integer >= {minimum}")
        if self.draft_min > self.draft_max:
            raise ConfigError(f"--draft-min {self.draft_min} is more than --draft-max "
                              f"{self.draft_max}")

    @property
    def is_on(self) -> bool:
        return self.spec_type != "none"

    def drafter(self, prompt_tokens: Sequence[int]) -> "NgramDrafter | None":
        """A new request's drafter (None when drafting is off)."""
        if not self.is_on:
            return None
        return NgramDrafter(prompt_tokens, self.ngram_size, self.draft_max, self.draft_min)

    def describe(self) -> str:
        if not self.is_on:
            return "speculative decoding: off"
        return (f"speculative decoding: {self.spec_type}, key of {self.ngram_size} tokens, "
                f"drafts of {self.draft_min}..{self.draft_max} tokens")


def _ngram_hash(key: Sequence[int]) -> int:
    """The hash of one run of tokens (as `_ngram_hashes` gives it)."""
    h = 0
    for token in key:
        h = (h * _HASH_BASE + token) & _HASH_MASK
    return h


def _ngram_hashes(tokens: Sequence[int], n: int) -> list[int]:
    """The hash of each run of n tokens in `tokens` (len(tokens) - n + 1 of them): in numpy for
    many (a prompt of 100k tokens is indexed between two windows of the other slots)."""
    if len(tokens) - n < _NUMPY_FROM:
        return [_ngram_hash(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    ids = np.asarray(tokens, dtype=np.int64).astype(np.uint64)
    windows = np.lib.stride_tricks.sliding_window_view(ids, n)  # [m, n]
    out = np.zeros(windows.shape[0], dtype=np.uint64)
    base = np.uint64(_HASH_BASE)
    for j in range(n):
        out = out * base + windows[:, j]  # (arrays wrap around silently)
    return out.tolist()


class NgramDrafter:
    """One sequence's tokens and an index of its n-grams: key (n tokens, by hash) -> the end of
    its most recent occurrence before the sequence's current end. `propose` looks up the current
    key; `extend` adds tokens as they are generated."""

    def __init__(self, tokens: Sequence[int], ngram_size: int, draft_max: int,
                 draft_min: int = 0):
        self.n, self.draft_max, self.draft_min = int(ngram_size), int(draft_max), int(draft_min)
        # decayed counts of accepted draft tokens and of misses (a window's first rejected
        # draft); the prior 1 / 1 reads as an acceptance rate of 0.5
        self._accepted, self._missed = 1.0, 1.0
        self._tokens: list[int] = []
        self._ends: dict[int, int] = {}  # a key's hash -> where its last occurrence ends
        self.extend(tokens)

    @property
    def num_tokens(self) -> int:
        return len(self._tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """The sequence grew by `tokens`. The key ending at the old end gets indexed now (it is
        no longer the current one); so does every key ending inside the new tokens but the
        last."""
        old = len(self._tokens)
        self._tokens.extend(int(t) for t in tokens)
        n, seq = self.n, self._tokens
        first = max(old, n)  # the end of the first key to index
        if first < len(seq):
            hashes = _ngram_hashes(seq[first - n:len(seq) - 1], n)
            self._ends.update(zip(hashes, range(first, len(seq))))  # later ones win

    @property
    def acceptance(self) -> float:
        """The estimated chance that a draft token is accepted (given the ones before it)."""
        return self._accepted / (self._accepted + self._missed)

    @property
    def length(self) -> int:
        """The next draft's length: the best for the estimated acceptance (`best_length`), at
        least draft_min, at most draft_max."""
        return max(self.draft_min, best_length(self.acceptance, self.draft_max))

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        """How the last draft fared: `num_accepted` of its `num_drafted` tokens were accepted
        (a miss after them when fewer than all)."""
        if num_drafted <= 0:
            return
        self._accepted = min(ACCEPT_CAP, ACCEPT_DECAY * self._accepted + num_accepted)
        self._missed = ACCEPT_DECAY * self._missed + (num_accepted < num_drafted)

    def propose(self, limit: int) -> list[int]:
        """The next draft: `guess(min(limit, self.length))`, or [] when the room left (`limit`)
        is under draft_min."""
        limit = int(limit)
        if limit < max(self.draft_min, 1):
            return []
        length = max(self.draft_min, best_length(self.acceptance, min(self.draft_max, limit)))
        return self.guess(min(limit, length))

    def guess(self, limit: int) -> list[int]:
        """`limit` tokens guessed to follow the sequence, or [] when its current key never
        occurred before. The guess copies what followed the key's last occurrence; where that
        runs into the sequence's end it keeps copying from the guess itself (a loop repeats)."""
        seq = self._tokens
        if limit <= 0 or len(seq) < self.n:
            return []
        key = seq[len(seq) - self.n:]
        start = self._ends.get(_ngram_hash(key))
        if start is None or seq[start - self.n:start] != key:  # (a hash collision)
            return []
        out: list[int] = []
        for i in range(limit):
            j = start + i  # [start, len) is the sequence, beyond it the guess so far
            out.append(seq[j] if j < len(seq) else out[j - len(seq)])
        return out
