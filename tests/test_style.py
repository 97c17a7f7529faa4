"""The source tree passes flake8 with setup.cfg's settings (max line 100), so style slips are
caught where they are made, not collected for a later clean-up."""
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_flake8_finds_nothing():
    done = subprocess.run([sys.executable, "-m", "flake8", "src", "tests", "tools", "plugins"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
