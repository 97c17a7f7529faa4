"""tools/bench_pool_reuse.py: its routing repeats the asked share of each layer's experts and
takes the rest cold; a tiny run prints a row per share."""
import pathlib
import sys

import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tools"))
import bench_pool_reuse  # noqa: E402


@pytest.mark.parametrize("share", [0.0, 0.4, 0.8, 1.0])
def test_routing_repeats_the_share_and_takes_the_rest_cold(share):
    layers, experts, per, tokens = 3, 16, 5, 30
    seq = bench_pool_reuse.routing(share, layers, experts, per, tokens, seed=2)
    keep = round(share * per)
    last_use = np.full((layers, experts), -100)
    for t, token in enumerate(seq):
        for layer, ids in enumerate(token):
            chosen = ids[0][ids[0] >= 0]
            assert len(set(chosen.tolist())) == per and ids.shape == (1, 8)
            if t:
                before = set(seq[t - 1][layer][0][:per].tolist())
                assert len(before & set(chosen.tolist())) == keep
                fresh = [e for e in chosen if e not in before]
                # a fresh expert is one of the least recently used: none used in the last
                # (experts - per) // per - 1 tokens
                assert all(t - last_use[layer, e] > (experts - per) // per - 1 for e in fresh)
            last_use[layer, chosen] = t


def test_a_tiny_run_prints_a_row_per_share(capsys):
    assert bench_pool_reuse.main(["--layers", "2", "--experts", "4", "--per-layer", "2",
                                  "--shares", "0,1", "--tokens", "3", "--repeats", "1",
                                  "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "| 0 |" in out and "| 1 |" in out and "2 layers x 2 experts" in out
    with pytest.raises(SystemExit):
        bench_pool_reuse.main(["--per-layer", "9", "--experts", "10"])
