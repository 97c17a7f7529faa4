"""The exchange buffer between the GPU's window and the CPU pool: one pinned, device-mapped host
buffer per model whose layout both sides compute from `ExchangeLayout` (defined here; the device
side, backends/cuda/offload.py, follows it), and numpy views carved from its address.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np

from strata.errors import ConfigError

# Legend: L = layers, R = rows of the window (R_max its capacity), K = experts per row,
# H = hidden, E = experts.
#
# Protocol, per window `seq` (int64, > 0, increasing; 0 = never written):
#   device, layer l: write x [R, H] (the layer's normed rows, float32), ids [R, K], wts [R, K],
#     __threadfence_system(), then ready[l] = seq (volatile store);
#   pool, layer l: wait until ready[l] == seq (acquire load), y[r] = sum over row r's pairs
#     whose expert is CPU-assigned (where[l, e] == WHERE_CPU) of wts[r, k] * expert_e(x[r]),
#     0 for rows without such a pair; store fence, then done[l] = seq (release store);
#     split [2] int32 = (e, c) with 0 < c < F (written with ids, the same layer): the layer's
#     boundary expert e is split, the pool computing gate/up rows [0, c) and the down's
#     columns [0, c) (its part of e's output), the device the rest (offload.cu's
#     count_groups); c = 0: none;
#     a failing pool writes done[l] = -seq, so the device may stop waiting early;
#   device: before layer l's combine wait until done[l] == seq, then add y to the GPU pairs.
# One x/ids/wts/y serves every layer: the device publishes layer l + 1 only after layer l's
# combine (stream order), so the pool has finished with layer l's buffers by then.
# status (int64 [4]) is the device's error report: status[0] = l + 1 when its wait for
# done[l] failed, status[1] = the seq it waited for, status[2] = why (1: no answer within its
# timeout, 2: the pool wrote done[l] = -seq); the host reads it after the window.

WHERE_VRAM, WHERE_PCIE, WHERE_CPU = 0, 1, 2  # the host-side where table [L, E] uint8
EXCHANGE_ALIGN_BYTES = 256
NUM_STATUS_WORDS = 4


def _align(num_bytes: int) -> int:
    return (num_bytes + EXCHANGE_ALIGN_BYTES - 1) // EXCHANGE_ALIGN_BYTES * EXCHANGE_ALIGN_BYTES


@dataclass(frozen=True)
class ExchangeLayout:
    """Field offsets of the exchange buffer for L layers, R_max rows, top-K and hidden H; each
    field starts at a multiple of 256 bytes from the buffer's start."""

    num_layers: int
    max_rows: int
    top_k: int
    hidden: int

    def __post_init__(self):
        for name in ("num_layers", "max_rows", "top_k", "hidden"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ConfigError(f"exchange layout {name} = {value!r} must be an integer >= 1")

    def fields(self) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
        """name -> (dtype, shape), in buffer order."""
        L, R, K, H = self.num_layers, self.max_rows, self.top_k, self.hidden
        return {
            "ready": (np.dtype(np.int64), (L,)),      # [L] written by the device
            "done": (np.dtype(np.int64), (L,)),       # [L] written by the pool
            "status": (np.dtype(np.int64), (NUM_STATUS_WORDS,)),  # device error report
            "split": (np.dtype(np.int32), (2,)),      # the layer's split expert and columns
            "x": (np.dtype(np.float32), (R, H)),      # [R_max, H] normed rows
            "ids": (np.dtype(np.int32), (R, K)),      # [R_max, K] routed expert ids
            "wts": (np.dtype(np.float32), (R, K)),    # [R_max, K] router weights
            "y": (np.dtype(np.float32), (R, H)),      # [R_max, H] the pool's weighted sums
        }

    @property
    def offsets(self) -> dict[str, int]:
        """name -> byte offset from the buffer's start (add it to the device pointer)."""
        offsets, at = {}, 0
        for name, (dtype, shape) in self.fields().items():
            offsets[name] = at
            at += _align(int(np.prod(shape)) * dtype.itemsize)
        return offsets

    @property
    def nbytes(self) -> int:
        name, (dtype, shape) = list(self.fields().items())[-1]
        return self.offsets[name] + _align(int(np.prod(shape)) * dtype.itemsize)

    @classmethod
    def for_spec(cls, spec, max_rows: int) -> "ExchangeLayout":
        """The layout for a model spec (n_layers, n_experts_used, hidden) and R_max rows."""
        return cls(int(spec.n_layers), int(max_rows), int(spec.n_experts_used), int(spec.hidden))


class Exchange:
    """Numpy views (`ready`, `done`, `status`, `split`, `x`, `ids`, `wts`, `y`) of an exchange
    buffer at a host address. `owner` (e.g. PyCUDA's pagelocked array) is kept alive with the
    views."""

    def __init__(self, layout: ExchangeLayout, address: int, size_bytes: int, owner=None):
        if address % EXCHANGE_ALIGN_BYTES:
            raise ConfigError(f"the exchange buffer at {address:#x} is not aligned to "
                              f"{EXCHANGE_ALIGN_BYTES} bytes; allocate it page-aligned (pinned "
                              "host memory is)")
        if size_bytes < layout.nbytes:
            raise ConfigError(f"the exchange buffer holds {size_bytes} bytes but {layout} needs "
                              f"{layout.nbytes}; allocate ExchangeLayout.nbytes")
        self.layout = layout
        self.address = int(address)
        self.size_bytes = int(size_bytes)
        self._owner = owner
        raw = np.frombuffer((ctypes.c_uint8 * layout.nbytes).from_address(self.address),
                            dtype=np.uint8)
        self._raw = raw
        offsets = layout.offsets
        for name, (dtype, shape) in layout.fields().items():
            count = int(np.prod(shape))
            view = raw[offsets[name]:offsets[name] + count * dtype.itemsize]
            setattr(self, name, view.view(dtype).reshape(shape))

    @classmethod
    def from_array(cls, layout: ExchangeLayout, buffer: np.ndarray) -> "Exchange":
        """Views over a host array (e.g. `pagelocked_empty(layout.nbytes, np.uint8,
        mem_flags=DEVICEMAP)`), which the Exchange keeps alive."""
        if not isinstance(buffer, np.ndarray) or not buffer.flags.c_contiguous:
            raise ConfigError("the exchange buffer must be a C-contiguous numpy array")
        return cls(layout, buffer.ctypes.data, buffer.nbytes, owner=buffer)

    @classmethod
    def in_host_memory(cls, layout: ExchangeLayout) -> "Exchange":
        """An exchange in plain (unpinned) host memory, zeroed: for the CPU-side tests and a
        device stand-in."""
        backing = np.zeros(layout.nbytes + EXCHANGE_ALIGN_BYTES, dtype=np.uint8)
        start = (-backing.ctypes.data) % EXCHANGE_ALIGN_BYTES
        return cls(layout, backing.ctypes.data + start, layout.nbytes, owner=backing)

    def field_address(self, name: str) -> int:
        """The host address of a field (the device adds the same offset to its pointer)."""
        return self.address + self.layout.offsets[name]

    def reset(self) -> None:
        """Zero the sequence words and the status (call when nothing is in flight)."""
        self.ready[:] = 0
        self.done[:] = 0
        self.status[:] = 0
        self.split[:] = 0

    def device_error(self) -> tuple[int, int] | None:
        """(layer, seq) of the device's timed-out wait for the pool, or None."""
        if self.status[0] == 0:
            return None
        return int(self.status[0]) - 1, int(self.status[1])
