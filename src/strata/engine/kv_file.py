"""One parked conversation in a file: its tokens and KV arrays (any nesting of tuples, dicts,
ints and numpy arrays, as a backend's `export_prefix` / `export_state` give them), for the
conversation cache's disk tier (conversation_disk.py).

Layout: MAGIC (8 bytes), version and header length (two little-endian uint32), the header as
JSON (the model and KV format it belongs to, the tokens' count, the reuse points, the tree of
the KV value with its arrays' dtypes, shapes and offsets), then each array's bytes from a
4 KiB boundary. Nothing in a file is ever executed or unpickled: a file from elsewhere can at
worst be refused.
"""
from __future__ import annotations

import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from numpy.lib import format as npformat

from strata.errors import StrataError
from strata.model.host_pages import anonymous_array

MAGIC = b"STRATAKV"
VERSION = 1
SUFFIX = ".strata-kv"
_PREFIX = struct.Struct("<8sII")  # magic, version, header bytes
ALIGN = 4096
MAX_HEADER_BYTES = 64 * 2**20
# Arrays move in chunks of this size, IO_THREADS at a time. H200 host, a 2.46 GiB file read
# back from the page cache: 1.8-2.7 GB/s on one thread, 8-10 on 4, 14-15 on 8 (from its
# virtual disk ~1.6 GB/s, and writes ~1 GB/s with the fsync, whatever the count)
IO_CHUNK_BYTES = 32 * 2**20
IO_THREADS = min(8, os.cpu_count() or 1)


class KVFileError(StrataError):
    """A conversation file that cannot be read: truncated, corrupt or of another format."""


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _encode(value: Any, arrays: list[np.ndarray]) -> Any:
    """The JSON tree of `value`; its arrays appended to `arrays`."""
    if value is None:
        return None
    if isinstance(value, np.ndarray):
        arrays.append(value)
        return {"array": len(arrays) - 1}
    if isinstance(value, (bool, np.bool_)):
        raise TypeError("a KV tree holds no booleans")
    if isinstance(value, (int, np.integer)):
        return {"int": int(value)}
    if isinstance(value, (tuple, list)):
        return {"tuple": [_encode(v, arrays) for v in value]}
    if isinstance(value, dict):
        return {"dict": [[_encode(k, arrays), _encode(v, arrays)] for k, v in value.items()]}
    raise TypeError(f"cannot store a {type(value).__name__} in a conversation file")


def _decode(node: Any, arrays: Sequence[np.ndarray]) -> Any:
    if node is None:
        return None
    if not isinstance(node, dict) or len(node) != 1:
        raise KVFileError(f"bad node {node!r} in the KV tree")
    (kind, body), = node.items()
    if kind == "array" and isinstance(body, int) and 0 <= body < len(arrays):
        return arrays[body]
    if kind == "int" and isinstance(body, int):
        return body
    if kind == "tuple" and isinstance(body, list):
        return tuple(_decode(v, arrays) for v in body)
    if kind == "dict" and isinstance(body, list):
        return {_decode(k, arrays): _decode(v, arrays) for k, v in body}
    if kind in ("array", "int", "tuple", "dict"):
        raise KVFileError(f"bad node {node!r} in the KV tree")
    raise KVFileError(f"unknown node kind {kind!r} in the KV tree")


def write_kv_file(path: str | os.PathLike, tokens: Sequence[int], value: Any,
                  meta: dict) -> int:
    """Write `tokens` and the KV `value` to `path` (as `path`.partial, synced, then renamed,
    so a file under its name is whole); return its size in bytes. `meta`: JSON fields kept in
    the header (the model, the KV format, the reuse points)."""
    path = Path(path)
    arrays: list[np.ndarray] = [np.asarray(tokens, dtype=np.int32)]
    tree = _encode(value, arrays)
    specs, offset = [], 0
    for a in arrays:
        specs.append({"dtype": npformat.dtype_to_descr(a.dtype), "shape": list(a.shape),
                      "offset": offset, "nbytes": int(a.nbytes)})
        offset = _align(offset + a.nbytes)
    header = json.dumps({**meta, "num_tokens": len(tokens), "tree": tree,
                         "arrays": specs}).encode()
    data_start = _align(_PREFIX.size + len(header))
    partial = path.with_name(path.name + ".partial")
    try:
        with open(partial, "wb") as f:
            f.write(_PREFIX.pack(MAGIC, VERSION, len(header)))
            f.write(header)
            size = data_start + specs[-1]["offset"] + specs[-1]["nbytes"]  # no padding at the end
            f.truncate(size)
            f.flush()
            _transfer(f.fileno(), [(np.ascontiguousarray(a).reshape(-1).view(np.uint8),
                                    data_start + spec["offset"])
                                   for a, spec in zip(arrays, specs)], write=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return size


def _transfer(fd: int, moves: list[tuple[np.ndarray, int]], write: bool) -> bool:
    """Read or write each (uint8 buffer, file offset) of `moves` in IO_CHUNK_BYTES pieces on
    IO_THREADS threads (os.preadv / pwritev release the GIL); False when a read found the
    file's end first."""
    pieces = [(memoryview(buf)[at:at + IO_CHUNK_BYTES], offset + at)
              for buf, offset in moves for at in range(0, buf.nbytes, IO_CHUNK_BYTES)]

    def move(piece) -> bool:
        view, offset = piece
        while view.nbytes:
            n = (os.pwritev if write else os.preadv)(fd, [view], offset)
            if n == 0:
                return False
            view, offset = view[n:], offset + n
        return True

    if len(pieces) <= 1:
        return all(move(p) for p in pieces)
    with ThreadPoolExecutor(min(IO_THREADS, len(pieces))) as pool:
        return all(list(pool.map(move, pieces)))


def read_kv_header(path: str | os.PathLike) -> dict:
    """The header of the conversation file at `path`, checked against the file's size; raises
    KVFileError naming what is wrong."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(_PREFIX.size)
            if len(prefix) < _PREFIX.size:
                raise KVFileError(f"{path}: {size} bytes, too short for a conversation file")
            magic, version, header_bytes = _PREFIX.unpack(prefix)
            if magic != MAGIC:
                raise KVFileError(f"{path} is not a Strata conversation file (magic "
                                  f"{magic!r})")
            if version != VERSION:
                raise KVFileError(f"{path}: format version {version}, this Strata reads "
                                  f"{VERSION}")
            if header_bytes > min(MAX_HEADER_BYTES, size - _PREFIX.size):
                raise KVFileError(f"{path}: header of {header_bytes} bytes in a file of "
                                  f"{size} (truncated or corrupt)")
            header = json.loads(f.read(header_bytes))
    except OSError as e:
        raise KVFileError(f"{path}: cannot read it ({e.strerror or e})") from e
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise KVFileError(f"{path}: corrupt header ({e})") from e
    try:
        data_start = _align(_PREFIX.size + header_bytes)
        specs = header["arrays"]
        end = max(data_start + int(s["offset"]) + int(s["nbytes"]) for s in specs)
        for s in specs:
            dtype = npformat.descr_to_dtype(s["dtype"])
            if dtype.itemsize * int(np.prod(s["shape"], dtype=np.int64)) != int(s["nbytes"]):
                raise KVFileError(f"{path}: an array's shape and bytes disagree")
        if int(header["num_tokens"]) != specs[0]["shape"][0]:
            raise KVFileError(f"{path}: the token count disagrees with the tokens stored")
        _check_header(header, specs)
    except KVFileError:
        raise
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise KVFileError(f"{path}: corrupt header ({type(e).__name__}: {e})") from e
    if end > size:
        raise KVFileError(f"{path}: truncated ({size} bytes, the header needs {end})")
    header["data_start"] = data_start
    return header


def _check_header(header: dict, specs: list) -> None:
    """What the size checks leave to JSON that still parses (a flipped digit, a hand edit):
    raises ValueError for a value the engine could not use."""
    if npformat.descr_to_dtype(specs[0]["dtype"]) != np.int32 or len(specs[0]["shape"]) != 1:
        raise ValueError("the tokens are not a list of int32")
    for s in specs:
        if npformat.descr_to_dtype(s["dtype"]).hasobject:
            raise ValueError(f"an array of Python objects ({s['dtype']!r})")
        if any(not isinstance(n, int) or n < 0 for n in [*s["shape"], s["offset"]]):
            raise ValueError(f"array shape {s['shape']} or offset {s['offset']} is negative")
    if int(header.get("kv_nbytes", 0)) < 0:
        raise ValueError(f"kv_nbytes {header['kv_nbytes']} is negative")
    points = header.get("reuse_points")
    if points is not None and not all(isinstance(p, int) for p in points):
        raise ValueError(f"reuse points {points!r} are not token counts")
    try:
        _decode(header["tree"], range(len(specs)))  # a dry run: every node well formed
    except KVFileError as e:
        raise ValueError(str(e)) from None


def read_kv_file(path: str | os.PathLike, header: dict | None = None
                 ) -> tuple[tuple[int, ...], Any]:
    """(tokens, KV value) of the file at `path`; arrays over 1 MiB land in memory asked for
    huge pages, as a park's do."""
    header = read_kv_header(path) if header is None else header
    arrays, moves = [], []
    for spec in header["arrays"]:
        dtype = npformat.descr_to_dtype(spec["dtype"])
        nbytes = int(spec["nbytes"])
        raw = anonymous_array(nbytes) if nbytes >= 2**20 else np.empty(nbytes, np.uint8)
        moves.append((raw, header["data_start"] + int(spec["offset"])))
        arrays.append(raw.view(dtype).reshape(spec["shape"]))
    try:
        with open(path, "rb", buffering=0) as f:
            if not _transfer(f.fileno(), moves, write=False):
                raise KVFileError(f"{path}: truncated while reading its KV")
    except OSError as e:
        raise KVFileError(f"{path}: cannot read it ({e.strerror or e})") from e
    tokens = tuple(int(t) for t in arrays[0])
    return tokens, _decode(header["tree"], arrays)
