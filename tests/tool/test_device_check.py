"""tools/device_check.sh pair: the A/B of two settings of `strata bench`, alternating (the
order turning each round). Run here with a stand-in for `python3 tools/bench_logged.py -- ...`
(`strata bench` with the tier's log; the GPU machine runs the real one): each side's
NAME=VALUE words reach the environment and its other words the bench's flags, and the summary
gives each row's runs, medians and B/A (and each run's timeline when the sides turn it on).
`old` and `kernel`: the packed old revision built beside the tree, and the pool's kernel bench
of both trees side by side (stand-ins for pip and tools/bench_pool_kernel.py). `sides`: pair
with any number of sides. Every part: a failure's reasons printed (a stand-in pytest). `suite`:
the carried wheels installed, then the whole suite with each failure's line."""
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# prints a table row whose tokens/s come from the environment (BOOST) and the flags it got
FAKE_PYTHON = """#!/bin/bash
if [[ "$1" == */tools/bench_logged.py ]] && [[ " $* " == *" -- "* ]]; then
  echo "args: $*" >&2
  [[ " $* " == *" --pcie-frac auto "* ]] && flag=1 || flag=0
  round=$(cat "$COUNTER" 2>/dev/null || echo 0); echo $((round + 1)) > "$COUNTER"
  echo "| m.gguf | cuda | pp512 | $((4000 + ${BOOST:-0} + round)).5 ± 9.0 |"
  echo "| m.gguf | cuda | tg64 x4 | $((100 + 10 * flag)).0 ± 1.0 |"
  exit 0
fi
exec "$REAL_PYTHON" "$@"
"""


def _fake_bin(tmp_path, text):
    """A folder holding `text` as an executable python3, to put first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "python3"
    fake.write_text(text)
    fake.chmod(0o755)
    return bin_dir


def _run_pair(tmp_path, fake_text, rounds, *args, mode="pair", **extra_env):
    """device_check.sh MODE ARGS with `fake_text` as python3: (the run, its $OUT)."""
    import sys

    bin_dir = _fake_bin(tmp_path, fake_text)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"")
    out = tmp_path / "out"
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", OUT=str(out),
               PAIR_MODEL=str(model), ROUNDS=str(rounds), REAL_PYTHON=sys.executable,
               COUNTER=str(tmp_path / "count"), **extra_env)
    res = subprocess.run(["bash", str(ROOT / "tools" / "device_check.sh"), mode, *args],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    return res, out


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_pair_alternates_the_two_sides_and_summarises_each_row(tmp_path):
    res, out = _run_pair(tmp_path, FAKE_PYTHON, 3, "", "BOOST=300 --pcie-frac auto",
                         "-p", "512", "-n", "0")
    logs = sorted(p.name for p in out.glob("pair_*.log"))
    assert logs == [f"pair_{side}_{r}.log" for side in (0, 1) for r in (1, 2, 3)]
    a_args = (out / "pair_0_1.log").read_text()
    b_args = (out / "pair_1_1.log").read_text()
    assert "--expert-cache 0 -p 512 -n 0" in a_args and "--pcie-frac" not in a_args
    assert b_args.rstrip().count("--pcie-frac auto") == 1
    # alternating, the order turning each round (A B, B A, A B): A got calls 0, 3, 4 and B
    # 1, 2, 5 (the counter), B + 300 from its env
    assert ("pp512: A (as is) 4000.5, 4003.5, 4004.5 median 4003.5; "
            "B (BOOST=300 --pcie-frac auto) 4301.5, 4302.5, 4305.5 median 4302.5; "
            "B/A 1.075, B won 3 of 3") in res.stdout
    assert "tg64 x4: A (as is) 100.0, 100.0, 100.0 median 100.0" in res.stdout
    assert "B/A 1.100, B won 3 of 3" in res.stdout


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_sides_alternates_any_number_of_sides_against_the_first(tmp_path):
    res, out = _run_pair(tmp_path, FAKE_PYTHON, 2, "", "BOOST=300", "BOOST=-100 --pcie-frac auto",
                         "--", "-p", "512", "-n", "0", mode="sides", PAIR_TAG="skew0")
    logs = sorted(p.name for p in out.glob("*.log"))
    assert logs == [f"skew0_{side}_{r}.log" for side in (0, 1, 2) for r in (1, 2)]
    c_args = (out / "skew0_2_1.log").read_text()
    # the sides' "--" ends the sides, never reaching the bench (bench_logged.py's own does)
    assert "--expert-cache 0 -p 512 -n 0 --pcie-frac auto" in c_args
    assert c_args.count(" -- ") == 1
    # calls 0-5 in the order A B C C B A: A 0, 5; B 1, 4 (+300); C 2, 3 (-100)
    assert ("pp512: A (as is) 4000.5, 4005.5 median 4003.0; "
            "B (BOOST=300) 4301.5, 4304.5 median 4303.0; "
            "C (BOOST=-100 --pcie-frac auto) 3902.5, 3903.5 median 3903.0; "
            "B/A 1.075, B won 2 of 2; C/A 0.975, C won 0 of 2") in res.stdout
    assert "C (BOOST=-100 --pcie-frac auto) 110.0, 110.0 median 110.0" in res.stdout


# bench_pool_kernel.py's lines: the old tree's (its path under OLD_TREE) at 1,000 experts/s,
# the working tree's at 1,200 (1,500 for AMX rows); pip's install of the old tree makes the
# target folder; a bench run with STRATA_STREAM_TIMELINE=1 prints a timeline line too
FAKE_KERNEL_PYTHON = """#!/bin/bash
if [[ "$1" == */tools/bench_pool_kernel.py ]] || [ "$1" = tools/bench_pool_kernel.py ]; then
  # the old side: the tree's benchmark on the old build's kernels
  base=1200
  [[ "$1" == tools/bench_pool_kernel.py && "$PYTHONPATH" == "$OLD_SITE":* ]] && base=1000
  echo "simd test, args: ${*:2}"
  echo "Q4_0  threads   3 rows/expert    8    : $(printf "%'d" $base) experts/s (1-2),  8 rows/s"
  echo "Q4_0  threads   3 rows/expert    8 amx: $(printf "%'d" $((base + 300))) experts/s (1-2)"
  exit 0
fi
if [ "$1" = -m ] && [ "$2" = pip ]; then
  for a in "$@"; do [ "$prev" = --target ] && mkdir -p "$a"; prev=$a; done
  exit 0
fi
exec "$REAL_PYTHON" "$@"
"""


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("tar") is None,
                    reason="needs bash and tar")
def test_old_builds_the_packed_revision_and_kernel_sets_the_trees_side_by_side(tmp_path):
    import subprocess as sp
    import sys

    work = tmp_path / "work"
    (work / "tools").mkdir(parents=True)
    (work / ".device").mkdir()
    src = tmp_path / "rev"
    (src / "tools").mkdir(parents=True)
    (src / "tools" / "bench_pool_kernel.py").write_text("# the old revision's bench\n")
    sp.run(["tar", "-czf", str(work / ".device" / "old.tar.gz"), "-C", str(src), "."],
           check=True)
    bin_dir = _fake_bin(tmp_path, FAKE_KERNEL_PYTHON)
    out = tmp_path / "out"
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", OUT=str(out), ROUNDS="2",
               REAL_PYTHON=sys.executable, OLD_TREE=str(tmp_path / "old"),
               OLD_SITE=str(tmp_path / "site_old"))
    script = str(ROOT / "tools" / "device_check.sh")
    res = sp.run(["bash", script, "kernel", "--threads", "3"], cwd=work, env=env,
                 capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    # no old build yet: the tree alone, its own arguments passed through
    assert "Q4_0 threads 3 rows/expert 8: tree 1,200 / 1,200" in res.stdout
    assert "old" not in res.stdout.split("== kernel_new_2")[-1]
    assert "args: --threads 3" in (out / "kernel_new_1.log").read_text()
    res = sp.run(["bash", script, "old"], cwd=work, env=env, capture_output=True, text=True,
                 timeout=60)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "old" / "tools" / "bench_pool_kernel.py").is_file()
    assert (tmp_path / "site_old").is_dir()
    res = sp.run(["bash", script, "kernel"], cwd=work, env=env, capture_output=True, text=True,
                 timeout=60)
    assert res.returncode == 0, res.stderr
    assert sorted(p.name for p in out.glob("kernel_*.log")) == [
        "kernel_new_1.log", "kernel_new_2.log", "kernel_old_1.log", "kernel_old_2.log"]
    # the default arguments: all cores but one, both kernels
    assert "--amx both" in (out / "kernel_old_1.log").read_text()
    assert ("Q4_0 threads 3 rows/expert 8: tree 1,200 / 1,200; old 1,000 / 1,000; "
            "tree/old 1.200") in res.stdout
    assert ("Q4_0 threads 3 rows/expert 8 amx: tree 1,500 / 1,500; old 1,300 / 1,300; "
            "tree/old 1.154") in res.stdout


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_pair_gives_each_runs_timeline_when_the_sides_ask_for_it(tmp_path):
    fake_text = FAKE_PYTHON.replace(
        '  exit 0\n',
        '  [ "$STRATA_STREAM_TIMELINE" = 1 ] && echo "expert cache: ...; timeline, medians of '
        '7 streamed windows: $((100 + ${BOOST:-0})).0 ms"\n  exit 0\n', 1)
    res, _ = _run_pair(tmp_path, fake_text, 2, "STRATA_STREAM_TIMELINE=1",
                       "STRATA_STREAM_TIMELINE=1 BOOST=7", "-p", "512")
    lines = res.stdout.splitlines()
    for side, ms in (("A", 100), ("B", 107)):
        for r in (1, 2):
            assert f"{side} round {r}: timeline, medians of 7 streamed windows: {ms}.0 ms" \
                in lines


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_sides_give_where_each_runs_auto_share_ended(tmp_path):
    fake_text = FAKE_PYTHON.replace(
        '  exit 0\n',
        '  echo "expert cache: ...; CPU pool: ...; PCIe share (--pcie-frac auto) by window rows: '
        '1: 0.$((375 - ${BOOST:-0})) (0 moves in 512 windows); read-ahead: ..."\n'
        '  echo "strata.pool INFO PCIe share of 1-row windows stays 0.375 (10.00 ms a window; '
        'tried 0.250: 10.10)" >&2\n  exit 0\n', 1)
    res, out = _run_pair(tmp_path, fake_text, 2, "", "BOOST=125", "-p", "0", "-n", "128")
    # the tuner's rounds are strata.pool's log lines
    assert "--log strata.tier=INFO --log strata.pool=INFO --" in (out / "pair_0_1.log").read_text()
    lines = res.stdout.splitlines()
    assert ("B round 2: PCIe share of 1-row windows stays 0.375 (10.00 ms a window; tried "
            "0.250: 10.10)") in lines
    for side, share in (("A", "0.375"), ("B", "0.250")):
        for r in (1, 2):
            assert (f"{side} round {r}: PCIe share (--pcie-frac auto) by window rows: "
                    f"1: {share} (0 moves in 512 windows)") in lines


# pytest's output for tests/backends/cuda/FILE.py: test_bad fails with its reason far above the
# log's tail, test_good passes with an "E " line of its own output
FAKE_PYTEST_PYTHON = """#!/bin/bash
if [ "$1" = "-m" ] && [ "$2" = "pytest" ]; then
  if [[ "$*" == *test_bad.py* ]]; then
    echo "F"
    echo "E   AssertionError: the pool's logits 0.05 off"
    for i in $(seq 20); do echo "context line $i"; done
    echo "1 failed in 1.00s"
    exit 1
  fi
  echo "E   printed by a passing test"
  for i in $(seq 5); do echo "more output $i"; done
  echo "1 passed in 1.00s"
  exit 0
fi
exec "$REAL_PYTHON" "$@"
"""


def _run_with(tmp_path, fake_text, *args, **extra_env):
    """device_check.sh ARGS in tmp_path with `fake_text` as python3, whatever its exit code."""
    import sys

    bin_dir = _fake_bin(tmp_path, fake_text)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", OUT=str(tmp_path / "out"),
               REAL_PYTHON=sys.executable, **extra_env)
    return subprocess.run(["bash", str(ROOT / "tools" / "device_check.sh"), *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_a_failing_parts_reasons_reach_stdout(tmp_path):
    # the device tool brings back a call's stdout always but only some of its log files
    res = _run_with(tmp_path, FAKE_PYTEST_PYTHON, "tests", "test_bad", "test_good")
    bad, good = res.stdout.split("== test_good")
    assert "== test_bad: rc 1" in bad
    assert "E   AssertionError: the pool's logits 0.05 off" in bad
    assert "1 failed" in bad
    assert "rc 0" in good and "1 passed" in good and "printed by a passing test" not in good


# `python3 -m strata bench ...` for the llama part: a table row per test from the flags it got,
# its order in the call and whether it saw llama-bench's library path
FAKE_STRATA_PYTHON = """#!/bin/bash
if [ "$1" = "-m" ] && [ "$2" = "strata" ] && [ "$3" = "bench" ]; then
  echo "strata $* LD=${LD_LIBRARY_PATH:-}" >> "$ORDER"
  [[ " $* " == *" --expert-cache 0 "* ]] && base=5000 || base=200
  [[ " $* " == *" -p 512 "* ]] && echo "| m.gguf | cuda | 15 | pp512 | $base.5 ± 9.0 |"
  if [[ " $* " == *" -np 4 "* ]]; then echo "| m.gguf | cuda | 15 | tg128 x4 | 150.0 ± 1.0 |"
  else echo "| m.gguf | cuda | 15 | tg128 | $((base / 50)).0 ± 1.0 |"; fi
  exit 0
fi
exec "$REAL_PYTHON" "$@"
"""

# llama-batched-bench in the packed tool: its table, S_TG the 8th column
FAKE_LLAMA_BATCHED = """#!/bin/bash
echo "llama batched $* LD=$LD_LIBRARY_PATH" >> "$ORDER"
echo "| PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |"
echo "|  128 |  128 |  4 | 1024 | 0.300 | 1706.67 | 8.533 |  60.00 | 8.833 | 115.92 |"
"""

# llama-bench in the packed tool: llama.cpp's table rows, at half of Strata's figures
FAKE_LLAMA_BENCH = """#!/bin/bash
if [ "$1" = "--list-devices" ]; then echo "Available devices:"; exit 0; fi
echo "llama $* LD=$LD_LIBRARY_PATH" >> "$ORDER"
[[ " $* " == *" -ncmoe 48 "* ]] && base=2500 || base=100
[[ " $* " == *" -p 512 "* ]] && echo "| qwen3moe | 16 GiB | CUDA | 99 | pp512 | $base.25 ± 3.0 |"
echo "| qwen3moe | 16 GiB | CUDA | 99 | tg128 | $((base / 50)).0 ± 0.5 |"
"""


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_llama_runs_llama_bench_beside_strata_abba_and_gives_each_rows_ratio(tmp_path):
    import sys
    import tarfile

    pack = tmp_path / "pack"
    pack.mkdir()
    tarball = tmp_path / "llama-bench.tar.xz"
    with tarfile.open(tarball, "w:xz") as tar:
        for name, text in (("llama-bench", FAKE_LLAMA_BENCH),
                           ("llama-batched-bench", FAKE_LLAMA_BATCHED)):
            (pack / name).write_text(text)
            (pack / name).chmod(0o755)
            tar.add(pack / name, arcname=name)
    cublas = tmp_path / "cublas"
    cublas.mkdir()
    (cublas / "libcublasLt.so.13").write_bytes(b"")
    for name in ("q.gguf", "q1.gguf"):  # the synths exist, so none is written
        (tmp_path / name).write_bytes(b"")
    bin_dir = _fake_bin(tmp_path, FAKE_STRATA_PYTHON)
    order = tmp_path / "order"
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", OUT=str(tmp_path / "out"),
               REAL_PYTHON=sys.executable, ORDER=str(order), ROUNDS="2",
               CUBLAS_DIR=str(cublas), LLAMA_DIR=str(tmp_path / "unpacked"),
               SYNTH_MODEL=str(tmp_path / "q.gguf"), SYNTH_SKEW1=str(tmp_path / "q1.gguf"))
    env.pop("LD_LIBRARY_PATH", None)
    res = subprocess.run(["bash", str(ROOT / "tools" / "device_check.sh"), "llama",
                          str(tarball)], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    runs = order.read_text().splitlines()
    sides = [line.split()[0] for line in runs]
    # round 1 llama.cpp first, round 2 Strata first; each synth in the three settings, skew 1
    # first
    assert sides == ["llama", "strata"] * 6 + ["strata", "llama"] * 6
    assert all("q1.gguf" in line for line in runs[:6] + runs[12:18])
    assert all(" -lm none" in line and " -ngl 99 " in line for line in runs
               if line.startswith("llama"))
    batched = [line for line in runs if line.startswith("llama batched")]
    assert len(batched) == 4 and all(" -ncmoe 48 " in line and " -npl 4" in line
                                     for line in batched)
    # llama-bench alone gets its libraries' path: the unpacked tool and the cuBLAS folder
    for line in runs:
        ld = line.split("LD=")[1]
        if line.startswith("llama"):
            assert ld.split(":")[:2] == [str(tmp_path / "unpacked"), str(cublas)]
        else:
            assert ld == ""
    lines = [line for line in res.stdout.splitlines() if "strata / llama.cpp" in line]
    assert lines == [
        "q half tg128: strata 4.0, 4.0 (median 4.0); llama.cpp 2.0, 2.0 (median 2.0); "
        "strata / llama.cpp 2.00",
        "q ram pp512: strata 5000.5, 5000.5 (median 5000.5); llama.cpp 2500.2, 2500.2 "
        "(median 2500.2); strata / llama.cpp 2.00",
        "q ram tg128: strata 100.0, 100.0 (median 100.0); llama.cpp 50.0, 50.0 (median 50.0); "
        "strata / llama.cpp 2.00",
        "q x4 tg128 x4: strata 150.0, 150.0 (median 150.0); llama.cpp 60.0, 60.0 "
        "(median 60.0); strata / llama.cpp 2.50",
        "q1 half tg128: strata 4.0, 4.0 (median 4.0); llama.cpp 2.0, 2.0 (median 2.0); "
        "strata / llama.cpp 2.00",
        "q1 ram pp512: strata 5000.5, 5000.5 (median 5000.5); llama.cpp 2500.2, 2500.2 "
        "(median 2500.2); strata / llama.cpp 2.00",
        "q1 ram tg128: strata 100.0, 100.0 (median 100.0); llama.cpp 50.0, 50.0 (median 50.0); "
        "strata / llama.cpp 2.00",
        "q1 x4 tg128 x4: strata 150.0, 150.0 (median 150.0); llama.cpp 60.0, 60.0 "
        "(median 60.0); strata / llama.cpp 2.50",
    ]


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_llama_says_what_is_missing(tmp_path):
    script = str(ROOT / "tools" / "device_check.sh")
    env = dict(os.environ, OUT=str(tmp_path / "out"))
    res = subprocess.run(["bash", script, "llama", str(tmp_path / "none.tar.xz")], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "build it with tools/build_llama_bench.sh" in res.stderr
    import tarfile

    tarball = tmp_path / "t.tar.xz"
    with tarfile.open(tarball, "w:xz"):
        pass
    env["CUBLAS_DIR"] = str(tmp_path)  # holds no libcublasLt.so.13
    env["LLAMA_DIR"] = str(tmp_path / "unpacked")
    res = subprocess.run(["bash", script, "llama", str(tarball)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "no libcublasLt.so.13" in res.stderr


# `python3 -m pip install ...` and `python3 -m pytest ...` for the suite: what each got
FAKE_SUITE_PYTHON = """#!/bin/bash
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then
  echo "pip $*" >> "$CALLS"
  exit 0
fi
if [ "$1" = "-m" ] && [ "$2" = "pytest" ]; then
  echo "pytest $* PYTHONPATH=${PYTHONPATH:-}" >> "$CALLS"
  echo "FAILED tests/server/test_x.py::test_y - AssertionError: 200 == 400"
  echo "ERROR tests/server/test_z.py - ModuleNotFoundError: No module named 'anthropic'"
  echo "1 failed, 41 passed, 1 error in 3.00s"
  exit 1
fi
exec "$REAL_PYTHON" "$@"
"""


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_suite_installs_the_carried_wheels_and_prints_each_failure(tmp_path):
    wheels = tmp_path / ".device" / "xwheels"
    wheels.mkdir(parents=True)
    (wheels / "openai-1.0-py3-none-any.whl").write_bytes(b"")
    calls = tmp_path / "calls"
    res = _run_with(tmp_path, FAKE_SUITE_PYTHON, "suite", CALLS=str(calls))
    pip, pytest_call = calls.read_text().splitlines()
    assert "--target /tmp/xsite" in pip and ".device/xwheels/openai-1.0-py3-none-any.whl" in pip
    # the whole tests folder, on xdist without pytest-benchmark, the wheels importable
    assert " -p no:benchmark " in pytest_call and " -n " in pytest_call
    assert pytest_call.split(" PYTHONPATH=")[0].endswith(" tests")
    assert pytest_call.endswith("/tmp/xsite") and " PYTHONPATH=" in pytest_call
    assert "== suite: rc 1" in res.stdout and res.returncode == 1  # the script's status too
    assert "FAILED tests/server/test_x.py::test_y - AssertionError: 200 == 400" in res.stdout
    assert "ERROR tests/server/test_z.py - ModuleNotFoundError" in res.stdout
