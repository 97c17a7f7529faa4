"""Guessed copies (docs/offload.md, "Guessed copies"): a streamed prompt window with a CPU pool
guesses each layer's routing one layer early and has the copy engine copy the guessed rare
experts into staging before the layer runs.

Per layer l >= 1 of such a window (shapes: R rows, E experts, L layers):
- compute stream, after layer l - 1's attention: router.cu's predict_logits / predict_topk
  (layer l's router on the residual x [R, H]: pred [E] rows guessed per expert), then
  offload.cu's guess_publish: the rare ones (where CPU) guessed for at least `min_rows` rows
  listed in mapped host memory, and flags [l] = seq;
- host (a worker thread, started on the window before the engine thread queues it: queuing a
  prompt window's thousand launches blocks once the driver's queue is full, while the compute
  stream waits for layer 1's copies; cuda_driver.issue_guessed_copies, GIL released): waits for
  the flag, copies the listed experts' images into their slots of the layer's staging set on
  its own copy stream, then writes landed [l] = seq on that stream;
- compute stream, before layer l's tier_groups: guess_claim makes the guessed experts the
  GPU's (where VRAM), without waiting, so neither the pool nor pull_rare takes them; then
  tier_groups and pool_publish, so the pool starts on the layer while the copies land; then
  guess_point waits for landed [l] and points the layer's tables at the copies, so the
  products read them from VRAM.
Behind the window the host's where is uploaded again (the residency's tables are, by the
streamer). A window queued without `before_run` (seq 0 on the device) does none of it.
"""
from __future__ import annotations

import logging
import queue
import threading

import numpy as np

log = logging.getLogger("strata.tier")

# The least guessed rows that make a rare expert worth a copy (STRATA_GUESS_ROWS=N, 0 off).
# 16: pp512 +9% on the skew-0 synth and a tie on the skew-1 one on an H100, where 8 gained
# 11% and lost 2% (docs/offload.md, "Session 71"); fewer rows take more of the rare experts
# from the CPU pool, which the skew-1 routing keeps busy. Under STRATA_POOL_BUDGET=auto 8 and 16
# tie on skew 0 (4,863 / 4,862, medians of four rounds) and 8 loses on skew 1 (session 82).
GUESS_MIN_ROWS = 16
GUESS_MAX_EXPERTS = 512  # router.cu's predict_topk: 32 x PREDICT_MAX_E_LANE experts
PREDICT_ROWS, PREDICT_WARPS = 8, 8  # router.cu's PREDICT_RT, PREDICT_WARPS
HOST_TIMEOUT_S = 5.0  # the host gives a layer's flag up after this (the device: 5 s too)


def guess_min_rows(env=None) -> int:
    """STRATA_GUESS_ROWS, default GUESS_MIN_ROWS; 0 turns guessed copies off."""
    from strata.backends.cuda.offload import count_setting

    return count_setting("STRATA_GUESS_ROWS", GUESS_MIN_ROWS, "rows", None, env)


class GuessedCopies:
    """Device and mapped host state of the guessed copies: pred [L, E] int32, fetched [L, E]
    uint8, landed [L] uint32 and the window's seq (device); flags [L] int64 and lists
    [L, 1 + E] int32 (mapped host memory the device writes and the host reads); guessed [L]
    int32 and status (device, read back after the window); the copy stream; totals."""

    def __init__(self, rt, L: int, E: int, min_rows: int, host_base: int, slot_bytes: int,
                 image_bytes: np.ndarray, part_off):
        drv = rt.drv
        self._rt, self.L, self.E, self.min_rows = rt, L, E, int(min_rows)
        self.host_base, self.slot_bytes = int(host_base), int(slot_bytes)
        self.image_bytes = np.ascontiguousarray(image_bytes, dtype=np.uint64)
        self._part_off = part_off
        self._pred = rt.upload(np.zeros((L, E), dtype=np.int32))
        self._fetched = rt.upload(np.zeros((L, E), dtype=np.uint8))
        self._landed = rt.upload(np.zeros(L, dtype=np.uint32))
        self._seq = rt.upload(np.zeros(1, dtype=np.int64))
        self.seq_host = rt.pinned((1,), np.int64)
        self.seq_host[0] = 0
        self._zero = rt.pinned((1,), np.int64)
        self._zero[0] = 0
        self._stats = rt.upload(np.zeros(L + 1, dtype=np.int32))  # guessed [L], status
        self.stats_host = rt.pinned((L + 1,), np.int32)
        self.stats_host[:] = 0
        mapped = drv.host_alloc_flags.DEVICEMAP
        self.flags_host = drv.pagelocked_empty((L,), np.int64, mem_flags=mapped)
        self.flags_host[:] = 0
        self.lists_host = drv.pagelocked_empty((L, E + 1), np.int32, mem_flags=mapped)
        self.lists_host[:] = 0
        self._flags_dev = int(self.flags_host.base.get_device_pointer())
        self._lists_dev = int(self.lists_host.base.get_device_pointer())
        self.stream = drv.Stream()
        self.stream_handle = int(self.stream.handle)
        # [L] uint64: each streamed layer's staging set (the streamer fills it before the
        # window's pull bases upload, so before any flag the worker waits for)
        self.stage_bases = rt.pinned((L,), np.uint64)
        self.stage_bases[:] = 0
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._results: queue.SimpleQueue = queue.SimpleQueue()
        self._worker = None
        self.layers = np.zeros(0, dtype=np.int32)  # the layers whose routing is guessed
        self._active = self._issued = False
        self.num_windows = self.num_listed = self.num_routed = self.num_pointed = 0
        self.num_copies = 0
        self.copied_bytes = 0

    # ---- the plan's launches --------------------------------------------------------------
    def set_layers(self, model) -> None:
        """The layers whose routing can be guessed: from the second on, with a float router
        and an FFN norm (predict_logits reads both), H a multiple of 4."""
        H = model.spec.hidden
        self.layers = np.array(
            [i for i, ly in enumerate(model.layers) if i > 0 and H % 4 == 0
             and getattr(ly, "router", None) is not None and ly.router.is_float
             and ly.ffn_norm is not None], dtype=np.int32)

    def guesses_layer(self, layer: int) -> bool:
        return bool((self.layers == layer).any())

    def add_guess(self, plan, model, layer: int, pull_base: int, where_ptr: int,
                  budget_ptr: int = 0, rows_cap: int = 0, expert_cost: int = 0) -> None:
        """After the attention of layer - 1 (x [R, H] its residual): layer's routing guessed and
        its rare guessed experts published (a layer of `layers`). With `budget_ptr` (the layer's
        pool budget, int32 on the device) the guessed experts the pool's budget walk would take
        (offload.cu's count_groups on the guessed rows: `rows_cap`, `expert_cost`) are not."""
        spec, ly = model.spec, model.layers[layer]
        w, H = ly.router, spec.hidden
        E, R, ws = self.E, plan.num_rows, plan._ws
        base = int(pull_base) + 8 * layer
        pred = int(self._pred) + 4 * layer * E
        # logits [R, E] into the router's buffer: layer - 1's router overwrites it next
        plan._add(f"predict_logits_{w.suffix}", (-(-E // PREDICT_WARPS), -(-R // PREDICT_ROWS)),
                  (32 * PREDICT_WARPS,), "PqiiPiPPP",
                  [w.ptr, w.row_bytes, E, H, ws.ptr("x"), R, ly.ffn_norm.ptr, base,
                   ws.ptr("router")])
        plan._add("predict_topk", (-(-R // PREDICT_WARPS),), (32 * PREDICT_WARPS,), "PiiiPP",
                  [ws.ptr("router"), R, E, spec.n_experts_used, base, pred])
        plan._add("guess_publish", (1,), (256,), "PPiiiPPPPPPii",
                  [pred, where_ptr, E, layer, self.min_rows, int(pull_base), int(self._seq),
                   self._lists_dev, self._flags_dev, int(self._fetched) + layer * E,
                   int(budget_ptr), int(rows_cap), int(expert_cost)])

    def add_claim(self, plan, layer: int, pull_base: int, where_ptr: int) -> None:
        """Before the layer's tier_groups, without waiting: its guessed experts the GPU's."""
        plan._add("guess_claim", (1,), (256,), "iPPPPiP",
                  [self.E, int(self._seq), int(self._fetched) + layer * self.E, where_ptr,
                   int(pull_base), layer, int(self._stats) + 4 * self.L])

    def add_point(self, plan, layer: int, pull_base: int, tables_ptr: int) -> None:
        """After the layer's pool_publish: wait for its copies, point the tables there."""
        plan._add("guess_point", (1,), (256,), "iiPPPPPPPPP",
                  [self.E, layer, int(self._seq), int(self._landed),
                   int(self._fetched) + layer * self.E, int(pull_base),
                   self.slot_bytes, int(self._part_off), tables_ptr, int(self._stats),
                   int(self._stats) + 4 * self.L])

    # ---- per window ---------------------------------------------------------------------
    def before_run(self, stream) -> None:
        """Compute stream, before a plan that guesses: the window's seq; the worker starts
        serving it (before the engine thread queues the window)."""
        self.seq_host[0] += 1
        self._rt.drv.memcpy_htod_async(self._seq, self.seq_host, stream)
        if self._worker is None:
            self._worker = threading.Thread(target=self._serve, name="strata-guessed-copies",
                                            daemon=True)
            self._worker.start()
        self._jobs.put(int(self.seq_host[0]))
        self._active = True

    def _serve(self) -> None:
        from strata._native import cuda_driver

        while True:
            seq = self._jobs.get()
            try:
                with self._rt.active():
                    result = cuda_driver.issue_guessed_copies(
                        self.flags_host.ctypes.data, self.lists_host.ctypes.data, self.E,
                        self.layers, seq, self.stage_bases, self.host_base, self.slot_bytes,
                        self.image_bytes, int(self._landed), self.stream_handle,
                        HOST_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - handed to the engine thread (wait)
                result = exc
            self._results.put((seq, result))

    def wait(self) -> None:
        """The window queued (engine thread): wait for the worker's pass over it, add its
        totals; its error raised here."""
        if not self._active or self._issued:
            return
        self._issued = True
        seq, result = self._results.get()
        while seq < int(self.seq_host[0]):  # a window that failed before its wait
            seq, result = self._results.get()
        if isinstance(result, Exception):
            raise result
        listed, copies, nbytes, gave_up = result
        self.num_listed += listed
        self.num_copies += copies
        self.copied_bytes += nbytes
        if gave_up >= 0:
            log.warning("guessed copies: no guess from layer %d of window %d within %.0f s; "
                        "that layer and the rest read their rare experts as before", gave_up,
                        int(self.seq_host[0]), HOST_TIMEOUT_S)

    def after_run(self, stream) -> None:
        """Behind the window: seq 0 again (a plan run without before_run guesses nothing), the
        counts read back and cleared."""
        if not self._active:
            return
        drv = self._rt.drv
        drv.memcpy_htod_async(self._seq, self._zero, stream)
        drv.memcpy_dtoh_async(self.stats_host, self._stats, stream)
        drv.memset_d32_async(self._stats, 0, self.L + 1, stream)

    def finish(self, routed: np.ndarray) -> None:
        """After the synchronize: the window's totals; `routed` [L, E] its routed rows."""
        if not self._active:
            return
        self._active = self._issued = False
        self.num_windows += 1
        for layer in self.layers:  # the lists stay in the mapped memory until the next window
            count = min(int(self.lists_host[layer, 0]), self.E)
            ids = self.lists_host[layer, 1:1 + count]
            if count and self.flags_host[layer] == self.seq_host[0]:
                self.num_routed += int((routed[layer, ids] > 0).sum())
        self.num_pointed += int(self.stats_host[:self.L].sum())
        status = int(self.stats_host[self.L])
        if status:
            log.warning("guessed copies: layer %d of window %d waited 5 s for its copies and "
                        "read its rare experts as before", status - 1, int(self.seq_host[0]))
        self.stats_host[:] = 0
