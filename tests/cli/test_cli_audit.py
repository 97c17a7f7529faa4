"""`strata run` / `strata bench` options that used to end in a traceback or a misleading
message (session 64's audit of the command line)."""
from __future__ import annotations

import os

import pytest
from click.testing import CliRunner

from strata.cli import main
from strata.config import EngineConfig
from strata.errors import ConfigError


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from strata.tool.synth import synth_model

    path = tmp_path_factory.mktemp("cli-audit") / "tiny.gguf"
    synth_model(path, shape="tiny", weight_type="f32", seed=5)
    return str(path)


def unwritable_trace_path() -> str:
    """A file name in a folder that exists but where no file can be created, even by root."""
    path = "/proc/strata-audit.trace"
    if not os.path.isdir("/proc"):
        pytest.skip("needs /proc (a folder where even root cannot create a file)")
    return path


@pytest.mark.parametrize("command", [["run", "-n", "1", "--temp", "0", "Hi"],
                                     ["bench", "-p", "4", "-n", "2", "-r", "1"]])
def test_dump_routing_to_an_unwritable_place_exits_2(tiny, command):
    # the folder exists, so the config let it through and the tier's open() raised
    # FileNotFoundError with a traceback once the model was loaded
    path = unwritable_trace_path()
    res = CliRunner().invoke(main, command[:1] + ["--model", tiny, "--dump-routing", path]
                             + command[1:])
    assert res.exit_code == 2, res.output
    assert f"--dump-routing {path!r} cannot be written" in res.stderr
    assert isinstance(res.exception, SystemExit) and "Traceback" not in res.output


def test_dump_routing_check_leaves_the_folder_as_it_was(tiny, tmp_path):
    path = tmp_path / "routing.trace"
    config = EngineConfig(tiny, dump_routing_path=path)
    assert config.dump_routing_path == path
    assert not path.exists()  # the probe's file is gone again
    path.write_bytes(b"kept")
    EngineConfig(tiny, dump_routing_path=path)
    assert path.read_bytes() == b"kept"  # an existing file is not truncated by the check
    with pytest.raises(ConfigError, match="cannot be written"):
        EngineConfig(tiny, dump_routing_path=unwritable_trace_path())


def test_a_model_that_is_no_regular_file_is_not_said_to_be_missing():
    # /dev/null exists: "does not exist" sent the user looking for a typo
    res = CliRunner().invoke(main, ["run", "--model", os.devnull, "Hi"])
    assert res.exit_code == 2
    assert f"{os.devnull!r} is not a regular file" in res.stderr
    assert "does not exist" not in res.stderr and "Traceback" not in res.output
    res = CliRunner().invoke(main, ["bench", "-p", "4", "-n", "0"],
                             env={"STRATA_MODEL": os.devnull})
    assert res.exit_code == 2 and "is not a regular file" in res.stderr


def test_run_names_the_decode_count_its_rate_is_of(tiny):
    # the rate divides the decode windows' tokens (the first token comes from the prompt's
    # logits, in the prompt's time) but the line named every generated token with it
    res = CliRunner().invoke(main, ["run", "--model", tiny, "-n", "8", "--temp", "0",
                                    "--raw", "Hello there"])
    assert res.exit_code == 0, res.output
    speed = res.stderr.strip().splitlines()[-1]
    decode = speed.split("decode: ", 1)[1]
    assert decode.startswith("7 tokens at ") and decode.endswith(
        "tokens/s (8 generated, the first from the prompt's logits)"), speed


HUGE = "1" + "0" * 5000  # int() refuses strings past 4300 digits


@pytest.mark.parametrize("flags, message", [
    # '²'.isdigit() is True but int('²') raises ValueError
    (["--read-chunk", "²"], "'²': give auto or a number of tokens >= 1"),
    (["--read-chunk", HUGE], "give auto or a number of tokens >= 1"),
    (["--expert-cache", "²"], "--expert-cache is '²'"),
    (["--expert-cache", HUGE], "give 'auto' or a number of slots >= 0"),
    (["--expert-cache", "4", "--kv-grow", "²"], "--kv-grow is '²'"),
    (["--batch-groups", "²"], "--batch-groups '²'"),
    (["--layer-split", "²"], "--layer-split '²'"),
    (["--expert-cache", "auto", "--vram-budget", "1" + "0" * 400],
     "more bytes than any machine has"),  # float() gives inf, int(inf) raised
])
def test_odd_numbers_in_options_exit_2_without_a_traceback(tiny, flags, message):
    res = CliRunner().invoke(main, ["run", "--model", tiny, "-n", "1"] + flags + ["Hi"])
    assert res.exit_code == 2, res.output
    assert isinstance(res.exception, SystemExit), res.exception
    assert message in res.stderr


@pytest.mark.parametrize("flags", [["-d", "²"], ["-np", "²"], ["-d", "0," + HUGE],
                                   ["--chunk", "²"]])
def test_odd_numbers_in_bench_lists_exit_2_without_a_traceback(tiny, flags):
    res = CliRunner().invoke(main, ["bench", "--model", tiny, "-p", "2", "-n", "2", "-r", "1"]
                             + flags)
    assert res.exit_code == 2, res.output
    assert isinstance(res.exception, SystemExit), res.exception
    assert "Invalid value for" in res.stderr


def test_kv_grow_of_zero_cells_is_refused_however_written(tiny):
    # "00" passed the text check for "0" and gave every slot a KV of 0 cells
    for value in ("0", "00", " 0 "):
        with pytest.raises(ConfigError, match="number of cells >= 1"):
            EngineConfig(tiny, expert_cache=4, kv_grow=value)
    assert EngineConfig(tiny, expert_cache=4, kv_grow=" 007 ").kv_grow == 7


@pytest.mark.parametrize("command", [["run", "Hi"], ["bench", "-p", "4", "-n", "0"],
                                     ["serve", "--port", "0"]])
def test_a_model_file_that_cannot_be_read_exits_2_naming_it(command):
    # a regular file whose first read fails (EIO), as an unreadable file does (EACCES) for a
    # user who is not root: GGUFModel.open's OSError came out as a traceback
    path = "/proc/self/mem"
    if not os.path.isfile(path):
        pytest.skip("needs Linux's /proc/self/mem")
    res = CliRunner().invoke(main, command[:1] + ["--model", path] + command[1:])
    assert res.exit_code == 2, res.output
    assert isinstance(res.exception, SystemExit), res.exception
    assert f"model file {path!r} cannot be read" in res.stderr


def test_dump_routing_to_a_pipe_is_refused_not_waited_on(tiny, tmp_path):
    # opening a FIFO for writing blocks until a reader comes: start-up hung
    fifo = tmp_path / "routing.fifo"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="must name a file in an existing folder"):
        EngineConfig(tiny, dump_routing_path=fifo)


def test_bench_says_it_ignores_kv_grow(tiny):
    # It took the flag and said nothing, as though the timed KVs grew.
    res = CliRunner().invoke(main, ["bench", "--model", tiny, "-p", "4", "-n", "2", "-r", "1",
                                    "--expert-cache", "8", "--kv-grow", "16"])
    assert res.exit_code == 0, res.output
    assert "--kv-grow is ignored" in res.stderr


def test_bench_reads_the_stored_profile_but_never_adds_its_random_routing(tiny, tmp_path,
                                                                          monkeypatch):
    # bench's random tokens' routing was folded into the profile the next `serve` fills from.
    monkeypatch.setenv("STRATA_CACHE_DIR", str(tmp_path))
    from strata.experts.profile import stored_profile_path

    stored = stored_profile_path(tiny)
    run = CliRunner().invoke(main, ["run", "--model", tiny, "-n", "2", "--temp", "0",
                                    "--expert-cache", "8", "--expert-profile", "auto", "Hi"])
    assert run.exit_code == 0, run.output
    assert stored.is_file()  # a run adds its routing
    before = stored.read_bytes()
    res = CliRunner().invoke(main, ["bench", "--model", tiny, "-p", "4", "-n", "2", "-r", "1",
                                    "--expert-cache", "8", "--expert-profile", "auto"])
    assert res.exit_code == 0, res.output
    assert stored.read_bytes() == before


def test_batch_groups_without_a_split_is_refused(tiny):
    # it was taken and ignored, as though slot groups were pipelined over one device
    res = CliRunner().invoke(main, ["run", "--model", tiny, "-n", "1", "--batch-groups", "2",
                                    "Hi"])
    assert res.exit_code == 2, res.output
    assert "--batch-groups 2 pipelines slot groups" in res.stderr
