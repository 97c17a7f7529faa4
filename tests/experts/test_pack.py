"""Expert pack: byte-exact round trip, 4096 alignment, refusal of foreign or damaged packs,
moe_ffn on pack views equal to GGUF views, and the `pack` command."""
import json
import os
import struct

import numpy as np
import pytest
from click.testing import CliRunner

from strata._native import kernels
from strata.errors import ConfigError, ModelFormatError
from strata.experts.pack import ALIGN_BYTES, PACK_MAGIC, ExpertPack, model_identity, write_pack
from strata.model.gguf_file import GGUFModel
from strata.tool.pack_cmd import pack as pack_command
from strata.tool.synth import synth_model

WEIGHT_TYPES = ("q4_0", "f32")


def make_model(directory, weight_type="q4_0", seed=0, **overrides):
    path = directory / f"m-{weight_type}-{seed}-{len(overrides)}.gguf"
    if not path.exists():
        synth_model(path, shape="tiny", weight_type=weight_type, seed=seed, **overrides)
    return GGUFModel.open(path)


def make_pack(directory, model, name=None):
    out = directory / (name or (model.path.stem + ".pack"))
    if not out.exists():
        write_pack(model, out)
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("packs")
    out = {}
    for wt in WEIGHT_TYPES:
        model = make_model(d, wt)
        out[wt] = (model, make_pack(d, model))
    return out


def gguf_expert(model, layer, expert):
    return tuple(model.tensor(f"blk.{layer}.ffn_{p}_exps.weight").raw[expert]
                 for p in ("gate", "up", "down"))


@pytest.mark.parametrize("weight_type", WEIGHT_TYPES)
def test_every_expert_round_trips_byte_exact(models, weight_type):
    model, path = models[weight_type]
    pack = ExpertPack.open(path, model)
    spec = model.spec
    assert (pack.n_layers, pack.n_experts) == (spec.n_layers, spec.n_experts)
    for layer in range(spec.n_layers):
        for e in range(spec.n_experts):
            got, want = pack.expert(layer, e), gguf_expert(model, layer, e)
            for g, w in zip(got, want):
                assert g.shape == w.shape and g.dtype == np.uint8
                assert np.array_equal(g, w)
            # gate, up and down lie back to back in one span
            assert np.array_equal(pack.expert_span(layer, e),
                                  np.concatenate([w.reshape(-1) for w in want]))
    # the experts really differ, so equality above is not vacuous
    assert not np.array_equal(pack.expert(0, 0)[0], pack.expert(0, 1)[0])


@pytest.mark.parametrize("weight_type", WEIGHT_TYPES)
def test_experts_are_aligned_and_pack_has_exact_size(models, weight_type):
    model, path = models[weight_type]
    pack = ExpertPack.open(path, model)
    spans = []
    for layer in range(pack.n_layers):
        for e in range(pack.n_experts):
            off = pack.offset(layer, e)
            assert off % ALIGN_BYTES == 0
            assert pack.expert_span(layer, e).ctypes.data % ALIGN_BYTES == 0
            spans.append((off, off + pack.layouts[layer].expert_nbytes))
    spans.sort()
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    first_data = spans[0][0]
    assert first_data >= ALIGN_BYTES * 2  # header page, then the index
    last_expert_bytes = pack.layouts[-1].expert_nbytes
    assert os.path.getsize(path) == spans[-1][0] + -(-last_expert_bytes // ALIGN_BYTES) * \
        ALIGN_BYTES


def test_views_are_read_only(models):
    model, path = models["q4_0"]
    gate, _, _ = ExpertPack.open(path, model).expert(1, 3)
    with pytest.raises(ValueError):
        gate[0, 0] = 1


@pytest.mark.parametrize("weight_type", WEIGHT_TYPES)
def test_moe_ffn_on_pack_views_equals_gguf_views(models, weight_type):
    model, path = models[weight_type]
    pack = ExpertPack.open(path, model)
    spec = model.spec
    rng = np.random.default_rng(7)
    x = rng.standard_normal((5, spec.hidden)).astype(np.float32)             # [T, H]
    ids = np.zeros((5, 1), dtype=np.int32)                                    # [T, K]
    weights = rng.uniform(0.2, 1.0, (5, 1)).astype(np.float32)                # [T, K]
    for layer in range(spec.n_layers):
        types = pack.layouts[layer].types
        for e in range(spec.n_experts):
            results = []
            for views in (pack.expert(layer, e), gguf_expert(model, layer, e)):
                gate, up, down = (v[None] for v in views)                    # [1, rows, rb]
                out = np.zeros((5, spec.hidden), dtype=np.float32)          # [T, H]
                kernels.moe_ffn(x, gate, types[0], up, types[1], down, types[2], ids,
                                weights, out)
                results.append(out)
            assert np.array_equal(results[0], results[1])
            assert np.abs(results[0]).max() > 0
            if weight_type == "f32":  # and it is the right expert: float64 reference
                g, u, d = (v.view(np.float32).astype(np.float64) for v in pack.expert(layer, e))
                h = g @ x.T.astype(np.float64)                                # [F, T]
                y = (d @ (h / (1 + np.exp(-h)) * (u @ x.T))).T * weights      # [T, H]
                np.testing.assert_allclose(results[0], y, rtol=1e-4, atol=1e-5)


def test_pack_of_another_model_is_refused(tmp_path, models):
    model, path = models["q4_0"]
    same_shape_other_seed = make_model(tmp_path, "q4_0", seed=1)
    assert model_identity(same_shape_other_seed) != model_identity(model)
    with pytest.raises(ModelFormatError, match="written for another model") as info:
        ExpertPack.open(path, same_shape_other_seed)
    assert "strata-tool pack" in str(info.value)
    more_layers = make_model(tmp_path, "q4_0", n_layers=3)
    with pytest.raises(ModelFormatError, match="3 layers"):
        ExpertPack.open(path, more_layers)
    with pytest.raises(ModelFormatError, match="written for another model"):
        ExpertPack.open(models["f32"][1], model)


def test_truncated_pack_is_refused(tmp_path, models):
    model, path = models["q4_0"]
    cut = tmp_path / "cut.pack"
    data = path.read_bytes()
    cut.write_bytes(data[:len(data) - 100])
    with pytest.raises(ModelFormatError, match=f"truncated.*{len(data)} bytes but has "
                                               f"{len(data) - 100}"):
        ExpertPack.open(cut, model)
    cut.write_bytes(data[:10])
    with pytest.raises(ModelFormatError, match="not a Strata expert pack"):
        ExpertPack.open(cut, model)


def test_damaged_packs_are_refused(tmp_path, models):
    model, path = models["q4_0"]
    data = bytearray(path.read_bytes())
    bad = tmp_path / "bad.pack"
    with pytest.raises(ModelFormatError, match="no such expert pack"):
        ExpertPack.open(bad, model)
    bad.write_bytes(model.path.read_bytes()[:8192])
    with pytest.raises(ModelFormatError, match="not a Strata expert pack"):
        ExpertPack.open(bad, model)
    wrong_version = bytearray(data)
    wrong_version[8:12] = struct.pack("<I", 99)
    bad.write_bytes(wrong_version)
    with pytest.raises(ModelFormatError, match="version 99"):
        ExpertPack.open(bad, model)
    garbled = bytearray(data)
    garbled[16:20] = b"\xff\xfe{{"
    bad.write_bytes(garbled)
    with pytest.raises(ModelFormatError, match="header is corrupt"):
        ExpertPack.open(bad, model)
    header_bytes = struct.unpack("<I", bytes(data[12:16]))[0]
    index_offset = json.loads(bytes(data[16:16 + header_bytes]))["index_offset"]
    moved = bytearray(data)
    moved[index_offset:index_offset + 8] = struct.pack("<q", 12345)
    bad.write_bytes(moved)
    with pytest.raises(ModelFormatError, match="index is corrupt"):
        ExpertPack.open(bad, model)


def test_write_leaves_no_partial_file_and_is_deterministic(tmp_path, models):
    model, path = models["f32"]
    out = tmp_path / "again.pack"
    nbytes = write_pack(model, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again.pack"]
    assert nbytes == os.path.getsize(out)
    assert out.read_bytes() == path.read_bytes()
    assert out.read_bytes()[:8] == PACK_MAGIC


def test_pack_command(tmp_path, models):
    model, path = models["q4_0"]
    out = tmp_path / "cmd.pack"
    result = CliRunner().invoke(pack_command, [str(model.path), str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    assert result.output.startswith(f"wrote {out}: {os.path.getsize(out)} bytes")
    assert out.read_bytes() == path.read_bytes()
    result = CliRunner().invoke(pack_command, [str(tmp_path / "nope.gguf"), str(out)])
    assert result.exit_code == 2
    assert "no such model file" in result.output


def test_packing_a_model_onto_itself_is_refused_and_leaves_it(tmp_path, models):
    # `strata-tool pack m.gguf m.gguf` replaced the model with its pack
    model = make_model(tmp_path, "q4_0", seed=2)
    before = model.path.read_bytes()
    with pytest.raises(ConfigError, match="is the model itself"):
        write_pack(model, tmp_path / ".." / tmp_path.name / model.path.name)
    assert model.path.read_bytes() == before
    result = CliRunner().invoke(pack_command, [str(model.path), str(model.path), "--quiet"])
    assert result.exit_code == 2 and "is the model itself" in result.output
    assert model.path.read_bytes() == before


def test_a_gguf_given_as_the_pack_is_not_offered_to_be_overwritten(tmp_path, models):
    # the hint for a file that is not a pack must not name that file as the pack to write
    model, _ = models["q4_0"]
    other = make_model(tmp_path, "q4_0", seed=3)
    for not_a_pack in (model.path, other.path):
        with pytest.raises(ModelFormatError, match="not a Strata expert pack") as info:
            ExpertPack.open(not_a_pack, model)
        assert f"`strata-tool pack {model.path} {not_a_pack}`" not in str(info.value)
        assert f"`strata-tool pack {model.path} OUT.pack`" in str(info.value)


def _with_header(data: bytes, **changes) -> bytes:
    """`data` (a pack) with its JSON header's keys changed as `changes` say."""
    header_bytes = struct.unpack("<I", data[12:16])[0]
    header = json.loads(data[16:16 + header_bytes])
    header.update(changes)
    blob = json.dumps(header).encode()
    out = bytearray(data)
    out[12:ALIGN_BYTES] = bytes(ALIGN_BYTES - 12)
    out[12:16 + len(blob)] = struct.pack("<I", len(blob)) + blob
    return bytes(out)


@pytest.mark.parametrize("changes", [
    {"index_offset": 10**12}, {"index_offset": -8}, {"index_offset": "73720"},
    {"file_bytes": 0}, {"file_bytes": -1}, {"file_bytes": 100}, {"data_offset": 0},
])
def test_a_pack_whose_header_lies_about_offsets_is_refused(tmp_path, models, changes):
    # these failed inside numpy ("offset must be non-negative and no greater than buffer
    # length", "memory mapped length must be positive"): a traceback, not the pack named
    model, path = models["q4_0"]
    bad = tmp_path / "lying.pack"
    bad.write_bytes(_with_header(path.read_bytes(), **changes))
    with pytest.raises(ModelFormatError, match="lying.pack: the expert pack's header is corrupt"):
        ExpertPack.open(bad, model)


def test_packing_into_a_folder_is_refused_before_writing(tmp_path, models):
    # the whole pack was written as folder.partial, then the rename failed with an
    # IsADirectoryError traceback and the pack-sized .partial stayed behind
    model, _ = models["q4_0"]
    folder = tmp_path / "packs"
    folder.mkdir()
    with pytest.raises(ConfigError, match=f"{folder} is a folder; give the pack's file path"):
        write_pack(model, folder)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["packs"]
    assert list(folder.iterdir()) == []


def test_a_pack_write_that_fails_midway_leaves_no_partial_file(tmp_path, models):
    # a full disk (here: a file size limit) left a pack-sized out.pack.partial behind
    import resource
    import signal

    model, path = models["q4_0"]
    out = tmp_path / "out.pack"
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG, not a killed worker
    resource.setrlimit(resource.RLIMIT_FSIZE, (16384, old_limit[1]))
    try:
        with pytest.raises(OSError):
            write_pack(model, out)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)
    assert list(tmp_path.iterdir()) == []
    assert write_pack(model, out) == path.stat().st_size


def test_a_model_of_94_layers_packs(tmp_path):
    """Qwen3-235B-A22B's 94 layers: the header outgrew its one page at ~55 layers and the pack
    was refused; it now takes two, and the index follows them."""
    model = make_model(tmp_path, "q4_0", n_layers=94)
    out = make_pack(tmp_path, model)
    data = out.read_bytes()
    header_bytes = struct.unpack("<I", data[12:16])[0]
    assert 16 + header_bytes > ALIGN_BYTES
    assert json.loads(data[16:16 + header_bytes])["index_offset"] == 2 * ALIGN_BYTES
    pack = ExpertPack.open(out, model)
    for layer, expert in ((0, 0), (50, 3), (93, 7)):
        assert tuple(bytes(b) for b in pack.expert(layer, expert)) == tuple(
            bytes(b) for b in gguf_expert(model, layer, expert))
    pack.close()
    model.close()
