"""The KV-grow stress run shared by the CPU and CUDA tests: three slots read prompts in fixed
chunks and decode while tier rounds swap experts (every window, copies in small steps) and KVs
grow into lent expert slots and trim back; every window's rows and logits are recorded for a
comparison with a frozen-tier run without KV grow."""
from __future__ import annotations

import numpy as np

from strata import Engine, EngineConfig, SamplingParams, hookimpl
from strata.engine.interleave import ReadPlan
from strata.experts.tier import DecayedCountTier
from strata.plugins import get_plugin_manager

PROMPT_LENGTHS = (40, 150, 90, 200, 20, 120)
MAX_TOKENS = (100, 60, 150, 40, 200, 80)
CHUNK_TOKENS = 32


class FixedInterleave:
    """Chunks of CHUNK_TOKENS, one decode window after each: windows that do not depend on
    timing, so two runs give the same windows."""

    name = "fixed"

    def plan(self, reads, num_decoding_slots, timing):
        if not reads:
            return None
        read = reads[0]
        return ReadPlan(read.slot_index, min(CHUNK_TOKENS, read.num_tokens_left), 1, None)


class StressPlugins:
    @hookimpl
    def strata_read_interleave(self):
        return FixedInterleave()

    @hookimpl
    def strata_tier_policy(self, config):
        # no hysteresis, fast decay: the cache keeps changing
        return DecayedCountTier(config.expert_cache_slots, decay=0.5, hysteresis=0.0)


def run_requests(path, copy_chunk_bytes=None, **options):
    """(windows [(tokens, positions, logits)], generated tokens per request, facts) of the six
    requests run to the end in three slots."""
    pm = get_plugin_manager(autoload=False)
    pm.register(StressPlugins(), "stress")
    rng = np.random.default_rng(7)
    prompts = [[int(t) for t in rng.integers(10, 4000, n)] for n in PROMPT_LENGTHS]
    config = EngineConfig(path, n_ctx=512, parallel=3, prompt_chunk_tokens=CHUNK_TOKENS,
                          **options)
    with Engine(config, plugin_manager=pm) as engine:
        tier = engine.expert_tier
        if copy_chunk_bytes is not None:
            tier.copy_chunk_bytes = copy_chunk_bytes
        windows, forward = [], tier.forward_window

        def recording(window, lazy=False):
            logits = np.array(forward(window))  # [N, V]
            windows.append((window.tokens.copy(), window.positions.copy(), logits))
            return logits

        tier.forward_window = recording
        handles = [engine.submit(p, SamplingParams(max_tokens=n, temperature=0.0,
                                                   ignore_eos=True))
                   for p, n in zip(prompts, MAX_TOKENS)]
        tokens = [[] for _ in handles]
        while not all(h.is_finished for h in handles):
            assert engine.step()
            for out, h in zip(tokens, handles):
                out += [e.token_id for e in h.pop_events()]
        assert [h.error for h in handles] == [None] * len(handles)
        assert tier.wait_idle(30)
        totals, lender = tier.snapshot_totals(), engine.scheduler.kv_lender
        # refills of returned slots count as free fills; evictions are the tier's own swaps
        facts = {"rounds": totals.num_rounds, "evictions": totals.num_evictions}
        if lender is not None:
            facts.update(grows=lender.num_grows, trims=lender.num_trims,
                         refused=lender.num_refused, lent_at_end=lender.num_lent_slots,
                         capacities=[kv.capacity for kv in engine.scheduler.kvs])
    return windows, tokens, facts


def assert_windows_equal(reference, got):
    assert len(got) == len(reference)
    for index, ((tokens, positions, want), (t, p, have)) in enumerate(zip(reference, got)):
        assert np.array_equal(tokens, t) and np.array_equal(positions, p), f"window {index}"
        assert np.array_equal(want, have), f"window {index}: logits differ from the frozen run"
