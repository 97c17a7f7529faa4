"""--conversation-cache-dir through the engine: conversations written at a stop (and on
eviction from RAM) are restored by the next engine of the same model, which then generates
exactly what an engine reading the whole prompt does; other models' files are left alone."""
from __future__ import annotations

import logging
import threading

import pytest
from faulty_plugins import BadPickerPlugin

from strata.config import EngineConfig
from strata.engine.engine import Engine
from strata.engine.kv_file import SUFFIX
from strata.engine.sampling import SamplingParams
from strata.errors import ConfigError
from strata.plugins import get_plugin_manager

GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
A = list(range(10, 70))
B = list(range(200, 250))


@pytest.fixture(scope="module")
def other_model_path(tmp_path_factory):
    from strata.tool.synth import synth_model

    path = tmp_path_factory.mktemp("models") / "tiny-other.gguf"
    synth_model(path, shape="tiny", weight_type="f32", seed=4)
    return path


def engine(path, folder, **kw):
    return Engine(EngineConfig(path, n_ctx=256, threads=2, conversation_cache_dir=folder,
                               **kw))


def fresh(path, prompt):
    with Engine(EngineConfig(path, n_ctx=256, threads=2)) as e:
        return e.generate_text(prompt, GREEDY).token_ids


def two_conversations(path, folder, **kw):
    """A's and B's first turns; B's ends in the slot, A's is parked: both go to files at
    close. Returns each prompt's next turn."""
    with engine(path, folder, **kw) as e:
        a = e.generate_text(A, GREEDY).token_ids
        b = e.generate_text(B, GREEDY).token_ids
    return A + a + [5, 6, 7], B + b + [8, 9]


@pytest.mark.parametrize("which", ["tiny", "hybrid"])
def test_a_restarted_engine_restores_both_conversations(tiny_model_path, hybrid_path,
                                                        tmp_path, caplog, which):
    path = tiny_model_path if which == "tiny" else hybrid_path
    next_a, next_b = two_conversations(path, tmp_path)
    assert len(list(tmp_path.glob(f"*{SUFFIX}"))) == 2
    with caplog.at_level(logging.INFO, "strata.engine"), engine(path, tmp_path) as e:
        got_b = e.generate_text(next_b, GREEDY).token_ids
        cached_b = e.last_stats.num_cached_tokens
        got_a = e.generate_text(next_a, GREEDY).token_ids
        cached_a = e.last_stats.num_cached_tokens
    assert "2 conversations" in caplog.text and "read" in caplog.text
    # the whole of each parked conversation (a hybrid model: its end, the last token of the
    # reply's prompt... a reuse point below the new prompt's last token)
    assert cached_b >= len(B) and cached_a >= len(A)
    assert got_b == fresh(path, next_b)
    assert got_a == fresh(path, next_a)
    # each conversation's new file replaced the one it was restored from (a hybrid model's
    # slot keeps a checkpoint where it was restored, so its new file restores there too)
    assert len(list(tmp_path.glob(f"*{SUFFIX}"))) == 2


def test_eviction_from_ram_writes_while_serving(tiny_model_path, tmp_path):
    # a RAM budget for one parked conversation: the second park evicts the first to a file
    with engine(tiny_model_path, tmp_path, conversation_cache_mib=0.05) as e:
        for prompt in (A, B, [1, 2, 3] * 20):
            e.generate_text(prompt, GREEDY)
        disk = e.scheduler.conversations.disk
        disk.flush()
        assert disk.num_written >= 1
        e.generate_text(A + [4], GREEDY)
        assert e.last_stats.num_cached_tokens >= len(A) and disk.num_read == 1


def test_another_models_files_are_left_alone(tiny_model_path, other_model_path, tmp_path):
    next_a, _ = two_conversations(tiny_model_path, tmp_path)
    with engine(other_model_path, tmp_path) as e:
        got = e.generate_text(next_a, GREEDY).token_ids
        assert e.last_stats.num_cached_tokens == 0
        assert e.scheduler.conversations.disk.num_entries == 0
    assert got == fresh(other_model_path, next_a)
    # the other model's stop added its own file; the first model's two are untouched
    assert len(list(tmp_path.glob(f"*{SUFFIX}"))) == 3
    with engine(tiny_model_path, tmp_path) as e:
        assert e.scheduler.conversations.disk.num_entries == 2


def test_a_file_cut_short_after_the_start_is_read_again_from_the_prompt(tiny_model_path,
                                                                        tmp_path, caplog):
    next_a, next_b = two_conversations(tiny_model_path, tmp_path)
    with caplog.at_level(logging.WARNING, "strata.engine"), engine(tiny_model_path,
                                                                   tmp_path) as e:
        for path in tmp_path.glob(f"*{SUFFIX}"):
            path.write_bytes(path.read_bytes()[:5000])
        got = e.generate_text(next_a, GREEDY).token_ids
        assert e.last_stats.num_cached_tokens == 0
    assert "cannot restore" in caplog.text
    assert got == fresh(tiny_model_path, next_a)


def test_reset_deletes_the_files(tiny_model_path, tmp_path):
    two_conversations(tiny_model_path, tmp_path)
    with engine(tiny_model_path, tmp_path) as e:
        e.reset()
        assert list(tmp_path.glob(f"*{SUFFIX}")) == []
        e.generate_text(A + [1], GREEDY)
        assert e.last_stats.num_cached_tokens == 0


def test_auto_is_the_user_cache_folder(tiny_model_path, tmp_path, monkeypatch):
    monkeypatch.setenv("STRATA_CACHE_DIR", str(tmp_path))
    config = EngineConfig(tiny_model_path, conversation_cache_dir="auto")
    assert config.resolve_conversation_dir() == tmp_path / "conversations"


@pytest.mark.parametrize("kw, match", [
    (dict(conversation_cache_dir=""), "empty"),
    (dict(conversation_cache_dir="{file}"), "is a file"),
    (dict(conversation_cache_dir="{dir}", conversation_cache_mib=0), "--cache-ram 0"),
    (dict(conversation_cache_dir="{dir}", conversation_cache_disk_mib=0), "disk_mib"),
    (dict(conversation_cache_dir="{dir}", conversation_cache_disk_mib="64"), "disk_mib"),
])
def test_bad_options_are_config_errors(tiny_model_path, tmp_path, kw, match):
    (tmp_path / "f").write_text("x")
    kw = {k: v.format(file=tmp_path / "f", dir=tmp_path / "d") if isinstance(v, str) else v
          for k, v in kw.items()}
    with pytest.raises(ConfigError, match=match):
        EngineConfig(tiny_model_path, **kw)


def test_a_request_waits_for_its_file_while_the_others_run(tiny_model_path, tmp_path,
                                                           monkeypatch, caplog):
    from strata.engine import conversation_disk
    from strata.engine.scheduler import STATE_QUEUED

    next_a, _ = two_conversations(tiny_model_path, tmp_path)
    release = threading.Event()
    real = conversation_disk.read_kv_file

    def slow_read(*args, **kw):
        assert release.wait(30)
        return real(*args, **kw)

    monkeypatch.setattr(conversation_disk, "read_kv_file", slow_read)
    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    caplog.set_level(logging.INFO, "strata.engine")
    with engine(tiny_model_path, tmp_path, parallel=2) as e:
        waiting = e.submit(next_a, GREEDY)
        other = e.submit([7, 8, 9] * 10, long)  # behind it in the queue, placed at once
        assert waiting.state == STATE_QUEUED and other.state != STATE_QUEUED
        assert "waits for its conversation file" in caplog.text
        for _ in range(5):
            assert e.step()
        assert waiting.state == STATE_QUEUED and len(other.pop_events()) >= 5
        release.set()
        while not (waiting.is_finished and other.is_finished):
            assert e.step()
        got = [ev.token_id for ev in waiting.pop_events() if ev.token_id is not None]
        assert waiting.stats.num_cached_tokens >= len(A)
    assert got == fresh(tiny_model_path, next_a)


def test_generate_waits_for_the_file_when_nothing_else_runs(tiny_model_path, tmp_path):
    next_a, _ = two_conversations(tiny_model_path, tmp_path)
    with engine(tiny_model_path, tmp_path) as e:
        got = e.generate_text(next_a, GREEDY).token_ids
        assert e.last_stats.num_cached_tokens >= len(A)
    assert got == fresh(tiny_model_path, next_a)


def test_a_request_that_fails_once_its_file_is_read_ends_with_its_error(
        tiny_model_path, tmp_path, caplog):
    """Placed in a step after the wait for its file, not at submit: the error that stopped
    the placement is what the caller gets, and the log names it."""
    next_a, _ = two_conversations(tiny_model_path, tmp_path)
    pm = get_plugin_manager(autoload=False)
    pm.register(BadPickerPlugin())
    caplog.set_level(logging.INFO, logger="strata.engine")
    with Engine(EngineConfig(tiny_model_path, n_ctx=256, threads=2,
                             conversation_cache_dir=tmp_path), plugin_manager=pm) as e:
        with pytest.raises(ConfigError, match="slot picker 'bad' chose slot 1"):
            e.generate_text(next_a, GREEDY)
        assert e.num_running == 0
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("request 1 waits for its conversation file") for m in messages)
    assert any(m.startswith("request 1: not placed (ConfigError: slot picker 'bad'")
               for m in messages)
