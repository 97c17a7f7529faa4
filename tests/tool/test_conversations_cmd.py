"""`strata-tool conversations`: lists the conversation files of a folder, marks one model's,
and deletes them with --clear, leaving other files alone."""
import numpy as np
import pytest
from click.testing import CliRunner

from strata.engine.conversation_disk import model_fingerprint
from strata.engine.kv_file import write_kv_file
from strata.model.gguf_file import GGUFModel
from strata.tool.cli import main


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from strata.tool.synth import synth_model

    path = tmp_path_factory.mktemp("models") / "tiny.gguf"
    synth_model(path, shape="tiny", weight_type="f32", seed=2)
    return path


def run(*args):
    return CliRunner().invoke(main, ["conversations", *map(str, args)])


def test_list_mark_and_clear_one_models_files(tiny, tmp_path):
    with GGUFModel.open(tiny) as model:
        mine = model_fingerprint(model)
    cells = np.zeros((1, 1, 3, 4), np.float16)
    write_kv_file(tmp_path / "a.strata-kv", [1, 2, 3], (cells, cells, None), {"model": mine})
    write_kv_file(tmp_path / "b.strata-kv", [4, 5, 6], (cells, cells, None), {"model": "f00"})
    (tmp_path / "notes.txt").write_text("not a conversation")
    listed = run(tmp_path)
    assert listed.exit_code == 0, listed.output
    assert "a.strata-kv" in listed.output and "b.strata-kv" in listed.output
    assert "2 conversation files in" in listed.output
    assert "1 other files left alone" in listed.output
    marked = run(tmp_path, "--model", tiny)
    assert "this model" in marked.output and "another model" in marked.output
    cleared = run(tmp_path, "--model", tiny, "--clear")
    assert cleared.exit_code == 0 and "1 conversation files deleted" in cleared.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.strata-kv", "notes.txt"]
    assert "1 conversation files deleted" in run(tmp_path, "--clear").output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_auto_and_bad_folders(tmp_path, monkeypatch):
    monkeypatch.setenv("STRATA_CACHE_DIR", str(tmp_path))
    (tmp_path / "conversations").mkdir()
    assert "0 conversation files in" in run("auto").output
    missing = run(tmp_path / "none")
    assert missing.exit_code == 2 and "is not a folder" in missing.output
    bad_model = run(tmp_path, "--model", tmp_path / "none.gguf")
    assert bad_model.exit_code == 2 and "error" in bad_model.output
