"""--expert-profile auto: the engine stores the routing it saw in the user cache folder at close
(counts of earlier runs halved), and the next start fills the cache from that profile; a
damaged stored profile is skipped with a warning and replaced; auto needs an expert cache."""
from __future__ import annotations

import logging

import numpy as np
import pytest

from strata import Engine, EngineConfig, SamplingParams
from strata.errors import ConfigError
from strata.experts.profile import (STORED_KEEP, read_profile, save_stored_profile,
                                    stored_profile_path)

pytestmark = pytest.mark.usefixtures("one_kernel_thread")
GREEDY = dict(temperature=0.0, ignore_eos=True)
NUM_SLOTS = 4


@pytest.fixture
def cache_folder(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv("STRATA_CACHE_DIR", str(folder))
    return folder


def serve_some(engine: Engine, seed: int) -> None:
    rng = np.random.default_rng(seed)
    handles = [engine.submit([int(t) for t in rng.integers(10, 4000, n)],
                             SamplingParams(max_tokens=6, **GREEDY)) for n in (9, 23)]
    while not all(h.is_finished for h in handles):
        assert engine.step()
    assert all(h.error is None for h in handles)


def new_engine(path) -> Engine:
    return Engine(EngineConfig(path, n_ctx=256, threads=1, parallel=2, prompt_chunk_tokens=8,
                               expert_cache=NUM_SLOTS, expert_profile_path="auto"))


def test_stored_at_close_and_filled_from_at_the_next_start(tiny_model_path, cache_folder,
                                                           caplog):
    stored = stored_profile_path(tiny_model_path)
    assert stored.parent.parent == cache_folder and not stored.exists()
    with caplog.at_level(logging.INFO, logger="strata.tier"):
        with new_engine(tiny_model_path) as engine:
            assert engine.config.expert_profile_save == stored
            assert engine.config.expert_profile_path is None  # nothing stored yet
            serve_some(engine, 1)
            recorder = engine.expert_tier.profile_recorder
            first_rows, first_accesses = recorder.rows.copy(), recorder.accesses.copy()
            totals = engine.expert_tier.snapshot_totals()
    assert "no stored routing profile for this model yet" in caplog.text
    assert f"routing profile stored in {stored}" in caplog.text
    profile = read_profile(stored)
    assert np.array_equal(profile.rows_by_expert(), first_rows)
    assert np.array_equal(profile.accesses_by_expert(), first_accesses)
    assert int(first_rows.sum()) == totals.num_hits + totals.num_misses > 0

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="strata.tier"):
        with new_engine(tiny_model_path) as engine:
            assert engine.config.expert_profile_path == stored
            table = engine.expert_tier.arena.table.peek().table
            resident = {(int(layer), int(e)) for layer, e in zip(*np.nonzero(table >= 0))}
            assert resident == set(profile.top(NUM_SLOTS))  # the hottest, as stored
            serve_some(engine, 2)
            second_rows = engine.expert_tier.profile_recorder.rows.copy()
    assert f"from profile {stored}" in caplog.text
    again = read_profile(stored)  # this run's counts plus half the earlier ones
    assert np.array_equal(again.rows_by_expert(),
                          second_rows + np.floor(first_rows * STORED_KEEP).astype(np.int64))


def test_a_damaged_stored_profile_is_skipped_and_replaced(tiny_model_path, cache_folder,
                                                          caplog):
    stored = stored_profile_path(tiny_model_path)
    stored.parent.mkdir(parents=True)
    stored.write_text("# strata routing profile v1 n_layers=2 n_experts=8\n0 0 0 1\n")
    with caplog.at_level(logging.INFO, logger="strata.tier"):
        with new_engine(tiny_model_path) as engine:
            assert "the stored routing profile is not usable" in caplog.text
            assert "filled %d from layer order" % NUM_SLOTS in caplog.text
            serve_some(engine, 3)
    assert read_profile(stored).rows_by_expert().sum() > 0  # a good one in its place


def test_a_given_damaged_profile_still_fails_the_start(tiny_model_path, tmp_path):
    bad = tmp_path / "bad.profile"
    bad.write_text("not a profile\n")
    with pytest.raises(Exception, match="not a Strata routing profile"):
        Engine(EngineConfig(tiny_model_path, expert_cache=NUM_SLOTS, expert_profile_path=bad))


def test_auto_needs_an_expert_cache(tiny_model_path, cache_folder):
    with pytest.raises(ConfigError, match="--expert-cache"):
        EngineConfig(tiny_model_path, expert_profile_path="auto")


def test_stored_counts_fold_earlier_runs_at_half_weight(tmp_path):
    path = tmp_path / "p" / "m.profile"
    accesses = np.array([[3, 0, 1], [0, 2, 2]])
    rows = np.array([[9, 0, 1], [0, 5, 4]])
    save_stored_profile(path, accesses, rows)
    save_stored_profile(path, accesses, rows)
    profile = read_profile(path)
    assert np.array_equal(profile.accesses_by_expert(), accesses + accesses // 2)
    assert np.array_equal(profile.rows_by_expert(), rows + rows // 2)
    assert profile.top(3) == [(0, 0), (1, 1), (1, 2)]  # 4 accesses; 3 with 7 rows, 3 with 6
    # a profile of another shape (the model changed under the same name) is replaced
    save_stored_profile(path, np.ones((1, 3), np.int64), np.ones((1, 3), np.int64))
    assert read_profile(path).rows_by_expert().tolist() == [[1, 1, 1]]


def test_a_cache_folder_that_cannot_be_written_costs_a_warning(tiny_model_path, tmp_path,
                                                               monkeypatch, caplog):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the cache folder should be")
    monkeypatch.setenv("STRATA_CACHE_DIR", str(blocker))
    with caplog.at_level(logging.WARNING, logger="strata.tier"):
        with new_engine(tiny_model_path) as engine:
            serve_some(engine, 4)
    assert "routing profile not stored" in caplog.text
    assert blocker.read_text().startswith("a file")
