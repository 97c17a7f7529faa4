"""`strata run` and `strata bench` through click's CliRunner on a tiny synth model."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from strata.cli import main


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from strata.tool.synth import synth_model

    path = tmp_path_factory.mktemp("cli") / "tiny.gguf"
    synth_model(path, shape="tiny", weight_type="f32", seed=5)
    return str(path)


def tokenizer_of(path: str):
    from strata.model.gguf_file import GGUFModel
    from strata.model.tokenizer import Tokenizer

    with GGUFModel.open(path) as m:
        return Tokenizer.from_gguf_metadata(m.metadata)


def runner() -> CliRunner:
    return CliRunner()


def test_run_streams_text_and_prints_speed(tiny):
    res = runner().invoke(main, ["run", "--model", tiny, "-n", "8", "--temp", "0", "Hello"])
    assert res.exit_code == 0, res.output
    assert res.stdout.endswith("\n") and len(res.stdout) > 1
    speed = res.stderr.strip().splitlines()[-1]
    assert speed.startswith("prompt: ") and " tokens/s, decode: " in speed
    text = "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
    assert speed.split()[1] == str(len(tokenizer_of(tiny).encode(text)))


def test_run_is_greedy_deterministic_and_raw_differs(tiny):
    args = ["run", "--model", tiny, "-n", "6", "--temp", "0"]
    a = runner().invoke(main, args + ["Hi there"])
    b = runner().invoke(main, args + ["Hi there"])
    raw = runner().invoke(main, args + ["--raw", "Hi there"])
    assert a.exit_code == b.exit_code == raw.exit_code == 0
    assert a.stdout == b.stdout
    num_raw = len(tokenizer_of(tiny).encode("Hi there"))
    assert raw.stderr.strip().splitlines()[-1].split()[1] == str(num_raw)


def test_run_uses_strata_model_env(tiny):
    res = runner().invoke(main, ["run", "-n", "2", "--temp", "0", "Hi"],
                          env={"STRATA_MODEL": tiny})
    assert res.exit_code == 0, res.output


def test_bad_model_path_exits_2(tmp_path):
    res = runner().invoke(main, ["run", "--model", str(tmp_path / "missing.gguf"), "Hi"])
    assert res.exit_code == 2
    assert "missing.gguf" in res.stderr and "does not exist" in res.stderr
    assert "strata-tool synth" in res.stderr
    assert "Traceback" not in res.output


def test_corrupt_model_exits_2_with_one_line(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"this is not a gguf file at all" * 10)
    res = runner().invoke(main, ["run", "--model", str(bad), "Hi"])
    assert res.exit_code == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "bad.gguf" in lines[0]


def test_no_model_anywhere_says_how_to_get_one(monkeypatch):
    monkeypatch.setattr("strata.cli.default_model_path", lambda: None)
    res = runner().invoke(main, ["run", "Hi"], env={"STRATA_MODEL": ""})
    assert res.exit_code == 2
    assert "strata-tool synth --shape tiny" in res.stderr


def test_bad_sampling_value_exits_2(tiny):
    res = runner().invoke(main, ["run", "--model", tiny, "--top-p", "0", "Hi"])
    assert res.exit_code == 2
    assert "top_p = 0.0" in res.stderr


def test_too_long_prompt_exits_2(tiny):
    res = runner().invoke(main, ["run", "--model", tiny, "--ctx-size", "8", "--raw",
                                 "one two three four five six seven eight nine ten"])
    assert res.exit_code == 2
    assert "context holds 8" in res.stderr


def test_bench_prints_both_rows(tiny):
    res = runner().invoke(main, ["bench", "--model", tiny, "-p", "16", "-n", "4", "-r", "2",
                                 "--threads", "1"])
    assert res.exit_code == 0, res.output
    lines = res.stdout.strip().splitlines()
    assert [c.strip() for c in lines[0].split("|")[1:-1]] == ["model", "size", "type",
                                                              "threads", "test", "t/s"]
    assert len(lines) == 4
    assert "| pp16 " in lines[2] and "| tg4 " in lines[3]
    for line in lines[2:]:
        cells = [c.strip() for c in line.split("|")[1:-1]]
        assert cells[2] == "F32" and cells[3] == "1"
        median, stdev = cells[5].split(" ± ")
        assert float(median) > 0 and float(stdev) >= 0


def test_bench_json(tiny):
    res = runner().invoke(main, ["bench", "--model", tiny, "-p", "8", "-n", "2", "-r", "3",
                                 "--json"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.stdout)
    assert [r["test"] for r in rows] == ["pp8", "tg2"]
    assert all(len(r["tokens_per_s"]) == 3 for r in rows)
    assert rows[0]["n_tokens"] == 8 and rows[0]["type"] == "F32"


def test_bench_bad_repetitions(tiny):
    res = runner().invoke(main, ["bench", "--model", tiny, "-r", "0"])
    assert res.exit_code == 2
    assert "-r" in res.output


def test_run_reads_the_prompt_from_stdin(tiny):
    args = ["run", "--model", tiny, "-n", "4", "--temp", "0", "--raw"]
    from_arg = runner().invoke(main, args + ["Hi there"])
    from_stdin = runner().invoke(main, args + ["-"], input="Hi there")
    assert from_stdin.exit_code == 0, from_stdin.output
    assert from_stdin.stdout == from_arg.stdout


def test_bad_threads_exits_2(tiny):
    for cmd in (["run", "--model", tiny, "--threads", "0", "Hi"],
                ["bench", "--model", tiny, "-p", "4", "-n", "1", "-r", "1", "--threads", "0"]):
        res = runner().invoke(main, cmd)
        assert res.exit_code == 2, res.output
        assert "threads" in res.stderr and "Traceback" not in res.output
