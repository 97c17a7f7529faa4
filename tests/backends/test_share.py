"""The PCIe share: miss_where's table and pool share, the stored calibration, and --pcie-frac."""
import json

import numpy as np
import pytest
from click.testing import CliRunner

from strata.backends.cuda.share import (CALIBRATION_FILE, DEFAULT_PCIE_FRAC, DEFAULT_SOURCE,
                                        SLOW_POOL_PCIE_FRAC,
                                        load_calibration, miss_where, resolve_pcie_frac,
                                        share_from_rates, store_calibration,
                                        whole_expert_share)
from strata.config import EngineConfig
from strata.errors import ConfigError

V, P, C = 0, 1, 2  # VRAM, PCIe, CPU pool


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from strata.tool.synth import synth_model

    path = tmp_path_factory.mktemp("share") / "tiny.gguf"
    synth_model(path, shape="tiny", weight_type="q8_0", seed=3)
    return str(path)


# ---- miss_where --------------------------------------------------------------------------------
def test_miss_where_gives_the_pool_every_miss_and_the_device_its_share():
    residency = np.array([[-1, 2, -1, -1, -1],
                          [4, 1, 2, 5, 6]])       # all resident
    where, pool_frac = miss_where(residency, 0.3)
    np.testing.assert_array_equal(where, [[C, V, C, C, C], [V, V, V, V, V]])
    assert where.dtype == np.uint8 and pool_frac == pytest.approx(0.7)
    # share 0: every miss the pool's, all of each layer's (no share on the device)
    where, pool_frac = miss_where(residency, 0.0)
    np.testing.assert_array_equal(where[0], [C, V, C, C, C])
    assert pool_frac == -1.0
    # share 1: every miss read over PCIe, no pool
    where, pool_frac = miss_where(residency, 1.0)
    np.testing.assert_array_equal(where[0], [P, V, P, P, P])
    assert pool_frac == -1.0


def test_miss_where_refuses_bad_tables():
    with pytest.raises(ConfigError, match=r"must be \[layers, experts\]"):
        miss_where(np.zeros(4), 0.5)
    with pytest.raises(ConfigError, match="pcie_frac is 1.5; give a fraction from 0"):
        miss_where(-np.ones((1, 2)), 1.5)


def test_expected_reads_counts_an_expert_once_per_window():
    from strata.backends.cuda.share import expected_reads

    m = np.array([[0.0, 0.25, 1.0, 2.0, 6.0]])        # expected routed rows per window
    # one row: the chance is the expected rows themselves, capped at 1
    np.testing.assert_allclose(expected_reads(m, 1), [[0.0, 0.25, 1.0, 1.0, 1.0]])
    # four rows: 1 - (1 - m / 4) ** 4; an expert expected in every row is read once
    np.testing.assert_allclose(expected_reads(m, 4),
                               [[0.0, 1 - 0.9375 ** 4, 1 - 0.75 ** 4, 0.9375, 1.0]])
    # a window of no rows counts as one
    np.testing.assert_allclose(expected_reads(m, 0), expected_reads(m, 1))


# ---- the stored calibration --------------------------------------------------------------------
def test_calibration_store_load_round_trip(tiny, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("STRATA_CACHE_DIR", str(tmp_path / "cache"))
    assert load_calibration(tiny, "GPU A", 8) is None
    path = store_calibration(tiny, "GPU A", 8, 0.75, {"cpu_experts_per_s": 100.0})
    store_calibration(tiny, "GPU A", 4, 0.5)
    assert path == tmp_path / "cache" / CALIBRATION_FILE
    entry = load_calibration(tiny, "GPU A", 8)
    assert entry["pcie_frac"] == 0.75 and entry["cpu_experts_per_s"] == 100.0
    assert entry["gpu"] == "GPU A" and entry["threads"] == 8
    assert load_calibration(tiny, "GPU A", 4)["pcie_frac"] == 0.5
    assert load_calibration(tiny, "GPU B", 8) is None            # keyed by GPU
    assert load_calibration(tiny, "GPU A", 16) is None           # and by threads
    with caplog.at_level("INFO", logger="strata.pool"):
        assert resolve_pcie_frac(None, tiny, "GPU A", 8)[0] == 0.75
        assert resolve_pcie_frac(0.2, tiny, "GPU A", 8) == (0.2, "--pcie-frac")
        frac, source = resolve_pcie_frac(None, tiny, "GPU B", 8)
    assert frac == DEFAULT_PCIE_FRAC == 0.3 and source.startswith(DEFAULT_SOURCE)
    assert f"strata-tool calibrate {tiny} --threads 8" in source
    assert "PCIe share of cache misses 0.75" in caplog.text
    # experts of a type the pool reads more slowly (IQ2_XXS = 16): a larger PCIe share to
    # start from, unless calibrated or asked for; still a default (one-row windows split
    # whole experts, the tuner moves it)
    frac, source = resolve_pcie_frac(None, tiny, "GPU B", 8, {12, 16})
    assert frac == SLOW_POOL_PCIE_FRAC == 0.6 and "IQ2_XXS" in source and "calibrate" in source
    assert source.startswith(DEFAULT_SOURCE)
    assert resolve_pcie_frac(None, tiny, "GPU A", 8, {16})[0] == 0.75
    assert resolve_pcie_frac(0.3, tiny, "GPU B", 8, {16})[0] == 0.3
    assert resolve_pcie_frac(None, tiny, "GPU B", 8, {2, 12, 14})[0] == DEFAULT_PCIE_FRAC
    # a share stored by an earlier Strata under another split of the misses is ignored, and
    # the log says so
    entries = json.loads(path.read_text())
    for entry in entries.values():
        entry.pop("split")
    path.write_text(json.dumps(entries))
    assert load_calibration(tiny, "GPU A", 8) is None
    frac, source = resolve_pcie_frac(None, tiny, "GPU A", 8)
    assert frac == DEFAULT_PCIE_FRAC and "earlier split of the misses and is ignored" in source
    assert "no calibration" in resolve_pcie_frac(None, tiny, "GPU B", 8)[1]
    # an unreadable file counts as no calibration, and the next store rewrites it
    path.write_text("{not json")
    assert load_calibration(tiny, "GPU A", 8) is None
    store_calibration(tiny, "GPU A", 8, 0.25)
    assert len(json.loads(path.read_text())) == 1
    assert load_calibration(tiny, "GPU A", 8)["pcie_frac"] == 0.25


def test_share_from_rates():
    assert share_from_rates(3000.0, 1000.0) == 0.75
    with pytest.raises(ConfigError, match="must be > 0"):
        share_from_rates(0.0, 10.0)


def test_calibrate_measures_the_cpu_pool(tiny, tmp_path, monkeypatch):
    from strata.backends.cuda.runtime import is_available
    from strata.experts.store import ExpertStore
    from strata.model.gguf_file import GGUFModel
    from strata.tool.calibrate import measure_cpu_pool
    from strata.tool.cli import main

    with GGUFModel.open(tiny) as model:
        store = ExpertStore.from_gguf(model)
        cpu = measure_cpu_pool(store, threads=1, seconds=0.05)
        assert cpu["cpu_experts_per_s"] > 0 and cpu["cpu_calls"] >= store.n_layers
        assert cpu["cpu_rows"] == 1
        # more rows than the experts can give distinct top-K sets: as many as they can
        wide = measure_cpu_pool(store, threads=1, seconds=0.01, rows=1000)
        assert wide["cpu_rows"] == model.spec.n_experts // model.spec.n_experts_used
        del store
    if is_available():
        return  # the GPU half runs in tests/backends/cuda/test_cuda_pool.py
    monkeypatch.setenv("STRATA_CACHE_DIR", str(tmp_path / "cache"))
    res = CliRunner().invoke(main, ["calibrate", tiny, "-t", "1", "--seconds", "0.05"])
    assert res.exit_code == 2
    assert res.stdout == ""                     # refused before timing the CPU pool
    assert "calibrate needs the GPU to measure its PCIe reach" in res.stderr
    assert "--device cpu" not in res.stderr     # calibrate has no such option
    assert not (tmp_path / "cache").exists()   # nothing stored from half a measurement


# ---- --pcie-frac -------------------------------------------------------------------------------
def test_pcie_frac_config_validation(tiny):
    assert EngineConfig(tiny, expert_cache=4, pcie_frac=0).pcie_frac == 0.0
    assert EngineConfig(tiny, expert_cache=4, pcie_frac=1, device="cuda").pcie_frac == 1.0
    assert EngineConfig(tiny).pcie_frac is None
    assert EngineConfig(tiny, expert_cache=4, pcie_frac="auto").pcie_frac == "auto"
    with pytest.raises(ConfigError, match="give it with --expert-cache auto|N"):
        EngineConfig(tiny, pcie_frac="auto")
    with pytest.raises(ConfigError, match=r"--pcie-frac is 'half'; .* or auto"):
        EngineConfig(tiny, expert_cache=4, pcie_frac="half")
    with pytest.raises(ConfigError, match="--pcie-frac is 1.5; give a fraction from 0"):
        EngineConfig(tiny, expert_cache=4, pcie_frac=1.5)
    with pytest.raises(ConfigError, match="--pcie-frac is True"):
        EngineConfig(tiny, expert_cache=4, pcie_frac=True)
    with pytest.raises(ConfigError, match="give it with --expert-cache auto|N"):
        EngineConfig(tiny, pcie_frac=0.5)
    with pytest.raises(ConfigError, match="and --device cuda"):
        EngineConfig(tiny, expert_cache=4, pcie_frac=0.5, device="cpu")


def test_pcie_frac_cli_option(tiny):
    from strata.cli import main

    for command in ("run", "bench", "serve"):
        assert "--pcie-frac" in CliRunner().invoke(main, [command, "--help"]).output
    for flags, message in ((["--pcie-frac", "2"], "'2': give a fraction from 0 to 1, or auto"),
                           (["--pcie-frac", "nan"], "'nan': give a fraction from 0 to 1"),
                           (["--pcie-frac", "some"], "'some': give a fraction from 0 to 1"),
                           (["--pcie-frac", "0.5"], "give it with --expert-cache"),
                           (["--pcie-frac", "AUTO"], "give it with --expert-cache"),
                           (["--pcie-frac", "0.5", "--expert-cache", "4", "--device", "cpu"],
                            "and --device cuda")):
        res = CliRunner().invoke(main, ["run", "--model", tiny, "-n", "1", "Hi"] + flags)
        assert res.exit_code == 2, res.output
        assert message in res.stderr and "Traceback" not in res.output


def test_prompt_sized_windows_read_every_miss_over_pcie():
    from strata.backends.cuda.share import POOL_MAX_ROWS, window_share

    assert window_share(0.3, 1) == window_share(0.3, POOL_MAX_ROWS) == 0.3
    assert window_share(0.3, POOL_MAX_ROWS + 1) == window_share(0.0, 512) == 1.0


def test_prompt_pool_budget_scales_with_the_copies_and_the_threads(monkeypatch):
    """The pool's budget per layer of a streamed prompt window: POOL_SHARE_OF_COPY of the copy
    engine's time for the window's copied experts a layer on average, in row units of the
    pool's time, the same in every layer (a layer with no copies of its own still moves its
    rare experts over the link); with STRATA_POOL_BUDGET_FLAT=0 each layer's own copies."""
    from strata.backends.cuda.share import (POOL_ROW_UNITS_PER_COPY_THREAD, POOL_SHARE_OF_COPY,
                                            prompt_pool_budget)

    monkeypatch.delenv("STRATA_POOL_BUDGET_FLAT", raising=False)
    copied = np.array([0, 10, 46, 128])
    flat = prompt_pool_budget(copied, 15)
    want = np.floor(POOL_SHARE_OF_COPY * copied.mean() * POOL_ROW_UNITS_PER_COPY_THREAD * 15)
    assert flat.dtype == np.int32 and flat.shape == (4,) and (flat == want).all()
    assert (prompt_pool_budget(copied, 30) >= 2 * flat - 1).all()  # twice the threads
    assert (prompt_pool_budget(copied, 0) == prompt_pool_budget(copied, 1)).all()
    assert (prompt_pool_budget(np.zeros(4, dtype=int), 15) == 0).all()
    assert prompt_pool_budget(np.zeros(0, dtype=int), 15).shape == (0,)
    monkeypatch.setenv("STRATA_POOL_BUDGET_FLAT", "0")
    budget = prompt_pool_budget(copied, 15)
    assert budget.dtype == np.int32 and budget[0] == 0
    assert (np.diff(budget) > 0).all()
    want = np.floor(POOL_SHARE_OF_COPY * 46 * POOL_ROW_UNITS_PER_COPY_THREAD * 15)
    assert budget[2] == want
    assert flat.sum() <= budget.sum() + 4  # the same total, spread evenly
    assert (prompt_pool_budget(copied, 30) >= 2 * budget - 1).all()


def test_an_unmeasured_share_keeps_whole_experts_in_one_row_windows():
    # count_groups before the split expert: of a row's K equal misses (cost 17 each) the pool
    # took the whole experts its rounded budget held; whole_expert_share gives that split
    assert whole_expert_share(0.3, 8) == 0.375     # the pool 5 of 8, as 0.3 gave
    assert whole_expert_share(0.35, 8) == 0.375
    assert whole_expert_share(0.25, 8) == 0.25     # 6 of 8: already whole
    assert whole_expert_share(0.3, 10) == pytest.approx(0.3)  # 7 of 10
    assert whole_expert_share(0.3, 6) == pytest.approx(1 / 3)  # 4 of 6
    assert whole_expert_share(0.0, 8) == 0.0 and whole_expert_share(1.0, 8) == 1.0
    with pytest.raises(ConfigError, match="pcie_frac"):
        whole_expert_share(1.5, 8)
