"""One stage of a layer split: a CUDA model over layers [first, stop) of a GGUF on one GPU
(`LayerRange` renames the range's tensors to 0..n-1), with one workspace per slot group (lane)
so that groups pipelined over the stages never share buffers.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np

from strata.backends.cuda.model import CudaModel
from strata.errors import ConfigError
from strata.experts.store import ExpertStore


class LayerRange:
    """A GGUF model seen through layers [first, stop): `spec.n_layers` is the range's count
    and `blk.i.*` is the base model's `blk.(first + i).*`. The token embedding is listed on
    the first stage (and the last with a tied head), the final norm and head on the last."""

    def __init__(self, gguf_model, first: int, stop: int):
        L = gguf_model.spec.n_layers
        if not 0 <= first < stop <= L:
            raise ConfigError(f"layer range {first}..{stop - 1} is not inside the model's "
                              f"{L} layers (0..{L - 1}); give 0 <= first < stop <= {L}")
        self.base = gguf_model
        self.first_layer, self.stop_layer = int(first), int(stop)
        base = gguf_model.spec
        self.spec = base.with_(n_layers=stop - first, first_layer=base.first_layer + first)
        self.is_first, self.is_last = first == 0, stop == L
        self.path = getattr(gguf_model, "path", None)
        names = []
        for name in gguf_model.tensor_names:
            if name.startswith("blk."):
                layer = int(name.split(".")[1])
                if first <= layer < stop:
                    names.append(f"blk.{layer - first}." + name.split(".", 2)[2])
            elif name == "token_embd.weight":
                if self.is_first or (self.is_last and self.spec.tied_output):
                    names.append(name)
            elif self.is_last:
                names.append(name)
        self.tensor_names = names

    def base_name(self, name: str) -> str:
        if not name.startswith("blk."):
            return name
        _, layer, rest = name.split(".", 2)
        return f"blk.{int(layer) + self.first_layer}.{rest}"

    def tensor(self, name: str):
        return self.base.tensor(self.base_name(name))

    def __contains__(self, name: str) -> bool:
        return name in self.tensor_names

    def __repr__(self) -> str:
        return f"LayerRange(layers {self.first_layer}..{self.stop_layer - 1} of {self.base!r})"


class _PackRange:
    """An expert pack seen through a layer range (what ExpertStore reads of a pack)."""

    def __init__(self, pack, first: int):
        self._pack, self._first = pack, first

    def expert(self, layer: int, expert: int):
        return self._pack.expert(layer + self._first, expert)

    def expert_span(self, layer: int, expert: int) -> np.ndarray:
        return self._pack.expert_span(layer + self._first, expert)


def stage_store(store: ExpertStore, view: LayerRange) -> ExpertStore:
    """The expert store of a stage: `store`'s layers [first, stop) as layers 0..n-1."""
    first, stop = view.first_layer, view.stop_layer
    pack = None if store.pack is None else _PackRange(store.pack, first)
    return ExpertStore(view, store.layouts[first:stop], pack)


class StageModel(CudaModel):
    """A CudaModel over a layer range on one device, with lanes: lane g keeps its own
    workspace and plans, so slot group g's buffers on this stage are its alone while the next
    stage copies its rows out."""

    def __init__(self, gguf_model, device: int | None, layers: tuple[int, int],
                 experts_resident: bool = True):
        super().__init__(gguf_model, device=device, experts_resident=experts_resident,
                         layers=layers)
        self.first_layer, self.stop_layer = int(layers[0]), int(layers[1])
        self._lane = 0
        self._lanes: dict[int, tuple] = {}

    def use_lane(self, lane: int) -> None:
        """Make lane `lane`'s workspace and plans the current ones."""
        if lane == self._lane:
            return
        self._lanes[self._lane] = (self._ws, self._plans)
        self._ws, self._plans = self._lanes.pop(lane, (None, OrderedDict()))
        self._lane = lane

    def drop_plans(self) -> None:
        super().drop_plans()
        for _, plans in self._lanes.values():
            plans.clear()

    def x_ptr(self) -> int:
        """Device address of the current lane's residual rows x [R, H] float32."""
        return self._ws.ptr("x")

    def logits_ptr(self) -> int:
        return self._ws.ptr("logits")

    def argmax_ptr(self) -> int:
        return self._ws.ptr("argmax")

    def lane_ptr(self, lane: int, name: str) -> int:
        """Device address of buffer `name` ("logits", "argmax", "x") in lane `lane`'s
        workspace, whichever lane is current."""
        ws = self._ws if lane == self._lane else self._lanes[lane][0]
        return ws.ptr(name)

    def __repr__(self) -> str:
        return (f"StageModel(layers {self.first_layer}..{self.stop_layer - 1} on GPU "
                f"{self.runtime.index})")
