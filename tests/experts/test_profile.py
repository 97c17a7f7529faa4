"""Ranked routing profiles: exact ranking order, file round trip, damaged files."""
import numpy as np
import pytest
from routing_helpers import make_trace

from strata.errors import ModelFormatError
from strata.experts.profile import build_profile, read_profile, write_profile


def _trace():
    # layer 0: e1 in 3 windows (rows 3), e0 in 2 (rows 5), e2 in 2 (rows 2); layer 1: e2 in 3
    # windows (rows 3), e0 in 2 (rows 5); never routed: (0, 3), (1, 1), (1, 3).
    return make_trace(2, 4, [
        [{0: 4, 1: 1}, {2: 1, 0: 1}],
        [{1: 1, 2: 1}, {2: 1, 0: 4}],
        [{0: 1, 1: 1, 2: 1}, {2: 1}],
    ])


def test_ranking_order_is_accesses_then_rows_then_position():
    profile = build_profile(_trace())
    assert profile.ranking.tolist() == [[0, 1], [1, 2], [0, 0], [1, 0], [0, 2], [0, 3], [1, 1],
                                        [1, 3]]
    assert profile.accesses.tolist() == [3, 3, 2, 2, 2, 0, 0, 0]
    assert profile.rows.tolist() == [3, 3, 5, 5, 2, 0, 0, 0]
    assert profile.top(3) == [(0, 1), (1, 2), (0, 0)]


def test_profile_of_several_traces_merges_them():
    trace = _trace()
    twice = build_profile([trace, trace])
    assert twice.ranking.tolist() == build_profile(trace).ranking.tolist()
    assert twice.accesses.tolist() == [6, 6, 4, 4, 4, 0, 0, 0]


def test_file_round_trip(tmp_path):
    profile = build_profile(_trace())
    write_profile(tmp_path / "p.txt", profile)
    again = read_profile(tmp_path / "p.txt")
    assert (again.n_layers, again.n_experts) == (2, 4)
    for name in ("ranking", "accesses", "rows"):
        assert np.array_equal(getattr(again, name), getattr(profile, name))
    assert (tmp_path / "p.txt").read_text().splitlines()[2] == "0 0 1 3 3"


def test_damaged_profiles_are_refused(tmp_path):
    (tmp_path / "a.txt").write_text("hello\n")
    with pytest.raises(ModelFormatError, match="not a Strata routing profile"):
        read_profile(tmp_path / "a.txt")
    write_profile(tmp_path / "p.txt", build_profile(_trace()))
    lines = (tmp_path / "p.txt").read_text().splitlines()
    (tmp_path / "short.txt").write_text("\n".join(lines[:-1]) + "\n")
    with pytest.raises(ModelFormatError, match="expected 8 ranked rows"):
        read_profile(tmp_path / "short.txt")


@pytest.mark.parametrize("row, why", [("0 0 9 3 3", r"\(0, 9\) is out of range"),  # 4 experts
                                      ("0 7 1 3 3", r"\(7, 1\) is out of range"),  # 2 layers
                                      ("0 1 2 3 3", r"\(1, 2\) is ranked twice")])
def test_a_profile_ranking_experts_the_model_lacks_is_refused(tmp_path, row, why):
    # a hand-edited or damaged row would name a slot the expert cache cannot fill
    write_profile(tmp_path / "p.txt", build_profile(_trace()))
    lines = (tmp_path / "p.txt").read_text().splitlines()
    assert lines[2] == "0 0 1 3 3"
    lines[2] = row
    (tmp_path / "bad.txt").write_text("\n".join(lines) + "\n")
    with pytest.raises(ModelFormatError, match=f"bad.txt: .*{why}"):
        read_profile(tmp_path / "bad.txt")


def test_a_binary_file_is_not_a_profile(tmp_path):
    (tmp_path / "model.gguf").write_bytes(b"GGUF\x03\x00\x00\x00\xbd\xff" * 8)
    with pytest.raises(ModelFormatError, match="not a Strata routing profile"):
        read_profile(tmp_path / "model.gguf")


@pytest.mark.parametrize("sizes", ["n_layers=0 n_experts=0", "n_layers=-2 n_experts=-3"])
def test_a_profile_of_no_experts_is_refused(tmp_path, sizes):
    # 0 x 0 was read as an empty profile (with a loadtxt warning); -2 x -3 expects 6 rows
    path = tmp_path / "empty.profile"
    path.write_text(f"# strata routing profile v1 {sizes}\n# rank layer expert accesses rows\n")
    with pytest.raises(ModelFormatError, match="empty.profile: damaged routing profile"):
        read_profile(path)
