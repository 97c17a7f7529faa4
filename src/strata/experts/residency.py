"""The residency table (layer x expert -> cache slot or -1) and its ONE ordered change path:
evict (publish missing, wait out older readers) -> overwrite the slot -> land (publish resident).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

MISSING = -1  # table entry of an expert that is in no slot
FREE = -1  # slot owner: holds no expert
CLAIMED = -2  # slot owner: evicted, its bytes may be being overwritten; resident nowhere


@dataclass(frozen=True)
class EvictTicket:
    """Returned by `begin_evict`: the slot, the version that published it missing, and the
    (layer, expert) it held (None if it was free)."""

    slot: int
    version: int
    evicted: tuple[int, int] | None


class Snapshot:
    """One published version of the table; its `table` ([L, E] int32, read-only) never changes.

    A snapshot from `ResidencyTable.snapshot()` is pinned: while it is held, no slot that it
    shows as resident is overwritten. Release it (`release()` or a `with` block) as soon as the
    window that reads it is done; a held pin stalls every eviction published after it.
    """

    __slots__ = ("version", "table", "_owner", "_released")

    def __init__(self, version: int, table: np.ndarray, owner: "ResidencyTable | None"):
        self.version = version
        self.table = table
        self._owner = owner
        self._released = owner is None

    def slot_of(self, layer: int, expert: int) -> int:
        """The slot holding (layer, expert) in this version, or -1."""
        return int(self.table[layer, expert])

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._owner._unpin(self.version)

    @property
    def is_released(self) -> bool:
        return self._released

    def __enter__(self) -> "Snapshot":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"Snapshot(version={self.version}, resident={int((self.table >= 0).sum())})"


def _repeats(values: np.ndarray) -> bool:
    """True when a value occurs twice. A sort, not np.unique: np.unique's first call in a
    process takes ~15 ms here (lazy imports), and with it the H200's first async tier window
    waited 50 ms once (not re-measured since; the engine thread pays such costs in a window)."""
    ordered = np.sort(values)
    return bool((ordered[1:] == ordered[:-1]).any())


class ResidencyTable:
    """Host residency table of an expert cache with `n_slots` slots.

    Every change goes through one ordered path, and only through it:
      1. `begin_evict(slot)` claims the slot: its expert (if any) is marked missing and a new
         version is published before the call returns, so every later reader misses it;
      2. the slot's bytes may be overwritten only once `is_overwritable(ticket)` holds: no reader
         still pins a version older than the ticket's (those versions may show the old expert
         in the slot);
      3. `land(slot, layer, expert)` publishes the expert as resident in the slot, called only
         after its bytes have fully landed there.
    Readers take `snapshot()`: the latest published version (never older than the last
    completed change), copy-on-write, so it cannot change under them.

    A CUDA backend mirrors this on the device with the same three steps: publishing a version
    is an upload of the table to the device copy on the compute stream (so every kernel issued
    later reads it), followed by an event E_pub recorded there; step 2 is the copy stream
    waiting on E_pub (the kernels that could read the older table come before it on the compute
    stream; host pins become stream order); step 3 records E_landed on the copy stream after
    the copy, and the compute stream waits on E_landed before the upload that makes the expert
    resident. The host version numbers stay the single order both sides follow.
    """

    def __init__(self, n_layers: int, n_experts: int, n_slots: int):
        if n_layers <= 0 or n_experts <= 0 or n_slots < 0:
            raise ValueError(f"a residency table needs n_layers > 0, n_experts > 0 and "
                             f"n_slots >= 0; got {n_layers}, {n_experts}, {n_slots}")
        self.n_layers, self.n_experts, self.n_slots = n_layers, n_experts, n_slots
        self._lock = threading.Lock()
        self._drained = threading.Condition(self._lock)
        table = np.full((n_layers, n_experts), MISSING, dtype=np.int32)  # [L, E] -> slot
        table.flags.writeable = False
        self._published = (0, table)  # (version, table): swapped as one reference
        self._owners = np.full(n_slots, FREE, dtype=np.int64)  # slot -> layer * E + expert
        self._claim_version = np.zeros(n_slots, dtype=np.int64)
        self._pins: dict[int, int] = {}  # version -> readers holding it

    # ---- reading ------------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self._published[0]

    def snapshot(self) -> Snapshot:
        """Pin and return the latest published version (release it when done)."""
        with self._lock:
            version, table = self._published
            self._pins[version] = self._pins.get(version, 0) + 1
        return Snapshot(version, table, self)

    def peek(self) -> Snapshot:
        """The latest version, unpinned: for inspection, never for reading slot bytes."""
        version, table = self._published
        return Snapshot(version, table, None)

    def slot_owner(self, slot: int) -> tuple[int, int] | None:
        """(layer, expert) resident in `slot`, or None while it is free or claimed."""
        key = int(self._owners[self._check_slot(slot)])
        return None if key < 0 else divmod(key, self.n_experts)

    def is_claimed(self, slot: int) -> bool:
        return int(self._owners[self._check_slot(slot)]) == CLAIMED

    def free_slots(self) -> list[int]:
        return [int(s) for s in np.flatnonzero(self._owners == FREE)]

    @property
    def num_resident(self) -> int:
        return int((self._owners >= 0).sum())

    # ---- the ordered change path --------------------------------------------------------
    def begin_evict(self, slot: int) -> EvictTicket:
        """Claim `slot` for overwriting: publish its expert (if any) as missing, then return."""
        self._check_slot(slot)
        with self._lock:
            key = int(self._owners[slot])
            if key == CLAIMED:
                raise RuntimeError(f"slot {slot} is already claimed by begin_evict and not yet "
                                   "landed or aborted; one change per slot at a time")
            evicted = None
            version, table = self._published
            if key >= 0:
                evicted = divmod(key, self.n_experts)
                table = table.copy()
                table[evicted] = MISSING
                table.flags.writeable = False
            # Publish a new version even for a free slot: the ticket's version orders the
            # overwrite after every reader that started earlier, whatever the slot held.
            version += 1
            self._owners[slot] = CLAIMED
            self._claim_version[slot] = version
            self._published = (version, table)
        return EvictTicket(slot, version, evicted)

    def begin_evict_many(self, slots) -> list[EvictTicket]:
        """begin_evict of each of `slots` (distinct), published as one version: one table copy
        for the batch (the async copier claims a round's slots at once)."""
        idx = np.asarray(slots, dtype=np.int64).reshape(-1)
        if idx.size == 0:
            return []
        if idx.min() < 0 or idx.max() >= self.n_slots:
            bad = int(idx[(idx < 0) | (idx >= self.n_slots)][0])
            raise IndexError(f"slot {bad} is out of range: the cache has {self.n_slots} slots")
        if _repeats(idx):
            raise ValueError(f"begin_evict_many: slots repeat in {idx.tolist()}")
        with self._lock:
            keys = self._owners[idx]
            if (keys == CLAIMED).any():
                slot = int(idx[keys == CLAIMED][0])
                raise RuntimeError(f"slot {slot} is already claimed by begin_evict and not yet "
                                   "landed or aborted; one change per slot at a time")
            version, table = self._published
            version += 1
            held = keys >= 0
            if held.any():
                table = table.copy()
                table.reshape(-1)[keys[held]] = MISSING
                table.flags.writeable = False
            self._owners[idx] = CLAIMED
            self._claim_version[idx] = version
            self._published = (version, table)
        E = self.n_experts
        return [EvictTicket(slot, version, (key // E, key % E) if key >= 0 else None)
                for slot, key in zip(idx.tolist(), keys.tolist())]

    def is_overwritable(self, ticket: EvictTicket) -> bool:
        """True once no reader pins a version older than the ticket's."""
        with self._lock:
            return self._oldest_pin_locked() >= ticket.version

    def wait_overwritable(self, ticket: EvictTicket, timeout_s: float | None = None) -> None:
        """Block until `is_overwritable(ticket)`; raise TimeoutError after `timeout_s`."""
        with self._drained:
            ok = self._drained.wait_for(lambda: self._oldest_pin_locked() >= ticket.version,
                                        timeout=timeout_s)
            if not ok:
                raise TimeoutError(
                    f"slot {ticket.slot}: readers of version {self._oldest_pin_locked()} "
                    f"(older than {ticket.version}) held their snapshot for over {timeout_s} s; "
                    "a snapshot was not released")

    def land(self, slot: int, layer: int, expert: int) -> int:
        """Publish (layer, expert) as resident in `slot`, whose bytes have fully landed; return
        the new version."""
        self._check_slot(slot)
        if not (0 <= layer < self.n_layers and 0 <= expert < self.n_experts):
            raise IndexError(f"expert ({layer}, {expert}) is out of range for a table of "
                             f"{self.n_layers} layers x {self.n_experts} experts")
        with self._lock:
            if int(self._owners[slot]) != CLAIMED:
                raise RuntimeError(f"land(slot {slot}) without begin_evict({slot}): a slot must "
                                   "be claimed (its old expert published missing) first")
            if self._oldest_pin_locked() < self._claim_version[slot]:
                raise RuntimeError(
                    f"land(slot {slot}) while a reader still pins version "
                    f"{self._oldest_pin_locked()} < {int(self._claim_version[slot])}: its bytes "
                    "were overwritten too early; wait_overwritable(ticket) before copying")
            version, table = self._published
            if table[layer, expert] != MISSING:
                raise ValueError(f"expert ({layer}, {expert}) is already resident in slot "
                                 f"{int(table[layer, expert])}; abort slot {slot} instead")
            table = table.copy()
            table[layer, expert] = slot
            table.flags.writeable = False
            self._owners[slot] = layer * self.n_experts + expert
            self._published = (version + 1, table)
            return version + 1

    def land_many(self, loads) -> int:
        """land() of each (slot, layer, expert) in `loads`, published as one version (one table
        copy); every load is checked before any is published. Returns the new version."""
        arr = np.asarray(loads, dtype=np.int64).reshape(-1, 3)
        slots, layers, experts = arr[:, 0], arr[:, 1], arr[:, 2]
        if len(arr) and (slots.min() < 0 or slots.max() >= self.n_slots):
            bad = int(slots[(slots < 0) | (slots >= self.n_slots)][0])
            raise IndexError(f"slot {bad} is out of range: the cache has {self.n_slots} slots")
        outside = (layers < 0) | (layers >= self.n_layers) | (experts < 0) | \
            (experts >= self.n_experts)
        if outside.any():
            at = int(np.flatnonzero(outside)[0])
            raise IndexError(f"expert ({int(layers[at])}, {int(experts[at])}) is out of range "
                             f"for a table of {self.n_layers} layers x {self.n_experts} experts")
        keys = layers * self.n_experts + experts
        if _repeats(slots) or _repeats(keys):
            raise ValueError(f"land_many: a slot or an expert repeats in {arr.tolist()}")
        with self._lock:
            version, table = self._published
            if not len(arr):
                return version
            unclaimed = self._owners[slots] != CLAIMED
            if unclaimed.any():
                slot = int(slots[unclaimed][0])
                raise RuntimeError(f"land(slot {slot}) without begin_evict({slot}): a slot must "
                                   "be claimed (its old expert published missing) first")
            oldest = self._oldest_pin_locked()
            early = self._claim_version[slots] > oldest
            if early.any():
                slot = int(slots[early][0])
                raise RuntimeError(
                    f"land(slot {slot}) while a reader still pins version {oldest} < "
                    f"{int(self._claim_version[slot])}: its bytes were overwritten too early; "
                    "wait_overwritable(ticket) before copying")
            flat = table.reshape(-1)
            taken = flat[keys] != MISSING
            if taken.any():
                at = int(np.flatnonzero(taken)[0])
                raise ValueError(f"expert ({int(layers[at])}, {int(experts[at])}) is already "
                                 f"resident in slot {int(flat[keys[at]])}; abort slot "
                                 f"{int(slots[at])} instead")
            table = table.copy()
            table.reshape(-1)[keys] = slots
            table.flags.writeable = False
            self._owners[slots] = keys
            self._published = (version + 1, table)
            return version + 1

    def abort(self, slot: int) -> None:
        """Give a claimed slot back as free (its copy failed or is no longer wanted)."""
        with self._lock:
            if int(self._owners[self._check_slot(slot)]) != CLAIMED:
                raise RuntimeError(f"abort(slot {slot}): the slot is not claimed")
            self._owners[slot] = FREE

    # ---- internals ----------------------------------------------------------------------
    def _oldest_pin_locked(self) -> int:
        return min(self._pins) if self._pins else self._published[0]

    def _unpin(self, version: int) -> None:
        with self._drained:
            left = self._pins[version] - 1
            if left:
                self._pins[version] = left
            else:
                del self._pins[version]
                self._drained.notify_all()

    def _check_slot(self, slot: int) -> int:
        if not 0 <= slot < self.n_slots:
            raise IndexError(f"slot {slot} is out of range: the cache has {self.n_slots} slots")
        return slot

    def __repr__(self) -> str:
        return (f"ResidencyTable({self.n_layers}x{self.n_experts}, {self.n_slots} slots, "
                f"version {self.version}, {self.num_resident} resident)")
