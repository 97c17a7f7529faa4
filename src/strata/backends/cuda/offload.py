"""The offload tiers of the CUDA backend (docs/offload.md): every routed expert in pinned,
device-mapped host RAM; a VRAM expert cache whose device pointer tables the grouped products read
(resident experts from their slot, the rest over PCIe); swaps on a side stream, ordered by events.
"""
from __future__ import annotations

import logging
import os

import numpy as np

from strata.backends.cuda.host_memory import PinnedBuffer
from strata.engine.recurrent import RecurrentState
from strata.errors import ConfigError
from strata.experts.arena import COPY_CHUNK_BYTES, ExpertArena, num_slots_for
from strata.experts.pack import PARTS, expert_tensor_name
from strata.experts.store import ExpertStore

log = logging.getLogger("strata.tier")


def count_setting(name: str, default: int, unit: str, most: int | None = None,
                  env=None) -> int:
    """A whole number >= 0 from environment variable `name` (empty: `default`; 0 turns the
    feature off), `unit` naming what it counts in the error for anything else."""
    env = os.environ if env is None else env
    text = env.get(name, "").strip()
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"{name}={text!r} is not a whole number of {unit} (0 turns it "
                          "off)") from None
    if value < 0 or (most is not None and value > most):
        upto = "or more" if most is None else f"to {most}"
        raise ConfigError(f"{name}={value}: give 0 (off) {upto} {unit}")
    return value


def read_ahead_experts(env=None) -> int:
    """Experts per layer a decode window with every expert in RAM stages ahead of its routing
    (device_tier.ReadAhead): STRATA_READ_AHEAD, default READ_AHEAD_EXPERTS, 0 off."""
    from strata.backends.cuda.device_tier import READ_AHEAD_EXPERTS, READ_AHEAD_MAX

    return count_setting("STRATA_READ_AHEAD", READ_AHEAD_EXPERTS, "experts per layer",
                         READ_AHEAD_MAX, env)


PART_ALIGN_BYTES = 256      # gate, up and down each start on 256 bytes inside a slot
# Free admission (keep_misses): a decode window keeps up to this many of each layer's misses
# read over PCIe, in slots of the lowest-ranked resident experts offered before it
KEEP_PER_LAYER = 2
VRAM_RESERVE_BYTES = 1 << 30  # `auto` leaves this free for the driver, graphs and growth


def slot_layout(store: ExpertStore) -> tuple[np.ndarray, int]:
    """(part offsets [L, 3] uint64 of gate, up, down inside a slot, slot bytes): parts aligned
    to PART_ALIGN_BYTES, one slot size for every layer (the largest)."""
    offsets = np.zeros((store.n_layers, 3), dtype=np.uint64)
    slot_bytes = PART_ALIGN_BYTES
    for layer, layout in enumerate(store.layouts):
        at = 0
        for part, p in enumerate(layout.parts):
            offsets[layer, part] = at
            at += -(-p.nbytes // PART_ALIGN_BYTES) * PART_ALIGN_BYTES
        slot_bytes = max(slot_bytes, at)
    return offsets, slot_bytes


class HostExperts:
    """Every (layer, expert) of `store` in one pinned host buffer [L * E, slot_bytes] mapped into
    the device's address space: the GPU reads a missing expert from here over PCIe, copies a
    swapped-in one from here into its slot, and the CPU pool computes from here."""

    def __init__(self, runtime, store: ExpertStore, part_offsets: np.ndarray, slot_bytes: int,
                 progress: bool | None = None):
        drv = runtime.drv
        L, E = store.n_layers, store.n_experts
        self.store, self.slot_bytes, self.part_offsets = store, slot_bytes, part_offsets
        self.nbytes = L * E * slot_bytes
        try:
            pinned = PinnedBuffer(drv, (L * E, slot_bytes), progress_name="experts in RAM")
        except Exception as exc:  # pycuda's MemoryError / LogicError from cuMemHostAlloc
            raise ConfigError(
                f"pinning {self.nbytes / 2**30:.2f} GiB of host RAM for the experts "
                f"({L} layers x {E} experts x {slot_bytes} bytes) was refused ({exc}); free RAM, "
                "raise the locked-memory limit (ulimit -l / the container's memlock), or run "
                "with --device cpu") from None
        self.pinned, self.buffer = pinned, pinned.array
        self.host_base = int(self.buffer.ctypes.data)
        self.device_base = pinned.device
        self._fill(progress)
        huge = pinned.huge_page_bytes() if pinned.pages == "huge" else 0
        log.info("experts in RAM: %.2f GiB pinned, %s", self.nbytes / 2**30,
                 "in 4 KiB pages" if pinned.pages == "small" else
                 "huge pages asked for" if huge is None else
                 f"{huge / 2**30:.2f} GiB of it in huge pages")

    def _fill(self, progress: bool | None) -> None:
        from tqdm import tqdm

        store, L, E = self.store, self.store.n_layers, self.store.n_experts
        rows = self.buffer.reshape(L, E, self.slot_bytes)  # [L, E, slot_bytes]
        with tqdm(total=self.nbytes, unit="B", unit_scale=True, desc="experts -> pinned RAM",
                  disable=None if progress is None else not progress, leave=False) as bar:
            for layer in range(L):
                for part, p in enumerate(store.layouts[layer].parts):
                    at = int(self.part_offsets[layer, part])
                    if store.pack is None:  # one strided copy of the layer's [E, ...] tensor
                        raw = store.model.tensor(expert_tensor_name(layer, PARTS[part])).raw
                        rows[layer, :, at:at + p.nbytes] = raw.reshape(E, -1)
                    else:
                        for e in range(E):
                            rows[layer, e, at:at + p.nbytes] = store.expert(
                                layer, e)[part].reshape(-1)
                bar.update(E * self.slot_bytes)

    def index(self, layer: int, expert: int) -> int:
        return layer * self.store.n_experts + expert

    def pointers(self, device: bool = True) -> np.ndarray:
        """[L, 3, E] uint64: each expert's gate, up and down blocks (device or host address)."""
        L, E = self.store.n_layers, self.store.n_experts
        base = np.uint64(self.device_base if device else self.host_base)
        starts = base + np.arange(L * E, dtype=np.uint64).reshape(L, 1, E) * np.uint64(
            self.slot_bytes)  # [L, 1, E]
        return starts + self.part_offsets[:, :, None]

    def expert_bytes(self, layer: int, expert: int) -> np.ndarray:
        """The expert's slot image (pinned): what a VRAM slot receives."""
        return self.buffer[self.index(layer, expert)]


def work_buffer_bytes(spec, num_rows: int, num_logit_rows: int | None = None) -> int:
    """About the bytes of plan.Workspace for windows of `num_rows` rows, `num_logit_rows` of
    them with logits (default all; its largest buffers: per row the residual, normed rows,
    q/k/v and router; per pair the expert buffers; per logit row the logits)."""
    recurrent = bool(spec.recurrent_layers)
    wide = max(spec.hidden, spec.q_dim, spec.ssm_inner if recurrent else 0)
    per_row = 4 * (3 * spec.hidden + 3 * wide + spec.q_dim + 2 * spec.kv_dim + spec.n_experts
                   + 2 * max(spec.shared_ffn, 1))
    if spec.has_attn_gate:  # q and gate projected together, then apart
        per_row += 4 * 3 * spec.q_dim
    if recurrent:  # a delta-net layer's q|k|v before and after the conv, z, beta|alpha, out
        per_row += 4 * (2 * spec.ssm_channels + 2 * spec.ssm_inner + 2 * spec.ssm_heads)
    per_pair = 16 + 5 * spec.expert_ffn + 4 * spec.hidden
    num_logit_rows = num_rows if num_logit_rows is None else min(num_logit_rows, num_rows)
    return num_rows * (per_row + spec.n_experts_used * per_pair) + num_logit_rows * 4 * spec.vocab


def auto_budget_bytes(model, config) -> int:
    """VRAM the cache may take for `--expert-cache auto`: what is free now (dense weights
    loaded) less the KV of every slot, the work buffers and a reserve; capped by --vram-budget."""
    spec = model.spec
    free, _ = model.runtime.free_bytes()
    n_ctx = config.resolve_n_ctx(spec.context_length)
    # fp16 K and V of every slot (--kv-grow: the base cells; more are lent by the cache), and
    # a hybrid model's two recurrent state buffers per slot
    kv_cells = config.parallel * config.kv_base_cells(n_ctx)
    kv_bytes = kv_cells * len(spec.attention_layers) * 2 * spec.kv_dim * 2
    if spec.recurrent_layers:
        kv_bytes += config.parallel * 2 * RecurrentState.nbytes_per_state(spec)
    # the largest window: a prompt chunk (--read-chunk auto: the streamed solo chunk) and the
    # other slots' decode rows; logits for the decode rows only
    num_rows = config.max_prompt_window_tokens() + 16 * config.parallel
    work_bytes = work_buffer_bytes(spec, num_rows, min(num_rows, 64 + 16 * config.parallel))
    room = max(0, free - kv_bytes - work_bytes - VRAM_RESERVE_BYTES)
    budget = config.vram_budget_bytes
    return room if budget is None else min(room, int(budget))


def build_vram_arena(model, store: ExpertStore, config) -> "VramExpertArena":
    """The VRAM arena for `--expert-cache auto|N` (sized by --vram-budget and free VRAM)."""
    part_offsets, slot_bytes = slot_layout(store)
    total = store.n_layers * store.n_experts
    room = auto_budget_bytes(model, config)
    n = num_slots_for(config.expert_cache if config.expert_cache is not None else "auto",
                      room, slot_bytes, total)
    host = HostExperts(model.runtime, store, part_offsets, slot_bytes)
    arena = VramExpertArena(model, store, n, host)
    from strata.backends.cuda.share import (DEFAULT_SOURCE, POOL_MAX_ROWS, resolve_pcie_frac,
                                            whole_expert_share)
    from strata.backends.cuda.stream import PROMPT_POOL_MAX_ROWS

    # --pcie-frac, else the stored `strata-tool calibrate` share, else 0.3 (0.6 for experts of
    # a type the pool reads more slowly: share.SLOW_POOL_TYPES), logged
    from strata.backends.cuda.cpu_pool import default_pool_threads

    # the pool's thread count, as `strata-tool calibrate` keys its stored share
    threads = config.threads or default_pool_threads()
    expert_types = {t for layer in range(store.n_layers) for t in store.types(layer)}
    # unset or auto: start from the share below, then move it while serving (share_tuner);
    # --pcie-frac F fixes it. Measured on H200 and H100 hosts (docs/offload.md, sessions 59
    # and 76): one slot +3 to +6% on the H100, four +1 to +8%, no loss beyond the spread
    auto = config.pcie_frac in (None, "auto")
    pcie_frac, source = resolve_pcie_frac(None if auto else config.pcie_frac,
                                          config.model_path, model.runtime.name, threads,
                                          expert_types)
    if pcie_frac < 1:
        # windows that hand rows to the pool (DeviceTier.pools): decode windows of up to
        # POOL_MAX_ROWS rows and streamed prompt windows of up to PROMPT_POOL_MAX_ROWS (their
        # rare experts); an engine window holds one prompt chunk and the decode rows of the
        # other slots (with room for draft tokens)
        arena.attach_pool(pcie_frac, min(max(POOL_MAX_ROWS, PROMPT_POOL_MAX_ROWS),
                                         config.max_prompt_window_tokens()
                                         + 16 * config.parallel), threads=config.threads)
        if source.startswith(DEFAULT_SOURCE):  # unmeasured: one-row windows split whole experts
            arena.one_row_share = whole_expert_share(pcie_frac, model.spec.n_experts_used)
        if auto and config.adapt_every == 0:
            log.info("--pcie-frac auto (the default): the tier is frozen (--adapt-every 0, "
                     "deterministic greedy output), so the share stays %.2f", pcie_frac)
        elif auto:
            from strata.backends.cuda.share_tuner import ShareTuner

            arena.share_tuner = ShareTuner(pcie_frac, model.spec.n_experts_used,
                                           arena.one_row_share)
            log.info("--pcie-frac auto (the default; --pcie-frac F fixes the share): decode "
                     "windows start at share %.2f and move it while serving, toward the split "
                     "where the CPU pool and the GPU take as long as each other (by window "
                     "rows; each move logged)", pcie_frac)
    if arena.pool is not None and arena.streamer.sure_auto is not None \
            and config.adapt_every == 0:
        arena.streamer.sure_auto = None
        log.info("STRATA_POOL_SURE=auto (the default): the tier is frozen (--adapt-every 0, "
                 "deterministic greedy output), so the CPU pool takes none of the experts a "
                 "prompt chunk copies (STRATA_POOL_SURE=P: a fixed share of them), and its "
                 "budget for the rare ones stays at %.2f x the layer's copy time "
                 "(STRATA_POOL_BUDGET=S sets it)", arena.streamer.pool_share_of_copy)
    log.info("VRAM expert cache: %d slots of %d bytes (%.2f GiB; %.2f GiB free for it), %d "
             "experts pinned in RAM (%.2f GiB); misses: %s", n, slot_bytes,
             n * slot_bytes / 2**30, room / 2**30, total, host.nbytes / 2**30,
             "GPU reads over PCIe" if arena.pool is None else
             f"{pcie_frac:.2f} of each decode layer's over PCIe (split on the GPU once it "
             "has the routing), the rest on the CPU pool")
    return arena


class VramExpertArena(ExpertArena):
    """N VRAM slots of one expert each. The device tables (`model.expert_tables`, uint64
    [L, 3, E]) point every expert at its slot when resident, else at its mapped host copy.

    The ordered path on the device (windows are synchronous, so between windows only the side
    stream may be busy): an eviction re-points the evicted expert at its host copy in the table
    upload on the compute stream, and the side stream waits on an event recorded after that
    upload before overwriting the slot; a loaded expert is re-pointed at its slot only after
    the event recorded behind its copy completed, in an upload before the next window.
    """

    reads_host_pointers = False
    misses_on_gpu = True
    # misses cross PCIe: decode windows can keep them as they read them (keep_misses)
    keeps_misses = True

    def __init__(self, model, store: ExpertStore, n_slots: int, host: HostExperts):
        super().__init__(store, n_slots, host.slot_bytes)
        self.model, self.host, self._rt = model, host, model.runtime
        drv = self._rt.drv
        with self._rt.active():
            self._slots = self._rt.alloc(n_slots * self.slot_bytes)
            self.slot_base = int(self._slots)
            self.side_stream = drv.Stream()
            self._mirror = self._rt.pinned((store.n_layers, 3, store.n_experts), np.uint64)
            self._mirror[:] = host.pointers(device=True)  # [L, 3, E]: all misses
            self._publish()
            self._rt.synchronize()
        self.copier = None  # the async tier's StreamCopier (copier.py), made by new_copier
        self.pool = None  # the CPU pool (attach_pool), None: every miss read over PCIe
        self.pcie_frac = 1.0
        # one-row decode windows' share when it is not pcie_frac (share.whole_expert_share)
        self.one_row_share: float | None = None
        # --pcie-frac auto (share_tuner.py): the share of each decode window class, measured
        # while serving; _tuned: {the pool seq a planned window gets: (rows, share)}
        self.share_tuner = None
        self._tuned: dict[int, tuple[int, float]] = {}
        self._where_version = -1
        self._pool_seq_taken = 0  # the last pool window counted by take_pool_window
        self._victims = None  # keep_misses: the tier's victims(residency, n), worst first
        self._ranked_victims = None  # [m, 2] ranked while the last window ran, for _offer
        self.offered_slots: frozenset[int] = frozenset()  # offered to the running window
        self._num_kept = 0  # experts kept since the last take_admitted
        from strata.backends.cuda.stream import PromptStreamer

        # windows of many rows (prompt chunks) stream their layers' missing experts (stream.py)
        self.streamer = PromptStreamer(self)

    # ---- free admission -----------------------------------------------------------------
    def keep_misses(self, victims) -> bool:
        """From now on a decode window keeps up to KEEP_PER_LAYER of each layer's misses read
        over PCIe, in the slots of resident experts `victims(residency [L, E], n)` names
        (worst first) before it: the window's kernels re-point such a victim at its host copy
        on the device and write the missed expert into its slot as they read it, so nothing
        is copied twice (offload.cu's keep_misses, matvec.cu's mv_keep). After the window,
        take_admitted publishes the changes through the table. False (nothing changes) where
        the expert products cannot (float experts, plan.experts_can_keep)."""
        from strata.backends.cuda.plan import experts_can_keep

        if not experts_can_keep(self.model):
            return False
        rt, host = self._rt, self.host
        with rt.active():
            self.model.tier.enable_admission(host.part_offsets, host.device_base,
                                             host.device_base + host.nbytes, self.slot_base,
                                             self.slot_bytes, KEEP_PER_LAYER)
        self._victims = victims
        return True

    def _offer(self, num_rows: int) -> None:
        """Before a window: the victims' slots its kernels may take (none for windows that do
        not keep misses). Slots a queued copy will claim are never offered, and the offered
        ones are left alone by rounds planned while the window runs (offered_slots)."""
        from strata.backends.cuda.plan import keeps_misses

        self.offered_slots = frozenset()
        if self._victims is None:
            return
        tier = self.model.tier
        with self._rt.active():
            tier.offer(np.empty((0, 3), dtype=np.int32))  # none unless offered below
        ranked, self._ranked_victims = self._ranked_victims, None
        if not keeps_misses(self.model, num_rows):
            return
        limit = self._offer_limit()
        queued = self.copier.queued_slots() if self.copier is not None else frozenset()
        residency = self.table.peek().table  # [L, E]
        if ranked is None:  # none ranked while the last window ran (prepare_next_window)
            ranked = self._rank_victims(limit + len(queued))
        if not len(ranked):
            return
        slots = residency[ranked[:, 0], ranked[:, 1]]  # still resident, not about to be copied
        usable = (slots >= 0) & ~np.isin(slots, np.fromiter(queued, np.int64, len(queued)))
        rows = np.column_stack([slots, ranked])[usable][:limit].astype(np.int32)
        if len(rows):
            with self._rt.active():
                tier.offer(rows)
            self.offered_slots = frozenset(rows[:, 0].tolist())

    def _offer_limit(self) -> int:
        return min(self.model.tier.admit_capacity, self.n_slots // 4)

    def _rank_victims(self, n: int) -> np.ndarray:
        """[m, 2] (layer, expert): the policy's victims now, worst first."""
        ranked = self._victims(self.table.peek().table, n)
        return np.array(ranked, dtype=np.int64).reshape(-1, 2)

    def take_admitted(self) -> int:
        """After a window (engine thread): publish what its kernels kept, each victim missing
        and the kept expert resident in its slot, through the table's ordered path (the
        bytes have landed: the window finished), then the device tables; return how many
        were kept since the last call. A kept expert that a copy made resident meanwhile
        gives its slot back free (its victim is gone either way)."""
        self.offered_slots = frozenset()
        if self._victims is None:
            return 0
        with self._rt.active():
            kept = self.model.tier.take_kept()
        if kept is not None:
            self._num_kept += self._publish_kept(*kept)
        num, self._num_kept = self._num_kept, 0
        return num

    def _publish_kept(self, candidates: np.ndarray, log: np.ndarray) -> int:
        taken = log >= 0
        if not taken.any():
            return 0
        slots = candidates[taken, 0].astype(np.int64)
        layers, experts = np.divmod(log[taken].astype(np.int64), self.store.n_experts)
        tickets = self.table.begin_evict_many(slots)  # the victims, published missing
        gone = [t.evicted for t in tickets if t.evicted is not None]
        resident = self.table.peek().table
        dup = resident[layers, experts] >= 0
        for slot in slots[dup]:
            self.table.abort(int(slot))
        keep = ~dup
        self.table.land_many(np.stack([slots[keep], layers[keep], experts[keep]], axis=1))
        with self._rt.active():
            self._point_many([g[0] for g in gone], [g[1] for g in gone], [-1] * len(gone))
            self._point_many(layers[keep], experts[keep], slots[keep])
            self._publish()
        return int(keep.sum())

    # ---- the CPU pool -------------------------------------------------------------------
    def attach_pool(self, pcie_frac: float, max_rows: int, threads: int | None = None) -> None:
        """Let a CPU pool compute about 1 - pcie_frac of the missing experts' routed rows from
        the pinned copies (backends/cuda/cpu_pool.py), through a mapped exchange buffer for
        windows of up to `max_rows` rows."""
        from strata.backends.cuda.cpu_pool import CpuPool
        from strata.backends.cuda.exchange import Exchange, ExchangeLayout
        from strata.backends.cuda.share import check_pcie_frac

        self.pcie_frac = check_pcie_frac(pcie_frac)
        rt, drv = self._rt, self._rt.drv
        layout = ExchangeLayout.for_spec(self.model.spec, max_rows)
        try:
            buf = drv.pagelocked_empty(layout.nbytes, np.uint8,
                                       mem_flags=drv.host_alloc_flags.DEVICEMAP)
        except Exception as exc:
            raise ConfigError(f"pinning the CPU pool's exchange buffer ({layout.nbytes} bytes) "
                              f"was refused ({exc}); run with --pcie-frac 1 (no CPU pool)"
                              ) from None
        exchange = Exchange.from_array(layout, buf)
        types = np.array([self.store.types(layer) for layer in range(self.store.n_layers)])
        self.pool = CpuPool(exchange, self.host.pointers(device=False), types,
                            self.model.spec.expert_ffn, threads=threads).start()
        with rt.active():
            self.model.tier.attach_pool(self.pool, exchange,
                                        int(buf.base.get_device_pointer()))
            ahead = read_ahead_experts()
            if self.n_slots == 0 and ahead > 0:  # every expert in RAM: stage likely ones
                image = [self._image_bytes(layer) for layer in range(self.store.n_layers)]
                self.model.tier.enable_read_ahead(self.host.device_base, self.slot_bytes,
                                                  self.host.part_offsets, image, ahead)
                log.info("read-ahead: decode windows copy each layer's %d likeliest "
                         "expert(s) into VRAM while its dense part runs (the link is idle "
                         "then); STRATA_READ_AHEAD=0 turns it off", ahead)
        self._where_version = -1
        self._set_where()

    def pools_rows(self, num_rows: int) -> bool:
        """Do windows of `num_rows` rows that stream their experts hand the rarely routed ones
        to the CPU pool (DeviceTier.pools asks once per row count)? Those the streamer leaves
        at their host copies (stream.rare_experts): the pool computes the routed ones from RAM,
        so their bytes do not cross the link the copies need (stream.PROMPT_POOL_MAX_ROWS)."""
        return self.streamer.pools_rare(num_rows)

    def _set_where(self, num_rows: int = 1) -> None:
        """where [L, E] for a window of this many rows, on the device and in the pool, when the
        residency, the window's share or its rows changed (share.miss_where: every miss the
        pool's, of which the device gives it 1 - share of each layer's routed ones;
        `window_share`: prompt chunks read every miss over PCIe); a streamed window that
        leaves rare experts gives those to the pool."""
        from strata.backends.cuda.share import miss_where, window_share

        if self.streamer.is_ready_for(num_rows) and self.pools_rows(num_rows):
            self._set_stream_where(num_rows)
            return
        share = window_share(self.pcie_frac, num_rows)
        if num_rows == 1 and self.one_row_share is not None:
            share = self.one_row_share
        tuned = self.share_tuner.share(num_rows) if self.share_tuner is not None else None
        if tuned is not None:
            share = tuned
            # the seq DeviceTier.before_run gives this window's hand-off
            self._tuned[int(self.model.tier.seq_host[0]) + 1] = (num_rows, share)
        key = (self.table.version, share)
        if key == self._where_version:
            return
        where, pool_frac = miss_where(self.table.peek().table, share)
        with self._rt.active():
            self.model.tier.set_where(where, pool_frac=pool_frac)
        self.pool.set_where(where)
        self._where_version = key

    def _record_share(self) -> None:
        """The pool's last window's compute + wait to the share tuner, when the tuner planned
        that window."""
        stats = self.pool.last_stats
        if not self._tuned or stats is None:
            return
        planned = self._tuned.pop(stats.seq, None)
        for seq in [seq for seq in self._tuned if seq < stats.seq]:
            del self._tuned[seq]  # windows whose figures were never seen here
        if planned is not None and planned[0] == stats.num_rows:
            self.share_tuner.record(planned[0], planned[1],
                                    (stats.pool_ms + stats.wait_ms) / 1e3)

    def _set_stream_where(self, num_rows: int) -> None:
        """A streamed window's where: its rare missing experts (the streamer's, as run() will
        leave them) to the CPU pool, the other missing ones PCIe (copied into staging: where
        only tells the kernels which pairs are the pool's), resident ones VRAM. The pool takes
        the routed ones within the device's caps (share.PROMPT_POOL_ROWS rows each, per layer
        share.prompt_pool_budget of its time); the kernels read the rest over PCIe."""
        from strata.backends.cuda.exchange import WHERE_CPU, WHERE_PCIE, WHERE_VRAM

        rare, sure, sure_rows = self.streamer.left_for(num_rows)  # [L, E], [L, E], [L]
        rare = rare | sure
        share_of_copy = self.streamer.pool_share_of_copy  # (SurePercent moves it)
        key = (self.table.version, "stream", np.packbits(rare).tobytes(), share_of_copy)
        if key == self._where_version:
            return
        from strata.backends.cuda.share import POOL_EXPERT_ROWS, prompt_pool_budget

        residency = self.table.peek().table
        where = np.where(residency >= 0, WHERE_VRAM, WHERE_PCIE).astype(np.uint8)
        where[rare] = WHERE_CPU
        copied = ((residency < 0) & ~rare).sum(axis=1)  # [L] experts the window copies
        budget = prompt_pool_budget(copied, self.pool.threads, share_of_copy)
        if sure.any():  # the sure experts left to the pool: their expected cost on top
            budget = budget + np.ceil(sure.sum(axis=1) * POOL_EXPERT_ROWS
                                      + sure_rows).astype(np.int32)
        if getattr(self.streamer, "timeline", False):
            log.info("prompt streaming: experts copied a layer %d-%d (median %d), the pool's "
                     "budget a layer %d-%d units (median %d)", copied.min(), copied.max(),
                     np.median(copied), budget.min(), budget.max(), np.median(budget))
        with self._rt.active():
            self.model.tier.set_where(where, budget)
        self.pool.set_where(where)
        self._where_version = key

    def seed_routing(self, rows: np.ndarray) -> None:
        """The profile's rows [L, E] (ExpertTier.start, with --expert-profile): the prompt
        streamer's counts start from them."""
        self.streamer.seed(rows)

    def fold_routed(self, counts: np.ndarray) -> None:
        self.streamer.account(counts)  # which experts prompt windows need not copy

    def reads_routing_before(self, num_rows: int) -> bool:
        """A window the CPU pool shares (its where table) or that streams its experts (the
        streamer's counts) is planned from the routing of the windows before it."""
        return self.pool is not None or self.streamer.wants(num_rows)

    # ---- the device tables --------------------------------------------------------------
    def slot_pointers(self, slot: int, layer: int) -> np.ndarray:
        """[3] uint64: gate, up, down of `slot` read with `layer`'s layout."""
        return np.uint64(self.slot_base + slot * self.slot_bytes) + self.host.part_offsets[layer]

    def _point(self, layer: int, expert: int, slot: int) -> None:
        """Host mirror: (layer, expert) read from `slot`, or from its host copy when -1."""
        self._point_many([layer], [expert], [slot])

    def _point_many(self, layers, experts, slots) -> None:
        """_point of each (layers[i], experts[i], slots[i]), in one numpy step (a tier round
        re-points ~128 experts per window)."""
        layers = np.asarray(layers, dtype=np.int64)
        experts = np.asarray(experts, dtype=np.int64)
        slots = np.asarray(slots, dtype=np.int64)
        if not layers.size:
            return
        host_index = layers * self.store.n_experts + experts  # HostExperts.index
        starts = np.where(slots >= 0, self.slot_base + slots * self.slot_bytes,
                          self.host.device_base + host_index * self.slot_bytes)
        self._mirror[layers, :, experts] = (starts.astype(np.uint64)[:, None]
                                            + self.host.part_offsets[layers])  # [n, 3]

    def _publish(self):
        """Upload the mirror on the compute stream; return an event recorded after it (the
        caller leaves the mirror unchanged until the stream passed it)."""
        drv, rt = self._rt.drv, self._rt
        drv.memcpy_htod_async(self.model.expert_tables_ptr, self._mirror, rt.stream)
        event = drv.Event()
        event.record(rt.stream)
        return event

    def device_table(self) -> np.ndarray:
        """[L, 3, E] uint64: the device's tables now (a synchronous read-back, for tests)."""
        with self._rt.active():
            self._rt.synchronize()
            out = np.empty_like(self._mirror)
            self._rt.drv.memcpy_dtoh(out, self.model.expert_tables_ptr)
        return out

    # ---- the ordered path ---------------------------------------------------------------
    def load_steps(self, slot: int, layer: int, expert: int, chunk_bytes: int = COPY_CHUNK_BYTES,
                   block: bool = True, timeout_s: float | None = None):
        """Blocking load (engine thread, between windows): "evicted" once the eviction is on
        the device, "copying" per chunk enqueued on the side stream; landed at the end."""
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes is {chunk_bytes}; give a positive size")
        rt, drv = self._rt, self._rt.drv
        ticket = self.table.begin_evict(slot)
        try:
            with rt.active():
                if ticket.evicted is not None:
                    self._point(*ticket.evicted, -1)
                published = self._publish()
                rt.synchronize()  # the mirror may change again from here
            yield "evicted"
            yield from self._until_overwritable(ticket, block, timeout_s)
            src = self.host.expert_bytes(layer, expert)
            nbytes = self._image_bytes(layer)
            with rt.active():
                self.side_stream.wait_for_event(published)
            for at in range(0, nbytes, chunk_bytes):
                with rt.active():
                    drv.memcpy_htod_async(self.slot_base + slot * self.slot_bytes + at,
                                          src[at:min(at + chunk_bytes, nbytes)], self.side_stream)
                yield "copying"
            with rt.active():
                self.side_stream.synchronize()
                self.table.land(slot, layer, expert)
                self._point(layer, expert, slot)
                self._publish()
                rt.synchronize()
        except BaseException:  # also GeneratorExit: a load dropped half-way frees its slot
            with rt.active():
                self.side_stream.synchronize()
            self.table.abort(slot)
            raise

    def _image_bytes(self, layer: int) -> int:
        """Bytes of a slot image that layer's expert uses (its down part's end)."""
        parts = self.store.layouts[layer].parts
        return int(self.host.part_offsets[layer, 2]) + parts[2].nbytes

    def fill(self, order) -> int:
        """Start-up fill: every free slot from `order` in one batch of copies, one upload."""
        free = self.table.free_slots()
        rt, drv = self._rt, self._rt.drv
        placed = []
        with rt.active():
            for (layer, expert), slot in zip(order, free):
                self.table.begin_evict(slot)
                drv.memcpy_htod_async(self.slot_base + slot * self.slot_bytes,
                                      self.host.expert_bytes(layer, expert)[
                                          :self._image_bytes(layer)], self.side_stream)
                placed.append((slot, layer, expert))
            self.side_stream.synchronize()
            for slot, layer, expert in placed:
                self.table.land(slot, layer, expert)
                self._point(layer, expert, slot)
            self._publish()
            rt.synchronize()
        return len(placed)

    def read_ahead_totals(self) -> tuple[int, int, int]:
        return self.model.tier.read_ahead_totals()

    def take_pool_window(self) -> tuple[int, float, float]:
        stats = self.pool.last_stats if self.pool is not None else None
        if stats is None or stats.seq == self._pool_seq_taken:
            return 0, 0.0, 0.0
        self._pool_seq_taken = stats.seq
        return stats.num_entries, stats.pool_ms / 1e3, stats.wait_ms / 1e3

    # the tier may pump the copier while a window runs (during_window) instead of before it
    overlaps_window = True

    def before_window(self, num_rows: int = 1, pump: bool = True) -> None:
        if self._victims is not None:  # what a window that failed before take_admitted kept
            with self._rt.active():
                kept = self.model.tier.take_kept()
            if kept is not None:
                self._num_kept += self._publish_kept(*kept)
        if pump and self.copier is not None:
            self.copier.pump()
        self.streamer.before_window(num_rows)  # staging for a prompt chunk, or given back
        if self.pool is not None:
            self._record_share()
            self._set_where(num_rows)
        self._offer(num_rows)

    def during_window(self) -> None:
        """The copier's pump while a window runs (engine thread, from the model's
        while_running): loads that landed are published for the next window and new copies
        queued; its uploads go on the compute stream behind the running window's kernels, and
        the side stream's copies wait for them, so the running window is never touched."""
        if self.copier is not None:
            self.copier.pump()

    def prepare_next_window(self) -> None:
        """While a window runs, after the pump and the tier's round: with free admission the
        victims the next window may be offered (twice its share: some will be taken or copied
        over)."""
        if self._victims is not None:
            self._ranked_victims = self._rank_victims(2 * self._offer_limit())

    def reserved_slots(self) -> frozenset[int]:
        """The slots prompt chunks borrow as staging (stream.py): never lent to a KV."""
        return self.streamer.reserved_slots()

    @property
    def is_lending_slots(self) -> bool:
        """True while slots are lent to a prompt chunk's staging or being refilled after it."""
        return self.streamer.is_lending

    # ---- lending slots to a KV (experts/kv_grow.py; reserved_slots above) -----------------
    def lend_slots(self, slots, timeout_s: float | None = None):
        """As ExpertArena's, with the evicted experts re-pointed at their host copies in one
        upload on the compute stream before the call returns: the KV's cells are written
        there (by copies and kernels on that stream) only after it."""
        rt, tickets = self._rt, []
        with rt.active():
            for slot in slots:
                ticket = self.table.begin_evict(slot)
                if ticket.evicted is not None:
                    self._point(*ticket.evicted, -1)
                tickets.append(ticket)
            self._publish()
            rt.synchronize()
        for ticket in tickets:
            self.table.wait_overwritable(ticket, timeout_s)
        return [ticket.evicted for ticket in tickets]

    def slot_region(self, first: int, count: int) -> int:
        """Device address of slots [first, first + count) (one region, lent to a KV)."""
        return self.slot_base + first * self.slot_bytes

    def new_copier(self, on_landed):
        from strata.backends.cuda.copier import StreamCopier

        self.copier = StreamCopier(self, on_landed)
        return self.copier

    def close(self) -> None:
        self.streamer.close()
        if self.copier is not None:
            self.copier.stop()
        if self.pool is not None:
            self.pool.stop()
            with self._rt.active():
                self.model.tier.detach_pool()
            self.pool = None

    def __repr__(self) -> str:
        return (f"VramExpertArena({self.n_slots} slots x {self.slot_bytes} bytes, "
                f"{self.table.num_resident} resident)")
