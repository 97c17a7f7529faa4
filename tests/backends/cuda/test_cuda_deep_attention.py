"""Rows deep in their context on the CUDA backend: from plan.ATT_DEEP_FROM cells a row's
attention takes attention_group.cu (a block per GQA group), below it attention.cu (a block per
head). STRATA_ATT_DEEP_FROM moves the threshold down to DEEP_FROM here, so small synth models
cross it: logits match the CPU backend, greedy tokens equal, window rows equal solo bit for bit
with rows and chunks on both sides of the threshold, and only windows with a deep row take the
plans with the group launches."""
import numpy as np
import pytest

from strata.backends.cpu import CpuModel
from strata.backends.window import Window
from strata.model.gguf_file import GGUFModel

from test_cuda_parity import _check_logits, _greedy, _tokens

pytestmark = pytest.mark.cuda

DEEP_FROM = 16
_models: dict = {}


@pytest.fixture
def deep_pair(synth_path, monkeypatch):
    """deep_pair(shape, weight_type) -> (CPU model, CUDA model with DEEP_FROM)."""
    from strata.backends.cuda import CudaModel

    def make(shape, weight_type):
        key = (shape, weight_type)
        if key not in _models:
            monkeypatch.setenv("STRATA_ATT_DEEP_FROM", str(DEEP_FROM))
            path = synth_path(shape, weight_type)
            gpu = CudaModel(GGUFModel.open(path))
            assert gpu.attention_deep_from == DEEP_FROM
            _models[key] = (CpuModel(GGUFModel.open(path)), gpu)
        return _models[key]

    return make


@pytest.mark.parametrize("shape, weight_type", [("tiny", "f32"), ("tiny", "q4_0"),
                                                ("tiny-qwen2moe", "f32"),
                                                ("tiny-qwen2moe", "q8_0")])
def test_logits_match_cpu(deep_pair, shape, weight_type):
    """A 23-row prompt (prompt kernels), four decode rows and a 9-row chunk (decode kernels: its
    rows past DEEP_FROM through the group kernel), as test_cuda_parity.py checks them."""
    cpu, gpu = deep_pair(shape, weight_type)
    _check_logits(cpu, gpu, f"{shape} {weight_type} deep from {DEEP_FROM}",
                  weight_type == "f32")


@pytest.mark.parametrize("shape, weight_type", [("tiny", "q4_0"), ("tiny-qwen2moe", "f32"),
                                                ("tiny-qwen3next", "f32")])
def test_greedy_tokens_agree(deep_pair, shape, weight_type):
    """48 greedy tokens after a 12-token prompt (36 of them past DEEP_FROM) equal the CPU's."""
    cpu, gpu = deep_pair(shape, weight_type)
    prompt = _tokens(12, cpu.spec.vocab, seed=9)
    want = _greedy(cpu, cpu.new_kv(96, dtype=np.float16), prompt, 48)
    assert _greedy(gpu, gpu.new_kv(96), prompt, 48) == want


def _prefilled(gpu, lengths, seed):
    """A KV per length, filled with that many tokens."""
    kvs = []
    for n in lengths:
        kvs.append(gpu.new_kv(96))
        gpu.forward(_tokens(n, gpu.spec.vocab, seed=seed + n), kvs[-1])
    return kvs


@pytest.mark.parametrize("shape", ("tiny", "tiny-qwen3next"))
def test_window_rows_equal_solo_across_the_threshold(deep_pair, shape):
    """A decode-sized window of a 6-row chunk crossing DEEP_FROM, a shallow decode row and a
    deep one: each slot's logits equal what it gets alone, bit for bit. A prompt-sized window
    (a 24-row chunk beside a shallow and a deep decode row; its products are the tiled family,
    so its rows are compared with the same slots in another order): the same bits."""
    _, gpu = deep_pair(shape, "q4_0")
    vocab = gpu.spec.vocab
    first, nexts = (12, 14, 30), (6, 1, 1)
    steps = [_tokens(n, vocab, seed=80 + n) for n in nexts]
    solo = [gpu.forward(nx, kv, all_logits=True)
            for kv, nx in zip(_prefilled(gpu, first, 60), steps)]
    window = Window.build(list(zip(_prefilled(gpu, first, 60), steps)), logits="all")
    assert gpu.deep_level(window)
    logits = gpu.forward_window(window)
    for i in range(len(steps)):
        np.testing.assert_array_equal(window.logits_of(logits, i), solo[i], err_msg=f"slot {i}")
    first, nexts = (4, 3, 40), (24, 1, 1)
    steps = [_tokens(n, vocab, seed=90 + n) for n in nexts]
    got = []
    for order in ((0, 1, 2), (2, 1, 0)):
        kvs = _prefilled(gpu, first, 70)
        window = Window.build([(kvs[i], steps[i]) for i in order], logits="all")
        assert window.num_rows >= 20 and gpu.deep_level(window)
        logits = gpu.forward_window(window)
        got.append({i: window.logits_of(logits, at) for at, i in enumerate(order)})
    for i in range(len(steps)):
        np.testing.assert_array_equal(got[0][i], got[1][i], err_msg=f"slot {i}")


def test_only_deep_windows_take_the_group_plans(deep_pair, synth_path, monkeypatch):
    """A window takes a plan with attention_group.cu's launches (two more per attention layer)
    only when one of its rows sits at DEEP_FROM or past it, and one without attention_d*'s
    launches when every row of a decode window does; with the threshold off, never."""
    from strata.backends.cuda import CudaModel
    from strata.backends.cuda.plan import DEEP_ALL, DEEP_NONE, DEEP_SOME, MMQ_MIN_ROWS

    _, gpu = deep_pair("tiny", "q4_0")
    layers = len(gpu.spec.attention_layers)
    plain = gpu.launches_per_window(1, 1)
    assert gpu.launches_per_window(1, 1, deep=DEEP_SOME) == plain + 2 * layers  # group, merge
    assert gpu.launches_per_window(1, 1, deep=DEEP_ALL) == plain + layers  # for attention_d*
    rows = MMQ_MIN_ROWS  # a prompt window keeps attention_prompt and singles beside the group
    assert (gpu.launches_per_window(rows, 1, deep=DEEP_ALL)
            == gpu.launches_per_window(rows, 1, deep=DEEP_SOME)
            == gpu.launches_per_window(rows, 1) + 2 * layers)
    kvs = [gpu.new_kv(64) for _ in range(2)]
    gpu.forward(_tokens(DEEP_FROM - 1, gpu.spec.vocab, seed=1), kvs[0])
    gpu.forward(_tokens(3, gpu.spec.vocab, seed=2), kvs[1])
    shallow = Window.build([(kv, [5]) for kv in kvs])  # rows at DEEP_FROM - 1 and 3
    assert gpu.deep_level(shallow) == DEEP_NONE
    gpu.forward_window(shallow)
    deep = Window.build([(kv, [6]) for kv in kvs])  # rows at DEEP_FROM and 4
    assert gpu.deep_level(deep) == DEEP_SOME
    assert gpu.deep_level(Window.build([(kvs[0], [7])])) == DEEP_ALL  # DEEP_FROM alone
    monkeypatch.setenv("STRATA_ATT_DEEP_FROM", "off")
    off = CudaModel(GGUFModel.open(synth_path("tiny", "q4_0")))
    assert off.attention_deep_from is None and off.deep_level(deep) == DEEP_NONE
    assert off.launches_per_window(1, 1, deep=DEEP_SOME) == plain
    assert off.launches_per_window(1, 1, deep=DEEP_ALL) == plain
