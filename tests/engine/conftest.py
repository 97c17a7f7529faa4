"""A tiny F32 synth model shared by the engine tests, and its tokenizer."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory):
    from strata.tool.synth import synth_model

    path = tmp_path_factory.mktemp("models") / "tiny-f32.gguf"
    synth_model(path, shape="tiny", weight_type="f32", seed=3)
    return path


@pytest.fixture(scope="session")
def hybrid_path(tmp_path_factory):
    """A tiny F32 qwen3next synth: gated delta-net layers with a recurrent state."""
    from strata.tool.synth import synth_model

    path = tmp_path_factory.mktemp("models") / "tiny-qwen3next.gguf"
    synth_model(path, shape="tiny-qwen3next", weight_type="f32", seed=7)
    return path


@pytest.fixture(scope="session")
def tokenizer(tiny_model_path):
    from strata.model.gguf_file import GGUFModel
    from strata.model.tokenizer import Tokenizer

    with GGUFModel.open(tiny_model_path) as m:
        return Tokenizer.from_gguf_metadata(m.metadata)


@pytest.fixture(scope="session")
def wide(tmp_path_factory):
    """tiny with 32 experts of width 64 (Q8_0, 13056-byte slots: 25 f32 cells each), skewed:
    an expert cache whose slots KV grow lends."""
    from strata.tool.synth import synth_model

    path = tmp_path_factory.mktemp("wide") / "tiny-wide.gguf"
    synth_model(path, shape="tiny", weight_type="q8_0", seed=5, routing_skew=1.0, n_experts=32,
                expert_ffn=64)
    return path
