"""The tier's wait is reported per window kind: solo windows (one slot) and batch windows
(several slots) each get exactly the waits of their windows, blocking and async."""
from __future__ import annotations

import numpy as np
import pytest

from strata.backends.cpu import CpuModel
from strata.backends.window import Window
from strata.config import EngineConfig
from strata.engine.expert_tier import ExpertTier
from strata.experts.tier import DecayedCountTier
from strata.model.gguf_file import GGUFModel


@pytest.fixture(scope="module")
def skewed_q8(tmp_path_factory):
    from strata.tool.synth import synth_model

    path = tmp_path_factory.mktemp("wait") / "tiny-skew.gguf"
    synth_model(path, shape="tiny", weight_type="q8_0", seed=11, routing_skew=1.0)
    return path


@pytest.mark.parametrize("is_async", [True, False], ids=["async", "blocking"])
def test_wait_by_window_kind_adds_up_exactly(skewed_q8, is_async):
    rng = np.random.default_rng(3)
    with GGUFModel.open(skewed_q8) as gguf:
        model = CpuModel(gguf, num_threads=1)
        config = EngineConfig(skewed_q8, expert_cache=3, adapt_every=1, adapt_async=is_async)
        tier = ExpertTier.build(config, gguf, model)
        tier.start(DecayedCountTier(3, decay=0.5, hysteresis=0.0))
        kvs = [model.new_kv(256) for _ in range(3)]
        want = {"solo": [0, 0.0], "batch": [0, 0.0]}
        try:
            for w in range(24):
                num_slots = 1 if w % 3 else 3  # two solo windows, then a batch window
                window = Window.build([(kv, rng.integers(10, 4000, 2)) for kv in kvs[:num_slots]])
                tier.forward_window(window)
                kind = "solo" if num_slots == 1 else "batch"
                want[kind][0] += 1
                want[kind][1] += tier.last_window.wait_s
            assert tier.wait_idle(30)
        finally:
            tier.close()
    got = tier.wait_by_kind
    assert (got["solo"].num_windows, got["batch"].num_windows) == (16, 8)
    assert [got["solo"].num_windows, got["solo"].wait_s] == want["solo"]
    assert [got["batch"].num_windows, got["batch"].wait_s] == want["batch"]
    assert got["solo"].wait_s + got["batch"].wait_s == pytest.approx(tier.totals.wait_s)
    assert tier.totals.num_swaps > 0  # rounds ran, so there was something to wait for
    assert got["batch"].max_wait_s <= tier.totals.max_wait_s
    assert "solo" in got["solo"].describe("solo") and "over 16" in got["solo"].describe("solo")
