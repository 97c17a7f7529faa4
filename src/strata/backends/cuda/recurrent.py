"""A hybrid model's recurrent state (qwen3next's gated delta-net layers) in device memory: the
two buffers of engine/recurrent.py's RecurrentState live on the GPU, where the window's kernels
read one and write the other; checkpoints and parked states are host copies in the same form as
the CPU backend's.
"""
from __future__ import annotations

import numpy as np

from strata.engine.recurrent import DEFAULT_CHECKPOINTS, RecurrentState
from strata.model.arch import ModelSpec

# Lr = recurrent layers, K = conv taps, C = conv channels, Hv = value heads,
# Dk / Dv = key / value head dims


class DeviceRecurrentState(RecurrentState):
    """conv [2, Lr, K-1, C] and ssm [2, Lr, Hv, Dk, Dv] float32 on the device (one allocation:
    conv 0, conv 1, ssm 0, ssm 1); `buffers()` gives their device addresses. Copies to and
    from the host (`snapshot`, `load`) are synchronous: the engine calls them between
    windows, after the last one finished."""

    def __init__(self, runtime, spec: ModelSpec, max_checkpoints: int = DEFAULT_CHECKPOINTS):
        self._rt = runtime
        super().__init__(spec, max_checkpoints)

    def _allocate(self) -> None:
        self._conv_bytes = 4 * int(np.prod(self.conv_shape(self.spec)))
        self._ssm_bytes = 4 * int(np.prod(self.ssm_shape(self.spec)))
        total = 2 * (self._conv_bytes + self._ssm_bytes)
        with self._rt.active():
            self._buf = self._rt.alloc(total)
            self._rt.drv.memset_d32(self._buf, 0, total // 4)
        self.address = int(self._buf)

    def _conv_at(self, which: int) -> int:
        return self.address + which * self._conv_bytes

    def _ssm_at(self, which: int) -> int:
        return self.address + 2 * self._conv_bytes + which * self._ssm_bytes

    def buffers(self) -> tuple[int, int, int, int]:
        """Device addresses of (conv in, conv out, ssm in, ssm out) of the next pass."""
        cur, nxt = self.current, 1 - self.current
        return self._conv_at(cur), self._conv_at(nxt), self._ssm_at(cur), self._ssm_at(nxt)

    def snapshot(self) -> tuple[np.ndarray, np.ndarray]:
        conv = np.empty(self.conv_shape(self.spec), dtype=np.float32)
        ssm = np.empty(self.ssm_shape(self.spec), dtype=np.float32)
        with self._rt.active():
            self._rt.synchronize()  # the last window's kernels wrote it
            self._rt.drv.memcpy_dtoh(conv, self._conv_at(self.current))
            self._rt.drv.memcpy_dtoh(ssm, self._ssm_at(self.current))
        return conv, ssm

    def load(self, snap: tuple[np.ndarray, np.ndarray]) -> None:
        conv, ssm = snap
        for name, arr, shape in (("conv", conv, self.conv_shape(self.spec)),
                                 ("ssm", ssm, self.ssm_shape(self.spec))):
            if arr.shape != shape:
                raise ValueError(f"a {name} state of shape {arr.shape} cannot be loaded into "
                                 f"one of {shape}")
        with self._rt.active():
            self._rt.synchronize()  # no kernel still reads the buffer
            self._rt.drv.memcpy_htod(self._conv_at(self.current),
                                     np.ascontiguousarray(conv, dtype=np.float32))
            self._rt.drv.memcpy_htod(self._ssm_at(self.current),
                                     np.ascontiguousarray(ssm, dtype=np.float32))

    def reset(self) -> None:
        with self._rt.active():
            self._rt.synchronize()
            self._rt.drv.memset_d32(self._conv_at(self.current), 0, self._conv_bytes // 4)
            self._rt.drv.memset_d32(self._ssm_at(self.current), 0, self._ssm_bytes // 4)
        self.checkpoints.clear()

    @property
    def device_bytes(self) -> int:
        return 2 * (self._conv_bytes + self._ssm_bytes)
