"""tools/device_check.sh pair: the A/B of two settings of `strata bench`, alternating. Run here
with a stand-in for `python3 tools/bench_logged.py -- ...` (`strata bench` with the tier's log;
the GPU machine runs the real one): each side's NAME=VALUE words reach the environment and its
other words the bench's flags, and the summary gives each row's runs, medians and B/A."""
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# prints a table row whose tokens/s come from the environment (BOOST) and the flags it got
FAKE_PYTHON = """#!/bin/bash
if [[ "$1" == */tools/bench_logged.py ]] && [ "$2" = "--" ]; then
  echo "args: $*" >&2
  [[ " $* " == *" --pcie-frac auto "* ]] && flag=1 || flag=0
  round=$(cat "$COUNTER" 2>/dev/null || echo 0); echo $((round + 1)) > "$COUNTER"
  echo "| m.gguf | cuda | pp512 | $((4000 + ${BOOST:-0} + round)).5 ± 9.0 |"
  echo "| m.gguf | cuda | tg64 x4 | $((100 + 10 * flag)).0 ± 1.0 |"
  exit 0
fi
exec "$REAL_PYTHON" "$@"
"""


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_pair_alternates_the_two_sides_and_summarises_each_row(tmp_path):
    import sys

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "python3"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"")
    out = tmp_path / "out"
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", OUT=str(out),
               PAIR_MODEL=str(model), ROUNDS="3", REAL_PYTHON=sys.executable,
               COUNTER=str(tmp_path / "count"))
    res = subprocess.run(["bash", str(ROOT / "tools" / "device_check.sh"), "pair", "",
                          "BOOST=300 --pcie-frac auto", "-p", "512", "-n", "0"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    logs = sorted(p.name for p in out.glob("pair_*.log"))
    assert logs == [f"pair_{side}_{r}.log" for side in (0, 1) for r in (1, 2, 3)]
    a_args = (out / "pair_0_1.log").read_text()
    b_args = (out / "pair_1_1.log").read_text()
    assert "--expert-cache 0 -p 512 -n 0" in a_args and "--pcie-frac" not in a_args
    assert b_args.rstrip().count("--pcie-frac auto") == 1
    # alternating: A got calls 0, 2, 4 and B 1, 3, 5 (the counter), B + 300 from its env
    assert ("pp512: A (as is) 4000.5, 4002.5, 4004.5 median 4002.5; "
            "B (BOOST=300 --pcie-frac auto) 4301.5, 4303.5, 4305.5 median 4303.5; "
            "B/A 1.075, B won 3 of 3") in res.stdout
    assert "tg64 x4: A (as is) 100.0, 100.0, 100.0 median 100.0" in res.stdout
    assert "B/A 1.100, B won 3 of 3" in res.stdout
