"""Open a GGUF model file: memory-map it, read its metadata and tensors, and check it fully;
read its tensors into RAM where the CPU computes from them (`--no-mmap`, `load_into_memory`).

Every problem with the file raises `ModelFormatError` naming the file and what is wrong.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from gguf import (GGML_QUANT_SIZES, GGUF_MAGIC, GGMLQuantizationType, GGUFEndian, GGUFReader,
                  GGUFValueType)

from strata.errors import ModelFormatError
from strata.model import arch
from strata.model.arch import ModelSpec

_MAGIC_BYTES = GGUF_MAGIC.to_bytes(4, "little")  # b"GGUF"
_MAX_NAMED = 5  # how many offending tensor names a message lists before "and N more"
_READ_CHUNK_BYTES = 64 << 20  # load_into_memory reads the file this much at a time
_QUIET_BELOW_BYTES = 256 << 20  # and shows no progress bar for less than this


def type_name(qtype: int) -> str:
    """ggml's name for a tensor type id (e.g. 'Q4_K'), or 'type id N' for an unknown id."""
    try:
        return GGMLQuantizationType(qtype).name
    except ValueError:
        return f"type id {qtype}"


def supported_types() -> tuple[int, ...]:
    """Tensor types the CPU kernels compute on (the native module's own list)."""
    from strata._native import kernels

    return tuple(kernels.SUPPORTED_TYPES)


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor of the file. `raw` is a read-only uint8 view of its bytes in the mapping,
    shaped [*shape[:-1], row_bytes] (an expert tensor is [E, rows, row_bytes])."""

    name: str
    qtype: int
    shape: tuple[int, ...]  # numpy order: the last axis is the contiguous row
    raw: np.ndarray
    offset_bytes: int  # where the data starts in the file

    @property
    def nbytes(self) -> int:
        return int(self.raw.nbytes)

    @property
    def row_bytes(self) -> int:
        return int(self.raw.shape[-1])

    @property
    def type_name(self) -> str:
        return type_name(self.qtype)


class _TruncatedHeader(Exception):
    """A header read ran past the end of the file."""

    def __init__(self, offset: int, nbytes: int):
        super().__init__(f"needs bytes {offset}..{offset + nbytes} of the file")
        self.offset = offset


class _Reader(GGUFReader):
    """GGUFReader that stops at the end of the file and leaves tensor data to `GGUFModel`.

    The stock reader silently reads short past the end (then fails obscurely or loops on a
    garbage array length) and builds every tensor view eagerly, failing without naming the
    tensor on an odd type or size; we check those ourselves.
    """

    def _get(self, offset, dtype, count=1, override_order=None):
        offset, count = int(offset), int(count)
        nbytes = int(np.dtype(dtype).itemsize) * count
        if count < 0 or offset + nbytes > len(self.data):
            raise _TruncatedHeader(int(offset), nbytes)
        return super()._get(offset, dtype, count, override_order)

    def _get_field_parts(self, orig_offs, raw_type):
        # The stock reader makes numpy views per array element: ~10 s for a 150k-token
        # vocabulary. Read arrays of scalars as one view and strings as memoryview slices.
        if raw_type != GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        item_type = self._get(orig_offs, np.uint32)
        count = self._get(orig_offs + 4, np.uint64)
        offs = orig_offs + 12
        n = int(count[0])
        sub = GGUFValueType(int(item_type[0]))
        parts: list = [item_type, count]
        if sub == GGUFValueType.STRING:
            buf = self._bytes()
            end = len(buf)
            for _ in range(n):
                if offs + 8 > end:
                    raise _TruncatedHeader(offs, 8)
                length = int.from_bytes(buf[offs:offs + 8], "little")
                offs += 8
                if offs + length > end:
                    raise _TruncatedHeader(offs, length)
                parts.append(buf[offs:offs + length])
                offs += length
            return offs - orig_offs, parts, list(range(2, 2 + n)), [GGUFValueType.ARRAY, sub]
        nptype = self.gguf_scalar_to_np.get(sub)
        if nptype is None:  # arrays of arrays: rare, keep the stock path
            return super()._get_field_parts(orig_offs, raw_type)
        values = self._get(offs, nptype, n)
        parts.append(values)
        return 12 + int(values.nbytes), parts, [2], [GGUFValueType.ARRAY, sub]

    def _bytes(self) -> memoryview:
        if getattr(self, "_mv", None) is None:
            self._mv = memoryview(self.data).cast("B")
        return self._mv

    def _build_tensors(self, start_offs, fields):
        self.tensor_fields = fields
        self.tensors = []


class GGUFModel:
    """A mapped GGUF model: `.spec`, `.metadata`, `.tensor(name)`, `.tensor_names`.

    Tensors are views of one read-only memory map of the file, or of the anonymous memory that
    `load_into_memory` read them into.
    """

    def __init__(self, path: Path, reader: GGUFReader, metadata: dict,
                 tensors: dict[str, TensorInfo], spec: ModelSpec):
        self.path = path
        self.metadata = metadata
        self.spec = spec
        self._reader = reader
        self._tensors = tensors
        self._memory = None  # the tensors' bytes once load_into_memory has read them

    # ---- opening ------------------------------------------------------------------------
    @classmethod
    def open(cls, path: str | os.PathLike) -> "GGUFModel":
        path = Path(path)
        src = str(path)
        if not path.is_file():
            if path.exists():  # /dev/null or a pipe: "no such file" sent users looking for a typo
                raise ModelFormatError(f"{src}: not a regular file; give the path of a .gguf "
                                       "model")
            raise ModelFormatError(f"{src}: no such model file")
        file_bytes = path.stat().st_size
        with open(path, "rb") as f:
            magic = f.read(4)
        if not magic:
            raise ModelFormatError(f"{src}: not a GGUF file: it is empty (0 bytes)")
        if magic != _MAGIC_BYTES:
            raise ModelFormatError(
                f"{src}: not a GGUF file (starts with {magic!r}, expected {_MAGIC_BYTES!r}); "
                "give the path of a .gguf model")
        try:
            reader = _Reader(path, "r")
        except _TruncatedHeader as exc:
            raise ModelFormatError(
                f"{src}: truncated or corrupt: the GGUF header runs past the end of the file "
                f"({file_bytes} bytes) at byte {exc.offset}; download or copy it again") from None
        except Exception as exc:  # GGUFReader raises ValueError/KeyError/IndexError on garbage
            raise ModelFormatError(
                f"{src}: unreadable GGUF header ({type(exc).__name__}: {exc}); the file is "
                "corrupt or was written by an incompatible tool") from None
        if reader.endianess == GGUFEndian.BIG:
            # The reader swaps the header's numbers, but the tensors' bytes stay big-endian and
            # every kernel reads little-endian: the model would run on garbage weights.
            raise ModelFormatError(
                f"{src}: big-endian GGUF is not supported; Strata reads little-endian files "
                f"only. Convert it in place with `gguf-convert-endian {src} little` (from the "
                "gguf package), or use the little-endian release of the model")
        metadata = _read_metadata(reader, src)
        tensors = _read_tensors(reader, src, file_bytes)
        _check_layout(tensors.values(), data_start=int(reader.data_offset),
                      alignment=int(reader.alignment), src=src)
        shapes = {name: t.shape for name, t in tensors.items()}
        spec = arch.spec_from_metadata(metadata, shapes, source=src)
        _check_tensors(spec, tensors, src)
        return cls(path, reader, metadata, tensors, spec)

    # ---- access -------------------------------------------------------------------------
    @property
    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def tensor(self, name: str) -> TensorInfo:
        try:
            return self._tensors[name]
        except KeyError:
            raise KeyError(f"{self.path}: no tensor named {name!r}") from None

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    @property
    def tensor_bytes(self) -> int:
        """Bytes from the first tensor's data to the last one's end: what load_into_memory
        reads."""
        start, stop = self._tensor_span()
        return stop - start

    @property
    def in_memory(self) -> bool:
        """Whether the tensors are in anonymous memory (load_into_memory), not the mapping."""
        return self._memory is not None

    def _tensor_span(self) -> tuple[int, int]:
        infos = self._tensors.values()
        if not infos:
            return 0, 0
        return (min(t.offset_bytes for t in infos),
                max(t.offset_bytes + t.nbytes for t in infos))

    def load_into_memory(self, *, progress: bool = True) -> float:
        """Read the tensors' bytes from the file into anonymous memory, in huge pages where the
        kernel gives them (host_pages.py), and point every tensor at them: `--no-mmap`. The
        CPU's decode kernels read each weight once a token, faster from there than from the
        file's 4 KiB pages. Views handed out before keep reading the mapping. Returns the
        seconds it took; ModelFormatError when the file has shrunk since it was opened."""
        from tqdm import tqdm

        from strata.model.host_pages import anonymous_array

        if self._memory is not None:
            return 0.0
        started = time.perf_counter()
        start, stop = self._tensor_span()
        memory = anonymous_array(stop - start)
        with open(self.path, "rb", buffering=0) as f, tqdm(
                total=stop - start, unit="B", unit_scale=True, unit_divisor=1024,
                desc=f"reading {self.path.name} into RAM",
                disable=not progress or stop - start < _QUIET_BELOW_BYTES, leave=False) as bar:
            f.seek(start)
            done = 0
            while done < stop - start:
                got = f.readinto(memoryview(memory[done:done + _READ_CHUNK_BYTES]))
                if not got:
                    raise ModelFormatError(
                        f"{self.path}: truncated while reading it into RAM: the tensors end at "
                        f"byte {stop} but the file ends at byte {start + done} (it changed "
                        "since it was opened); copy it again, or serve it mapped (--mmap)")
                done += got
                bar.update(got)
        memory.flags.writeable = False
        self._tensors = {
            name: replace(t, raw=memory[t.offset_bytes - start:t.offset_bytes - start + t.nbytes]
                          .reshape(t.raw.shape))
            for name, t in self._tensors.items()}
        self._memory = memory
        return time.perf_counter() - started

    def close(self) -> None:
        """Drop this object's hold on the mapping; the file is unmapped once no `raw` view
        handed out earlier is still alive."""
        self._tensors = {}
        self._reader = None
        self._memory = None

    def __enter__(self) -> "GGUFModel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"GGUFModel({str(self.path)!r}, arch={self.spec.arch!r}, "
                f"tensors={len(self._tensors)})")


def _read_metadata(reader: GGUFReader, src: str) -> dict:
    meta: dict = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):  # version and counts, not key/value metadata
            continue
        try:
            meta[name] = field.contents()
        except Exception as exc:
            raise ModelFormatError(
                f"{src}: metadata key {name!r} cannot be decoded ({exc}); the file is corrupt"
            ) from None
    return meta


def _read_tensors(reader: _Reader, src: str, file_bytes: int) -> dict[str, TensorInfo]:
    supported = supported_types()
    out: dict[str, TensorInfo] = {}
    data_start = int(reader.data_offset)
    for field in reader.tensor_fields:
        _, name_data, _, dims, raw_type, rel_offset = field.parts
        name = bytes(name_data).decode("utf-8", errors="replace")
        qtype = int(raw_type[0])
        shape = tuple(int(d) for d in reversed(dims.tolist()))  # ggml order -> numpy order
        if name in out:
            raise ModelFormatError(f"{src}: tensor {name!r} appears twice; the file is corrupt")
        if qtype not in supported:
            raise ModelFormatError(
                f"{src}: tensor {name!r} has type {type_name(qtype)}, which Strata cannot "
                f"compute; supported types: {', '.join(type_name(t) for t in supported)}. "
                "Convert or quantise the model to one of those")
        block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
        if not shape or any(d <= 0 for d in shape):
            raise ModelFormatError(f"{src}: tensor {name!r} has an empty shape {shape}")
        cols = shape[-1]
        if cols % block:
            raise ModelFormatError(
                f"{src}: tensor {name!r} has rows of {cols} values, not a multiple of the "
                f"{type_name(qtype)} block of {block}; this type cannot store it "
                f"(use a model quantised with a type whose block divides {cols})")
        row_bytes = cols // block * block_bytes
        nbytes = row_bytes * math.prod(shape[:-1])  # Python ints: a corrupt dim cannot wrap
        offset = data_start + int(rel_offset[0])
        if offset + nbytes > file_bytes:
            raise ModelFormatError(
                f"{src}: truncated: tensor {name!r} needs bytes {offset}..{offset + nbytes} "
                f"but the file has {file_bytes}; download or copy it again")
        raw = reader.data[offset:offset + nbytes].reshape(*shape[:-1], row_bytes)
        out[name] = TensorInfo(name, qtype, shape, raw, offset)
    return out


def _check_layout(tensors, *, data_start: int, alignment: int, src: str) -> None:
    """Every tensor starts at a multiple of `alignment` from the data section's start, and no
    two share a byte (adjacent is fine): a corrupt offset would otherwise hand one tensor's
    bytes to another and run on garbage weights. Sorted by offset: O(n log n)."""
    misaligned = [t for t in tensors if (t.offset_bytes - data_start) % alignment]
    if misaligned:
        t = misaligned[0]
        more = f" (and {len(misaligned) - 1} more tensor(s))" if len(misaligned) > 1 else ""
        raise ModelFormatError(
            f"{src}: tensor {t.name!r} starts at data offset {t.offset_bytes - data_start} "
            f"(byte {t.offset_bytes} of the file), not a multiple of the alignment "
            f"{alignment} (general.alignment, default 32){more}; the file is corrupt")
    ordered = sorted(tensors, key=lambda t: t.offset_bytes)
    for before, after in zip(ordered, ordered[1:]):
        end = before.offset_bytes + before.nbytes
        if after.offset_bytes < end:
            raise ModelFormatError(
                f"{src}: tensors {before.name!r} (bytes {before.offset_bytes}..{end}) and "
                f"{after.name!r} (bytes {after.offset_bytes}.."
                f"{after.offset_bytes + after.nbytes}) overlap; the tensor offsets are "
                "corrupt")


def _check_tensors(spec: ModelSpec, tensors: dict[str, TensorInfo], src: str) -> None:
    expected = arch.expected_tensors(spec, arch.legacy_ssm_in(spec, tensors))
    missing = [name for name in expected if name not in tensors]
    if missing:
        more = f" and {len(missing) - _MAX_NAMED} more" if len(missing) > _MAX_NAMED else ""
        raise ModelFormatError(
            f"{src}: {len(missing)} tensor(s) that {spec.arch} needs are missing: "
            f"{', '.join(missing[:_MAX_NAMED])}{more}; the file is incomplete or not a "
            f"{spec.arch} model")
    for name, shape in expected.items():
        found = tensors[name].shape
        if found != tuple(shape) and not (name.endswith("ffn_gate_inp_shexp.weight")
                                          and found == (1, *shape)):
            raise ModelFormatError(
                f"{src}: tensor {name!r} has shape {found}, expected {tuple(shape)} (numpy "
                "order) from the metadata; the metadata and tensors disagree")
