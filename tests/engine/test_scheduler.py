"""The scheduler behind the engine: concurrent slots equal solo runs, queueing, placement with
parked conversations, cancellation, prompt reading interleaved with decoding, the agent pattern.
"""
from __future__ import annotations

import logging
import re

import numpy as np
import pytest
from faulty_plugins import BadPickerPlugin

from strata import Engine, EngineConfig, SamplingParams, hookimpl
from strata.engine.generate import collect
from strata.engine.interleave import ReadPlan
from strata.engine.scheduler import STATE_DECODING, STATE_QUEUED, STATE_READING
from strata.errors import ConfigError
from strata.plugins import get_plugin_manager

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_8k(tmp_path_factory):
    """The tiny synth model with room for long conversations."""
    from strata.tool.synth import synth_model

    path = tmp_path_factory.mktemp("models") / "tiny-8k.gguf"
    synth_model(path, shape="tiny", weight_type="f32", seed=5, context_length=8192)
    return path


def new_engine(path, parallel=1, n_ctx=4096, plugin_manager=None, **options) -> Engine:
    return Engine(EngineConfig(path, n_ctx=n_ctx, threads=2, parallel=parallel, **options),
                  plugin_manager=plugin_manager)


def random_tokens(rng, n: int) -> list[int]:
    return [int(t) for t in rng.integers(10, 4000, n)]


def run_all(engine: Engine, handles) -> list[list[int]]:
    """Step until every handle finished; each one's generated token ids."""
    tokens = [[] for _ in handles]
    while not all(h.is_finished for h in handles):
        assert engine.step()
        for out, h in zip(tokens, handles):
            out += [e.token_id for e in h.pop_events()]
    for h in handles:
        assert h.error is None
    return tokens


def solo(path, prompt, params) -> list[int]:
    with new_engine(path) as fresh:
        return collect(fresh.generate(prompt, params)).token_ids


def test_concurrent_requests_equal_solo_runs(model_8k):
    rng = np.random.default_rng(1)
    prompts = [random_tokens(rng, n) for n in (40, 7, 300)]
    params = [SamplingParams(max_tokens=12, **GREEDY), SamplingParams(max_tokens=5, **GREEDY),
              SamplingParams(max_tokens=9, temperature=0.9, seed=4, ignore_eos=True)]
    with new_engine(model_8k, parallel=3, prompt_chunk_tokens=64) as engine:
        handles = [engine.submit(p, sp) for p, sp in zip(prompts, params)]
        assert [h.slot_index for h in handles] == [0, 1, 2]
        together = run_all(engine, handles)
    assert [len(t) for t in together] == [12, 5, 9]
    assert together == [solo(model_8k, p, sp) for p, sp in zip(prompts, params)]


def test_a_request_waits_while_every_slot_is_busy(model_8k):
    rng = np.random.default_rng(2)
    prompts = [random_tokens(rng, 20) for _ in range(3)]
    params = [SamplingParams(max_tokens=n, **GREEDY) for n in (3, 8, 4)]
    with new_engine(model_8k, parallel=2) as engine:
        handles = [engine.submit(p, sp) for p, sp in zip(prompts, params)]
        assert [h.state for h in handles] == [STATE_READING, STATE_READING, STATE_QUEUED]
        assert (engine.num_running, engine.num_queued, engine.num_reading) == (2, 1, 2)
        engine.step()  # one prompt chunk per window: the first prompt
        assert (engine.num_running, engine.num_queued, engine.num_reading) == (2, 1, 1)
        engine.step()
        assert (engine.num_running, engine.num_queued, engine.num_reading) == (2, 1, 0)
        engine.step()  # the first request's third token ends it: its slot goes to the third
        assert handles[0].is_finished and handles[2].state == STATE_READING
        assert handles[2].slot_index == handles[0].slot_index
        assert engine.num_queued == 0
        results = run_all(engine, handles)
    assert results[1:] == [solo(model_8k, p, sp) for p, sp in zip(prompts[1:], params[1:])]


def test_parked_conversations_are_restored_with_one_slot(model_8k, caplog):
    caplog.set_level(logging.INFO, logger="strata.engine")
    rng = np.random.default_rng(3)
    params = SamplingParams(max_tokens=6, **GREEDY)
    with new_engine(model_8k, parallel=1) as engine:
        first = {name: random_tokens(rng, 300) for name in "ab"}
        answers = {name: collect(engine.generate(first[name], params)) for name in "ab"}
        assert engine.scheduler.conversations.num_entries == 1  # a, parked when b came
        for name in "ab":
            caplog.clear()
            prompt = first[name] + answers[name].token_ids + random_tokens(rng, 25)
            res = collect(engine.generate(prompt, params))
            # Everything but the last answer token (never read back) comes from the park.
            assert res.stats.num_cached_tokens == 300 + 5
            assert res.stats.num_prompt_tokens_computed == len(prompt) - 305
            assert "slot 0 restored a parked conversation of 305 tokens" in caplog.text
            assert f"prompt {len(prompt)} tokens = 305 reused + {len(prompt) - 305} read" \
                in caplog.text
            assert res.token_ids == solo(model_8k, prompt, params)


def test_a_conversation_over_the_budget_parks_its_longest_prefix_that_fits(model_8k, caplog):
    caplog.set_level(logging.INFO, logger="strata.engine")
    rng = np.random.default_rng(9)
    params = SamplingParams(max_tokens=4, **GREEDY)
    with new_engine(model_8k, parallel=1, conversation_cache_mib=0.05) as engine:
        kv = engine.scheduler.kvs[0]
        token_bytes = 2 * kv.num_layers * kv.spec.n_kv_heads * kv.spec.head_dim \
            * kv.dtype.itemsize
        fit = int(0.05 * 2**20) // token_bytes
        a = random_tokens(rng, fit + 200)
        answer = collect(engine.generate(a, params))
        collect(engine.generate(random_tokens(rng, 30), params))  # a is parked: too large
        assert f"slot 0: parked the first {fit} of its {len(a) + 3} tokens" in caplog.text
        caplog.clear()
        prompt = a + answer.token_ids + random_tokens(rng, 10)
        res = collect(engine.generate(prompt, params))
        assert f"slot 0 restored a parked conversation of {fit} tokens" in caplog.text
        assert res.stats.num_cached_tokens == fit
        assert res.token_ids == solo(model_8k, prompt, params)


def test_a_small_loss_is_not_parked_where_copies_are_dear(model_8k, monkeypatch, caplog):
    """Device KV (min_copy_gain 0.25, set here on the host KV): an editor's next completion
    keeps 95% of the slot; parking all of it to save the other 5% would cost more."""
    from strata.engine.kv import KVCache

    monkeypatch.setattr(KVCache, "min_copy_gain", 0.25)
    caplog.set_level(logging.INFO, logger="strata.engine")
    rng = np.random.default_rng(11)
    params = SamplingParams(max_tokens=4, **GREEDY)
    with new_engine(model_8k, parallel=1) as engine:
        prompt = random_tokens(rng, 200)
        collect(engine.generate(prompt, params))
        caplog.clear()
        res = collect(engine.generate(prompt[:190] + [5], params))
        assert engine.scheduler.conversations.num_entries == 0
        assert res.stats.num_cached_tokens == 190
        assert "slot 0 kept its KV (190 tokens reused); the 13 tokens after them dropped, " \
            "not parked (a park copies all 203: worth it from 25% of them)" in caplog.text
        res = collect(engine.generate(random_tokens(rng, 30), params))  # loses everything
        assert engine.scheduler.conversations.num_entries == 1


def test_the_budget_is_at_most_half_the_ram_available(model_8k, monkeypatch, caplog):
    import strata.engine.engine as engine_module

    caplog.set_level(logging.INFO, logger="strata.engine")
    monkeypatch.setattr(engine_module, "available_bytes", lambda: 100 * 2**20)
    with new_engine(model_8k, conversation_cache_mib=8192) as engine:
        assert engine.scheduler.conversations.budget_bytes == 50 * 2**20
    assert "up to 50 MiB of host RAM for parked conversations (asked: 8192 MiB; 50% of the " \
        "100 MiB available)" in caplog.text
    with new_engine(model_8k, conversation_cache_mib=-1) as engine:
        assert engine.scheduler.conversations.budget_bytes == 50 * 2**20
    with new_engine(model_8k, conversation_cache_mib=20) as engine:
        assert engine.scheduler.conversations.budget_bytes == 20 * 2**20


def test_parking_off_rebuilds_the_conversation(model_8k, caplog):
    caplog.set_level(logging.INFO, logger="strata.engine")
    rng = np.random.default_rng(4)
    params = SamplingParams(max_tokens=3, **GREEDY)
    with new_engine(model_8k, parallel=1, conversation_cache_mib=0) as engine:
        a, b = random_tokens(rng, 50), random_tokens(rng, 50)
        collect(engine.generate(a, params))
        collect(engine.generate(b, params))
        caplog.clear()
        res = collect(engine.generate(a + [7], params))
        assert res.stats.num_cached_tokens == 0
        assert "slot 0 rebuilt" in caplog.text
        assert engine.scheduler.conversations.num_entries == 0


def test_cancel_frees_the_slot_and_keeps_the_kv(model_8k):
    rng = np.random.default_rng(5)
    prompt = random_tokens(rng, 30)
    with new_engine(model_8k, parallel=1) as engine:
        first = engine.submit(prompt, SamplingParams(max_tokens=100, **GREEDY))
        for _ in range(3):
            engine.step()
        got = [e.token_id for e in first.pop_events()]
        assert len(got) == 3
        follow_up = prompt + got + random_tokens(rng, 4)
        waiting = engine.submit(follow_up, SamplingParams(max_tokens=2, **GREEDY))
        assert waiting.state == STATE_QUEUED
        first.cancel()
        engine.step()
        assert first.is_finished and first.error is None and not first.pop_events()
        # The slot holds the prompt and the two tokens read back before the cancel.
        assert waiting.stats.num_cached_tokens == 32
        assert waiting.state == STATE_DECODING
        run_all(engine, [waiting])
        assert not engine.step()


def test_cancel_while_queued(model_8k):
    with new_engine(model_8k, parallel=1) as engine:
        running = engine.submit([5, 6, 7], SamplingParams(max_tokens=2, **GREEDY))
        queued = engine.submit([8, 9], SamplingParams(max_tokens=2, **GREEDY))
        queued.cancel()
        engine.step()
        assert queued.is_finished and queued.slot_index is None and not queued.pop_events()
        assert engine.num_queued == 0
        run_all(engine, [running])


class WindowLog:
    """An observer plugin: every window's stats."""

    def __init__(self):
        self.windows = []

    @hookimpl
    def strata_window_done(self, stats):
        self.windows.append(stats)


def test_decoding_goes_on_between_prompt_chunks(model_8k, caplog):
    caplog.set_level(logging.INFO, logger="strata.engine")
    rng = np.random.default_rng(6)
    pm = get_plugin_manager(autoload=False)
    observer = WindowLog()
    pm.register(observer)
    chunk, long_len = 32, 128
    short, long = random_tokens(rng, 10), random_tokens(rng, long_len)
    long_params = SamplingParams(max_tokens=3, **GREEDY)
    with new_engine(model_8k, parallel=2, prompt_chunk_tokens=chunk,
                    plugin_manager=pm) as engine:
        decoding = engine.submit(short, SamplingParams(max_tokens=4000, **GREEDY))
        engine.step()
        reading = engine.submit(long, long_params)
        long_tokens = run_all(engine, [reading])[0]
        decoding.cancel()  # it decoded all along; the rest is not needed
        engine.step()
        short_tokens = [e.token_id for e in decoding.pop_events()]
    windows = observer.windows[1:]  # from the one that read the first chunk
    chunk_windows = [i for i, w in enumerate(windows) if w.num_prompt_rows > 0]
    num_chunks = long_len // chunk
    assert [windows[i].num_prompt_rows for i in chunk_windows] == [chunk] * num_chunks
    # The decoding slot has a row in every window, and at least one window of its own between
    # two chunks (the default policy keeps it at >= half its solo rate).
    assert all(w.num_decode_rows >= 1 for w in windows)
    assert all(b - a >= 2 for a, b in zip(chunk_windows, chunk_windows[1:]))
    assert len(short_tokens) == len(windows) + 1
    for n in range(chunk, long_len, chunk):
        assert f"reading the prompt: {n} of {long_len} tokens" in caplog.text
    assert long_tokens == solo(model_8k, long, long_params)
    assert short_tokens == solo(model_8k, short,
                                SamplingParams(max_tokens=len(short_tokens), **GREEDY))


def agent_turns(path, parallel: int, conversations: dict, num_turns: int, seed: int):
    """Run `num_turns` turns of each conversation, each round's turns submitted together in
    a shuffled order; return {name: [(prompt, answer tokens, cached tokens), ...]}."""
    rng = np.random.default_rng(seed)
    params = SamplingParams(max_tokens=5, **GREEDY)
    history = {name: [] for name in conversations}
    prompts = dict(conversations)
    with new_engine(path, parallel=parallel, n_ctx=4096, prompt_chunk_tokens=512) as engine:
        for _ in range(num_turns):
            names = list(prompts)
            rng.shuffle(names)
            handles = [engine.submit(prompts[name], params) for name in names]
            answers = run_all(engine, handles)
            for name, handle, answer in zip(names, handles, answers):
                history[name].append((prompts[name], answer, handle.stats.num_cached_tokens))
                prompts[name] = prompts[name] + answer + random_tokens(rng, 40)
    return history


@pytest.fixture(scope="module")
def fresh_answers(model_8k):
    """Greedy answers of an engine that reads each prompt whole, by prompt (shared by both
    parametrizations: the same turns must give the same prompts)."""
    answers = {}
    with new_engine(model_8k, n_ctx=4096) as fresh:
        def answer(prompt: list[int]) -> list[int]:
            if tuple(prompt) not in answers:
                fresh.reset()
                res = collect(fresh.generate(prompt, SamplingParams(max_tokens=5, **GREEDY)))
                assert res.stats.num_cached_tokens == 0
                answers[tuple(prompt)] = res.token_ids
            return answers[tuple(prompt)]

        yield answer


@pytest.mark.parametrize("parallel", [2, 1])
def test_agent_pattern_reuses_every_cached_prefix(model_8k, fresh_answers, parallel):
    rng = np.random.default_rng(7)
    conversations = {"a": random_tokens(rng, 2200), "b": random_tokens(rng, 1800)}
    history = agent_turns(model_8k, parallel, conversations, num_turns=4, seed=8)
    for name, turns in history.items():
        assert turns[0][2] == 0
        for (prompt, answer, _), (_, _, cached) in zip(turns, turns[1:]):
            # The whole previous turn but its last answer token (never read back).
            assert cached == len(prompt) + len(answer) - 1
        for prompt, answer, _ in turns:
            assert answer == fresh_answers(prompt)


def test_log_names_the_slot_and_the_reuse(model_8k, caplog):
    caplog.set_level(logging.INFO, logger="strata.engine")
    params = SamplingParams(max_tokens=2, **GREEDY)
    with new_engine(model_8k, parallel=2) as engine:
        first = collect(engine.generate([5, 6, 7, 8], params))
        res = collect(engine.generate([5, 6, 7, 8] + first.token_ids + [9], params))
    assert res.stats.num_cached_tokens == 5
    lines = [r.getMessage() for r in caplog.records]
    assert any(re.fullmatch(r"request 1: slot 0 rebuilt \(0 tokens reused\)", x) for x in lines)
    assert any(re.fullmatch(r"request 2: slot 0 kept its KV \(5 tokens reused\)", x)
               for x in lines)
    assert any(re.fullmatch(r"request 2: prompt 7 tokens = 5 reused \+ 2 read in \d+ ms", x)
               for x in lines)


def test_parallel_must_be_a_slot_count(model_8k):
    for bad in (0, 9):
        with pytest.raises(ConfigError, match="parallel"):
            EngineConfig(model_8k, parallel=bad)
    for bad in (-2, -0.5, float("inf"), True):
        with pytest.raises(ConfigError, match="conversation_cache_mib"):
            EngineConfig(model_8k, conversation_cache_mib=bad)
    assert EngineConfig(model_8k, conversation_cache_mib=-1).conversation_cache_mib == -1


def test_a_faulty_slot_picker_fails_the_request_with_a_message(model_8k):
    pm = get_plugin_manager(autoload=False)
    pm.register(BadPickerPlugin())
    with new_engine(model_8k, parallel=2, plugin_manager=pm) as engine:
        with pytest.raises(ConfigError, match="slot picker 'bad' chose slot 2"):
            collect(engine.generate([5, 6, 7], SamplingParams(max_tokens=2, **GREEDY)))
        assert not engine.step() and engine.num_running == 0


def test_a_request_copies_a_busy_slots_prefix(model_8k, caplog):
    """Two agents share a long system prompt: the second, arriving while the first decodes,
    copies the first's cells of it and reads only its own tokens; both answers equal fresh
    runs."""
    caplog.set_level(logging.INFO, logger="strata.engine")
    rng = np.random.default_rng(11)
    shared = random_tokens(rng, 700)
    first, second = shared + random_tokens(rng, 30), shared + random_tokens(rng, 25)
    params = SamplingParams(max_tokens=24, **GREEDY)
    with new_engine(model_8k, parallel=2) as engine:
        a = engine.submit(first, params)
        while a.state != STATE_DECODING:
            assert engine.step()
        b = engine.submit(second, params)
        answers = run_all(engine, [a, b])
    assert b.stats.num_cached_tokens == len(shared)
    assert any(re.fullmatch(rf"request 2: slot 1 copied the first {len(shared)} cells of busy "
                            rf"slot 0's KV \({len(shared)} tokens reused\)", r.getMessage())
               for r in caplog.records)
    assert answers == [solo(model_8k, first, params), solo(model_8k, second, params)]


def test_a_slot_whose_kv_copies_run_sits_out_while_others_decode(model_8k, caplog):
    """A device KV's park or restore may still be crossing PCIe when its request is placed
    (backends/cuda/kv_copies.py): the request sits out of windows while another slot decodes,
    and the engine waits for the copies only when nothing else can run. Here slot 1's KV says
    its copies run for its first three looks."""
    caplog.set_level(logging.DEBUG, logger="strata.engine")
    rng = np.random.default_rng(11)
    first, second = random_tokens(rng, 30), random_tokens(rng, 40)
    params = SamplingParams(max_tokens=12, **GREEDY)
    with new_engine(model_8k, parallel=2) as engine:
        kv = engine.scheduler.kvs[1]
        looks, settles = [], []
        kv.copies_pending = lambda: (looks.append(1), len(looks) <= 3)[1]
        kv.settle = lambda: settles.append(1)
        a = engine.submit(first, params)
        while a.state != STATE_DECODING:
            assert engine.step()
        a.pop_events()
        b = engine.submit(second, params)
        assert b.slot_index == 1 and b.state == STATE_READING
        for _ in range(3):  # slot 1 sits out; slot 0 decodes a token each window
            assert engine.step()
            assert kv.num_tokens == 0 and len(a.pop_events()) == 1
        assert "slots [1] sit out this window" in caplog.text
        results = run_all(engine, [a, b])
        assert not settles  # slot 0 had work every time slot 1 was held
        assert results[1] == solo(model_8k, second, params)

        # alone, a slot whose copies run is waited for, not skipped
        for other in engine.scheduler.kvs:
            other.copies_pending = lambda: not settles
            other.settle = lambda: settles.append(1)
        c = engine.submit(first, SamplingParams(max_tokens=3, **GREEDY))
        assert engine.step()
        assert settles == [1] and f"slot {c.slot_index}: waited" in caplog.text
        assert c.state == STATE_DECODING  # its prompt was read in that window
        run_all(engine, [c])


# ---- faulty plugins: the engine goes on --------------------------------------------------
class FaultyInterleave:
    """A read-interleave plugin whose every plan is wrong in the same way."""

    name = "faulty"

    def __init__(self, answer):
        self.answer, self.num_calls = answer, 0

    def plan(self, reads, num_decoding_slots, timing):
        self.num_calls += 1
        return self.answer(reads[0]) if reads else None

    @hookimpl
    def strata_read_interleave(self):
        return self


def raises(read):
    raise ZeroDivisionError("bad arithmetic")


@pytest.mark.parametrize("answer, problem", [
    (lambda read: None, "returned None, not a ReadPlan"),
    (lambda read: ReadPlan(read.slot_index, 0, 0, None), "a chunk of 0 tokens of a read with"),
    (lambda read: ReadPlan(read.slot_index, read.num_tokens_left + 1, 0, None),
     "tokens of a read with"),
    (lambda read: ReadPlan(7, 16, 0, None), "slot 7 has no prompt to read"),
    (lambda read: ReadPlan(read.slot_index, 16.0, 0, None), "chunk_tokens 16.0 is not an int"),
    (lambda read: ReadPlan(read.slot_index, 16, -1, None), "-1 decode windows"),
    (raises, "raised ZeroDivisionError: bad arithmetic"),
], ids=["none", "zero", "over", "no-slot", "float", "negative", "raises"])
def test_a_faulty_read_plan_is_replaced_by_the_builtin_one(model_8k, caplog, answer, problem):
    rng = np.random.default_rng(12)
    prompts = [random_tokens(rng, 40), random_tokens(rng, 100)]
    params = SamplingParams(max_tokens=6, **GREEDY)
    plugin = FaultyInterleave(answer)
    pm = get_plugin_manager(autoload=False)
    pm.register(plugin, name="faulty-plugin")
    with new_engine(model_8k, parallel=2, prompt_chunk_tokens=32) as engine:
        want = run_all(engine, [engine.submit(p, params) for p in prompts])
    with new_engine(model_8k, parallel=2, prompt_chunk_tokens=32, plugin_manager=pm) as engine:
        got = run_all(engine, [engine.submit(p, params) for p in prompts])
        again = run_all(engine, [engine.submit(prompts[0][:20], params)])
        assert engine.num_running == 0 and engine.scheduler.table.num_idle == 2
    assert got == want and len(again[0]) == 6  # the built-in planned every chunk: same windows
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and plugin.num_calls > 1  # once, then at DEBUG
    assert warnings[0].startswith("read-interleave policy 'faulty' (plugin 'faulty-plugin') ")
    assert problem in warnings[0] and "the built-in 'half-rate' plans instead" in warnings[0]


class FaultyObservers:
    """Observer plugins that raise: after the third window, and at the first request's end."""

    def __init__(self):
        self.num_requests = 0

    @hookimpl
    def strata_window_done(self, stats):
        if stats.window_index == 3:
            raise RuntimeError("window observer failed")

    @hookimpl
    def strata_request_done(self, stats):
        self.num_requests += 1
        if self.num_requests == 1:
            raise RuntimeError("request observer failed")


def test_an_observer_that_raises_fails_no_request(model_8k, caplog):
    rng = np.random.default_rng(13)
    prompts = [random_tokens(rng, 10), random_tokens(rng, 100)]
    params = [SamplingParams(max_tokens=n, **GREEDY) for n in (3, 8)]
    pm = get_plugin_manager(autoload=False)
    observers, windows = FaultyObservers(), WindowLog()
    pm.register(observers, name="faulty-observers")
    pm.register(windows, name="window-log")
    with new_engine(model_8k, parallel=2, prompt_chunk_tokens=32, plugin_manager=pm) as engine:
        got = run_all(engine, [engine.submit(p, sp) for p, sp in zip(prompts, params)])
        assert engine.num_running == 0 and engine.scheduler.table.num_idle == 2
    assert got == [solo(model_8k, p, sp) for p, sp in zip(prompts, params)]
    assert observers.num_requests == 2  # (the first request's observer raised)
    assert [w.window_index for w in windows.windows] == list(range(1, len(windows.windows) + 1))
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert sorted(errors) == [
        "plugin 'faulty-observers' failed in strata_request_done; the engine goes on (its later "
        "failures are logged at DEBUG): fix or uninstall the plugin",
        "plugin 'faulty-observers' failed in strata_window_done; the engine goes on (its later "
        "failures are logged at DEBUG): fix or uninstall the plugin"]
