"""The async tier's copies into VRAM expert slots on the arena's side stream, driven from the
engine thread between windows, so copies land while the following windows run.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from strata._native import cuda_driver
from strata.experts.arena import COPY_CHUNK_BYTES

if TYPE_CHECKING:
    from strata.backends.cuda.offload import VramExpertArena


class StreamCopier:
    """The async tier's copies on the arena's side stream, driven from the engine thread before
    each window (`pump`): lands the loads whose copy event completed, claims the slots of new
    loads (evictions published in one upload, event E_pub), enqueues their copies behind E_pub
    (one cuda_driver list per pump, one event per pump for the loads it completes).
    `chunks_per_window` (None: whole loads) spreads a load's chunks over several windows. Loads into
    slots the caller already claimed (`submit_claimed`: a prompt chunk's borrowed staging)
    are copied behind the compute stream's work so far instead."""

    def __init__(self, arena: VramExpertArena, on_landed, chunk_bytes: int = COPY_CHUNK_BYTES,
                 chunks_per_window: int | None = None):
        self.arena, self._on_landed = arena, on_landed
        self.chunk_bytes, self.chunks_per_window = chunk_bytes, chunks_per_window
        self._queued: list = []
        self._claimed: list = []  # loads whose slot the caller claimed (submit_claimed)
        self._flight: list[dict] = []  # {load, at, nbytes, event}

    def start(self) -> None:
        pass

    @property
    def is_busy(self) -> bool:
        return bool(self._queued or self._claimed or self._flight)

    def submit(self, loads) -> None:
        self._queued.extend(loads)

    def queued_slots(self) -> frozenset[int]:
        """Slots of submitted loads not yet claimed (the next pump claims them)."""
        return frozenset(load.slot for load in self._queued)

    def submit_claimed(self, loads) -> None:
        """Loads into slots already claimed (begin_evict done, the eviction published)."""
        self._claimed.extend(loads)

    def pump(self) -> None:
        a, rt, drv = self.arena, self.arena._rt, self.arena._rt.drv
        with rt.active():
            # 1. land what has arrived, one table version for all of them (an event is shared
            # by the loads one pump completed: query it once)
            landing, arrived, resident = [], {}, a.table.peek().table
            for f in self._flight:
                event = f["event"]
                if event is None:
                    continue
                if id(event) not in arrived:
                    arrived[id(event)] = event.query()
                if arrived[id(event)] and (f["ticket"] is None
                                           or a.table.is_overwritable(f["ticket"])):
                    # (a window started before the claim may still hold its snapshot: with
                    # pipelined slot groups it finishes after this pump; its kernels ran
                    # before the copy, which waited for the eviction's upload, but the table
                    # publishes the load only once no reader holds an older version)
                    landing.append(f)
            landed, seen = [], set()
            for f in landing:
                load = f["load"]
                self._flight.remove(f)
                if resident[load.layer, load.expert] >= 0 or (load.layer, load.expert) in seen:
                    # another copier loaded it meanwhile (a refill racing a swap)
                    a.table.abort(load.slot)
                    continue
                seen.add((load.layer, load.expert))
                landed.append(load)
            changed = bool(landed)
            if landed:
                a.table.land_many([(ld.slot, ld.layer, ld.expert) for ld in landed])
                a._point_many([ld.layer for ld in landed], [ld.expert for ld in landed],
                              [ld.slot for ld in landed])
                for load in landed:
                    self._on_landed(load)
            # 2. claim the slots of new loads (their evictions in one table version)
            tickets = a.table.begin_evict_many([load.slot for load in self._queued])
            evicted = [t.evicted for t in tickets if t.evicted is not None]
            a._point_many([e[0] for e in evicted], [e[1] for e in evicted], [-1] * len(evicted))
            started = [{"load": load, "at": 0, "event": None, "nbytes": a._image_bytes(load.layer),
                        "ticket": ticket} for load, ticket in zip(self._queued, tickets)]
            self._queued = []
            if changed or started:
                published = a._publish()
                if started:
                    a.side_stream.wait_for_event(published)
                self._flight += started
            if self._claimed:  # copied behind every kernel issued so far
                issued = drv.Event()
                issued.record(rt.stream)
                a.side_stream.wait_for_event(issued)
                self._flight += [{"load": load, "at": 0, "event": None, "ticket": None,
                                  "nbytes": a._image_bytes(load.layer)} for load in self._claimed]
                self._claimed = []
            # 3. enqueue copies behind the published evictions: one list run by one call (no
            # Python per driver call), a whole load per copy unless chunks_per_window spreads
            # it, and one event after the copies for every load they complete
            budget, side = self.chunks_per_window, int(a.side_stream.handle)
            step = self.chunk_bytes if budget is not None else None
            copies, completed = cuda_driver.LaunchList(), []
            for f in self._flight:
                load = f["load"]
                src = a.host.host_base + a.host.index(load.layer, load.expert) * a.host.slot_bytes
                dst = a.slot_base + load.slot * a.slot_bytes
                while f["at"] < f["nbytes"] and (budget is None or budget > 0):
                    at = f["at"]
                    end = f["nbytes"] if step is None else min(at + step, f["nbytes"])
                    copies.append(cuda_driver.copy_htod(dst + at, src + at, end - at, side))
                    f["at"] = end
                    budget = None if budget is None else budget - 1
                if f["at"] >= f["nbytes"] and f["event"] is None:
                    completed.append(f)
            if completed:
                event = cuda_driver.Event()
                copies.append(cuda_driver.record_event(event, side))
                for f in completed:
                    f["event"] = event
            if len(copies):
                copies.run(side)

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Pump until every submitted load landed (engine thread, no window running)."""
        deadline = None if timeout_s is None else time.perf_counter() + timeout_s
        while self.is_busy:
            self.pump()
            if deadline is not None and time.perf_counter() > deadline:
                return False
            time.sleep(0.0002)
        return True

    def stop(self) -> None:
        """Drop queued loads; loads in flight finish their copies and are given back free."""
        a = self.arena
        self._queued = []
        for load in self._claimed:
            a.table.abort(load.slot)
        self._claimed = []
        if self._flight:
            with a._rt.active():
                a.side_stream.synchronize()
            for f in self._flight:
                a.table.abort(f["load"].slot)
            self._flight = []
