"""CpuModel against a float64 reference pass, chunking, KV reuse and the errors it raises."""
import numpy as np
import pytest
from cpu_reference import reference_logits
from synth_models import synth_cpu_models

from strata._native import kernels
from strata.backends.cpu import CpuModel
from strata.errors import ConfigError, RequestError

PROMPT = np.array([17, 4000, 3, 250, 251, 9, 1024, 77, 5, 3000, 42], dtype=np.int32)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> CpuModel over tiny synth models, built once for the module."""
    root = tmp_path_factory.mktemp("cpu")
    variants = {
        "qwen3moe-f32": dict(shape="tiny", weight_type="f32", seed=1),
        "qwen2moe-f32": dict(shape="tiny-qwen2moe", weight_type="f32", seed=2),
        "qwen3moe-f16": dict(shape="tiny", weight_type="f16", seed=3),
        "qwen2moe-f16": dict(shape="tiny-qwen2moe", weight_type="f16", seed=4),
        "qwen3moe-tied": dict(shape="tiny", weight_type="f32", seed=5, tied_output=True),
        "qwen3moe-q8_0": dict(shape="tiny", weight_type="q8_0", seed=6),
        "qwen2moe-q4_0": dict(shape="tiny-qwen2moe", weight_type="q4_0", seed=7),
        "qwen3moe-bf16": dict(shape="tiny", weight_type="bf16", seed=8),
    }
    # k-quants store rows in blocks of 256 values: widen tiny so every row is a multiple
    # (seed 23 would give Q2_K a router near-tie in row 3, below: three rows flip experts)
    for kind, seed in (("q4_k", 20), ("q5_k", 21), ("q6_k", 22), ("q2_k", 25), ("q3_k", 24),
                       ("iq4_xs", 26), ("iq2_xs", 27), ("iq2_s", 28), ("iq3_xxs", 29),
                       ("iq1_s", 30)):
        variants[f"qwen3moe-{kind}"] = dict(shape="tiny", weight_type=kind, seed=seed,
                                            hidden=256, expert_ffn=256, head_dim=64)
    return synth_cpu_models(root, variants)


def _scale(ref: np.ndarray) -> float:
    return float(np.max(np.abs(ref)))


@pytest.mark.parametrize("name", ["qwen3moe-f32", "qwen2moe-f32", "qwen3moe-f16",
                                  "qwen2moe-f16", "qwen3moe-bf16", "qwen3moe-tied"])
def test_float_weights_match_the_float64_reference(models, name):
    model = models[name]
    logits = model.forward(PROMPT, model.new_kv(32), all_logits=True)
    ref = reference_logits(model.gguf, PROMPT)
    assert logits.shape == (len(PROMPT), model.spec.vocab) and logits.dtype == np.float32
    # float32 products over rows of <= 64 values and float32 softmax/norms: each step adds
    # ~1e-7 relative error; through 2 layers the logits stay within 1e-5 of their scale.
    # 1e-4 leaves room and still catches any real mistake (a wrong head, sign or position
    # moves logits by O(1e-1) of their scale).
    np.testing.assert_allclose(logits, ref, rtol=0, atol=1e-4 * _scale(ref))


@pytest.mark.parametrize("name", ["qwen3moe-q8_0", "qwen2moe-q4_0", "qwen3moe-q4_k",
                                  "qwen3moe-q5_k", "qwen3moe-q6_k", "qwen3moe-q2_k",
                                  "qwen3moe-q3_k", "qwen3moe-iq4_xs", "qwen3moe-iq2_xs",
                                  "qwen3moe-iq2_s", "qwen3moe-iq3_xxs", "qwen3moe-iq1_s"])
def test_quantised_weights_stay_close_to_the_reference(models, name):
    model = models[name]
    logits = model.forward(PROMPT, model.new_kv(32), all_logits=True)
    ref = reference_logits(model.gguf, PROMPT)
    # The kernels quantise activations to 8 bits per block of 32 (error up to 1/254 of the
    # block's largest value per product): a few percent of the logit scale after two layers.
    # A router near-tie (top-k probabilities within ~1e-3) can flip under that error and route
    # a row to another expert, changing it wholesale (llama.cpp behaves the same); rows that
    # attend to it move a little too. So most rows, not all, must be within the tolerance.
    row_err = np.max(np.abs(logits - ref), axis=-1) / _scale(ref)
    assert np.mean(row_err <= 5e-2) >= 0.85, np.round(row_err, 3)
    agree = np.mean(np.argmax(logits, -1) == np.argmax(ref, -1))
    assert agree >= 0.8


@pytest.mark.parametrize("name", ["qwen3moe-f32", "qwen2moe-f32", "qwen3moe-q8_0"])
def test_chunks_equal_one_pass(models, name):
    model = models[name]
    whole = model.forward(PROMPT, model.new_kv(32), all_logits=True)
    kv = model.new_kv(32)
    parts = [model.forward(PROMPT[a:b], kv, all_logits=True)
             for a, b in ((0, 4), (4, 5), (5, 11))]
    assert kv.num_tokens == len(PROMPT)
    chunked = np.concatenate(parts)
    np.testing.assert_allclose(chunked, whole, rtol=0, atol=1e-5 * _scale(whole))


@pytest.mark.parametrize("name", ["qwen2moe-f32", "qwen3moe-q8_0"])
def test_threads_agree(models, name):
    model = models[name]
    single = model.forward(PROMPT, model.new_kv(32), all_logits=True)
    kernels.set_num_threads(2)
    try:
        threaded = model.forward(PROMPT, model.new_kv(32), all_logits=True)
    finally:
        kernels.set_num_threads(1)
    np.testing.assert_allclose(threaded, single, rtol=0, atol=1e-5 * _scale(single))


def test_float16_kv_cells(models):
    model = models["qwen3moe-f32"]
    ref = model.forward(PROMPT, model.new_kv(32), all_logits=True)
    kv = model.new_kv(32, dtype=np.float16)
    logits = np.concatenate([model.forward(PROMPT[:5], kv, all_logits=True),
                             model.forward(PROMPT[5:], kv, all_logits=True)])
    assert kv.keys(0).dtype == np.float16
    # K/V rounded to 11-bit mantissas (relative error 2^-11) move the logits by ~1e-3 of scale
    np.testing.assert_allclose(logits, ref, rtol=0, atol=5e-3 * _scale(ref))
    assert not np.allclose(logits, ref, rtol=0, atol=1e-7 * _scale(ref))


def test_long_context_across_key_tiles(models):
    # 150 tokens span three of attention's 64-key tiles; decoding past them one row at a time,
    # in odd chunks, and all at once gives the same logits
    model = models["qwen2moe-f32"]
    tokens = np.random.default_rng(3).integers(0, 4096, size=150).astype(np.int32)
    whole = model.forward(tokens, model.new_kv(160), all_logits=True)
    kv = model.new_kv(160)
    parts = [model.forward(tokens[:63], kv, all_logits=True),
             model.forward(tokens[63:130], kv, all_logits=True)]
    parts += [model.forward(tokens[t:t + 1], kv) for t in range(130, 150)]
    np.testing.assert_allclose(np.concatenate(parts), whole, rtol=0,
                               atol=1e-5 * _scale(whole))
    ref = reference_logits(model.gguf, tokens[:70])
    np.testing.assert_allclose(whole[:70], ref, rtol=0, atol=1e-4 * _scale(ref))


def test_last_row_only(models):
    model = models["qwen2moe-f32"]
    every = model.forward(PROMPT, model.new_kv(32), all_logits=True)
    last = model.forward(PROMPT, model.new_kv(32))
    assert last.shape == (1, model.spec.vocab)
    np.testing.assert_allclose(last[0], every[-1], rtol=0, atol=1e-6 * _scale(every))


def test_truncate_reuses_a_shared_prefix(models):
    model = models["qwen3moe-f32"]
    other = np.array([900, 901, 902], dtype=np.int32)
    kv = model.new_kv(32)
    model.forward(PROMPT, kv)
    kv.truncate(6)
    reused = model.forward(other, kv, all_logits=True)
    fresh = model.forward(np.concatenate([PROMPT[:6], other]), model.new_kv(32), all_logits=True)
    np.testing.assert_allclose(reused, fresh[6:], rtol=0, atol=1e-5 * _scale(fresh))


def test_decode_one_token_at_a_time(models):
    model = models["qwen2moe-f16"]
    whole = model.forward(PROMPT, model.new_kv(32), all_logits=True)
    kv = model.new_kv(32)
    rows = [model.forward(PROMPT[t:t + 1], kv)[0] for t in range(len(PROMPT))]
    np.testing.assert_allclose(np.stack(rows), whole, rtol=0, atol=1e-5 * _scale(whole))


def test_full_kv_raises_and_keeps_the_cache(models):
    model = models["qwen3moe-f32"]
    kv = model.new_kv(12)
    model.forward(PROMPT[:10], kv)
    with pytest.raises(RequestError, match="holds 10 of 12 tokens and cannot take 3 more"):
        model.forward(PROMPT[:3], kv)
    assert kv.num_tokens == 10
    model.forward(PROMPT[:2], kv)
    assert kv.num_tokens == 12


@pytest.mark.parametrize("tokens, message", [
    (np.array([1, 4096], dtype=np.int32), "token id 4096 is outside the vocabulary"),
    (np.array([-1], dtype=np.int32), "token id -1 is outside the vocabulary"),
    (np.array([], dtype=np.int32), "non-empty 1-D array"),
    (np.array([[1, 2]], dtype=np.int32), "non-empty 1-D array"),
    (np.array([1.0, 2.0]), "integer token ids"),
])
def test_bad_tokens(models, tokens, message):
    model = models["qwen3moe-f32"]
    kv = model.new_kv(8)
    with pytest.raises(RequestError, match=message):
        model.forward(tokens, kv)
    assert kv.num_tokens == 0


def test_config_errors(models):
    model = models["qwen3moe-f32"]
    with pytest.raises(ConfigError, match="exceeds the model's 4096"):
        model.new_kv(5000)
    with pytest.raises(ConfigError, match="num_threads = 0 must be positive"):
        CpuModel(model.gguf, num_threads=0)
    # OpenMP segfaulted starting 100,000 threads; 2**31 was an OverflowError traceback
    for num_threads in (100_000, 2**31):
        with pytest.raises(ConfigError, match=f"num_threads = {num_threads} is more than the "
                                              f"{kernels.MAX_THREADS} threads"):
            CpuModel(model.gguf, num_threads=num_threads)
