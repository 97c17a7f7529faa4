"""A request's life when something fails on the way: a refused KV grow, a conversation file or
slot file whose arrays are not this KV's. The request ends with a message or runs without the
bad entry; no slot stays busy, no good parked conversation is lost, the next request is served
with the tokens of a fresh engine."""
from __future__ import annotations

import logging

import numpy as np
import pytest

from strata import Engine, EngineConfig, SamplingParams
from strata.engine.conversations import ParkedConversation
from strata.engine.generate import collect
from strata.engine.kv_file import SUFFIX, read_kv_file, read_kv_header, write_kv_file
from strata.errors import RequestError
from strata.plugins import get_plugin_manager

from faulty_plugins import RefusePlugin

GREEDY = dict(temperature=0.0, ignore_eos=True)


def test_a_refused_kv_grow_keeps_the_parked_conversation_it_would_restore(wide):
    """A prompt extending a parked conversation past what KV grow can lend fails with a
    message; the parked conversation stays for the next turn (it was taken out of the cache
    before the grow was refused, and lost)."""
    pm = get_plugin_manager(autoload=False)
    pm.register(RefusePlugin(), "refuse")
    rng = np.random.default_rng(3)
    a, b = ([int(t) for t in rng.integers(10, 4000, 30)] for _ in range(2))
    params = SamplingParams(max_tokens=5, **GREEDY)
    with Engine(EngineConfig(wide, n_ctx=512, expert_cache=48, kv_grow=64),
                plugin_manager=pm) as engine:
        answer = collect(engine.generate(a, params)).token_ids
        collect(engine.generate(b, params))  # a's conversation is parked
        assert engine.scheduler.conversations.num_entries == 1
        with pytest.raises(RequestError, match="needs 135 KV cells but slot 0 has 64"):
            collect(engine.generate(a + answer + list(range(100, 200)), params))
        assert engine.scheduler.conversations.num_entries == 1
        assert engine.scheduler.table.num_idle == 1
        follow = a + answer + [7, 8]
        got = collect(engine.generate(follow, params))
        assert got.stats.num_cached_tokens == len(a) + len(answer) - 1
    with Engine(EngineConfig(wide, n_ctx=512, expert_cache=48)) as fresh:
        assert got.token_ids == collect(fresh.generate(follow, params)).token_ids


def damaged(keys, values, state, how):
    """A conversation's arrays edited `how`: a layer short, a head dim short, fewer cells than
    tokens, or (a hybrid model's) a conv state short of a layer."""
    if how == "layer":
        return keys[:1], values[:1], state
    if how == "head-dim":
        return keys[..., :-1], values[..., :-1], state
    if how == "cells":
        return keys[:, :, :10], values[:, :, :10], state
    end, (conv, ssm), checkpoints = state
    return keys, values, (end, (conv[:-1], ssm), checkpoints)


@pytest.mark.parametrize("model, how", [("tiny", "layer"), ("tiny", "head-dim"),
                                        ("tiny", "cells"), ("hybrid", "state")])
def test_a_conversation_file_of_other_shapes_is_dropped_and_the_request_runs(
        tiny_model_path, hybrid_path, tmp_path, caplog, model, how):
    """A conversation file whose header names this model and KV format but whose arrays are
    not the KV's (edited, or damaged where the header still parses) is dropped with a warning
    and the request placed again without it: before, a layer short restored silently (wrong
    tokens), other shapes failed every request sharing its prefix with a ValueError, and
    left the slot's cells half replaced."""
    path = tiny_model_path if model == "tiny" else hybrid_path
    params = SamplingParams(max_tokens=6, **GREEDY)
    first = list(range(10, 70))
    folder = tmp_path / "conversations"
    with Engine(EngineConfig(path, n_ctx=256, threads=2, conversation_cache_dir=folder)) as e:
        answer = e.generate_text(first, params).token_ids
    file, = folder.glob(f"*{SUFFIX}")
    header = read_kv_header(file)
    tokens, (keys, values, state) = read_kv_file(file, header)
    arrays = tuple(np.ascontiguousarray(a) if isinstance(a, np.ndarray) else a
                   for a in damaged(keys, values, state, how))
    write_kv_file(file, tokens, arrays, {key: header[key] for key in
                                         ("model", "kv_format", "reuse_points", "kv_nbytes")})
    follow = first + answer + [5, 6, 7]
    with Engine(EngineConfig(path, n_ctx=256, threads=2)) as fresh:
        want = fresh.generate_text(follow, params).token_ids
    with caplog.at_level(logging.WARNING, "strata.engine"), \
            Engine(EngineConfig(path, n_ctx=256, threads=2,
                                conversation_cache_dir=folder)) as e:
        got = e.generate_text(follow, params)
        assert got.token_ids == want and got.stats.num_cached_tokens == 0
        assert e.scheduler.conversations.disk.num_entries == 0  # the file is dropped
        again = e.generate_text(follow, params)  # the slot's own cells now
        assert again.token_ids == want and again.stats.num_cached_tokens == len(follow) - 1
        assert e.scheduler.table.num_idle == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert warnings[0].startswith(f"a parked conversation of {len(tokens)} tokens cannot be "
                                  "restored: its ")
    assert warnings[0].endswith("; dropped, the request is placed again without it")


@pytest.mark.parametrize("how", ["layer", "head-dim"])
def test_a_slot_file_of_other_shapes_is_refused_and_the_slot_kept(tiny_model_path, how):
    """A slot file whose arrays are not this KV's is a RequestError (a 400) before the slot
    changes: before, a layer short restored silently and a head dim short failed inside the
    restore (a 500) with the slot's cells half replaced."""
    params = SamplingParams(max_tokens=4, **GREEDY)
    with Engine(EngineConfig(tiny_model_path, n_ctx=160, parallel=1)) as engine:
        prompt = list(range(20, 50))
        first = collect(engine.generate(prompt, params))
        tokens, (keys, values, state), points, nbytes = engine.scheduler.export_slot(0)
        bad = ParkedConversation(0, tokens, damaged(keys, values, state, how), nbytes, points)
        with pytest.raises(RequestError, match=r"the slot file cannot be restored: its keys "
                                               r"are \(.*\) of float32, this KV's"):
            engine.scheduler.install_slot(0, bad)
        assert engine.scheduler.table.tokens(0) == tokens  # the slot is as it was
        again = collect(engine.generate(prompt, params))
        assert again.token_ids == first.token_ids
        assert again.stats.num_cached_tokens == len(prompt) - 1
