"""Mistakes a new user makes on `strata run` / `strata bench` (session 71's first-hour walk
through the README): each error names the flag as typed, not an internal field."""
from __future__ import annotations

import pytest
from click.testing import CliRunner

from strata.cli import main


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from strata.tool.synth import synth_model

    path = tmp_path_factory.mktemp("first-hour") / "tiny.gguf"
    synth_model(path, shape="tiny", weight_type="f32", seed=5)
    return str(path)


@pytest.mark.parametrize("args, flag", [(["-n", "-1"], "'-n' / '--max-tokens'"),
                                        (["-n", "0"], "'-n' / '--max-tokens'"),
                                        (["--temp", "-1"], "'--temp'")])
def test_run_names_the_sampling_flag(tiny, args, flag):
    res = CliRunner().invoke(main, ["run", "--model", tiny, *args, "Hi"])
    assert res.exit_code == 2
    assert f"Invalid value for {flag}" in res.output, res.output


def test_run_refuses_an_empty_prompt_from_stdin(tiny):
    res = CliRunner().invoke(main, ["run", "--model", tiny, "-n", "2", "-"], input=" \n")
    assert res.exit_code == 2
    assert "empty PROMPT from stdin" in res.output, res.output


def test_bench_past_the_context_names_the_flag_given(tiny):
    # the tiny model's context is 4096 tokens; no -d was given, so none is named
    res = CliRunner().invoke(main, ["bench", "--model", tiny, "-p", "5000", "-n", "4"])
    assert res.exit_code == 2
    assert "-p 5000 needs 5000 tokens of context" in res.output and "-d" not in res.output
