"""The default read-interleave policy: exact decisions, and the half-rate guarantee."""
from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from strata.engine.interleave import HalfRateInterleave, PendingRead, ReadPlan, WindowTiming
from strata.errors import ConfigError
from strata.hookspecs import ReadInterleave


def make_reads(*specs) -> list[PendingRead]:
    """Each spec: (slot_index, num_tokens_left, num_tokens_read)."""
    return [PendingRead(*spec) for spec in specs]


def test_default_implements_the_interface():
    assert isinstance(HalfRateInterleave(), ReadInterleave)


def test_nothing_to_read_gives_no_plan():
    assert HalfRateInterleave(64).plan([], 3, WindowTiming(0.1, 0.01)) is None


def test_alone_it_reads_full_chunks_back_to_back():
    policy = HalfRateInterleave(64)
    assert policy.plan(make_reads((2, 1000, 0)), 0, WindowTiming(0.1, 0.01)) == \
        ReadPlan(2, 64, 0, None)
    assert policy.plan(make_reads((2, 40, 960)), 0, None) == ReadPlan(2, 40, 0, None)


def test_before_any_measurement_it_alternates():
    policy = HalfRateInterleave(64)
    assert policy.plan(make_reads((0, 1000, 0)), 2, None) == ReadPlan(0, 64, 1, None)


@pytest.mark.parametrize("window_s, per_token_s, expected_windows, expected_share", [
    (0.100, 0.001, 1, 0.100 / (0.100 + 0.064)),  # chunk 64 ms < window 100 ms: one window
    (0.032, 0.001, 2, 0.064 / 0.128),             # chunk = 2 windows exactly: share 1/2
    (0.030, 0.001, 3, 0.090 / 0.154),             # 64/30 = 2.13 -> 3 windows
    (0.010, 0.002, 13, 0.130 / 0.258),            # chunk 128 ms / 10 ms -> 13
    (0.050, 0.0, 0, 1.0),                         # reading costs nothing measurable
])
def test_decode_windows_between_chunks_keep_half_the_solo_rate(window_s, per_token_s,
                                                               expected_windows, expected_share):
    plan = HalfRateInterleave(64).plan(make_reads((1, 500, 0)), 3,
                                       WindowTiming(window_s, per_token_s))
    assert (plan.slot_index, plan.chunk_tokens, plan.num_decode_windows_after) == \
        (1, 64, expected_windows)
    assert plan.decode_share == pytest.approx(expected_share, rel=1e-12)
    assert plan.decode_share >= 0.5


def test_the_last_chunk_is_shorter_and_needs_fewer_windows():
    plan = HalfRateInterleave(64).plan(make_reads((0, 20, 980)), 1, WindowTiming(0.01, 0.001))
    assert plan == ReadPlan(0, 20, 2, pytest.approx(0.02 / 0.04))


def test_a_short_prompt_arriving_during_a_long_read_goes_first():
    policy = HalfRateInterleave(64)
    reads = make_reads((0, 900, 128), (3, 500, 0), (1, 30, 0), (2, 10, 0))
    assert policy.plan(reads, 2, WindowTiming(0.1, 0.001)) == \
        ReadPlan(1, 30, 1, pytest.approx(0.1 / 0.13))
    # Once the short ones are read the long read continues, earliest arrival first.
    assert policy.plan(reads[:2], 2, None) == ReadPlan(0, 64, 1, None)


def test_a_prompt_of_exactly_one_chunk_counts_as_short():
    reads = make_reads((0, 900, 64), (1, 64, 0), (2, 65, 0))
    assert HalfRateInterleave(64).next_read(reads) == reads[1]


def test_long_reads_go_in_arrival_order():
    reads = make_reads((3, 300, 0), (0, 900, 0))
    assert HalfRateInterleave(64).next_read(reads) == reads[0]


def test_a_larger_share_needs_more_windows():
    policy = HalfRateInterleave(64, min_decode_share=0.75)
    plan = policy.plan(make_reads((0, 999, 0)), 1, WindowTiming(0.032, 0.001))
    assert plan.num_decode_windows_after == 6  # 6 * 32 * 0.25 = 48 >= 0.75 * 64
    assert plan.decode_share == pytest.approx(0.192 / 0.256)


@example(window_s=1.0, per_token_s=5e-324, chunk=1, left=1, share=0.25)
@given(window_s=st.floats(1e-5, 10.0), per_token_s=st.floats(0.0, 1.0),
       chunk=st.integers(1, 4096), left=st.integers(1, 100_000),
       share=st.sampled_from([0.0, 0.25, 0.5, 0.9]))
def test_decode_share_always_holds_and_the_window_count_is_minimal(window_s, per_token_s, chunk,
                                                                   left, share):
    policy = HalfRateInterleave(chunk, min_decode_share=share)
    plan = policy.plan(make_reads((0, left, 0)), 4, WindowTiming(window_s, per_token_s))
    assert plan.chunk_tokens == min(chunk, left)
    chunk_s = plan.chunk_tokens * per_token_s
    k = plan.num_decode_windows_after
    assert k * window_s * (1 - share) >= share * chunk_s
    # no windows exactly when none are needed; one more than k - 1 only where k - 1 falls short
    # (k = 1 is the least for any positive share of a positive chunk, even when the float
    # product share * chunk_s underflows to 0: hypothesis found per_token_s = 5e-324)
    assert (k == 0) == (share == 0 or chunk_s == 0)
    if k > 1:
        assert (k - 1) * window_s * (1 - share) < share * chunk_s
    assert plan.decode_share >= share - 1e-9


@pytest.mark.parametrize("chunk", [0, -5, 2.5, True])
def test_bad_read_chunk_is_a_config_error(chunk):
    with pytest.raises(ConfigError, match="--read-chunk"):
        HalfRateInterleave(chunk)


@pytest.mark.parametrize("share", [1.0, -0.1, 2.0])
def test_bad_share_is_a_config_error(share):
    with pytest.raises(ConfigError, match="min_decode_share"):
        HalfRateInterleave(64, min_decode_share=share)


@pytest.mark.parametrize("timing, name", [
    (WindowTiming(0.0, 0.001), "decode_window_seconds"),
    (WindowTiming(float("nan"), 0.001), "decode_window_seconds"),
    (WindowTiming(0.1, -1.0), "prompt_seconds_per_token"),
    (WindowTiming(0.1, float("inf")), "prompt_seconds_per_token"),
])
def test_bad_timings_are_reported_by_name(timing, name):
    with pytest.raises(ValueError, match=name):
        HalfRateInterleave(64).plan(make_reads((0, 100, 0)), 1, timing)


def test_alone_it_reads_solo_chunks_and_with_others_decoding_read_chunks():
    policy = HalfRateInterleave(64, solo_chunk_tokens=4096)
    assert policy.plan(make_reads((1, 5000, 0)), 0, None) == ReadPlan(1, 4096, 0, None)
    assert policy.plan(make_reads((1, 900, 4100)), 0, None) == ReadPlan(1, 900, 0, None)
    plan = policy.plan(make_reads((1, 5000, 0)), 2, WindowTiming(0.01, 0.001))
    assert (plan.chunk_tokens, plan.num_decode_windows_after) == (64, 7)
    # without a solo size the read chunk serves both
    assert HalfRateInterleave(64).solo_chunk_tokens == 64


@pytest.mark.parametrize("solo", [0, -5, 2.5, True, "4096"])
def test_bad_solo_chunk_is_a_config_error(solo):
    with pytest.raises(ConfigError, match="solo_chunk_tokens"):
        HalfRateInterleave(64, solo_chunk_tokens=solo)
