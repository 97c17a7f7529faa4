"""The CUDA backend equals the CPU backend: logits on synth models of both architectures and
every tensor type (tolerances relative to the logit scale), files that mix k-quants with
llama.cpp's fallback types for rows that are not a multiple of 256, 64-token greedy
continuations, window-vs-solo equality and KV park/restore."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from strata.backends.cpu import CpuModel
from strata.backends.window import Window
from strata.model.gguf_file import GGUFModel

from cuda_synth import ACT256_TYPES, FALLBACK_TYPES, IQ_TYPES, TYPES, fallback_overrides

pytestmark = pytest.mark.cuda

SHAPES = ("tiny", "tiny-qwen2moe")
FLOAT_TYPES = ("f32", "f16", "bf16")
# Per logit row: max |cuda - cpu| / max |cpu logits|; both backends keep KV cells in fp16.
# Float weights: float32 sums in another order: every row within FLOAT_TOLERANCE.
# Quantised weights: both quantise activations to 8 bits per 32 values the same way, and rows
# agree to ~1e-7 until a K/V value lands on an fp16 rounding edge (or an activation on an
# 8-bit one) and rounds the other way; every later row attends to that cell, and the 8-bit
# re-quantisation downstream turns a one-ulp change into ~1e-2 of the logit scale. That is the
# size of the CPU's own change from fp32 to fp16 KV cells (~1e-2, measured on these models),
# not a kernel error: the kernels equal float64 references (test_cuda_kernels.py). So: the
# first row (no earlier cells) within FLOAT_TOLERANCE, 90% of rows within QUANT_TOLERANCE,
# and the top-1 token equal on 90% of rows.
FLOAT_TOLERANCE = 1e-4
QUANT_TOLERANCE = 3e-2
# Files with k-quant (or, since session 100, grid i-quant) tensors: the CPU quantises their
# activations per 256 columns (llama.cpp's Q8_K: fused_k.c, fused_iq.c), the GPU per 32 (as
# llama.cpp's CUDA), so even the first row differs by that rounding, amplified as above.
# Measured on these models as the CPU's own change from 32 to 256 (session 99): first row
# 1.1e-2 .. 2.3e-2, 90th percentile 1.9e-2 .. 3.6e-2, top-1 equal on 87-100% of rows. The
# kernels on each side equal their float64 references (tests/native, test_cuda_kernels.py);
# these bounds catch a wrong layer, not a rounding.
K_FIRST_TOLERANCE = 5e-2
K_TOLERANCE = 6e-2
K_TOP1 = 0.8
# The grid i-quant files (2-3 bit) turn that rounding into a jump on more rows. The CPU's own
# change from 32 to 256 on these models (session 100, the CPU machine) left 86-100% of rows
# within K_TOLERANCE (80th percentile 2.3e-2 .. 3.9e-2, 90th up to 0.13), the first row within
# 2.4e-2 and top-1 equal on 83-100%; the H100 host's CUDA logits (per 32, as the CPU's were)
# gave the same figures (tiny iq2_xs: 90th percentile 0.133; tiny-qwen2moe iq2_s 0.098). So
# they hold 80% of rows within K_TOLERANCE.
K_SHARE, IQ_SHARE = 90, 80  # percentiles of the rows
_models: dict = {}


def _pair(synth_path, shape, weight_type):
    key = (shape, weight_type)
    if key not in _models:
        from strata.backends.cuda import CudaModel

        path = synth_path(shape, weight_type)
        _models[key] = (CpuModel(GGUFModel.open(path)), CudaModel(GGUFModel.open(path)))
    return _models[key]


def _tokens(n, vocab, seed):
    return np.random.default_rng(seed).integers(0, vocab, size=n).astype(np.int32)


@pytest.mark.parametrize("weight_type", TYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_logits_match_cpu(synth_path, shape, weight_type):
    cpu, gpu = _pair(synth_path, shape, weight_type)
    _check_logits(cpu, gpu, f"{shape} {weight_type}", weight_type in FLOAT_TYPES,
                  weight_type in ACT256_TYPES, IQ_SHARE if weight_type in IQ_TYPES else K_SHARE)


@pytest.mark.parametrize("weight_type", sorted(FALLBACK_TYPES))
@pytest.mark.parametrize("shape", SHAPES)
def test_k_quant_file_with_fallback_types_matches_cpu(tmp_path_factory, shape, weight_type):
    """A k-quant file whose expert (and shared) down rows are 96 columns (not a multiple of
    256) holds them in llama.cpp's fallback types (Q5_0 / Q5_1 / Q8_0 / IQ4_NL) beside the
    k-quant rows; the CUDA logits match the CPU's as for one-type files (the 23-row prompt
    through mmq_k.cu and mmq.cu tiles side by side, decode rows through mv_*)."""
    from strata.backends.cuda import CudaModel
    from strata.tool.synth import synth_model

    path = tmp_path_factory.mktemp("fallback") / f"{shape}-{weight_type}.gguf"
    synth_model(path, shape=shape, weight_type=weight_type, **fallback_overrides(shape))
    model = GGUFModel.open(path)
    short = {model.tensor(n).qtype for n in model.tensor_names
             if model.tensor(n).shape[-1] == 96}  # the down rows
    main, *others = FALLBACK_TYPES[weight_type]
    assert int(QT[main]) in short and short <= {int(QT[t]) for t in (main, *others)}
    cpu, gpu = CpuModel(GGUFModel.open(path)), CudaModel(GGUFModel.open(path))
    _check_logits(cpu, gpu, f"{shape} {weight_type} (96-column rows)", False, True)


def _check_logits(cpu, gpu, label: str, is_float: bool, has_k: bool = False,
                  k_share: int = K_SHARE) -> None:
    vocab = cpu.spec.vocab
    kc, kg = cpu.new_kv(128, dtype=np.float16), gpu.new_kv(128)
    prompt = _tokens(23, vocab, seed=1)
    steps = [(prompt, True)] + [(_tokens(1, vocab, seed=10 + i), False) for i in range(4)]
    steps.append((_tokens(9, vocab, seed=3), True))  # a second chunk after decoding
    errors, same_top1 = [], []
    for tokens, all_logits in steps:
        want = cpu.forward(tokens, kc, all_logits=all_logits)
        got = gpu.forward(tokens, kg, all_logits=all_logits)
        assert got.shape == want.shape and got.dtype == np.float32
        assert np.isfinite(got).all()
        errors += list(np.abs(got - want).max(axis=1) / np.abs(want).max())
        same_top1 += list(np.argmax(got, axis=1) == np.argmax(want, axis=1))
    errors = np.array(errors)
    print(f"{label}: |cuda - cpu| / logit scale per row: median "
          f"{np.median(errors):.1e}, max {errors.max():.1e}; top-1 equal on "
          f"{np.mean(same_top1):.0%} of {len(errors)} rows")
    if is_float:
        assert errors.max() < FLOAT_TOLERANCE
        assert all(same_top1)
    elif has_k:
        assert errors[0] < K_FIRST_TOLERANCE
        assert np.percentile(errors, k_share) < K_TOLERANCE
        assert np.mean(same_top1) >= K_TOP1
    else:
        assert errors[0] < FLOAT_TOLERANCE
        assert np.percentile(errors, 90) < QUANT_TOLERANCE
        assert np.mean(same_top1) >= 0.9
    assert kg.num_tokens == kc.num_tokens == 23 + 4 + 9


def _greedy(model, kv, prompt, num_tokens, forced=None):
    """Greedy tokens after `prompt`; with `forced`, the argmax at each step while feeding
    `forced` (teacher forcing: both backends see the same sequence)."""
    logits = model.forward(prompt, kv)
    out = []
    for i in range(num_tokens):
        out.append(int(np.argmax(logits[-1])))
        nxt = out[-1] if forced is None else forced[i]
        logits = model.forward(np.array([nxt], dtype=np.int32), kv)
    return out


TEACHER_FORCED = ("q3_k", "q4_k", "q6_k", "q4_1", "q5_0", "q5_1", "iq4_nl")
# the k-quants' activations rounded per 256 columns on the CPU, per 32 on the GPU: the CPU's
# own change from 32 to 256, teacher-forced the same way, kept 54-62 of the 64 argmaxes on
# these models (session 99)
K_FORCED_AGREE = 48


@pytest.mark.parametrize("weight_type", ("f32", "bf16", "q8_0", "q4_0") + TEACHER_FORCED)
@pytest.mark.parametrize("shape", SHAPES)
def test_greedy_64_tokens_agree(synth_path, shape, weight_type):
    """64 greedy tokens are the same on both backends; for k-quant models and the other
    32-column types (where a rounding edge can flip a near-tie, see above) the CUDA argmax, fed
    the CPU's tokens, equals the CPU's on at least 60 of the 64 steps (K_FORCED_AGREE for the
    k-quants, whose activations the two backends round per 256 / per 32 columns)."""
    cpu, gpu = _pair(synth_path, shape, weight_type)
    prompt = _tokens(12, cpu.spec.vocab, seed=5)
    want = _greedy(cpu, cpu.new_kv(128, dtype=np.float16), prompt, 64)
    if weight_type in TEACHER_FORCED:
        got = _greedy(gpu, gpu.new_kv(128), prompt, 64, forced=want)
        agree = sum(a == b for a, b in zip(got, want))
        print(f"{shape} {weight_type}: teacher-forced argmax equal on {agree} of 64 steps")
        assert agree >= (K_FORCED_AGREE if weight_type in ACT256_TYPES else 60)
    else:
        got = _greedy(gpu, gpu.new_kv(128), prompt, 64)
        assert got == want


@pytest.mark.parametrize("weight_type", ("f32", "q4_0", "q5_1"))
@pytest.mark.parametrize("shape", SHAPES)
def test_window_rows_equal_solo(synth_path, shape, weight_type):
    """Each slot's logits in a window of three slots (a prompt chunk and two decodes) equal
    what the slot gets alone, bit for bit."""
    _, gpu = _pair(synth_path, shape, weight_type)
    vocab = gpu.spec.vocab
    prompts = [_tokens(n, vocab, seed=20 + n) for n in (5, 9, 14)]
    nexts = [_tokens(n, vocab, seed=40 + n) for n in (6, 1, 1)]
    solo = []
    for p, nx in zip(prompts, nexts):
        kv = gpu.new_kv(64)
        gpu.forward(p, kv)
        solo.append(gpu.forward(nx, kv, all_logits=True))
    kvs = [gpu.new_kv(64) for _ in prompts]
    for p, kv in zip(prompts, kvs):
        gpu.forward(p, kv)
    window = Window.build(list(zip(kvs, nexts)), logits="all")
    logits = gpu.forward_window(window)
    for i in range(3):
        np.testing.assert_array_equal(window.logits_of(logits, i), solo[i])
    greedy = gpu.forward_window_greedy(Window.build([(kv, [7]) for kv in kvs], logits="last"))
    assert greedy.shape == (3,) and greedy.dtype == np.int32


def test_kv_park_and_restore(synth_path):
    """Host copies of the KV (parking) restored into a fresh KV continue the sequence exactly."""
    _, gpu = _pair(synth_path, "tiny", "q4_0")
    vocab, L = gpu.spec.vocab, gpu.spec.n_layers
    prompt, nxt = _tokens(17, vocab, seed=7), _tokens(3, vocab, seed=8)
    kv = gpu.new_kv(64)
    gpu.forward(prompt, kv)
    k = np.stack([kv.keys(layer) for layer in range(L)])  # [L, KV, n, D]
    v = np.stack([kv.values(layer) for layer in range(L)])
    assert k.shape == (L, gpu.spec.n_kv_heads, 17, gpu.spec.head_dim) and k.dtype == np.float16
    assert np.abs(k).max() > 0 and np.abs(v).max() > 0
    want = gpu.forward(nxt, kv, all_logits=True)
    restored = gpu.new_kv(64)
    for layer in range(L):
        restored.append(layer, k[layer], v[layer])
    restored.commit(17)
    np.testing.assert_array_equal(restored.keys(1), k[1])
    got = gpu.forward(nxt, restored, all_logits=True)
    np.testing.assert_array_equal(got, want)
    restored.truncate(5)
    assert restored.num_tokens == 5
    restored.clear()
    assert restored.num_tokens == 0


def test_graph_replay_equals_launch_list(synth_path):
    _, gpu = _pair(synth_path, "tiny-qwen2moe", "q8_0")
    prompt = _tokens(8, gpu.spec.vocab, seed=11)
    outs = []
    for use_graphs in (True, False):
        gpu.use_graphs = use_graphs
        kv = gpu.new_kv(32)
        gpu.forward(prompt, kv)
        outs.append([gpu.forward(_tokens(1, gpu.spec.vocab, seed=s), kv) for s in range(3)])
    gpu.use_graphs = True
    for a, b in zip(*outs):
        np.testing.assert_array_equal(a, b)
    print("launches per decode token:", gpu.launches_per_window(1, 1))


@pytest.mark.parametrize("shape,weight_type", [("tiny", "q4_0"), ("tiny-qwen2moe", "q4_k"),
                                               ("tiny", "f16")])
def test_programmatic_launch_gives_the_plain_launch_bits(synth_path, monkeypatch, shape,
                                                         weight_type):
    """Decode windows launched programmatically (cc >= 9.0 by default: the q/k/v product and
    the router read their weights before the wait) give the logits of plain launches, bit for
    bit, over a prompt and eight one-token windows."""
    from strata.backends.cuda import CudaModel

    _, gpu = _pair(synth_path, shape, weight_type)
    if not gpu.runtime.programmatic:
        pytest.skip("no programmatic dependent launch here (needs cc >= 9.0 and its driver call)")
    monkeypatch.setenv("STRATA_PDL", "0")
    plain = CudaModel(GGUFModel.open(synth_path(shape, weight_type)))
    assert not plain.runtime.programmatic
    prompt = _tokens(12, gpu.spec.vocab, seed=3)
    outs = []
    for model in (gpu, plain):
        kv = model.new_kv(32)
        model.forward(prompt, kv)
        outs.append([model.forward(_tokens(1, model.spec.vocab, seed=s), kv) for s in range(8)])
    for a, b in zip(*outs):
        np.testing.assert_array_equal(a, b)
