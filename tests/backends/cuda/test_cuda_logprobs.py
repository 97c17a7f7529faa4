"""Log probabilities on the GPU: the samplers read rows the CUDA model leaves on the device,
so logprobs bring a generated token's row to the host, and an echo's prompt brings every row
of its windows. The figures equal the CPU backend's on the same file, all experts in VRAM and
with an expert cache reading its misses over PCIe."""
from __future__ import annotations

import numpy as np
import pytest

from strata import Engine, EngineConfig, SamplingParams

from cuda_synth import write_split_test_model

pytestmark = pytest.mark.cuda

PROMPT = [(i * 7) % 2000 + 10 for i in range(150)]  # two 128-row windows for the echo


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    out = tmp_path_factory.mktemp("logprobs") / "tiny-q8_0.gguf"
    write_split_test_model(out)
    return out


def _figures(path, **options):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3,
                            prompt_logprobs=2)
    with Engine(EngineConfig(path, n_ctx=512, threads=2, **options)) as engine:
        events = list(engine.generate(PROMPT, params))
    return [e.token_id for e in events], events[0].prompt_logprobs, [e.logprob for e in events]


@pytest.fixture(scope="module")
def cpu(path):
    return _figures(path, device="cpu")


def _assert_close(got, want, atol):
    assert [lp.token_id for lp in got] == [lp.token_id for lp in want]
    print(f"max |logprob difference| over {len(got)} tokens:",
          max(abs(a.logprob - b.logprob) for a, b in zip(got, want)))
    np.testing.assert_allclose([lp.logprob for lp in got], [lp.logprob for lp in want],
                               atol=atol)
    # the alternatives: the same figures (near-ties may swap places between backends)
    for a, b in zip(got, want):
        np.testing.assert_allclose(sorted(v for _, v in a.top), sorted(v for _, v in b.top),
                                   atol=atol)


@pytest.mark.parametrize("options", [dict(), dict(expert_cache=6, pcie_frac=1.0)],
                         ids=["resident", "cache-pcie"])
def test_gpu_figures_equal_the_cpu_backend(path, cpu, options):
    tokens, prompt, generated = _figures(path, device="cuda", **options)
    cpu_tokens, cpu_prompt, cpu_generated = cpu
    assert len(prompt) == len(PROMPT) - 1
    _assert_close(prompt, cpu_prompt, 2e-2)
    n = next((i for i, (a, b) in enumerate(zip(tokens, cpu_tokens)) if a != b), len(tokens))
    assert n >= 4  # greedy tokens agree at least until a near-tie
    _assert_close(generated[:n], cpu_generated[:n], 2e-2)
