"""tools/bench_infill.py against a live server on a tiny synth model with FIM tokens: a cold
completion reads the files, each keystroke after it only the changed end."""
import json
import pathlib
import sys

import pytest

from strata.config import EngineConfig
from strata.engine.engine import Engine
from strata.server.app import ServerConfig

from live_server import start_live_server

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tools"))
import bench_infill  # noqa: E402


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    from strata.tool.synth import synth_model

    path = tmp_path_factory.mktemp("models") / "tiny-fim.gguf"
    synth_model(path, shape="tiny", weight_type="f32", seed=3, vocab=4160)
    server = start_live_server(Engine(EngineConfig(path, n_ctx=2048, threads=1)),
                               ServerConfig(model_id="tiny-fim"))
    yield server.url
    server.stop()


def test_keystrokes_read_only_what_changed(url, capsys):
    assert bench_infill.main(["--url", url, "--prefix-lines", "20", "--suffix-lines", "4",
                              "--extra-chunks", "2", "--chunk-lines", "8", "-n", "4", "-r", "3",
                              "--json"]) == 0
    cold, keys = json.loads(capsys.readouterr().out)
    assert (cold["row"], keys["row"], keys["runs"]) == ("cold", "keystroke", 3)
    assert cold["tokens"] == keys["tokens"] == 4 and not cold["truncated"]
    assert cold["read_tokens"] == cold["prompt_tokens"] > 600
    # the suffix (4 lines) and the middle token come after the cursor: read again each time
    assert 0 < keys["read_tokens"] < 150 and keys["prompt_tokens"] >= cold["prompt_tokens"]


def test_table(url, capsys):
    assert bench_infill.main(["--url", url, "--prefix-lines", "4", "--suffix-lines", "1",
                              "--extra-chunks", "0", "-n", "2", "-r", "1"]) == 0
    out = capsys.readouterr().out
    assert "| cold |" in out and "| keystroke |" in out
