"""strata.tool.synth / presets: deterministic random models with sane weights in every type."""
import hashlib
import math

import numpy as np
import pytest
from gguf import GGUFReader, quants
from tokenizers import Tokenizer

from strata.errors import ConfigError
from strata.model import arch
from strata.tool.presets import PRESETS, SYNTH_TOKENIZER_VOCAB, get_preset
from strata.tool.synth import (MIXES, WEIGHT_TYPES, build_spec, data_text, synth_model,
                               synth_tokenizer_meta)

# tiny widened so every row is a multiple of 256 (k-quants need it); one layer keeps it fast.
K_SHAPE = dict(hidden=256, head_dim=64, expert_ffn=256, n_layers=1)


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _meta(reader: GGUFReader) -> dict:
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path):
    a, b, c = tmp_path / "a.gguf", tmp_path / "b.gguf", tmp_path / "c.gguf"
    synth_model(a, "tiny", "q4_0", seed=7)
    synth_model(b, "tiny", "q4_0", seed=7)
    synth_model(c, "tiny", "q4_0", seed=8)
    assert _sha(a) == _sha(b)
    assert _sha(a) != _sha(c)
    ra, rc = GGUFReader(a), GGUFReader(c)
    for ta, tc in zip(ra.tensors, rc.tensors):
        assert ta.name == tc.name
        if ta.name.endswith("weight") and "norm" not in ta.name:
            assert not np.array_equal(ta.data, tc.data), ta.name


def test_jobs_write_the_same_bytes(tmp_path):
    one, many = tmp_path / "one.gguf", tmp_path / "many.gguf"
    synth_model(one, "tiny", "q4_0", seed=2, routing_skew=0.5)
    synth_model(many, "tiny", "q4_0", seed=2, routing_skew=0.5, jobs=3)
    assert one.read_bytes() == many.read_bytes()


@pytest.mark.parametrize("weight_type", sorted(WEIGHT_TYPES) + sorted(MIXES))
def test_weight_type_dequantises_to_the_target_std(tmp_path, weight_type):
    path = tmp_path / "m.gguf"
    spec = synth_model(path, "tiny", weight_type, seed=3, **K_SHAPE)
    reader = GGUFReader(path)
    big_types = set()
    for t in reader.tensors:
        w = quants.dequantize(t.data, t.tensor_type).astype(np.float64)
        assert np.isfinite(w).all(), t.name
        if "norm" in t.name:
            assert t.tensor_type.name == "F32"
            assert 0.9 <= w.min() and w.max() <= 1.1, t.name
            continue
        if t.name == "token_embd.weight":
            want = 0.03
        elif t.name.endswith(("attn_output.weight", "ffn_down_exps.weight")):
            want = 1 / math.sqrt(256 * 2 * spec.n_layers)  # writes to the residual stream
        else:
            want = 1 / 16  # 1 / sqrt(fan_in 256)
        assert abs(w.std() / want - 1) < 0.08, (t.name, w.std(), want)
        assert abs(w.mean()) < 0.05 * want, (t.name, w.mean())
        if t.name.endswith("ffn_gate_inp.weight"):
            assert t.tensor_type.name == "F32"  # the router stays F32
        else:
            big_types.add(t.tensor_type.name)
    if weight_type in MIXES:  # the base type, and Q6_K for the head, attn_v and ffn_down
        assert big_types == {MIXES[weight_type].name, "Q6_K"}
    else:
        assert big_types == {weight_type.upper()}


def test_mixes_follow_llama_cpp(tmp_path):
    """q4_k_m on 16 layers: Q6_K for the head and, in layers 0, 1, 4, 7, 10, 13, 14, 15
    (llama.cpp's use_more_bits), for attn_v and ffn_down_exps; Q4_K elsewhere."""
    path = tmp_path / "m.gguf"
    synth_model(path, "tiny", "q4_k_m", **{**K_SHAPE, "n_layers": 16})
    types = {t.name: t.tensor_type.name for t in GGUFReader(path).tensors}
    more = {i for i in range(16) if types[f"blk.{i}.attn_v.weight"] == "Q6_K"}
    assert more == {0, 1, 4, 7, 10, 13, 14, 15}
    assert all(types[f"blk.{i}.ffn_down_exps.weight"] == ("Q6_K" if i in more else "Q4_K")
               for i in range(16))
    assert types["output.weight"] == "Q6_K" and types["token_embd.weight"] == "Q4_K"
    base = ("attn_q", "attn_k", "attn_output", "ffn_gate_exps", "ffn_up_exps")
    assert {types[f"blk.{i}.{n}.weight"] for i in range(16) for n in base} == {"Q4_K"}
    assert GGUFReader(path).fields["general.file_type"].parts[-1][0] == 15  # MOSTLY_Q4_K_M


@pytest.mark.parametrize("weight_type, fallback", [("q4_k_m", ("Q5_0", "Q8_0")),
                                                   ("q5_k_m", ("Q5_1", "Q8_0")),
                                                   ("q3_k", ("IQ4_NL",)), ("iq4_xs", ("IQ4_NL",))])
def test_rows_a_k_quant_cannot_hold_take_llama_cpps_fallback(tmp_path, weight_type, fallback):
    """Expert downs of 96 columns (not a multiple of 256, as Qwen1.5-MoE's 1408): Q4_K -> Q5_0,
    Q5_K -> Q5_1, Q6_K -> Q8_0, Q2_K / Q3_K / IQ4_XS -> IQ4_NL (llama_tensor_get_type); rows of
    256 keep the k-quant. Weights keep their std in the fallback type."""
    path = tmp_path / "m.gguf"
    spec = synth_model(path, "tiny-qwen2moe", weight_type,
                       **{**K_SHAPE, "expert_ffn": 96, "shared_ffn": 256, "n_layers": 8})
    tensors = {t.name: t for t in GGUFReader(path).tensors}
    downs = {tensors[f"blk.{i}.ffn_down_exps.weight"].tensor_type.name for i in range(8)}
    assert downs == set(fallback)
    base = (MIXES.get(weight_type) or WEIGHT_TYPES[weight_type]).name
    assert tensors["blk.0.ffn_gate_exps.weight"].tensor_type.name == base
    assert tensors["blk.0.ffn_down_shexp.weight"].tensor_type.name in (base, "Q6_K")
    w = quants.dequantize(tensors["blk.2.ffn_down_exps.weight"].data,
                          tensors["blk.2.ffn_down_exps.weight"].tensor_type).astype(np.float64)
    want = 1 / math.sqrt(96 * 2 * spec.n_layers)
    assert abs(w.std() / want - 1) < 0.08 and abs(w.mean()) < 0.05 * want


def test_tiny_of_both_architectures_matches_the_contract(tmp_path):
    for shape, arch_name, n_tensors in (("tiny", "qwen3moe", 27),
                                        ("tiny-qwen2moe", "qwen2moe", 37)):
        path = tmp_path / f"{shape}.gguf"
        spec = synth_model(path, shape, "f32")
        assert spec == get_preset(shape) and spec.arch == arch_name
        reader = GGUFReader(path)
        shapes = {t.name: tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors}
        assert shapes == arch.expected_tensors(spec) and len(shapes) == n_tensors
        read = arch.spec_from_metadata(_meta(reader), shapes)
        assert read == spec.with_(rms_eps=float(np.float32(1e-6)))  # GGUF stores a float32
    assert build_spec("tiny", "qwen2moe") == get_preset("tiny-qwen2moe")
    assert build_spec("tiny-qwen2moe", "qwen3moe") == get_preset("tiny")


def test_overrides_and_layer_zero_independent_of_layer_count(tmp_path):
    one, two = tmp_path / "one.gguf", tmp_path / "two.gguf"
    spec = synth_model(one, "tiny", "q8_0", n_layers=1, vocab=5000)
    synth_model(two, "tiny", "q8_0", n_layers=2, vocab=5000)
    assert (spec.n_layers, spec.vocab) == (1, 5000)
    r1, r2 = GGUFReader(one), GGUFReader(two)
    t2 = {t.name: t for t in r2.tensors}
    for t in r1.tensors:
        if t.name.endswith(("attn_output.weight", "ffn_down_exps.weight")):
            continue  # their scale depends on the layer count
        np.testing.assert_array_equal(t.data, t2[t.name].data)
    meta = _meta(r1)
    tokens = meta["tokenizer.ggml.tokens"]
    # Qwen's six FIM tokens come after the shipped tokenizer, then llama.cpp's padding
    assert len(tokens) == 5000 and tokens[4096] == "<|fim_prefix|>"
    assert tokens[4101] == "<|file_sep|>" and tokens[4102] == "[PAD4102]"
    assert tokens[-1] == "[PAD4999]"
    assert meta["tokenizer.ggml.token_type"][4095:4103] == [4] * 7 + [5]


def test_errors_say_what_to_change(tmp_path):
    out = tmp_path / "x.gguf"
    with pytest.raises(ConfigError, match="shape 'tiny' with q4_0: expert_ffn 40 is not a "
                                          "multiple of 32"):
        synth_model(out, "tiny", "q4_0", expert_ffn=40)
    with pytest.raises(ConfigError, match="expert_ffn 1416 is not a multiple of 32"):
        synth_model(out, "qwen2-moe-a2.7b-like", "q8_0", expert_ffn=1416)
    with pytest.raises(ConfigError, match="unknown weight type 'tq1_0'; choose one of f32"):
        synth_model(out, "tiny", "tq1_0")
    with pytest.raises(ConfigError, match="unknown model shape 'huge'; choose one of: tiny"):
        synth_model(out, "huge")
    with pytest.raises(ConfigError, match="cannot override n_layer; spec fields"):
        synth_model(out, "tiny", n_layer=3)
    with pytest.raises(ConfigError, match="unknown architecture 'llama'"):
        synth_model(out, "tiny", arch="llama")
    with pytest.raises(ConfigError, match="query heads are not a multiple of 3 KV heads"):
        synth_model(out, "tiny", n_kv_heads=3)
    with pytest.raises(ConfigError, match="vocab 100 is smaller than the shipped tokenizer's "
                                          "4096 tokens"):
        synth_model(out, "tiny", vocab=100)
    assert not out.exists()


def test_presets():
    assert set(PRESETS) == {"tiny", "tiny-qwen2moe", "tiny-qwen3next", "cpu-bench",
                            "qwen3-30b-a3b", "qwen3-next-80b-a3b", "olmoe-1b-7b-like",
                            "qwen2-moe-a2.7b-like"}
    big = get_preset("qwen3-30b-a3b")
    assert (big.n_layers, big.hidden, big.n_heads, big.n_kv_heads, big.head_dim, big.n_experts,
            big.n_experts_used, big.expert_ffn, big.vocab, big.rope_theta,
            big.context_length) == (48, 2048, 32, 4, 128, 128, 8, 768, 151936, 1e6, 40960)
    bench = get_preset("cpu-bench")
    assert (bench.n_layers, bench.hidden, bench.n_experts, bench.n_experts_used,
            bench.expert_ffn, bench.n_heads, bench.n_kv_heads, bench.head_dim,
            bench.vocab) == (24, 1024, 64, 8, 512, 16, 4, 64, 32000)
    q2 = get_preset("qwen2-moe-a2.7b-like")
    assert (q2.arch, q2.n_experts, q2.n_experts_used, q2.expert_ffn, q2.shared_ffn,
            q2.norm_topk) == ("qwen2moe", 60, 4, 1408, 5632, False)
    nxt = get_preset("qwen3-next-80b-a3b")  # Qwen3-Next-80B-A3B's config.json
    assert (nxt.n_layers, len(nxt.attention_layers), nxt.hidden, nxt.n_heads, nxt.n_kv_heads,
            nxt.head_dim, nxt.n_rot, nxt.n_experts, nxt.n_experts_used, nxt.expert_ffn,
            nxt.shared_ffn, nxt.ssm_groups, nxt.ssm_heads, nxt.ssm_state, nxt.ssm_v_dim,
            nxt.ssm_conv) == (48, 12, 2048, 16, 2, 256, 64, 512, 10, 512, 512, 16, 32, 128, 128, 4)
    tokenizer = Tokenizer.from_str(data_text("synth_tokenizer.json"))
    assert tokenizer.get_vocab_size() == SYNTH_TOKENIZER_VOCAB == get_preset("tiny").vocab


def test_tokenizer_meta_keys():
    meta = synth_tokenizer_meta()
    tokenizer = Tokenizer.from_str(data_text("synth_tokenizer.json"))
    assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.pre"] == "qwen2"
    tokens = meta["tokenizer.ggml.tokens"]
    assert len(tokens) == 4096
    assert all(tokenizer.token_to_id(tok) == i for i, tok in enumerate(tokens))
    assert meta["tokenizer.ggml.eos_token_id"] == tokenizer.token_to_id("<|im_end|>")
    assert meta["tokenizer.ggml.bos_token_id"] == tokenizer.token_to_id("<|endoftext|>")
    assert meta["tokenizer.ggml.padding_token_id"] == tokenizer.token_to_id("<|endoftext|>")
    control = [tokens[i] for i, t in enumerate(meta["tokenizer.ggml.token_type"]) if t == 3]
    assert control == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    # The reasoning and tool-call tags stay in decoded text (USER_DEFINED), as in Qwen's files.
    text_tags = [tokens[i] for i, t in enumerate(meta["tokenizer.ggml.token_type"]) if t == 4]
    assert text_tags == ["<think>", "</think>", "<tool_call>", "</tool_call>"]
    assert meta["tokenizer.ggml.merges"][0].count(" ") == 1
    assert meta["tokenizer.chat_template"] == data_text("chat_template.jinja")


@pytest.mark.parametrize("shape, arch_name", [("tiny-qwen3next", "qwen3moe"),
                                              ("tiny-qwen3next", "qwen2moe")])
def test_switching_away_from_qwen3next_writes_a_model_that_opens(tmp_path, shape, arch_name):
    # the recurrent layers stayed in the spec: synth wrote a file whose own loader found
    # "12 tensor(s) that qwen3moe needs are missing"
    from strata.model.gguf_file import GGUFModel

    out = tmp_path / "switched.gguf"
    spec = synth_model(out, shape, "f32", arch=arch_name)
    assert spec.recurrent_layers == () and spec.rope_dim == 0
    with GGUFModel.open(out) as model:
        assert model.spec.with_(rms_eps=spec.rms_eps) == spec  # the file keeps it as f32


def test_switching_to_qwen3next_names_the_shapes_that_have_its_sizes(tmp_path):
    with pytest.raises(ConfigError, match="shape 'tiny' has no gated delta-net sizes to switch "
                                          "to qwen3next; use --shape tiny-qwen3next"):
        synth_model(tmp_path / "x.gguf", "tiny", arch="qwen3next")
