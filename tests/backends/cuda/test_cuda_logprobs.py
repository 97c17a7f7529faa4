"""Log probabilities on the GPU: the samplers read rows the CUDA model leaves on the device,
so logprobs bring a generated token's row to the host, and an echo's prompt brings every row
of its windows. With float weights the figures equal the CPU backend's on the same file; with
an expert cache reading its misses over PCIe they equal the all-resident GPU's (the same
kernels over other addresses)."""
from __future__ import annotations

import numpy as np
import pytest

from strata import Engine, EngineConfig, SamplingParams

from cuda_synth import write_split_test_model

pytestmark = pytest.mark.cuda

PROMPT = [(i * 7) % 2000 + 10 for i in range(150)]  # two 128-row windows for the echo


def _figures(path, **options):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3,
                            prompt_logprobs=2)
    with Engine(EngineConfig(path, n_ctx=512, threads=2, **options)) as engine:
        events = list(engine.generate(PROMPT, params))
    assert len(events[0].prompt_logprobs) == len(PROMPT) - 1
    return [e.token_id for e in events], list(events[0].prompt_logprobs) + [
        e.logprob for e in events]


def _assert_close(got, want, atol):
    assert [lp.token_id for lp in got] == [lp.token_id for lp in want]
    diff = max(abs(a.logprob - b.logprob) for a, b in zip(got, want))
    print(f"max |logprob difference| over {len(got)} tokens: {diff:.2e}")
    assert diff <= atol
    for a, b in zip(got, want):
        np.testing.assert_allclose([v for _, v in a.top], [v for _, v in b.top], atol=atol)


def test_float_weights_equal_the_cpu_backend(tmp_path):
    from strata.tool.synth import synth_model

    path = tmp_path / "tiny-f32.gguf"
    synth_model(path, shape="tiny", weight_type="f32", seed=11, routing_skew=1.0, n_layers=4)
    cpu_tokens, cpu = _figures(path, device="cpu")
    gpu_tokens, gpu = _figures(path, device="cuda")
    assert gpu_tokens == cpu_tokens
    _assert_close(gpu, cpu, 2e-3)


def test_an_expert_cache_gives_the_resident_figures(tmp_path):
    path = tmp_path / "tiny-q8_0.gguf"
    write_split_test_model(path)
    tokens, resident = _figures(path, device="cuda")
    cached_tokens, cached = _figures(path, device="cuda", expert_cache=6, pcie_frac=1.0)
    assert cached_tokens == tokens
    _assert_close(cached, resident, 1e-6)
