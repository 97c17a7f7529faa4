"""The KV cache of one sequence in device memory: fp16 cells [L, 2 (K, V), KV, C, D], or int8
cells with one float32 scale per (token, head) after them, with the KVCache interface the
scheduler uses (host copies for parking, append for restoring), and a hybrid model's recurrent
state (backends/cuda/recurrent.py).
"""
from __future__ import annotations

import contextlib

import numpy as np

from strata.backends.cuda.host_memory import PAGE_BYTES, pinned_while
from strata.backends.cuda.host_pool import PinnedPool
from strata.backends.cuda.kv_copies import copier as kv_copier
from strata.backends.cuda.recurrent import DeviceRecurrentState
from strata.engine.kv import SequenceReuse
from strata.engine.recurrent import DEFAULT_CHECKPOINTS
from strata.errors import ConfigError, RequestError
from strata.model.arch import ModelSpec
from strata.model.host_pages import anonymous_array, owns_pages

# L = layers with cells (a hybrid model's attention layers), KV = KV heads,
# C = capacity (tokens), D = head dim, T = rows appended now
CELL_DTYPES = (np.dtype(np.float16), np.dtype(np.int8))


class _Cells:
    """Where cells are, as `_copy_rows` reads a source: (address, capacity, cells bytes)."""

    def __init__(self, address: int, capacity: int, cells_bytes: int):
        self.address, self.capacity, self._cells_bytes = address, capacity, cells_bytes


def int8_cell_dtype(head_dim: int) -> np.dtype:
    """The host form of one int8 (token, head) cell: D int8 codes and their scale
    (value = q * scale, scale = max |value| / 127)."""
    return np.dtype([("q", np.int8, (head_dim,)), ("scale", np.float32)])


class CudaKV(SequenceReuse):
    """K/V cells of one sequence on the GPU. Invariant as KVCache: cells [0, num_tokens) of
    every layer are filled; a forward pass writes cells [num_tokens, num_tokens + T) of every
    layer on the device, and `commit(T)` makes them part of the sequence.

    int8 cells: device bytes int8 [L, 2, KV, C, D], then float32 scales [L, 2, KV, C]; `base`
    (what the kernels get) is the address with bit 0 set, which tells them the cells are int8.
    Host copies (`keys`, `values`, `append`) are then `int8_cell_dtype(D)` arrays [KV, n]."""

    # Parking or restoring copies the whole KV between the GPU and host RAM. H200, synth
    # Qwen3-30B-A3B, experts in RAM (session 66, tools/bench_agents.py with a shared system
    # prompt): a park into a kept pinned block plus its restore ~9 us a cell, reading a token
    # again ~135 us (less with experts in VRAM); the first parks of a run pin fresh blocks.
    # So a park or restore pays from about a tenth of the cells at stake (0.25 until then
    # dropped the own turns of agents whose shared system prompt was over 3x as long).
    min_copy_gain = 0.1

    def __init__(self, runtime, spec: ModelSpec, capacity_tokens: int, dtype=np.float16,
                 max_checkpoints: int = DEFAULT_CHECKPOINTS):
        capacity_tokens = int(capacity_tokens)
        if capacity_tokens <= 0:
            raise ConfigError(
                f"KV cache capacity {capacity_tokens} tokens must be positive; give a context "
                "size of at least 1")
        if np.dtype(dtype) not in CELL_DTYPES:
            raise ConfigError(f"the CUDA backend keeps KV cells as float16 or int8, not "
                              f"{np.dtype(dtype).name}")
        self.spec = spec
        self.dtype = np.dtype(dtype)  # of the cells (int8 cells also carry scales)
        self.is_int8 = self.dtype == np.int8
        self.host_dtype = int8_cell_dtype(spec.head_dim) if self.is_int8 else self.dtype
        self.capacity = capacity_tokens
        self.num_tokens = 0
        self._rt = runtime
        self._shape = (len(spec.attention_layers), 2, spec.n_kv_heads, capacity_tokens,
                       spec.head_dim)
        self._cells_bytes = int(np.prod(self._shape)) * self.dtype.itemsize
        self._buf = runtime.alloc(max(self.nbytes, 256))  # a stage may hold no attention layer
        self._own_capacity = capacity_tokens  # what _buf holds (rehome goes back to it)
        self.address = int(self._buf)  # device address of cell [0, 0, 0, 0, 0]
        self.base = self.address | int(self.is_int8)
        self.state = (DeviceRecurrentState(runtime, spec, max_checkpoints)
                      if spec.recurrent_layers else None)
        self._landings = []  # copies of the cells queued on the copy stream (kv_copies.py)

    @property
    def num_layers(self) -> int:
        """Layers with cells (a hybrid model's attention layers)."""
        return self._shape[0]

    @property
    def nbytes(self) -> int:
        scales = 4 * int(np.prod(self._shape[:4])) if self.is_int8 else 0
        return self._cells_bytes + scales

    @staticmethod
    def nbytes_for(spec: ModelSpec, capacity_tokens: int, dtype=np.float16) -> int:
        """Bytes of the cells (and int8 scales) of a KV of `capacity_tokens`."""
        rows = len(spec.attention_layers) * 2 * spec.n_kv_heads * int(capacity_tokens)
        if np.dtype(dtype) == np.int8:
            return rows * (spec.head_dim + 4)
        return rows * spec.head_dim * np.dtype(dtype).itemsize

    # KV grow may move the cells into a run that overlaps the one they are in (experts/kv_grow.py)
    rehome_overlap_safe = True

    def rehome(self, capacity_tokens: int, address: int | None = None) -> None:
        """Move the committed cells into `capacity_tokens` cells at device `address` (at least
        `nbytes_for` bytes, e.g. expert-cache slots lent by KV grow), or back into the KV's
        own allocation when None. Copies on the compute stream, after every kernel issued so
        far (which may still read the old cells); cells [0, num_tokens) are copied exactly,
        also where the new cells overlap the old ones (through a staging copy of them)."""
        capacity_tokens = int(capacity_tokens)
        if address is None:
            address = int(self._buf)
            if capacity_tokens > self._own_capacity:
                raise ValueError(f"the KV's own cells hold {self._own_capacity} tokens, not "
                                 f"{capacity_tokens}; give an address for more")
        if not self.num_tokens <= capacity_tokens:
            raise ValueError(f"cannot move a KV of {self.num_tokens} tokens into "
                             f"{capacity_tokens} cells")
        rows = self.num_layers * 2 * self.spec.n_kv_heads  # (layer, K/V, head) rows
        new_cells_bytes = rows * capacity_tokens * self.spec.head_dim * self.dtype.itemsize
        source, staging, n = self, None, self.num_tokens
        new_end = int(address) + self.nbytes_for(self.spec, capacity_tokens, self.dtype)
        if n and int(address) < self.address + self.nbytes and self.address < new_end:
            # the new cells overlap the old (a KV growing its lent run in place): a row copied
            # into them could overwrite rows not copied yet, so stage the cells elsewhere first
            with self._rt.active():
                staging = self._rt.alloc(max(self.nbytes_for(self.spec, n, self.dtype), 256))
            staged_bytes = rows * n * self.spec.head_dim * self.dtype.itemsize
            self._copy_rows((int(staging), n, staged_bytes), self, n)
            source = _Cells(int(staging), n, staged_bytes)
        self._copy_rows((int(address), capacity_tokens, new_cells_bytes), source,
                        n)  # the old cells (and the staging) may be reused from here
        del staging
        self.capacity = capacity_tokens
        self._shape = self._shape[:3] + (capacity_tokens,) + self._shape[4:]
        self._cells_bytes = new_cells_bytes
        self.address = int(address)
        self.base = self.address | int(self.is_int8)

    def _copy_rows(self, dst: tuple[int, int, int], src: "CudaKV", num_tokens: int) -> None:
        """Device copies of cells [0, num_tokens) of every (layer, K/V, head) row of `src`
        (and their int8 scales) into the cells at `dst` = (address, capacity, cells bytes),
        on the compute stream after every kernel issued so far; returns once they landed."""
        address, capacity, cells_bytes = dst
        self.settle()
        rows = self.num_layers * 2 * self.spec.n_kv_heads
        row_bytes = self.spec.head_dim * self.dtype.itemsize
        rt = self._rt
        with rt.active():
            for row in range(rows if num_tokens else 0):
                rt.drv.memcpy_dtod_async(address + row * capacity * row_bytes,
                                         src.address + row * src.capacity * row_bytes,
                                         num_tokens * row_bytes, rt.stream)
                if self.is_int8:
                    rt.drv.memcpy_dtod_async(
                        address + cells_bytes + 4 * row * capacity,
                        src.address + src._cells_bytes + 4 * row * src.capacity,
                        4 * num_tokens, rt.stream)
            rt.stream.synchronize()

    def copy_prefix(self, source, num_tokens: int) -> None:
        """`source`'s first `num_tokens` cells (a busy slot's shared prefix), copied on the
        device when it is a KV of the same GPU and cell type (no trip through host RAM)."""
        if not (isinstance(source, CudaKV) and source._rt is self._rt
                and source.dtype == self.dtype and source._shape[:3] == self._shape[:3]
                and source.state is None and self.state is None):
            super().copy_prefix(source, num_tokens)
            return
        self.truncate(0)
        self.check_room(num_tokens)
        self._copy_rows((self.address, self.capacity, self._cells_bytes), source, num_tokens)
        self.commit(num_tokens)

    def export_prefix(self, num_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """Host copies of the first `num_tokens` cells of every layer, (keys, values) each
        [L, KV, n, D] (int8 cells: [L, KV, n] of `host_dtype`), landed when it returns."""
        k, v, landing = self.park_prefix(num_tokens)
        if landing is not None:
            landing.wait()
        return k, v

    def park_prefix(self, num_tokens: int):
        """(keys, values, landing) as `export_prefix`, but the copies into a kept pinned block
        are only queued (kv_copies.py): the arrays hold the cells once `landing` is done (None:
        they do now). The other slots' windows run meanwhile; this KV's next window waits."""
        if self.is_int8:
            return self._park_int8(int(num_tokens))
        L, KV, D, n = self.num_layers, self.spec.n_kv_heads, self.spec.head_dim, num_tokens
        nbytes = 2 * L * KV * n * D * self.dtype.itemsize
        # [K/V, L, KV, n, D] in a pinned block kept from an earlier park (host_pool.py; a new
        # one is pinned by the copy thread before the copies), else in memory asked for huge
        # pages and pinned for the copies: gigabytes copied into fresh pageable 4 KiB pages
        # fault each one in (the copy ran at ~2 GB/s so)
        with self._rt.active():
            got = _host_pool(self._rt).lease_to_pin(nbytes) if nbytes else None
        is_kept = got is not None
        out, pin = got if is_kept else (None, None)
        pinned = contextlib.nullcontext()
        if not is_kept:
            out = anonymous_array(nbytes)
            out[::PAGE_BYTES] = 0  # the pages come in (huge ones where the kernel gives them)
            pinned = self.host_copies(out)
        out = out.view(self.dtype).reshape(2, L, KV, n, D)
        head_bytes = n * D * self.dtype.itemsize
        copies = [(self._rt.drv.memcpy_dtoh_async, out[kind, layer, j],
                   self._cell_address(layer, kind, j, 0), head_bytes)
                  for layer in range(L if n else 0) for kind in (0, 1) for j in range(KV)]
        with self._rt.active(), pinned:
            around = None if pin is None else _calling_first(pin)
            landing = self._landed(kv_copier(self._rt).submit(copies, out, in_pieces=True,
                                                              around=around))
            if not is_kept:  # unpinned when `pinned` ends: the copies land first
                landing.wait()
                landing = None
        return out[0], out[1], landing

    def _park_int8(self, n: int):
        """park_prefix of int8 cells: codes and scales copied into a pinned pool block (queued
        as fp16 cells are), then gathered into the records [2, L, KV, n] of `host_dtype` by the
        copy thread once they have landed; the block goes back to the pool after that."""
        L, KV, D = self.num_layers, self.spec.n_kv_heads, self.spec.head_dim
        if not (L and n):
            return (*super().export_prefix(n), None)
        with self._rt.active():
            got = _host_pool(self._rt).lease_to_pin(_int8_block_bytes(L, KV, n, D))
        if got is None:  # no pinned block to be had: copied and gathered here
            return (*super().export_prefix(n), None)
        raw, pin = got
        codes, scales = _int8_parts(raw, L, KV, n, D)
        out = anonymous_array(2 * L * KV * n * self.host_dtype.itemsize)
        out = out.view(self.host_dtype).reshape(2, L, KV, n)

        def gather():
            out["q"] = codes
            out["scale"] = scales

        copies = self._int8_copies(self._rt.drv.memcpy_dtoh_async, codes, scales, n, to_host=True)
        with self._rt.active():
            around = None if pin is None else _calling_first(pin)
            landing = self._landed(kv_copier(self._rt).submit(
                copies, (raw, out), in_pieces=True, around=around, then=gather))
        return out[0], out[1], landing

    def _restore_int8(self, keys: np.ndarray, values: np.ndarray, n: int) -> bool:
        """restore_cells of int8 records: the copy thread takes codes and scales out of them
        into a pinned pool block, then copies those; False (nothing done) when the records are
        not this KV's kind or no pinned block is to be had."""
        L, KV, D = self.num_layers, self.spec.n_kv_heads, self.spec.head_dim
        fits = all(a.dtype == self.host_dtype and a.ndim == 3 and a.shape[:2] == (L, KV)
                   and a.shape[2] >= n for a in (keys, values))
        if not (fits and L):
            return False  # (the engine thread's path names what is wrong)
        with self._rt.active():
            got = _host_pool(self._rt).lease_to_pin(_int8_block_bytes(L, KV, n, D))
        if got is None:
            return False
        raw, pin = got
        codes, scales = _int8_parts(raw, L, KV, n, D)

        def scatter():
            for kind, records in ((0, keys), (1, values)):
                part = records[:, :, :n]
                codes[kind] = part["q"]
                scales[kind] = part["scale"]

        self.truncate(0)
        self.check_room(n)
        copies = self._int8_copies(self._rt.drv.memcpy_htod_async, codes, scales, n,
                                   to_host=False)
        with self._rt.active():
            around = None if pin is None else _calling_first(pin)
            self._landed(kv_copier(self._rt).submit(
                copies, (raw, keys, values), in_pieces=False, around=around, before=scatter))
        self.commit(n)
        return True

    def _int8_copies(self, function, codes, scales, n: int, to_host: bool) -> list:
        """The copies of cells [0, n) of every (layer, K/V, head) row, codes and scales,
        between the device and `codes` [2, L, KV, n, D] / `scales` [2, L, KV, n]."""
        D, copies = self.spec.head_dim, []
        for layer in range(self.num_layers):
            for kind in (0, 1):
                for j in range(self.spec.n_kv_heads):
                    pairs = ((self._cell_address(layer, kind, j, 0), codes[kind, layer, j], n * D),
                             (self._scale_address(layer, kind, j, 0), scales[kind, layer, j],
                              4 * n))
                    for address, host, nbytes in pairs:
                        copies.append((function, host, address, nbytes) if to_host
                                      else (function, address, host, nbytes))
        return copies

    def restore_cells(self, keys: np.ndarray, values: np.ndarray, num_tokens: int) -> None:
        """Hold the first `num_tokens` cells of a parked conversation. The copies are only
        queued (kv_copies.py): this KV's next window waits for them, the other slots' do not.
        From a kept pinned block (a park of this GPU) they run behind the park that filled it;
        from memory of its own mapping (a conversation file's or a slot file's cells,
        kv_file.read_kv_file) the copy thread pins it around them, or, for a prefix of the
        file's cells, gathers them into a pinned pool block (`_restore_gathered`). int8
        records go through a pinned pool block the copy thread fills first (`_restore_int8`).
        fp16 cells in the heap (small arrays; pinning whole pages there would pin other
        arrays' bytes too) are copied here."""
        n = int(num_tokens)
        if self.is_int8 and n and self._restore_int8(keys, values, n):
            return
        if self.is_int8 or not n:
            super().restore_cells(keys, values, n)
            return
        is_kept = _host_pool(self._rt).holds(keys, values)
        if not (is_kept or (owns_pages(keys) and owns_pages(values))):
            super().restore_cells(keys, values, n)
            return
        if not is_kept and self._restore_gathered(keys, values, n):
            return
        self.truncate(0)
        self.check_room(n)
        # (a file's mapping: pinned on the copy thread, ~0.4 s a 2.5 GiB, and unpinned there)
        around = None if is_kept else pinned_while(keys, values)
        with self._rt.active():
            self._landed(kv_copier(self._rt).submit(self._fp16_copies(keys, values, n),
                                                    (keys, values), in_pieces=False,
                                                    around=around))
        self.commit(n)

    def _fp16_copies(self, keys: np.ndarray, values: np.ndarray, n: int) -> list:
        """The copies host -> device of cells [0, n) of every (layer, K/V, head) row of `keys`
        / `values` [L, KV, n', D]: a head's [n, D] block is contiguous in them."""
        return [(self._rt.drv.memcpy_htod_async, self._cell_address(layer, kind, j, 0),
                 src[layer, j, :n], src[layer, j, :n].nbytes)
                for layer in range(self.num_layers) for kind, src in ((0, keys), (1, values))
                for j in range(self.spec.n_kv_heads)]

    def _restore_gathered(self, keys: np.ndarray, values: np.ndarray, n: int) -> bool:
        """restore_cells of the first `n` of a file's longer fp16 cells (a prefix lent from a
        conversation file): the copy thread gathers them into a pinned pool block, then
        copies those, instead of pinning the file's whole arrays for a prefix of any length.
        False (nothing done) for a whole file's cells, arrays not of this KV's shape, or no
        pinned block to be had."""
        L, KV, D = self.num_layers, self.spec.n_kv_heads, self.spec.head_dim
        fits = all(a.dtype == self.dtype and a.ndim == 4 and a.shape[:2] == (L, KV)
                   and a.shape[3] == D for a in (keys, values))
        if not (fits and L and n < keys.shape[2] and n <= values.shape[2]):
            return False
        nbytes = 2 * L * KV * n * D * self.dtype.itemsize
        with self._rt.active():
            got = _host_pool(self._rt).lease_to_pin(nbytes)
        if got is None:
            return False
        raw, pin = got
        cells = raw[:nbytes].view(self.dtype).reshape(2, L, KV, n, D)

        def gather():
            cells[0] = keys[:, :, :n]
            cells[1] = values[:, :, :n]

        self.truncate(0)
        self.check_room(n)
        with self._rt.active():
            around = None if pin is None else _calling_first(pin)
            self._landed(kv_copier(self._rt).submit(
                self._fp16_copies(cells[0], cells[1], n), (raw, keys, values), in_pieces=False,
                around=around, before=gather))
        self.commit(n)
        return True

    def _landed(self, landing):
        self._landings = [x for x in self._landings if not x.done()] + [landing]
        return landing

    def copies_pending(self) -> bool:
        """Whether copies into or out of this KV's cells are still running (kv_copies.py)."""
        self._landings = [x for x in self._landings if not x.done()]
        return bool(self._landings)

    def order_copies(self, stream) -> None:
        """Work queued on `stream` from now on (a window that runs this KV) comes after the
        copies into or out of its cells."""
        for landing in self._landings:
            landing.order(stream)

    def settle(self) -> None:
        """Wait for every KV copy of this context handed over so far: a synchronous copy (the
        legacy stream) is not ordered after the copy stream."""
        if getattr(self._rt, "kv_copier", None) is not None:
            self._rt.kv_copier.settle()
        self._landings = []

    def host_copies(self, *arrays):
        """The copies of `arrays` run pinned (DMA) in this KV's context; int8 cells go
        through gathered temporaries, so they are left as they are."""
        if self.is_int8:
            return super().host_copies(*arrays)
        return _in_context(self._rt, pinned_while(*arrays))

    def _head(self, layer: int, kind: int, head: int) -> int:
        return (layer * 2 + kind) * self.spec.n_kv_heads + head

    def _cell_address(self, layer: int, kind: int, head: int, cell: int) -> int:
        index = self._head(layer, kind, head) * self.capacity + cell
        return self.address + index * self.spec.head_dim * self.dtype.itemsize

    def _scale_address(self, layer: int, kind: int, head: int, cell: int) -> int:
        index = self._head(layer, kind, head) * self.capacity + cell
        return self.address + self._cells_bytes + 4 * index

    def _read(self, layer: int, kind: int) -> np.ndarray:
        KV, D, n = self.spec.n_kv_heads, self.spec.head_dim, self.num_tokens
        self.settle()
        out = np.empty((KV, n), dtype=self.host_dtype)  # [KV, num_tokens] (int8 cells)
        cells = np.empty((KV, n, D), dtype=self.dtype)  # [KV, num_tokens, D]
        if n:
            with self._rt.active():
                for j in range(KV):
                    self._rt.drv.memcpy_dtoh(cells[j], self._cell_address(layer, kind, j, 0))
                    if self.is_int8:
                        scales = np.empty(n, dtype=np.float32)
                        self._rt.drv.memcpy_dtoh(scales, self._scale_address(layer, kind, j, 0))
                        out[j]["scale"] = scales
        if not self.is_int8:
            return cells
        out["q"] = cells
        return out

    def keys(self, layer: int) -> np.ndarray:
        """A host copy of `layer`'s committed keys: [KV, num_tokens, D] fp16, or [KV,
        num_tokens] of `host_dtype` (codes and scale) for int8 cells."""
        return self._read(layer, 0)

    def values(self, layer: int) -> np.ndarray:
        return self._read(layer, 1)

    def append(self, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        """Write k, v (as `keys` returns them, T tokens) after the committed tokens of `layer`
        (restoring a parked conversation); `commit(T)` once every layer has them."""
        num_new = int(k.shape[1])
        self.check_room(num_new)
        KV, D = self.spec.n_kv_heads, self.spec.head_dim
        expected = (KV, num_new) if self.is_int8 else (KV, num_new, D)
        for name, src in (("k", k), ("v", v)):
            if tuple(src.shape) != expected or (self.is_int8 and src.dtype != self.host_dtype):
                raise RequestError(
                    f"KV append takes {name} of shape {expected}"
                    f"{' and dtype ' + str(self.host_dtype) if self.is_int8 else ''}, got "
                    f"{tuple(src.shape)} {src.dtype}; restore a conversation into a KV of the "
                    "cell type it was parked from")
        self.settle()
        with self._rt.active():
            for kind, src in ((0, k), (1, v)):
                for j in range(KV if num_new else 0):
                    # a head's [T, D] block: contiguous in a parked [KV, n, D] array cut to T
                    # tokens, so copied as it is
                    head = src[j]
                    cells = head["q"] if self.is_int8 else head
                    self._rt.drv.memcpy_htod(
                        self._cell_address(layer, kind, j, self.num_tokens),
                        np.ascontiguousarray(cells, dtype=self.dtype))
                    if self.is_int8:
                        self._rt.drv.memcpy_htod(
                            self._scale_address(layer, kind, j, self.num_tokens),
                            np.ascontiguousarray(head["scale"]))

    def commit(self, num_new_tokens: int) -> None:
        """Make the rows written to every layer part of the sequence."""
        self.check_room(num_new_tokens)
        self.num_tokens += int(num_new_tokens)

    def __repr__(self) -> str:
        cells = "int8 + scales" if self.is_int8 else "float16"
        return (f"CudaKV({self.num_tokens}/{self.capacity} tokens, {self.num_layers} layers, "
                f"{cells} on the GPU)")


def _int8_block_bytes(L: int, KV: int, n: int, D: int) -> int:
    """Bytes of a pinned block holding int8 cells' codes [2, L, KV, n, D] and, from the next
    64-byte boundary, their scales [2, L, KV, n] float32."""
    return -(-2 * L * KV * n * D // 64) * 64 + 8 * L * KV * n


def _int8_parts(raw: np.ndarray, L: int, KV: int, n: int, D: int):
    """(codes, scales) views of a block of `_int8_block_bytes`."""
    codes_bytes = 2 * L * KV * n * D
    at = -(-codes_bytes // 64) * 64
    codes = raw[:codes_bytes].view(np.int8).reshape(2, L, KV, n, D)
    scales = raw[at:at + 8 * L * KV * n].view(np.float32).reshape(2, L, KV, n)
    return codes, scales


def _host_pool(rt) -> PinnedPool:
    """The pinned blocks parks reuse, one pool per GPU context."""
    pool = getattr(rt, "kv_host_pool", None)
    if pool is None:
        pool = rt.kv_host_pool = PinnedPool(rt)
    return pool


@contextlib.contextmanager
def _calling_first(function):
    """A context that calls `function` when entered (a fresh block's pin, on the copy
    thread)."""
    function()
    yield


@contextlib.contextmanager
def _in_context(rt, copies):
    """`copies` entered and left with `rt`'s context current (pins belong to a context)."""
    with rt.active(), copies:
        yield
