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


class _Clock:
    """expert_tier's log clock: `step` seconds later at each call."""

    def __init__(self, step):
        self.now, self.step = 0.0, step

    def __call__(self):
        self.now += self.step
        return self.now


def _group_lines(tiny_model_path, monkeypatch, caplog, step_s) -> list[str]:
    import logging

    from strata import Engine, EngineConfig, SamplingParams
    from strata.engine import expert_tier
    from strata.engine.generate import collect

    monkeypatch.setattr(expert_tier, "_log_clock", _Clock(step_s))
    caplog.set_level(logging.INFO, logger=expert_tier.log.name)
    with Engine(EngineConfig(tiny_model_path, n_ctx=256, threads=2, expert_cache=4)) as engine:
        collect(engine.generate([5, 6, 7], SamplingParams(max_tokens=100, temperature=0.0,
                                                          ignore_eos=True)))
    return [r.getMessage() for r in caplog.records if "expert cache, windows" in r.getMessage()]


def test_the_group_line_comes_every_32_windows_at_most_once_in_ten_seconds(
        tiny_model_path, monkeypatch, caplog):
    """100 windows: a line at windows 32, 64 and 96 when seconds pass between them, only the
    first when they come faster (a GPU at 200 windows a second wrote six lines a second); and
    the rest at the end."""
    slow = _group_lines(tiny_model_path, monkeypatch, caplog, step_s=60.0)
    assert [line.split(":")[0] for line in slow] == [
        "expert cache, windows 0-31", "expert cache, windows 32-63",
        "expert cache, windows 64-95", "expert cache, windows 96-99"]
    caplog.clear()
    fast = _group_lines(tiny_model_path, monkeypatch, caplog, step_s=1e-3)
    assert [line.split(":")[0] for line in fast] == ["expert cache, windows 0-31",
                                                     "expert cache, windows 32-99"]
