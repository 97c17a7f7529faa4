"""Pipelined decode in the scheduler (--batch-groups N on a layer split): while every running
request decodes, slot group i % N keeps one window in flight, started as soon as its last one
finished; a prompt to read, a placement or a cancel drains them first. Here the CPU model runs
behind SplitModel's start_window / finish_window (it computes a window when it is finished,
the order in which the GPUs would complete it); the GPU tests run the real split."""
from __future__ import annotations

import numpy as np
import pytest

from strata import Engine, EngineConfig, SamplingParams, hookimpl
from strata.engine.interleave import ReadPlan
from strata.engine.scheduler import Scheduler
from strata.plugins import get_plugin_manager

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from strata.tool.synth import synth_model

    path = tmp_path_factory.mktemp("pipelined") / "tiny.gguf"
    synth_model(path, shape="tiny", weight_type="f32", seed=3)
    return path


class LaneModel:
    """The CPU model with SplitModel's pipelined interface: start_window records the window
    as its lane's, finish_window runs it; one window per lane in flight, and no plain window
    while any is."""

    def __init__(self, model, events: list, batch_groups: int = 2):
        self.model, self.events, self.batch_groups = model, events, batch_groups
        self.flying: dict[int, object] = {}
        self.fail_lane = None

    def __getattr__(self, name):
        return getattr(self.model, name)

    def forward_window(self, window, **kwargs):
        assert not self.flying, "a plain window while pipelined windows are in flight"
        self.events.append(("window", len(window.kvs), window.num_rows))
        return self.model.forward_window(window, **kwargs)

    def start_window(self, window, lane: int, mode: str = "lazy"):
        assert lane not in self.flying and mode == "lazy"
        window.check_current()
        self.flying[lane] = window
        self.events.append(("start", lane, len(window.kvs)))
        return lane, window

    def finish_window(self, ticket):
        lane, window = ticket
        assert self.flying.pop(lane) is window
        self.events.append(("finish", lane))
        if lane == self.fail_lane:
            raise RuntimeError(f"lane {lane} failed")
        return self.model.forward_window(window)


class ReadWhole:
    """Read-interleave: the first pending prompt whole, no decode windows owed after it (the
    default policy plans from measured timings, which differ between machines)."""

    name = "read-whole"

    def plan(self, pending, num_decoding, timing):
        first = pending[0]
        return ReadPlan(first.slot_index, first.num_tokens_left, 0, None)


class ReadWholePlugin:
    @hookimpl
    def strata_read_interleave(self, config, spec, num_slots):
        return ReadWhole()


def engine_with(path, parallel: int, groups: int, events: list) -> Engine:
    pm = get_plugin_manager(autoload=False)
    pm.register(ReadWholePlugin())
    engine = Engine(EngineConfig(path, n_ctx=512, threads=2, parallel=parallel,
                                 prompt_chunk_tokens=128), plugin_manager=pm)
    if groups > 1:
        old = engine.scheduler
        engine.scheduler = Scheduler(LaneModel(engine.model, events, groups), engine.tokenizer,
                                     engine.n_ctx, parallel, old.choosers)
    return engine


def run(engine, prompts, params, submit_later=()):
    """Step until every request finished (the `submit_later` ones are submitted once the
    first requests decode); each one's token ids."""
    handles = [engine.submit(p, sp) for p, sp in zip(prompts, params)]
    later = list(submit_later)
    tokens = {}
    while not all(h.is_finished for h in handles) or later:
        assert engine.step()
        if later and all(h.stats.num_generated_tokens >= 3 for h in handles):
            p, sp = later.pop(0)
            handles.append(engine.submit(p, sp))
        for h in handles:
            tokens.setdefault(h.request_id, []).extend(e.token_id for e in h.pop_events())
    for h in handles:
        assert h.error is None, h.error
    return [tokens[h.request_id] for h in handles]


def until_pipelined(engine, prompts, params, events) -> list:
    """Submit the requests and step until the first pipelined window starts; their handles."""
    handles = [engine.submit(p, sp) for p, sp in zip(prompts, params)]
    while not any(e[0] == "start" for e in events):
        assert engine.step()
    return handles


def _requests(seed: int, n: int):
    rng = np.random.default_rng(seed)
    prompts = [[int(t) for t in rng.integers(10, 4000, k)] for k in (20, 45, 9, 70)[:n]]
    params = [SamplingParams(max_tokens=m, **GREEDY) for m in (34, 29, 37, 31)[:n]]
    params[1] = SamplingParams(max_tokens=29, temperature=0.8, seed=7, ignore_eos=True)
    return prompts, params


def test_pipelined_groups_give_the_tokens_of_whole_windows(tiny):
    prompts, params = _requests(1, 4)
    events: list = []
    with engine_with(tiny, 4, 1, []) as plain:
        want = run(plain, prompts, params)
    with engine_with(tiny, 4, 2, events) as piped:
        got = run(piped, prompts, params)
    assert got == want and [len(t) for t in got] == [34, 29, 37, 31]
    starts = [e for e in events if e[0] == "start"]
    assert starts and {lane for _, lane, _ in starts} == {0, 1}
    # slots 0, 2 are group 0 and 1, 3 group 1: two rows each while all four decode
    assert ("start", 0, 2) in starts and ("start", 1, 2) in starts
    # both groups in flight at once: group 1 starts before group 0's window finishes, and
    # each step finishes the oldest
    first = events.index(("start", 0, 2))
    assert events[first + 1:first + 3] == [("start", 1, 2), ("finish", 0)]
    assert events[first + 3:first + 6] == [("start", 0, 2), ("finish", 1), ("start", 1, 2)]


def test_a_new_request_drains_the_windows_in_flight(tiny):
    prompts, params = _requests(2, 4)
    late = ([int(t) for t in np.random.default_rng(9).integers(10, 4000, 50)],
            SamplingParams(max_tokens=6, **GREEDY))
    with engine_with(tiny, 4, 1, []) as plain:
        want = run(plain, prompts[:3], params[:3], [late])
    events: list = []
    with engine_with(tiny, 4, 2, events) as piped:
        got = run(piped, prompts[:3], params[:3], [late])
    assert got == want
    # the late prompt (slot 3) was read in plain windows (LaneModel checks none was in flight
    # then), after pipelined ones, and pipelining resumed once it decoded
    kinds = [e[0] for e in events]
    read = [i for i, e in enumerate(events) if e[0] == "window" and e[2] > e[1]]
    assert read and "start" in kinds[:read[-1]] and "start" in kinds[read[-1]:]
    before = [k for k in kinds[:read[-1]] if k != "window"]
    assert before[-1] == "finish"  # drained before it (plain decode windows may come between)


def test_a_cancel_in_flight_drains_first_and_frees_the_slot(tiny):
    prompts, params = _requests(3, 4)
    events: list = []
    with engine_with(tiny, 4, 2, events) as piped:
        handles = until_pipelined(piped, prompts, params, events)
        assert piped.scheduler._in_flight  # windows in flight now
        handles[1].cancel()
        piped.scheduler.drop_cancelled()
        assert not piped.scheduler._in_flight and not piped.scheduler.model.flying
        assert handles[1].is_finished and handles[1].error is None
        while not all(h.is_finished for h in handles):
            assert piped.step()
    for h in handles[:1] + handles[2:]:
        assert h.error is None and h.stats.num_generated_tokens == h.params.max_tokens


def test_a_failed_window_fails_only_its_group(tiny):
    prompts, params = _requests(4, 4)
    events: list = []
    with engine_with(tiny, 4, 2, events) as piped:
        handles = until_pipelined(piped, prompts, params, events)
        piped.scheduler.model.fail_lane = 1
        while not all(h.is_finished for h in handles):
            assert piped.step()
            piped.scheduler.model.fail_lane = None if any(
                e == ("finish", 1) for e in events) else 1
    failed = [h.slot_index % 2 == 1 for h in handles]
    for h, is_failed in zip(handles, failed):
        assert (h.error is not None) == is_failed
        if is_failed:
            assert "lane 1 failed" in str(h.error)
        else:
            assert h.stats.num_generated_tokens == h.params.max_tokens
