"""The KV cache of one sequence: per attention layer K and V cells, float32 or float16, and in a
hybrid model (qwen3next) the recurrent layers' state. The native window loop writes a pass's rows
into `cells` layer by layer; the pass commits them once all layers ran.
"""
from __future__ import annotations

import contextlib

import numpy as np

from strata._native.kernels import KV_KEY_TILE
from strata.engine.recurrent import DEFAULT_CHECKPOINTS, RecurrentState
from strata.errors import ConfigError, RequestError
from strata.model.arch import ModelSpec
from strata.model.host_pages import anonymous_array

# L = attention layers (every layer but a hybrid model's recurrent ones), KV = KV heads,
# C = capacity (tokens), D = head dim, T = rows appended now,
# NT = key tiles (C / KV_KEY_TILE rounded up), TILE = KV_KEY_TILE

CELL_DTYPES = (np.dtype(np.float32), np.dtype(np.float16))


class SequenceReuse:
    """The reuse side of one sequence's KV, on either backend: how far back a new prompt can
    take it, and a hybrid model's recurrent `state` (None otherwise: any prefix of the tokens
    can be kept) with its checkpoints, for parking and restoring; and the room left. Needs
    `num_tokens` and `capacity`."""

    state = None
    # A placement parks a slot's KV, or restores a parked one over the slot's own prefix, only
    # where that keeps at least this share of the cells it copies that the slot would lose or
    # lacks. Host KV: any (a memory copy costs far less than reading the tokens again on the
    # CPU). Device KV overrides it: its copies cross PCIe.
    min_copy_gain = 0.0

    def fill_cells(self, layers, num_tokens: int) -> None:
        """Hold the first `num_tokens` cells of `layers`: (keys, values) per layer, as a KV's
        `keys(layer)` / `values(layer)` give them ([KV, n, D] or int8 cells [KV, n])."""
        self.truncate(0)
        for layer, (k, v) in enumerate(layers):
            self.append(layer, k[:, :num_tokens], v[:, :num_tokens])
        self.commit(num_tokens)

    def restore_cells(self, keys: np.ndarray, values: np.ndarray, num_tokens: int) -> None:
        """Hold the first `num_tokens` cells of a parked conversation's `keys` and `values`
        ([L, KV, n, D], or int8 cells [L, KV, n]), copied while `host_copies` holds."""
        with self.host_copies(keys, values):
            self.fill_cells(zip(keys, values), num_tokens)

    def host_copies(self, *arrays):
        """A context for copies between this KV and the host `arrays` (a device KV pins their
        pages meanwhile); nothing here."""
        return contextlib.nullcontext()

    def copy_prefix(self, source, num_tokens: int) -> None:
        """Hold `source`'s first `num_tokens` cells (a busy slot's shared prefix)."""
        self.fill_cells(((source.keys(layer), source.values(layer))
                         for layer in range(source.num_layers)), num_tokens)

    def export_prefix(self, num_tokens: int):
        """Host copies of the first `num_tokens` cells of every layer for parking: (keys,
        values), each [L, KV, n, D] (a device KV's int8 cells: [L, KV, n] of codes and
        scales), in memory asked for huge pages: a park of gigabytes into fresh 4 KiB pages
        spends most of its time faulting them in."""
        L = self.num_layers
        if L == 0:  # a model (or stage) without attention layers
            empty = np.empty((0, self.spec.n_kv_heads, num_tokens, self.spec.head_dim))
            return empty, empty
        first = self.values(0)[:, :num_tokens]
        shape = (2, L) + first.shape  # [K/V, L, KV, n, D]
        out = anonymous_array(int(np.prod(shape)) * first.dtype.itemsize)
        out = out.view(first.dtype).reshape(shape)
        for layer in range(L):
            out[0, layer] = self.keys(layer)[:, :num_tokens]
            out[1, layer] = self.values(layer)[:, :num_tokens]
        return out[0], out[1]

    def park_prefix(self, num_tokens: int):
        """(keys, values, landing): `export_prefix`'s arrays and what tells when their copies
        have landed, None here (they have; a device KV may still be copying:
        backends/cuda/kv_copies.py)."""
        return (*self.export_prefix(num_tokens), None)

    def copies_pending(self) -> bool:
        """Whether copies into or out of the cells still run (a device KV's queued copies);
        the scheduler keeps the slot out of windows meanwhile."""
        return False

    def settle(self) -> None:
        """Wait for the copies `copies_pending` tells of."""

    @property
    def room_tokens(self) -> int:
        return self.capacity - self.num_tokens

    def can_append(self, num_new_tokens: int) -> bool:
        return self.num_tokens + num_new_tokens <= self.capacity

    def check_room(self, num_new_tokens: int) -> None:
        """Raise RequestError unless `num_new_tokens` more tokens fit."""
        if not self.can_append(num_new_tokens):
            raise RequestError(
                f"KV cache full: it holds {self.num_tokens} of {self.capacity} tokens and "
                f"cannot take {num_new_tokens} more; shorten the prompt or max_tokens, or "
                "raise the context size")

    def reusable(self, num_tokens: int) -> int:
        """The most of the first `num_tokens` tokens `truncate` can keep: all of them, except in
        a hybrid model, where the state exists only at 0, at the end and at checkpoints."""
        num_tokens = max(0, min(int(num_tokens), self.num_tokens))
        if self.state is None or num_tokens == self.num_tokens:
            return num_tokens
        return max((p for p in self.state.checkpoints if p <= num_tokens), default=0)

    def truncate(self, num_tokens: int) -> None:
        """Keep only the first `num_tokens` tokens (a new prompt shares that prefix); in a
        hybrid model `num_tokens` must be a length `reusable` gives."""
        if not 0 <= num_tokens <= self.num_tokens:
            raise ValueError(
                f"cannot truncate a KV cache of {self.num_tokens} tokens to {num_tokens}")
        if self.state is not None and num_tokens != self.num_tokens:
            if num_tokens == 0:
                self.state.reset()
            elif num_tokens in self.state.checkpoints:
                self.state.go_back(num_tokens)
            else:
                raise ValueError(
                    f"cannot take the recurrent state of {self.num_tokens} tokens back to "
                    f"{num_tokens}: it is kept only at 0, {self.num_tokens} and the "
                    f"checkpoints {list(self.state.positions())}")
        self.num_tokens = int(num_tokens)

    def reuse_points(self) -> tuple[int, ...] | None:
        """The lengths a hybrid model's sequence can go back to (its checkpoints and its end);
        None when any length will do."""
        if self.state is None:
            return None
        return tuple(sorted({*self.state.checkpoints, self.num_tokens}))

    def export_state(self):
        """A hybrid model's recurrent state for parking: (num_tokens, the state there,
        {position: checkpoint}), copies; None for a model without recurrent layers."""
        if self.state is None:
            return None
        return self.num_tokens, self.state.snapshot(), dict(self.state.checkpoints)

    def import_state(self, exported, num_tokens: int) -> None:
        """Install `export_state`'s result in this KV, which holds the first `num_tokens` of
        the parked tokens now: the state at that length (the parked end, a checkpoint or 0)
        and the checkpoints before it."""
        if self.state is None:
            return
        end, live, checkpoints = exported
        if num_tokens == 0:
            self.state.reset()
            return
        if num_tokens != end and num_tokens not in checkpoints:
            raise ValueError(f"no recurrent state at {num_tokens} tokens to restore; the "
                             f"parked one has {end} and checkpoints {sorted(checkpoints)}")
        self.state.load(live if num_tokens == end else checkpoints[num_tokens])
        self.state.checkpoints.clear()
        # the newest --ctx-checkpoints of them: a file of a server that kept more (with 0, a
        # restored slot kept its file's checkpoints for good)
        kept = sorted(p for p in checkpoints if p <= num_tokens)
        for position in kept[max(0, len(kept) - self.state.max_checkpoints):]:
            self.state.checkpoints[position] = checkpoints[position]

    def keep_checkpoint(self) -> bool:
        """Keep the recurrent state at the current length (a hybrid model after a prompt was
        read), so a later prompt that shares these tokens but not the rest can go back here."""
        return self.state is not None and self.state.keep_checkpoint(self.num_tokens)

    def clear(self) -> None:
        self.truncate(0)


class KVCache(SequenceReuse):
    """K/V cells of one sequence. Invariant: cells [0, num_tokens) of every layer are filled;
    `append` writes cells [num_tokens, num_tokens + T) of one layer and `commit(T)` makes them
    part of the sequence once every layer has them.

    V cells are [L, KV, C, D]. K cells are stored tile-transposed, [L, KV, NT, D, TILE] (key t
    is column t % TILE of tile t // TILE), the panels attention multiplies without repacking;
    `keys(layer)` gives them back as [KV, num_tokens, D].

    A hybrid model's KV also holds its recurrent layers' `state` (None otherwise). That state
    cannot be cut back to any length: `reusable(n)` says how many tokens a new prompt sharing
    n of them can keep, and `truncate` takes only such a length."""

    def __init__(self, spec: ModelSpec, capacity_tokens: int, dtype=np.float32,
                 max_checkpoints: int = DEFAULT_CHECKPOINTS):
        capacity_tokens = int(capacity_tokens)
        if capacity_tokens <= 0:
            raise ConfigError(
                f"KV cache capacity {capacity_tokens} tokens must be positive; give a context "
                "size of at least 1")
        if np.dtype(dtype) not in CELL_DTYPES:
            raise ConfigError(f"KV cells of {np.dtype(dtype).name} are not supported; use "
                              "float32 or float16")
        self.spec = spec
        self.dtype = np.dtype(dtype)
        self.capacity = capacity_tokens
        self.num_tokens = 0
        L, KV, D = len(spec.attention_layers), spec.n_kv_heads, spec.head_dim
        num_tiles = -(-capacity_tokens // KV_KEY_TILE)
        self._k = np.zeros((L, KV, num_tiles, D, KV_KEY_TILE), dtype=self.dtype)
        self._v = np.zeros((L, KV, capacity_tokens, D), dtype=self.dtype)
        self.state = RecurrentState(spec, max_checkpoints) if spec.recurrent_layers else None

    @property
    def num_layers(self) -> int:
        """Layers with cells (a hybrid model's attention layers)."""
        return self._v.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes of the cells (K's last tile is whole even where the capacity ends inside it)
        and of the recurrent state with its checkpoints."""
        state = self.state.nbytes if self.state is not None else 0
        return int(self._k.nbytes + self._v.nbytes) + state

    @staticmethod
    def nbytes_for(spec: ModelSpec, capacity_tokens: int, dtype=np.float32) -> int:
        """Bytes of the cells of a KV of `capacity_tokens` (what `rehome` needs)."""
        num_tiles = -(-int(capacity_tokens) // KV_KEY_TILE)
        per_token = (len(spec.attention_layers) * spec.n_kv_heads * spec.head_dim
                     * np.dtype(dtype).itemsize)
        return per_token * (num_tiles * KV_KEY_TILE + int(capacity_tokens))

    def rehome(self, capacity_tokens: int, memory: np.ndarray | None = None) -> None:
        """Move the committed cells into new cells of `capacity_tokens`: views of `memory`
        (uint8, at least `nbytes_for` bytes, e.g. expert-cache slots lent by KV grow), or a new
        array when None. Cells [0, num_tokens) keep their values exactly."""
        capacity_tokens = int(capacity_tokens)
        if not self.num_tokens <= capacity_tokens:
            raise ValueError(f"cannot move a KV of {self.num_tokens} tokens into "
                             f"{capacity_tokens} cells")
        L, KV, D = self.num_layers, self.spec.n_kv_heads, self.spec.head_dim
        num_tiles = -(-capacity_tokens // KV_KEY_TILE)
        k_shape, v_shape = (L, KV, num_tiles, D, KV_KEY_TILE), (L, KV, capacity_tokens, D)
        if memory is None:
            k, v = np.zeros(k_shape, dtype=self.dtype), np.zeros(v_shape, dtype=self.dtype)
        else:
            k_bytes = int(np.prod(k_shape)) * self.dtype.itemsize
            need = self.nbytes_for(self.spec, capacity_tokens, self.dtype)
            if memory.dtype != np.uint8 or memory.ndim != 1 or memory.size < need:
                raise ValueError(f"rehome needs a flat uint8 region of >= {need} bytes, got "
                                 f"{memory.dtype} {memory.shape}")
            k = memory[:k_bytes].view(self.dtype).reshape(k_shape)  # [L, KV, NT, D, TILE]
            v = memory[k_bytes:need].view(self.dtype).reshape(v_shape)  # [L, KV, C, D]
        used_tiles = -(-self.num_tokens // KV_KEY_TILE)
        k[:, :, :used_tiles] = self._k[:, :, :used_tiles]
        v[:, :, :self.num_tokens] = self._v[:, :, :self.num_tokens]
        self._k, self._v, self.capacity = k, v, capacity_tokens

    @property
    def cells(self) -> tuple[np.ndarray, np.ndarray]:
        """The K [L, KV, NT, D, TILE] and V [L, KV, C, D] cell arrays the native loop writes
        (cells past num_tokens are not part of the sequence)."""
        return self._k, self._v

    def fill_cells(self, layers, num_tokens: int) -> None:
        """As `SequenceReuse.fill_cells`, written a key tile at a time: `append`'s scattered
        writes took 0.32 s to restore 4256 cells of Qwen3-30B-A3B's shape (48 layers, 4 KV
        heads, head dim 128, fp16), over 10x a plain copy's time."""
        n = int(num_tokens)
        self.truncate(0)
        self.check_room(n)
        KV, D, TILE = self.spec.n_kv_heads, self.spec.head_dim, KV_KEY_TILE
        full, rest = divmod(n, TILE)
        for layer, (k, v) in enumerate(layers):
            if k.shape[1] < n or v.shape[1] < n:
                raise ValueError(f"layer {layer} has {min(k.shape[1], v.shape[1])} cells, "
                                 f"fewer than the {n} to fill")
            # [KV, full * TILE, D] -> [KV, full, D, TILE]
            self._k[layer, :, :full] = \
                k[:, :full * TILE].reshape(KV, full, TILE, D).transpose(0, 1, 3, 2)
            if rest:
                self._k[layer, :, full, :, :rest] = k[:, full * TILE:n].transpose(0, 2, 1)
            self._v[layer, :, :n] = v[:, :n]
        self.commit(n)

    def copy_prefix(self, source, num_tokens: int) -> None:
        """From a host KV of the same shape and cell type: its key tiles and value cells as
        they are (no trip through `keys()`, which copies all of the source's)."""
        n = int(num_tokens)
        if not (isinstance(source, KVCache) and source.dtype == self.dtype
                and source._v.shape[:2] + source._v.shape[3:]
                == self._v.shape[:2] + self._v.shape[3:] and n <= source.num_tokens):
            super().copy_prefix(source, n)
            return
        self.truncate(0)
        self.check_room(n)
        num_tiles = -(-n // KV_KEY_TILE)  # the last one's columns past n are not cells
        self._k[:, :, :num_tiles] = source._k[:, :, :num_tiles]
        self._v[:, :, :n] = source._v[:, :, :n]
        self.commit(n)

    def append(self, layer: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Write k, v [KV, T, D] after the committed tokens of `layer`; return that layer's keys
        and values [KV, num_tokens + T, D] including the new rows (keys as a copy)."""
        num_new = k.shape[1]
        self.check_room(num_new)
        end = self.num_tokens + num_new
        positions = np.arange(self.num_tokens, end)
        # [KV, NT, D, TILE] indexed by (tile, column) arrays: the selection is [T, KV, D]
        self._k[layer][:, positions // KV_KEY_TILE, :, positions % KV_KEY_TILE] = \
            k.transpose(1, 0, 2)
        self._v[layer, :, self.num_tokens:end] = v
        return self._keys(layer, end), self._v[layer, :, :end]

    def commit(self, num_new_tokens: int) -> None:
        """Make the rows appended to every layer part of the sequence."""
        self.check_room(num_new_tokens)
        self.num_tokens += int(num_new_tokens)

    def _keys(self, layer: int, num_tokens: int) -> np.ndarray:
        num_tiles = -(-num_tokens // KV_KEY_TILE)
        tiles = self._k[layer, :, :num_tiles].transpose(0, 1, 3, 2)  # [KV, nt, TILE, D]
        return tiles.reshape(self.spec.n_kv_heads, num_tiles * KV_KEY_TILE,
                             self.spec.head_dim)[:, :num_tokens]  # [KV, num_tokens, D] copy

    def keys(self, layer: int) -> np.ndarray:
        """[KV, num_tokens, D]: a copy (the cells are stored tile-transposed)."""
        return self._keys(layer, self.num_tokens)

    def values(self, layer: int) -> np.ndarray:
        return self._v[layer, :, :self.num_tokens]  # [KV, num_tokens, D]

    def __repr__(self) -> str:
        return (f"KVCache({self.num_tokens}/{self.capacity} tokens, {self.num_layers} layers, "
                f"{self.dtype.name})")
