"""`strata-tool` given what a user gets wrong (session 67's audit): outputs that are devices or
its own inputs, writes that fail or are interrupted half-way, empty and foreign traces, and
option values past what the file formats hold. Each ends in one `error:` line and exit 2, and
leaves no file under the output's name that looks valid."""
from __future__ import annotations

import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from gguf import GGMLQuantizationType as QT

from strata.experts.trace import RECORD_DTYPE, RoutingTrace, write_trace
from strata.model import arch
from strata.model.writer import write_gguf
from strata.tool.cli import main
from strata.tool.routing import synth_trace
from strata.tool.synth import build_spec, synth_model, synth_tokenizer_meta

TOOL = [sys.executable, "-m", "strata.tool"]


def _run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def _assert_refused(result, message: str) -> None:
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit) and "Traceback" not in result.output
    assert message in result.stderr, result.stderr


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("bad-input") / "tiny.gguf"
    synth_model(path, "tiny", "q8_0")
    return path


def _trace(path: Path, n_layers: int = 2, n_experts: int = 8, num_windows: int = 20) -> Path:
    write_trace(path, synth_trace(n_layers, n_experts, 2, num_windows, rows_per_window=2))
    return path


@pytest.fixture
def a_socket(tmp_path):
    """A path that exists and is not a regular file (nor blocks an open, as a pipe does)."""
    path = tmp_path / "o.sock"
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(path))
    yield path
    sock.close()


@pytest.mark.parametrize("command", ["synth", "pack", "synth-trace", "profile"])
def test_an_output_that_is_no_regular_file_is_refused_and_left_alone(tiny, tmp_path, a_socket,
                                                                     command):
    # synth and pack renamed their finished file over it: a device such as /dev/full became
    # a plain file (as root); synth-trace's message named --dump-routing
    args = {"synth": ["synth", "--shape", "tiny", "--type", "f32", a_socket],
            "pack": ["pack", tiny, a_socket],
            "synth-trace": ["synth-trace", a_socket, "--windows", "5"],
            "profile": ["profile", _trace(tmp_path / "t.trace"), "-o", a_socket]}[command]
    result = _run(*args)
    _assert_refused(result, f"{a_socket} exists and is not a regular file")
    assert a_socket.is_socket()


def test_a_profile_is_not_written_over_its_own_trace(tmp_path):
    trace = _trace(tmp_path / "t.trace")
    before = trace.read_bytes()
    _assert_refused(_run("profile", trace, "-o", trace), f"{trace} is also an input")
    assert trace.read_bytes() == before


@pytest.mark.parametrize("command", ["synth-trace", "profile"])
def test_a_write_that_fails_half_way_leaves_no_file(tmp_path, command):
    # both wrote straight into OUT: a full disk (here a file-size limit) left a cut trace or
    # profile under the name
    out = tmp_path / "out"
    trace = _trace(tmp_path / "t.trace", num_windows=200)
    args = {"synth-trace": ["synth-trace", out, "--windows", "2000", "--layers", "4"],
            "profile": ["profile", trace, "-o", out]}[command]
    limit_bytes = 100

    def limit_file_size():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))

    done = subprocess.run(TOOL + [str(a) for a in args], capture_output=True, text=True,
                          preexec_fn=limit_file_size, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr == f"error: cannot write {out}: File too large\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.trace"]


def test_synth_trace_names_its_own_output_when_it_cannot_write(tmp_path):
    if not os.path.isdir("/proc"):
        pytest.skip("needs /proc (a folder where even root cannot create a file)")
    result = _run("synth-trace", "/proc/strata-audit.trace", "--windows", "5")
    _assert_refused(result, "cannot write /proc/strata-audit.trace: No such file or directory")
    assert "--dump-routing" not in result.stderr


def test_ctrl_c_during_a_parallel_synth_stops_it_cleanly(tmp_path):
    # ^C reaches the whole process group: each pool worker printed a KeyboardInterrupt
    # traceback, and the command could hang waiting for them. The workers get it first here,
    # so that they have the time to show what they do with it.
    children = Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children")
    if not children.exists():
        pytest.skip("needs Linux's /proc/PID/task/TID/children")
    out = tmp_path / "m.gguf"
    partial = tmp_path / "m.gguf.partial"
    # -X faulthandler: a command that hangs is sent SIGABRT below, which prints every thread's
    # stack (seen once in CI under load: still running 60 s after the ^C)
    proc = subprocess.Popen(TOOL[:1] + ["-X", "faulthandler"] + TOOL[1:]
                            + ["synth", "--shape", "cpu-bench", "--type", "q4_0",
                               "--layers", "6", "-j", "2", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        # signalled once the workers' tensors are being written (their set-up is done)
        while proc.poll() is None and not (partial.exists()
                                           and partial.stat().st_size > 20 << 20):
            time.sleep(0.01)
        assert proc.poll() is None, "synth ended before it could be interrupted"
        workers = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        assert len(workers) == 2
        for pid in workers:
            os.kill(int(pid), signal.SIGINT)
        time.sleep(0.2)
        os.kill(proc.pid, signal.SIGINT)
        try:
            _, stderr = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            for pid in [proc.pid, *workers]:
                try:
                    os.kill(int(pid), signal.SIGABRT)
                except ProcessLookupError:
                    pass
            _, stderr = proc.communicate(timeout=30)
            pytest.fail(f"synth still ran 60 s after ^C; its threads' stacks:\n{stderr[-6000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 1 and stderr.rstrip().endswith("Aborted!"), stderr[-2000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr
    assert list(tmp_path.iterdir()) == []


def test_a_context_length_past_32_bits_is_an_option_error(tmp_path):
    # the GGUF's u32 key: struct.error's traceback once the file was being written
    result = _run("synth", "--shape", "tiny", "--type", "f32", "--context-length", 2**32,
                  tmp_path / "m.gguf")
    assert result.exit_code == 2 and "--context-length" in result.stderr
    assert "4294967296 is not in the range 1<=x<=4294967295" in result.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", ["profile", "replay"])
def test_a_trace_without_records_is_refused(tmp_path, command):
    # a server stopped before its first request: profile ranked every expert at 0 (layer
    # order) and replay printed 0.0% hit rates, as though measured
    empty = tmp_path / "empty.trace"
    write_trace(empty, RoutingTrace(2, 8, np.zeros(0, dtype=RECORD_DTYPE), {}))
    out = tmp_path / "p.profile"
    args = ["-o", out] if command == "profile" else ["--slots", "4"]
    result = _run(command, empty, *args)
    _assert_refused(result, f"{empty} holds no routing records")
    assert not out.exists() and "windows" not in result.stdout
    listed = _run("inspect", "--routing", empty)
    assert listed.exit_code == 0
    assert listed.stdout == (f"routing trace: 2 layers x 8 experts, no records: nothing was "
                             f"routed while {empty} was recorded\n")


def test_traces_of_two_models_are_named_when_they_do_not_merge(tmp_path):
    small = _trace(tmp_path / "small.trace")
    large = _trace(tmp_path / "large.trace", n_layers=4, n_experts=16)
    result = _run("replay", small, large, "--slots", "4")
    _assert_refused(result, f"{large} routes 4 layers x 16 experts, {small} 2 x 8")


def test_a_profile_of_another_model_is_refused_before_replaying(tmp_path):
    trace = _trace(tmp_path / "t.trace")
    other = tmp_path / "other.profile"
    assert _run("profile", _trace(tmp_path / "o.trace", 4, 16), "-o", other).exit_code == 0
    result = _run("replay", trace, "--slots", "4", "--profile", other)
    _assert_refused(result, f"{other} ranks 4 layers x 16 experts but the trace routes 2 x 8")
    assert result.stdout == ""  # the table's header was printed before the refusal


def test_inspect_refuses_a_trace_of_another_model(tiny, tmp_path):
    trace = _trace(tmp_path / "t.trace", n_layers=4, n_experts=16)
    result = _run("inspect", tiny, "--routing", trace)
    _assert_refused(result, f"{trace} routes 4 layers x 16 experts but {tiny} has 2 x 8")
    assert result.stdout == ""
    assert _run("inspect", tiny, "--routing", _trace(tmp_path / "mine.trace")).exit_code == 0


def test_inspect_shows_file_type_special_tokens_and_chat_template(tiny, tmp_path):
    lines = _run("inspect", tiny).stdout.splitlines()
    assert "file type: Q8_0 (general.file_type 7)" in lines
    assert ("  pre-tokenizer qwen2; BOS '<|endoftext|>' (4089), not added to prompts; "
            "EOS '<|im_end|>' (4091)") in lines
    assert "chat template: in the file (3274 characters)" in lines
    # a file without a template, a file type or special tokens
    spec = build_spec("tiny")
    meta = synth_tokenizer_meta(spec.vocab)
    for key in ("tokenizer.chat_template", "tokenizer.ggml.bos_token_id",
                "tokenizer.ggml.eos_token_id", "tokenizer.ggml.padding_token_id"):
        del meta[key]
    bare = tmp_path / "bare.gguf"
    write_gguf(bare, spec, [(name, QT.F32, np.zeros(shape, np.float32))
                            for name, shape in arch.expected_tensors(spec).items()], meta)
    lines = _run("inspect", bare).stdout.splitlines()
    assert "file type: not stated" in lines and "  pre-tokenizer qwen2" in lines
    assert "chat template: none in the file (Strata uses its ChatML default)" in lines


def test_a_model_that_is_no_regular_file_is_not_said_to_be_missing():
    # "no such model file" for /dev/null sent the user looking for a typo
    result = _run("inspect", os.devnull)
    _assert_refused(result, f"error: {os.devnull}: not a regular file")


def test_an_empty_model_file_is_called_empty(tmp_path):
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    _assert_refused(_run("inspect", empty), f"{empty}: not a GGUF file: it is empty (0 bytes)")


def test_calibrate_refuses_nan_seconds(tiny):
    # NaN passed click's range and the timing loop stopped after one round
    _assert_refused(_run("calibrate", "--seconds", "nan", tiny),
                    "Invalid value for --seconds: nan")


def test_conversations_clear_says_where_it_deleted_from(tmp_path):
    result = _run("conversations", tmp_path, "--clear")
    assert result.exit_code == 0
    assert result.stdout == f"0 conversation files deleted from {tmp_path} (0.00 GiB)\n"


def test_conversations_clear_names_a_file_it_cannot_delete(tmp_path):
    # file.unlink()'s OSError came out as a traceback, after some files were already gone
    from strata.engine.kv_file import write_kv_file

    folder = tmp_path / "conversations"
    folder.mkdir()
    cells = np.zeros((1, 1, 3, 4), np.float16)
    write_kv_file(folder / "a.strata-kv", [1, 2, 3], (cells, cells, None), {"model": "f00"})
    # a folder whose files even root cannot delete
    if shutil.which("chattr") is None or subprocess.run(
            ["chattr", "+i", str(folder)], capture_output=True).returncode:
        pytest.skip("needs chattr +i (root, on a file system with the immutable flag)")
    try:
        result = _run("conversations", folder, "--clear")
    finally:
        subprocess.run(["chattr", "-i", str(folder)], check=True)
    _assert_refused(result, f"error: cannot delete {folder / 'a.strata-kv'}: Operation not "
                            "permitted")
    assert result.stdout == f"0 conversation files deleted from {folder} (0.00 GiB)\n"
    assert (folder / "a.strata-kv").exists()
