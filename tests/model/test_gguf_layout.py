"""GGUFModel: the tensors' data offsets (aligned, never overlapping) and the byte order."""
import shutil

import numpy as np
import pytest
from gguf import GGUFEndian, GGUFReader, GGUFValueType, GGUFWriter

from strata.errors import ModelFormatError
from strata.model.gguf_file import GGUFModel
from strata.tool.synth import synth_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("layout") / "tiny.gguf"
    synth_model(path, shape="tiny", weight_type="f16", seed=5)
    return path


@pytest.fixture
def copy(tiny, tmp_path):
    dst = tmp_path / "broken.gguf"
    shutil.copyfile(tiny, dst)
    return dst


def _rel_offsets(path) -> dict[str, int]:
    """Each tensor's data offset relative to the data section, as the header stores it."""
    reader = GGUFReader(path)
    return {t.name: int(t.field.parts[-1][0]) for t in reader.tensors}


def _set_rel_offsets(path, offsets: dict[str, int]) -> None:
    reader = GGUFReader(path, "r+")
    for t in reader.tensors:
        if t.name in offsets:
            t.field.parts[-1][0] = offsets[t.name]
    reader.data.flush()
    del reader


def _open_error(path) -> str:
    with pytest.raises(ModelFormatError) as info:
        GGUFModel.open(path)
    return str(info.value)


def _rewrite(src, dst, *, endianess=GGUFEndian.LITTLE, alignment=None) -> None:
    """Write `src`'s metadata and tensors again with gguf's own writer, in another byte order
    or with a `general.alignment` of its own."""
    reader = GGUFReader(src)
    writer = GGUFWriter(dst, reader.fields["general.architecture"].contents(),
                        endianess=endianess)
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.alignment"):
            continue
        sub = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], sub_type=sub)
    for t in reader.tensors:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes,
                               raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in reader.tensors:
        writer.write_tensor_data(np.asarray(t.data))  # swapped to `endianess` by the writer
    writer.close()


# ---- offsets -------------------------------------------------------------------------------
def test_overlapping_tensors_are_named(copy):
    # blk.1.attn_q starting 32 bytes into blk.0.attn_q (4096 f16 values = 8192 bytes): aligned,
    # inside the file, and both tensors would read each other's bytes as their own.
    rel = _rel_offsets(copy)
    _set_rel_offsets(copy, {"blk.1.attn_q.weight": rel["blk.0.attn_q.weight"] + 32})
    msg = _open_error(copy)
    assert "'blk.0.attn_q.weight'" in msg and "'blk.1.attn_q.weight'" in msg
    assert "overlap" in msg and "broken.gguf" in msg


def test_a_tensor_inside_another_is_named(copy):
    # a small norm vector pointed into the middle of the embedding table
    rel = _rel_offsets(copy)
    _set_rel_offsets(copy, {"output_norm.weight": rel["token_embd.weight"] + 4096})
    msg = _open_error(copy)
    assert "'token_embd.weight'" in msg and "'output_norm.weight'" in msg and "overlap" in msg


def test_a_misaligned_offset_is_named(copy):
    rel = _rel_offsets(copy)
    name = "blk.0.ffn_norm.weight"
    _set_rel_offsets(copy, {name: rel[name] + 4})  # inside the file; alignment is checked first
    msg = _open_error(copy)
    assert repr(name) in msg and f"data offset {rel[name] + 4}" in msg
    assert "not a multiple of the alignment 32" in msg


def test_tensors_out_of_file_order_but_apart_still_open(copy, tiny):
    # The spec asks only for aligned offsets; two tensors of one size swapped in the data
    # section are a valid file, and each name must read its own bytes.
    a, b = "blk.0.attn_k.weight", "blk.1.attn_k.weight"
    rel = _rel_offsets(copy)
    _set_rel_offsets(copy, {a: rel[b], b: rel[a]})
    with GGUFModel.open(tiny) as good, GGUFModel.open(copy) as swapped:
        assert np.array_equal(swapped.tensor(a).raw, good.tensor(b).raw)
        assert np.array_equal(swapped.tensor(b).raw, good.tensor(a).raw)


def test_a_custom_alignment_is_honoured(tiny, tmp_path):
    # gguf's writer pads every tensor to general.alignment; such a file opens, and an offset
    # aligned to the default 32 but not to the file's 64 is refused.
    path = tmp_path / "aligned64.gguf"
    _rewrite(tiny, path, alignment=64)
    with GGUFModel.open(path) as model, GGUFModel.open(tiny) as good:
        for name in good.tensor_names:
            assert (model.tensor(name).offset_bytes - model._reader.data_offset) % 64 == 0
            assert np.array_equal(model.tensor(name).raw, good.tensor(name).raw)
    rel = _rel_offsets(path)
    first = min(rel, key=rel.get)
    _set_rel_offsets(path, {first: rel[first] + 32})
    msg = _open_error(path)
    assert repr(first) in msg and "not a multiple of the alignment 64" in msg


# ---- byte order ----------------------------------------------------------------------------
def test_big_endian_is_refused(tiny, tmp_path):
    # It opened, with every F16/F32 weight read byte-swapped: garbage served silently.
    big = tmp_path / "big.gguf"
    _rewrite(tiny, big, endianess=GGUFEndian.BIG)
    msg = _open_error(big)
    assert "big-endian GGUF is not supported" in msg and "big.gguf" in msg
    assert "gguf-convert-endian" in msg
    # the same rewrite in little-endian order is byte for byte the file Strata wrote
    little = tmp_path / "little.gguf"
    _rewrite(tiny, little)
    assert little.read_bytes() == tiny.read_bytes()
