"""CudaModel: the CPU model's interface (new_kv, forward, forward_window, spec) with every
layer on one GPU. A window uploads one descriptor and runs its shape's plan: decode-sized
windows replay a captured CUDA graph, larger ones run the prepared launch list.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np

from strata.backends.cuda.kv import CudaKV
from strata.backends.cuda.plan import WindowPlan, Workspace
from strata.backends.cuda.runtime import Runtime
from strata.backends.cuda.weights import (DeviceLayer, DeviceMatrix, DeviceVector, small_values,
                                          weight_bytes)
from strata.backends.window import Window
from strata.errors import ConfigError, RequestError
from strata.model.gguf_file import GGUFModel

GRAPH_MAX_ROWS = 16      # windows of at most this many rows replay a captured graph
_MIN_WORKSPACE_ROWS = 64
_MAX_PLANS = 32          # window shapes whose launches (and graphs) are kept
_VRAM_RESERVE_BYTES = 512 << 20  # left free for the workspace, KV and the driver


class _GateRow:
    """The shared expert's [H] gate as a one-row F32 matrix for the product kernels."""

    suffix, is_float, expert_bytes, table_ptr, rows = "f32", True, 0, 0, 1

    def __init__(self, vec: DeviceVector):
        self.ptr, self.cols, self.row_bytes = vec.ptr, vec.size, 4 * vec.size
        self._vec = vec


class CudaModel:
    """Runs a GGUF MoE model on one GPU. `forward_window` takes the next rows of several
    sequences (KVs made by `new_kv`) in one pass; `forward` the next tokens of one sequence."""

    def __init__(self, gguf_model: GGUFModel, device: int | None = None):
        self.gguf = gguf_model
        self.spec = spec = gguf_model.spec
        self.runtime = rt = Runtime(device)
        need = weight_bytes(gguf_model)
        free, total = rt.free_bytes()
        if need + _VRAM_RESERVE_BYTES > free:
            raise ConfigError(
                f"the model's tensors need {need / 2**30:.2f} GiB of VRAM (+ "
                f"{_VRAM_RESERVE_BYTES >> 20} MiB for work buffers) but {rt.name} has "
                f"{free / 2**30:.2f} GiB free of {total / 2**30:.2f} GiB; use a smaller "
                "quantisation, free the GPU, or run with --device cpu")
        self.embd = DeviceMatrix(rt, gguf_model.tensor("token_embd.weight"))
        self.layers = [DeviceLayer(rt, gguf_model, spec, i) for i in range(spec.n_layers)]
        self.out_norm = DeviceVector(rt, small_values(gguf_model.tensor("output_norm.weight")))
        head = "token_embd.weight" if spec.tied_output else "output.weight"
        self.head = self.embd if spec.tied_output else DeviceMatrix(rt, gguf_model.tensor(head))
        self.shexp_gate_rows = [_GateRow(ly.shexp_gate) if ly.shexp_gate is not None else None
                                for ly in self.layers]
        # as the CPU backend: inverse frequencies in float32, as torch computes them
        exps = np.arange(0, spec.head_dim, 2, dtype=np.float32) / np.float32(spec.head_dim)
        self.inv_freq = DeviceVector(rt, 1.0 / np.power(np.float32(spec.rope_theta), exps))
        self.eps = float(np.float32(spec.rms_eps))
        self.attn_scale = float(np.float32(spec.head_dim ** -0.5))
        mats = [self.head] + [m for ly in self.layers for m in
                              (ly.wq, ly.wk, ly.wv, ly.router, ly.gate_exps, ly.shexp_w_gate)
                              if m is not None]
        # the normed rows are also quantised when a product over H reads 8-bit activations
        self.quantize_h = any(not m.is_float for m in mats)
        if spec.head_dim % 8 or spec.head_dim > 256:
            raise ConfigError(f"head dim {spec.head_dim}: the CUDA attention kernel takes a "
                              "multiple of 8 up to 256; run this model with --device cpu")
        if self.quantize_h and (spec.hidden % 32 or spec.q_dim % 32):
            raise ConfigError(f"hidden {spec.hidden} / q_dim {spec.q_dim} must be multiples of "
                              "32 for quantised weights on the CUDA backend")
        self._ws: Workspace | None = None
        self._plans: OrderedDict[tuple[int, int], WindowPlan] = OrderedDict()
        self.use_graphs = True

    # ---- KV ---------------------------------------------------------------------------------
    def new_kv(self, capacity_tokens: int, dtype=None) -> CudaKV:
        """An empty device KV cache for one sequence (fp16 cells)."""
        if dtype is not None and np.dtype(dtype) != np.float16:
            raise ConfigError(f"the CUDA backend keeps KV cells in float16, not "
                              f"{np.dtype(dtype).name}; leave dtype unset")
        if capacity_tokens > self.spec.context_length:
            raise ConfigError(
                f"context of {capacity_tokens} tokens exceeds the model's "
                f"{self.spec.context_length}; ask for at most {self.spec.context_length}")
        with self.runtime.active():
            return CudaKV(self.runtime, self.spec, capacity_tokens)

    # ---- plans --------------------------------------------------------------------------------
    def _plan(self, num_rows: int, num_logit_rows: int) -> WindowPlan:
        if self._ws is None or self._ws.max_rows < num_rows:
            rows = max(_MIN_WORKSPACE_ROWS, 1 << (num_rows - 1).bit_length())
            self._plans.clear()  # their addresses point into the old workspace
            self._ws = None
            self._ws = Workspace(self.runtime, self.spec, rows)
        key = (num_rows, num_logit_rows)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = WindowPlan(self, self._ws, num_rows, num_logit_rows)
            if len(self._plans) > _MAX_PLANS:
                self._plans.popitem(last=False)
        self._plans.move_to_end(key)
        return plan

    def launches_per_window(self, num_rows: int = 1, num_logit_rows: int = 1) -> int:
        """Kernel launches of one pass over a window of this shape (graph nodes when captured)."""
        with self.runtime.active():
            return len(self._plan(num_rows, num_logit_rows).launches)

    # ---- the pass -----------------------------------------------------------------------------
    def forward(self, tokens: np.ndarray, kv: CudaKV, all_logits: bool = False) -> np.ndarray:
        """Run `tokens` at positions kv.num_tokens.. and append their K/V; return the logits
        [T, V] of every row when `all_logits`, else [1, V] of the last row."""
        window = Window.build([(kv, tokens)], logits="all" if all_logits else "last")
        return self.forward_window(window)

    def forward_window(self, window: Window) -> np.ndarray:
        """One pass over the rows of `window`; returns the logits [N, V] of its logit rows as
        float32 (`window.logits_of(logits, slot)` picks a slot's)."""
        return self._run(window, want_logits=True)

    def forward_window_greedy(self, window: Window) -> np.ndarray:
        """As forward_window, but returns only the greedy token [N] of each logit row (argmax
        on the device: no logits cross PCIe)."""
        return self._run(window, want_logits=False)

    def profile_window(self, window: Window) -> dict[str, float]:
        """Run `window` launch by launch with CUDA events between them; returns the device
        milliseconds per kernel name (summed over its launches). The KVs are not committed."""
        rt = self.runtime
        with rt.active():
            plan = self._prepare(window)
            events = [rt.drv.Event() for _ in range(len(plan.launches) + 1)]
            events[0].record(rt.stream)
            for i in range(len(plan.launches)):
                plan.launches.launch_one(i, rt.stream_handle)
                events[i + 1].record(rt.stream)
            rt.stream.synchronize()
        times: dict[str, float] = {}
        for i, name in enumerate(plan.launches.names()):
            times[name] = times.get(name, 0.0) + events[i].time_till(events[i + 1])
        return times

    def _prepare(self, window: Window) -> WindowPlan:
        """Check the window, pick its plan and upload its descriptor (in the active context)."""
        window.check_current()
        for i, kv in enumerate(window.kvs):
            if not isinstance(kv, CudaKV) or kv.spec != self.spec:
                raise RequestError(
                    f"slot {i}: its KV cache ({kv!r}) was not made by this CUDA model; make "
                    "every KV of a window with this model's new_kv")
        R, N = window.num_rows, window.num_logit_rows
        plan = self._plan(R, max(N, 1))
        ws = self._ws
        lengths = window.run_lengths()
        ws.host_kv[:R] = np.repeat(np.array([kv.base for kv in window.kvs], dtype=np.uint64),
                                   lengths)
        ws.host_cap[:R] = np.repeat(np.array([kv.capacity for kv in window.kvs],
                                             dtype=np.int32), lengths)
        ws.host_tokens[:R] = window.tokens
        ws.host_pos[:R] = window.positions
        ws.host_logit_rows[:N] = window.logit_rows
        if N == 0:
            ws.host_logit_rows[0] = R - 1  # the head still runs over one row; not returned
        self.runtime.drv.memcpy_htod_async(ws.ptr("desc"), ws.host_desc, self.runtime.stream)
        return plan

    def _run(self, window: Window, want_logits: bool) -> np.ndarray:
        R, N, rt = window.num_rows, window.num_logit_rows, self.runtime
        with rt.active():
            plan = self._prepare(window)
            ws = self._ws
            plan.run(rt.stream_handle, self.use_graphs and R <= GRAPH_MAX_ROWS)
            if want_logits:
                out = ws.host_logits[:max(N, 1)]  # [N, V]
                rt.drv.memcpy_dtoh_async(out, ws.ptr("logits"), rt.stream)
            else:
                out = ws.host_argmax[:max(N, 1)]  # [N]
                rt.drv.memcpy_dtoh_async(out, ws.ptr("argmax"), rt.stream)
            rt.stream.synchronize()
        window.commit()
        return np.array(out[:N])
