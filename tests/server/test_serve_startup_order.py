"""`strata serve` binds its port before the model loads: a busy port is reported without
loading the model (a large one takes minutes), and the address line comes before a load error."""
import socket
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from strata.tool.synth import synth_model

    path = tmp_path_factory.mktemp("startup") / "tiny.gguf"
    synth_model(path, shape="tiny", weight_type="f32", seed=3)
    return path


def serve(model: Path, port: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "strata", "serve", "--model", str(model),
                           "--port", str(port), "--device", "cpu", "--threads", "1"],
                          capture_output=True, text=True, timeout=120)


def test_a_busy_port_is_reported_before_the_model_loads(tiny):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        res = serve(tiny, port)
    assert res.returncode == 2, res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: cannot listen on 127.0.0.1:{port}"), res.stderr
    assert "strata.engine" not in res.stderr  # the engine never started loading


def test_the_address_line_comes_before_a_load_error(tiny, tmp_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny.read_bytes()[:3000])
    res = serve(cut, 0)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    serving = [i for i, line in enumerate(lines) if line.startswith("strata: serving cut.gguf")]
    failed = [i for i, line in enumerate(lines) if "loading the model failed" in line]
    assert len(serving) == 1 and len(failed) == 1, res.stderr
    assert serving[0] < failed[0], res.stderr
    assert lines[-1].startswith("error: the model failed to load") and "truncated" in lines[-1]
