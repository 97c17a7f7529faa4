"""Conversation files: a parked KV's tokens and arrays round trip exactly; a truncated, corrupt
or foreign file is refused with an error naming it."""
from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from strata.engine.kv_file import MAGIC, SUFFIX, KVFileError, read_kv_file, read_kv_header, \
    write_kv_file

INT8_CELL = np.dtype([("codes", "i1", (8,)), ("scale", "<f4")])


def hybrid_value():
    """(keys, values, state) as a hybrid model's park gives them: the recurrent state at the
    end and checkpoints by position."""
    rng = np.random.default_rng(0)
    k = rng.standard_normal((3, 2, 5, 4)).astype(np.float16)  # [L, KV, n, D]
    v = rng.standard_normal((3, 2, 5, 4)).astype(np.float16)
    state = (5, (np.ones((2, 3, 4), np.float32), np.zeros((2, 1, 2, 2), np.float32)),
             {2: (np.full((2, 3, 4), 2.0, np.float32), np.full((2, 1, 2, 2), 3.0, np.float32))})
    return k, v, state


def assert_same(a, b):
    if isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape
        assert a.tobytes() == b.tobytes()
    elif isinstance(a, (tuple, list)):
        assert isinstance(b, tuple) and len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b)
        for key in a:
            assert_same(a[key], b[key])
    else:
        assert a == b and type(a) is type(b)


def test_a_hybrid_park_round_trips_with_its_header(tmp_path):
    path = tmp_path / f"a{SUFFIX}"
    value = hybrid_value()
    size = write_kv_file(path, [7, 8, 9, 10, 11], value,
                         {"model": "m1", "kv_format": "f", "reuse_points": [2, 5]})
    assert path.stat().st_size == size
    assert list(tmp_path.iterdir()) == [path]  # no .partial left
    header = read_kv_header(path)
    assert header["model"] == "m1" and header["reuse_points"] == [2, 5]
    assert header["num_tokens"] == 5
    tokens, back = read_kv_file(path)
    assert tokens == (7, 8, 9, 10, 11)
    assert_same(value, back)


def test_int8_cells_and_empty_arrays_round_trip(tmp_path):
    cells = np.zeros((2, 1, 3), INT8_CELL)  # [L, KV, n] records
    cells["codes"] = np.arange(48).reshape(2, 1, 3, 8) - 20
    cells["scale"] = 0.5
    value = (cells, cells.copy(), None)
    write_kv_file(tmp_path / "b", [1, 2, 3], value, {})
    tokens, back = read_kv_file(tmp_path / "b")
    assert tokens == (1, 2, 3)
    assert_same(value, back)
    empty = (np.empty((0, 2, 0, 4), np.float32),) * 2 + (None,)
    write_kv_file(tmp_path / "c", [], empty, {})
    assert_same(empty, read_kv_file(tmp_path / "c")[1])


def test_a_large_array_lands_in_memory_of_its_own(tmp_path):
    big = np.arange(2**19, dtype=np.float32).reshape(1, 1, 2**17, 4)  # 2 MiB
    write_kv_file(tmp_path / "d", [1] * 2**17, (big, big, None), {})
    _, (k, v, _) = read_kv_file(tmp_path / "d")
    assert np.array_equal(k, big) and np.array_equal(v, big)
    assert k.ctypes.data % 4096 == 0 and k.ctypes.data != v.ctypes.data


def test_what_cannot_be_stored_leaves_no_file(tmp_path):
    with pytest.raises(TypeError, match="str"):
        write_kv_file(tmp_path / "e", [1], ("text",), {})
    with pytest.raises(TypeError, match="booleans"):
        write_kv_file(tmp_path / "e", [1], (True,), {})
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def good_file(tmp_path):
    path = tmp_path / f"good{SUFFIX}"
    write_kv_file(path, list(range(40)), hybrid_value(), {"model": "m"})
    return path


@pytest.mark.parametrize("cut", [0, 5, 16, 100, 4096, -1])
def test_a_truncated_file_is_refused_by_name(good_file, cut):
    data = good_file.read_bytes()
    good_file.write_bytes(data[:cut] if cut >= 0 else data[:-100])
    with pytest.raises(KVFileError, match="good.strata-kv") as err:
        read_kv_file(good_file)
    assert any(w in str(err.value) for w in ("truncated", "too short", "header", "corrupt"))


def test_foreign_and_corrupt_headers_are_refused(good_file):
    data = bytearray(good_file.read_bytes())
    good_file.write_bytes(b"GGUF" + bytes(data[4:]))
    with pytest.raises(KVFileError, match="not a Strata conversation file"):
        read_kv_header(good_file)
    newer = bytearray(data)
    newer[8:12] = struct.pack("<I", 99)
    good_file.write_bytes(bytes(newer))
    with pytest.raises(KVFileError, match="version 99"):
        read_kv_header(good_file)
    _, _, header_bytes = struct.unpack("<8sII", bytes(data[:16]))
    garbled = bytearray(data)
    garbled[16:16 + header_bytes] = b"{" * header_bytes
    good_file.write_bytes(bytes(garbled))
    with pytest.raises(KVFileError, match="corrupt header"):
        read_kv_header(good_file)
    header = json.loads(bytes(data[16:16 + header_bytes]))
    header["arrays"][1]["shape"][0] += 1  # shape and bytes disagree
    text = json.dumps(header).encode().ljust(header_bytes)
    good_file.write_bytes(bytes(data[:16]) + text + bytes(data[16 + header_bytes:]))
    with pytest.raises(KVFileError, match="disagree"):
        read_kv_header(good_file)


def _edit_header(path, edit):
    """Rewrite the JSON header of the conversation file at `path` through `edit(header)`, its
    length kept (the arrays stay where they are)."""
    data = path.read_bytes()
    _, _, header_bytes = struct.unpack("<8sII", data[:16])
    header = json.loads(data[16:16 + header_bytes])
    edit(header)
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= header_bytes
    path.write_bytes(data[:16] + text.ljust(header_bytes) + data[16 + header_bytes:])


@pytest.mark.parametrize("damage", [
    lambda h: h["tree"]["tuple"].__setitem__(0, {"array": 7}),        # no array 7
    lambda h: h["tree"]["tuple"].__setitem__(0, {"array": "1"}),
    lambda h: h["tree"].__setitem__("tuple", 5),
    lambda h: h["tree"]["tuple"][2]["tuple"].__setitem__(0, {"int": "x"}),
    lambda h: h.__setitem__("reuse_points", "abc"),
    lambda h: h.__setitem__("reuse_points", 5),
    lambda h: h.__setitem__("kv_nbytes", "x"),
    lambda h: h["arrays"][1].__setitem__("shape", [-3, -2, 5, 4]),     # -3 x -2: the same bytes
    lambda h: h["arrays"][1].__setitem__("offset", -4096),
    lambda h: h["arrays"][1].update(dtype="|O", nbytes=960),           # 120 objects
    lambda h: h["arrays"][0].update(dtype="<i2", nbytes=80),  # tokens not int32
], ids=["array-index", "array-index-text", "tuple-not-list", "int-not-int", "reuse-text",
        "reuse-int", "kv-nbytes", "negative-shape", "negative-offset", "object-dtype",
        "token-dtype"])
def test_a_header_damaged_inside_its_json_is_refused(good_file, damage):
    # JSON that still parses (one flipped digit, a hand edit) must not reach the engine:
    # each of these crashed `strata run --conversation-cache-dir` with a traceback
    _edit_header(good_file, damage)
    with pytest.raises(KVFileError, match="good.strata-kv: corrupt header"):
        read_kv_header(good_file)


def test_a_missing_file_is_a_kv_file_error(tmp_path):
    with pytest.raises(KVFileError, match="cannot read"):
        read_kv_header(tmp_path / "none")
    assert MAGIC == b"STRATAKV"


leaf_arrays = hnp.arrays(
    dtype=st.sampled_from([np.float32, np.float16, np.int8, INT8_CELL]),
    shape=hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5))
trees = st.recursive(
    st.one_of(leaf_arrays, st.none(), st.integers(-2**40, 2**40)),
    lambda inner: st.one_of(st.lists(inner, max_size=3).map(tuple),
                            st.dictionaries(st.integers(0, 10**6), inner, max_size=3)),
    max_leaves=8)


@settings(max_examples=60, deadline=None)
@given(tokens=st.lists(st.integers(0, 2**31 - 1), max_size=50), value=trees)
def test_any_tree_of_arrays_round_trips(tmp_path_factory, tokens, value):
    path = tmp_path_factory.mktemp("kv") / "f"
    write_kv_file(path, tokens, value, {"model": "x"})
    got_tokens, got = read_kv_file(path)
    assert got_tokens == tuple(tokens)
    assert_same(value, got)
