"""tools/bench_engine.py on the shipped default model: a row per sampling mode and slot count,
the engine's and the model's decode rates measured, and bad options refused."""
import json
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tools"))
import bench_engine  # noqa: E402


def test_rows_for_every_mode_and_slot_count(capsys):
    assert bench_engine.main(["-p", "8", "-n", "4", "-r", "1", "--slots", "1,2", "--json",
                              "-t", "1"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["sampling"], r["slots"]) for r in rows] == [
        (m, s) for s in (1, 2) for m in ("greedy", "top-k", "top-p")]
    for r in rows:
        assert r["engine"] > 0 and r["model"] > 0 and len(r["engine_runs"]) == 1


def test_table_and_bad_options(capsys):
    assert bench_engine.main(["-p", "4", "-n", "3", "-r", "1", "--slots", "1",
                              "--sampling", "greedy", "-t", "1"]) == 0
    out = capsys.readouterr().out
    assert "| greedy | 1 |" in out and "engine / model" in out
    with pytest.raises(SystemExit):
        bench_engine.main(["--sampling", "beam"])
    assert "unknown: beam" in capsys.readouterr().err


def test_json_mode(capsys):
    assert bench_engine.main(["-p", "4", "-n", "3", "-r", "1", "--slots", "1",
                              "--sampling", "json", "--json", "-t", "1"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["sampling"] for r in rows] == ["json"] and rows[0]["engine"] > 0
