"""The KV cache of one sequence in device memory: fp16 cells [L, 2 (K, V), KV, C, D], with the
KVCache interface the scheduler uses (host copies for parking, append for restoring).
"""
from __future__ import annotations

import numpy as np

from strata.errors import ConfigError, RequestError
from strata.model.arch import ModelSpec

# L = layers, KV = KV heads, C = capacity (tokens), D = head dim, T = rows appended now


class CudaKV:
    """K/V cells of one sequence on the GPU. Invariant as KVCache: cells [0, num_tokens) of
    every layer are filled; a forward pass writes cells [num_tokens, num_tokens + T) of every
    layer on the device, and `commit(T)` makes them part of the sequence."""

    def __init__(self, runtime, spec: ModelSpec, capacity_tokens: int):
        capacity_tokens = int(capacity_tokens)
        if capacity_tokens <= 0:
            raise ConfigError(
                f"KV cache capacity {capacity_tokens} tokens must be positive; give a context "
                "size of at least 1")
        self.spec = spec
        self.dtype = np.dtype(np.float16)
        self.capacity = capacity_tokens
        self.num_tokens = 0
        self._rt = runtime
        self._shape = (spec.n_layers, 2, spec.n_kv_heads, capacity_tokens, spec.head_dim)
        self._buf = runtime.alloc(self.nbytes)
        self.base = int(self._buf)  # device address of cell [0, 0, 0, 0, 0]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self._shape)) * self.dtype.itemsize

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

    def _cell_address(self, layer: int, kind: int, head: int, cell: int) -> int:
        L, _, KV, C, D = self._shape
        index = (((layer * 2 + kind) * KV + head) * C + cell) * D
        return self.base + index * self.dtype.itemsize

    def _read(self, layer: int, kind: int) -> np.ndarray:
        KV, D, n = self.spec.n_kv_heads, self.spec.head_dim, self.num_tokens
        out = np.empty((KV, n, D), dtype=self.dtype)  # [KV, num_tokens, D]
        if n:
            with self._rt.active():
                for j in range(KV):
                    self._rt.drv.memcpy_dtoh(out[j], self._cell_address(layer, kind, j, 0))
        return out

    def keys(self, layer: int) -> np.ndarray:
        """A host copy of `layer`'s committed keys [KV, num_tokens, D] (fp16)."""
        return self._read(layer, 0)

    def values(self, layer: int) -> np.ndarray:
        return self._read(layer, 1)

    def append(self, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        """Write k, v [KV, T, D] after the committed tokens of `layer` (restoring a parked
        conversation); `commit(T)` once every layer has them."""
        num_new = int(k.shape[1])
        self.check_room(num_new)
        expected = (self.spec.n_kv_heads, num_new, self.spec.head_dim)
        if tuple(k.shape) != expected or tuple(v.shape) != expected:
            raise RequestError(f"KV append takes k and v of shape {expected}, got "
                               f"{tuple(k.shape)} and {tuple(v.shape)}")
        with self._rt.active():
            for kind, src in ((0, k), (1, v)):
                cells = np.ascontiguousarray(src, dtype=self.dtype)
                for j in range(self.spec.n_kv_heads):
                    if num_new:
                        self._rt.drv.memcpy_htod(
                            self._cell_address(layer, kind, j, self.num_tokens), cells[j])

    def commit(self, num_new_tokens: int) -> None:
        """Make the rows written to every layer part of the sequence."""
        self.check_room(num_new_tokens)
        self.num_tokens += int(num_new_tokens)

    def truncate(self, num_tokens: int) -> None:
        """Keep only the first `num_tokens` tokens (a new prompt shares that prefix)."""
        if not 0 <= num_tokens <= self.num_tokens:
            raise ValueError(
                f"cannot truncate a KV cache of {self.num_tokens} tokens to {num_tokens}")
        self.num_tokens = int(num_tokens)

    def clear(self) -> None:
        self.num_tokens = 0

    def __repr__(self) -> str:
        return (f"CudaKV({self.num_tokens}/{self.capacity} tokens, {self.spec.n_layers} layers, "
                f"float16 on the GPU)")
