"""Expert caches: the interface every arena offers the tier (`ExpertArena`: residency table,
ordered loads, hit/miss counts) and the CPU one (N slots of one expert in a numpy buffer).
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from strata.errors import ConfigError
from strata.experts.residency import ResidencyTable, Snapshot
from strata.experts.store import ExpertStore

SLOT_ALIGN_BYTES = 64  # slots start on cache lines
COPY_CHUNK_BYTES = 1 << 20


def num_slots_for(expert_cache: str | int, budget_bytes: int | None, slot_bytes: int,
                  num_experts_total: int) -> int:
    """Slots for `--expert-cache auto|N` under `--vram-budget` (bytes, None for no budget).

    auto: as many slots as the budget holds, at most one per (layer, expert); N: exactly N,
    which must fit the budget and not exceed the number of experts.
    """
    if budget_bytes is not None and budget_bytes < 0:
        raise ConfigError(f"--vram-budget is {budget_bytes} bytes; give a size >= 0")
    if isinstance(expert_cache, str) and expert_cache.strip().lower() == "auto":
        if budget_bytes is None:
            raise ConfigError("--expert-cache auto needs --vram-budget (the bytes the cache may "
                              "use); give a budget or a slot count, e.g. --expert-cache 64")
        return min(budget_bytes // slot_bytes, num_experts_total)
    try:
        n = int(expert_cache)
    except (TypeError, ValueError):
        raise ConfigError(f"--expert-cache is {expert_cache!r}; give 'auto' or a number of "
                          "slots >= 0") from None
    if n < 0:
        raise ConfigError(f"--expert-cache is {n}; give 'auto' or a number of slots >= 0")
    if n > num_experts_total:
        raise ConfigError(f"--expert-cache {n} exceeds the model's {num_experts_total} routed "
                          f"experts; give at most {num_experts_total} (or auto)")
    if budget_bytes is not None and n * slot_bytes > budget_bytes:
        raise ConfigError(
            f"--expert-cache {n} needs {n * slot_bytes} bytes ({slot_bytes} per slot) but "
            f"--vram-budget is {budget_bytes}; give at most {budget_bytes // slot_bytes} slots "
            "or a larger budget")
    return n


@dataclass(frozen=True)
class HitCounts:
    """Routed entries (row, k) served by the cache (hits) and by the store (misses)."""

    hits: int = 0
    misses: int = 0

    @property
    def total(self) -> int:
        return self.hits + self.misses

    @property
    def hit_rate(self) -> float:
        return self.hits / self.total if self.total else 0.0

    def __add__(self, other: "HitCounts") -> "HitCounts":
        return HitCounts(self.hits + other.hits, self.misses + other.misses)


class ExpertArena(abc.ABC):
    """What the expert tier (engine/expert_tier.py) needs of an expert cache of `n_slots` slots.

    Subclasses hold the slots' bytes (CPU: a numpy buffer; CUDA: VRAM slots with device pointer
    tables, backends/cuda/offload.py) and implement `load_steps`, the one ordered path that
    changes residency. The base keeps the residency table and the hit/miss counts.
    """

    #: True when the model reads the experts through host pointers passed per window
    #: (`pointer_table`); a device arena keeps its own tables on the device instead.
    reads_host_pointers = True

    def __init__(self, store: ExpertStore, n_slots: int, slot_bytes: int,
                 table: ResidencyTable | None = None):
        self.store = store
        self.slot_bytes = slot_bytes
        self._n_slots = n_slots
        self.table = table or ResidencyTable(store.n_layers, store.n_experts, n_slots)
        if (self.table.n_layers, self.table.n_experts, self.table.n_slots) != (
                store.n_layers, store.n_experts, n_slots):
            raise ValueError(f"{self.table} does not match {store} with {n_slots} slots")
        self._window = HitCounts()
        self.totals = HitCounts()

    @property
    def n_slots(self) -> int:
        return self._n_slots

    @abc.abstractmethod
    def load_steps(self, slot: int, layer: int, expert: int, chunk_bytes: int = COPY_CHUNK_BYTES,
                   block: bool = True, timeout_s: float | None = None) -> Iterator[str]:
        """Load (layer, expert) into `slot` one step per `next()` ("evicted", "waiting",
        "copying"...); the expert is landed (resident) when the generator ends."""

    def _until_overwritable(self, ticket, block: bool, timeout_s: float | None):
        """Until no reader of an older table version pins the ticket's slot: waits (`block`)
        or yields "waiting" per step."""
        if block:
            self.table.wait_overwritable(ticket, timeout_s)
            return
        while not self.table.is_overwritable(ticket):
            yield "waiting"

    def load(self, slot: int, layer: int, expert: int, timeout_s: float | None = None) -> int:
        """Load (layer, expert) into `slot`, evicting what it held; return the landed version."""
        for _ in self.load_steps(slot, layer, expert, chunk_bytes=max(self.slot_bytes, 1),
                                 timeout_s=timeout_s):
            pass
        return self.table.version

    def fill(self, order) -> int:
        """Load experts from `order` (an iterable of (layer, expert), best first) into the free
        slots until they run out; return how many were loaded. Start-up fill uses it with a
        routing profile's order, or layer order when there is none."""
        free = self.table.free_slots()
        loaded = 0
        for (layer, expert), slot in zip(order, free):
            self.load(slot, layer, expert)
            loaded += 1
        return loaded

    overlaps_window = False  # True: the tier may call during_window while a window runs

    def before_window(self, num_rows: int = 1, pump: bool = True) -> None:
        """Called by the tier before each window of `num_rows` rows (a device arena lands
        finished copies here, unless pump is False, and sets the window's PCIe share)."""

    def during_window(self) -> None:
        """Called by the tier while a window runs, when overlaps_window (a device arena's
        copier pump, moved there from before_window)."""

    def prepare_next_window(self) -> None:
        """Called by the tier while a window runs, after during_window and the round (host work
        the next window's before_window would otherwise do: a device arena's where table)."""

    #: True when the misses are read over PCIe by the GPU or computed by a CPU pool (the offload
    #: tiers): logs and metrics split them
    misses_on_gpu = False
    # a miss moves the expert's bytes over the link anyway (GPU reach), so a window can keep
    # it in the slot of a resident expert the policy gives up (keep_misses: free admission);
    # the CPU arena's misses copy nothing
    keeps_misses = False
    # the slots offered to the running window's kernels (keep_misses): rounds leave them be
    offered_slots: frozenset = frozenset()

    def keep_misses(self, victims) -> bool:
        """Let windows keep their misses in the slots of `victims(residency, n)` (worst
        first); False where this arena cannot."""
        return False

    def take_admitted(self) -> int:
        """After a window: publish the misses it kept; how many since the last call."""
        return 0

    def read_ahead_totals(self) -> tuple[int, int, int]:
        """(experts decode windows staged before their routing, of them routed, their routed
        entries) since start-up (backends/cuda/device_tier.py's read-ahead); none here."""
        return 0, 0, 0

    def take_pool_window(self) -> tuple[int, float, float]:
        """(routed entries, compute seconds, seconds waiting for the GPU) of the CPU pool in the
        window just run; (0, 0.0, 0.0) with no pool."""
        return 0, 0.0, 0.0

    def new_copier(self, on_landed):
        """The async copier of this arena, or None for the tier's copier thread (which runs
        `load_steps` beside the windows). `on_landed(load)` counts a landed load."""
        return None

    def close(self) -> None:
        """Free what the arena holds beyond Python memory (device slots, pinned memory)."""

    # ---- lending slots to a KV (experts/kv_grow.py) ---------------------------------------
    def reserved_slots(self) -> frozenset[int]:
        """Slots the arena may borrow for itself (a device arena's prompt staging): never lent."""
        return frozenset()

    def lend_slots(self, slots, timeout_s: float | None = None) -> list[tuple[int, int] | None]:
        """Take `slots` out of the cache through the ordered path: each is claimed and its
        expert published missing, then the call waits out readers of older versions. The
        slots stay claimed (no expert lands there) until `unlend`. Returns what each held."""
        tickets = [self.table.begin_evict(slot) for slot in slots]
        for ticket in tickets:
            self.table.wait_overwritable(ticket, timeout_s)
        return [ticket.evicted for ticket in tickets]

    def unlend(self, slots) -> None:
        """Give lent `slots` back as free slots (refills then load them the ordered way)."""
        for slot in slots:
            self.table.abort(slot)

    # ---- hit / miss accounting ----------------------------------------------------------
    def account_routed(self, snap: Snapshot, counts: np.ndarray) -> HitCounts:
        """count_routed, then fold_routed: one window's routing counted and kept."""
        result = self.count_routed(snap, counts)
        self.fold_routed(counts)
        return result

    def fold_routed(self, counts: np.ndarray) -> None:
        """Keep what later windows read of a window's routed rows `counts` [L, E] (nothing
        here; the CUDA arena's decayed counts). The tier may call it while the next window
        runs, unless reads_routing_before says that window reads them."""

    def reads_routing_before(self, num_rows: int) -> bool:
        """Does a window of `num_rows` rows read, before it starts, what fold_routed kept of
        the window before it?"""
        return False

    def count_routed(self, snap: Snapshot, counts: np.ndarray) -> HitCounts:
        """Count one window's routed entries, given as rows per (layer, expert) `counts`
        [L, E], as hits or misses against `snap`, into the current window; return them."""
        hits = int(counts[snap.table >= 0].sum())
        result = HitCounts(hits, int(counts.sum()) - hits)
        self._window = self._window + result
        self.totals = self.totals + result
        return result

    def account(self, snap: Snapshot, layer: int, experts: np.ndarray) -> HitCounts:
        """Count one layer's routed entries (`experts` [T, K] ids, -1 skipped) as hits or misses
        against `snap`, into the current window; return this call's counts."""
        ids = np.asarray(experts).reshape(-1)
        ids = ids[ids >= 0]
        slots = snap.table[layer, ids]  # [n]
        hits = int((slots >= 0).sum())
        counts = HitCounts(hits, int(ids.size) - hits)
        self._window = self._window + counts
        self.totals = self.totals + counts
        return counts

    def take_window(self) -> HitCounts:
        """The counts since the last call (one window), and start a new window."""
        counts, self._window = self._window, HitCounts()
        return counts


class CpuExpertArena(ExpertArena):
    """The expert cache of the CPU backend: `n_slots` slots of `slot_bytes` in one buffer.

    A slot holds one expert's gate, up and down bytes back to back, in the store's layout for
    its layer. Its decisions and hit rates are those a VRAM cache of the same size would have.
    """

    def __init__(self, store: ExpertStore, n_slots: int, table: ResidencyTable | None = None):
        slot_bytes = -(-store.expert_nbytes // SLOT_ALIGN_BYTES) * SLOT_ALIGN_BYTES
        super().__init__(store, n_slots, slot_bytes, table)
        self.buffer = np.zeros((n_slots, self.slot_bytes), dtype=np.uint8)  # [N, slot_bytes]

    @classmethod
    def from_budget(cls, store: ExpertStore, expert_cache: str | int = "auto",
                    budget_bytes: int | None = None) -> "CpuExpertArena":
        slot_bytes = -(-store.expert_nbytes // SLOT_ALIGN_BYTES) * SLOT_ALIGN_BYTES
        n = num_slots_for(expert_cache, budget_bytes, slot_bytes,
                          store.n_layers * store.n_experts)
        return cls(store, n)

    # ---- loading through the ordered path -----------------------------------------------
    def load_steps(self, slot: int, layer: int, expert: int, chunk_bytes: int = COPY_CHUNK_BYTES,
                   block: bool = True, timeout_s: float | None = None) -> Iterator[str]:
        """Load (layer, expert) into `slot` one step per `next()`: "evicted", then "waiting"
        while older readers still pin the slot (only when not `block`), then "copying" per
        chunk; the expert is landed when the generator ends."""
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes is {chunk_bytes}; give a positive size")
        segments = self.store.expert_segments(layer, expert)
        ticket = self.table.begin_evict(slot)
        try:
            yield "evicted"
            yield from self._until_overwritable(ticket, block, timeout_s)
            dst = self.buffer[slot]
            at = 0
            for seg in segments:
                for start in range(0, seg.size, chunk_bytes):
                    piece = seg[start:start + chunk_bytes]
                    dst[at:at + piece.size] = piece
                    at += piece.size
                    yield "copying"
            self.table.land(slot, layer, expert)
        except BaseException:  # also GeneratorExit: a load dropped half-way frees its slot
            self.table.abort(slot)
            raise

    def slot_region(self, first: int, count: int) -> np.ndarray:
        """The bytes of slots [first, first + count) as one flat uint8 view (lent to a KV)."""
        return self.buffer[first:first + count].reshape(-1)

    # ---- reading ------------------------------------------------------------------------
    def slot_views(self, slot: int, layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(gate, up, down) views of `slot` read with `layer`'s layout, each [rows, row_bytes]."""
        views, at = [], 0
        for part in self.store.layouts[layer].parts:
            views.append(self.buffer[slot, at:at + part.nbytes].reshape(part.rows,
                                                                        part.row_bytes))
            at += part.nbytes
        return tuple(views)

    def expert_views(self, snap: Snapshot, layer: int, expert: int):
        """((gate, up, down), is_hit): from the slot `snap` shows, else from the store. The
        views stay valid only while `snap` is held."""
        slot = snap.slot_of(layer, expert)
        if slot >= 0:
            return self.slot_views(slot, layer), True
        return self.store.expert(layer, expert), False

    def part_offsets(self) -> np.ndarray:
        """[L, 3] uint64: where gate, up and down start inside a slot, per layer's layout."""
        out = np.zeros((self.store.n_layers, 3), dtype=np.uint64)
        for layer, layout in enumerate(self.store.layouts):
            sizes = [part.nbytes for part in layout.parts]
            out[layer] = (0, sizes[0], sizes[0] + sizes[1])
        return out

    def pointer_table(self, snap: Snapshot, store_pointers: np.ndarray) -> np.ndarray:
        """[L, 3, E] uint64: the slot's blocks for the experts `snap` shows resident, the
        store's (`store_pointers`, same shape) for the rest. Valid only while `snap` is held."""
        pointers = store_pointers.copy()
        layers, experts = np.nonzero(snap.table >= 0)  # [n] each
        if len(layers):
            slots = snap.table[layers, experts].astype(np.uint64)  # [n]
            bases = np.uint64(self.buffer.ctypes.data) + slots * np.uint64(self.slot_bytes)
            offsets = self.part_offsets()[layers]  # [n, 3]
            pointers[layers, :, experts] = bases[:, None] + offsets
        return pointers

    def __repr__(self) -> str:
        return (f"CpuExpertArena({self.n_slots} slots x {self.slot_bytes} bytes, "
                f"{self.table.num_resident} resident)")
