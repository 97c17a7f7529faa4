"""Free admission in the engine (ExpertTier._admit): with an arena whose misses cross the link
(`admits_misses`) and an asynchronous tier, a policy's `admit` keeps the experts a window missed;
the cache then holds exactly what the same policy, replayed on the window's counts, keeps;
results never change; faulty admissions are skipped; arenas whose misses copy nothing and
blocking tiers admit nothing."""
from __future__ import annotations

import logging

import numpy as np
import pytest

from strata.backends.cpu import CpuModel
from strata.backends.window import Window
from strata.config import EngineConfig
from strata.engine.expert_tier import ADMIT_MAX_PER_WINDOW, ExpertTier
from strata.experts.tier import FREE_SLOT
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


def make_tier(model_path, gguf, policy, admits=True, adapt_async=True):
    model = CpuModel(gguf)
    config = EngineConfig(model_path, expert_cache=NUM_SLOTS, adapt_every=1000,
                          adapt_async=adapt_async)
    tier = ExpertTier.build(config, gguf, model)
    tier.arena.admits_misses = admits  # as a device arena, whose misses cross PCIe
    tier.start(policy)
    return tier, model


def decode(tier, model, steps, seed=1):
    """`steps` one-row windows of greedy decode after a 5-token prompt; yields after each
    window (copies landed) its routed rows [L, E] and the token."""
    kv = model.new_kv(256)
    rng = np.random.default_rng(seed)
    logits = tier.forward_window(Window.build([(kv, rng.integers(10, 4000, 5))]))
    assert tier.wait_idle(30)
    for _ in range(steps):
        token = int(np.argmax(logits[-1]))
        logits = tier.forward_window(Window.build([(kv, np.array([token]))]))
        assert tier.wait_idle(30)
        yield tier._counts.copy(), token


def resident(tier) -> np.ndarray:
    return tier.arena.table.peek().table >= 0


def test_the_cache_keeps_what_the_policy_admits(model_path):
    with GGUFModel.open(model_path) as gguf:
        tier, model = make_tier(model_path, gguf, WindowScoreTier(NUM_SLOTS))
        shadow = WindowScoreTier(NUM_SLOTS)  # the same policy, replayed on the counts
        try:
            assert tier.admits
            first = True
            num_admitted = base = 0
            for counts, _ in decode(tier, model, 40):
                if first:  # the shadow starts from the tier's state after the first windows
                    shadow.frequency = tier.policy.frequency.copy()
                    shadow.recent_rows = tier.policy.recent_rows.copy()
                    want = resident(tier)
                    base = tier.snapshot_totals().num_admissions
                    first = False
                    continue
                shadow.observe(counts)
                table = np.where(want, 0, -1)
                swaps = shadow.admit(counts, table)[:ADMIT_MAX_PER_WINDOW]
                for s in swaps:
                    if s.evict_layer != FREE_SLOT:
                        want[s.evict_layer, s.evict_expert] = False
                    want[s.load_layer, s.load_expert] = True
                num_admitted += len(swaps)
                assert np.array_equal(resident(tier), want)
                # every expert this window routed is resident now (the policy admits every
                # miss it has a victim for: 4 routed of 6 slots)
                assert resident(tier)[counts > 0].all()
            totals = tier.snapshot_totals()
            assert totals.num_admissions - base == num_admitted > 0
            assert totals.num_swaps == totals.num_admissions and totals.num_rounds == 0
        finally:
            tier.close()


def test_admission_changes_no_token(model_path):
    with GGUFModel.open(model_path) as gguf:
        tokens = {}
        for admits in (False, True):
            tier, model = make_tier(model_path, gguf, WindowScoreTier(NUM_SLOTS), admits)
            try:
                tokens[admits] = [t for _, t in decode(tier, model, 30, seed=3)]
                assert (tier.snapshot_totals().num_admissions > 0) == admits
            finally:
                tier.close()
        assert tokens[True] == tokens[False]


class FaultyAdmit(WindowScoreTier):
    """Admits an expert the window did not route to and evicts one it did."""

    def admit(self, counts, residency):
        not_routed = np.argwhere((counts == 0) & (residency < 0))
        routed_resident = np.argwhere((counts > 0) & (residency >= 0))
        swaps = [ExpertSwap(int(not_routed[0][0]), int(not_routed[0][1]), FREE_SLOT,
                            FREE_SLOT)]
        missed = np.argwhere((counts > 0) & (residency < 0))
        if len(missed) and len(routed_resident):
            swaps.append(ExpertSwap(int(missed[0][0]), int(missed[0][1]),
                                    int(routed_resident[0][0]), int(routed_resident[0][1])))
        return swaps


def test_faulty_admissions_are_skipped(model_path, caplog):
    with GGUFModel.open(model_path) as gguf:
        tier, model = make_tier(model_path, gguf, FaultyAdmit(NUM_SLOTS))
        try:
            with caplog.at_level(logging.WARNING, logger="strata.tier"):
                before = resident(tier)
                for _ in decode(tier, model, 6):
                    pass
            assert tier.snapshot_totals().num_admissions == 0
            assert np.array_equal(resident(tier), before)
            assert "did not route to" in caplog.text
        finally:
            tier.close()


@pytest.mark.parametrize("admits,adapt_async", [(False, True), (True, False)],
                         ids=["misses-copy-nothing", "blocking"])
def test_no_admission_without_a_link_or_async_tier(model_path, admits, adapt_async):
    with GGUFModel.open(model_path) as gguf:
        tier, model = make_tier(model_path, gguf, WindowScoreTier(NUM_SLOTS), admits,
                                adapt_async)
        try:
            assert not tier.admits
            for _ in decode(tier, model, 5):
                pass
            assert tier.snapshot_totals().num_admissions == 0
        finally:
            tier.close()
