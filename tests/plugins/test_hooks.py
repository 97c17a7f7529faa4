"""One test per hook: the built-in answer (or none), and a registered plugin taking effect."""
from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import pytest

from strata.engine.generate import GenerationStats
from strata.engine.interleave import HalfRateInterleave, PendingRead, ReadPlan
from strata.engine.slots import LongestPrefixPicker
from strata.hookspecs import ExpertSwap, SlotView, WindowStats, hookimpl
from strata.plugins import BUILTIN_PLUGIN_NAME, get_plugin_manager, resolve_choosers


class FakeConfig:
    """Only what the hooks read: the engine config is built from a model file elsewhere."""

    def __init__(self, prompt_chunk_tokens=512):
        self.prompt_chunk_tokens = prompt_chunk_tokens


CONTEXT = dict(config=FakeConfig(96), spec=None, num_slots=4)


@contextmanager
def registered(plugin, name):
    pm = get_plugin_manager(autoload=False)
    pm.register(plugin, name=name)
    try:
        yield pm
    finally:
        pm.unregister(name=name)


# ---- strata_slot_picker -------------------------------------------------------------------
class HighestIdlePicker:
    name = "highest-idle"

    def pick(self, prompt_tokens, slots):
        return max(s.index for s in slots if not s.is_busy), 0


class HighestIdlePlugin:
    def __init__(self):
        self.calls = []

    @hookimpl
    def strata_slot_picker(self, num_slots):
        self.calls.append(num_slots)
        return HighestIdlePicker()


def test_strata_slot_picker_default_is_longest_prefix():
    choosers = resolve_choosers(get_plugin_manager(autoload=False), **CONTEXT)
    assert type(choosers.slot_picker) is LongestPrefixPicker
    assert choosers.sources["strata_slot_picker"] == BUILTIN_PLUGIN_NAME


def test_strata_slot_picker_plugin_overrides_the_default_once():
    plugin = HighestIdlePlugin()
    with registered(plugin, "highest") as pm:
        choosers = resolve_choosers(pm, **CONTEXT)
    assert plugin.calls == [4]  # called once, at build, with the context it asked for
    assert choosers.sources["strata_slot_picker"] == "highest"
    slots = [SlotView(i, (1, 2), False, 0) for i in range(3)]
    assert choosers.slot_picker.pick([1, 2, 3], slots) == (2, 0)


def test_strata_slot_picker_a_plugin_that_declines_falls_through():
    class Declines:
        @hookimpl
        def strata_slot_picker(self):
            return None

    with registered(Declines(), "declines") as pm:
        choosers = resolve_choosers(pm, **CONTEXT)
    assert choosers.sources["strata_slot_picker"] == BUILTIN_PLUGIN_NAME


# ---- strata_read_interleave ---------------------------------------------------------------
def test_strata_read_interleave_default_uses_the_configured_chunk():
    choosers = resolve_choosers(get_plugin_manager(autoload=False), **CONTEXT)
    assert type(choosers.read_interleave) is HalfRateInterleave
    assert choosers.read_interleave.read_chunk_tokens == 96
    assert choosers.read_interleave.plan([PendingRead(0, 1000)], 0, None) == \
        ReadPlan(0, 96, 0, None)


def test_strata_read_interleave_plugin_overrides_the_default():
    class ReadAllAtOnce:
        name = "all-at-once"

        def plan(self, reads, num_decoding_slots, timing):
            return ReadPlan(reads[0].slot_index, reads[0].num_tokens_left, 0, None) if reads \
                else None

    class Plugin:
        @hookimpl
        def strata_read_interleave(self, config, spec, num_slots):
            return ReadAllAtOnce()

    with registered(Plugin(), "all-at-once") as pm:
        choosers = resolve_choosers(pm, **CONTEXT)
    assert choosers.sources["strata_read_interleave"] == "all-at-once"
    assert choosers.read_interleave.plan([PendingRead(2, 5000)], 3, None) == \
        ReadPlan(2, 5000, 0, None)


# ---- strata_tier_policy -------------------------------------------------------------------
class TopCountsTier:
    """Swap in the most-counted missing expert for the least-counted resident one."""

    name = "top-counts"

    def plan_swaps(self, counts, residency, min_gain):
        missing = np.where(residency < 0, counts, -1)
        resident = np.where(residency >= 0, counts, np.iinfo(counts.dtype).max)
        load = np.unravel_index(np.argmax(missing), counts.shape)
        evict = np.unravel_index(np.argmin(resident), counts.shape)
        if counts[load] - counts[evict] < min_gain:
            return []
        return [ExpertSwap(int(load[0]), int(load[1]), int(evict[0]), int(evict[1]))]


def test_strata_tier_policy_is_the_builtin_until_a_plugin_answers():
    choosers = resolve_choosers(get_plugin_manager(autoload=False), **CONTEXT)
    assert choosers.tier_policy.name == "decayed-count"
    assert choosers.sources["strata_tier_policy"] == "strata.builtin"

    class Plugin:
        @hookimpl
        def strata_tier_policy(self):
            return TopCountsTier()

    with registered(Plugin(), "tier") as pm:
        choosers = resolve_choosers(pm, **CONTEXT)
    counts = np.array([[5, 0, 9], [1, 7, 2]])
    residency = np.array([[0, 1, -1], [-1, 2, -1]])
    assert choosers.tier_policy.plan_swaps(counts, residency, 1.0) == [ExpertSwap(0, 2, 0, 1)]
    assert choosers.tier_policy.plan_swaps(counts, residency, 10.0) == []


# ---- strata_kv_grow -----------------------------------------------------------------------
class LendColdestSlots:
    name = "lend-coldest"

    def grow(self, slot_index, num_cells_needed, cells_per_expert_slot, residency):
        num = -(-num_cells_needed // cells_per_expert_slot)
        return sorted(int(s) for s in residency[residency >= 0])[-num:]

    def give_back(self, slot_index, expert_slots):
        return [(0, s) for s in expert_slots]


def test_strata_kv_grow_defaults_to_least_valued_and_a_plugin_overrides_it():
    choosers = resolve_choosers(get_plugin_manager(autoload=False), **CONTEXT)
    assert choosers.kv_grow.name == "least-valued"
    assert choosers.sources["strata_kv_grow"] == "strata.builtin"

    class Plugin:
        @hookimpl
        def strata_kv_grow(self, spec):
            return LendColdestSlots()

    with registered(Plugin(), "grow") as pm:
        choosers = resolve_choosers(pm, **CONTEXT)
    residency = np.array([[0, 3, -1], [1, -1, 2]])
    assert choosers.kv_grow.grow(1, 300, 128, residency) == [1, 2, 3]
    assert choosers.kv_grow.give_back(1, [2, 3]) == [(0, 2), (0, 3)]


# ---- strata_window_done / strata_request_done ---------------------------------------------
class Recorder:
    def __init__(self):
        self.windows, self.requests = [], []

    @hookimpl
    def strata_window_done(self, stats):
        self.windows.append(stats)

    @hookimpl
    def strata_request_done(self, stats):
        self.requests.append(stats)


class CountsOnly:
    def __init__(self):
        self.num_windows = 0

    @hookimpl
    def strata_window_done(self):
        self.num_windows += 1


def test_strata_window_done_calls_every_observer():
    recorder, counter = Recorder(), CountsOnly()
    pm = get_plugin_manager(autoload=False)
    pm.register(recorder, name="recorder")
    pm.register(counter, name="counter")
    try:
        choosers = resolve_choosers(pm, **CONTEXT)
    finally:
        pm.unregister(name="recorder")
        pm.unregister(name="counter")
    stats = [WindowStats(i, 3, 64 * i, 0.01) for i in range(3)]
    for s in stats:
        choosers.window_done(s)
    assert recorder.windows == stats and counter.num_windows == 3
    # No observers: notifying costs a loop over nothing.
    resolve_choosers(get_plugin_manager(autoload=False), **CONTEXT).window_done(stats[0])


def test_strata_request_done_calls_every_observer():
    recorder = Recorder()
    with registered(recorder, "recorder") as pm:
        choosers = resolve_choosers(pm, **CONTEXT)
    stats = GenerationStats(num_prompt_tokens=10, num_cached_tokens=4, num_generated_tokens=3)
    choosers.request_done(stats)
    assert recorder.requests == [stats] and recorder.windows == []


def test_strata_request_done_through_a_wrapper_still_reaches_observers():
    seen = []

    class Wrapper:
        @hookimpl(wrapper=True)
        def strata_request_done(self, stats):
            seen.append("before")
            result = yield
            seen.append("after")
            return result

    recorder = Recorder()
    pm = get_plugin_manager(autoload=False)
    pm.register(recorder, name="recorder")
    pm.register(Wrapper(), name="wrapper")
    choosers = resolve_choosers(pm, **CONTEXT)
    choosers.request_done("stats")
    assert seen == ["before", "after"] and recorder.requests == ["stats"]


@pytest.mark.parametrize("hook_name", ["strata_slot_picker", "strata_read_interleave"])
def test_a_builtin_chooser_hook_wrapped_by_a_plugin_reports_wrapped(hook_name):
    class Wrapper:
        pass

    # A new-style wrapper that passes the result through unchanged.
    setattr(Wrapper, hook_name, hookimpl(wrapper=True)(lambda self, num_slots: (yield)))
    with registered(Wrapper(), "wrapper") as pm:
        choosers = resolve_choosers(pm, **CONTEXT)
    assert choosers.sources[hook_name] == "(wrapped)"
    assert choosers.slot_picker is not None and choosers.read_interleave is not None
