"""tools/bench_agents.py against a live server of one slot on a tiny synth model: each agent's
first turn reads its prompt, every later turn restores its parked conversation."""
import json
import pathlib
import sys

import pytest

from strata.config import EngineConfig
from strata.engine.engine import Engine
from strata.server.app import ServerConfig

from live_server import start_live_server

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tools"))
import bench_agents  # noqa: E402


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    from strata.tool.synth import synth_model

    path = tmp_path_factory.mktemp("models") / "tiny.gguf"
    synth_model(path, shape="tiny", weight_type="f32", seed=5)
    server = start_live_server(Engine(EngineConfig(path, n_ctx=1024, threads=1)),
                               ServerConfig(model_id="tiny"))
    yield server.url
    server.stop()


def test_switches_restore_the_parked_conversations(url, capsys):
    assert bench_agents.main(["--url", url, "--agents", "2", "--lines", "30", "--turns", "3",
                              "-n", "3", "--json"]) == 0
    cold, switch = json.loads(capsys.readouterr().out)
    rows = (cold["row"], cold["runs"], switch["row"], switch["runs"])
    assert rows == ("cold", 2, "switch", 4)
    assert cold["cached_tokens"] == 0 and cold["prompt_tokens"] > 200
    # everything but the added line comes from the agent's parked conversation
    assert cold["prompt_tokens"] - 1 <= switch["cached_tokens"] < switch["prompt_tokens"]


def test_table(url, capsys):
    assert bench_agents.main(["--url", url, "--agents", "1", "--lines", "5", "--turns", "2",
                              "-n", "2"]) == 0
    out = capsys.readouterr().out
    assert "| cold |" in out and "| switch |" in out


def test_a_shared_system_prompt_is_reused_by_each_new_agent(url, capsys):
    """--system-lines: every agent's prompt starts with the same sentences, so each agent's
    first turn after the first reuses them (the slot keeps them and parks the other's tail)."""
    assert bench_agents.main(["--url", url, "--agents", "3", "--lines", "4",
                              "--system-lines", "12", "--turns", "2", "-n", "2", "--json"]) == 0
    cold, switch = json.loads(capsys.readouterr().out)
    shared = len(bench_agents.agent_prompt(0, 0, 0, 12).split())  # words: fewer than tokens
    assert cold["cached_runs"][0] == 0
    assert all(shared <= n < cold["prompt_tokens"] for n in cold["cached_runs"][1:])
    assert all(n >= cold["prompt_tokens"] - 1 for n in switch["cached_runs"])
