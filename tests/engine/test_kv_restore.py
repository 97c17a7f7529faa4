"""Cells going back into a host KV: a parked conversation's (`restore_cells`) and a busy slot's
prefix (`copy_prefix`) give the cells `append` would have, and a parked entry that lends a
prefix (another conversation's system prompt) has only that prefix copied into the slot."""
from __future__ import annotations

import logging

import numpy as np
import pytest

from strata import Engine, EngineConfig, SamplingParams
from strata.engine.generate import collect
from strata.engine.kv import KVCache
from strata.model.gguf_file import GGUFModel

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def spec(tiny_model_path):
    with GGUFModel.open(tiny_model_path) as gguf:
        return gguf.spec


def filled(spec, rng, num_tokens: int, dtype, capacity: int = 300) -> KVCache:
    """A KV whose cells were appended a few rows at a time, as windows write them."""
    kv = KVCache(spec, capacity, dtype=dtype)
    shape = (spec.n_kv_heads, num_tokens, spec.head_dim)
    done = 0
    while done < num_tokens:
        step = min(int(rng.integers(1, 50)), num_tokens - done)
        for layer in range(kv.num_layers):
            k = rng.standard_normal(shape)[:, :step].astype(dtype)
            v = rng.standard_normal(shape)[:, :step].astype(dtype)
            kv.append(layer, k, v)
        kv.commit(step)
        done += step
    return kv


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("num_tokens", [0, 1, 63, 64, 65, 200])
def test_restored_and_copied_cells_are_the_appended_ones(spec, dtype, num_tokens):
    rng = np.random.default_rng(num_tokens)
    source = filled(spec, rng, 230, dtype)
    keys, values = source.export_prefix(230)  # [L, KV, n, D], as a park gives them
    restored = filled(spec, rng, 17, dtype)  # cells of its own first: all replaced
    restored.restore_cells(keys, values, num_tokens)
    copied = filled(spec, rng, 280, dtype)
    copied.copy_prefix(source, num_tokens)
    for kv in (restored, copied):
        assert kv.num_tokens == num_tokens
        for layer in range(kv.num_layers):
            assert np.array_equal(kv.keys(layer), source.keys(layer)[:, :num_tokens])
            assert np.array_equal(kv.values(layer), source.values(layer)[:, :num_tokens])
        # and the next rows append after them as they would after a prompt read
        k = rng.standard_normal((spec.n_kv_heads, 3, spec.head_dim)).astype(dtype)
        for layer in range(kv.num_layers):
            got_k, _ = kv.append(layer, k, k)
            assert np.array_equal(got_k[:, num_tokens:], k)
        kv.commit(3)


def test_a_restore_of_more_cells_than_the_arrays_hold_is_refused(spec):
    rng = np.random.default_rng(0)
    keys, values = filled(spec, rng, 10, np.float32).export_prefix(10)
    kv = KVCache(spec, 64)
    with pytest.raises(ValueError, match="fewer than the 11"):
        kv.restore_cells(keys, values, 11)


def test_a_lent_prefix_copies_only_its_cells(tiny_model_path, caplog):
    """B shares only a system prompt with parked A: the slot gets the first cells of A's
    entry, not all of them cut back afterwards; B's answer is a fresh engine's, and A's own
    next turn still restores all of A."""
    caplog.set_level(logging.INFO, logger="strata.engine")
    rng = np.random.default_rng(5)
    system = rng.integers(10, 4000, 40).tolist()
    a = system + rng.integers(10, 4000, 150).tolist()
    b = system + rng.integers(10, 4000, 9).tolist()
    with Engine(EngineConfig(tiny_model_path, n_ctx=512, threads=2, parallel=1)) as engine:
        first_a = collect(engine.generate(a, GREEDY))
        collect(engine.generate(rng.integers(10, 4000, 20).tolist(), GREEDY))  # parks A
        caplog.clear()
        got_b = collect(engine.generate(b, GREEDY))
        assert got_b.stats.num_cached_tokens == len(system)
        assert (f"slot 0 restored the first {len(system)} of a parked conversation's "
                f"{len(a) + 3} tokens") in caplog.text
        a2 = a + first_a.token_ids + rng.integers(10, 4000, 5).tolist()
        got_a2 = collect(engine.generate(a2, GREEDY))
        assert got_a2.stats.num_cached_tokens == len(a) + 3
        fresh = []
        for prompt in (b, a2):
            engine.reset()
            fresh.append(collect(engine.generate(prompt, GREEDY)).token_ids)
    assert [got_b.token_ids, got_a2.token_ids] == fresh


def test_a_file_that_lends_a_system_prompt_stays(tiny_model_path, tmp_path):
    """A restarted engine lends A's file's system prompt to conversation C; C's own file,
    written at the stop, must not replace A's (A's next turn found only the system prompt
    then, in C's file, and read the rest of A again)."""
    rng = np.random.default_rng(8)
    system = rng.integers(10, 4000, 40).tolist()
    a = system + rng.integers(10, 4000, 50).tolist()
    c = system + rng.integers(10, 4000, 6).tolist()

    def engine():
        return Engine(EngineConfig(tiny_model_path, n_ctx=256, threads=2,
                                   conversation_cache_dir=tmp_path))
    with engine() as e:
        first_a = collect(e.generate(a, GREEDY)).token_ids
    with engine() as e:
        assert collect(e.generate(c, GREEDY)).stats.num_cached_tokens == len(system)
    a2 = a + first_a + [7, 8, 9]
    with engine() as e:
        got = collect(e.generate(a2, GREEDY))
        assert got.stats.num_cached_tokens == len(a) + len(first_a) - 1
        e.reset()
        assert collect(e.generate(a2, GREEDY)).token_ids == got.token_ids
