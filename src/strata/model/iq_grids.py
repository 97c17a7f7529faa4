"""The lookup tables of the i-quants (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S), taken
from the gguf package at run time, so the CPU kernels (`_native/kernels.pyx` hands them to C at
import) and the CUDA kernels (generated into their source, `backends/cuda/runtime.py`) read the
same values as gguf's own dequantisation, which the tests hold them to.

`grid(qtype)`: int8 [N, W], entry i the W (8 or 4) values that grid index i stands for (IQ2_*:
8, 25, 43; IQ3_XXS: 4 .. 62; IQ3_S: 1 .. 15; IQ1_*: -1, 0, 1). `ksigns()`: uint8 [128], the
sign patterns of IQ2_XXS / IQ2_XS / IQ3_XXS (bit j set: value j is negated), 7 bits of index
with the eighth sign the parity.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import quants

GRID_TYPES = (QT.IQ2_XXS, QT.IQ2_XS, QT.IQ2_S, QT.IQ3_XXS, QT.IQ3_S, QT.IQ1_S, QT.IQ1_M)


@lru_cache(maxsize=None)
def grid(qtype: int) -> np.ndarray:
    cls = quants._type_traits[QT(qtype)]
    cls.init_grid()
    values = np.asarray(cls.grid, dtype=np.float32).reshape(cls.grid_shape)
    out = values.astype(np.int8)
    if not np.array_equal(out.astype(np.float32), values):
        raise ValueError(f"{QT(qtype).name}'s grid holds values that are not small integers")
    out.setflags(write=False)
    return out


@lru_cache(maxsize=1)
def ksigns() -> np.ndarray:
    out = np.frombuffer(quants.IQ2_XXS.ksigns, dtype=np.uint8).copy()
    assert out.shape == (128,)
    out.setflags(write=False)
    return out
