"""CudaModel: the CPU model's interface (new_kv, forward, forward_window, spec) with every
layer on one GPU. A window uploads one descriptor and runs its shape's plan: decode-sized
windows replay a captured CUDA graph, larger ones run the prepared launch list. With
`experts_resident=False` the routed experts stay in host RAM behind a VRAM cache (offload.py).
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np

from strata.backends.cuda.kv import CudaKV
from strata.backends.cuda.logits import DeviceLogits, LogitReader
from strata.backends.cuda.plan import (CELLS_FP16, CELLS_INT8, DEEP_ALL, DEEP_NONE, DEEP_SOME,
                                       WindowPlan, Workspace, attention_deep_from,
                                       prompt_attention)
from strata.backends.cuda.runtime import Runtime
from strata.backends.cuda.device_tier import DeviceTier
from strata.backends.cuda.weights import (DeviceLayer, DeviceMatrix, DeviceVector, small_values,
                                          weight_bytes)
from strata.backends.window import Window
from strata.engine.recurrent import DEFAULT_CHECKPOINTS
from strata.errors import ConfigError, RequestError
from strata.model.gguf_file import GGUFModel

GRAPH_MAX_ROWS = 16      # windows of at most this many rows replay a captured graph
_MIN_WORKSPACE_ROWS = 64
_MAX_PLANS = 32          # window shapes whose launches (and graphs) are kept
_VRAM_RESERVE_BYTES = 512 << 20  # left free for the workspace, KV and the driver


def _pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def _delta_products(ly) -> tuple:
    """The products over H of a gated delta-net layer (none for an attention layer)."""
    return (ly.ssm_qkv, ly.ssm_gate, ly.ssm_ba) if ly.is_recurrent else ()


def _check_delta_net(spec, layers) -> None:
    """ConfigError naming the dimension when a hybrid model's recurrent layers do not fit the
    CUDA kernels (delta_net.cu)."""
    if spec.ssm_state > 128:
        raise ConfigError(f"delta-net key head dim {spec.ssm_state}: the CUDA delta rule keeps "
                          "a column of the state in registers, at most 128 rows; run this "
                          "model with --device cpu")
    if any(ly.is_recurrent and not ly.ssm_out.is_float for ly in layers) \
            and spec.ssm_inner % 32:
        raise ConfigError(f"delta-net inner size {spec.ssm_inner} must be a multiple of 32 "
                          "for a quantised ssm_out on the CUDA backend; run with --device cpu")


class CudaModel:
    """Runs a GGUF MoE model on one GPU. `forward_window` takes the next rows of several
    sequences (KVs made by `new_kv`) in one pass; `forward` the next tokens of one sequence.

    `experts_resident=False`: only the dense part goes to VRAM; the routed experts are read
    through device tables (`expert_tables`, uint64 [L, 3, E]) that an expert arena fills
    (`new_expert_arena`, called by the engine's ExpertTier) before the first window."""

    reads_expert_pointers = False  # the tier's arena keeps the expert tables on the device

    def __init__(self, gguf_model: GGUFModel, device: int | None = None,
                 experts_resident: bool = True, layers: tuple[int, int] | None = None):
        """`layers` (first, stop): only those layers (a stage of a layer split, stage.py):
        the first stage embeds the tokens, the last applies the final norm and the head, the
        others take and give the residual rows [R, H] float32 in the workspace's `x`."""
        if layers is not None:
            from strata.backends.cuda.stage import LayerRange

            gguf_model = LayerRange(gguf_model, *layers)
        self.is_first = getattr(gguf_model, "is_first", True)
        self.is_last = getattr(gguf_model, "is_last", True)
        self.gguf = gguf_model
        self.spec = spec = gguf_model.spec
        self.runtime = rt = Runtime(device)
        self.experts_resident = experts_resident
        need = weight_bytes(gguf_model, routed_experts=experts_resident)
        free, total = rt.free_bytes()
        if need + _VRAM_RESERVE_BYTES > free:
            what = "the model's tensors need" if experts_resident else (
                "the model's dense part (everything but the routed experts) needs")
            offload = ("keep the routed experts in RAM behind a VRAM cache (--expert-cache "
                       "auto), " if experts_resident and spec.n_experts else "")
            raise ConfigError(
                f"{what} {need / 2**30:.2f} GiB of VRAM (+ "
                f"{_VRAM_RESERVE_BYTES >> 20} MiB for work buffers) but {rt.name} has "
                f"{free / 2**30:.2f} GiB free of {total / 2**30:.2f} GiB; {offload}use a "
                "smaller quantisation, free the GPU, or run with --device cpu")
        self.expert_tables, self.expert_tables_ptr = None, 0
        if not experts_resident:
            self.expert_tables = rt.alloc(8 * 3 * spec.n_layers * spec.n_experts)
            self.expert_tables_ptr = int(self.expert_tables)
        self.expert_arena = None  # set by new_expert_arena
        needs_embd = self.is_first or (self.is_last and spec.tied_output)
        self.embd = (DeviceMatrix(rt, gguf_model.tensor("token_embd.weight")) if needs_embd
                     else None)
        self.layers = [DeviceLayer(rt, gguf_model, spec, i, self.expert_tables_ptr)
                       for i in range(spec.n_layers)]
        self.out_norm = self.head = None  # on the last stage only
        if self.is_last:
            self.out_norm = DeviceVector(rt, small_values(gguf_model.tensor("output_norm.weight")))
            self.head = self.embd if spec.tied_output else DeviceMatrix(
                rt, gguf_model.tensor("output.weight"))
        # as the CPU backend: inverse frequencies in float32, as torch computes them (of the
        # first n_rot dims of a head: qwen3next rotates only those)
        exps = np.arange(0, spec.n_rot, 2, dtype=np.float32) / np.float32(spec.n_rot)
        self.inv_freq = DeviceVector(rt, 1.0 / np.power(np.float32(spec.rope_theta), exps))
        self.eps = float(np.float32(spec.rms_eps))
        self.attn_scale = float(np.float32(spec.head_dim ** -0.5))
        mats = [m for m in (self.head,) if m is not None] + [
            m for ly in self.layers for m in (ly.wq, ly.wk, ly.wv, ly.router, ly.gate_exps,
                                              ly.shexp_w_gate, *_delta_products(ly))
            if m is not None]
        # the normed rows are also quantised when a product over H reads 8-bit activations
        self.quantize_h = any(not m.is_float for m in mats)
        if spec.head_dim % 8 or spec.head_dim > 256:
            raise ConfigError(f"head dim {spec.head_dim}: the CUDA attention kernel takes a "
                              "multiple of 8 up to 256; run this model with --device cpu")
        if self.quantize_h and (spec.hidden % 32 or spec.q_dim % 32):
            raise ConfigError(f"hidden {spec.hidden} / q_dim {spec.q_dim} must be multiples of "
                              "32 for quantised weights on the CUDA backend")
        if spec.recurrent_layers:
            _check_delta_net(spec, self.layers)
        self._ws: Workspace | None = None
        # windows with a row at least this deep run plans with attention_group.cu (plan.py)
        self.attention_deep_from = attention_deep_from(spec)
        self._plans: OrderedDict[tuple[int, int, int, int], WindowPlan] = OrderedDict()
        self.use_graphs = True
        # a pass's logits stay on the device until the next pass (forward_window_lazy)
        self.logit_reader = LogitReader(rt, lambda: self._ws.ptr("logits"), spec.vocab)
        # routing counts (+ the CPU pool's hand-off) on the device; always with offloaded experts
        self.tier: DeviceTier | None = None
        if not experts_resident:
            with rt.active():
                self.tier = DeviceTier(self)

    # ---- the expert tier ----------------------------------------------------------------------
    def new_expert_arena(self, store, config):
        """The VRAM expert cache over `store` for `config` (--expert-cache, --vram-budget); it
        points every expert's table entries at its slot or its pinned host copy."""
        if self.experts_resident:
            raise ConfigError("this CUDA model holds every expert in VRAM; build it with "
                              "experts_resident=False for an expert cache")
        from strata.backends.cuda.offload import build_vram_arena

        self.expert_arena = build_vram_arena(self, store, config)
        return self.expert_arena

    def enable_routing_counts(self) -> None:
        """Gather routing counts on the device from now on (one more launch per layer)."""
        if self.tier is None:
            with self.runtime.active():
                self.tier = DeviceTier(self)
            self.drop_plans()

    def drop_plans(self) -> None:
        """Forget the prepared plans (their launches change, e.g. a CPU pool was attached)."""
        self._plans.clear()

    # ---- KV ---------------------------------------------------------------------------------
    def new_kv(self, capacity_tokens: int, dtype=None,
               max_checkpoints: int = DEFAULT_CHECKPOINTS) -> CudaKV:
        """An empty device KV cache for one sequence: fp16 cells (dtype None or float16), or
        int8 cells with a scale per (token, head) (dtype int8); a hybrid model's also holds
        its recurrent state and keeps up to `max_checkpoints` copies to go back to."""
        if dtype is not None and np.dtype(dtype) not in (np.float16, np.int8):
            raise ConfigError(f"the CUDA backend keeps KV cells as float16 or int8, not "
                              f"{np.dtype(dtype).name}; pass one of those or leave dtype unset")
        if capacity_tokens > self.spec.context_length:
            raise ConfigError(
                f"context of {capacity_tokens} tokens exceeds the model's "
                f"{self.spec.context_length}; ask for at most {self.spec.context_length}")
        with self.runtime.active():
            return CudaKV(self.runtime, self.spec, capacity_tokens,
                          np.float16 if dtype is None else dtype, max_checkpoints)

    # ---- plans --------------------------------------------------------------------------------
    def _plan(self, num_rows: int, num_logit_rows: int, deep: int = DEEP_NONE,
              cells: int = CELLS_FP16) -> WindowPlan:
        """The plan of windows of this shape; `deep` (deep_level): DEEP_SOME for one with a
        row at attention_deep_from or past it (the plan then launches attention_group.cu's
        kernel too), DEEP_ALL for a decode window whose rows all are (that kernel only);
        `cells` (cell_types): the KVs' cell types, which pick a prompt window's
        attention_prompt.cu kernels (other windows' plans do not depend on them)."""
        ws = self._ws
        if ws is None or ws.max_rows < num_rows or ws.max_logit_rows < num_logit_rows:
            rows = max(_MIN_WORKSPACE_ROWS, _pow2(num_rows), ws.max_rows if ws else 0)
            # logits only for the logit rows: prompt windows have one or none
            logit_rows = min(rows, max(_MIN_WORKSPACE_ROWS, _pow2(num_logit_rows),
                                       ws.max_logit_rows if ws else 0))
            self._plans.clear()  # their addresses point into the old workspace
            self._ws = ws = None
            self._ws = Workspace(self.runtime, self.spec, rows, logit_rows)
        if self.attention_deep_from is None:
            deep = DEEP_NONE
        elif deep == DEEP_ALL and prompt_attention(num_rows, self.spec):
            deep = DEEP_SOME  # a prompt window's rows beside their slot's take attention_prompt
        if not prompt_attention(num_rows, self.spec):
            cells = CELLS_FP16
        key = (num_rows, num_logit_rows, int(deep), cells)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = WindowPlan(
                self, self._ws, num_rows, num_logit_rows,
                self.attention_deep_from if deep else None, deep == DEEP_ALL, cells)
            if len(self._plans) > _MAX_PLANS:
                self._plans.popitem(last=False)
        self._plans.move_to_end(key)
        return plan

    def launches_per_window(self, num_rows: int = 1, num_logit_rows: int = 1,
                            deep: int = DEEP_NONE, cells: int = CELLS_FP16) -> int:
        """Kernel launches of one pass over a window of this shape (graph nodes when captured);
        `deep`: DEEP_SOME with a row deep enough for attention_group.cu, DEEP_ALL with every
        row that deep (True counts as DEEP_SOME); `cells`: the KVs' cell types (cell_types)."""
        with self.runtime.active():
            return len(self._plan(num_rows, num_logit_rows, deep, cells).launches)

    def deep_level(self, window: Window) -> int:
        """DEEP_NONE, DEEP_SOME or DEEP_ALL: how many rows of `window` sit at
        attention_deep_from or past it (none, some, every one)."""
        deep_from = self.attention_deep_from
        if deep_from is None or int(window.positions.max()) < deep_from:
            return DEEP_NONE
        return DEEP_ALL if int(window.positions.min()) >= deep_from else DEEP_SOME

    @staticmethod
    def cell_types(window: Window) -> int:
        """CELLS_FP16 | CELLS_INT8: the cell types of `window`'s KVs."""
        cells = 0
        for kv in window.kvs:
            cells |= CELLS_INT8 if kv.is_int8 else CELLS_FP16
        return cells or CELLS_FP16

    # ---- the pass -----------------------------------------------------------------------------
    def forward(self, tokens: np.ndarray, kv: CudaKV, all_logits: bool = False) -> np.ndarray:
        """Run `tokens` at positions kv.num_tokens.. and append their K/V; return the logits
        [T, V] of every row when `all_logits`, else [1, V] of the last row."""
        window = Window.build([(kv, tokens)], logits="all" if all_logits else "last")
        return self.forward_window(window)

    # the forward_window* methods take while_running: engine/expert_tier.py checks this flag
    runs_while_window = True

    def forward_window(self, window: Window, expert_pointers=None,
                       routing_counts: np.ndarray | None = None,
                       while_running=None) -> np.ndarray:
        """One pass over the rows of `window`; returns the logits [N, V] of its logit rows as
        float32 (`window.logits_of(logits, slot)` picks a slot's). `routing_counts` [L, E]
        int64, when given, gets the rows routed to each (layer, expert) added to it.
        `expert_pointers` is the CPU backend's (host pointers): the CUDA model takes None.
        `while_running(is_done)`, when given, is called once the window's work is queued and
        before waiting for it (host work that overlaps the GPU's; `is_done()` tells whether the
        GPU has finished the window); what it queues on the compute stream comes after the
        window's kernels."""
        return self._run(window, want_logits=True, expert_pointers=expert_pointers,
                         routing_counts=routing_counts, while_running=while_running)

    def forward_window_greedy(self, window: Window, expert_pointers=None,
                              routing_counts: np.ndarray | None = None,
                              while_running=None) -> np.ndarray:
        """As forward_window, but returns only the greedy token [N] of each logit row (argmax
        on the device: no logits cross PCIe; -1 for a row that holds a NaN)."""
        return self._run(window, want_logits=False, expert_pointers=expert_pointers,
                         routing_counts=routing_counts, while_running=while_running)

    def forward_window_lazy(self, window: Window, expert_pointers=None,
                            routing_counts: np.ndarray | None = None,
                            while_running=None) -> DeviceLogits:
        """As forward_window, but the logits [N, V] stay on the device until the next pass:
        the sampler takes each row's best candidates from there (backends/cuda/logits.py) and
        `np.asarray` copies them when wanted."""
        return self._run(window, want_logits=False, expert_pointers=expert_pointers,
                         routing_counts=routing_counts, lazy=True, while_running=while_running)

    def profile_window(self, window: Window) -> dict[str, float]:
        """Run `window` launch by launch with CUDA events between them; returns the device
        milliseconds per kernel name (summed over its launches). The KVs are not committed."""
        rt = self.runtime
        self.logit_reader.generation += 1  # the pass overwrites the logits on the device
        with rt.active():
            plan = self._prepare(window)
            if self.tier is not None:
                self.tier.before_run(window.num_rows)  # a CPU pool serves this window too
            events = [rt.drv.Event() for _ in range(len(plan.launches) + 1)]
            events[0].record(rt.stream)
            for i in range(len(plan.launches)):
                plan.launches.launch_one(i, rt.stream_handle)
                events[i + 1].record(rt.stream)
            rt.stream.synchronize()
            if self.tier is not None:
                self.tier.finish(None)
        times: dict[str, float] = {}
        for i, name in enumerate(plan.launches.names()):
            times[name] = times.get(name, 0.0) + events[i].time_till(events[i + 1])
        return times

    def _prepare(self, window: Window) -> WindowPlan:
        """Check the window, pick its plan and upload its descriptor (in the active context)."""
        window.check_current()
        for i, kv in enumerate(window.kvs):
            if not isinstance(kv, CudaKV) or (kv.spec is not self.spec and kv.spec != self.spec):
                raise RequestError(
                    f"slot {i}: its KV cache ({kv!r}) was not made by this CUDA model; make "
                    "every KV of a window with this model's new_kv")
            kv.order_copies(self.runtime.stream)  # a park or restore of its cells still runs
        R, N = window.num_rows, window.num_logit_rows
        plan = self._plan(R, max(N, 1), self.deep_level(window), self.cell_types(window))
        ws = self._ws
        lengths = window.run_lengths()
        ws.host_kv[:R] = np.repeat(np.array([kv.base for kv in window.kvs], dtype=np.uint64),
                                   lengths)
        ws.host_cap[:R] = np.repeat(np.array([kv.capacity for kv in window.kvs],
                                             dtype=np.int32), lengths)
        ws.host_tokens[:R] = window.tokens
        ws.host_pos[:R] = window.positions
        ws.host_logit_rows[:N] = window.logit_rows
        if ws.hybrid:  # each row's sequence state and run (the delta-net kernels' runs)
            ws.host_state[:R] = np.repeat(np.array([kv.state.buffers() for kv in window.kvs],
                                                   dtype=np.uint64).reshape(-1, 4), lengths,
                                          axis=0)
            ws.host_run0[:R] = np.repeat(window.run_starts[:-1], lengths)
            ws.host_run_len[:R] = np.repeat(lengths, lengths)
        if N == 0:
            ws.host_logit_rows[0] = R - 1  # the head still runs over one row; not returned
        self.runtime.drv.memcpy_htod_async(ws.ptr("desc"), ws.host_desc, self.runtime.stream)
        return plan

    def _run(self, window: Window, want_logits: bool, expert_pointers=None,
             routing_counts: np.ndarray | None = None, lazy: bool = False,
             while_running=None):
        if expert_pointers is not None:
            raise ValueError("the CUDA model reads experts through its device tables; pass "
                             "expert_pointers=None (an expert cache is an arena on the device)")
        if not self.experts_resident and self.expert_arena is None:
            raise ConfigError("this CUDA model keeps its experts in host RAM and has no expert "
                              "arena yet; build one with new_expert_arena (the engine does)")
        L, E = self.spec.n_layers, self.spec.n_experts
        if routing_counts is not None:
            if (not isinstance(routing_counts, np.ndarray) or routing_counts.dtype != np.int64
                    or routing_counts.shape != (L, E)):
                raise ValueError(f"routing_counts must be an int64 array of shape {(L, E)}")
            self.enable_routing_counts()
        R, N, rt = window.num_rows, window.num_logit_rows, self.runtime
        tier = self.tier
        self.logit_reader.generation += 1  # the pass overwrites the logits on the device
        with rt.active():
            plan = self._prepare(window)
            ws = self._ws
            if tier is not None:
                tier.before_run(R)
                tier.start_guesses(R)  # a worker serves this window's guessed copies
            plan.run(rt.stream_handle, self.use_graphs and R <= GRAPH_MAX_ROWS)
            if tier is not None:
                tier.issue_guesses()  # (the streamer waits for it before its timeline)
                tier.after_run()
            if lazy or not want_logits:  # (lazy: the greedy ids beside the rows left there)
                out = ws.host_argmax[:max(N, 1)]  # [N]
                rt.drv.memcpy_dtoh_async(out, ws.ptr("argmax"), rt.stream)
            else:
                out = ws.host_logits[:max(N, 1)]  # [N, V]
                rt.drv.memcpy_dtoh_async(out, ws.ptr("logits"), rt.stream)
            if while_running is not None:  # the GPU runs the window meanwhile
                while_running(rt.stream.is_done)
            rt.stream.synchronize()
            if tier is not None:
                tier.finish(routing_counts)
        window.commit()
        if lazy:
            return DeviceLogits(self.logit_reader, 0, N, self.logit_reader.generation,
                                greedy_ids=np.array(out[:N]))
        return np.array(out[:N])
