"""Expert pack: a model's routed experts rewritten so that each (layer, expert) is one contiguous,
4096-aligned span (gate, up, down raw blocks back to back), for one copy or one stream per expert.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from strata.errors import ConfigError, ModelFormatError
from strata.model.gguf_file import GGUFModel

PACK_MAGIC = b"STRXPACK"
PACK_VERSION = 1
ALIGN_BYTES = 4096  # each expert starts on a page: one aligned copy, O_DIRECT-friendly streams
PARTS = ("gate", "up", "down")
_PREFIX = struct.Struct("<8sII")  # magic, version, header JSON bytes


def expert_tensor_name(layer: int, part: str) -> str:
    return f"blk.{layer}.ffn_{part}_exps.weight"


def _align(n: int) -> int:
    return -(-n // ALIGN_BYTES) * ALIGN_BYTES


@dataclass(frozen=True)
class PartLayout:
    """One of gate/up/down of a layer: its ggml type and the shape of one expert's block."""

    qtype: int
    rows: int
    row_bytes: int

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes


@dataclass(frozen=True)
class LayerLayout:
    """The three parts of one layer's experts; every expert of the layer has this layout."""

    gate: PartLayout
    up: PartLayout
    down: PartLayout

    @property
    def parts(self) -> tuple[PartLayout, PartLayout, PartLayout]:
        return (self.gate, self.up, self.down)

    @property
    def expert_nbytes(self) -> int:
        return self.gate.nbytes + self.up.nbytes + self.down.nbytes

    @property
    def types(self) -> tuple[int, int, int]:
        return (self.gate.qtype, self.up.qtype, self.down.qtype)


def model_layouts(model: GGUFModel) -> list[LayerLayout]:
    """Per layer, the layout of one routed expert as the GGUF stores it."""
    layouts = []
    for layer in range(model.spec.n_layers):
        parts = []
        for part in PARTS:
            t = model.tensor(expert_tensor_name(layer, part))
            parts.append(PartLayout(int(t.qtype), int(t.raw.shape[1]), int(t.raw.shape[2])))
        layouts.append(LayerLayout(*parts))
    return layouts


def model_identity(model: GGUFModel) -> dict:
    """What ties a pack to its model: architecture, counts, and a hash of the expert tensors'
    names, types, shapes and offsets, the file size, and each expert tensor's first and last
    page of data (so a model of the same shape with other weights is told apart; cheap)."""
    spec = model.spec
    h = hashlib.sha256()
    for layer in range(spec.n_layers):
        for part in PARTS:
            t = model.tensor(expert_tensor_name(layer, part))
            h.update(f"{t.name}|{t.qtype}|{t.shape}|{t.offset_bytes};".encode())
            flat = t.raw.reshape(-1)
            h.update(flat[:ALIGN_BYTES])
            h.update(flat[-ALIGN_BYTES:])
    file_bytes = int(Path(model.path).stat().st_size)
    h.update(f"file_bytes={file_bytes}".encode())
    return {"arch": spec.arch, "n_layers": spec.n_layers, "n_experts": spec.n_experts,
            "model_hash": h.hexdigest(), "model_file_bytes": file_bytes}


def _describe(identity: dict) -> str:
    return (f"{identity['arch']}, {identity['n_layers']} layers x {identity['n_experts']} "
            f"experts, {identity['model_file_bytes']} bytes, expert hash "
            f"{identity['model_hash'][:12]}")


def _header_pages(blob_bytes: int) -> int:
    """Where the index starts: the page after the prefix and the header's JSON."""
    return _align(_PREFIX.size + blob_bytes)


def _plan(layouts: list[LayerLayout], n_experts: int, index_offset: int):
    """Offsets of every expert: layer by layer, expert by expert, each aligned."""
    index_bytes = len(layouts) * n_experts * 8
    offset = _align(index_offset + index_bytes)
    data_offset = offset
    index = np.zeros((len(layouts), n_experts), dtype=np.int64)  # [L, E] byte offsets
    for layer, lay in enumerate(layouts):
        stride = _align(lay.expert_nbytes)
        index[layer] = offset + stride * np.arange(n_experts, dtype=np.int64)
        offset += stride * n_experts
    return index, data_offset, offset


# ---------------------------------------------------------------------------- writing

def write_pack(model: GGUFModel, out: str | os.PathLike, progress: bool = False) -> int:
    """Write the expert pack of `model` to `out`, streaming expert by expert (the model is never
    read whole into RAM); return the pack's size in bytes. The file appears under its name only
    once complete (written as `out.partial`, then renamed)."""
    from tqdm import tqdm

    out = Path(out)
    if out.exists() and out.samefile(model.path):
        raise ConfigError(f"{out} is the model itself; give the pack another path, e.g. "
                          f"`strata-tool pack {model.path} {model.path.with_suffix('.pack')}`")
    if out.is_dir():
        raise ConfigError(f"{out} is a folder; give the pack's file path, e.g. "
                          f"{out / model.path.with_suffix('.pack').name}")
    layouts = model_layouts(model)
    n_experts = model.spec.n_experts
    header = dict(model_identity(model))
    header["layers"] = [{p: [part.qtype, part.rows, part.row_bytes]
                         for p, part in zip(PARTS, lay.parts)} for lay in layouts]
    # The index starts on the page after the header, which records the offsets: plan them
    # after the pages the header takes (one up to ~55 layers; Qwen3-235B-A22B's 94 take two),
    # again while it outgrows them (the offsets only grow, so this ends).
    index_offset = ALIGN_BYTES
    while True:
        index, data_offset, file_bytes = _plan(layouts, n_experts, index_offset)
        header.update(index_offset=index_offset, data_offset=data_offset, file_bytes=file_bytes)
        blob = json.dumps(header, sort_keys=True).encode()
        if _header_pages(len(blob)) <= index_offset:
            break
        index_offset = _header_pages(len(blob))
    partial = out.with_name(out.name + ".partial")
    data_bytes = file_bytes - data_offset
    try:
        with open(partial, "wb") as f, tqdm(total=data_bytes, unit="B", unit_scale=True,
                                            desc=f"pack {out.name}", disable=not progress) as bar:
            f.write(_PREFIX.pack(PACK_MAGIC, PACK_VERSION, len(blob)) + blob)
            f.seek(index_offset)
            f.write(index.tobytes())
            for layer, lay in enumerate(layouts):
                views = [model.tensor(expert_tensor_name(layer, p)).raw for p in PARTS]
                pad = bytes(_align(lay.expert_nbytes) - lay.expert_nbytes)
                for e in range(n_experts):
                    f.seek(int(index[layer, e]))
                    for view in views:
                        f.write(view[e])  # [rows, row_bytes], contiguous in the mapping
                    f.write(pad)
                    bar.update(len(pad) + lay.expert_nbytes)
            f.truncate(file_bytes)
        os.replace(partial, out)
    except BaseException:
        # a full disk or ^C must not leave a pack-sized .partial behind
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)
        raise
    return file_bytes


# ---------------------------------------------------------------------------- reading

class ExpertPack:
    """A pack mapped read-only: `expert(layer, e)` gives (gate, up, down) views shaped like the
    GGUF's `[rows, row_bytes]`, `expert_span(layer, e)` the whole contiguous span."""

    def __init__(self, path: Path, data: np.ndarray, index: np.ndarray,
                 layouts: list[LayerLayout], identity: dict):
        self.path = path
        self.layouts = layouts
        self.identity = identity
        self._data = data
        self._index = index  # [L, E] int64 byte offsets

    @property
    def n_layers(self) -> int:
        return len(self.layouts)

    @property
    def n_experts(self) -> int:
        return int(self._index.shape[1])

    def offset(self, layer: int, expert: int) -> int:
        return int(self._index[layer, expert])

    def expert_span(self, layer: int, expert: int) -> np.ndarray:
        """The expert's gate, up and down bytes as one contiguous uint8 view."""
        start = self.offset(layer, expert)
        return self._data[start:start + self.layouts[layer].expert_nbytes]

    def expert(self, layer: int, expert: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        span = self.expert_span(layer, expert)
        views, at = [], 0
        for part in self.layouts[layer].parts:
            views.append(span[at:at + part.nbytes].reshape(part.rows, part.row_bytes))
            at += part.nbytes
        return tuple(views)

    @classmethod
    def open(cls, path: str | os.PathLike, model: GGUFModel) -> "ExpertPack":
        """Map the pack at `path`, refusing it unless it was written for `model` and is whole."""
        path = Path(path)
        src = str(path)
        if not path.is_file():
            raise ModelFormatError(f"{src}: no such expert pack; write one with "
                                   f"`strata-tool pack {model.path} {src}`")
        actual_bytes = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(_PREFIX.size)
            if len(prefix) < _PREFIX.size or prefix[:8] != PACK_MAGIC:
                raise ModelFormatError(
                    f"{src}: not a Strata expert pack (starts with {prefix[:8]!r}, expected "
                    f"{PACK_MAGIC!r}); write one with `strata-tool pack {model.path} OUT.pack`"
                    " and give OUT.pack")
            magic, version, blob_bytes = _PREFIX.unpack(prefix)
            if version != PACK_VERSION:
                raise ModelFormatError(
                    f"{src}: expert pack version {version}, this Strata reads version "
                    f"{PACK_VERSION}; write it again with `strata-tool pack`")
            blob = f.read(blob_bytes)
        try:
            header = json.loads(blob)
            layers = [LayerLayout(*(PartLayout(*map(int, entry[p])) for p in PARTS))
                      for entry in header["layers"]]
            index_offset, data_offset = int(header["index_offset"]), int(header["data_offset"])
            file_bytes = int(header["file_bytes"])
        except (ValueError, KeyError, TypeError) as exc:
            raise ModelFormatError(f"{src}: the expert pack's header is corrupt ({exc}); "
                                   "write it again with `strata-tool pack`") from None
        identity = {k: header.get(k) for k in ("arch", "n_layers", "n_experts", "model_hash",
                                               "model_file_bytes")}
        expected = model_identity(model)
        if identity != expected:
            raise ModelFormatError(
                f"{src}: this expert pack was written for another model ({_describe(identity)})"
                f", not for {model.path} ({_describe(expected)}); write a pack for this model "
                f"with `strata-tool pack {model.path} OUT`")
        if layers != model_layouts(model):
            raise ModelFormatError(f"{src}: the expert pack's tensor layouts differ from "
                                   f"{model.path}'s; write it again with `strata-tool pack`")
        n_experts = identity["n_experts"]
        # The header's offsets and size must be the layout's own before any of them is used
        # to map or slice the file (a damaged header would otherwise fail inside numpy).
        planned_index = _header_pages(blob_bytes)
        planned, planned_data, planned_bytes = _plan(layers, n_experts, planned_index)
        if (index_offset, data_offset, file_bytes) != (planned_index, planned_data,
                                                       planned_bytes):
            raise ModelFormatError(
                f"{src}: the expert pack's header is corrupt (index at {index_offset}, data at "
                f"{data_offset}, {file_bytes} bytes; the layout puts them at {planned_index}, "
                f"{planned_data}, {planned_bytes}); write it again with `strata-tool pack`")
        if actual_bytes < file_bytes:
            raise ModelFormatError(
                f"{src}: truncated: the expert pack should be {file_bytes} bytes but has "
                f"{actual_bytes}; write it again with `strata-tool pack {model.path} {src}`")
        data = np.memmap(path, dtype=np.uint8, mode="r", shape=(file_bytes,))
        index = np.frombuffer(data, dtype=np.int64, count=len(layers) * n_experts,
                              offset=index_offset).reshape(len(layers), n_experts)
        if not np.array_equal(index, planned):
            raise ModelFormatError(f"{src}: the expert pack's index is corrupt (offsets are not "
                                   "the aligned layout); write it again with `strata-tool pack`")
        return cls(path, data, index, layers, identity)

    def close(self) -> None:
        """Drop this object's hold on the mapping (views handed out keep it alive)."""
        self._data = None
        self._index = None

    def __repr__(self) -> str:
        return f"ExpertPack({str(self.path)!r}, {_describe(self.identity)})"

    def describe(self) -> str:
        return _describe(self.identity)


__all__ = ["ALIGN_BYTES", "ExpertPack", "LayerLayout", "PartLayout", "model_identity",
           "model_layouts", "write_pack"]
