"""tools/bench_api.py against a live server on the shipped default model: a row per API, every
request streamed to its -n tokens, and an API the server refuses stops the run with its error."""
import json
import pathlib
import sys

import pytest

from strata.config import EngineConfig
from strata.engine.engine import Engine
from strata.server.app import ServerConfig

from live_server import start_live_server

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tools"))
import bench_api  # noqa: E402


@pytest.fixture(scope="module")
def url():
    from strata.cli import resolve_model

    server = start_live_server(Engine(EngineConfig(resolve_model(None), n_ctx=256, threads=1)),
                               ServerConfig(model_id="default"))
    yield server.url
    server.stop()


def test_a_row_per_api(url, capsys):
    assert bench_api.main(["--url", url, "-n", "6", "-r", "2", "--json",
                           "--apis", "chat,messages,responses,completions"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["api"] for r in rows] == ["chat", "messages", "responses", "completions"]
    for r in rows:
        assert r["tokens"] == [6, 6] and r["decode"] > 0 and 0 < r["ttft_s"] < 30


def test_requests_at_once_give_their_aggregate(url, capsys):
    assert bench_api.main(["--url", url, "-n", "4", "-r", "1", "-c", "3", "--json",
                           "--apis", "responses"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["tokens"] == [12] and row["decode"] > 0


def test_table_and_a_refused_request(url, capsys):
    assert bench_api.main(["--url", url, "-n", "3", "-r", "1", "--apis", "messages"]) == 0
    assert "| messages |" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="HTTP 400"):
        bench_api.main(["--url", url, "-n", "0", "-r", "1", "--apis", "chat"])
