"""strata.model.writer: GGUF files written from given tensors read back exactly (GGUFReader)."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader, quants

from strata.model import arch
from strata.model.arch import ModelSpec
from strata.model.writer import byte_shape, row_bytes, write_gguf
from strata.tool.synth import synth_tokenizer_meta

SPEC = ModelSpec(arch="qwen3moe", n_layers=1, hidden=64, n_heads=4, n_kv_heads=2, head_dim=16,
                 n_experts=4, n_experts_used=2, expert_ffn=32, vocab=4096, context_length=256)
SPEC_QWEN2 = SPEC.with_(arch="qwen2moe", shared_ffn=64, norm_topk=False, tied_output=True)


def _make_tensors(spec: ModelSpec, rng: np.random.Generator):
    """(name, type, data, float values) for every tensor: Q8_0 for the attention matrices (real
    quantisation through gguf.quants), F16 for the experts, F32 for everything else."""
    out = []
    for name, shape in arch.expected_tensors(spec).items():
        values = rng.standard_normal(shape).astype(np.float32)
        if arch.is_small_tensor(name) or name.endswith("ffn_gate_inp.weight"):
            out.append((name, int(QT.F32), values, values))
        elif name.startswith("blk.") and ".attn_" in name:
            data = quants.quantize(values, QT.Q8_0)
            out.append((name, int(QT.Q8_0), data, quants.dequantize(data, QT.Q8_0)))
        else:
            half = values.astype(np.float16)
            out.append((name, int(QT.F16), half, half.astype(np.float32)))
    return out


@pytest.mark.parametrize("spec", [SPEC, SPEC_QWEN2], ids=["qwen3moe", "qwen2moe-tied"])
def test_round_trip_names_types_shapes_data(tmp_path, spec):
    rng = np.random.default_rng(1)
    tensors = _make_tensors(spec, rng)
    path = tmp_path / "m.gguf"
    size = write_gguf(path, spec, [(n, t, d) for n, t, d, _ in tensors],
                      synth_tokenizer_meta(spec.vocab), extra_meta={"general.file_type": 7})
    assert size == path.stat().st_size
    reader = GGUFReader(path)
    by_name = {t.name: t for t in reader.tensors}
    assert [t.name for t in reader.tensors] == [n for n, *_ in tensors]
    for name, qtype, _, values in tensors:
        t = by_name[name]
        assert int(t.tensor_type) == qtype
        assert tuple(int(d) for d in t.shape) == tuple(reversed(arch.expected_tensors(spec)[name]))
        got = quants.dequantize(t.data, t.tensor_type).reshape(values.shape)
        np.testing.assert_array_equal(got, values)
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert arch.spec_from_metadata(meta, {n: tuple(reversed([int(d) for d in t.shape]))
                                          for n, t in by_name.items()}) == \
        spec.with_(rms_eps=float(np.float32(spec.rms_eps)))  # GGUF stores it as float32
    assert meta["general.file_type"] == 7
    assert meta["tokenizer.ggml.add_bos_token"] is False


def test_lazy_tensors_are_made_one_at_a_time_in_order(tmp_path):
    tensors = _make_tensors(SPEC, np.random.default_rng(2))
    calls = []

    def lazy(name, data):
        def make():
            calls.append(name)
            return data
        return make

    write_gguf(tmp_path / "m.gguf", SPEC, [(n, t, lazy(n, d)) for n, t, d, _ in tensors],
               synth_tokenizer_meta(SPEC.vocab))
    assert calls == [n for n, *_ in tensors]


def _write(tmp_path, tensors):
    return write_gguf(tmp_path / "bad.gguf", SPEC, tensors, synth_tokenizer_meta(SPEC.vocab))


def test_rejects_wrong_shape_missing_unknown_and_duplicate_tensors(tmp_path):
    good = [(n, t, d) for n, t, d, _ in _make_tensors(SPEC, np.random.default_rng(3))]
    with pytest.raises(ValueError, match="missing tensors: output.weight"):
        _write(tmp_path, [e for e in good if e[0] != "output.weight"])
    with pytest.raises(ValueError, match="'blk.0.attn_q.bias' is not part"):
        _write(tmp_path, good + [("blk.0.attn_q.bias", 0, np.zeros(64, np.float32))])
    with pytest.raises(ValueError, match="given twice"):
        _write(tmp_path, good + [good[0]])
    wrong = [(n, t, np.zeros((3, 64), np.float32) if n == "output_norm.weight" else d)
             for n, t, d in good]
    with pytest.raises(ValueError, match=r"'output_norm.weight': F32 data must be float32 of "
                                         r"shape \(64,\), got float32 \(3, 64\)"):
        _write(tmp_path, wrong)
    short = [(n, t, d[..., :-1] if n == "blk.0.attn_q.weight" else d) for n, t, d in good]
    with pytest.raises(ValueError, match=r"Q8_0 data must be encoded uint8 rows of shape "
                                         r"\(64, 68\)"):
        _write(tmp_path, short)


def test_rejects_quantised_norms_and_rows_that_do_not_fit_the_block(tmp_path):
    good = [(n, t, d) for n, t, d, _ in _make_tensors(SPEC, np.random.default_rng(4))]
    norm = [(n, int(QT.F16) if n == "output_norm.weight" else t, d) for n, t, d in good]
    with pytest.raises(ValueError, match="'output_norm.weight' is a norm.*must be F32, got F16"):
        _write(tmp_path, norm)
    k_quant = [(n, int(QT.Q4_K) if n == "output.weight" else t, d) for n, t, d in good]
    with pytest.raises(ValueError, match="Q4_K stores rows in blocks of 256 values, but a row "
                                         "here has 64"):
        _write(tmp_path, k_quant)


def test_row_bytes_and_byte_shape():
    assert row_bytes(QT.Q4_0, 64) == 36
    assert row_bytes(QT.Q6_K, 512) == 420
    assert row_bytes(QT.F16, 3) == 6
    assert byte_shape(QT.Q4_K, (8, 32, 256)) == (8, 32, 144)


def test_a_failed_write_keeps_the_earlier_file_and_never_shows_half_a_model(tmp_path):
    # the model was written under its own name: an interrupted write deleted whatever file was
    # there before, and a killed one left a half-written model under the name
    path = tmp_path / "m.gguf"
    path.write_bytes(b"the earlier file")
    tensors = [(n, t, d) for n, t, d, _ in _make_tensors(SPEC, np.random.default_rng(5))]
    seen_while_writing = []

    def interrupted():
        seen_while_writing.append(path.read_bytes())
        raise KeyboardInterrupt

    broken = [(n, t, interrupted if n == "blk.0.ffn_up_exps.weight" else d)
              for n, t, d in tensors]
    with pytest.raises(KeyboardInterrupt):
        write_gguf(path, SPEC, broken, synth_tokenizer_meta(SPEC.vocab))
    assert seen_while_writing == [b"the earlier file"]
    assert path.read_bytes() == b"the earlier file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]
    nbytes = write_gguf(path, SPEC, tensors, synth_tokenizer_meta(SPEC.vocab))
    assert nbytes == path.stat().st_size and sorted(p.name for p in tmp_path.iterdir()) == [
        "m.gguf"]
    assert len(GGUFReader(path).tensors) == len(tensors)
