"""The tier's group log line: cache hits and misses, and with the offload tiers the misses split
into PCIe reads and the CPU pool's entries with its compute time."""
from strata.engine.tier_stats import TierTotals, format_group


def _totals(**kw):
    base = dict(num_windows=32, num_hits=300, num_misses=100, num_rounds=8, num_fills=3,
                num_evictions=5, num_bytes_moved=8 << 20, wait_s=0.004, max_wait_s=0.001)
    return TierTotals(**{**base, **kw})


def test_cpu_arena_line():
    line = format_group(_totals(), 64, "async")
    assert line == ("expert cache, windows 64-95: 400 routed entries = 300 cache + 100 miss "
                    "(75.0% hit), 8 rounds, 8 swaps (3 free fills + 5 evictions), 8.0 MiB "
                    "moved, tier wait 4.00 ms (async; at most 1.00 ms in one window)")


def test_offload_line_splits_the_misses():
    line = format_group(_totals(num_pool_entries=40, pool_s=0.0125, pool_wait_s=0.0031), 0,
                        "blocking", misses_on_gpu=True)
    assert line.startswith("expert cache, windows 0-31: 400 routed entries = 300 VRAM + 60 "
                           "PCIe + 40 CPU pool (pool 12.5 ms computing, 3.1 ms waiting for the "
                           "GPU) (75.0% hit), 8 rounds")


def test_minus_keeps_the_pool_fields():
    later = _totals(num_pool_entries=40, pool_s=0.5, pool_wait_s=0.25, num_windows=40)
    earlier = _totals(num_pool_entries=10, pool_s=0.2, pool_wait_s=0.05, num_windows=32)
    group = later.minus(earlier)
    assert (group.num_windows, group.num_pool_entries) == (8, 30)
    assert abs(group.pool_s - 0.3) < 1e-12 and abs(group.pool_wait_s - 0.2) < 1e-12
