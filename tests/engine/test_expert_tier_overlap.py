"""The tier's host work while a window runs (ExpertTier.overlaps_window): with a model that takes
`while_running` and an arena that pumps in `during_window` (the CUDA backend's pair), the pump
and the due round run inside the window, the round one window later than between windows and
from the windows before it, and their time counts as wait only when the GPU was done first.
Here a CPU model stands in for the GPU (its forward runs after while_running returns)."""
from __future__ import annotations

import numpy as np
import pytest

from strata.backends.cpu import CpuModel
from strata.backends.window import Window
from strata.config import EngineConfig
from strata.engine.expert_tier import ExpertTier
from strata.experts.arena import CpuExpertArena
from strata.experts.tier import DecayedCountTier
from strata.model.gguf_file import GGUFModel


@pytest.fixture(scope="module")
def skewed_q8(tmp_path_factory):
    from strata.tool.synth import synth_model

    path = tmp_path_factory.mktemp("overlap") / "tiny-skew.gguf"
    synth_model(path, shape="tiny", weight_type="q8_0", seed=11, routing_skew=1.0)
    return path


class _OverlapModel:
    """The CPU model, taking while_running as the CUDA model does: called before the forward
    (the 'GPU' runs meanwhile), with is_done answering `gpu_done`."""

    runs_while_window = True

    def __init__(self, model, events):
        self.model, self.events, self.gpu_done = model, events, False

    def __getattr__(self, name):
        return getattr(self.model, name)

    def forward_window(self, window, expert_pointers=None, routing_counts=None,
                       while_running=None):
        self.events.append("launch")
        if while_running is not None:
            while_running(lambda: self.gpu_done)
        self.events.append("sync")
        return self.model.forward_window(window, expert_pointers=expert_pointers,
                                         routing_counts=routing_counts)


class _PumpArena(CpuExpertArena):
    """The CPU arena, recording where the tier pumps it."""

    overlaps_window = True
    events: list
    prompt_rows = 10 ** 9  # windows of at least this many rows read the routing before them

    def before_window(self, num_rows: int = 1, pump: bool = True) -> None:
        self.events.append("before+pump" if pump else "before")

    def fold_routed(self, counts) -> None:
        self.events.append("fold")

    def reads_routing_before(self, num_rows: int) -> bool:
        return num_rows >= self.prompt_rows

    def during_window(self) -> None:
        self.events.append("pump")

    def prepare_next_window(self) -> None:
        self.events.append("prepare")


class _RecordingPolicy(DecayedCountTier):
    def __init__(self, events, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.events, self.round_counts, self.observed = events, [], []

    def observe(self, counts):
        self.observed.append(counts.copy())

    def plan_swaps(self, counts, residency, min_gain):
        self.events.append("round")
        self.round_counts.append(counts.copy())
        return super().plan_swaps(counts, residency, min_gain)


def _tier(path, gguf, model, events, overlap: bool, adapt_every=2, is_async=True):
    config = EngineConfig(path, expert_cache=3, adapt_every=adapt_every, adapt_async=is_async)
    tier = ExpertTier.build(config, gguf, _OverlapModel(model, events) if overlap else model)
    if overlap:
        tier.arena.__class__ = _PumpArena  # start() then sees the CUDA pair's flags
        tier.arena.events = events
    policy = _RecordingPolicy(events, 3, decay=0.5, hysteresis=0.0)
    tier.start(policy)
    return tier, policy


def _windows(rng, kvs, num_windows):
    for w in range(num_windows):
        num_slots = 1 if w % 3 else len(kvs)
        yield Window.build([(kv, rng.integers(10, 4000, 2)) for kv in kvs[:num_slots]])


def test_pump_and_round_run_inside_the_window_one_window_later(skewed_q8):
    with GGUFModel.open(skewed_q8) as gguf:
        model = CpuModel(gguf, num_threads=1)
        events: list[str] = []
        tier, policy = _tier(skewed_q8, gguf, model, events, overlap=True)
        assert tier.overlaps_window
        kvs = [model.new_kv(256) for _ in range(2)]
        counts = []
        try:
            for window in _windows(np.random.default_rng(3), kvs, 7):
                tier.forward_window(window)
                counts.append(tier._counts.copy())
                assert tier.wait_idle(30)  # no round is skipped for a busy copier
        finally:
            tier.close()
    per_window = "|".join(events).split("|before|")
    # every window: no pump before it; while it runs the last window's routing folded in, one
    # pump; rounds (adapt_every 2) inside windows 3, 5, 7: after two windows each, from the
    # counts of the windows before; then the arena prepares the next window. The last window's
    # routing is folded in at close.
    assert events[0] == "before" and len(per_window) == 7
    for w, part in enumerate(per_window):
        want = (["launch"] + ["fold"] * (w > 0) + ["pump"] + ["round"] * (w in (2, 4, 6))
                + ["prepare", "sync"] + ["fold"] * (w == 6))
        assert part.removeprefix("before|").split("|") == want, (w, part)
    assert len(policy.observed) == 7
    for seen, window_counts in zip(policy.observed, counts):
        np.testing.assert_array_equal(seen, window_counts)
    assert len(policy.round_counts) == 3
    np.testing.assert_array_equal(policy.round_counts[0], counts[0] + counts[1])
    np.testing.assert_array_equal(policy.round_counts[1], counts[2] + counts[3])
    np.testing.assert_array_equal(policy.round_counts[2], counts[4] + counts[5])


def test_a_blocking_tier_keeps_its_rounds_between_windows(skewed_q8):
    """A blocking round waits for readers of the table version it replaces, the running window
    among them: it must not run inside the window (on the GPU that deadlocked for 120 s)."""
    with GGUFModel.open(skewed_q8) as gguf:
        model = CpuModel(gguf, num_threads=1)
        events: list[str] = []
        tier, policy = _tier(skewed_q8, gguf, model, events, overlap=True, is_async=False)
        assert tier.mode == "blocking" and not tier.overlaps_window
        kvs = [model.new_kv(256) for _ in range(2)]
        try:
            for window in _windows(np.random.default_rng(3), kvs, 5):
                tier.forward_window(window)
        finally:
            tier.close()
    per_window = "|".join(events).split("before+pump|")[1:]
    assert len(per_window) == 5 and len(policy.round_counts) == 2
    for w, part in enumerate(per_window):  # rounds after windows 2 and 4, outside them
        want = ["launch", "sync", "fold"] + (["round"] if w in (1, 3) else [])
        assert part.rstrip("|").split("|") == want, (w, part)


def test_a_frozen_tier_does_not_overlap(skewed_q8):
    with GGUFModel.open(skewed_q8) as gguf:
        model = CpuModel(gguf, num_threads=1)
        tier, _ = _tier(skewed_q8, gguf, model, [], overlap=True, adapt_every=0)
        try:
            assert tier.mode == "frozen" and not tier.overlaps_window
        finally:
            tier.close()


@pytest.mark.parametrize("gpu_done", [False, True])
def test_overlapped_time_is_wait_only_when_the_gpu_finished_first(skewed_q8, gpu_done):
    with GGUFModel.open(skewed_q8) as gguf:
        model = CpuModel(gguf, num_threads=1)
        tier, _ = _tier(skewed_q8, gguf, model, [], overlap=True, adapt_every=1)
        tier.model.gpu_done = gpu_done
        kvs = [model.new_kv(256) for _ in range(2)]
        try:
            for window in _windows(np.random.default_rng(5), kvs, 4):
                tier.forward_window(window)
                before, (swaps, during) = tier._before_s, tier._during
                assert tier.last_window.wait_s == pytest.approx(before + during)
                assert tier.last_window.num_swaps == swaps
                assert (during > 0) == gpu_done
        finally:
            tier.close()


def test_overlap_gives_the_tokens_of_the_tier_between_windows(skewed_q8):
    """Greedy tokens do not depend on residency: the overlapped tier, the tier between windows
    and no tier give the same tokens."""
    def greedy(mode):
        with GGUFModel.open(skewed_q8) as gguf:
            model = CpuModel(gguf, num_threads=1)
            tier = None
            if mode != "none":
                tier, _ = _tier(skewed_q8, gguf, model, [], overlap=mode == "overlap",
                                adapt_every=1)
            kv, out = model.new_kv(256), []
            token = np.array([17, 99, 1234], dtype=np.int32)
            try:
                for _ in range(12):
                    window = Window.build([(kv, token)])
                    logits = (tier or model).forward_window(window)
                    token = np.array([int(np.argmax(logits[-1]))], dtype=np.int32)
                    out.append(int(token[0]))
            finally:
                if tier is not None:
                    tier.close()
            return out

    assert greedy("overlap") == greedy("between") == greedy("none")


def test_a_window_that_reads_the_routing_gets_it_folded_in_before_it(skewed_q8, tmp_path):
    """Deferred routing (overlaps_window) is folded in before a window the arena plans from it
    (reads_routing_before: prompt streaming, a CPU pool), and the trace at close holds every
    window in order, as between windows."""
    def run(overlap):
        with GGUFModel.open(skewed_q8) as gguf:
            model = CpuModel(gguf, num_threads=1)
            events: list[str] = []
            config = EngineConfig(skewed_q8, expert_cache=3, adapt_every=2, adapt_async=True,
                                  dump_routing_path=tmp_path / f"{overlap}.trace")
            tier = ExpertTier.build(config, gguf,
                                    _OverlapModel(model, events) if overlap else model)
            if overlap:
                tier.arena.__class__ = _PumpArena
                tier.arena.events, tier.arena.prompt_rows = events, 5
            tier.start(_RecordingPolicy(events, 3, decay=0.5, hysteresis=0.0))
            kvs = [model.new_kv(256) for _ in range(2)]
            rng = np.random.default_rng(8)
            try:
                for w in range(6):  # windows 2 and 5 of 6 rows: prompt-sized
                    rows = 6 if w in (2, 5) else 1
                    tier.forward_window(Window.build(
                        [(kv, rng.integers(10, 4000, rows)) for kv in kvs[:1 + w % 2]]))
                    assert tier.wait_idle(30)
            finally:
                tier.close()
            return events, tier.policy.observed

    events, observed = run(True)
    parts = "|".join(events).split("|launch|")
    # the fold of window 1 comes before window 2's before_window; of window 4 before window 5's
    assert parts[2].endswith("fold|before") and parts[5].endswith("fold|before"), parts
    assert parts[1].endswith("sync|before") and parts[3].endswith("sync|before"), parts
    _, between = run(False)
    assert len(observed) == len(between) == 6
    for a, b in zip(observed, between):
        np.testing.assert_array_equal(a, b)
    from strata.experts.trace import read_trace

    ours, theirs = read_trace(tmp_path / "True.trace"), read_trace(tmp_path / "False.trace")
    assert ours.num_windows == theirs.num_windows == 6
    np.testing.assert_array_equal(ours.records, theirs.records)


def test_greedy_forward_gives_the_argmax_of_the_logits(skewed_q8):
    with GGUFModel.open(skewed_q8) as gguf:
        model = CpuModel(gguf, num_threads=1)
        tier, _ = _tier(skewed_q8, gguf, model, [], overlap=True, adapt_every=0)
        kvs = [model.new_kv(64) for _ in range(2)]
        kvs2 = [model.new_kv(64) for _ in range(2)]
        try:
            for step in range(3):
                tokens = [np.array([17 + step, 90], dtype=np.int32), np.array([5], np.int32)]
                ids = tier.forward_window(Window.build(list(zip(kvs, tokens))), greedy=True)
                logits = tier.forward_window(Window.build(list(zip(kvs2, tokens))))
                np.testing.assert_array_equal(ids, np.argmax(logits, axis=-1))
                assert ids.dtype == np.int32 and ids.shape == (2,)
        finally:
            tier.close()
