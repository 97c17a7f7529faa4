"""--read-chunk auto|N: the CLI's value, the EngineConfig fields it sets, their resolution by the
engine (the solo chunk: larger only where prompt windows stream their experts from RAM) and the
interleave policy the plugin hook builds from them."""
from __future__ import annotations

import click
import pytest

from strata.cli_options import ReadChunk, read_chunk_fields
from strata.config import SOLO_STREAMED_CHUNK_TOKENS, EngineConfig
from strata.errors import ConfigError
from strata.plugins import get_plugin_manager, resolve_choosers


@pytest.mark.parametrize("text, value", [("auto", "auto"), (" AUTO ", "auto"), ("1", 1),
                                         ("4096", 4096)])
def test_read_chunk_parses_auto_or_a_count(text, value):
    assert ReadChunk().convert(text, None, None) == value


@pytest.mark.parametrize("text", ["0", "-3", "2.5", "big", ""])
def test_read_chunk_refuses_anything_else(text):
    with pytest.raises(click.BadParameter, match="give auto or a number"):
        ReadChunk().convert(text, None, None)


def test_fields_of_auto_and_of_a_count():
    assert read_chunk_fields("auto") == dict(prompt_chunk_tokens=512, solo_chunk_tokens="auto")
    assert read_chunk_fields(96) == dict(prompt_chunk_tokens=96, solo_chunk_tokens=None)


def test_resolution(tiny_model_path):
    auto = EngineConfig(tiny_model_path, **read_chunk_fields("auto"))
    assert auto.max_prompt_window_tokens() == SOLO_STREAMED_CHUNK_TOKENS
    assert auto.resolve_solo_chunk(streams_prompt_experts=True) == SOLO_STREAMED_CHUNK_TOKENS
    assert auto.max_prompt_window_tokens() == SOLO_STREAMED_CHUNK_TOKENS
    cpu = EngineConfig(tiny_model_path, **read_chunk_fields("auto"))
    assert cpu.resolve_solo_chunk(streams_prompt_experts=False) == 512
    assert cpu.max_prompt_window_tokens() == 512
    given = EngineConfig(tiny_model_path, **read_chunk_fields(96))
    assert given.max_prompt_window_tokens() == 96
    assert given.resolve_solo_chunk(streams_prompt_experts=True) == 96  # N is honoured
    # a chunk above 4096 stays the solo size too
    big = EngineConfig(tiny_model_path, prompt_chunk_tokens=8192, solo_chunk_tokens="auto")
    assert big.resolve_solo_chunk(streams_prompt_experts=True) == 8192


@pytest.mark.parametrize("solo", [0, -1, 2.5, "many"])
def test_a_bad_solo_chunk_is_a_config_error(tiny_model_path, solo):
    with pytest.raises(ConfigError, match="solo_chunk_tokens"):
        EngineConfig(tiny_model_path, solo_chunk_tokens=solo)


def test_the_hook_builds_the_policy_from_the_resolved_sizes(tiny_model_path):
    config = EngineConfig(tiny_model_path, prompt_chunk_tokens=64, solo_chunk_tokens="auto")
    config.resolve_solo_chunk(streams_prompt_experts=True)
    choosers = resolve_choosers(get_plugin_manager(autoload=False), config=config, spec=None,
                                num_slots=2)
    policy = choosers.read_interleave
    assert (policy.read_chunk_tokens, policy.solo_chunk_tokens) == (64, 4096)


def test_the_cpu_engine_reads_solo_prompts_in_read_chunks(tiny_model_path):
    """On the CPU nothing is streamed: auto keeps 512 for every window."""
    from strata.engine.engine import Engine

    engine = Engine(EngineConfig(tiny_model_path, device="cpu", **read_chunk_fields("auto")))
    try:
        assert engine.config.solo_chunk_tokens == 512
        policy = engine.scheduler.choosers.read_interleave
        assert policy.solo_chunk_tokens == policy.read_chunk_tokens == 512
    finally:
        engine.close()
