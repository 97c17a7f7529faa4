"""The expert tier of a layer split: one ExpertTier per stage (its store, VRAM cache, residency
table, routing counts, policy and copier over its own layers, on its own GPU) behind the one
object the engine, the CLI and /metrics read (totals summed over the stages).
"""
from __future__ import annotations

import copy
import dataclasses
import logging

import numpy as np

from strata.backends.cuda.stage import stage_store
from strata.engine.expert_tier import ExpertTier, TierWindow, model_forward
from strata.engine.tier_stats import OptimumResult, TierTotals
from strata.experts.profile import StoredProfileRecorder
from strata.experts.store import ExpertStore
from strata.experts.trace import TraceWriter

log = logging.getLogger("strata.tier")


class StageTier(ExpertTier):
    """An ExpertTier over one stage's layers (local layer i = global first + i), driven in two
    halves around the split pass: `begin` before it, `end` after it."""

    def __init__(self, model, store, arena, config, index: int, profile_path=None,
                 profile_is_stored: bool = False):
        super().__init__(model, store, arena, config)
        self.index = index
        self.first_layer, self.stop_layer = model.first_layer, model.stop_layer
        self._profile_path = profile_path
        self._profile_is_stored = profile_is_stored and profile_path is not None

    @property
    def label(self) -> str:
        return (f"stage {self.index} (GPU {self.model.runtime.index}, layers "
                f"{self.first_layer}-{self.stop_layer - 1})")

    @property
    def log_prefix(self) -> str:
        return f"{self.label}: "

    # the whole model's profile, restricted to this stage's layers
    @property
    def profile_path(self):
        return self._profile_path

    @property
    def profile_layers(self) -> tuple[int, int]:
        return self.first_layer, self.stop_layer

    @property
    def profile_model_layers(self) -> int:
        return self.model.gguf.base.spec.n_layers

    @property
    def profile_is_stored(self) -> bool:
        return self._profile_is_stored

    def begin(self, num_rows: int):
        """Before the pass: land finished copies (unless the pump runs during the pass, see
        during), set the PCIe share; the residency snapshot."""
        self._before_s = 0.0
        self._during = (0, 0.0)
        self._fold_pending_before(num_rows)
        if self.arena is None:
            return None
        import time

        t0 = time.perf_counter()
        self.arena.before_window(num_rows, pump=not self.overlaps_window)
        self._before_s = time.perf_counter() - t0
        return self.arena.table.snapshot()

    def during(self, is_done) -> None:
        """While the split pass runs (overlaps_window): this stage's pump and due round, on its
        GPU; `is_done()` tells whether every stage has finished."""
        with self.model.runtime.active():
            self._during_window(is_done)

    def end(self, snap, counts: np.ndarray, kind: str) -> None:
        """After the pass: this stage's counts [Ls, E], accounting and (when due) a round."""
        self._counts[:] = counts
        self._after_window(snap, kind)


@dataclasses.dataclass
class _TierTicket:
    """A pipelined window in flight: the model's ticket, each stage's residency snapshot and
    before_window time, the window's routing counts [L, E] and kind."""

    model: object
    snaps: list
    befores: list
    counts: np.ndarray
    kind: str


@dataclasses.dataclass(frozen=True)
class _Facts:
    """What observers read of the whole split's store and cache (`tier.store`, `tier.arena`)."""

    source: str
    n_layers: int
    n_experts: int
    n_slots: int
    misses_on_gpu: bool = True


class _SplitRecent:
    """The stages' recent routing as one: accesses summed, hit rates weighted by accesses."""

    def __init__(self, stages):
        self._stages = stages

    def optimum(self) -> OptimumResult:
        parts = [t.recent.optimum() for t in self._stages if t.recent is not None]
        total = sum(p.num_accesses for p in parts)

        def rate(field: str) -> float:
            return (sum(getattr(p, field) * p.num_accesses for p in parts) / total
                    if total else 0.0)

        return OptimumResult(min((p.num_windows for p in parts), default=0), total,
                             rate("cache_hit_rate"), rate("optimum_hit_rate"))


class SplitTier:
    """The tiers of every stage, with ExpertTier's interface for its callers: `start`,
    `forward_window`, `forward`, `last_window`, `snapshot_totals`, `mode`, `wait_idle`,
    `close`, and `store` / `arena` / `recent` as facts about the whole split."""

    def __init__(self, model, stages: list[StageTier], config, source: str):
        self.model, self.stages, self.config = model, stages, config
        L, E = model.spec.n_layers, model.spec.n_experts
        slots = sum(t.arena.n_slots for t in stages if t.arena is not None)
        self.store = _Facts(source, L, E, slots)
        self.arena = self.store if any(t.arena is not None for t in stages) else None
        self.recent = _SplitRecent(stages)
        self.is_async = bool(config.adapt_async)
        self.last_window = TierWindow()
        self._counts = np.zeros((L, E), dtype=np.int64)  # [L, E] this window's routed rows
        # the last window's counts for the trace and the stored profile, recorded while the
        # next window runs when a stage overlaps (as each stage's own routing: StageTier)
        self._pending = None
        self._pending_counts = np.zeros((L, E), dtype=np.int64)
        self.trace = None
        if config.dump_routing_path is not None:
            self.trace = TraceWriter(config.dump_routing_path, L, E,
                                     {"model": str(config.model_path), "source": source})
        self._num_windows = 0
        # --expert-profile auto: the whole model's routing, stored at close
        self.profile_recorder = None
        if getattr(config, "expert_profile_save", None) is not None and self.arena is not None:
            self.profile_recorder = StoredProfileRecorder(config.expert_profile_save, L, E)
            if config.expert_profile_path is None:
                log.info("no stored routing profile for this model yet: the caches fill in "
                         "layer order; this run's routing is stored in %s at close",
                         config.expert_profile_save)

    @classmethod
    def build(cls, config, gguf, model) -> "SplitTier":
        """A stage tier per stage of `model` (SplitModel): `--vram-budget` applies to each
        card; `--expert-cache N` is shared by layer count, `auto` sizes each card's own."""
        if config.expert_pack_path is not None:
            store = ExpertStore.from_pack(config.expert_pack_path, gguf)
        else:
            store = ExpertStore.from_gguf(gguf)
        L = model.spec.n_layers
        stages = []
        given = config.expert_cache
        num_given = int(given) if given not in (None, "auto") else None
        for i, stage in enumerate(model.stages):
            st_config = copy.copy(config)
            st_config.dump_routing_path = None  # the split records the whole model's routing
            st_config.expert_profile_path = None  # StageTier reads its layers' part
            st_config.expert_profile_save = None  # the split stores the whole model's routing
            if num_given is not None:
                first = num_given * stage.first_layer // L
                st_config.expert_cache = num_given * stage.stop_layer // L - first
            st_store = stage_store(store, stage.gguf)
            arena = None
            if not stage.experts_resident:
                with stage.runtime.active():  # its free VRAM, its allocations
                    arena = stage.new_expert_arena(st_store, st_config)
                st_config.expert_cache_slots = arena.n_slots
            stages.append(StageTier(stage, st_store, arena, st_config, i,
                                    config.expert_profile_path,
                                    config.expert_profile_save is not None))
        config.expert_cache_slots = sum(t.arena.n_slots for t in stages if t.arena is not None)
        if getattr(config, "kv_grow", None) is not None:
            # KV grow lends one cache's slots to one KV; a split's KV spans every stage's cache
            log.warning("--kv-grow is off on a layer split (not built for several caches yet); "
                        "every slot gets its KV cells up front")
            config = copy.copy(config)
            config.kv_grow = None
        return cls(model, stages, config, store.source)

    # ---- running ----------------------------------------------------------------------------
    def start(self, policy) -> None:
        """Each stage takes its own copy of the policy (its state is per (layer, expert) of its
        layers; its slot count is the stage's), fills its cache and starts its copier."""
        for t in self.stages:
            p = copy.deepcopy(policy) if policy is not None else None
            if p is not None and hasattr(p, "num_cache_slots") and t.arena is not None:
                p.num_cache_slots = t.arena.n_slots
            t.start(p)

    @property
    def mode(self) -> str:
        return self.stages[0].mode

    @property
    def streams_prompt_experts(self) -> bool:
        return any(t.streams_prompt_experts for t in self.stages)

    def forward_window(self, window, lazy: bool = False, greedy: bool = False):
        """The split pass with every stage's tier around it (as ExpertTier.forward_window)."""
        kind = "batch" if len(window.kvs) > 1 else "solo"
        snaps = [t.begin(window.num_rows) for t in self.stages]
        forward = model_forward(self.model, lazy, greedy)
        extra = {}
        if self._overlapping:  # their pumps and rounds run while the GPUs run the pass
            extra["while_running"] = self._while_running
        try:
            self._counts[:] = 0
            logits = forward(window, routing_counts=self._counts, **extra)
        finally:
            for snap in snaps:
                if snap is not None:
                    snap.release()  # the slots it showed may be overwritten from now on
        self._close_window(snaps, self._counts, kind)
        return logits

    # ---- pipelined windows (the scheduler's slot groups; SplitModel.start_window) ------------
    @property
    def pipelines(self) -> bool:
        """Can windows of several slot groups be in flight at once? Not with a blocking round
        (it waits until no window holds the table version it replaces: the others in flight
        would never finish) nor with free admission or a CPU pool (one window at a time)."""
        return all(t.mode != "blocking" and not t.admits
                   and (t.arena is None or getattr(t.arena, "pool", None) is None)
                   for t in self.stages)

    def start_window(self, window, lane: int, mode: str = "lazy"):
        """Each stage's tier before the window, then the window queued as lane `lane`
        (SplitModel.start_window); finish_window completes it."""
        kind = "batch" if len(window.kvs) > 1 else "solo"
        snaps = [t.begin(window.num_rows) for t in self.stages]
        befores = [t._before_s for t in self.stages]
        counts = np.zeros_like(self._counts)
        try:
            ticket = self.model.start_window(window, lane, mode, routing_counts=counts)
        except BaseException:
            for snap in snaps:
                if snap is not None:
                    snap.release()
            raise
        return _TierTicket(ticket, snaps, befores, counts, kind)

    def finish_window(self, ticket: "_TierTicket"):
        """Wait for a window start_window queued (the stages' pumps and rounds run meanwhile)
        and account it as forward_window does; returns what the model's finish_window does."""
        try:
            out = self.model.finish_window(
                ticket.model, while_running=self._while_running if self._overlapping else None)
        finally:
            for snap in ticket.snaps:
                if snap is not None:
                    snap.release()
        for t, before in zip(self.stages, ticket.befores):
            t._before_s = before  # begin() of a later window replaced it
        self._close_window(ticket.snaps, ticket.counts, ticket.kind)
        return out

    @property
    def _overlapping(self) -> list:
        return [t for t in self.stages if t.overlaps_window]

    def _while_running(self, is_done) -> None:
        """While the GPUs run a pass: the last window's trace record, each overlapping stage's
        pump and due round."""
        self._record_pending()
        for t in self._overlapping:
            t.during(is_done)

    def _close_window(self, snaps, counts: np.ndarray, kind: str) -> None:
        """After a pass: each stage's accounting, the trace and profile (now, or while the
        next window runs), the window's figures."""
        hits = misses = swaps = 0
        wait_s = 0.0
        for t, snap in zip(self.stages, snaps):
            t.end(snap, counts[t.first_layer:t.stop_layer], kind)
            w = t.last_window
            hits, misses, swaps = hits + w.num_hits, misses + w.num_misses, swaps + w.num_swaps
            wait_s += w.wait_s
        self._record_pending()  # a pass that did not run while_running
        if self._overlapping:
            self._pending_counts[:] = counts
            self._pending = (self._num_windows, self._pending_counts)
        else:
            self._record(self._num_windows, counts)
        self._num_windows += 1
        self.last_window = TierWindow(hits, misses, swaps, wait_s)

    def _record(self, window_index: int, counts: np.ndarray) -> None:
        """A window's routing [L, E] into the trace and the stored profile."""
        if self.trace is not None:
            self.trace.record_counts(window_index, counts)
            if (window_index + 1) % 32 == 0:
                self.trace.flush()
        if self.profile_recorder is not None:
            self.profile_recorder.add(counts)

    def _record_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            self._record(*pending)

    def forward(self, tokens: np.ndarray, kv, all_logits: bool = False) -> np.ndarray:
        from strata.backends.window import Window

        return self.forward_window(Window.build([(kv, tokens)],
                                                logits="all" if all_logits else "last"))

    # ---- what observers read ----------------------------------------------------------------
    def snapshot_totals(self) -> TierTotals:
        """The stages' totals summed (windows: each window counted once; the longest wait)."""
        parts = [t.snapshot_totals() for t in self.stages]
        out = TierTotals()
        for f in dataclasses.fields(TierTotals):
            values = [getattr(p, f.name) for p in parts]
            setattr(out, f.name, max(values) if f.name in ("max_wait_s", "num_windows")
                    else sum(values))
        return out

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        return all([t.wait_idle(timeout_s) for t in self.stages])

    def log_group(self) -> None:
        for t in self.stages:
            if t.arena is not None:
                t.log_group()

    def close(self) -> None:
        for t in self.stages:
            t.close()
        self._record_pending()
        if self.trace is not None:
            self.trace.close()
        if self.profile_recorder is not None:
            self.profile_recorder.save()
