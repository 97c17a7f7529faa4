"""`strata-tool synth` and `strata-tool inspect` through click's CliRunner."""
import hashlib

import pytest
from click.testing import CliRunner

from strata.tool.cli import main
from strata.tool.inspect import inspect_model
from strata.tool.presets import PRESETS
from strata.tool.synth import synth_model


def _run(*args):
    return CliRunner().invoke(main, list(args))


@pytest.fixture(scope="module")
def tiny_q8(tmp_path_factory):
    path = tmp_path_factory.mktemp("m") / "tiny-q8.gguf"
    synth_model(path, "tiny", "q8_0")
    return path


def test_synth_list():
    result = _run("synth", "--list")
    assert result.exit_code == 0
    assert [line.split()[0] for line in result.output.splitlines()] == list(PRESETS)


def test_synth_writes_the_same_file_as_the_api(tmp_path, tiny_q8):
    out = tmp_path / "cli.gguf"
    result = _run("synth", "--shape", "tiny", "--type", "q8_0", str(out))
    assert result.exit_code == 0, result.output
    assert hashlib.sha256(out.read_bytes()).digest() == \
        hashlib.sha256(tiny_q8.read_bytes()).digest()
    size = out.stat().st_size
    assert f"wrote {out}: qwen3moe, shape tiny, q8_0, seed 0, {size} bytes" in result.stdout
    assert "  experts: 8 of width 32, top-2 (renormalised)" in result.stdout
    assert "writing" in result.stderr  # the progress bar


def test_synth_options_arch_layers_seed(tmp_path):
    out = tmp_path / "q2.gguf"
    result = _run("synth", "--shape", "tiny", "--type", "f16", "--arch", "qwen2moe",
                  "--layers", "3", "--seed", "5", str(out))
    assert result.exit_code == 0, result.output
    report = inspect_model(out)
    assert (report.spec.arch, report.spec.n_layers, report.spec.shared_ffn) == ("qwen2moe", 3, 64)
    assert report.spec.context_length == 4096  # the preset's


def test_synth_context_length(tmp_path):
    out = tmp_path / "long.gguf"
    result = _run("synth", "--shape", "tiny", "--type", "f32", "--context-length", "131072",
                  str(out))
    assert result.exit_code == 0, result.output
    assert "context 131072" in result.stdout
    assert inspect_model(out).spec.context_length == 131072
    bad = _run("synth", "--shape", "tiny", "--context-length", "0", str(tmp_path / "x.gguf"))
    assert bad.exit_code == 2 and "--context-length" in bad.output


@pytest.mark.parametrize("args, message", [
    (("--shape", "tiny", "--routing-skew", "-1"), "routing skew must be a finite number >= 0"),
    (("--shape", "nope"), "unknown model shape 'nope'"),
    (("--type", "tq1_0"), "unknown weight type 'tq1_0'"),
    ((), "give the output path"),
])
def test_synth_errors_exit_2_with_one_line(tmp_path, args, message):
    out = [str(tmp_path / "x.gguf")] if args else []
    result = _run("synth", *args, *out)
    assert result.exit_code == 2
    assert result.stderr.startswith("error: ") and message in result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.output
    assert not (tmp_path / "x.gguf").exists()


def test_inspect_accounts_dense_and_expert_bytes(tiny_q8):
    report = inspect_model(tiny_q8)
    # Per layer: gate/up/down experts of 8 x 32 x 64 values, Q8_0 = 34 bytes per 32 values.
    expert_bytes = 2 * 3 * (8 * 32 * 64 // 32 * 34)
    assert report.expert_bytes == expert_bytes == 104448
    assert report.expert_bytes_per_token == expert_bytes * 2 // 8
    q8_dense = (2 * 4096 * 64 + 2 * (64 * 64 + 2 * 32 * 64 + 64 * 64)) // 32 * 34
    f32_dense = 4 * (64 + 2 * (64 + 64 + 16 + 16 + 8 * 64))
    assert report.dense_bytes == q8_dense + f32_dense
    assert report.bytes_by_type == {"Q8_0": q8_dense + expert_bytes, "F32": f32_dense}
    assert report.tensors_by_type == {"Q8_0": 2 + 2 * 7, "F32": 1 + 2 * 5}
    assert report.num_tokens == 4096 and report.tokenizer_model == "gpt2"
    assert report.num_params == 2 * 4096 * 64 + 64 + 2 * (
        64 * 64 * 2 + 2 * 32 * 64 + 64 + 64 + 16 + 16 + 8 * 64 + 3 * 8 * 32 * 64)
    assert report.file_bytes == tiny_q8.stat().st_size


def test_inspect_cli_output(tiny_q8):
    result = _run("inspect", str(tiny_q8))
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"{tiny_q8}: qwen3moe 'strata-synth-tiny-q8_0'")
    assert "  layers 2, hidden 64, vocab 4096, context 4096" in lines
    assert "tokenizer: gpt2, 4096 tokens" in lines
    assert any(line.startswith("routed experts:") and "102.00 KiB" in line for line in lines)
    assert any(line.startswith("experts per token:") and "25.50 KiB" in line
               and "(top-2 of 8 in each of 2 layers)" in line for line in lines)


@pytest.mark.parametrize("kind", ["missing", "not-gguf", "truncated", "empty"])
def test_inspect_bad_files_exit_2_with_one_line(tmp_path, tiny_q8, kind):
    path = tmp_path / "bad.gguf"
    if kind == "not-gguf":
        path.write_text("this is a text file, not a model\n" * 10)
    elif kind == "truncated":
        path.write_bytes(tiny_q8.read_bytes()[: tiny_q8.stat().st_size // 2])
    elif kind == "empty":
        path.write_bytes(b"")
    result = _run("inspect", str(path))
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith(f"error: {path}") and result.stderr.count("\n") == 1
    assert "Traceback" not in result.output and result.stdout == ""


def test_synth_into_a_missing_folder_exits_2(tmp_path):
    out = tmp_path / "no-such-dir" / "m.gguf"
    result = _run("synth", "--shape", "tiny", "--type", "f32", str(out))
    assert result.exit_code == 2
    assert result.stderr == f"error: cannot write {out}: No such file or directory\n"
    assert not out.exists()
