"""Expert store: where every (layer, expert) lives in host RAM, from the GGUF mapped as it is or
from an expert pack. Both give the same raw (gate, up, down) views; the pack's are contiguous.
"""
from __future__ import annotations

import os

import numpy as np

from strata.experts.pack import PARTS, ExpertPack, LayerLayout, expert_tensor_name, model_layouts
from strata.model.gguf_file import GGUFModel


class ExpertStore:
    """Raw views of every routed expert: `expert(layer, e) -> (gate, up, down)`, each shaped
    `[rows, row_bytes]` like one expert of the GGUF's `[E, rows, row_bytes]` tensors."""

    def __init__(self, model: GGUFModel, layouts: list[LayerLayout], pack: ExpertPack | None):
        self.model = model
        self.layouts = layouts
        self.pack = pack
        self._layer_tensors = None if pack is not None else [
            tuple(model.tensor(expert_tensor_name(layer, p)).raw for p in PARTS)
            for layer in range(model.spec.n_layers)]

    @classmethod
    def from_gguf(cls, model: GGUFModel) -> "ExpertStore":
        return cls(model, model_layouts(model), None)

    @classmethod
    def from_pack(cls, path: str | os.PathLike, model: GGUFModel) -> "ExpertStore":
        """Serve the experts from the pack at `path` (refused unless written for `model`)."""
        pack = ExpertPack.open(path, model)
        return cls(model, pack.layouts, pack)

    @property
    def source(self) -> str:
        return "pack" if self.pack is not None else "gguf"

    @property
    def n_layers(self) -> int:
        return len(self.layouts)

    @property
    def n_experts(self) -> int:
        return self.model.spec.n_experts

    @property
    def expert_nbytes(self) -> int:
        """Bytes of the largest expert (gate + up + down) of any layer: one cache slot's size."""
        return max(lay.expert_nbytes for lay in self.layouts)

    def layer_expert_nbytes(self, layer: int) -> int:
        return self.layouts[layer].expert_nbytes

    def types(self, layer: int) -> tuple[int, int, int]:
        """ggml type ids of (gate, up, down) in `layer`."""
        return self.layouts[layer].types

    def expert(self, layer: int, expert: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        self._check(layer, expert)
        if self.pack is not None:
            return self.pack.expert(layer, expert)
        gate, up, down = self._layer_tensors[layer]
        return gate[expert], up[expert], down[expert]

    def expert_segments(self, layer: int, expert: int) -> list[np.ndarray]:
        """The expert's bytes as flat uint8 views in slot order (gate, up, down): one segment
        from a pack, three from a GGUF. Copying them back to back fills a cache slot."""
        if self.pack is not None:
            self._check(layer, expert)
            return [self.pack.expert_span(layer, expert)]
        return [view.reshape(-1) for view in self.expert(layer, expert)]

    def expert_pointers(self) -> np.ndarray:
        """[L, 3, E] uint64: the address of every expert's gate, up and down blocks in the
        store (the mapped GGUF or pack), as `CpuModel.forward_window(expert_pointers=)` takes
        them. Valid while the store's mapping is open."""
        pointers = np.empty((self.n_layers, 3, self.n_experts), dtype=np.uint64)
        for layer in range(self.n_layers):
            if self.pack is None:
                for part, raw in enumerate(self._layer_tensors[layer]):  # [E, rows, row_bytes]
                    pointers[layer, part] = raw.ctypes.data + np.arange(
                        self.n_experts, dtype=np.uint64) * np.uint64(raw.strides[0])
                continue
            starts = np.array([self.pack.expert_span(layer, e).ctypes.data
                               for e in range(self.n_experts)], dtype=np.uint64)  # [E]
            at = 0
            for part, layout in enumerate(self.layouts[layer].parts):
                pointers[layer, part] = starts + np.uint64(at)
                at += layout.nbytes
        return pointers

    def _check(self, layer: int, expert: int) -> None:
        if not (0 <= layer < self.n_layers and 0 <= expert < self.n_experts):
            raise IndexError(f"expert ({layer}, {expert}) is out of range: the model has "
                             f"{self.n_layers} layers x {self.n_experts} experts")

    def __repr__(self) -> str:
        return (f"ExpertStore({self.source}, {self.n_layers} layers x {self.n_experts} experts, "
                f"{self.expert_nbytes} bytes per expert)")
