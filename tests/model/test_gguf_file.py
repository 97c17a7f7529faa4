"""GGUFModel: reading a synth model back, and a clear ModelFormatError for each broken file."""
import os
import shutil

import numpy as np
import pytest
from gguf import GGUFReader

from strata._native import kernels
from strata.errors import ModelFormatError
from strata.model import arch
from strata.model.gguf_file import GGUFModel
from strata.tool.synth import synth_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    spec = synth_model(path, shape="tiny", weight_type="f16", seed=3)
    return path, spec


@pytest.fixture
def copy(tiny, tmp_path):
    """A fresh copy of the tiny model to corrupt."""
    dst = tmp_path / "broken.gguf"
    shutil.copyfile(tiny[0], dst)
    return dst


def _edit_header(path, edit):
    """Open `path` read-write with gguf's own reader and let `edit(reader)` poke header bytes."""
    reader = GGUFReader(path, "r+")
    edit(reader)
    reader.data.flush()
    del reader


def _tensor_field(reader, name):
    return next(t.field for t in reader.tensors if t.name == name)


def _open_error(path) -> str:
    with pytest.raises(ModelFormatError) as info:
        GGUFModel.open(path)
    return str(info.value)


# ---- reading a good file -------------------------------------------------------------------
def test_open_reads_spec_metadata_and_tensors(tiny):
    path, spec = tiny
    with GGUFModel.open(path) as model:
        # GGUF stores the epsilon as float32
        assert model.spec == spec.with_(rms_eps=float(np.float32(spec.rms_eps)))
        assert model.path == path
        assert model.metadata["general.architecture"] == "qwen3moe"
        assert model.metadata["qwen3moe.block_count"] == spec.n_layers
        assert isinstance(model.metadata["tokenizer.ggml.tokens"], list)
        assert all(isinstance(s, str) for s in model.metadata["tokenizer.ggml.tokens"][:10])
        assert not any(key.startswith("GGUF.") for key in model.metadata)
        expected = arch.expected_tensors(spec)
        assert set(model.tensor_names) == set(expected)
        for name, shape in expected.items():
            t = model.tensor(name)
            assert t.name == name and t.shape == shape


def test_metadata_equals_the_stock_reader(tiny):
    # gguf_file reads arrays on a fast path of its own; it must give what gguf's reader gives.
    stock = {k: f.contents() for k, f in GGUFReader(tiny[0]).fields.items()
             if not k.startswith("GGUF.")}
    with GGUFModel.open(tiny[0]) as model:
        assert model.metadata == stock
        assert len(model.metadata["tokenizer.ggml.tokens"]) == model.spec.vocab
        assert set(model.metadata["tokenizer.ggml.token_type"]) <= {1, 3, 4, 5}
        assert all(" " in m for m in model.metadata["tokenizer.ggml.merges"][:50])


def test_tensor_views_are_the_file_bytes(tiny):
    path, spec = tiny
    blob = path.read_bytes()
    reader = GGUFReader(path)
    by_name = {t.name: t for t in reader.tensors}
    with GGUFModel.open(path) as model:
        for name in ("token_embd.weight", "blk.1.ffn_down_exps.weight", "blk.0.attn_norm.weight"):
            t = model.tensor(name)
            ref = by_name[name]
            assert t.qtype == int(ref.tensor_type)
            assert t.offset_bytes == ref.data_offset and t.nbytes == ref.n_bytes
            assert t.raw.dtype == np.uint8 and not t.raw.flags.writeable
            assert t.raw.tobytes() == blob[t.offset_bytes:t.offset_bytes + t.nbytes]
        exps = model.tensor("blk.0.ffn_gate_exps.weight")  # F16: 2 bytes a value
        assert exps.raw.shape == (spec.n_experts, spec.expert_ffn, spec.hidden * 2)
        assert model.tensor("blk.0.attn_norm.weight").raw.shape == (spec.hidden * 4,)


def test_unknown_tensor_name_is_a_key_error(tiny):
    with GGUFModel.open(tiny[0]) as model:
        with pytest.raises(KeyError, match="no tensor named 'nope'"):
            model.tensor("nope")


# ---- broken files ---------------------------------------------------------------------------
def test_not_gguf(tmp_path):
    path = tmp_path / "garbage.gguf"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    msg = _open_error(path)
    assert "garbage.gguf" in msg and "not a GGUF file" in msg
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    assert "not a GGUF file" in _open_error(empty)


def test_missing_file(tmp_path):
    assert "no such model file" in _open_error(tmp_path / "absent.gguf")


def test_garbage_after_magic_is_an_unreadable_header(tmp_path):
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"GGUF" + (7).to_bytes(4, "little") + bytes(range(256)) * 4)
    msg = _open_error(path)
    assert "unreadable GGUF header" in msg and "version 7" in msg


def test_garbage_counts_do_not_hang(tmp_path):
    # version 3, then counts and a key length far past the end of the file
    body = (3).to_bytes(4, "little") + (1).to_bytes(8, "little") + (2**40).to_bytes(8, "little")
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"GGUF" + body + b"\xff" * 64)
    assert "runs past the end of the file" in _open_error(path)


@pytest.mark.parametrize("where", ["header", "first tensor", "middle", "last byte"])
def test_truncated(copy, where):
    size = copy.stat().st_size
    reader = GGUFReader(copy)
    data_start = reader.tensors[0].data_offset
    last = max(reader.tensors, key=lambda t: t.data_offset)
    del reader
    cut = {"header": 40, "first tensor": data_start + 3, "middle": size // 2,
           "last byte": size - 1}[where]
    with open(copy, "r+b") as f:
        f.truncate(cut)
    msg = _open_error(copy)
    assert "truncated" in msg and "broken.gguf" in msg
    if where == "last byte":
        assert repr(last.name) in msg and f"the file has {size - 1}" in msg


def test_unknown_architecture(copy):
    def edit(reader):
        reader.fields["general.architecture"].parts[-1][:] = np.frombuffer(b"qwen9moe", np.uint8)

    _edit_header(copy, edit)
    msg = _open_error(copy)
    assert "unknown architecture 'qwen9moe'" in msg and "qwen3moe" in msg


@pytest.mark.parametrize("key, value, message", [
    ("qwen3moe.context_length", 0, "context_length = 0 must be positive"),
    ("qwen3moe.rope.freq_base", -5.0, "rope.freq_base = -5.0 must be a positive number"),
    ("qwen3moe.rope.freq_base", float("nan"), "rope.freq_base = nan must be a positive number"),
    ("qwen3moe.attention.layer_norm_rms_epsilon", -1.0,
     "layer_norm_rms_epsilon = -1.0 must be a number >= 0"),
])
def test_impossible_hyperparameters_are_named(copy, key, value, message):
    # they opened, then failed later as "KV cache capacity 0" or "NaN logits ... weights corrupt"
    def edit(reader):
        reader.fields[key].parts[-1][0] = value

    _edit_header(copy, edit)
    msg = _open_error(copy)
    assert message in msg and "broken.gguf" in msg


def test_missing_tensor(copy):
    name = "blk.1.ffn_up_exps.weight"

    def edit(reader):  # rename the tensor, as if it had been dropped
        _tensor_field(reader, name).parts[1][-1] = ord("X")

    _edit_header(copy, edit)
    msg = _open_error(copy)
    assert "missing" in msg and name in msg


def test_wrong_shape(copy):
    name = "blk.0.attn_q.weight"  # numpy shape (64, 64); halve the rows (ggml dim 1)

    def edit(reader):
        _tensor_field(reader, name).parts[3][1] = 32

    _edit_header(copy, edit)
    msg = _open_error(copy)
    assert repr(name) in msg and "shape (32, 64), expected (64, 64)" in msg


def test_unsupported_type(copy):
    name = "blk.0.attn_k.weight"

    def edit(reader):
        _tensor_field(reader, name).parts[4][0] = 34  # TQ1_0

    _edit_header(copy, edit)
    msg = _open_error(copy)
    assert repr(name) in msg and "TQ1_0" in msg
    assert "F32" in msg and "Q4_0" in msg  # the supported types are listed
    assert 34 not in kernels.SUPPORTED_TYPES


def test_unknown_type_id(copy):
    def edit(reader):
        _tensor_field(reader, "blk.0.attn_v.weight").parts[4][0] = 77

    _edit_header(copy, edit)
    msg = _open_error(copy)
    assert "'blk.0.attn_v.weight'" in msg and "type id 77" in msg


def test_a_huge_dimension_is_truncated_not_an_overflow(copy):
    # A flipped high byte of a dimension: its size overflows int64, which must not wrap round
    # to a size the file seems to hold.
    name = "blk.0.ffn_up_exps.weight"

    def edit(reader):
        _tensor_field(reader, name).parts[3][2] = 2**62  # x 32 rows wraps to 0 in int64

    _edit_header(copy, edit)
    msg = _open_error(copy)
    assert "truncated" in msg and repr(name) in msg


def test_k_quant_row_not_a_multiple_of_256(copy):
    name = "blk.0.attn_output.weight"  # rows of 64 values

    def edit(reader):
        _tensor_field(reader, name).parts[4][0] = 12  # Q4_K

    _edit_header(copy, edit)
    msg = _open_error(copy)
    assert repr(name) in msg and "rows of 64 values" in msg and "Q4_K block of 256" in msg


def _is_mapped(array) -> bool:
    """Whether `array` is a view of a numpy memory map (the file's), through its bases."""
    while array is not None:
        if isinstance(array, np.memmap):
            return True
        array = getattr(array, "base", None)
    return False


def test_load_into_memory_keeps_every_tensor_and_leaves_the_map(tiny):
    path, _ = tiny
    with GGUFModel.open(path) as model:
        before = {name: model.tensor(name) for name in model.tensor_names}
        assert not model.in_memory and all(_is_mapped(t.raw) for t in before.values())
        assert model.tensor_bytes == (max(t.offset_bytes + t.nbytes for t in before.values())
                                      - min(t.offset_bytes for t in before.values()))
        assert model.load_into_memory(progress=False) > 0.0
        assert model.in_memory
        for name, old in before.items():
            new = model.tensor(name)
            assert not _is_mapped(new.raw) and not new.raw.flags.writeable
            assert (new.qtype, new.shape, new.offset_bytes) == (old.qtype, old.shape,
                                                                old.offset_bytes)
            assert new.raw.shape == old.raw.shape and np.array_equal(new.raw, old.raw)
        assert model.load_into_memory(progress=False) == 0.0      # once
        # a view handed out before still reads the map
        assert _is_mapped(before["token_embd.weight"].raw)


def test_a_file_cut_short_after_opening_is_named_when_read_into_memory(copy):
    with GGUFModel.open(copy) as model:
        end = model.tensor_bytes
        os.truncate(copy, os.path.getsize(copy) - end // 2)
        with pytest.raises(ModelFormatError, match=r"broken\.gguf: truncated while reading it "
                                                   r"into RAM: .* \(--mmap\)"):
            model.load_into_memory(progress=False)
        assert not model.in_memory


@pytest.mark.parametrize("block_count, message", [
    (2**32 - 1, "says 4294967295 layers but there is no tensor 'blk.4294967294.attn_norm.weight'"
                " (the last layer with tensors is blk.1)"),
    (3, "says 3 layers but there is no tensor 'blk.2.attn_norm.weight'"),
    (1, "says 1 layers but the file has tensors of layer 1"),
])
def test_a_block_count_the_tensors_do_not_bear_out_is_named(copy, block_count, message):
    # A corrupt count of 2**32 - 1 built per-layer tensor tables for hours (and GiBs); a count
    # one short opened the 2-layer file as a 1-layer model and served it without its last layer.
    def edit(reader):
        reader.fields["qwen3moe.block_count"].parts[-1][0] = block_count

    _edit_header(copy, edit)
    msg = _open_error(copy)
    assert message in msg and "'qwen3moe.block_count'" in msg and "broken.gguf" in msg


def _write_tiny_with(path, extra_meta):
    """The tiny F32 model with `extra_meta` replacing or adding metadata keys."""
    from gguf import GGMLQuantizationType as QT

    from strata.model.writer import write_gguf
    from strata.tool.synth import _make_tensor, _write_order, build_spec, synth_tokenizer_meta

    spec = build_spec("tiny")
    tensors = [(n, QT.F32, _make_tensor(spec, n, QT.F32, 0)) for n in _write_order(spec)]
    write_gguf(path, spec, tensors, synth_tokenizer_meta(spec.vocab), extra_meta=extra_meta)


@pytest.mark.parametrize("key, value, message", [
    # a ValueError traceback from int('abc')
    ("qwen3moe.expert_feed_forward_length", ["abc"],
     "'qwen3moe.expert_feed_forward_length' is ['abc'], expected one integer per layer"),
    # an OverflowError traceback from int(inf)
    ("qwen3moe.expert_count", float("inf"),
     "'qwen3moe.expert_count' has value inf, expected an integer"),
    # these opened, silently read as 8 experts and as True
    ("qwen3moe.expert_count", 8.5, "'qwen3moe.expert_count' has value 8.5, expected an integer"),
    ("qwen3moe.block_count", "2", "'qwen3moe.block_count' has value '2', expected an integer"),
    ("qwen3moe.expert_weights_norm", "false",
     "'qwen3moe.expert_weights_norm' has value 'false', expected bool"),
    # named as a block_count of 3, or as "n_layers = -2147483646 must be positive"
    ("qwen3moe.nextn_predict_layers", -1, "'qwen3moe.nextn_predict_layers' = -1 must lie in 0..1"),
    ("qwen3moe.nextn_predict_layers", 2**31,
     "'qwen3moe.nextn_predict_layers' = 2147483648 must lie in 0..1"),
])
def test_metadata_of_the_wrong_type_is_named(tmp_path, key, value, message):
    path = tmp_path / "typed.gguf"
    _write_tiny_with(path, {key: value})
    msg = _open_error(path)
    assert message in msg and "typed.gguf" in msg


def test_metadata_of_the_right_type_still_opens(tmp_path):
    path = tmp_path / "typed.gguf"
    _write_tiny_with(path, {"qwen3moe.expert_feed_forward_length": [32, 32],
                            "qwen3moe.expert_weights_norm": False,
                            "qwen3moe.rope.freq_base": 10000})  # an int where a float goes
    with GGUFModel.open(path) as model:
        assert (model.spec.expert_ffn, model.spec.norm_topk) == (32, False)
        assert model.spec.rope_theta == 10000.0
