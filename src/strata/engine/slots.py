"""Slots: the table of `--parallel` sequences, the default slot picker, and the placement of a
new request (slot picker + parked conversations).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from strata.errors import ConfigError
from strata.hookspecs import SlotPicker, SlotView

MAX_SLOTS = 8


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Number of leading tokens `a` and `b` share."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    # numpy: prompts of tens of thousands of tokens compared against every slot per request.
    diff = np.asarray(a[:n], dtype=np.int64) != np.asarray(b[:n], dtype=np.int64)
    first = int(np.argmax(diff))
    return first if diff[first] else n


def max_reusable(prefix_tokens: int, num_prompt_tokens: int) -> int:
    """Cells a request can keep: the last prompt token is always read again, because its logits
    give the first new token and the KV does not keep logits."""
    return max(0, min(prefix_tokens, num_prompt_tokens - 1))


class SlotTable:
    """The engine's slots: the tokens each one's KV holds, busy or idle, and a logical clock of
    use. The KV arrays themselves live with the backend; this is the bookkeeping."""

    def __init__(self, num_slots: int):
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) \
                or not 1 <= num_slots <= MAX_SLOTS:
            raise ConfigError(f"--parallel {num_slots!r} is not a slot count Strata runs; give "
                              f"an integer from 1 to {MAX_SLOTS}")
        self.num_slots = num_slots
        self._tokens: list[list[int]] = [[] for _ in range(num_slots)]
        self._is_busy = [False] * num_slots
        self._last_used_tick = [0] * num_slots
        self._tick = 0

    def views(self, reuse_points: Sequence[tuple[int, ...] | None] | None = None
              ) -> tuple[SlotView, ...]:
        """Every slot's view; `reuse_points`: each slot's (its KV's `reuse_points()`, a
        hybrid model's), None: any length."""
        points = reuse_points if reuse_points is not None else [None] * self.num_slots
        return tuple(SlotView(i, tuple(self._tokens[i]), self._is_busy[i],
                              self._last_used_tick[i], points[i])
                     for i in range(self.num_slots))

    def view(self, index: int) -> SlotView:
        return self.views()[index]

    @property
    def num_idle(self) -> int:
        return self._is_busy.count(False)

    def has_idle(self) -> bool:
        return self.num_idle > 0

    def tokens(self, index: int) -> list[int]:
        return list(self._tokens[index])

    def acquire(self, index: int, num_reused_tokens: int) -> None:
        """Give idle slot `index` to a request that keeps its first `num_reused_tokens` tokens."""
        self._check_index(index)
        if self._is_busy[index]:
            raise ValueError(f"slot {index} is busy; acquire only an idle slot")
        if not 0 <= num_reused_tokens <= len(self._tokens[index]):
            raise ValueError(f"slot {index} holds {len(self._tokens[index])} tokens; cannot "
                             f"reuse {num_reused_tokens}")
        del self._tokens[index][num_reused_tokens:]
        self._is_busy[index] = True
        self._touch(index)

    def replace_tokens(self, index: int, tokens: Sequence[int]) -> None:
        """The slot's KV was overwritten (a parked conversation restored into it)."""
        self._check_index(index)
        self._tokens[index] = np.asarray(tokens, dtype=np.int64).tolist()  # (long: numpy)

    def extend(self, index: int, tokens: Sequence[int]) -> None:
        """The slot's KV got cells for `tokens` (a prompt chunk or a decoded token)."""
        self._check_index(index)
        self._tokens[index].extend(int(t) for t in tokens)

    def release(self, index: int) -> None:
        """The request ended; the slot keeps its tokens for the next turn."""
        self._check_index(index)
        if not self._is_busy[index]:
            raise ValueError(f"slot {index} is already idle")
        self._is_busy[index] = False
        self._touch(index)

    def clear(self, index: int) -> None:
        """Forget the slot's tokens (its KV was parked elsewhere or is no longer valid)."""
        self._check_index(index)
        self._tokens[index].clear()

    def _touch(self, index: int) -> None:
        self._tick += 1
        self._last_used_tick[index] = self._tick

    def _check_index(self, index: int) -> None:
        if not 0 <= index < self.num_slots:
            raise IndexError(f"slot {index} does not exist; slots are 0..{self.num_slots - 1}")


class LongestPrefixPicker:
    """The default: the idle slot that keeps the most of the prompt (`SlotView.num_reusable`:
    a hybrid model's slot only up to a reuse point), unless it would lose more of its tokens
    than it keeps while an idle slot is empty (another conversation that shares only a system
    prompt with the request): then the empty one, so no conversation is displaced while a
    slot is free (the engine copies the shared prefix into it where the KV can). A slot that
    keeps at least as much as it loses stays the request's (the same conversation's next turn,
    its last answer re-rendered without its reasoning: nothing to keep the tail for). Else an
    empty idle slot; else the least recently used idle slot. Ties go to the slot that loses
    the fewest tokens, then to the lowest index."""

    name = "longest-prefix"

    def pick(self, prompt_tokens: Sequence[int], slots: Sequence[SlotView]) -> tuple[int, int]:
        idle = [s for s in slots if not s.is_busy]
        if not idle:
            raise ValueError("pick() needs at least one idle slot")
        best, best_reuse, best_lost = None, 0, 0
        for s in idle:
            reuse = s.num_reusable(prompt_tokens)
            if reuse > best_reuse or (reuse == best_reuse > 0
                                      and s.num_tokens - reuse < best_lost):
                best, best_reuse, best_lost = s, reuse, s.num_tokens - reuse
        empty = next((s for s in idle if s.is_empty), None)
        if best is not None:
            num_lost = best.num_tokens - best_reuse
            if empty is None or num_lost <= best_reuse:
                return best.index, best_reuse
        if empty is not None:
            return empty.index, 0
        lru = min(idle, key=lambda s: (s.last_used_tick, s.index))
        return lru.index, 0


def check_pick(picker: SlotPicker, choice, prompt_tokens: Sequence[int],
               slots: Sequence[SlotView]) -> tuple[int, int]:
    """Validate a picker's answer so a faulty plugin fails with a message, not a corrupt KV."""
    where = f"slot picker {picker_name(picker)!r}"
    try:
        index, num_reused = choice
        if isinstance(index, bool) or isinstance(num_reused, bool):
            raise TypeError
        index, num_reused = operator.index(index), operator.index(num_reused)
    except (TypeError, ValueError):
        raise ConfigError(f"{where} returned {choice!r}; pick() must return "
                          "(slot_index, num_reused_tokens); fix or uninstall the plugin") from None
    if not 0 <= index < len(slots) or slots[index].is_busy:
        raise ConfigError(f"{where} chose slot {index}, which is not an idle slot; fix or "
                          "uninstall the plugin")
    limit = max_reusable(common_prefix_len(slots[index].tokens, prompt_tokens),
                         len(prompt_tokens))
    if not 0 <= num_reused <= limit:
        raise ConfigError(f"{where} reuses {num_reused} tokens of slot {index}, but only "
                          f"{limit} can be reused; fix or uninstall the plugin")
    return index, num_reused


def picker_name(picker: SlotPicker) -> str:
    return getattr(picker, "name", type(picker).__name__)


def ask_picker(picker: SlotPicker, prompt_tokens: Sequence[int],
               slots: Sequence[SlotView]) -> tuple[int, int]:
    """The picker's checked answer; ConfigError naming it when it raises or answers wrong."""
    try:
        choice = picker.pick(prompt_tokens, slots)
    except Exception as exc:
        raise ConfigError(f"slot picker {picker_name(picker)!r} failed: {type(exc).__name__}: "
                          f"{exc}; fix or uninstall the plugin") from exc
    return check_pick(picker, choice, prompt_tokens, slots)


@dataclass(frozen=True)
class Placement:
    """Where a new request goes and what the engine does first.

    - `is_parking_needed`: park the slot's current tokens/KV before touching it (it holds tokens
      the request does not keep);
    - `parked_key`: restore that parked conversation into the slot (it beats the slot's own
      prefix), then keep its first `num_reused_tokens` cells; None: keep the slot's own first
      `num_reused_tokens` cells;
    - `source_slot`: copy the first `num_reused_tokens` cells of that other slot's KV (busy,
      or idle and left to its own conversation) into this slot instead: it holds the longest
      prefix (several agents sharing one system prompt and tools).

    Order for the engine: `take(parked_key)` first, then park the slot's KV, then copy the taken
    KV in; parking first could evict the very entry about to be restored.
    """

    slot_index: int
    num_reused_tokens: int
    parked_key: int | None
    is_parking_needed: bool
    source_slot: int | None = None


def place_request(prompt_tokens: Sequence[int], picker: SlotPicker, slots: Sequence[SlotView],
                  conversations=None, reusable=None, copies_slots: bool = False,
                  min_copy_gain: float = 0.0) -> Placement:
    """Ask the picker for a slot, then prefer a parked conversation when it shares a longer
    prefix with the prompt than the chosen slot's own tokens do, and (`copies_slots`) another
    slot's cells (busy or idle) when they share a longer one still. `reusable(slot, n)`: how
    many of a slot's first n tokens it can keep (a hybrid model's recurrent state goes back
    only to its checkpoints); default all n. `min_copy_gain` (the KV's,
    `SequenceReuse.min_copy_gain`): a parked conversation is restored only when at least that
    share of its reused cells are more than the slot keeps, and the slot's tokens are parked
    only when at least that share of them would be lost."""
    index, num_reused = ask_picker(picker, prompt_tokens, slots)
    if reusable is not None:
        num_reused = int(reusable(index, num_reused))
    parked_key = None
    if conversations is not None:
        key, length = conversations.best_match(prompt_tokens)
        usable = max_reusable(length, len(prompt_tokens))
        if key is not None and usable > num_reused and (
                usable - num_reused >= min_copy_gain * usable):
            parked_key, num_reused = key, usable
    source = None
    if copies_slots:
        others = [(common_prefix_len(s.tokens, prompt_tokens), -s.index) for s in slots
                  if s.index != index]
        length, minus_index = max(others, default=(0, 0))
        usable = max_reusable(length, len(prompt_tokens))
        if usable > num_reused:
            source, parked_key, num_reused = -minus_index, None, usable
    # Restoring or copying overwrites the whole slot; else cells past the reused prefix go.
    num_kept = 0 if parked_key is not None or source is not None else num_reused
    num_lost = slots[index].num_tokens - num_kept
    is_parking_needed = num_lost > 0 and num_lost >= min_copy_gain * slots[index].num_tokens
    return Placement(index, num_reused, parked_key, is_parking_needed, source)
