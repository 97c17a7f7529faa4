"""Example Strata plugin: the slot picker becomes "always the least recently used idle slot"."""
from __future__ import annotations

from typing import Sequence

from strata.hookspecs import SlotView, hookimpl


class LeastRecentlyUsedPicker:
    """Every request goes to the idle slot used longest ago (ties: lowest index). It reuses the
    chosen slot's cached prefix when there is one, but never looks for it elsewhere."""

    name = "example-lru"

    def pick(self, prompt_tokens: Sequence[int], slots: Sequence[SlotView]) -> tuple[int, int]:
        idle = [s for s in slots if not s.is_busy]
        if not idle:
            raise ValueError("pick() needs at least one idle slot")
        slot = min(idle, key=lambda s: (s.last_used_tick, s.index))
        prefix = 0
        while (prefix < min(slot.num_tokens, len(prompt_tokens))
               and slot.tokens[prefix] == prompt_tokens[prefix]):
            prefix += 1
        # The last prompt token is always read again: its logits give the first new token.
        return slot.index, max(0, min(prefix, len(prompt_tokens) - 1))


@hookimpl
def strata_slot_picker(num_slots):
    """Example plugin: always the least recently used idle slot."""
    return LeastRecentlyUsedPicker()
