"""The expert tier at run time: store, arena (CPU, or VRAM slots on the CUDA backend), residency
table, tier policy, routing counts and trace around every forward pass; every `adapt_every`
windows a round of swaps, applied through the arena's ordered path before the next window
(blocking) or by a copier (async: a thread, or the CUDA arena's side stream).
"""
from __future__ import annotations

import logging
import math
import operator
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from strata.errors import ConfigError, ModelFormatError
from strata.experts.arena import (COPY_CHUNK_BYTES, SLOT_ALIGN_BYTES, CpuExpertArena,
                                  ExpertArena, num_slots_for)
from strata.experts.profile import StoredProfileRecorder, read_profile
from strata.experts.store import ExpertStore
from strata.experts.tier import FREE_SLOT
from strata.experts.trace import TraceWriter
from strata.hookspecs import ExpertSwap
from strata.engine.tier_copier import COPY_TIMEOUT_S, TierCopier
from strata.engine.tier_stats import RecentRouting, TierTotals, WaitTotals, format_group

log = logging.getLogger("strata.tier")

LOG_EVERY_WINDOWS = 32  # windows per INFO summary line, at most one line per
LOG_MIN_INTERVAL_S = 10.0  # seconds (a GPU decoding 200 windows a second wrote six a second)
_log_clock = time.monotonic  # (tests step it)
POLICY_FAILURE_REPEAT = 100  # a failing policy plugin is logged again every this many rounds


@dataclass(frozen=True)
class TierWindow:
    """What the tier did in one window: routed entries served by the cache (hits) and by the
    store (misses), swaps started by the round it closed, seconds it waited for the tier."""

    num_hits: int = 0
    num_misses: int = 0
    num_swaps: int = 0
    wait_s: float = 0.0


@dataclass(frozen=True)
class _Load:
    slot: int
    layer: int
    expert: int
    is_eviction: bool


def model_forward(model, lazy: bool = False, greedy: bool = False):
    """The model's pass for a tier's forward_window: lazy logits or greedy ids where the model
    has them (CudaModel, SplitModel), else forward_window (greedy: argmax of its logits)."""
    if greedy:
        fn = getattr(model, "forward_window_greedy", None)
        if fn is not None:
            return fn

        def argmax_of_logits(window, **kwargs):
            return np.argmax(model.forward_window(window, **kwargs), axis=-1).astype(np.int32)
        return argmax_of_logits
    fn = getattr(model, "forward_window_lazy", None) if lazy else None
    return fn or model.forward_window


class ExpertTier:
    """Owns the expert store (GGUF or pack), the arena (None without `--expert-cache`), the
    policy, the routing counts and the trace. Build with `build()`, then `start(policy)`; the
    scheduler calls `forward_window(window)` in place of the model's. Engine thread only
    (the async copier is its own thread)."""

    def __init__(self, model, store: ExpertStore, arena: ExpertArena | None, config):
        self.model = model
        self.store = store
        self.arena = arena
        self.config = config
        self.policy = None
        self.copy_chunk_bytes = COPY_CHUNK_BYTES  # bytes per copy step (the copier's slices)
        self.is_async = bool(config.adapt_async)
        shape = (store.n_layers, store.n_experts)
        self._counts = np.zeros(shape, dtype=np.int64)  # [L, E] this window's routed rows
        self._round_counts = np.zeros(shape, dtype=np.int64)  # [L, E] since the last round
        # [L, 3, E] uint64 host pointers, for models that take them per window (the CPU's)
        self._reads_pointers = getattr(model, "reads_expert_pointers", True) and (
            arena is None or arena.reads_host_pointers)
        self._store_pointers = store.expert_pointers() if self._reads_pointers else None
        self._pointers = self._store_pointers
        self._pointer_version = -1
        self._windows_since_round = 0
        self._num_policy_failures = 0  # rounds the policy plugin failed (see _policy_failed)
        self._lock = threading.Lock()  # guards totals (the copier adds to them)
        self.totals = TierTotals()
        self._logged = TierTotals()
        self._max_wait_since_log = 0.0
        self._logged_at = -math.inf  # _log_clock() at the last log_group line
        self._ahead_logged = (0, 0, 0)  # the arena's read_ahead_totals at the last log_group
        self.last_window = TierWindow()
        self.recent = (RecentRouting(store.n_layers, store.n_experts, arena.n_slots)
                       if arena is not None else None)
        self.profile = None  # the RoutingProfile the cache was filled from (start)
        # --expert-profile auto: this run's routing, folded into the stored profile at close
        self.profile_recorder = None
        if getattr(config, "expert_profile_save", None) is not None and arena is not None:
            self.profile_recorder = StoredProfileRecorder(config.expert_profile_save,
                                                          store.n_layers, store.n_experts)
        self.trace = None
        if config.dump_routing_path is not None:
            self.trace = TraceWriter(config.dump_routing_path, store.n_layers, store.n_experts,
                                     {"model": str(config.model_path), "source": store.source})
        self._copier = None  # the async copier (TierCopier, or the arena's own)
        self.kv_lender = None  # KV grow's lender (experts/kv_grow.py), set when it is built
        self._before_s = 0.0  # seconds the arena's before_window took (the tier's wait)
        # Set by start(): an asynchronous tier over a device arena pumps and starts its rounds
        # while the window's GPU work runs (the model's while_running): see _during_window
        self.overlaps_window = False
        self._during = (0, 0.0)  # (swaps started, seconds of wait) by the last _during_window
        # (window index, counts [L, E]) of the last window, folded in while the next one runs
        # (overlaps_window: _fold_routing is off the path between windows); one at most
        self._pending = None
        self._pending_counts = np.zeros(shape, dtype=np.int64)
        self.admits = False  # set by start(): windows keep the misses they read (keep_misses)
        # the tier's wait by window kind: "solo" (one slot) and "batch" (several slots)
        self.wait_by_kind = {"solo": WaitTotals(), "batch": WaitTotals()}

    # ---- building -----------------------------------------------------------------------
    @classmethod
    def build(cls, config, gguf, model) -> "ExpertTier | None":
        """The tier for `config` (None when it asks for no cache, pack or trace). Sets
        `config.expert_cache_slots` to the resolved slot count, which the policy hook reads."""
        if not config.has_expert_tier:
            return None
        build_split = getattr(model, "build_expert_tier", None)
        if build_split is not None:  # a layer split: a tier per stage (cuda/split_tier.py)
            return build_split(config, gguf)
        if config.expert_pack_path is not None:
            store = ExpertStore.from_pack(config.expert_pack_path, gguf)
        else:
            store = ExpertStore.from_gguf(gguf)
        arena = None
        if getattr(model, "experts_resident", True) is False:
            # the CUDA backend with offloaded experts: VRAM slots, every expert in pinned host
            # RAM; it sizes `auto` (also when no --expert-cache was given: the experts beyond
            # VRAM need a cache there) from free VRAM and --vram-budget
            arena = model.new_expert_arena(store, config)
            config.expert_cache_slots = arena.n_slots
        elif config.expert_cache is not None:
            slot_bytes = -(-store.expert_nbytes // SLOT_ALIGN_BYTES) * SLOT_ALIGN_BYTES
            num_slots = num_slots_for(config.expert_cache, config.vram_budget_bytes,
                                      slot_bytes, store.n_layers * store.n_experts)
            arena = CpuExpertArena(store, num_slots)
            config.expert_cache_slots = num_slots
        return cls(model, store, arena, config)

    def start(self, policy) -> None:
        """Take the resolved tier policy (None: the cache stays as filled), fill the cache from
        the profile (else in layer order) and start the copier when async."""
        self.policy = policy
        if self.arena is None:
            log.info("experts read from the %s, no cache%s", self.store.source,
                     f"; routing recorded to {self.config.dump_routing_path}"
                     if self.trace is not None else "")
            return
        t0 = time.perf_counter()
        self.profile = profile = self._read_profile()  # KV grow's refills rank by it too
        order, source = self._fill_order(profile)
        num_filled = self.arena.fill(order)
        arena = self.arena
        is_frozen = self.mode == "frozen"
        log.info("%sexpert cache: %d slots x %d bytes (%.1f MiB) of %d experts, experts from "
                 "the %s; filled %d from %s in %.0f ms; tier %s", self.log_prefix,
                 arena.n_slots, arena.slot_bytes,
                 arena.n_slots * arena.slot_bytes / 2**20, self.store.n_layers
                 * self.store.n_experts, self.store.source, num_filled, source,
                 (time.perf_counter() - t0) * 1e3,
                 "frozen" if is_frozen else
                 f"{getattr(policy, 'name', type(policy).__name__)} every "
                 f"{self.config.adapt_every} windows ({self.mode})")
        seed = getattr(arena, "seed_routing", None)
        if profile is not None and seed is not None:
            # a device arena's prompt streaming starts from the profile's routing (stream.py)
            first, stop = self.profile_layers
            seed(profile.rows_by_expert()[first:stop])
        if self.is_async and not is_frozen:
            self._copier = self.arena.new_copier(self._count_load) or TierCopier(self.apply)
            self._copier.start()
        # Only asynchronous rounds may run inside a window: a blocking round waits until no
        # reader holds the table version its evictions replace, and the running window is one.
        self.overlaps_window = bool(
            self.mode == "async" and arena.overlaps_window
            and getattr(self.model, "runs_while_window", False))
        # Free admission: where a miss already moves the expert's bytes over the link (GPU
        # reach), the window's kernels keep it in the slot of a resident expert the policy's
        # `victims` gives up; with the asynchronous tier only, as its rounds' copies
        self.admits = bool(self.mode == "async" and arena.keeps_misses
                           and callable(getattr(policy, "victims", None))
                           and arena.keep_misses(self._victims))
        if self.admits:
            log.info("%sfree admission: decode windows keep the experts they read over PCIe "
                     "in the slots of those policy %s ranks lowest", self.log_prefix,
                     getattr(policy, "name", type(policy).__name__))

    # ---- the profile --------------------------------------------------------------------
    @property
    def profile_path(self):
        """The --expert-profile this tier fills from (None: layer order)."""
        return self.config.expert_profile_path

    @property
    def profile_layers(self) -> tuple[int, int]:
        """(first, stop): the model's layers this tier's local layers 0.. are (a split's stage
        holds a range of them)."""
        return 0, self.store.n_layers

    def _read_profile(self):
        """The RoutingProfile of `profile_path`, checked against the whole model (None without
        one). A stored profile (--expert-profile auto) that is damaged or does not fit is
        skipped with a warning (the run stores a new one), a given one fails the start."""
        path = self.profile_path
        if path is None:
            if getattr(self.config, "expert_profile_save", None) is not None:
                log.info("%sno stored routing profile for this model yet: the cache fills in "
                         "layer order; this run's routing is stored in %s at close",
                         self.log_prefix, self.config.expert_profile_save)
            return None
        try:
            profile = read_profile(path)
            n_layers = self.profile_model_layers
            if (profile.n_layers, profile.n_experts) != (n_layers, self.store.n_experts):
                raise ConfigError(
                    f"--expert-profile {path} ranks {profile.n_layers} layers x "
                    f"{profile.n_experts} experts but the model has {n_layers} x "
                    f"{self.store.n_experts}; make a profile from this model's traces "
                    "(`strata-tool profile`)")
        except (ConfigError, ModelFormatError, OSError) as exc:
            if not self.profile_is_stored:
                raise
            log.warning("%sthe stored routing profile is not usable (%s); the cache fills in "
                        "layer order and this run stores a new one", self.log_prefix, exc)
            return None
        return profile

    @property
    def profile_is_stored(self) -> bool:
        """Is profile_path the profile --expert-profile auto stored (not one the user gave)?"""
        save = getattr(self.config, "expert_profile_save", None)
        return save is not None and self.profile_path is not None and \
            Path(self.profile_path) == Path(save)

    @property
    def profile_model_layers(self) -> int:
        """The layer count of the whole model (the profile ranks all of them)."""
        return self.store.n_layers

    def _fill_order(self, profile):
        """(iterable of (layer, expert) best first, what it came from): the profile's ranking
        of this tier's layers, else layer order."""
        n_layers, n_experts = self.store.n_layers, self.store.n_experts
        if profile is None:
            return ((layer, e) for layer in range(n_layers) for e in range(n_experts)), \
                "layer order"
        first, stop = self.profile_layers
        ranking = profile.ranking  # [L*E, 2] hottest first
        mine = ranking[(ranking[:, 0] >= first) & (ranking[:, 0] < stop)]
        order = [(int(layer) - first, int(e)) for layer, e in mine[:self.arena.n_slots]]
        return order, f"profile {self.profile_path}"

    # ---- the window ---------------------------------------------------------------------
    def forward_window(self, window, lazy: bool = False, greedy: bool = False) -> np.ndarray:
        """The model's forward pass over `window` with the experts read through the cache;
        then the accounting, the trace and (when due) a round. Returns the logits (left on
        the device with `lazy` when the model can: see CudaModel.forward_window_lazy), or with
        `greedy` each logit row's argmax [N] (on the device when the model can)."""
        forward = model_forward(self.model, lazy, greedy)
        self._before_s = 0.0
        self._during = (0, 0.0)
        self._fold_pending_before(window.num_rows)
        if self.arena is not None:
            t0 = time.perf_counter()
            # a device arena lands finished copies here (or, overlapping, while the window
            # runs) and sets the window's PCIe share
            self.arena.before_window(window.num_rows, pump=not self.overlaps_window)
            self._before_s = time.perf_counter() - t0
        snap = self.arena.table.snapshot() if self.arena is not None else None
        try:
            pointers = self._pointers_for(snap) if self._reads_pointers else None
            self._counts[:] = 0
            extra = {"while_running": self._during_window} if self.overlaps_window else {}
            logits = forward(window, expert_pointers=pointers, routing_counts=self._counts,
                             **extra)
        finally:
            if snap is not None:
                snap.release()  # the slots it showed may be overwritten from now on
        self._after_window(snap, "batch" if len(window.kvs) > 1 else "solo")
        return logits

    def forward(self, tokens: np.ndarray, kv, all_logits: bool = False) -> np.ndarray:
        """`CpuModel.forward` through the tier (one sequence, one window)."""
        from strata.backends.window import Window

        return self.forward_window(Window.build([(kv, tokens)],
                                                logits="all" if all_logits else "last"))

    def _pointers_for(self, snap) -> np.ndarray:
        """[L, 3, E]: rebuilt only when the table's version changed since the last window."""
        if snap is not None and snap.version != self._pointer_version:
            self._pointers = self.arena.pointer_table(snap, self._store_pointers)
            self._pointer_version = snap.version
        return self._pointers

    def _after_window(self, snap, kind: str = "solo") -> None:
        """Between windows: the window's hits and misses, admissions and wait (what the engine
        and /metrics read now); its routing folded in now, or while the next window runs."""
        counts = self._counts
        window_index = self.totals.num_windows
        self._fold_routing_pending()  # a window that did not run while_running (it failed)
        hits = misses = 0
        pool_entries, pool_s, pool_wait_s = 0, 0.0, 0.0
        if snap is not None:
            served = self.arena.count_routed(snap, counts)
            self.arena.take_window()
            hits, misses = served.hits, served.misses
            pool_entries, pool_s, pool_wait_s = self.arena.take_pool_window()
            keys = np.flatnonzero(counts)  # [n] layer * E + expert, ascending
            num_access_hits = int((snap.table.reshape(-1)[keys] >= 0).sum())
            self.recent.append(keys, num_access_hits)
        num_swaps, wait_s = self._during[0], self._before_s + self._during[1]
        if self.overlaps_window:
            # the round ran while the window did (_during_window); the routing is folded in
            # while the next one runs, before its round: the same order, off the host's path
            # between windows (~0.1 ms per tier on the GPU machine)
            self._pending_counts[:] = counts
            self._pending = (window_index, self._pending_counts)
        else:
            self._fold_routing(window_index, counts)
        if (not self.overlaps_window and self.mode != "frozen"
                and self._windows_since_round >= self.config.adapt_every):
            t0 = time.perf_counter()
            num_swaps = self._round()
            wait_s += time.perf_counter() - t0
        num_kept = self.arena.take_admitted() if self.admits else 0
        with self._lock:
            t = self.totals
            t.num_admissions += num_kept
            t.num_windows += 1
            t.num_hits += hits
            t.num_misses += misses
            t.num_pool_entries += pool_entries
            t.pool_s += pool_s
            t.pool_wait_s += pool_wait_s
            if snap is not None:
                t.num_accesses += len(keys)
                t.num_access_hits += num_access_hits
            t.wait_s += wait_s
            t.max_wait_s = max(t.max_wait_s, wait_s)
        self._max_wait_since_log = max(self._max_wait_since_log, wait_s)
        self.last_window = TierWindow(hits, misses, num_swaps, wait_s)
        self.wait_by_kind[kind].add(wait_s)
        log.debug("window %d: %d cache + %d miss routed entries, %d swaps, tier wait %.3f ms",
                  window_index, hits, misses, num_swaps, wait_s * 1e3)
        if self.totals.num_windows % LOG_EVERY_WINDOWS == 0:
            if self.trace is not None:
                self.trace.flush()  # a server killed hard keeps all but the last group
            if self.arena is not None and \
                    _log_clock() - self._logged_at >= LOG_MIN_INTERVAL_S:
                self.log_group()

    @property
    def streams_prompt_experts(self) -> bool:
        """Do prompt windows stream the experts they read from RAM (a device arena with a
        streamer that does not hold every expert: backends/cuda/stream.py)?"""
        arena = self.arena
        return bool(arena is not None and getattr(arena, "streamer", None) is not None
                    and arena.n_slots < self.store.n_layers * self.store.n_experts)

    @property
    def mode(self) -> str:
        """"frozen" (no rounds: no cache slots, no policy or --adapt-every 0), "async" or
        "blocking"."""
        if (self.arena is None or self.arena.n_slots == 0 or self.policy is None
                or self.config.adapt_every == 0):
            return "frozen"
        return "async" if self.is_async else "blocking"

    log_prefix = ""  # before each log_group line (a split's stage tier names its stage)

    def log_group(self) -> None:
        """INFO: what the cache did since the last such line."""
        now = self.snapshot_totals()
        group = now.minus(self._logged)
        ahead = self.arena.read_ahead_totals()
        staged, routed = (ahead[0] - self._ahead_logged[0], ahead[1] - self._ahead_logged[1])
        if group.num_windows:
            group.max_wait_s = self._max_wait_since_log
            log.info("%s%s%s; tier wait by window since start: %s, %s", self.log_prefix,
                     format_group(group, self._logged.num_windows, self.mode,
                                  self.arena.misses_on_gpu),
                     f"; read ahead {staged} experts, {routed} of them routed" if staged else "",
                     self.wait_by_kind["solo"].describe("solo"),
                     self.wait_by_kind["batch"].describe("batch"))
        self._logged, self._ahead_logged = now, ahead
        self._logged_at = _log_clock()
        self._max_wait_since_log = 0.0

    def _fold_routing(self, window_index: int, counts: np.ndarray) -> None:
        """A window's routed rows [L, E] into what later windows and rounds read: the arena's
        decayed counts, the trace, the stored profile, the round's counts, the policy's
        `observe`."""
        if self.arena is not None:
            self.arena.fold_routed(counts)
        if self.trace is not None:
            self.trace.record_counts(window_index, counts)
        if self.profile_recorder is not None:
            self.profile_recorder.add(counts)
        self._round_counts += counts
        observe = getattr(self.policy, "observe", None)  # optional per-window TierPolicy hook
        if observe is not None and self.mode != "frozen":
            observe(counts)  # [L, E] this window's rows, read only: the array is reused
        self._windows_since_round += 1

    def _fold_routing_pending(self) -> None:
        """Fold in the last window's routing if it is still pending."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self._fold_routing(*pending)

    def _fold_pending_before(self, num_rows: int) -> None:
        """Before a window: fold in the last one's routing now when this one reads it before it
        runs (arena.reads_routing_before: a CPU pool's where table, prompt streaming)."""
        if self._pending is not None and self.arena is not None \
                and self.arena.reads_routing_before(num_rows):
            self._fold_routing_pending()

    def _during_window(self, is_done) -> None:
        """While a window's GPU work runs (overlaps_window): the last window's routing folded
        in, the arena's pump, then the round when one is due, from the counts of the windows
        before this one (a round starts one window later than between windows). Its time
        counts as the window's wait only when the GPU had finished before it did
        (`is_done()`): otherwise it was hidden behind the GPU."""
        t0 = time.perf_counter()
        num_swaps = 0
        try:
            self._fold_routing_pending()
            self.arena.during_window()
            if self.mode != "frozen" and self._windows_since_round >= self.config.adapt_every:
                num_swaps = self._round()
            self.arena.prepare_next_window()
        except Exception:  # noqa: BLE001 - the window's requests must still get their tokens
            log.exception("the tier's pump or round failed while a window ran; the window "
                          "goes on, the next one pumps again")
        spent = time.perf_counter() - t0
        self._during = (num_swaps, spent if is_done() else 0.0)

    # ---- rounds -------------------------------------------------------------------------
    def _round(self) -> int:
        """Ask the policy and start its swaps; return how many were started."""
        if getattr(self.arena, "is_lending_slots", False):
            # Slots lent to a prompt chunk's staging (backends/cuda/stream.py) look free to the
            # policy but are not: skip the round until they are back; the counts stay.
            with self._lock:
                self.totals.num_rounds_skipped += 1
            return 0
        if self._copier is not None and self._copier.is_busy:
            # The previous round is still copying: skip this one rather than make the window
            # wait; its counts stay and go to the next round.
            with self._lock:
                self.totals.num_rounds_skipped += 1
            log.debug("tier round skipped: the previous round's copies are still landing")
            return 0
        counts = self._round_counts.copy()
        self._round_counts[:] = 0
        self._windows_since_round = 0
        residency = self.arena.table.peek().table  # [L, E] read-only
        with self._lock:
            self.totals.num_rounds += 1
        try:
            swaps = self.policy.plan_swaps(counts, residency.copy(), float(
                self.config.adapt_min_gain))
            loads = self._resolve(list(swaps), residency)
        except Exception:  # noqa: BLE001 - a faulty plugin must not fail the window's requests
            self._policy_failed("failed; no swaps this round")
            return 0
        if not loads:
            return 0
        if self._copier is not None:
            self._copier.submit(loads)
        else:
            self.apply(loads)
        return len(loads)

    def _victims(self, residency: np.ndarray, n: int) -> list[tuple[int, int]]:
        """The policy's `victims` for free admission (keep_misses), none when it fails."""
        try:
            return list(self.policy.victims(residency.copy(), n))
        except Exception:  # noqa: BLE001 - a faulty plugin must not fail the window's requests
            self._policy_failed("failed to name victims; nothing kept")
            return []

    def _policy_failed(self, what: str) -> None:
        """Log a policy plugin's failure (inside an except block): the first with its
        traceback, then one line every POLICY_FAILURE_REPEAT failures (a round every few
        windows would bury the log); the rest at DEBUG."""
        self._num_policy_failures += 1
        name = getattr(self.policy, "name", type(self.policy).__name__)
        num = self._num_policy_failures
        if num == 1:
            log.exception("tier policy %r %s: fix the plugin", name, what)
        elif num % POLICY_FAILURE_REPEAT == 0:
            log.error("tier policy %r %s: fix the plugin (%d failures so far)", name, what, num)
        else:
            log.debug("tier policy %r %s (failure %d)", name, what, num, exc_info=True)

    def _resolve(self, swaps, residency: np.ndarray) -> list[_Load]:
        """The slot of each swap: a free one for FREE_SLOT, else the evicted expert's. Swaps
        that cannot be applied (a faulty plugin) are dropped with a warning."""
        free = self.arena.table.free_slots()
        taken: set[int] = set(self.arena.offered_slots)  # the running window may take them
        loaded: set[tuple[int, int]] = set()
        loads, num_bad = [], 0
        num_layers, num_experts = residency.shape
        for swap in swaps:
            try:  # four ints (numpy's too) within [L, E]; an eviction may be FREE_SLOT
                swap = ExpertSwap(*(operator.index(v) for v in swap))
            except (TypeError, ValueError):
                num_bad += 1
                continue
            if not (0 <= swap.load_layer < num_layers and 0 <= swap.load_expert < num_experts
                    and (swap.evict_layer == FREE_SLOT or (
                        0 <= swap.evict_layer < num_layers
                        and 0 <= swap.evict_expert < num_experts))):
                num_bad += 1  # (a negative index would wrap to another expert)
                continue
            target = (swap.load_layer, swap.load_expert)
            if residency[target] >= 0 or target in loaded:
                num_bad += 1
                continue
            if swap.evict_layer != FREE_SLOT and int(
                    residency[swap.evict_layer, swap.evict_expert]) in self.arena.offered_slots:
                continue  # offered to the running window (free admission): next round
            if swap.evict_layer == FREE_SLOT:
                if not free:
                    # slots lent to KV grow look free to a policy that counts residents
                    num_bad += self.kv_lender is None or not self.kv_lender.num_lent_slots
                    continue
                slot, is_eviction = free.pop(0), False
            else:
                slot, is_eviction = int(residency[swap.evict_layer, swap.evict_expert]), True
                if slot < 0 or slot in taken:
                    num_bad += 1
                    continue
            taken.add(slot)
            loaded.add(target)
            loads.append(_Load(slot, swap.load_layer, swap.load_expert, is_eviction))
        if num_bad:
            log.warning("tier policy %r returned %d swaps that cannot be applied (not four "
                        "integers in range, a load already resident, an eviction of a missing "
                        "expert, or no free slot); "
                        "they were skipped: fix the plugin",
                        getattr(self.policy, "name", type(self.policy).__name__), num_bad)
        return loads

    def apply(self, loads: list[_Load], stop: threading.Event | None = None) -> None:
        """Copy each load through the arena's ordered path and count it (either thread)."""
        for load in loads:
            steps = self.arena.load_steps(load.slot, load.layer, load.expert,
                                          chunk_bytes=self.copy_chunk_bytes,
                                          timeout_s=COPY_TIMEOUT_S)
            try:
                for _ in steps:
                    if stop is not None and stop.is_set():
                        break
            except TimeoutError:
                log.error("expert (%d, %d) not loaded into slot %d: a reader held an old table "
                          "version for %.0f s", load.layer, load.expert, load.slot,
                          COPY_TIMEOUT_S)
                continue
            finally:
                steps.close()  # a load left half-way frees its slot
            if stop is not None and stop.is_set():
                return
            self._count_load(load)

    def refill(self, loads) -> None:
        """Load (slot, layer, expert)s into free slots (KV grow's returned ones) through the
        ordered path: by the copier when async, else now."""
        items = [_Load(slot, layer, expert, False) for slot, layer, expert in loads]
        if items and self._copier is not None:
            self._copier.submit(items)
        elif items:
            self.apply(items)

    def _count_load(self, load: _Load) -> None:
        """Add a landed load to the totals (either thread)."""
        with self._lock:
            t = self.totals
            t.num_bytes_moved += self.store.layer_expert_nbytes(load.layer)
            if load.is_eviction:
                t.num_evictions += 1
            else:
                t.num_fills += 1

    # ---- what observers read ------------------------------------------------------------
    def snapshot_totals(self) -> TierTotals:
        with self._lock:
            return self.totals.copy()

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Wait until the copier has landed every round handed to it (True; at once when
        blocking)."""
        return self._copier is None or self._copier.wait_idle(timeout_s)

    def close(self) -> None:
        """Stop the copier (a copy in progress is dropped, its slot freed), close the trace and
        log the last summary."""
        if self._copier is not None:
            self._copier.stop()
            self._copier = None
        self._fold_routing_pending()  # the last window's routing, for the trace and profile
        if self.trace is not None:
            self.trace.close()
        if self.profile_recorder is not None:
            self.profile_recorder.save()
        if self.arena is not None and self.totals.num_windows > self._logged.num_windows:
            self.log_group()
        if self.arena is not None:
            self.arena.close()
