"""Strata's CPU forward pass of qwen3next against transformers' Qwen3NextForCausalLM.

transformers cannot read a qwen3next GGUF, so the torch model is built from the file's tensors
by undoing what llama.cpp's converter did (its Qwen3NextModel.modify_tensors): zero-centred
RMSNorm weights had 1 added (all but the delta net's gated norm), A_log became -exp(A_log),
in_proj_qkvz was split into attn_qkv (q, k, v contiguous) and attn_gate (z), and the conv
weight lost its middle axis. The mapping here is written from the converter's description,
independently of Strata's loader."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.qwen3_next")

from strata.backends.cpu import CpuModel  # noqa: E402
from strata.model.gguf_file import GGUFModel  # noqa: E402
from strata.tool.synth import synth_model  # noqa: E402

pytestmark = pytest.mark.parity

FLOAT_ATOL = 1e-4  # of the logit scale, as in test_parity_transformers.py
VARIANTS = {"f32": 31, "f16": 32}


def _config(spec):
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(
        vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.expert_ffn,
        num_hidden_layers=spec.n_layers, num_attention_heads=spec.n_heads,
        num_key_value_heads=spec.n_kv_heads, head_dim=spec.head_dim,
        max_position_embeddings=spec.context_length, rms_norm_eps=spec.rms_eps,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta,
                         "partial_rotary_factor": spec.n_rot / spec.head_dim},
        linear_conv_kernel_dim=spec.ssm_conv, linear_key_head_dim=spec.ssm_state,
        linear_value_head_dim=spec.ssm_v_dim, linear_num_key_heads=spec.ssm_groups,
        linear_num_value_heads=spec.ssm_heads, moe_intermediate_size=spec.expert_ffn,
        shared_expert_intermediate_size=spec.shared_ffn,
        num_experts_per_tok=spec.n_experts_used, num_experts=spec.n_experts,
        norm_topk_prob=spec.norm_topk, tie_word_embeddings=False,
        layer_types=["linear_attention" if spec.is_recurrent(i) else "full_attention"
                     for i in range(spec.n_layers)])


def _state_dict(path, spec) -> dict:
    """The HF parameters from the GGUF's tensors (dequantised to float32)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(path)
    t = {r.name: np.array(dequantize(r.data, r.tensor_type), dtype=np.float32).reshape(
        [int(n) for n in reversed(r.shape)]) for r in reader.tensors}
    dk, dv, r = spec.ssm_state, spec.ssm_v_dim, spec.ssm_heads // spec.ssm_groups
    out = {"model.embed_tokens.weight": t["token_embd.weight"],
           "lm_head.weight": t["output.weight"],
           "model.norm.weight": t["output_norm.weight"] - 1}
    for i in range(spec.n_layers):
        g, p = f"blk.{i}.", f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = t[g + "attn_norm.weight"] - 1
        out[p + "post_attention_layernorm.weight"] = t[g + "post_attention_norm.weight"] - 1
        if spec.is_recurrent(i):
            qkv, z = t[g + "attn_qkv.weight"], t[g + "attn_gate.weight"]
            key_dim = spec.ssm_groups * dk
            q, k, v = qkv[:key_dim], qkv[key_dim:2 * key_dim], qkv[2 * key_dim:]
            groups = [np.concatenate([q[j * dk:(j + 1) * dk], k[j * dk:(j + 1) * dk],
                                      v[j * r * dv:(j + 1) * r * dv],
                                      z[j * r * dv:(j + 1) * r * dv]])
                      for j in range(spec.ssm_groups)]
            la = p + "linear_attn."
            out[la + "in_proj_qkvz.weight"] = np.concatenate(groups)
            out[la + "in_proj_ba.weight"] = t[g + "ssm_ba.weight"]
            out[la + "conv1d.weight"] = t[g + "ssm_conv1d.weight"][:, None, :]
            out[la + "dt_bias"] = t[g + "ssm_dt.bias"]
            out[la + "A_log"] = np.log(-t[g + "ssm_a"])
            out[la + "norm.weight"] = t[g + "ssm_norm.weight"]
            out[la + "out_proj.weight"] = t[g + "ssm_out.weight"]
        else:
            sa = p + "self_attn."
            for ours, theirs in (("attn_q", "q_proj"), ("attn_k", "k_proj"),
                                 ("attn_v", "v_proj"), ("attn_output", "o_proj")):
                out[sa + theirs + ".weight"] = t[g + ours + ".weight"]
            out[sa + "q_norm.weight"] = t[g + "attn_q_norm.weight"] - 1
            out[sa + "k_norm.weight"] = t[g + "attn_k_norm.weight"] - 1
        m = p + "mlp."
        out[m + "gate.weight"] = t[g + "ffn_gate_inp.weight"]
        out[m + "experts.gate_up_proj"] = np.concatenate(
            [t[g + "ffn_gate_exps.weight"], t[g + "ffn_up_exps.weight"]], axis=1)
        out[m + "experts.down_proj"] = t[g + "ffn_down_exps.weight"]
        for part in ("gate", "up", "down"):
            out[m + f"shared_expert.{part}_proj.weight"] = t[g + f"ffn_{part}_shexp.weight"]
        out[m + "shared_expert_gate.weight"] = t[g + "ffn_gate_inp_shexp.weight"].reshape(1, -1)
    return {name: torch.from_numpy(np.ascontiguousarray(a)) for name, a in out.items()}


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    from transformers import Qwen3NextForCausalLM

    root = tmp_path_factory.mktemp("parity_qwen3next")
    out = {}
    for kind, seed in VARIANTS.items():
        path = root / f"{kind}.gguf"
        spec = synth_model(path, shape="tiny-qwen3next", weight_type=kind, seed=seed)
        theirs = Qwen3NextForCausalLM(_config(spec)).float().eval()
        missing, unexpected = theirs.load_state_dict(_state_dict(path, spec), strict=False)
        assert not unexpected and not [m for m in missing if "rotary" not in m], \
            (missing, unexpected)
        out[kind] = (CpuModel(GGUFModel.open(path)), theirs)
    return out


def _prompt(length: int, vocab: int) -> np.ndarray:
    return np.random.default_rng(100 + length).integers(0, vocab, length).astype(np.int32)


def _torch_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        ids = torch.from_numpy(tokens.astype(np.int64))[None]
        return model(ids, use_cache=False).logits[0].float().numpy()  # [T, V]


def _close(logits, ref):
    scale = float(np.max(np.abs(ref)))
    np.testing.assert_allclose(logits, ref, rtol=0, atol=FLOAT_ATOL * scale)


@pytest.mark.parametrize("kind", VARIANTS)
@pytest.mark.parametrize("length", (1, 5, 31, 70))
def test_logits_equal_transformers(pairs, kind, length):
    ours, theirs = pairs[kind]
    tokens = _prompt(length, ours.spec.vocab)
    _close(ours.forward(tokens, ours.new_kv(80), all_logits=True), _torch_logits(theirs, tokens))


@pytest.mark.parametrize("kind", VARIANTS)
def test_chunks_and_decode_carry_the_state(pairs, kind):
    """Chunks of 9, 1 and 20 tokens, then 10 single tokens: the recurrent state and the conv's
    last inputs cross every boundary."""
    ours, theirs = pairs[kind]
    tokens = _prompt(40, ours.spec.vocab)
    kv = ours.new_kv(64)
    bounds = [0, 9, 10, 30, *range(31, 41)]
    logits = np.concatenate([ours.forward(tokens[a:b], kv, all_logits=True)
                             for a, b in zip(bounds, bounds[1:])])
    _close(logits, _torch_logits(theirs, tokens))


def test_greedy_continuation_equals_transformers(pairs):
    ours, theirs = pairs["f32"]
    prompt = _prompt(9, ours.spec.vocab)
    kv = ours.new_kv(40)
    logits, got = ours.forward(prompt, kv), []
    for _ in range(16):
        got.append(int(np.argmax(logits[-1])))
        logits = ours.forward(np.array([got[-1]], dtype=np.int32), kv)
    tokens = list(prompt)
    for _ in range(16):
        tokens.append(int(np.argmax(_torch_logits(theirs, np.array(tokens))[-1])))
    assert got == tokens[len(prompt):]
