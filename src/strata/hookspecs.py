"""The plugin contract: pluggy hook specifications (prefix `strata_`) and the interfaces the
chooser hooks' policy objects implement. docs/plugins.md has one entry per hook.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, Sequence, runtime_checkable

import pluggy

if TYPE_CHECKING:
    import numpy as np

    from strata.engine.interleave import PendingRead, ReadPlan, WindowTiming

PROJECT_NAME = "strata"
hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


# ---- what the policy objects see and return -----------------------------------------------
@dataclass(frozen=True)
class SlotView:
    """A read-only view of one slot as the slot picker sees it."""

    index: int
    tokens: tuple[int, ...]  # the tokens whose K/V cells the slot holds, in order
    is_busy: bool  # a request is reading or decoding in it
    last_used_tick: int  # logical clock of its last acquire/release; 0 = never used
    # the lengths its KV can be cut back to besides 0 (a hybrid model's recurrent state exists
    # only at its checkpoints and its end); None: any length
    reuse_points: tuple[int, ...] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def num_reusable(self, prompt_tokens: Sequence[int]) -> int:
        """The most of this slot's leading cells a request with `prompt_tokens` can keep: the
        common prefix, but not the prompt's last token (it is read for the first logits), cut
        back to a reuse point where the slot has them."""
        from strata.engine.slots import common_prefix_len, max_reusable

        limit = max_reusable(common_prefix_len(self.tokens, prompt_tokens), len(prompt_tokens))
        if self.reuse_points is None:
            return limit
        return max((p for p in self.reuse_points if p <= limit), default=0)

    @property
    def is_empty(self) -> bool:
        return not self.tokens


class ExpertSwap(NamedTuple):
    """Load routed expert (load_layer, load_expert) into the VRAM slot that (evict_layer,
    evict_expert) holds now."""

    load_layer: int
    load_expert: int
    evict_layer: int
    evict_expert: int


@dataclass(frozen=True)
class WindowStats:
    """What one window (one forward pass over R rows) did. The expert-cache fields stay 0
    without `--expert-cache`: routed entries (row, top-k pick) served by the cache
    (`num_cache_hits`) and from the expert store (`num_cache_misses`), the swaps the tier round
    closed by this window started (`num_swaps`), and the seconds the window spent waiting for
    the tier outside its forward pass (`tier_wait_s`: a blocking round's copies; ~0 async).
    `seconds` includes that wait."""

    window_index: int
    num_decode_rows: int
    num_prompt_rows: int
    seconds: float
    num_cache_hits: int = 0
    num_cache_misses: int = 0
    num_swaps: int = 0
    tier_wait_s: float = 0.0


# ---- the interfaces ------------------------------------------------------------------------
@runtime_checkable
class SlotPicker(Protocol):
    """Decides which slot a new request goes to."""

    name: str

    def pick(self, prompt_tokens: Sequence[int], slots: Sequence[SlotView]) -> tuple[int, int]:
        """Return (slot_index, num_reused_tokens): the idle slot to use and how many of its
        leading cells the request keeps (at most the common prefix of the slot's tokens and the
        prompt, and at most len(prompt_tokens) - 1, since the last prompt token is always read to
        get the first logits). Called only when at least one slot is idle; the engine checks
        the answer and rejects a busy slot or an over-long reuse."""


@runtime_checkable
class ReadInterleave(Protocol):
    """Decides how prompt reading interleaves with the other slots' decoding."""

    name: str

    def plan(self, reads: Sequence[PendingRead], num_decoding_slots: int,
             timing: WindowTiming | None) -> ReadPlan | None:
        """Given the prompts placed in slots and not yet fully read (in arrival order), the
        number of slots decoding now and the measured window timings (None before the first
        measurement), return which read gets the next chunk, its size in tokens and how many
        decode windows run after it before the next chunk; None when `reads` is empty. The
        engine checks the plan (`strata.engine.interleave.check_read_plan`: a chunk of 1 to the
        read's tokens left) and uses the built-in's plan, with a warning, in place of a wrong
        one or an exception."""


@runtime_checkable
class TierPolicy(Protocol):
    """Moves routed experts into and out of the VRAM expert cache as the routing changes.

    Three OPTIONAL methods (not part of the protocol check; a policy without them keeps working):
    - `observe(counts) -> None`: called by the engine after every window (before that window's
      `plan_swaps` when a round is due; not while the tier is frozen) with `counts` [L, E]
      int64, the rows each expert took in that window. Read only and reused by the caller:
      copy what you keep. Lets a policy keep per-window recency that round sums hide.
    - `admit(counts, residency) -> list[ExpertSwap]`: free admission, for a backend whose
      misses move an expert's bytes over the link anyway (GPU reach over PCIe): after a window
      (after `observe`), which experts it missed to keep, each load an expert that window
      routed to and missed, each eviction FREE_SLOT (-1) or an expert it did not route to.
      `strata.experts.replay.replay_tier(free_admission=True)` calls it. Must not modify its
      arguments.
    - `victims(residency, n) -> list[tuple[int, int]]`: free admission in the engine: up to
      `n` resident (layer, expert)s whose slots the next window may take for experts it misses
      and reads over PCIe, worst first (after `observe` of the window before). The engine's
      asynchronous tier over an arena whose misses cross the link (the CUDA offload,
      `ExpertArena.keeps_misses`) asks before every decode window; the window's kernels keep up
      to 2 misses per layer, in the order offered, and skip a victim that layer routes to
      (docs/offload.md). The CPU arena's misses copy nothing, so not there. Must not modify
      its argument.
    """

    name: str

    def plan_swaps(self, counts: np.ndarray, residency: np.ndarray,
                   min_gain: float) -> list[ExpertSwap]:
        """Called every `--adapt-every` windows with `counts` [L, E] (routing counts since the
        last call) and `residency` [L, E] (the VRAM slot of each expert, -1 when not resident).
        Return the swaps whose expected gain clears `min_gain` (`--adapt-min-gain`; its unit is
        the policy's), best first; [] for none. An eviction of (FREE_SLOT, FREE_SLOT)
        (`strata.experts.tier.FREE_SLOT`, -1) takes a free slot. Must not modify its
        arguments."""


@runtime_checkable
class KVGrow(Protocol):
    """Lends expert-cache slots to the KV of a request that needs more cells (`--kv-grow`).

    One OPTIONAL method: `attach(view)`, called once when the engine starts (before any
    `grow`), with a `strata.experts.kv_grow.LendView` (`table`, the residency table, whose
    `n_slots` is the cache's slot count; `reserved`, the slots the arena keeps for itself;
    `scores()`, the tier policy's; `profile_rank`; `own_run`; `is_lendable`) for policies that
    want more than `residency`."""

    name: str

    def grow(self, slot_index: int, num_cells_needed: int, cells_per_expert_slot: int,
             residency: np.ndarray) -> list[int]:
        """The KV of slot `slot_index` needs room for `num_cells_needed` cells in all: it moves
        whole into the lent slots. The engine asks first for max(the need, twice the KV's
        capacity), then, if refused, for the need alone (each in whole KV tiles, at most the
        context). Return at least ceil(num_cells_needed /
        cells_per_expert_slot) expert-cache slots forming one run of consecutive slot numbers
        (ascending), none lent or being copied into, except the KV's own slots that the view's
        `own_run(slot_index)` offers (a run overlapping them extends the KV in place); the
        engine evicts the new slots through the ordered path and gives back the old ones
        outside the run. [] refuses (a decoding request ends with finish reason "length", a
        prompt that does not fit fails). `residency` [L, E] is read-only."""

    def give_back(self, slot_index: int, expert_slots: Sequence[int]) -> list[tuple[int, int]]:
        """Slot `slot_index`'s KV no longer uses `expert_slots` (its request ended, or it moved
        to another run); they return to the cache. Return the (layer, expert) to refill each
        one with, in the same order (experts not resident; a slot without one stays free)."""


# ---- chooser hooks: firstresult, called once when the engine is built ------------------------
@hookspec(firstresult=True)
def strata_slot_picker(config: Any, spec: Any, num_slots: int) -> SlotPicker | None:
    """Return the SlotPicker the engine uses for every new request.

    Called once when the engine is built, with the EngineConfig, the ModelSpec and the number of
    slots (`--parallel`). The first non-None result wins; the built-in default (longest cached
    prefix, else an empty slot, else the least recently used) is registered trylast.
    """


@hookspec(firstresult=True)
def strata_read_interleave(config: Any, spec: Any, num_slots: int) -> ReadInterleave | None:
    """Return the ReadInterleave policy that decides chunk sizes and the decode share.

    Called once when the engine is built. The first non-None result wins; the built-in default
    keeps every decoding slot at >= half its solo decode rate while a prompt is read and lets a
    prompt shorter than one chunk go first.
    """


@hookspec(firstresult=True)
def strata_tier_policy(config: Any, spec: Any, num_slots: int) -> TierPolicy | None:
    """Return the TierPolicy that moves experts into and out of the VRAM expert cache.

    Called once when the engine is built with an expert cache (`--expert-cache`); `num_slots`
    is `--parallel` as for every chooser: the cache's slot count is `config.expert_cache_slots`
    (`auto` resolved before this call). The first non-None result wins; the built-in default
    (`decayed-count`, strata.experts.tier) answers last. `--adapt-every 0` freezes the
    cache and the policy is never asked for swaps.
    """


@hookspec(firstresult=True)
def strata_kv_grow(config: Any, spec: Any, num_slots: int) -> KVGrow | None:
    """Return the KVGrow policy that lends expert-cache slots to a KV that runs out of cells.

    Called once when the engine is built; used with `--kv-grow` (and an expert cache). The first
    non-None result wins; the built-in default (`least-valued`, strata.experts.kv_grow) answers
    last.
    """


# ---- observer hooks: every implementation is called, results are ignored ---------------------
@hookspec
def strata_window_done(stats: WindowStats) -> None:
    """Called after every window with its WindowStats (read-only). Keep it cheap: it runs on the
    engine thread between windows. Every implementation is called; return values are ignored."""


@hookspec
def strata_request_done(stats: Any) -> None:
    """Called once when a request ends (finished, stopped or failed) with its GenerationStats
    (read-only): prompt and cached token counts, generated tokens, timings. Every implementation
    is called; return values are ignored."""


CHOOSER_HOOKS = ("strata_slot_picker", "strata_read_interleave", "strata_tier_policy",
                 "strata_kv_grow")
OBSERVER_HOOKS = ("strata_window_done", "strata_request_done")
# The interface each chooser's result must implement.
CHOOSER_INTERFACES = {
    "strata_slot_picker": SlotPicker,
    "strata_read_interleave": ReadInterleave,
    "strata_tier_policy": TierPolicy,
    "strata_kv_grow": KVGrow,
}
