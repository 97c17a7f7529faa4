"""Free admission in the engine: it needs an arena whose misses cross the link and whose
windows keep them (`keeps_misses`: the CUDA offload, tests/backends/cuda/test_cuda_offload.py
checks it there), an asynchronous tier and a policy with `victims`; the CPU arena keeps nothing.
While a window may take the offered victims' slots, rounds leave those slots alone."""
from __future__ import annotations

import logging

import numpy as np
import pytest

from strata.backends.cpu import CpuModel
from strata.backends.window import Window
from strata.config import EngineConfig
from strata.engine.expert_tier import ExpertTier
from strata.experts.tier import DecayedCountTier
from strata.experts.tier_window import WindowScoreTier
from strata.hookspecs import ExpertSwap
from strata.model.gguf_file import GGUFModel

pytestmark = pytest.mark.usefixtures("one_kernel_thread")

NUM_SLOTS = 6  # of 2 layers x 8 experts


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    from strata.tool.synth import synth_model

    path = tmp_path_factory.mktemp("admit") / "tiny-skew.gguf"
    synth_model(path, shape="tiny", weight_type="f32", seed=6, routing_skew=1.0)
    return path


def make_tier(model_path, gguf, policy, adapt_async=True):
    model = CpuModel(gguf)
    config = EngineConfig(model_path, expert_cache=NUM_SLOTS, adapt_every=1000,
                          adapt_async=adapt_async)
    tier = ExpertTier.build(config, gguf, model)
    tier.start(policy)
    return tier, model


@pytest.mark.parametrize("adapt_async", [True, False], ids=["async", "blocking"])
def test_the_cpu_arena_keeps_no_misses(model_path, adapt_async):
    with GGUFModel.open(model_path) as gguf:
        tier, model = make_tier(model_path, gguf, WindowScoreTier(NUM_SLOTS), adapt_async)
        try:
            assert not tier.arena.keeps_misses and not tier.admits
            kv = model.new_kv(64)
            logits = tier.forward_window(Window.build([(kv, np.arange(10, 15))]))
            for _ in range(5):
                token = np.array([int(np.argmax(logits[-1]))])
                logits = tier.forward_window(Window.build([(kv, token)]))
            assert tier.snapshot_totals().num_admissions == 0
        finally:
            tier.close()


def test_rounds_leave_the_slots_offered_to_the_running_window_alone(model_path, caplog):
    with GGUFModel.open(model_path) as gguf:
        tier, _ = make_tier(model_path, gguf, DecayedCountTier(NUM_SLOTS))
        try:
            residency = tier.arena.table.peek().table
            (l0, e0), (l1, e1) = np.argwhere(residency >= 0)[:2]
            missing = np.argwhere(residency < 0)[:2]
            offered = int(residency[l0, e0])
            tier.arena.offered_slots = frozenset([offered])  # as a window running with them
            swaps = [ExpertSwap(int(missing[0][0]), int(missing[0][1]), int(l0), int(e0)),
                     ExpertSwap(int(missing[1][0]), int(missing[1][1]), int(l1), int(e1))]
            with caplog.at_level(logging.WARNING, logger="strata.tier"):
                loads = tier._resolve(swaps, residency)
            assert [ld.slot for ld in loads] == [int(residency[l1, e1])]
            assert "cannot be applied" not in caplog.text  # skipped for now, not refused
            tier.arena.offered_slots = frozenset()  # the window is over: the next round may
            assert len(tier._resolve(swaps, residency)) == 2
        finally:
            tier.close()


class NoVictims(WindowScoreTier):
    """A policy that fails to name victims."""

    def victims(self, residency, n):
        raise RuntimeError("broken plugin")


def test_a_failing_victims_hook_keeps_nothing(model_path, caplog):
    with GGUFModel.open(model_path) as gguf:
        tier, _ = make_tier(model_path, gguf, NoVictims(NUM_SLOTS))
        try:
            with caplog.at_level(logging.ERROR, logger="strata.tier"):
                assert tier._victims(tier.arena.table.peek().table, 4) == []
            assert "failed to name victims" in caplog.text
        finally:
            tier.close()
