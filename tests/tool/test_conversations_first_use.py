"""`strata-tool conversations` on a machine where no server has written conversation files:
the cache folder does not exist yet, which is nothing to list, not an error."""
from click.testing import CliRunner

from strata.tool.cli import main


def test_auto_before_any_server_wrote_there(tmp_path, monkeypatch):
    monkeypatch.setenv("STRATA_CACHE_DIR", str(tmp_path / "fresh"))
    listed = CliRunner().invoke(main, ["conversations"])
    assert listed.exit_code == 0, listed.output
    assert "0 conversation files in" in listed.output
    assert "--conversation-cache-dir auto" in listed.output  # what writes them there
    assert not (tmp_path / "fresh").exists()  # listing creates nothing


def test_a_missing_folder_named_by_the_user_is_an_error_saying_which(tmp_path):
    missing = CliRunner().invoke(main, ["conversations", str(tmp_path / "none")])
    assert missing.exit_code == 2
    assert f"{str(tmp_path / 'none')!r} is not a folder" in missing.output
    assert "--conversation-cache-dir" in missing.output
