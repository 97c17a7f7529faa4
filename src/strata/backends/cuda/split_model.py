"""SplitModel: the CudaModel interface over a layer split (stages on their GPUs, stage.py). A
window's residual rows cross to the next stage once, ordered by events (no host sync inside a
window); `batch_groups` > 1 pipelines slot groups over the stages (group A on stage 2 while B
runs on stage 1), each group in its own workspace lane.
"""
from __future__ import annotations

import logging

import numpy as np

from strata.backends.cuda.logits import DeviceLogits, LogitReader
from strata.backends.cuda.split_kv import SplitKV, group_windows, stage_window
from strata.backends.cuda.model import GRAPH_MAX_ROWS
from strata.backends.cuda.stage import StageModel
from strata.backends.window import Window
from strata.engine.recurrent import DEFAULT_CHECKPOINTS
from strata.errors import ConfigError, ModelFormatError, RequestError

log = logging.getLogger("strata.engine")


class _Hop:
    """Moves x [R, H] float32 of one lane from stage `src` to stage `dst`: a device-to-device
    copy on one GPU, a peer copy between GPUs with peer access, else through a pinned host
    buffer. Queued on the streams behind events: `dst` waits for `src`'s plan."""

    def __init__(self, src: StageModel, dst: StageModel):
        self.src, self.dst = src, dst
        rs, rd = src.runtime, dst.runtime
        self.is_same_context = int(rs.context.handle) == int(rd.context.handle)
        self.is_peer = False
        if not self.is_same_context and rs.device.can_access_peer(rd.device):
            for a, b in ((rs, rd), (rd, rs)):
                with a.active():
                    try:
                        a.drv.Context.enable_peer_access(b.context)
                    except a.drv.Error as exc:  # already enabled by an earlier split
                        if "already" not in str(exc).lower():
                            raise
            self.is_peer = True
        self._host: dict[int, np.ndarray] = {}  # lane -> pinned [R, H] float32 (no peer path)
        self._events: dict = {}  # lane -> event recorded behind src's pass (reused per window)

    @property
    def how(self) -> str:
        return ("device-to-device" if self.is_same_context else
                "peer copy" if self.is_peer else "pinned host buffer")

    def queue(self, lane: int, num_rows: int, src_x: int, dst_x: int) -> None:
        """Queue the copy of lane `lane`'s rows (after src's queued plan; before dst's)."""
        rs, rd = self.src.runtime, self.dst.runtime
        nbytes = 4 * num_rows * self.src.spec.hidden
        with rs.active():
            if not (self.is_same_context or self.is_peer):
                host = self._host.get(lane)
                if host is None or host.nbytes < nbytes:
                    host = self._host[lane] = rs.pinned((max(nbytes, 4096) // 4,), np.float32)
                rs.drv.memcpy_dtoh_async(host[:nbytes // 4], src_x, rs.stream)
            done = self._events.get(lane)
            if done is None:
                done = self._events[lane] = rs.drv.Event(rs.drv.event_flags.DISABLE_TIMING)
            done.record(rs.stream)
        with rd.active():
            rd.stream.wait_for_event(done)
            if self.is_same_context:
                rd.drv.memcpy_dtod_async(dst_x, src_x, nbytes, rd.stream)
            elif self.is_peer:
                rd.drv.memcpy_peer_async(dst_x, src_x, nbytes, rd.context, rs.context,
                                         rd.stream)
            else:
                rd.drv.memcpy_htod_async(dst_x, host[:nbytes // 4], rd.stream)


class SplitModel:
    """A GGUF MoE model split by layers over GPUs: stage i runs layers [first_i, stop_i) on
    `devices[i]`. The interface is CudaModel's (spec, new_kv, forward, forward_window,
    forward_window_greedy, forward_window_lazy); KVs are SplitKVs (each stage its layers'
    cells). `experts_resident=False`: every stage keeps its routed experts in host RAM behind
    its own VRAM cache and tier (split_tier.py)."""

    reads_expert_pointers = False

    def __init__(self, gguf_model, devices: list[int], layer_counts: list[int],
                 experts_resident: bool = True, batch_groups: int = 1):
        L = gguf_model.spec.n_layers
        if len(devices) != len(layer_counts) or sum(layer_counts) != L or min(layer_counts) < 1:
            raise ConfigError(f"layer split {layer_counts} over GPUs {devices}: give one "
                              f"positive layer count per GPU adding up to the model's {L}")
        self.gguf = gguf_model
        self.spec = gguf_model.spec
        self.experts_resident = experts_resident
        self.stages: list[StageModel] = []
        first = 0
        for device, count in zip(devices, layer_counts):
            self.stages.append(StageModel(gguf_model, device, (first, first + count),
                                          experts_resident=experts_resident))
            first += count
        self.hops = [_Hop(a, b) for a, b in zip(self.stages, self.stages[1:])]
        self.batch_groups = int(batch_groups)
        last = self.last.runtime
        self._logits_ptr = 0  # where the last pass's [N, V] logits are on the last GPU
        self.logit_reader = LogitReader(last, lambda: self._logits_ptr, self.spec.vocab)
        self._joined = None  # [N, V] device buffer joining the groups' logits (groups > 1)
        self._joined_rows = 0
        self._host_logits = np.empty((0, self.spec.vocab), np.float32)
        self._host_argmax = None
        self._lane_counts: dict[tuple[int, int], np.ndarray] = {}  # (stage, lane) -> [Ls, E]
        self._lanes: dict[int, _Lane] = {}  # pipelined windows' lanes (start_window)
        self.expert_tier = None  # the SplitTier, set when it is built
        self._pool_logged = False
        self.plan_text = self.describe()  # what `strata run` / `bench` print at start

    @property
    def last(self) -> StageModel:
        return self.stages[-1]

    @property
    def runtime(self):
        """The first stage's runtime (what one-GPU callers log as "the GPU")."""
        return self.stages[0].runtime

    def describe(self) -> str:
        parts = [f"GPU {s.runtime.index} layers {s.first_layer}-{s.stop_layer - 1}"
                 for s in self.stages]
        hops = ", ".join(h.how for h in self.hops)
        return f"layer split: {'; '.join(parts)}; rows cross by {hops or 'nothing'}"

    def build_expert_tier(self, config, gguf):
        """The per-stage expert tiers (split_tier.py), called by ExpertTier.build."""
        from strata.backends.cuda.split_tier import SplitTier

        self.expert_tier = SplitTier.build(config, gguf, self)
        return self.expert_tier

    def enable_routing_counts(self) -> None:
        for stage in self.stages:
            stage.enable_routing_counts()

    # ---- KV ---------------------------------------------------------------------------------
    def new_kv(self, capacity_tokens: int, dtype=None,
               max_checkpoints: int = DEFAULT_CHECKPOINTS) -> SplitKV:
        """An empty KV for one sequence: each stage's layers' cells (and a hybrid model's
        recurrent state, with up to `max_checkpoints` copies) on its GPU."""
        return SplitKV(self.spec, [s.new_kv(capacity_tokens, dtype, max_checkpoints)
                                   for s in self.stages],
                       [s.first_layer for s in self.stages])

    # ---- the pass -----------------------------------------------------------------------------
    def forward(self, tokens: np.ndarray, kv: SplitKV, all_logits: bool = False) -> np.ndarray:
        window = Window.build([(kv, tokens)], logits="all" if all_logits else "last")
        return self.forward_window(window)

    def forward_window(self, window: Window, expert_pointers=None,
                       routing_counts: np.ndarray | None = None,
                       while_running=None) -> np.ndarray:
        """Logits [N, V] float32 of the window's logit rows (as CudaModel.forward_window;
        `while_running(is_done)` runs once every stage's work is queued, before the waits)."""
        return self._run(window, "logits", expert_pointers, routing_counts, while_running)

    def forward_window_greedy(self, window: Window, expert_pointers=None,
                              routing_counts: np.ndarray | None = None,
                              while_running=None) -> np.ndarray:
        """The greedy token [N] of each logit row (argmax on the last GPU)."""
        return self._run(window, "greedy", expert_pointers, routing_counts, while_running)

    def forward_window_lazy(self, window: Window, expert_pointers=None,
                            routing_counts: np.ndarray | None = None,
                            while_running=None) -> DeviceLogits:
        """Logits [N, V] left on the last GPU until the next pass (CudaModel's lazy form)."""
        return self._run(window, "lazy", expert_pointers, routing_counts, while_running)

    def _check(self, window: Window, expert_pointers, routing_counts) -> None:
        if expert_pointers is not None:
            raise ValueError("the split model reads experts through its stages' device "
                             "tables; pass expert_pointers=None")
        if not self.experts_resident and any(s.expert_arena is None for s in self.stages):
            raise ConfigError("this split model keeps its experts in host RAM and some stage "
                              "has no expert arena yet; build the tiers (the engine does)")
        for i, kv in enumerate(window.kvs):
            if not isinstance(kv, SplitKV) or len(kv.parts) != len(self.stages):
                raise RequestError(f"slot {i}: its KV cache ({kv!r}) was not made by this "
                                   "split model; make every KV of a window with its new_kv")
        if routing_counts is not None:
            shape = (self.spec.n_layers, self.spec.n_experts)
            if (not isinstance(routing_counts, np.ndarray) or routing_counts.dtype != np.int64
                    or routing_counts.shape != shape):
                raise ValueError(f"routing_counts must be an int64 array of shape {shape}")
            self.enable_routing_counts()

    def num_groups_for(self, window: Window) -> int:
        """Slot groups this window runs as: batch_groups, at most one per run, when it reads a
        prompt chunk (a pass's time grows with its rows there); one for decode rows only (a
        decode pass costs about the same for 1 row as for 4: the scheduler pipelines decode
        windows of different groups instead, start_window) and when a stage hands rows to a
        CPU pool (one pool window per pass)."""
        if window.num_rows == len(window.kvs):
            return 1
        if any(s.tier is not None and s.tier.has_pool for s in self.stages):
            if self.batch_groups > 1 and not self._pool_logged:
                log.info("batch groups: 1 while a CPU pool serves cache misses (--pcie-frac "
                         "< 1 takes one pool window per pass); --pcie-frac 1 pipelines %d",
                         self.batch_groups)
                self._pool_logged = True
            return 1
        return max(1, min(self.batch_groups, window.num_slots))

    # the forward_window* methods take while_running, as CudaModel's
    runs_while_window = True

    def _is_done(self) -> bool:
        """Has every stage's stream finished its queued work?"""
        for stage in self.stages:
            with stage.runtime.active():
                if not stage.runtime.stream.is_done():
                    return False
        return True

    def _run(self, window: Window, mode: str, expert_pointers, routing_counts,
             while_running=None):
        self._check(window, expert_pointers, routing_counts)
        if any(state.in_flight for state in self._lanes.values()):
            raise RuntimeError("a pipelined window is in flight; finish_window it first")
        window.check_current()
        for state in self._lanes.values():
            state.reader.generation += 1  # lane 0's workspace is this pass's too
        groups = group_windows(window, self.num_groups_for(window))
        G, N = len(groups), window.num_logit_rows
        self.logit_reader.generation += 1  # the pass overwrites the last one's logits
        if G > 1 and mode != "greedy":
            self._grow_joined(max(N, 1))
        host_argmax = self._argmax_rows(max(N, 1)) if mode == "greedy" else None
        try:
            self._queue(window, groups, mode, host_argmax, routing_counts is not None)
            if while_running is not None:  # the GPUs run the window meanwhile
                while_running(self._is_done)
            for stage in self.stages:
                with stage.runtime.active():
                    stage.runtime.stream.synchronize()
            self._finish_counts(G, routing_counts)
        finally:
            for stage in self.stages:
                stage.use_lane(0)
        window.commit()
        if mode == "lazy":
            self._logits_ptr = self.last.logits_ptr() if G == 1 else int(self._joined)
            return DeviceLogits(self.logit_reader, 0, N, self.logit_reader.generation)
        if mode == "greedy":
            return np.array(host_argmax[:N])
        return np.array(self._host_logits[:N])

    def _queue(self, window: Window, groups: list[Window], mode: str, host_argmax,
               counting: bool) -> None:
        """Queue every (group, stage) pass on the stages' streams: stage s of group g after
        stage s - 1 of group g (events), groups in order on each stage."""
        G, N = len(groups), window.num_logit_rows
        for stage in self.stages:
            stage.logit_reader.generation += 1  # its lanes' logits are overwritten too
            if G == 1 and stage.tier is not None:
                with stage.runtime.active():
                    stage.tier.before_run(window.num_rows)  # a CPU pool takes this window
        l0 = 0
        for g, group in enumerate(groups):
            for s in range(len(self.stages)):
                self._queue_stage(s, group, g, counting and G > 1)
            self._queue_outputs(mode, g, G, l0, group.num_logit_rows, host_argmax)
            l0 += group.num_logit_rows
        for stage in self.stages:
            if G == 1 and stage.tier is not None:
                with stage.runtime.active():
                    stage.tier.after_run()  # the counts' read-back behind the plan
        if mode == "logits":
            last = self.last.runtime
            with last.active():
                src = self.last.logits_ptr() if G == 1 else int(self._joined)
                last.drv.memcpy_dtoh_async(self._host_rows(max(N, 1)), src, last.stream)

    def _queue_stage(self, s: int, window: Window, lane: int, lane_counts: bool) -> None:
        """Queue lane `lane`'s pass of `window` on stage s: its descriptor, the rows crossing
        from stage s - 1, the plan, and (lane_counts) its routing counts' read-back. Leaves
        the stage on that lane."""
        stage = self.stages[s]
        rt = stage.runtime
        with rt.active():
            stage.use_lane(lane)
            plan = stage._prepare(stage_window(window, s))
            if s > 0:
                self.hops[s - 1].queue(lane, window.num_rows, self.stages[s - 1].x_ptr(),
                                       stage.x_ptr())
            plan.run(rt.stream_handle, stage.use_graphs and window.num_rows <= GRAPH_MAX_ROWS)
            if lane_counts:
                self._queue_lane_counts(s, lane)

    # ---- outputs and counts -----------------------------------------------------------------
    def _queue_outputs(self, mode: str, g: int, G: int, l0: int, Ng: int, host_argmax) -> None:
        """Behind group g's last stage: its argmax rows to the host (greedy), or with several
        groups its logits into rows [l0, l0 + Ng) of the joined buffer."""
        last, rt = self.last, self.last.runtime
        with rt.active():
            if mode == "greedy":
                n = max(Ng, 1) if G == 1 else Ng
                if n:
                    rt.drv.memcpy_dtoh_async(host_argmax[l0:l0 + n], last.argmax_ptr(),
                                             rt.stream)
            elif G > 1 and Ng:
                V = self.spec.vocab
                rt.drv.memcpy_dtod_async(int(self._joined) + 4 * l0 * V, last.logits_ptr(),
                                         4 * Ng * V, rt.stream)

    def _grow_joined(self, num_rows: int) -> None:
        if num_rows > self._joined_rows:
            rt = self.last.runtime
            with rt.active():
                rows = max(num_rows, 64)
                self._joined = rt.alloc(4 * rows * self.spec.vocab)
                self._joined_rows = rows

    def _host_rows(self, num_rows: int) -> np.ndarray:
        if self._host_logits.shape[0] < num_rows:
            rt = self.last.runtime
            self._host_logits = rt.pinned((max(num_rows, 64), self.spec.vocab), np.float32)
        return self._host_logits[:num_rows]

    def _argmax_rows(self, num_rows: int) -> np.ndarray:
        if self._host_argmax is None or self._host_argmax.shape[0] < num_rows:
            self._host_argmax = self.last.runtime.pinned((max(num_rows, 64),), np.int32)
        return self._host_argmax

    def _queue_lane_counts(self, s: int, lane: int) -> None:
        """Several groups: each lane's routing counts of stage s read back after its pass
        (the device counts are per pass, so the next group's would overwrite them)."""
        stage = self.stages[s]
        key = (s, lane)
        host = self._lane_counts.get(key)
        if host is None:
            host = self._lane_counts[key] = stage.runtime.pinned(
                (stage.spec.n_layers, stage.spec.n_experts), np.int32)
        stage.runtime.drv.memcpy_dtoh_async(host, stage.tier.counts_ptr(0),
                                            stage.runtime.stream)

    def _finish_counts(self, G: int, routing_counts) -> None:
        """After the synchronize: the stages' counts into routing_counts [L, E] (rows
        [first, stop) from each stage), and each stage's pool finished (raises on failure)."""
        for s, stage in enumerate(self.stages):
            part = (routing_counts[stage.first_layer:stage.stop_layer]
                    if routing_counts is not None else None)
            if G == 1:
                if stage.tier is not None:
                    stage.tier.finish(part)
            elif part is not None:
                for lane in range(G):
                    part += self._lane_counts[(s, lane)]

    # ---- pipelined windows: one slot group per lane, several in flight ----------------------
    def start_window(self, window: Window, lane: int, mode: str = "lazy",
                     routing_counts: np.ndarray | None = None) -> "LaneTicket":
        """Queue `window` (one slot group's rows) as lane `lane` on every stage's stream and
        return at once; finish_window waits for it and returns what forward_window_<mode>
        would ("logits", "greedy", "lazy"). Windows of other lanes may be in flight: while
        lane A's rows run on stage 2, lane B's run on stage 1 (pipelined decode). Each lane
        has its own workspaces, logits, counts and events; its KVs must be its own.
        `routing_counts` [L, E] gets the window's routed rows added at finish_window."""
        if mode not in ("logits", "greedy", "lazy"):
            raise ValueError(f"start_window: mode must be logits, greedy or lazy, got {mode!r}")
        self._check(window, None, routing_counts)
        if lane in self._lanes and self._lanes[lane].in_flight:
            raise RuntimeError(f"lane {lane} already has a window in flight; finish it first")
        window.check_current()
        state = self._lane(lane)
        N = window.num_logit_rows
        try:
            for s, stage in enumerate(self.stages):
                self._queue_stage(s, window, lane, routing_counts is not None)
                rt = stage.runtime
                with rt.active():
                    if stage is self.last and mode != "lazy":
                        host = state.host_rows(mode, max(N, 1), rt)
                        src = stage.argmax_ptr() if mode == "greedy" else stage.logits_ptr()
                        rt.drv.memcpy_dtoh_async(host, src, rt.stream)
                    state.done[s].record(rt.stream)
        finally:
            for stage in self.stages:
                stage.use_lane(0)
        state.reader.generation += 1  # the lane's last logits are overwritten
        state.in_flight = True
        return LaneTicket(lane, window, mode, routing_counts)

    def finish_window(self, ticket: "LaneTicket", while_running=None):
        """Wait for a window start_window queued (running `while_running(is_done)` first, as
        forward_window does) and return its greedy ids [N], logits [N, V] or lazy logits."""
        state = self._lanes[ticket.lane]
        if not state.in_flight:
            raise RuntimeError(f"lane {ticket.lane} has no window in flight")

        def is_done() -> bool:
            for stage, event in zip(self.stages, state.done):
                with stage.runtime.active():
                    if not event.query():
                        return False
            return True

        try:
            if while_running is not None:  # the GPUs run the window meanwhile
                while_running(is_done)
            for stage, event in zip(self.stages, state.done):
                with stage.runtime.active():
                    event.synchronize()
        finally:
            state.in_flight = False
        if ticket.routing_counts is not None:
            for s, stage in enumerate(self.stages):
                ticket.routing_counts[stage.first_layer:stage.stop_layer] += \
                    self._lane_counts[(s, ticket.lane)]
        ticket.window.commit()
        N = ticket.window.num_logit_rows
        if ticket.mode == "lazy":
            return DeviceLogits(state.reader, 0, N, state.reader.generation)
        return np.array(state.rows[ticket.mode][:N])

    def _lane(self, lane: int) -> "_Lane":
        state = self._lanes.get(lane)
        if state is None:
            last = self.last
            events = []
            for stage in self.stages:
                with stage.runtime.active():
                    events.append(stage.runtime.drv.Event(
                        stage.runtime.drv.event_flags.DISABLE_TIMING))
            reader = LogitReader(last.runtime, lambda: last.lane_ptr(lane, "logits"),
                                 self.spec.vocab)
            state = self._lanes[lane] = _Lane(events, reader)
        return state

    def __repr__(self) -> str:
        return f"SplitModel({self.describe()})"


class LaneTicket:
    """A window start_window queued: its lane, window, mode and routing counts."""

    def __init__(self, lane: int, window: Window, mode: str, routing_counts):
        self.lane, self.window, self.mode = lane, window, mode
        self.routing_counts = routing_counts


class _Lane:
    """A pipelined lane's events (one per stage, behind its work), logit reader and pinned
    output rows."""

    def __init__(self, done: list, reader: LogitReader):
        self.done, self.reader = done, reader
        self.rows: dict[str, np.ndarray] = {}
        self.in_flight = False

    def host_rows(self, mode: str, num_rows: int, rt) -> np.ndarray:
        """Pinned rows for mode's output: [n] int32 argmax or [n, V] float32 logits."""
        have = self.rows.get(mode)
        if have is None or have.shape[0] < num_rows:
            n = max(num_rows, 64)
            have = self.rows[mode] = (rt.pinned((n,), np.int32) if mode == "greedy" else
                                      rt.pinned((n, self.reader._vocab), np.float32))
        return have[:num_rows]


# ---- building from the engine's options ------------------------------------------------------
def card_free_bytes(drv, index: int) -> int:
    """Free bytes of GPU `index` now (through its primary context)."""
    context = drv.Device(index).retain_primary_context()
    context.push()
    try:
        free, _ = drv.mem_get_info()
    finally:
        drv.Context.pop()
    return int(free)


def _rows_by_expert(config, spec):
    """[L, E] rows routed to each (layer, expert) by --expert-profile, for the plan's hit
    rates; None without one or when it does not fit this model (the tier says why when it
    reads it)."""
    from strata.experts.profile import read_profile

    path = getattr(config, "expert_profile_path", None)
    if path is None or not spec.n_experts:
        return None
    try:
        profile = read_profile(path)
    except (ConfigError, ModelFormatError, OSError):
        return None
    if (profile.n_layers, profile.n_experts) != (spec.n_layers, spec.n_experts):
        return None
    return profile.rows_by_expert()


def build_split_model(gguf_model, config, offload: bool) -> SplitModel:
    """The SplitModel for `config` (--split-device, --layer-split, --batch-groups, and
    --vram-budget per card): the stage plan (auto: the smallest predicted decode time of the
    slowest stage) and the batch-groups decision are logged."""
    from strata.backends import split as sp
    from strata.backends.cuda.runtime import import_pycuda

    drv = import_pycuda()
    spec = gguf_model.spec
    devices = sp.parse_split_devices(config.split_devices, drv.Device.count())
    counts = sp.parse_layer_split(config.layer_split, spec.n_layers, len(devices))
    costs = sp.layer_costs(gguf_model)
    budget = config.vram_budget_bytes if offload else None
    cards = [sp.Card(i, card_free_bytes(drv, i), cache_budget_bytes=budget) for i in devices]
    kv_tokens = config.parallel * config.resolve_n_ctx(spec.context_length)
    plan, offload, too_big = sp.plan_for_model(costs, cards, counts, kv_tokens=kv_tokens,
                                               offload=offload, profile=_rows_by_expert(config,
                                                                                        spec))
    if too_big is not None:  # as one GPU does with --device auto (backends/select.py)
        config.expert_cache = "auto"
        log.info("layer split: the routed experts in pinned RAM behind an adaptive VRAM cache "
                 "on each card (--expert-cache auto), since every expert does not fit: %s",
                 too_big)
    is_tiered = offload and config.expert_cache != 0 and config.adapt_every > 0
    blocking = is_tiered and not config.adapt_async
    pool_asked = offload and config.pcie_frac is not None and (
        config.pcie_frac == "auto" or config.pcie_frac < 1)
    groups, why = sp.choose_batch_groups(config.batch_groups, len(devices), config.parallel,
                                         blocking_tier=blocking, cpu_pool=pool_asked,
                                         drafts=config.drafts.is_on)
    if groups > 1 and blocking:  # as the log line above says
        config.adapt_async = True
    if groups > 1:  # (the engine reads config.drafts after the model is built)
        config.spec_type = "none"
    if groups > 1 and offload and config.expert_cache != 0 and (
            config.pcie_frac is None or config.pcie_frac == "auto" or config.pcie_frac < 1):
        # A CPU pool takes one window at a time. With a cache, pipelined groups reading their
        # misses over PCIe decoded faster on two H200s from 74% of the routed experts in VRAM
        # up (docs/cuda.md, "Two GPUs"); with no cache (all misses) the pool stays.
        if not pool_asked:
            why += ("\nmisses read over PCIe (no CPU pool: it takes one window at a time, and "
                    "pipelined groups decode faster; --pcie-frac F keeps it with one group)")
        config.pcie_frac = 1.0
    model = SplitModel(gguf_model, [s.card for s in plan.stages], plan.counts,
                       experts_resident=not offload, batch_groups=groups)
    model.plan_text = "\n".join([plan.describe(), why, model.describe()])
    for line in model.plan_text.splitlines():
        log.info("%s", line)
    return model
