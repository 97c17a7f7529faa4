"""The recurrent state of one sequence in a hybrid model (qwen3next's gated delta-net layers):
per recurrent layer, the last conv inputs and the delta rule's state matrix, double-buffered so a
pass that fails leaves the sequence as it was, and checkpoints to go back to.

A recurrent state cannot be cut back like K/V cells: the state after n tokens exists only where
it was kept. So a sequence can return to 0 tokens, stay where it is, or go back to a checkpoint:
the state copied after a prompt was read (llama.cpp's context checkpoints, `--ctx-checkpoints`).
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np

from strata.errors import ConfigError
from strata.model.arch import ModelSpec

# Lr = recurrent layers, K = conv taps, C = conv channels (q, k and v of every head),
# Hv = value heads, Dk / Dv = key / value head dims

DEFAULT_CHECKPOINTS = 8


class RecurrentState:
    """conv [2, Lr, K-1, C] and ssm [2, Lr, Hv, Dk, Dv] float32. Buffer `current` holds the
    state after the committed tokens; a pass reads it and writes the other, and `flip` (after
    every layer ran) makes the other current. Checkpoints: position -> (conv, ssm) copies."""

    def __init__(self, spec: ModelSpec, max_checkpoints: int = DEFAULT_CHECKPOINTS):
        if isinstance(max_checkpoints, bool) or not isinstance(max_checkpoints, int) \
                or max_checkpoints < 0:
            raise ConfigError(f"--ctx-checkpoints {max_checkpoints!r} must be an integer >= 0 "
                              "(0: a new prompt reuses a slot's state only when it extends all "
                              "of the slot's tokens)")
        self.spec = spec
        self.max_checkpoints = max_checkpoints
        self.current = 0
        self.checkpoints: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self._allocate()

    def _allocate(self) -> None:
        """The two buffers of each kind, zero (the state of no tokens)."""
        self._conv = np.zeros((2, *self.conv_shape(self.spec)), dtype=np.float32)
        self._ssm = np.zeros((2, *self.ssm_shape(self.spec)), dtype=np.float32)

    @staticmethod
    def conv_shape(spec: ModelSpec) -> tuple[int, int, int]:
        """One conv state: [Lr, K-1, C]."""
        return len(spec.recurrent_layers), spec.ssm_conv - 1, spec.ssm_channels

    @staticmethod
    def ssm_shape(spec: ModelSpec) -> tuple[int, int, int, int]:
        """One delta-rule state: [Lr, Hv, Dk, Dv]."""
        return (len(spec.recurrent_layers), spec.ssm_heads, spec.ssm_state, spec.ssm_v_dim)

    @staticmethod
    def nbytes_per_state(spec: ModelSpec) -> int:
        """Bytes of one state (one buffer, or one checkpoint)."""
        per_layer = ((spec.ssm_conv - 1) * spec.ssm_channels
                     + spec.ssm_heads * spec.ssm_state * spec.ssm_v_dim)
        return 4 * per_layer * len(spec.recurrent_layers)

    @property
    def nbytes(self) -> int:
        """Both buffers and the checkpoints."""
        return (2 + len(self.checkpoints)) * self.nbytes_per_state(self.spec)

    def buffers(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(conv in, conv out, ssm in, ssm out) of the next pass: [Lr, K-1, C] and
        [Lr, Hv, Dk, Dv], the "in" ones current."""
        cur, nxt = self.current, 1 - self.current
        return self._conv[cur], self._conv[nxt], self._ssm[cur], self._ssm[nxt]

    def flip(self) -> None:
        """The pass that wrote the other buffer ran every layer: its state is current now."""
        self.current = 1 - self.current

    def snapshot(self) -> tuple[np.ndarray, np.ndarray]:
        """Copies of the current state."""
        return self._conv[self.current].copy(), self._ssm[self.current].copy()

    def load(self, snap: tuple[np.ndarray, np.ndarray]) -> None:
        """Make `snap` (from `snapshot`) the current state."""
        conv, ssm = snap
        self._conv[self.current] = conv
        self._ssm[self.current] = ssm

    def reset(self) -> None:
        """The state of no tokens: zeros; checkpoints dropped."""
        self._conv[self.current] = 0
        self._ssm[self.current] = 0
        self.checkpoints.clear()

    def keep_checkpoint(self, position: int) -> bool:
        """Copy the current state (the state after `position` tokens) as a checkpoint, dropping
        the oldest beyond `max_checkpoints`; False when checkpoints are off."""
        if self.max_checkpoints == 0 or position <= 0:
            return False
        self.checkpoints.pop(position, None)
        self.checkpoints[position] = self.snapshot()
        while len(self.checkpoints) > self.max_checkpoints:
            self.checkpoints.popitem(last=False)
        return True

    def go_back(self, position: int) -> None:
        """Make the checkpoint at `position` current and drop the checkpoints after it."""
        self.load(self.checkpoints[position])
        for p in [p for p in self.checkpoints if p > position]:
            del self.checkpoints[p]

    def positions(self) -> tuple[int, ...]:
        return tuple(sorted(self.checkpoints))
