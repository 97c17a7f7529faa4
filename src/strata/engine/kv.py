"""The KV cache of one sequence: per layer K and V cells [n_kv_heads, capacity, head_dim].

A forward pass appends its rows' K/V layer by layer, then commits them once all layers ran.
"""
from __future__ import annotations

import numpy as np

from strata.errors import ConfigError, RequestError
from strata.model.arch import ModelSpec

# L = layers, KV = KV heads, C = capacity (tokens), D = head dim, T = rows appended now


class KVCache:
    """K/V cells of one sequence. Invariant: cells [0, num_tokens) of every layer are filled;
    `append` writes cells [num_tokens, num_tokens + T) of one layer and `commit(T)` makes them
    part of the sequence once every layer has them."""

    def __init__(self, spec: ModelSpec, capacity_tokens: int, dtype=np.float32):
        capacity_tokens = int(capacity_tokens)
        if capacity_tokens <= 0:
            raise ConfigError(
                f"KV cache capacity {capacity_tokens} tokens must be positive; give a context "
                "size of at least 1")
        self.spec = spec
        self.dtype = np.dtype(dtype)
        self.capacity = capacity_tokens
        self.num_tokens = 0
        shape = (spec.n_layers, spec.n_kv_heads, capacity_tokens, spec.head_dim)
        self._k = np.zeros(shape, dtype=self.dtype)  # [L, KV, C, D]
        self._v = np.zeros(shape, dtype=self.dtype)  # [L, KV, C, D]

    @property
    def nbytes(self) -> int:
        return int(self._k.nbytes + self._v.nbytes)

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

    def append(self, layer: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Write k, v [KV, T, D] after the committed tokens of `layer`; return the views
        [KV, num_tokens + T, D] of that layer's keys and values including the new rows."""
        num_new = k.shape[1]
        self.check_room(num_new)
        end = self.num_tokens + num_new
        self._k[layer, :, self.num_tokens:end] = k
        self._v[layer, :, self.num_tokens:end] = v
        return self._k[layer, :, :end], self._v[layer, :, :end]

    def commit(self, num_new_tokens: int) -> None:
        """Make the rows appended to every layer part of the sequence."""
        self.check_room(num_new_tokens)
        self.num_tokens += int(num_new_tokens)

    def keys(self, layer: int) -> np.ndarray:
        return self._k[layer, :, :self.num_tokens]  # [KV, num_tokens, D]

    def values(self, layer: int) -> np.ndarray:
        return self._v[layer, :, :self.num_tokens]  # [KV, num_tokens, D]

    def truncate(self, num_tokens: int) -> None:
        """Keep only the first `num_tokens` tokens (a new prompt shares that prefix)."""
        if not 0 <= num_tokens <= self.num_tokens:
            raise ValueError(
                f"cannot truncate a KV cache of {self.num_tokens} tokens to {num_tokens}")
        self.num_tokens = int(num_tokens)

    def clear(self) -> None:
        self.num_tokens = 0

    def __repr__(self) -> str:
        return (f"KVCache({self.num_tokens}/{self.capacity} tokens, {self.spec.n_layers} layers, "
                f"{self.dtype.name})")
