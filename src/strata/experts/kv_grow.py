"""KV grow (`--kv-grow`): a slot's KV starts with a base of cells and borrows expert-cache slots
while its request needs more, given back (refilled) when the request ends. `LeastValuedKVGrow`
is the built-in KVGrow policy; `KVLender` is the engine side that lends, moves and returns.
"""
from __future__ import annotations

import logging
import operator
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from strata.errors import RequestError
from strata.experts.residency import ResidencyTable

log = logging.getLogger("strata.tier")

LEND_TIMEOUT_S = 60.0  # copies in flight must land, and old readers leave, within this


def _no_run(slot_index: int) -> tuple[int, ...]:
    return ()


@dataclass(frozen=True)
class LendView:
    """What a KVGrow policy may read of the cache (given by `attach(view)`, optional): the
    residency table (read only), the slots the arena keeps for itself, the tier policy's
    scores ([L, E] expected routed rows, or None), a profile rank ([L, E], 0 = hottest) and,
    during a `grow` call, `own_run(slot_index)`: the slots that slot's KV holds now and may keep
    (a run that overlaps them extends the KV in place; () when it may not)."""

    table: ResidencyTable
    reserved: frozenset
    scores: Callable[[], np.ndarray | None]
    profile_rank: np.ndarray | None = None
    own_run: Callable[[int], Sequence[int]] = _no_run

    def is_lendable(self, slot: int, slot_index: int | None = None) -> bool:
        """May `slot` be in a run lent (to slot `slot_index`'s KV, which may keep its own)?"""
        if slot_index is not None and slot in self.own_run(slot_index):
            return True
        return slot not in self.reserved and not self.table.is_claimed(slot)


class LeastValuedKVGrow:
    """Lends the run of consecutive slots whose experts the tier values least (free slots
    first), and refills returned slots with the best experts not resident.

    Value order of the experts (worst first): the tier policy's scores, then the profile rank
    (unranked last), then (layer, expert). A run's cost is the sum of its slots' ordinal costs
    (free 0, the growing KV's own slots 0, resident 1 + place in the value order); the cheapest
    run wins, ties to the lowest slot. So a KV that grows again extends its run in place where
    the slots beside it are cheap, and can grow into (nearly) the whole cache. Without
    `attach` it sees only `residency`: it lends resident slots only, valued by (layer, expert)
    alone."""

    name = "least-valued"

    def __init__(self):
        self.view: LendView | None = None
        self._residency: np.ndarray | None = None  # the last grow's, when not attached

    def attach(self, view: LendView) -> None:
        self.view = view

    def _order(self, residency: np.ndarray) -> np.ndarray:
        """Flat (layer * E + expert) indices from least to most valued."""
        L, E = residency.shape
        scores = self.view.scores() if self.view is not None else None
        scores = np.zeros(L * E) if scores is None else np.asarray(scores, float).reshape(-1)
        rank = self.view.profile_rank if self.view is not None else None
        rank = np.zeros(L * E) if rank is None else np.asarray(rank).reshape(-1)
        keys = np.arange(L * E)
        # lexsort: the last key is the primary one; worse rank (larger) first, then higher key
        return np.lexsort((-keys, -rank, scores))

    def slot_costs(self, residency: np.ndarray, slot_index: int | None = None) -> np.ndarray:
        """[N] float: each slot's lending cost to slot `slot_index`'s KV (inf: not lendable)."""
        table = self.view.table if self.view is not None else None
        n_slots = table.n_slots if table is not None else int(residency.max(initial=-1)) + 1
        costs = np.full(n_slots, np.inf)
        if table is not None:
            for slot in range(n_slots):
                if self.view.is_lendable(slot) and table.slot_owner(slot) is None:
                    costs[slot] = 0.0  # free
            if slot_index is not None:
                for slot in self.view.own_run(slot_index):
                    if 0 <= slot < n_slots:
                        costs[slot] = 0.0  # the KV's own already: nothing evicted
        flat = residency.reshape(-1)
        order = [int(i) for i in self._order(residency) if flat[i] >= 0]
        for place, key in enumerate(order):
            slot = int(flat[key])
            if table is None or self.view.is_lendable(slot):
                costs[slot] = 1.0 + place
        return costs

    def grow(self, slot_index: int, num_cells_needed: int, cells_per_expert_slot: int,
             residency: np.ndarray) -> list[int]:
        self._residency = residency
        num = -(-int(num_cells_needed) // max(int(cells_per_expert_slot), 1))
        costs = self.slot_costs(residency, slot_index)
        if num <= 0 or num > len(costs):
            return []
        finite = np.isfinite(costs)
        sums = np.convolve(np.where(finite, costs, 0.0), np.ones(num), "valid")  # [N - num + 1]
        blocked = np.convolve(~finite, np.ones(num), "valid") > 0
        if blocked.all():
            return []
        first = int(np.argmin(np.where(blocked, np.inf, sums)))
        return list(range(first, first + num))

    def give_back(self, slot_index: int, expert_slots) -> list[tuple[int, int]]:
        residency = (self.view.table.peek().table if self.view is not None
                     else self._residency)
        if residency is None:
            return []
        flat = residency.reshape(-1)
        best = [int(i) for i in self._order(residency)[::-1] if flat[i] < 0]
        E = residency.shape[1]
        return [divmod(key, E) for key in best[:len(expert_slots)]]


def profile_rank(profile, n_layers: int, n_experts: int) -> np.ndarray | None:
    """[L, E] int64: each expert's place in `profile` (a RoutingProfile; 0 = hottest; unranked:
    L * E), or None without one."""
    if profile is None:
        return None
    rank = np.full((n_layers, n_experts), n_layers * n_experts, dtype=np.int64)
    for place, (layer, expert) in enumerate(profile.top(n_layers * n_experts)):
        if layer < n_layers and expert < n_experts:
            rank[layer, expert] = place
    return rank


class KVLender:
    """The engine side of KV grow (engine thread, between windows): `grow` lends a run of
    expert-cache slots to a slot's KV and moves its cells there; `trim` moves them back into
    the KV's own base cells and returns the run, refilled with the experts the policy names.

    Lending goes through the arena's ordered path (`lend_slots`: claimed, evicted experts
    published missing before the KV writes there) after every copy in flight has landed (else
    the grow is refused); a lent slot stays claimed, so neither the tier nor the prompt
    streamer touches it. A KV that grows again may keep its run: only the new run's other
    slots are lent, and its old slots outside it are returned. Returned slots are freed and
    refilled by the tier's ordinary loads (`ExpertTier.refill`)."""

    def __init__(self, tier, policy, n_ctx: int, base_cells: int, kv_type, kv_dtype, tile: int):
        self.tier, self.arena, self.policy = tier, tier.arena, policy
        self.n_ctx, self.base_cells, self.tile = int(n_ctx), int(base_cells), int(tile)
        spec = tier.model.spec
        self._nbytes_for = lambda cells: kv_type.nbytes_for(spec, cells, kv_dtype)
        self.cell_bytes = -(-self._nbytes_for(self.tile) // self.tile)
        self.cells_per_slot = self.arena.slot_bytes // self.cell_bytes
        self.lent: dict[int, list[int]] = {}  # engine slot -> its run of expert slots
        self.timeout_s = LEND_TIMEOUT_S  # for copies in flight to land, old readers to leave
        self._own: tuple[int, tuple] = (-1, ())  # (engine slot, run it may keep) in a grow
        self.num_grows = self.num_trims = self.num_refused = self.num_refills = 0
        tier.kv_lender = self  # logs and /metrics read the counters from the tier
        attach = getattr(policy, "attach", None)
        if attach is not None:
            store = tier.store
            attach(LendView(self.arena.table, self.arena.reserved_slots(),
                            lambda: getattr(tier.policy, "scores", None),
                            profile_rank(getattr(tier, "profile", None), store.n_layers,
                                         store.n_experts), self._own_run))

    @classmethod
    def build(cls, tier, policy, model, n_ctx: int, kv_dtype) -> "KVLender | None":
        """The lender for `--kv-grow` (None without it, without a cache or a policy)."""
        config = getattr(tier, "config", None)
        if config is None or config.kv_grow is None:
            return None
        if getattr(tier, "arena", None) is None or policy is None:
            log.warning("--kv-grow is off: %s; every slot gets %d KV cells up front",
                        "no KV grow policy" if policy is None else "no expert cache (or a "
                        "layer split)", n_ctx)
            return None
        base = config.kv_base_cells(n_ctx)
        probe = model.new_kv(1, **({} if kv_dtype is None else {"dtype": kv_dtype}))
        tile = 1
        if not hasattr(probe, "base"):  # the CPU's KV stores K in tiles of KV_KEY_TILE
            from strata._native.kernels import KV_KEY_TILE as tile
        lender = cls(tier, policy, n_ctx, base, type(probe), probe.dtype, tile)
        if lender.cells_per_slot < 1:
            log.warning("--kv-grow is off: one KV cell takes %d bytes, more than an expert slot "
                        "(%d); every slot gets %d cells up front", lender.cell_bytes,
                        lender.arena.slot_bytes, n_ctx)
            tier.kv_lender = None
            return None
        if lender.max_cells <= base:
            # every grow would be refused: prompts longer than the base would fail for good
            log.warning("--kv-grow is off: the expert cache's %d lendable slots of %d cells "
                        "cannot hold more than the %d cells a slot starts with; every slot gets "
                        "%d cells up front (give a larger --expert-cache to grow)",
                        lender.num_lendable_slots, lender.cells_per_slot, base, n_ctx)
            tier.kv_lender = None
            return None
        log.info("KV grow (%s): slots start with %d cells, grow to at most %d by borrowing "
                 "expert-cache slots of %d cells each", getattr(policy, "name", "?"), base,
                 lender.max_cells, lender.cells_per_slot)
        return lender

    @property
    def num_lendable_slots(self) -> int:
        """Expert-cache slots KV grow may ever lend (those the arena keeps are not)."""
        return self.arena.n_slots - len(self.arena.reserved_slots())

    @property
    def max_cells(self) -> int:
        """The most cells one slot's KV can ever grow to: n_ctx, or what every lendable slot
        holds (in whole K tiles, as grow asks for them) when that is less."""
        lendable = self.num_lendable_slots * self.cells_per_slot // self.tile * self.tile
        return min(self.n_ctx, max(lendable, self.base_cells))

    @property
    def num_lent_slots(self) -> int:
        return sum(len(run) for run in self.lent.values())

    def is_lending(self, slot_index: int) -> bool:
        return slot_index in self.lent

    def _settle(self) -> bool:
        """Until no copy into any slot is in flight (tier rounds, streamer refills): False
        (logged) when one is still in flight after `timeout_s`."""
        waits = [("the tier's copies", self.tier.wait_idle)]
        streamer = getattr(self.arena, "streamer", None)
        if streamer is not None:
            waits.append(("the prompt streamer's refills", streamer.wait_idle))
        for what, wait_idle in waits:
            if not wait_idle(self.timeout_s):
                log.warning("KV grow: %s into the expert cache are still in flight after %.0f "
                            "s; no slot is lent or refilled meanwhile", what, self.timeout_s)
                return False
        return True

    def _moves_through_overlap(self, kv) -> bool:
        """Can `kv` move into a run that overlaps its own (its cells bit-identical)? A KV whose
        `rehome` says so (`rehome_overlap_safe`), or the CPU's KVCache, whose `rehome` without
        memory makes a fresh home (grow goes through one)."""
        from strata.engine.kv import KVCache

        return bool(getattr(kv, "rehome_overlap_safe", False)) or type(kv) is KVCache

    # ---- grow ---------------------------------------------------------------------------
    def grow(self, slot_index: int, kv, num_cells: int) -> bool:
        """Give slot `slot_index`'s KV room for `num_cells` cells in all (double its capacity,
        at most n_ctx; if the policy refuses that, just enough): False when that is beyond
        n_ctx, a copy into the cache is still in flight, or the policy refuses both. A KV that
        grows again may keep the slots it holds: only the run's other slots are lent, and
        those of its old run outside the new one are given back."""
        if kv.capacity >= num_cells:
            return True
        if num_cells > self.n_ctx:
            return False
        t0 = time.perf_counter()
        if not self._settle():
            self.num_refused += 1
            log.info("slot %d: KV grow to %d cells refused (%d cells now): copies in flight",
                     slot_index, num_cells, kv.capacity)
            return False
        old_run = self.lent.get(slot_index, [])
        own = tuple(old_run) if old_run and self._moves_through_overlap(kv) else ()
        doubled = min(self.n_ctx, max(int(num_cells), 2 * kv.capacity))
        # whole K tiles on the CPU; the doubled request first, then the bare need
        requests = dict.fromkeys(-(-cells // self.tile) * self.tile
                                 for cells in (doubled, int(num_cells)))
        run, request = None, 0
        for request in requests:
            run = self._ask(slot_index, request, own)
            if run:
                break
        if not run:
            self.num_refused += 1
            log.info("slot %d: KV grow to %d cells refused (%d cells now)", slot_index,
                     num_cells, kv.capacity)
            return False
        added = [s for s in run if s not in own]
        try:
            evicted = self.arena.lend_slots(added, self.timeout_s) if added else []
        except TimeoutError as exc:
            # a reader still pins the slots' old bytes: give them back untouched (free)
            self.arena.unlend(added)
            self.num_refused += 1
            log.warning("slot %d: KV grow to %d cells refused: %s", slot_index, num_cells, exc)
            return False
        fits = len(run) * self.arena.slot_bytes // self.cell_bytes // self.tile * self.tile
        capacity = min(self.n_ctx, max(fits, request))
        try:
            if set(run) & set(own) and not getattr(kv, "rehome_overlap_safe", False):
                kv.rehome(max(kv.num_tokens, 1))  # the runs overlap: through a fresh home
            kv.rehome(capacity, self.arena.slot_region(run[0], len(run)))
        except Exception:  # noqa: BLE001 - e.g. no device memory to stage the cells
            # the KV is whole where it was (or in its fresh home): the new slots go back
            self.arena.unlend(added)
            self.num_refused += 1
            log.exception("slot %d: KV grow to %d cells refused: its cells could not move",
                          slot_index, num_cells)
            return False
        self.lent[slot_index] = run
        self._tell_policy(-len(added))
        self.num_grows += 1
        log.info("slot %d: KV grown to %d cells in expert slots %d-%d (%d lent, %d experts "
                 "evicted) in %.1f ms", slot_index, capacity, run[0], run[-1], len(added),
                 sum(e is not None for e in evicted), (time.perf_counter() - t0) * 1e3)
        freed = [s for s in old_run if s not in run]
        if freed:
            self._give_back(slot_index, freed, f"KV moved to slots {run[0]}-{run[-1]}")
        return True

    def grow_for_prompt(self, slot_index: int, kv, num_prompt_tokens: int) -> None:
        """`grow` for a prompt about to be placed; RequestError when it is refused."""
        if not self.grow(slot_index, kv, num_prompt_tokens):
            if num_prompt_tokens > self.max_cells:
                raise RequestError(
                    f"the prompt needs {num_prompt_tokens} KV cells but a slot's KV grows to "
                    f"at most {self.max_cells} (the expert cache's {self.num_lendable_slots} "
                    f"lendable slots of {self.cells_per_slot} cells, --kv-grow); shorten the "
                    "prompt or give a larger --expert-cache")
            raise RequestError(
                f"the prompt needs {num_prompt_tokens} KV cells but slot {slot_index} has "
                f"{kv.capacity} and the expert cache lent none (--kv-grow); retry later, "
                "shorten the prompt or raise --kv-grow")

    def _ask(self, slot_index: int, request: int, own: tuple = ()) -> list[int] | None:
        """The policy's run for `request` cells, checked; None when refused or unusable. `own`:
        the slots the KV holds and may keep (the view's `own_run` meanwhile)."""
        residency = self.arena.table.peek().table
        self._own = (slot_index, own)
        try:
            answer = self.policy.grow(slot_index, request, self.cells_per_slot, residency.copy())
            return self._check_run(answer, -(-request // self.cells_per_slot), own)
        except Exception:  # noqa: BLE001 - a faulty plugin refuses, it does not fail windows
            log.exception("KV grow policy %r failed; slot %d's KV does not grow: fix the "
                          "plugin", getattr(self.policy, "name", "?"), slot_index)
            return None
        finally:
            self._own = (-1, ())

    def _own_run(self, slot_index: int) -> tuple[int, ...]:
        """LendView.own_run: the slots the growing KV may keep, during a grow."""
        return self._own[1] if slot_index == self._own[0] else ()

    def _check_run(self, answer, num_needed: int, own: tuple = ()) -> list[int] | None:
        """The policy's slots as a run of consecutive lendable slots (or the KV's `own`
        ones), else None (logged)."""
        if answer is None or len(answer) == 0:  # (a numpy array has no truth value)
            return None
        run = [operator.index(s) for s in answer]
        reserved, table = self.arena.reserved_slots(), self.arena.table
        problem = None
        if len(run) < num_needed:
            problem = f"{len(run)} slots, {num_needed} needed"
        elif run != list(range(run[0], run[0] + len(run))):
            problem = "slots that are not one run of consecutive numbers"
        elif not (0 <= run[0] and run[-1] < table.n_slots):
            problem = f"slots outside 0..{table.n_slots - 1}"
        elif any(s not in own and (s in reserved or table.is_claimed(s)) for s in run):
            problem = "a slot that is lent, reserved or being copied into"
        if problem is not None:
            log.warning("KV grow policy %r returned %s; refused: fix the plugin",
                        getattr(self.policy, "name", "?"), problem)
            return None
        return run

    # ---- trim ---------------------------------------------------------------------------
    def trim(self, slot_index: int, kv) -> int:
        """The request in slot `slot_index` ended: keep its first base cells in the KV's own
        memory and return the lent slots; returns the tokens kept."""
        run = self.lent.pop(slot_index, None)
        if run is None:
            return kv.num_tokens
        keep = kv.reusable(min(kv.num_tokens, self.base_cells))  # (a recurrent state: a
        kv.truncate(keep)  # checkpoint at most)
        try:
            kv.rehome(self.base_cells)
        except BaseException:
            self.lent[slot_index] = run  # the KV still lives in the run: it stays lent
            raise
        self.num_trims += 1
        self._give_back(slot_index, run, f"KV trimmed to {self.base_cells} cells ({keep} kept)")
        return keep

    def _tell_policy(self, num_slots: int) -> None:
        """The built-in tier policies plan fills for `num_cache_slots` minus the resident
        experts: lent slots are not there to fill."""
        policy = self.tier.policy
        if isinstance(getattr(policy, "num_cache_slots", None), int):
            policy.num_cache_slots += num_slots

    def _give_back(self, slot_index: int, run: list[int], why: str) -> None:
        # refills are checked against a table no copy is changing; while one is, the slots
        # return empty (the tier fills them later)
        pairs = []
        try:
            if self._settle():
                pairs = list(self.policy.give_back(slot_index, list(run)))
        except Exception:  # noqa: BLE001
            log.exception("KV grow policy %r failed in give_back; slots %d-%d return empty",
                          getattr(self.policy, "name", "?"), run[0], run[-1])
            pairs = []
        residency = self.arena.table.peek().table
        L, E = residency.shape
        loads, seen, bad = [], set(), []
        for slot, pair in zip(run, pairs):
            try:
                layer, expert = (operator.index(x) for x in pair)
            except (TypeError, ValueError):
                bad.append(pair)
                continue
            if 0 <= layer < L and 0 <= expert < E and residency[layer, expert] < 0 \
                    and (layer, expert) not in seen:
                seen.add((layer, expert))
                loads.append((slot, layer, expert))
        if bad:
            # a faulty plugin: those slots return empty (the slot and its run must go back)
            log.warning("KV grow policy %r returned %d refills that are not (layer, expert) "
                        "pairs of integers (the first: %r); those slots return empty: fix "
                        "the plugin", getattr(self.policy, "name", "?"), len(bad), bad[0])
        self.arena.unlend(run)
        self._tell_policy(len(run))
        self.tier.refill(loads)
        self.num_refills += len(loads)
        log.info("slot %d: %s; expert slots %d-%d returned (%d), %d refilled", slot_index,
                 why, run[0], run[-1], len(run), len(loads))
