"""A machine with a driver and a GPU that CUDA_VISIBLE_DEVICES hides (cuInit: "no CUDA-capable
device is detected"): `--device cuda` says so and names the variable and `--device cpu`,
rather than ending in PyCUDA's RuntimeError; `--device auto` runs on the CPU."""
import os
import subprocess
import sys

import pytest

from strata.tool.synth import synth_model

pytestmark = pytest.mark.cuda


def _bench(model, device: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, "-m", "strata", "bench", "-m", str(model), "--device",
                           device, "-p", "8", "-n", "2", "-r", "1"],
                          capture_output=True, text=True, timeout=300, env=env)


def test_a_hidden_gpu_is_named_and_auto_takes_the_cpu(tmp_path):
    model = tmp_path / "tiny.gguf"
    synth_model(model, shape="tiny", weight_type="f32")
    cuda = _bench(model, "cuda")
    assert cuda.returncode == 2, cuda.stderr
    assert "no CUDA-capable device" in cuda.stderr
    assert "CUDA_VISIBLE_DEVICES=''" in cuda.stderr and "--device cpu" in cuda.stderr
    assert "Traceback" not in cuda.stderr
    auto = _bench(model, "auto")
    assert auto.returncode == 0, auto.stderr
    rows = [line for line in auto.stdout.splitlines() if "tiny.gguf" in line]
    assert len(rows) == 2 and all("| cpu " in row for row in rows), auto.stdout
