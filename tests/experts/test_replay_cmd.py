"""`strata-tool replay`'s options: `--slots P%` rounds to the nearest count (halves up, in
decimal), and `--adapt-min-gain` takes what the engine's option takes (a finite number >= 0)."""
import pytest
from click.testing import CliRunner
from routing_helpers import make_trace

from strata.experts.trace import write_trace
from strata.tool.replay_cmd import parse_slots, replay


@pytest.mark.parametrize("text, total, want", [
    ("29%", 50, 15),  # 14.5: 0.29 * 50 is 14.499999999999998 in binary floating point
    ("12.5%", 4, 1),  # 0.5: a half goes up (round() took it to the even 0: no cache)
    ("12.5%", 12, 2),  # 1.5
    ("62.5%", 4, 3),  # 2.5 (round(): 2)
    ("10%", 96, 10),  # 9.6
    ("0%", 16, 0), ("100%", 16, 16), ("1e-9%", 16, 0), (" 50 %", 16, 8),
])
def test_a_share_of_the_experts_rounds_to_the_nearest_count_halves_up(text, total, want):
    assert parse_slots(text, total) == want


@pytest.fixture
def trace_path(tmp_path):
    path = tmp_path / "t.trace"
    write_trace(path, make_trace(1, 4, [[[0, 1]], [[0, 2]], [[0, 1]], [[3]]] * 3))
    return str(path)


@pytest.mark.parametrize("gain", ["nan", "inf", "-inf", "-1", "-0.5"])
def test_a_min_gain_the_engine_refuses_is_refused(trace_path, gain):
    # NaN made every comparison false: no free fill ever cleared it, and a swap whose gain is
    # worse than nothing was never stopped: a 0% hit rate printed as the policy's
    result = CliRunner().invoke(replay, [trace_path, "--slots", "2", "--adapt-min-gain", gain])
    assert result.exit_code == 2, result.output
    assert "--adapt-min-gain" in result.output and "finite number >= 0" in result.output
    assert "windows" not in result.output and "Traceback" not in result.output


def test_a_min_gain_of_zero_replays(trace_path):
    result = CliRunner().invoke(replay, [trace_path, "--slots", "2", "--adapt-every", "1",
                                         "--adapt-min-gain", "0"])
    assert result.exit_code == 0, result.output
    policy_line = result.output.splitlines()[2].split()
    assert policy_line[:2] == ["2", "decayed-count"] and policy_line[2] != "0.0%"
