"""The tier's part of a CUDA window: routing counts per (layer, expert) gathered on the device
after the pair grouping, the where table (VRAM / PCIe / CPU pool) that takes CPU-assigned experts
out of the grouped products, the hand-off of those experts' rows to the CPU pool, and free
admission: misses read over PCIe kept in slots the host offered (offload.cu).
"""
from __future__ import annotations

import logging
import os

import numpy as np

from strata.backends.cuda.share import (DECODE_EXPERT_ROWS, NO_BUDGET, POOL_EXPERT_ROWS,
                                        POOL_MAX_ROWS, PROMPT_POOL_ROWS)
from strata.errors import ConfigError

log = logging.getLogger("strata.tier")

WHERE_VRAM, WHERE_PCIE, WHERE_CPU = 0, 1, 2  # as backends/cuda/exchange.py
# A streamed window's rare expert that the pool does not take and that has more than
# PULL_MIN_ROWS rows is copied into its staging slot by pull_rare once the layer's routing is
# known (one read, 16-byte words, PULL_CHUNKS blocks an expert); the others are read over PCIe
# by the grouped products, once per 32-row tile. 0 (session 83; 32, one row tile, before): every
# one is pulled, since the products' reads of an expert's tile wait on the link a load at a
# time where pull_rare keeps it busy: pp512 with no cache on H100 hosts, skew-0 synth ahead in
# 8 of 8 alternating rounds (median 4,935 against 4,848), skew-1 even (5,692 against 5,671;
# docs/offload.md, "Session 83"). STRATA_PULL_ROWS=N sets it (pull_min_rows).
PULL_MIN_ROWS = 0
PULL_CHUNKS = 16

# Read-ahead (enable_read_ahead; offload.cu's read_ahead): experts staged per layer and window,
# at most READ_AHEAD_MAX; a score's decay per window (0.5: the last token's experts outrank
# every older one, and of those the ones the tokens before chose too); blocks per expert.
READ_AHEAD_EXPERTS = 1
READ_AHEAD_MAX = 4
READ_AHEAD_DECAY = 0.5
READ_AHEAD_CHUNKS = 32  # H200, tg64 at share 0.3: 78.1 / 79.3 tokens/s against 73.6 / 75.9 at 16


def pull_min_rows(env=None) -> int:
    """STRATA_PULL_ROWS: the rows past which pull_rare copies a streamed window's rare expert
    into staging instead of the products reading it over PCIe (default PULL_MIN_ROWS)."""
    env = os.environ if env is None else env
    text = env.get("STRATA_PULL_ROWS", "").strip()
    if not text:
        return PULL_MIN_ROWS
    if not text.isdigit():
        raise ConfigError(f"STRATA_PULL_ROWS={text!r}: give a whole number of rows >= 0 (0: "
                          "every rare expert the GPU reads is pulled into staging; e.g. 32: "
                          "only those of more than one row tile)")
    return int(text)


class DeviceTier:
    """Device buffers of the tier: counts int32 [L, E] (rows routed per expert in the last
    window), where uint8 [L, E], the window's seq int64 and, with a CPU pool, the mapped
    exchange buffer (layout: exchange.py)."""

    def __init__(self, model):
        rt, spec = model.runtime, model.spec
        self.model, self._rt = model, rt
        self.num_layers, self.num_experts = L, E = spec.n_layers, spec.n_experts
        self._counts = rt.alloc(4 * L * E)
        self.counts_host = rt.pinned((L, E), np.int32)
        self._where = rt.alloc(L * E)
        self.where_host = rt.pinned((L, E), np.uint8)
        self.where_host[:] = WHERE_PCIE
        rt.drv.memcpy_htod(self._where, self.where_host)
        self._win = rt.alloc(L * E)  # [L, E] uint8: the window's own where (count_groups)
        # a decode window's pool share (set_where): the device gives the pool this share of each
        # layer's routed misses (offload.cu's count_groups); < 0: off
        self._frac = rt.alloc(4)
        self.frac_host = rt.pinned((1,), np.float32)
        self.frac_host[0] = -1.0
        rt.drv.memcpy_htod(self._frac, self.frac_host)
        self._budget = rt.alloc(4 * L)  # [L] int32: the pool's time a layer (share.py's units)
        self.budget_host = rt.pinned((L,), np.int32)
        self.budget_host[:] = NO_BUDGET
        rt.drv.memcpy_htod(self._budget, self.budget_host)
        self._seq = rt.alloc(8)
        self.seq_host = rt.pinned((1,), np.int64)
        self.seq_host[0] = 0
        self._arrived = rt.alloc(4 * L)
        rt.drv.memset_d32(self._arrived, 0, L)
        # pull_rare (enable_pulls): a streamed layer's staging set [L] uint64 (0: none), set by
        # the streamer around its windows, and the experts pulled [L] int32
        self._pull_base = rt.alloc(8 * L)
        rt.drv.memset_d32(self._pull_base, 0, 2 * L)
        self._pulled = rt.alloc(4 * L)
        rt.drv.memset_d32(self._pulled, 0, L)
        self.pulled_host = rt.pinned((L,), np.int32)
        self.pulled_host[:] = 0  # pinned memory comes uninitialised
        self._pull_args = None  # (host device base, slot bytes, part offsets on the device, [L])
        self._guess = None  # enable_pulls with guess_min_rows(): GuessedCopies (guess.py)
        self._guess_window = False  # is the running window's host serving guesses (start_guesses)
        self.pool = None
        self._pool_window = False  # did the running window hand rows to the pool (before_run)
        self._pools_rows: dict[int, bool] = {}  # rows -> pools(rows), until the pool changes
        self.exchange = None
        self._exchange_device = 0
        self._ahead = None  # enable_read_ahead: decode windows stage likely experts (ReadAhead)
        # a decode layer's pool budget may end inside an expert: split it by columns between the
        # pool and the GPU (offload.cu's count_groups); STRATA_SPLIT_EXPERT=0 keeps whole
        # experts (to measure one against the other in one build)
        self.splits_experts = os.environ.get("STRATA_SPLIT_EXPERT", "1") != "0"
        self.admission_on = False  # enable_admission: decode windows keep their PCIe misses
        self._offered = 0  # candidates offered for the next window (offer)
        self._kept_run = False  # did the running window take the offer (before_run)
        self.kept = None  # after it: (candidates [n, 3], log [n]) for the arena (take_kept)

    # ---- pointers the plan's launches take ----------------------------------------------
    def counts_ptr(self, layer: int) -> int:
        return int(self._counts) + 4 * layer * self.num_experts

    def where_ptr(self, layer: int) -> int:
        return int(self._where) + layer * self.num_experts

    def win_ptr(self, layer: int) -> int:
        return int(self._win) + layer * self.num_experts

    @property
    def has_pool(self) -> bool:
        return self.pool is not None

    def exchange_ptr(self, field: str) -> int:
        return self._exchange_device + self.exchange.layout.offsets[field]

    # ---- the where table ----------------------------------------------------------------
    def set_where(self, where: np.ndarray, budget: np.ndarray | None = None,
                  pool_frac: float = -1.0) -> None:
        """Upload `where` [L, E] uint8 and the pool's budget per layer in a window, `budget`
        [L] (share.prompt_pool_budget; None: no limit) for the next window (between windows;
        the compute stream is idle, so the pinned copies may change again after the window).
        A prompt window's pool also takes only experts of at most PROMPT_POOL_ROWS rows.
        pool_frac >= 0 (decode windows): the pool takes that share of the cost of each layer's
        routed CPU-assigned experts (the device decides once it sees the routing), the GPU
        reads the rest over PCIe."""
        where = np.asarray(where, dtype=np.uint8)
        if where.shape != self.where_host.shape:
            raise ValueError(f"where must be [L, E] = {self.where_host.shape}, got {where.shape}")
        cap = np.full(self.num_layers, NO_BUDGET, dtype=np.int32)
        if budget is not None:
            cap[:] = np.clip(budget, 0, NO_BUDGET)
        drv, stream = self._rt.drv, self._rt.stream
        if not np.array_equal(cap, self.budget_host):
            self.budget_host[:] = cap
            drv.memcpy_htod_async(self._budget, self.budget_host, stream)
        if not np.array_equal(where, self.where_host):
            self.where_host[:] = where
            drv.memcpy_htod_async(self._where, self.where_host, stream)
        frac = np.float32(pool_frac if pool_frac >= 0.0 else -1.0)
        if self.frac_host[0] != frac:
            self.frac_host[0] = frac
            drv.memcpy_htod_async(self._frac, self.frac_host, stream)

    # ---- pulls of heavily routed rare experts (offload.cu's pull_rare) ----------------------
    def enable_pulls(self, host_device_base: int, slot_bytes: int, part_offsets: np.ndarray,
                     image_bytes: np.ndarray) -> None:
        """Let streamed prompt windows with a pool copy a rare expert the pool does not take
        and that has more than PULL_MIN_ROWS rows into its staging slot once the routing is
        known (one read over the link instead of one per row tile). part_offsets [L, 3] and
        image_bytes [L]: the slot image layout, the same in the host copies [host_device_base
        + (layer * E + e) * slot_bytes] and the staging slots. The plans are rebuilt."""
        part_off = self._rt.upload(np.ascontiguousarray(part_offsets, dtype=np.uint64))
        self._pull_args = (int(host_device_base), int(slot_bytes), part_off,
                           np.asarray(image_bytes, dtype=np.uint64).copy())
        self._enable_guesses(host_device_base, slot_bytes, part_off, image_bytes)
        self.model.drop_plans()

    def _enable_guesses(self, host_device_base, slot_bytes, part_off, image_bytes) -> None:
        """Guessed copies (guess.py) beside the pulls, unless STRATA_GUESS_ROWS=0, the layer is
        too wide for predict_topk or the driver lacks cuStreamWriteValue32."""
        from strata._native import cuda_driver
        from strata.backends.cuda.guess import GUESS_MAX_EXPERTS, GuessedCopies, guess_min_rows

        min_rows = guess_min_rows()
        if min_rows == 0 or self.num_experts > GUESS_MAX_EXPERTS:
            return
        if not cuda_driver.has_stream_write_value():
            log.info("guessed copies off: the driver has no cuStreamWriteValue32")
            return
        arena = getattr(self.model, "expert_arena", None)
        host_base = arena.host.host_base if arena is not None else 0
        if not host_base:
            return
        self._guess = GuessedCopies(self._rt, self.num_layers, self.num_experts, min_rows,
                                    host_base, slot_bytes, image_bytes, part_off)
        self._guess.set_layers(self.model)

    def guesses(self, num_rows: int) -> bool:
        """Does a window of `num_rows` rows guess its routing a layer early (guess.py)? The
        streamed prompt windows that pull_rare serves (with a pool), once enabled."""
        return (self._guess is not None and num_rows > POOL_MAX_ROWS and self.pools(num_rows)
                and len(self._guess.layers) > 0 and self.model.is_first and self.model.is_last)

    def add_guess(self, plan, layer: int) -> None:
        """After the attention of layer - 1: layer's routing guessed and published (guess.py),
        when the layer is one whose routing is guessed."""
        if self._guess.guesses_layer(layer):
            arena = getattr(self.model, "expert_arena", None)
            streamer = getattr(arena, "streamer", None)
            pooled = (int(self._budget) + 4 * layer  # the pool's experts are not guessed
                      if streamer is not None
                      and (streamer.sure_percent or streamer.sure_auto is not None) else 0)
            self._guess.add_guess(plan, self.model, layer, int(self._pull_base),
                                  self.where_ptr(layer), pooled, PROMPT_POOL_ROWS,
                                  POOL_EXPERT_ROWS)

    def start_guesses(self, num_rows: int) -> None:
        """Before the plan (model._run): this window's guesses are served by its host."""
        self._guess_window = self.guesses(num_rows)
        if self._guess_window:
            self._guess.before_run(self._rt.stream)

    def issue_guesses(self) -> None:
        """The window queued (model._run): wait for the guessed copies' worker to finish its
        pass, then the host's where and no seq again behind the window."""
        if not self._guess_window or self._guess._issued:
            return
        try:
            self._guess.wait()
        finally:
            drv, stream = self._rt.drv, self._rt.stream
            drv.memcpy_htod_async(self._where, self.where_host, stream)
            self._guess.after_run(stream)

    @property
    def guess_stage_bases(self):
        """[L] uint64 pinned: the streamed layers' staging sets the guessed copies write into
        (the streamer fills it beside pull_rare's), or None without guesses."""
        return None if self._guess is None else self._guess.stage_bases

    def guess_totals(self) -> tuple[int, int, int, int, int]:
        """(windows, experts listed, of them routed, of them pointed at, bytes copied) since
        start-up, up to the last finished window."""
        g = self._guess
        if g is None:
            return (0, 0, 0, 0, 0)
        return (g.num_windows, g.num_listed, g.num_routed, g.num_pointed, g.copied_bytes)

    @property
    def pull_base_ptr(self) -> int:
        return int(self._pull_base)

    @property
    def pulled_ptr(self) -> int:
        return int(self._pulled)

    # ---- read-ahead (offload.cu's read_ahead) ----------------------------------------------
    def enable_read_ahead(self, host_device_base: int, slot_bytes: int, part_offsets: np.ndarray,
                          image_bytes: np.ndarray, per_layer: int = READ_AHEAD_EXPERTS,
                          decay: float = READ_AHEAD_DECAY) -> None:
        """Let decode windows with a CPU pool copy each layer's `per_layer` likeliest experts
        (decayed routed rows) into a VRAM ring while the layer's dense part runs, on a side
        stream; the layer's split then leaves the staged ones that are routed to the GPU. Only
        for a cache with no slots: every table entry's own value is then its host copy
        [host_device_base + (layer * E + e) * slot_bytes], which ahead_point restores. The
        plans are rebuilt."""
        if not 1 <= per_layer <= READ_AHEAD_MAX:
            raise ValueError(f"read-ahead of {per_layer} experts a layer; 1..{READ_AHEAD_MAX}")
        self._ahead = ReadAhead(self._rt, self.num_layers, self.num_experts, int(host_device_base),
                                int(slot_bytes), part_offsets, image_bytes, per_layer, decay)
        self.model.drop_plans()

    def reads_ahead(self, num_rows: int) -> bool:
        """Does a window of `num_rows` rows read ahead? Decode windows that hand rows to the
        pool, once enabled."""
        return self._ahead is not None and num_rows <= POOL_MAX_ROWS and self.pools(num_rows)

    def add_read_ahead(self, plan, layer: int) -> None:
        """The layer's read-ahead on the side stream, behind the launches before it (plan: at
        the window's start for layer 0, after the previous layer's expert products)."""
        self._ahead.add(plan, layer, self.model.expert_tables_ptr)

    def read_ahead_totals(self) -> tuple[int, int, int]:
        """(experts staged, of them routed, their routed entries) since start-up, up to the
        last finished window."""
        return (0, 0, 0) if self._ahead is None else self._ahead.totals()

    # ---- free admission -----------------------------------------------------------------
    def enable_admission(self, part_offsets: np.ndarray, host_base: int, host_end: int,
                         slot_base: int, slot_bytes: int, per_layer: int) -> int:
        """Let decode windows keep up to `per_layer` of each layer's misses read over PCIe in
        slots offered before the window (offer; offload.cu's keep_misses, the mv_* kernels
        writing what they stage). part_offsets [L, 3] uint64: the slot image layout, the same
        in VRAM slots and host copies [host_base, host_end). Returns the most candidates a
        window can take (L * per_layer). The plans are rebuilt with the admission launches."""
        rt, L, E = self._rt, self.num_layers, self.num_experts
        C = L * per_layer
        self._atab = rt.alloc(8 * 3 * L * E)  # [L, 3, E] uint64: where a miss is kept, 0 none
        rt.drv.memset_d32(self._atab, 0, 6 * L * E)
        self._part_off = rt.upload(np.ascontiguousarray(part_offsets, dtype=np.uint64))
        self._cands = rt.alloc(4 * 3 * C)  # [C, 3] int32 (slot, victim layer, victim expert)
        self.cands_host = rt.pinned((C, 3), np.int32)
        self._state = rt.alloc(8)  # (offered, next) int32
        rt.drv.memset_d32(self._state, 0, 2)
        self.state_host = rt.pinned((2,), np.int32)
        self._log = rt.alloc(4 * C)  # [C] int32
        self.log_host = rt.pinned((C,), np.int32)
        self._keep_args = (int(host_base), int(host_end), int(slot_base), int(slot_bytes))
        self.admit_per_layer, self.admit_capacity = int(per_layer), C
        self.admission_on = True
        self.model.drop_plans()
        return C

    def disable_admission(self) -> None:
        if self.admission_on:
            self.admission_on = False
            self._offered = 0
            self.model.drop_plans()

    def keep_tables(self, layer: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """((gate, up), (down, 0)): the layer's admission tables [E] uint64 the expert
        products read (an expert whose entry is not 0 is written there as it is read)."""
        row = 8 * self.num_experts
        at = int(self._atab) + 3 * layer * row
        return (at, at + row), (at + 2 * row, 0)

    def offer(self, candidates: np.ndarray) -> None:
        """Candidates [n, 3] int32 (slot, layer, expert of the resident victim) for the next
        window, best to give up first; n <= admit_capacity. Taken by before_run when that
        window keeps misses (plan.keeps_misses), else dropped."""
        n = len(candidates)
        if n > self.admit_capacity:
            raise ValueError(f"{n} candidates offered, the window takes at most "
                             f"{self.admit_capacity}")
        self.cands_host[:n] = candidates
        self._offered = n

    # ---- the CPU pool -------------------------------------------------------------------
    def attach_pool(self, pool, exchange, exchange_device_ptr: int) -> None:
        """Hand CPU-assigned experts to `pool` (submit(seq, num_rows) / wait()) through
        `exchange` (mapped at `exchange_device_ptr`); the plans are rebuilt with the hand-off."""
        if exchange.layout.num_layers != self.num_layers:
            raise ConfigError(f"the exchange buffer is laid out for {exchange.layout.num_layers} "
                              f"layers, the model has {self.num_layers}")
        self.pool, self.exchange = pool, exchange
        self._exchange_device = int(exchange_device_ptr)
        exchange.reset()
        self._pools_rows.clear()
        self.model.drop_plans()

    def detach_pool(self) -> None:
        """Back to no pool (every miss read over PCIe); the plans are rebuilt without it."""
        if self.pool is not None:
            self.pool = self.exchange = None
            self._exchange_device = 0
            self._pools_rows.clear()
            self.model.drop_plans()

    def pools(self, num_rows: int) -> bool:
        """Does a window of `num_rows` rows hand rows to the CPU pool? With a pool: decode
        windows (up to share.POOL_MAX_ROWS rows; window_share) and streamed prompt windows whose
        rarely routed experts the pool computes (the arena's `pools_rows`). Any other window has
        no CPU-assigned expert, so its plan has no hand-off at all: no publish, no wait for the
        pool, the fused combine + norm. Decided once per row count (the plans are cached by it,
        and before_run must agree with the plan), again after attach / detach."""
        if self.pool is None:
            return False
        decided = self._pools_rows.get(num_rows)
        if decided is None:
            arena = getattr(self.model, "expert_arena", None)
            decided = num_rows <= POOL_MAX_ROWS or bool(
                arena is not None and num_rows <= self.exchange.layout.max_rows
                and arena.pools_rows(num_rows))
            self._pools_rows[num_rows] = decided
        return decided

    def add_after_grouping(self, plan, layer: int) -> None:
        """Launches after group_pairs: the layer's counts (and the pool's groups out, the
        window's own where), rows to the pool. A decode window's pool takes every expert the
        where table gives it; a prompt window's only those of at most PROMPT_POOL_ROWS rows, within
        the layer's budget (the rest are read over PCIe: offload.cu's count_groups)."""
        from strata.backends.cuda.plan import expert_split_step

        ws, R, E = plan._ws, plan.num_rows, self.num_experts
        spec = self.model.spec
        pooled = self.pools(R)
        is_decode = R <= POOL_MAX_ROWS
        rows_cap = R if is_decode else PROMPT_POOL_ROWS
        grouping = [ws.ptr("groups"), ws.ptr("num_groups"), E, self.counts_ptr(layer),
                    self.where_ptr(layer) if pooled else 0, self.win_ptr(layer), rows_cap,
                    DECODE_EXPERT_ROWS if is_decode else POOL_EXPERT_ROWS,
                    int(self._budget) + 4 * layer, int(self._frac)]
        # a decode window splits the expert its pool budget ends in by columns (count_groups)
        split = [expert_split_step(self.model, self.model.layers[layer])
                 if pooled and is_decode and self.splits_experts else 0, spec.expert_ffn]
        # a streamed prompt window's guessed experts: claimed for the GPU here, waited for
        # after pool_publish (the pool starts on the layer while the guessed copies land)
        guessed = (pooled and R > POOL_MAX_ROWS and self.guesses(R)
                   and self._guess.guesses_layer(layer))
        if guessed:
            self._guess.add_claim(plan, layer, int(self._pull_base), self.where_ptr(layer))
        if pooled and self.reads_ahead(R):  # the layer's staged experts landed first
            plan.launches.append(self._ahead.join(plan, layer))
            plan._add("tier_groups_ahead", (1,), (256,), "PPiPPPiiPPPiPfPii",
                      [*grouping, *self._ahead.count_args(layer), *split])
        elif plan.keeps_misses:  # and the misses this layer keeps (free admission)
            plan._add("tier_groups_keep", (1,), (256,), "PPiPPPiiPPPPPPPPiiPPPP",
                      [*grouping, self.model.expert_tables_ptr, int(self._atab),
                       int(self._part_off), int(self._cands), int(self._state), int(self._log),
                       layer, self.admit_per_layer, *self._keep_args])
        else:
            plan._add("tier_groups", (1,), (256,), "PPiPPPiiPPii", [*grouping, *split])
        if not pooled:
            return
        if R > self.exchange.layout.max_rows:
            raise ConfigError(f"a window of {R} rows exceeds the CPU pool's exchange buffer of "
                              f"{self.exchange.layout.max_rows} rows")
        H, K = spec.hidden, spec.n_experts_used
        at = len(plan.launches)
        plan._add("pool_publish", ((R * H + 255) // 256,), (256,), "PPPiiiPiiPPPPPPPP",
                  [ws.ptr("hf"), ws.ptr("ids"), ws.ptr("wts"), R, K, H, self.win_ptr(layer), E,
                   layer, int(self._seq), self.exchange_ptr("x"), self.exchange_ptr("ids"),
                   self.exchange_ptr("wts"), self.exchange_ptr("ready"), int(self._arrived),
                   ws.ptr("num_groups") + 4, self.exchange_ptr("split")])
        plan.mark_span("publish", layer, at)
        if guessed:  # the guessed copies landed, the tables at them
            at = len(plan.launches)
            self._guess.add_point(plan, layer, int(self._pull_base),
                                  self.model.expert_tables_ptr)
            plan.mark_span("guess", layer, at)
        if R > POOL_MAX_ROWS and self._pull_args is not None:  # a streamed prompt window
            host_base, slot_bytes, part_off, image = self._pull_args
            at = len(plan.launches)
            plan._add("pull_rare", (PULL_CHUNKS, E), (256,), "PPPiiiPPPPPPP",
                      [self.counts_ptr(layer), self.where_ptr(layer), self.win_ptr(layer), E,
                       layer, pull_min_rows(), int(self._pull_base), host_base, slot_bytes,
                       int(image[layer]), int(part_off), self.model.expert_tables_ptr,
                       int(self._pulled)])
            plan.mark_span("pulls", layer, at)

    def add_combine(self, plan, layer: int, shared: tuple[int, int]) -> None:
        """The pool's wait and the combine that leaves CPU pairs out and adds the pool's y."""
        ws, R, E = plan._ws, plan.num_rows, self.num_experts
        spec = self.model.spec
        H, K = spec.hidden, spec.n_experts_used
        plan._add("pool_wait", (1,), (1,), "PPiiPP",
                  [self.exchange_ptr("done"), self.win_ptr(layer), E, layer, int(self._seq),
                   self.exchange_ptr("status")])
        plan._add("moe_combine_pool", ((R * H + 255) // 256,), (256,), "PPPPiiiPPPiP",
                  [ws.ptr("x"), ws.ptr("ybuf"), ws.ptr("wts"), ws.ptr("ids"), R, K, H, *shared,
                   self.win_ptr(layer), E, self.exchange_ptr("y")])

    # ---- per window ---------------------------------------------------------------------
    def before_run(self, num_rows: int) -> None:
        """Compute stream, before the plan: the offered candidates when the window keeps its
        misses; the window's seq and the pool started on it when it hands rows to the pool."""
        from strata.backends.cuda.plan import keeps_misses

        drv, stream = self._rt.drv, self._rt.stream
        self._kept_run = bool(self._offered and keeps_misses(self.model, num_rows))
        if self._kept_run:
            n = self._offered
            self.state_host[:] = (n, 0)
            self.log_host[:n] = -1
            drv.memcpy_htod_async(self._cands, self.cands_host[:n], stream)
            drv.memcpy_htod_async(self._log, self.log_host[:n], stream)
            drv.memcpy_htod_async(self._state, self.state_host, stream)
        self._offered = 0
        self._pool_window = self.pools(num_rows)
        if not self._pool_window:
            return
        self.seq_host[0] += 1
        drv.memcpy_htod_async(self._seq, self.seq_host, stream)
        self.pool.submit(int(self.seq_host[0]), num_rows)

    def after_run(self) -> None:
        """Queue the counts' read-back behind the plan (before the window's synchronize), and
        after a window that kept misses its log, then no candidates for the windows after it
        (a split's pipelined groups run plans without before_run)."""
        drv, stream = self._rt.drv, self._rt.stream
        drv.memcpy_dtoh_async(self.counts_host, self._counts, stream)
        if self._ahead is not None and self._pool_window:
            self._ahead.read_back(stream)
        if self._kept_run:
            drv.memcpy_dtoh_async(self.log_host, self._log, stream)
            drv.memset_d32_async(self._state, 0, 2, stream)

    def take_kept(self):
        """(candidates [n, 3], log [n]) of the last window that kept misses (log: layer * E +
        expert kept in the candidate's slot, -2 skipped, -1 not reached), once; else None.
        A window that kept misses but never reached finish (it failed) is waited for and its
        log read here: the device tables already show what its kernels did."""
        if self._kept_run:
            rt = self._rt
            rt.synchronize()
            rt.drv.memcpy_dtoh(self.log_host, self._log)
            rt.drv.memset_d32(self._state, 0, 2)
            self._collect_kept()
        kept, self.kept = self.kept, None
        return kept

    def _collect_kept(self) -> None:
        n = int(self.state_host[0])
        self.kept = (self.cands_host[:n].copy(), self.log_host[:n].copy())
        self._kept_run = False

    def finish(self, routing_counts: np.ndarray | None) -> None:
        """After the synchronize: add the counts, keep the admission log for the arena, wait
        for the pool, raise on a failed hand-off."""
        if routing_counts is not None:
            routing_counts += self.counts_host
        if self._guess_window:
            self._guess_window = False
            self._guess.finish(self.counts_host)
        if self._kept_run:
            self._collect_kept()
        if not self._pool_window:
            return
        from strata.backends.cuda.cpu_pool import CpuPoolError

        try:
            self.pool.wait()  # raises CpuPoolError when the pool failed
        finally:
            failed = self.exchange.device_error()
            what = ("reported a failure" if int(self.exchange.status[2]) == 2
                    else "did not answer within 10 s")
            if failed is not None:
                self.exchange.reset()  # the next window's waits start clean
        if failed is not None:
            layer, seq = failed
            raise CpuPoolError(
                f"the CPU pool {what} on layer {layer} of window {seq}; this window's results "
                "are invalid. Check the log for the pool's error, or run with --pcie-frac 1 "
                "(no CPU pool)")


class ReadAhead:
    """Device state of the decode read-ahead (offload.cu's read_ahead / ahead_point): a ring of
    two sets of S staging slots used in turn, turn [1] int32, staged [L, S] int32 (the experts
    each layer's read_ahead picked, -1 none), sets [2, 1 + S] int32 (per set the layer whose
    tables point at it and its experts), score [L, E] float32, stats [3] uint64 (experts
    staged, of them routed, their routed entries), and the side stream the copies run on."""

    def __init__(self, rt, L: int, E: int, host_device_base: int, slot_bytes: int,
                 part_offsets: np.ndarray, image_bytes: np.ndarray, per_layer: int, decay: float):
        drv = rt.drv
        self._rt, self.L, self.E, self.S = rt, L, E, per_layer
        self.host_base, self.slot_bytes, self.decay = host_device_base, slot_bytes, decay
        self.image_bytes = np.asarray(image_bytes, dtype=np.uint64).copy()
        self._part_off = rt.upload(np.ascontiguousarray(part_offsets, dtype=np.uint64))
        self._ring = rt.alloc(2 * per_layer * slot_bytes)
        self._turn = rt.upload(np.zeros(1, dtype=np.int32))
        self._staged = rt.upload(np.full((L, per_layer), -1, dtype=np.int32))
        self._sets = rt.upload(np.full((2, 1 + per_layer), -1, dtype=np.int32))
        self._score = rt.upload(np.zeros((L, E), dtype=np.float32))
        self._stats = rt.upload(np.zeros(3, dtype=np.uint64))
        self.stats_host = rt.pinned((3,), np.uint64)
        self.stats_host[:] = 0
        self.stream = drv.Stream()
        self.stream_handle = int(self.stream.handle)

    def add(self, plan, layer: int, tables_ptr: int) -> None:
        """Fork: the side stream waits for the plan's launches so far, copies the layer's
        experts, points its tables at them and records the join event."""
        from strata._native import cuda_driver

        events = plan.ahead_events.setdefault(layer, (cuda_driver.Event(), cuda_driver.Event()))
        side, rt = self.stream_handle, self._rt
        plan.launches.append(cuda_driver.record_event(events[0]))
        plan.launches.append(cuda_driver.wait_event(events[0], side))
        plan.launches.append(rt.kernel("read_ahead").prepare(
            (READ_AHEAD_CHUNKS, self.S), (256,), "PiiiPPPqqq",
            [int(self._score) + 4 * layer * self.E, self.E, layer, self.S, int(self._staged),
             int(self._turn), int(self._ring), self.host_base, self.slot_bytes,
             int(self.image_bytes[layer])], programmatic=False, stream=side))
        plan.launches.append(rt.kernel("ahead_point").prepare(
            (1,), (1,), "iiiPPPPqqPP",
            [self.E, layer, self.S, int(self._staged), int(self._sets), int(self._turn),
             int(self._ring), self.host_base, self.slot_bytes, int(self._part_off), tables_ptr],
            programmatic=False, stream=side))
        plan.launches.append(cuda_driver.record_event(events[1], side))

    def join(self, plan, layer: int):
        """The plan's stream waits for the layer's read-ahead (before its tier_groups_ahead)."""
        from strata._native import cuda_driver

        return cuda_driver.wait_event(plan.ahead_events[layer][1])

    def count_args(self, layer: int) -> list:
        return [int(self._staged) + 4 * layer * self.S, self.S,
                int(self._score) + 4 * layer * self.E, self.decay, int(self._stats)]

    def read_back(self, stream) -> None:
        self._rt.drv.memcpy_dtoh_async(self.stats_host, self._stats, stream)

    def totals(self) -> tuple[int, int, int]:
        return tuple(int(v) for v in self.stats_host)
