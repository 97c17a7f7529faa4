"""qwen3next files as llama.cpp writes them: the multi-token-prediction layer counted in
block_count, the first converter's ssm_in for attn_qkv + attn_gate, metadata errors."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader

from strata.backends.cpu import CpuModel
from strata.errors import ModelFormatError
from strata.model import arch
from strata.model.gguf_file import GGUFModel
from strata.model.writer import write_gguf
from strata.tool.synth import synth_model, synth_tokenizer_meta


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("q3n") / "tiny.gguf"
    spec = synth_model(path, shape="tiny-qwen3next", weight_type="f32", seed=21)
    return path, spec


def _tensors(path) -> dict[str, np.ndarray]:
    reader = GGUFReader(path)
    return {t.name: np.array(t.data, dtype=np.float32).reshape(
        [int(n) for n in reversed(t.shape)]) for t in reader.tensors}


def _logits(path, tokens):
    model = CpuModel(GGUFModel.open(path))
    return model.forward(tokens, model.new_kv(32), all_logits=True)


def test_legacy_ssm_in_gives_the_same_logits(model_file, tmp_path):
    """ssm_in is HF's in_proj_qkvz, grouped by key head: q, k, then v and z of its value
    heads. Strata reorders its rows at load; the logits equal the split file's exactly."""
    path, spec = model_file
    tensors = _tensors(path)
    dk, dv, r = spec.ssm_state, spec.ssm_v_dim, spec.ssm_heads // spec.ssm_groups
    for i in spec.recurrent_layers:
        p = f"blk.{i}."
        qkv, z = tensors.pop(p + "attn_qkv.weight"), tensors.pop(p + "attn_gate.weight")
        key_dim = spec.ssm_groups * dk
        q, k, v = qkv[:key_dim], qkv[key_dim:2 * key_dim], qkv[2 * key_dim:]
        tensors[p + "ssm_in.weight"] = np.concatenate(
            [np.concatenate([q[g * dk:(g + 1) * dk], k[g * dk:(g + 1) * dk],
                             v[g * r * dv:(g + 1) * r * dv], z[g * r * dv:(g + 1) * r * dv]])
             for g in range(spec.ssm_groups)])
    legacy = tmp_path / "legacy.gguf"
    write_gguf(legacy, spec, [(n, 0, a) for n, a in tensors.items()],
               synth_tokenizer_meta(spec.vocab), legacy_ssm_in=True)
    tokens = np.arange(3, 23, dtype=np.int32)
    np.testing.assert_array_equal(_logits(legacy, tokens), _logits(path, tokens))


def _meta(spec, **changes):
    meta = arch.spec_to_metadata(spec)
    meta.update(changes)
    return meta


def test_mtp_layer_is_not_counted(model_file):
    _, spec = model_file
    meta = _meta(spec, **{"qwen3next.block_count": spec.n_layers + 1,
                          "qwen3next.nextn_predict_layers": 1})
    meta["qwen3next.attention.recurrent_layers"] = [spec.is_recurrent(i)
                                                    for i in range(spec.n_layers)] + [False]
    assert arch.spec_from_metadata(meta) == spec


def test_layer_pattern_from_the_array(model_file):
    _, spec = model_file
    meta = _meta(spec)
    del meta["qwen3next.full_attention_interval"]  # the array alone says it
    assert arch.spec_from_metadata(meta).attention_layers == spec.attention_layers
    meta["qwen3next.attention.recurrent_layers"] = [True, False, False, True]
    with pytest.raises(ModelFormatError, match="recurrent_layers"):
        arch.spec_from_metadata(meta)


@pytest.mark.parametrize("key, value, match", [
    ("qwen3next.ssm.group_count", 3, "multiple of 3 key heads"),
    ("qwen3next.ssm.state_size", 0, "ssm.state_size"),
    ("qwen3next.rope.dimension_count", 7, "rope.dimension_count"),
])
def test_bad_recurrent_metadata_is_named(model_file, key, value, match):
    _, spec = model_file
    with pytest.raises(ModelFormatError, match=match):
        arch.spec_from_metadata(_meta(spec, **{key: value}))


def test_missing_ssm_key_is_named(model_file):
    _, spec = model_file
    meta = _meta(spec)
    del meta["qwen3next.ssm.conv_kernel"]
    with pytest.raises(ModelFormatError, match="ssm.conv_kernel"):
        arch.spec_from_metadata(meta)
