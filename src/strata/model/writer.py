"""Write llama.cpp-compatible GGUF v3 model files, streaming tensor data one tensor at a time.

Used by `strata-tool synth` and by tests that build models from their own weights.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Union

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, GGUFWriter

from strata.model import arch
from strata.model.arch import ModelSpec

# A tensor's data: the array itself, or a zero-argument callable that returns it when its turn
# comes to be written (so a large model never sits in memory all at once).
TensorData = Union[np.ndarray, Callable[[], np.ndarray]]


def row_bytes(qtype: int, num_cols: int) -> int:
    """Bytes of one row of `num_cols` values stored as `qtype`; ValueError if they do not fit."""
    qtype = GGMLQuantizationType(qtype)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if num_cols % block_size:
        raise ValueError(
            f"{qtype.name} stores rows in blocks of {block_size} values, but a row here has "
            f"{num_cols}; pick a type whose block divides {num_cols} (e.g. f32, f16, q8_0)")
    return num_cols // block_size * type_size


def byte_shape(qtype: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The uint8 shape [..., row_bytes] that `shape` (numpy order) takes when stored as `qtype`."""
    return (*shape[:-1], row_bytes(qtype, shape[-1]))


def _as_stored_bytes(name: str, qtype: GGMLQuantizationType, shape: tuple[int, ...],
                     data: np.ndarray) -> np.ndarray:
    """Check `data` against the expected shape and type; return it as the bytes to write."""
    if qtype == GGMLQuantizationType.F32:
        if data.dtype != np.float32 or tuple(data.shape) != shape:
            raise ValueError(f"tensor {name!r}: F32 data must be float32 of shape {shape}, "
                             f"got {data.dtype} {tuple(data.shape)}")
        return np.ascontiguousarray(data)
    if qtype == GGMLQuantizationType.F16 and data.dtype == np.float16:
        if tuple(data.shape) != shape:
            raise ValueError(f"tensor {name!r}: F16 data must have shape {shape}, "
                             f"got {tuple(data.shape)}")
        return np.ascontiguousarray(data).view(np.uint8).reshape(byte_shape(qtype, shape))
    want = byte_shape(qtype, shape)
    if data.dtype != np.uint8 or tuple(data.shape) != want:
        raise ValueError(f"tensor {name!r}: {qtype.name} data must be encoded uint8 rows of "
                         f"shape {want} (for {shape}), got {data.dtype} {tuple(data.shape)}")
    return np.ascontiguousarray(data)


def _add_value(writer: GGUFWriter, key: str, value: object) -> None:
    """Add one metadata key with the GGUF value type llama.cpp expects for its Python type."""
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, (int, np.integer)):
        value = int(value)
        if value < 0:
            writer.add_int32(key, value) if value >= -2**31 else writer.add_int64(key, value)
        else:
            writer.add_uint32(key, value) if value < 2**32 else writer.add_uint64(key, value)
    elif isinstance(value, (float, np.floating)):
        writer.add_float32(key, float(value))
    elif isinstance(value, str):
        writer.add_key_value(key, value, GGUFValueType.STRING)
    elif isinstance(value, (list, tuple)):
        if not value:
            raise ValueError(f"metadata key {key!r}: GGUF cannot store an empty array")
        first = value[0]
        if isinstance(first, str):
            sub = GGUFValueType.STRING
        elif isinstance(first, bool):
            sub = GGUFValueType.BOOL
        elif isinstance(first, (int, np.integer)):
            sub = GGUFValueType.INT32
            value = [int(v) for v in value]
        elif isinstance(first, (float, np.floating)):
            sub = GGUFValueType.FLOAT32
            value = [float(v) for v in value]
        else:
            raise ValueError(f"metadata key {key!r}: cannot store arrays of {type(first).__name__}")
        writer.add_key_value(key, list(value), GGUFValueType.ARRAY, sub_type=sub)
    else:
        raise ValueError(f"metadata key {key!r}: cannot store a {type(value).__name__} in GGUF")


def write_gguf(path: str | os.PathLike, spec: ModelSpec,
               tensors: Iterable[tuple[str, int, TensorData]], tokenizer_meta: dict,
               extra_meta: dict | None = None, progress: bool = False,
               name: str = "strata-model", legacy_ssm_in: bool = False) -> int:
    """Write `spec`, its tokenizer and `tensors` as a GGUF v3 file; return the file size in bytes.

    `tensors` yields (name, ggml type id, data) with data float32 for F32 (or float16 for F16)
    and encoded uint8 rows [..., row_bytes] for every other type, or a zero-argument callable
    returning that array: callables are called one at a time, in order, while writing.
    Every tensor of `arch.expected_tensors(spec, legacy_ssm_in)` must be given once, with its
    shape (`legacy_ssm_in`: a qwen3next file as llama.cpp's first converter wrote it).
    """
    expected = arch.expected_tensors(spec, legacy_ssm_in)
    entries: list[tuple[str, GGMLQuantizationType, TensorData]] = []
    seen: set[str] = set()
    for tname, qtype, data in tensors:
        if tname not in expected:
            raise ValueError(f"tensor {tname!r} is not part of a {spec.arch} model with this spec")
        if tname in seen:
            raise ValueError(f"tensor {tname!r} is given twice")
        try:
            qtype = GGMLQuantizationType(int(qtype))
        except ValueError:
            raise ValueError(f"tensor {tname!r}: unknown ggml type id {qtype}") from None
        if qtype != GGMLQuantizationType.F32 and arch.is_small_tensor(tname):
            raise ValueError(f"tensor {tname!r} is a norm/bias/gate vector and must be F32, "
                             f"got {qtype.name}")
        row_bytes(qtype, expected[tname][-1])  # fails early, naming the type and row length
        seen.add(tname)
        entries.append((tname, qtype, data))
    missing = [n for n in expected if n not in seen]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ValueError(f"missing tensors: {', '.join(missing[:5])}{more}")

    # Written beside `path` and renamed when whole: a failed or killed write leaves no
    # half-written model under the name, and an earlier file there survives it.
    partial = f"{os.fspath(path)}.partial"
    writer = GGUFWriter(partial, spec.arch)
    bar = None
    try:
        meta = dict(arch.spec_to_metadata(spec))
        meta.pop("general.architecture")  # GGUFWriter adds it itself
        meta["general.name"] = name
        meta.update(tokenizer_meta)
        meta.update(extra_meta or {})
        for key, value in meta.items():
            _add_value(writer, key, value)

        total_bytes = 0
        for tname, qtype, _ in entries:
            shape = expected[tname]
            if qtype == GGMLQuantizationType.F32:
                nbytes = int(np.prod(shape)) * 4
                writer.add_tensor_info(tname, shape, np.dtype(np.float32), nbytes)
            else:
                bshape = byte_shape(qtype, shape)
                nbytes = int(np.prod(bshape))
                writer.add_tensor_info(tname, bshape, np.dtype(np.uint8), nbytes, raw_dtype=qtype)
            total_bytes += nbytes

        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="writing")
        for tname, qtype, data in entries:
            array = data() if callable(data) else data
            stored = _as_stored_bytes(tname, qtype, expected[tname], np.asarray(array))
            writer.write_tensor_data(stored)
            if bar is not None:
                bar.update(stored.nbytes)
            del array, stored  # let a streamed tensor go before the next one is made
        if bar is not None:
            bar.close()
    except BaseException:
        if bar is not None:
            # now, not when it is collected: after the caller's "Aborted!" its last line
            # ended the output of an interrupted synth (seen with 16 cores)
            bar.close()
        writer.close()
        if os.path.exists(partial):
            os.unlink(partial)
        raise
    writer.close()
    try:
        os.replace(partial, path)
    except OSError:
        os.unlink(partial)  # e.g. `path` is a folder
        raise
    return os.path.getsize(path)
