"""What a slot's KV cells hold, as the scheduler changes it: where a prompt goes (the longest
cached prefix, a parked conversation restored), a placement undone, a parked conversation
installed, a slot's cells parked in host RAM, an idle slot's cells saved, restored or erased
by request (llama.cpp's slot files), and whether a parked conversation fits a slot's KV."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np

from strata.engine.slots import place_request
from strata.errors import RequestError

if TYPE_CHECKING:
    from strata.engine.scheduler import _Active

log = logging.getLogger("strata.engine")


class SlotCells:
    """The Scheduler's slot-cell methods (scheduler.py's `Scheduler` holds them). They use its
    `kvs` (one KVCache a slot), `table` (SlotTable: each slot's tokens, busy or idle),
    `conversations` (ConversationCache: parked conversations), `choosers` (the slot picker),
    `kv_lender` (KV grow, or None), `_active` (the requests in slots, by slot index) and
    `drain()` (the windows in flight finished)."""

    def _placement(self, prompt, reuses: bool = True):
        """Where `prompt` goes, and the parked entry it restores (taken now: parking the slot
        could evict that very entry), or None. `reuses` False: no cached prefix (the prompt's
        logprobs need every row's logits); the slot's tokens are parked as usual. With KV grow
        the slot's KV grows for the prompt before the entry is taken: a refused grow (a
        RequestError) leaves the entry parked for the next request."""
        views = self.table.views([kv.reuse_points() for kv in self.kvs])
        if not reuses:
            placement = place_request(prompt, self.choosers.slot_picker, views,
                                      reusable=lambda slot, n: 0,
                                      min_copy_gain=self.kvs[0].min_copy_gain)
            self._grow_for_prompt(placement.slot_index, len(prompt))
            return placement, None
        while True:
            placement = place_request(prompt, self.choosers.slot_picker, views,
                                      self.conversations,
                                      reusable=lambda slot, n: self.kvs[slot].reusable(n),
                                      # a slot's state exists at its own length only
                                      copies_slots=self.kvs[0].state is None,
                                      min_copy_gain=self.kvs[0].min_copy_gain)
            self._grow_for_prompt(placement.slot_index, len(prompt))
            if placement.parked_key is None:
                return placement, None
            restored = self.conversations.take(placement.parked_key,
                                               placement.num_reused_tokens)
            if restored is None:
                continue  # a file that could not be read (logged, and dropped)
            problem = self._unfit(placement.slot_index, restored)
            if problem is None:
                return placement, restored
            # a conversation file whose arrays are not this KV's (damaged or edited)
            log.warning("a parked conversation of %d tokens cannot be restored: %s; dropped, "
                        "the request is placed again without it", restored.num_tokens,
                        problem)
            self.conversations.discard(placement.parked_key)

    def _grow_for_prompt(self, index: int, num_prompt_tokens: int) -> None:
        """KV grow: room in slot `index`'s KV for the prompt (RequestError when refused)."""
        if self.kv_lender is not None:
            self.kv_lender.grow_for_prompt(index, self.kvs[index], num_prompt_tokens)

    def _unplace(self, index: int, restored, is_changed: bool) -> None:
        """Undo a placement in slot `index` that failed: the slot idle again, its cells
        forgotten when they may have changed, else `restored` (taken for it) parked again."""
        self._active.pop(index, None)
        if self.table.view(index).is_busy:
            self.table.release(index)
        if is_changed:
            self.table.clear(index)
            self.kvs[index].clear()
        elif restored is not None:
            self.conversations.park(restored.tokens, restored.kv_arrays, restored.nbytes,
                                    restored.reuse_points, landing=restored.landing)

    def _install(self, index: int, parked, num_used: int | None = None) -> int:
        """Put a parked conversation's cells (as many as the slot holds and, where it lends
        a prefix, `num_used`; down to a reuse point of a hybrid model) in slot `index`;
        return how many."""
        kv = self.kvs[index]
        k, v, state = parked.kv_arrays  # [L, KV, n, D] each; the recurrent state or None
        n = self._install_length(index, parked, num_used)
        kv.restore_cells(k, v, n)
        kv.import_state(state, n)
        if n and kv.state is not None:
            # a hybrid model's state where it was restored stays reachable: a later prompt (a
            # retry of this turn) can go back here, and the conversation's next park restores
            # there, so it replaces the file it came from
            kv.keep_checkpoint()
        self.table.replace_tokens(index, parked.tokens[:n])
        return n

    def _unfit(self, index: int, parked) -> str | None:
        """What keeps `parked` (a conversation file's or a slot file's, above all) from going
        into slot `index`: cells of another shape or type than the slot's KV, recurrent states
        unlike its own, or none where its reuse points say; None when it fits."""
        kv = self.kvs[index]
        try:
            k, v, state = parked.kv_arrays
        except (TypeError, ValueError):
            return "its KV is not (keys, values, recurrent state)"
        cells = np.dtype(getattr(kv, "host_dtype", kv.dtype))
        # [L, KV, n, D] (int8: [L, KV, n] of records of D codes and a scale), n >= its tokens
        shape = (kv.num_layers, kv.spec.n_kv_heads, parked.num_tokens)
        if not getattr(kv, "is_int8", False):
            shape += (kv.spec.head_dim,)
        for name, cell_array in (("keys", k), ("values", v)):
            if kv.num_layers and not (
                    isinstance(cell_array, np.ndarray) and cell_array.dtype == cells
                    and cell_array.ndim == len(shape) and cell_array.shape[2] >= shape[2]
                    and cell_array.shape[:2] + cell_array.shape[3:] == shape[:2] + shape[3:]):
                return (f"its {name} are {getattr(cell_array, 'shape', cell_array)!r} of "
                        f"{getattr(cell_array, 'dtype', type(cell_array).__name__)}, this "
                        f"KV's {shape!r} of {cells} (layers, KV heads, tokens, head dim)")
        points = parked.reuse_points
        if points is not None and not all(
                isinstance(p, (int, np.integer)) and not isinstance(p, bool)
                and 0 <= p <= parked.num_tokens for p in points):
            return (f"its reuse points {list(points)} are not token counts from 0 to its "
                    f"{parked.num_tokens} tokens")
        problem = _state_problem(_state_shapes(kv), state)
        if problem is not None:
            return problem
        n = self._install_length(index, parked)
        if not _state_reaches(state, n):
            return (f"its reuse points {list(parked.reuse_points or ())} do not match its "
                    f"recurrent states (none at {n} tokens)")
        return None

    def _install_length(self, index: int, parked, num_used: int | None = None) -> int:
        """How many of `parked`'s tokens slot `index` takes: as many as it holds (at most
        `num_used`), down to a reuse point of a hybrid model."""
        n = min(parked.num_tokens, parked.kv_arrays[0].shape[2], self.kvs[index].capacity)
        if num_used is not None:
            n = min(n, num_used)
        if parked.reuse_points is not None:  # the state exists at its points only
            n = max((p for p in parked.reuse_points if p <= n), default=0)
        return n

    # ---- one idle slot's cells, by request (llama.cpp's slot save / restore / erase) --------
    def _idle_slot(self, index: int) -> int:
        if isinstance(index, bool) or not isinstance(index, int) \
                or not 0 <= index < self.table.num_slots:
            raise RequestError(f"no slot {index!r}: this server has slots 0 to "
                               f"{self.table.num_slots - 1} (--parallel)")
        self.drain()
        if index in self._active:
            raise RequestError(f"slot {index} is processing a request; retry when it is idle "
                               "(GET /slots shows which are)")
        return index

    def export_slot(self, index: int):
        """(tokens, (keys, values, state), reuse points, KV bytes) of idle slot `index`."""
        index = self._idle_slot(index)
        kv, tokens = self.kvs[index], self.table.tokens(index)
        k, v = kv.export_prefix(len(tokens))
        nbytes = k.nbytes + v.nbytes
        return tokens, (k, v, kv.export_state()), kv.reuse_points(), nbytes

    def install_slot(self, index: int, parked) -> int:
        """Put `parked` (a ParkedConversation) in idle slot `index`, parking what the slot
        held first; return the tokens its next turn can reuse. With KV grow an idle slot
        keeps its base cells (a request's conversation is parked whole at its trim): a file
        longer than them goes in up to them and is parked whole, for the next turn to restore
        with the KV grown (it was cut to the base cells)."""
        index = self._idle_slot(index)
        problem = self._unfit(index, parked)  # before the slot changes
        if problem is not None:
            raise RequestError(f"the slot file cannot be restored: {problem}; the file is "
                               "damaged or not Strata's")
        if self.table.tokens(index):
            self._park(index)
        n = self._install(index, parked)
        if n < parked.num_tokens and self.kv_lender is not None and self.conversations.park(
                parked.tokens, parked.kv_arrays, parked.nbytes, parked.reuse_points) is not None:
            log.info("slot %d: %d tokens restored from a slot file, all %d parked for its "
                     "next turn (KV grow: an idle slot keeps %d cells)", index, n,
                     parked.num_tokens, self.kv_lender.base_cells)
            return parked.num_tokens
        log.info("slot %d: %d tokens restored from a slot file", index, n)
        return n

    def erase_slot(self, index: int) -> int:
        """Forget idle slot `index`'s cells; return how many tokens it held."""
        index = self._idle_slot(index)
        n = len(self.table.tokens(index))
        self.table.clear(index)
        self.kvs[index].clear()
        log.info("slot %d: %d tokens erased", index, n)
        return n

    def _checkpoint_if_due(self, active: _Active) -> None:
        """A hybrid model's slot keeps its recurrent state when all but the prompt's last
        token are in: the same prompt again, or the next turn of the conversation (whose
        template renders this reply anew), can start there."""
        kv = self.kvs[active.slot_index]
        if kv.num_tokens == len(active.handle.prompt_tokens) - 1 and kv.keep_checkpoint():
            log.info("slot %d: recurrent state checkpoint at %d tokens (kept: %s)",
                     active.slot_index, kv.num_tokens,
                     ", ".join(map(str, kv.state.positions())))

    def _park(self, index: int) -> None:
        """Copy slot `index`'s KV cells to the conversation cache. A KV larger than the whole
        budget parks its longest prefix that fits (the K/V of a prefix depend on it alone: an
        agent's next turn starts with it); a hybrid model's, whose recurrent state exists at
        its end and checkpoints only, is not parked then."""
        tokens = self.table.tokens(index)
        kv = self.kvs[index]
        budget = self.conversations.budget_bytes
        # a head's cell of one token: D values, or an int8 record of D codes and its scale
        cell_bytes = (kv.host_dtype.itemsize if getattr(kv, "is_int8", False)
                      else kv.spec.head_dim * kv.dtype.itemsize)
        token_bytes = 2 * kv.num_layers * kv.spec.n_kv_heads * cell_bytes
        nbytes = token_bytes * len(tokens)
        if kv.state is not None:
            nbytes += kv.state.nbytes_per_state(kv.spec) * (1 + len(kv.state.checkpoints))
        num_kept = len(tokens)
        if nbytes > budget:
            num_kept = 0 if kv.state is not None else min(budget // token_bytes, len(tokens))
            if num_kept == 0:
                if tokens and budget > 0:
                    log.info("slot %d: not parked: its %d tokens of KV (%.1f MiB) are over "
                             "--conversation-cache-mib %.0f", index, len(tokens),
                             nbytes / 2**20, budget / 2**20)
                return
            nbytes = token_bytes * num_kept
        # [L, KV, n, D] each (int8: [L, KV, n]); a device KV's copies may still be running
        k, v, landing = kv.park_prefix(num_kept)
        key = self.conversations.park(tokens[:num_kept], (k, v, kv.export_state()), nbytes,
                                      kv.reuse_points(), landing=landing)
        kept = (f"{num_kept} tokens" if num_kept == len(tokens) else
                f"the first {num_kept} of its {len(tokens)} tokens (all of them are over "
                f"--conversation-cache-mib {budget / 2**20:.0f})")
        log.info("slot %d: parked %s of KV in host RAM (entry %s, %d entries, %.1f MiB)",
                 index, kept, key, self.conversations.num_entries,
                 self.conversations.used_bytes / 2**20)


def _state_shapes(kv):
    """The shapes of a state `kv.export_state()` holds, without copying one: None (no
    recurrent layers), one KV's [conv shape, ssm shape] (float32 each), or a layer split's
    tuple of its stages' (each such a list, or None)."""
    if kv.state is None:
        return None
    parts = getattr(kv, "parts", None)
    if parts is not None:
        return tuple(_state_shapes(part) for part in parts)
    state = kv.state
    return [state.conv_shape(state.spec), state.ssm_shape(state.spec)]


def _state_problem(shapes, parked) -> str | None:
    """What makes a parked recurrent state (`KVCache.export_state`'s (end, (conv, ssm),
    {position: (conv, ssm)}), a split's tuple of them, or None) unlike this KV's `shapes`
    (`_state_shapes`); None when every state in it has this KV's arrays."""
    if shapes is None:
        return None if parked is None else "it holds a recurrent state, this model has none"
    if isinstance(shapes, list):  # one KV's
        try:
            end, live, checkpoints = parked
            states = [live, *checkpoints.values()]
            fits = (isinstance(end, (int, np.integer)) and end >= 0
                    # a checkpoint is the state after 1 or more tokens
                    and all(isinstance(p, (int, np.integer)) and not isinstance(p, bool)
                            and p > 0 for p in checkpoints)
                    and all(len(st) == len(shapes) and all(
                        isinstance(a, np.ndarray) and a.dtype == np.float32 and a.shape == shape
                        for a, shape in zip(st, shapes)) for st in states))
        except (TypeError, ValueError, AttributeError):
            fits = False
        return None if fits else "its recurrent states are not of this model's shape"
    if not isinstance(parked, tuple) or len(parked) != len(shapes):
        return f"its recurrent state is not one of a split of {len(shapes)} stages"
    for part_shapes, parked_part in zip(shapes, parked):
        problem = _state_problem(part_shapes, parked_part)
        if problem is not None:
            return problem
    return None


def _state_reaches(exported, num_tokens: int) -> bool:
    """Whether a parked recurrent state (`KVCache.export_state`'s (end, state, checkpoints), a
    layer split's tuple of them, or None) has its state at `num_tokens`."""
    if exported is None or num_tokens == 0:
        return True
    end = exported[0]
    if not isinstance(end, (int, np.integer)):  # a split's stages: each its own, or None
        return all(_state_reaches(part, num_tokens) for part in exported)
    return num_tokens == end or num_tokens in exported[2]
