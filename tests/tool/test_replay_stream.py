"""tools/replay_stream.py: a routing trace replayed through the prompt streamer's choice of
what to copy, with and without the share of windows that routed to each expert."""
import pathlib
import sys

import numpy as np
import pytest

from strata.experts.trace import TraceWriter

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tools"))
import replay_stream  # noqa: E402


def bursty_trace(path, windows=12, rows=512, top_k=8):
    """2 layers x 32 experts: experts 0-7 in every window, one of 8-15 in each window (a
    burst of every row), 16-31 sharing the rest."""
    L, E = 2, 32
    with TraceWriter(path, L, E) as trace:
        for w in range(windows):
            counts = np.zeros((L, E), dtype=np.int64)  # [L, E] rows
            counts[:, :8] = 300
            counts[:, 8 + w % 8] = rows
            counts[:, 16:] = (rows * top_k - counts.sum(axis=1, keepdims=True)) // 16
            trace.record_counts(w, counts)
    return path


def test_the_share_of_windows_stops_copies_of_bursty_experts(tmp_path, capsys):
    path = str(bursty_trace(tmp_path / "bursty.trace"))
    counts_only = replay_stream.main([path, "--no-hits", "--warm", "8", "--guess-rows", "0"])
    with_hits = replay_stream.main([path, "--warm", "8", "--guess-rows", "0"])
    assert "per layer: 25.0 experts routed" in capsys.readouterr().out
    assert counts_only["routed"] == with_hits["routed"] == 25.0
    # the counts copy every bursty expert (their mean is ~64 rows a window), 7 of them unread
    assert counts_only["copied"] == 32.0 and counts_only["wasted"] == 7.0
    assert with_hits["copied"] == 24.0 and with_hits["wasted"] == 0.0
    # the routed burst is pulled into staging, once; with guessed copies it is guessed
    assert with_hits["pulled"] == 1.0 and with_hits["link"] == 25.0 < counts_only["link"]
    guessed = replay_stream.main([path, "--warm", "8", "--guess-rows", "16"])
    assert (guessed["guessed"], guessed["pulled"], guessed["link"]) == (1.0, 0.0, 25.0)
    # every layer copies the same 24 experts
    assert guessed["copies_spread"] == (24.0, 24.0, 24.0) and guessed["layers_uncopied"] == 0.0


def test_a_trace_shorter_than_the_warm_up_is_refused(tmp_path):
    path = str(bursty_trace(tmp_path / "short.trace", windows=2))
    with pytest.raises(SystemExit, match="none past --warm 3"):
        replay_stream.main([path])


def test_the_pools_budget_decides_who_reads_a_light_rare_expert(tmp_path):
    """A burst of 20 rows: the pool takes it within its budget, else pull_rare copies it (the
    default, every rare expert the GPU reads) or, past --pull-rows 32, the products read it
    over PCIe (one row tile); --pool-share 0 leaves the pool nothing."""
    L, E, K, R = 1, 32, 8, 512
    path = str(tmp_path / "light.trace")
    with TraceWriter(path, L, E) as trace:
        for w in range(12):
            counts = np.zeros((L, E), dtype=np.int64)
            counts[:, :8] = 300
            counts[:, 8 + w % 8] = 20
            counts[:, 16:] = (R * K - counts.sum(axis=1, keepdims=True)) // 16
            trace.record_counts(w, counts)
    no_guess = ["--guess-rows", "0"]
    none = replay_stream.main([path, "--warm", "8", "--pool-share", "0", *no_guess])
    read = replay_stream.main([path, "--warm", "8", "--pool-share", "0", "--pull-rows", "32",
                               *no_guess])
    kept = replay_stream.main([path, "--warm", "8", *no_guess])
    guessed = replay_stream.main([path, "--warm", "8", "--pool-share", "0", "--guess-rows", "16"])
    assert (guessed["guessed"], guessed["pulled"]) == (1.0, 0.0)  # 20 rows: a guessed copy
    assert none["pooled"] == 0.0 and (none["pulled"], none["read"]) == (1.0, 0.0)
    assert read["pooled"] == 0.0 and (read["pulled"], read["read"]) == (0.0, 1.0)
    assert kept["pooled"] == 1.0 and kept["read"] == 0.0 and kept["link"] == none["link"] - 1


def test_the_pools_budget_goes_to_the_fewest_rows_first():
    """Four routed rare experts of 30, 3, 20 and 1 rows, a budget of 12 row units (an expert
    costs POOL_EXPERT_ROWS + its rows): the pool takes the 1- and 3-row ones (3 + 5 units),
    not the 30-row one that comes first; the other two are pulled, or with a pull threshold
    of 32 rows read per tile (both at most 32)."""
    rows = np.zeros(8)
    rows[[1, 2, 4, 6]] = [30, 3, 20, 1]
    rare = np.ones(8, dtype=bool)
    assert replay_stream.split_rare(rows, rare, 12) == (2, 2, 0)
    assert replay_stream.split_rare(rows, rare, 12, 32) == (2, 0, 2)
    assert replay_stream.split_rare(rows, rare, 7, 32) == (1, 0, 3)  # the 1-row one only
    assert replay_stream.split_rare(rows, rare, 0, 25) == (0, 1, 3)  # the 30-row one pulled
    # guessed copies from 16 rows: of what the pool leaves, the 20- and 30-row ones
    assert replay_stream.split_rare(rows, rare, 12, None, 16) == (2, 2, 0, 0)
    assert replay_stream.split_rare(rows, rare, 0, 0, 16) == (0, 2, 2, 0)


def test_the_pools_modelled_time_interpolates_its_table_by_rows():
    """--pool-us: an expert's time at the table's rows is the table's, between them it is
    interpolated in log2(rows), beyond them held; a layer's time sums its experts'."""
    table = "1:10,4:30,16:70"
    assert replay_stream.pool_us([1], table) == 10.0 and replay_stream.pool_us([16], table) == 70
    assert replay_stream.pool_us([2], table) == 20.0  # halfway from 1 to 4 in log2
    assert replay_stream.pool_us([64], table) == 70.0 and replay_stream.pool_us([], table) == 0
    assert replay_stream.pool_us([1, 4, 4], table) == 70.0
    taken, left = replay_stream.pool_walk(np.array([0, 30, 3, 1, 20.0]), np.ones(5, bool), 12)
    assert (taken, left) == ([1.0, 3.0], [20.0, 30.0])  # the fewest rows first, within 12 units
