"""--pcie-frac auto's tuner (backends/cuda/share_tuner.py) against windows whose time is a
function of the share: it finds the fastest share of each window class, leaves a flat one
alone, does not follow noise, and follows a host that changes."""
import numpy as np
import pytest

from strata.backends.cuda import share_tuner as st
from strata.backends.cuda.share_tuner import ShareTuner
from strata.errors import ConfigError


def run(tuner, seconds_at, windows, rows=1, rng=None):
    """`windows` windows of `rows` rows through the tuner; the shares they ran at."""
    shares = []
    for _ in range(windows):
        share = tuner.share(rows)
        t = seconds_at(share)
        if rng is not None:
            t *= 1.0 + rng.normal(0.0, 0.01)  # 1% noise per window
        tuner.record(rows, share, t)
        shares.append(share)
    return shares


def one_row_host(pool_ms_per_expert, gpu_ms_per_expert, serial_ms=2.5):
    """A one-row window's time at a share on a host: per layer the slower of the pool's and
    the GPU's experts (whole experts, as count_groups splits 8 misses of cost 17 each) plus the
    serial part."""
    def seconds_at(share):
        budget = int(np.floor((1.0 - share) * 8 * 17 + 0.5))
        pool = min(8, budget // 17)
        return (max(pool * pool_ms_per_expert, (8 - pool) * gpu_ms_per_expert)
                + serial_ms) / 1e3
    return seconds_at


def test_it_moves_to_the_fastest_split_and_stays():
    # a host whose pool is slow: 4 experts each side beats the default's 5 / 3
    host = one_row_host(pool_ms_per_expert=2.2, gpu_ms_per_expert=2.0)
    tuner = ShareTuner(0.3)
    shares = run(tuner, host, 600, rng=np.random.default_rng(0))
    # 4 of 8 to each side (shares 0.375-0.5) is the fastest split there
    settled = tuner.shares()[1]
    assert 0.375 < settled <= 0.5 and host(settled) == host_best(host)
    # after the move it tries around the new share, then settles there: of the last 400
    # windows, only two rounds' tries (64 and 128 windows after the round that kept it) differ
    assert sum(share != settled for share in shares[-400:]) <= 2 * 4 * st.PROBE
    # other classes were never timed: still at the start, and not in the summary
    assert tuner.share(4) == 0.3 and tuner.share(16) == 0.3 and tuner.share(17) is None
    assert tuner.summary() == [("1", settled, tuner._classes[1].moves, 600)]
    assert tuner._classes[1].moves >= 1


def test_steps_are_an_expert_of_a_row():
    assert ShareTuner(0.3).steps == (0.125, -0.125, 0.0625, -0.0625)
    assert ShareTuner(0.3, experts_per_row=10).steps == (0.1, -0.1, 0.05, -0.05)


def test_it_climbs_more_than_one_step():
    host = one_row_host(pool_ms_per_expert=3.0, gpu_ms_per_expert=1.0)  # GPU much faster
    tuner = ShareTuner(0.2)
    run(tuner, host, 400)
    # 0.2 gives the pool 6 of 8; the fastest is 2 (0.7): reached in steps of an expert
    assert host(tuner.shares()[1]) == host_best(host)
    assert tuner.shares()[1] > 0.6


def test_a_flat_host_and_noise_leave_the_share_alone():
    tuner = ShareTuner(0.3)
    rng = np.random.default_rng(1)
    run(tuner, lambda share: 0.012, 2000, rng=rng)  # every share as fast, 1% noise
    assert tuner.shares()[1] == 0.3
    # shares that give the same split (0.3 and 0.35: 5 of 8 to the pool) are not a move
    host = one_row_host(pool_ms_per_expert=1.9, gpu_ms_per_expert=2.6)
    tuner = ShareTuner(0.3)
    run(tuner, host, 2000, rng=rng)
    assert host(tuner.shares()[1]) == host(0.3)


def test_it_follows_a_host_that_changes():
    fast_pool = one_row_host(pool_ms_per_expert=1.5, gpu_ms_per_expert=2.5)
    busy_pool = one_row_host(pool_ms_per_expert=3.0, gpu_ms_per_expert=2.5)  # CPU taken
    tuner = ShareTuner(0.3)
    run(tuner, fast_pool, 600)
    assert fast_pool(tuner.shares()[1]) == host_best(fast_pool)
    run(tuner, busy_pool, 3000)
    assert busy_pool(tuner.shares()[1]) == host_best(busy_pool)
    assert tuner.shares()[1] > 0.375  # the pool gave up an expert or more


def host_best(host):
    return min(host(s / 1000) for s in range(0, 901))


def test_classes_are_separate_and_late_figures_are_ignored():
    tuner = ShareTuner(0.3)
    assert [tuner.class_of(r) for r in (1, 2, 3, 4, 5, 8, 9, 16, 17)] == \
        [1, 2, 4, 4, 8, 8, 16, 16, None]
    host = one_row_host(pool_ms_per_expert=2.2, gpu_ms_per_expert=2.0)
    run(tuner, host, 600, rows=3)  # windows of 3 rows: class 4
    assert host(tuner.shares()[4]) == host_best(host) and tuner.shares()[1] == 0.3
    # a window planned at another share (before a change) is not counted; nor a bad time
    before = tuner.shares()[4]
    while tuner.share(4) != before:  # finish a round of tries
        tuner.record(4, tuner.share(4), host(tuner.share(4)))
    for _ in range(3 * st.EVERY):
        tuner.record(4, 0.9, 0.001)  # would look fast, but it is not the share in force
        tuner.record(4, before, 0.0)
        tuner.record(4, before, float("nan"))
    assert tuner.shares()[4] == before
    tuner.record(17, 0.3, 0.01)  # beyond the classes: nothing


def test_tries_stay_within_the_shares_the_pool_can_take():
    tuner = ShareTuner(0.0)
    host = one_row_host(pool_ms_per_expert=9.0, gpu_ms_per_expert=0.1)  # push toward 1
    shares = run(tuner, host, 3000)
    assert max(shares) <= st.HIGHEST and min(shares) >= st.LOWEST
    assert tuner.shares()[1] > st.HIGHEST - 0.125  # as far as the tries may go


def split_host(pool_ms_per_expert, gpu_ms_per_expert, serial_ms=2.5):
    """A one-row window's time on a host where the expert a layer's budget ends in is split by
    columns (count_groups: the pool's part in 24ths of an expert, Q4_0 768 columns)."""
    def seconds_at(share):
        pool = np.floor((1.0 - share) * 8 * 24 + 0.5) / 24  # experts, in whole 24ths
        return (max(pool * pool_ms_per_expert, (8 - pool) * gpu_ms_per_expert)
                + serial_ms) / 1e3
    return seconds_at


def test_with_the_split_expert_it_settles_inside_an_expert():
    # balance at 3.81 of 8 experts to the pool (share 0.524): half-expert steps get it within
    # half an expert of that, between two whole splits
    host = split_host(pool_ms_per_expert=2.2, gpu_ms_per_expert=2.0)
    tuner = ShareTuner(0.3)
    run(tuner, host, 1500, rng=np.random.default_rng(3))
    settled = tuner.shares()[1]
    assert abs(settled - 0.524) <= 0.0625 + 1e-9
    assert round(settled * 8, 6) % 1 != 0  # between two whole splits
    assert host(settled) <= 1.05 * host(0.5238)  # within the tuner's margin of the best


def test_the_one_row_class_may_start_elsewhere():
    tuner = ShareTuner(0.3, one_row_start=0.375)
    assert tuner.share(1) == 0.375 and tuner.share(2) == 0.3 and tuner.share(16) == 0.3


def test_its_timing_can_be_set_from_the_environment(monkeypatch):
    host = one_row_host(pool_ms_per_expert=2.2, gpu_ms_per_expert=2.0)
    monkeypatch.setenv(st.ENV_TUNER, "warmup=64,every=128")
    late = ShareTuner(0.3)
    assert (late.warmup, late.every, late.probe, late.margin) == (64, 128, st.PROBE, st.MARGIN)
    # nothing is tried before the 64th window; the default tries from the 16th
    assert set(run(late, host, 64)) == {0.3}
    monkeypatch.delenv(st.ENV_TUNER)
    assert len(set(run(ShareTuner(0.3), host, 64))) > 1


def test_a_bad_timing_setting_is_named(monkeypatch):
    for text in ("warmup", "warmup=0", "every=x", "speed=3", "margin=-1", "backoff=2",
                 "interleave=-1"):
        monkeypatch.setenv(st.ENV_TUNER, text)
        with pytest.raises(ConfigError, match="STRATA_SHARE_TUNER"):
            ShareTuner(0.3)


def drifting(host, slower=0.3, over=120):
    """`host` whose windows grow `slower` times slower over its first `over` windows (the
    CPU's clocks settling after the model loads), then stay so."""
    done = [0]

    def seconds_at(share):
        t = host(share) * (1.0 + slower * min(done[0], over) / over)
        done[0] += 1
        return t
    return seconds_at


def test_interleaved_rounds_see_through_a_drifting_host(monkeypatch):
    # the pool takes 6 of 8 (0.25) fastest, 6% ahead of the 5 the one-row class starts with
    host = one_row_host(pool_ms_per_expert=1.2, gpu_ms_per_expert=2.6)
    assert host(0.25) < 0.95 * host(0.375) and host(0.25) == host_best(host)

    def settled(seed):
        tuner = ShareTuner(0.3, one_row_start=0.375)
        run(tuner, drifting(host), 500, rng=np.random.default_rng(seed))
        return tuner.shares()[1]

    # one neighbour after another, each later try looks slower by the drift alone: with a
    # round every 512 windows (the default) the first round's reading stays all run
    assert sum(settled(seed) == 0.375 for seed in range(6)) >= 3
    # backoff=1: the next round 64 windows on, then 128, ... sees the settled host
    monkeypatch.setenv(st.ENV_TUNER, "backoff=1")
    assert [settled(seed) for seed in range(6)] == [0.25] * 6
    monkeypatch.setenv(st.ENV_TUNER, "interleave=1")
    assert [settled(seed) for seed in range(6)] == [0.25] * 6


def test_interleaved_rounds_alternate_and_count_late_figures(monkeypatch):
    monkeypatch.setenv(st.ENV_TUNER, "interleave=1,warmup=8,probe=2")
    tuner = ShareTuner(0.375)
    host = one_row_host(pool_ms_per_expert=1.2, gpu_ms_per_expert=2.6)
    run(tuner, host, 8)
    shares = [tuner.share(1)]
    tuner.record(1, shares[0], host(shares[0]))
    for _ in range(15):
        shares.append(tuner.share(1))
        tuner.record(1, shares[-1], host(shares[-1]))
    # share, neighbour, share, the next neighbour, ...: each neighbour twice, then the move
    assert shares[:8] == [0.375, 0.5, 0.375, 0.25, 0.375, 0.4375, 0.375, 0.3125]
    assert tuner.shares()[1] == 0.25 and tuner._classes[1].moves == 1
    # a window planned in the round whose figures come after the move is not counted
    tuner.record(1, 0.4375, 0.0001)
    assert tuner.shares()[1] == 0.25


def test_each_rounds_decision_is_logged(caplog):
    host = one_row_host(pool_ms_per_expert=1.2, gpu_ms_per_expert=2.6)  # 0.25 fastest
    with caplog.at_level("INFO", logger="strata.pool"):
        tuner = ShareTuner(0.25)
        run(tuner, host, st.WARMUP + 4 * st.PROBE)
    # kept, with what each neighbour gave
    assert [r.getMessage() for r in caplog.records] == [
        "PCIe share of 1-row windows stays 0.250 (9.70 ms a window; tried 0.125: 10.90, "
        "0.188: 9.70, 0.312: 10.30, 0.375: 10.30; the next round in 512 windows)"]


def round_starts(tuner, seconds_at, windows):
    """The windows at which the tuner's rounds of tries began."""
    shares = run(tuner, seconds_at, windows)
    return [i for i in range(1, windows) if shares[i] != shares[0] == shares[i - 1]]


def test_rounds_that_keep_the_share_come_further_apart(monkeypatch):
    flat = lambda share: 0.012  # noqa: E731 (every share as fast: each round keeps it)
    round_windows = 4 * st.PROBE  # four neighbours
    # the default: EVERY between all rounds
    starts = round_starts(ShareTuner(0.3), flat, 2500)
    assert starts[0] == st.WARMUP and len(starts) >= 4
    assert {b - a - round_windows for a, b in zip(starts, starts[1:])} == {st.EVERY}
    # backoff=1: 64, 128, 256 and then EVERY
    monkeypatch.setenv(st.ENV_TUNER, "backoff=1")
    starts = round_starts(ShareTuner(0.3), flat, 2500)
    gaps = [b - a - round_windows for a, b in zip(starts, starts[1:])]
    assert starts[0] == st.WARMUP
    assert gaps == [64, 128, 256, 512, 512, 512][:len(gaps)] and len(gaps) >= 5
    # every=N caps the gaps
    monkeypatch.setenv(st.ENV_TUNER, "backoff=1,every=100")
    starts = round_starts(ShareTuner(0.3), flat, 1000)
    assert [b - a - round_windows for a, b in zip(starts, starts[1:])][:4] == [64, 100, 100, 100]


def test_a_move_starts_the_gaps_again(monkeypatch):
    monkeypatch.setenv(st.ENV_TUNER, "backoff=1")
    host = one_row_host(pool_ms_per_expert=1.2, gpu_ms_per_expert=2.6)  # 0.25 fastest
    tuner = ShareTuner(0.3, one_row_start=0.375)
    run(tuner, host, 2000)
    c = tuner._classes[1]
    assert tuner.shares()[1] == 0.25 and c.moves == 1 and c.kept >= 4
    busy = one_row_host(pool_ms_per_expert=3.0, gpu_ms_per_expert=2.5)  # the CPU taken
    shares, moves = [], []
    for _ in range(2000):
        shares += run(tuner, busy, 1)
        moves.append(c.moves)
    assert c.moves > 1 and busy(tuner.shares()[1]) == host_best(busy)
    # after the last move: a round PROBE windows on, then (each keeping the share) 64, 128
    # and 256 windows after the one before
    settled, moved = tuner.shares()[1], moves.index(c.moves)
    after = shares[moved + 1:]
    starts = [i for i in range(1, len(after)) if after[i] != settled == after[i - 1]]
    assert starts[0] == st.PROBE
    assert [b - a - 4 * st.PROBE for a, b in zip(starts, starts[1:])][:3] == [64, 128, 256]
