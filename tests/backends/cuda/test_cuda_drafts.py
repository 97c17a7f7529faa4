"""Speculative decoding (--spec-type ngram-simple) on the GPU: decode runs of several rows,
their logits left on the device and read row by row by the samplers, give the tokens of one
token per window, on one GPU (every expert in VRAM; an expert cache with a CPU pool and PCIe
reads) and on a layer split, where drafts keep `--batch-groups auto` at one group and an
explicit number of groups turns them off."""
from __future__ import annotations

import pytest

from strata import Engine, EngineConfig, SamplingParams

from cuda_synth import num_gpus, write_split_test_model
from request_runs import run_requests

pytestmark = pytest.mark.cuda

PROMPTS = [[7, 7, 7, 7], [(i * 5) % 3000 + 10 for i in range(40)], [1, 2, 3, 1, 2, 3, 1, 2]]
PARAMS = [SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True),
          SamplingParams(max_tokens=100, temperature=0.8, seed=4, ignore_eos=True),
          SamplingParams(max_tokens=90, temperature=0.0, ignore_eos=True)]
NGRAM = dict(spec_type="ngram-simple", spec_ngram_size_n=2)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    out = tmp_path_factory.mktemp("drafts") / "tiny-q8_0.gguf"
    write_split_test_model(out)
    return out


def _run(path, **options):
    """(token ids, stats) of every request, all submitted at once; and the engine's config."""
    with Engine(EngineConfig(path, n_ctx=512, parallel=2, prompt_chunk_tokens=16,
                             device="cuda", **options)) as engine:
        runs = run_requests(engine, PROMPTS, PARAMS)
        return [(t, h.stats) for t, h in runs], engine.config


@pytest.fixture(scope="module")
def plain(path):
    results, _ = _run(path)
    return [t for t, _ in results]


@pytest.mark.parametrize("options", [
    dict(),
    dict(expert_cache=6, adapt_every=1, pcie_frac=0.5),
    dict(expert_cache=6, adapt_every=1, pcie_frac=1.0, kv_type="int8"),
], ids=["resident", "cache-pool-pcie", "cache-pcie-int8"])
def test_drafts_give_the_tokens_of_no_drafts(path, plain, options):
    if options.get("kv_type") == "int8":
        plain = [t for t, _ in _run(path, **options)[0]]
    results, _ = _run(path, **NGRAM, **options)
    assert [t for t, _ in results] == plain
    assert sum(s.num_draft_tokens for _, s in results) > 0


@pytest.mark.parametrize("groups,drafts_on", [("auto", True), (2, False)])
def test_a_split_keeps_drafts_at_one_group(path, plain, groups, drafts_on):
    if num_gpus() < 2:
        pytest.skip("needs two GPUs")
    results, config = _run(path, split_devices="0,1", layer_split="2,2", batch_groups=groups,
                           **NGRAM)
    assert [t for t, _ in results] == plain
    assert config.drafts.is_on == drafts_on
    assert (sum(s.num_draft_tokens for _, s in results) > 0) == drafts_on
