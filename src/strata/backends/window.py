"""A window: the rows of several sequences (slots) that go through one forward pass together,
grouped by slot in contiguous runs (a decode token, draft tokens or a prompt chunk each).
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from strata.engine.kv import KVCache
from strata.errors import RequestError

# Legend: R = rows of the window, S = slots (runs) in it, N = rows that need logits.

LOGITS_MODES = ("last", "all", "none")


def _check_tokens(tokens, slot: int, vocab: int) -> np.ndarray:
    """One run's token ids as int32 [n]; RequestError naming the slot when they are unusable."""
    arr = np.asarray(tokens)
    if arr.ndim != 1 or arr.size == 0 or arr.dtype.kind not in "iu":
        raise RequestError(
            f"slot {slot}: a forward pass takes a non-empty 1-D array of integer token ids, got "
            f"shape {arr.shape} of {arr.dtype}")
    if arr.min() < 0 or arr.max() >= vocab:
        bad = (arr < 0) | (arr >= vocab)
        raise RequestError(
            f"slot {slot}: token id {int(arr[bad][0])} is outside the vocabulary [0, {vocab}); "
            "the prompt was encoded with another tokenizer")
    return arr.astype(np.int32)


class Window:
    """The rows of one forward pass. Run i holds the rows of `kvs[i]`: rows
    [run_starts[i], run_starts[i+1]) at positions kvs[i].num_tokens.. as the window was built.
    Build it with `Window.build`; a window is used once (its KVs move on after the pass)."""

    __slots__ = ("kvs", "tokens", "positions", "slots", "run_starts", "start_tokens",
                 "logit_rows", "logit_starts", "runs")

    def __init__(self, kvs: tuple[KVCache, ...], tokens: np.ndarray, positions: np.ndarray,
                 slots: np.ndarray, run_starts: np.ndarray, start_tokens: np.ndarray,
                 logit_rows: np.ndarray, logit_starts: np.ndarray):
        self.kvs = kvs  # [S] one KV per run, each at most once
        self.tokens = tokens  # [R] int32
        self.positions = positions  # [R] int64, the row's position in its sequence
        self.slots = slots  # [R] int32, the run (index into kvs) of each row
        self.run_starts = run_starts  # [S+1] int64: run i is rows run_starts[i]:run_starts[i+1]
        self.start_tokens = start_tokens  # [S] kvs[i].num_tokens when the window was built
        self.logit_rows = logit_rows  # [N] int64, ascending: rows whose logits are returned
        self.logit_starts = logit_starts  # [S+1]: run i's logits are N-rows logit_starts[i]:[i+1]
        # (kv, first row, end row, first position) per run as Python ints, made once so the
        # layer loop does no per-run conversions
        self.runs = [(kv, int(r0), int(r1), int(p0)) for kv, r0, r1, p0
                     in zip(kvs, run_starts[:-1], run_starts[1:], start_tokens)]

    @classmethod
    def build(cls, runs: Sequence[tuple[KVCache, Sequence[int] | np.ndarray]],
              logits: str | Sequence[str] = "last") -> "Window":
        """A window of `runs`, each (kv, tokens): the tokens continue that KV's sequence.

        `logits` says which rows need logits: "last" (the last row of each run), "all"
        (every row: drafts, parity tests) or "none" (a prompt chunk that is not the last),
        for every run, or one mode per run. Raises RequestError, before any KV changes,
        when a KV is listed twice, a token id is unusable or a KV has no room for its rows."""
        runs = list(runs)
        if not runs:
            raise RequestError("a window needs at least one (kv, tokens) run; got none")
        modes = [logits] * len(runs) if isinstance(logits, str) else list(logits)
        if len(modes) != len(runs):
            raise RequestError(
                f"logits names {len(modes)} modes for {len(runs)} runs; give one per run or "
                "one string for all")
        for i, mode in enumerate(modes):
            if mode not in LOGITS_MODES:
                raise RequestError(
                    f"slot {i}: logits mode {mode!r} is not one of {', '.join(LOGITS_MODES)}")
        kvs = tuple(kv for kv, _ in runs)
        spec = kvs[0].spec
        seen: dict[int, int] = {}
        for i, kv in enumerate(kvs):
            if id(kv) in seen:
                raise RequestError(
                    f"slots {seen[id(kv)]} and {i} share one KV cache; a sequence may appear "
                    "once per window: join its tokens into one run")
            seen[id(kv)] = i
            if kv.spec is not spec and kv.spec != spec:
                raise RequestError(
                    f"slot {i}: its KV cache belongs to another model ({kv.spec.arch}, "
                    f"{kv.spec.n_layers} layers) than slot 0's ({spec.arch}, {spec.n_layers} "
                    "layers); make every KV with the same model's new_kv")
        token_runs = [_check_tokens(tokens, i, spec.vocab) for i, (_, tokens) in enumerate(runs)]
        for i, (kv, toks) in enumerate(zip(kvs, token_runs)):
            try:
                kv.check_room(len(toks))
            except RequestError as e:
                raise RequestError(f"slot {i}: {e}") from None

        # per-run bookkeeping in Python ints (S is small), each array made once: a decode
        # window is built for every token, and numpy calls on one-element arrays cost more
        # than the arithmetic
        lengths = [len(t) for t in token_runs]  # [S]
        starts = list(itertools.accumulate(lengths, initial=0))  # [S+1]
        firsts = [kv.num_tokens for kv in kvs]  # [S]
        picked: list[int] = []  # [N]
        logit_counts = [0]  # [S+1]
        for mode, r0, r1 in zip(modes, starts, starts[1:]):
            if mode == "all":
                picked.extend(range(r0, r1))
            elif mode == "last":
                picked.append(r1 - 1)
            logit_counts.append(len(picked))
        # position of row r: its run's first position plus its offset inside the run
        positions = np.arange(starts[-1], dtype=np.int64)  # [R]
        if len(runs) == 1:
            slots = np.zeros(starts[-1], dtype=np.int32)  # [R]
            positions += firsts[0]
        else:
            slots = np.repeat(np.arange(len(runs), dtype=np.int32), lengths)
            positions += np.repeat(np.array([p - r0 for p, r0 in zip(firsts, starts)],
                                            dtype=np.int64), lengths)
        return cls(kvs, token_runs[0] if len(runs) == 1 else np.concatenate(token_runs),
                   positions, slots, np.array(starts, dtype=np.int64),
                   np.array(firsts, dtype=np.int64), np.array(picked, dtype=np.int64),
                   np.array(logit_counts, dtype=np.int64))

    @property
    def num_rows(self) -> int:
        return int(self.run_starts[-1])

    @property
    def num_slots(self) -> int:
        return len(self.kvs)

    @property
    def num_logit_rows(self) -> int:
        return len(self.logit_rows)

    def run_lengths(self) -> np.ndarray:
        return np.diff(self.run_starts)  # [S]

    def logits_of(self, logits: np.ndarray, slot: int) -> np.ndarray:
        """Run `slot`'s rows of the [N, V] logits a forward pass of this window returned."""
        return logits[self.logit_starts[slot]:self.logit_starts[slot + 1]]

    def check_current(self) -> None:
        """RequestError unless every KV still holds the tokens it held when the window was
        built (a pass in between would put the rows at the wrong positions)."""
        for i, kv in enumerate(self.kvs):
            if kv.num_tokens != self.start_tokens[i]:
                raise RequestError(
                    f"slot {i}: the window was built when its KV held {self.start_tokens[i]} "
                    f"tokens but it now holds {kv.num_tokens}; build a new window for each "
                    "forward pass")

    def commit(self) -> None:
        """Make every run's rows part of its sequence (after all layers appended them), and
        the recurrent state the pass wrote current (a hybrid model's)."""
        for kv, r0, r1, _ in self.runs:
            kv.commit(r1 - r0)
            state = getattr(kv, "state", None)
            if state is not None:
                state.flip()

    def __repr__(self) -> str:
        runs = ", ".join(f"{int(n)}@{int(p)}" for n, p in zip(self.run_lengths(),
                                                              self.start_tokens))
        return f"Window({self.num_rows} rows, runs [{runs}], {self.num_logit_rows} logit rows)"
