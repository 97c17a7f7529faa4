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
        # The common prefix, less the prompt's last token (read again for the first logits),
        # cut back to a point a hybrid model's slot can keep.
        return slot.index, slot.num_reusable(prompt_tokens)


@hookimpl
def strata_slot_picker(num_slots):
    """Example plugin: always the least recently used idle slot."""
    return LeastRecentlyUsedPicker()
