"""A request that shares a long prefix with a busy slot copies that slot's cells on the GPU
backend too (fp16 and int8 KV, device copies between the slots' cells): it reads only its own
tokens, and both answers equal the ones a fresh run gives. Parking and restoring through the
engine (host copies read straight into the parked arrays) continue a conversation exactly."""
import numpy as np
import pytest

from strata import Engine, EngineConfig, SamplingParams
from strata.engine.generate import collect
from strata.engine.scheduler import STATE_DECODING

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("kv_type", ["f16", "int8"])
def test_a_busy_slots_prefix_is_copied(synth_path, kv_type):
    path = synth_path("tiny", "q8_0")
    rng = np.random.default_rng(3)
    shared = rng.integers(10, 2000, 300).tolist()
    first = shared + rng.integers(10, 2000, 20).tolist()
    second = shared + rng.integers(10, 2000, 15).tolist()
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=16)
    with Engine(EngineConfig(path, n_ctx=1024, parallel=2, device="cuda",
                             kv_type=kv_type)) as engine:
        a = engine.submit(first, params)
        while a.state != STATE_DECODING:
            assert engine.step()
        b = engine.submit(second, params)
        tokens = [[], []]
        while not (a.is_finished and b.is_finished):
            assert engine.step()
            for out, h in zip(tokens, (a, b)):
                out += [e.token_id for e in h.pop_events()]
        assert a.error is None and b.error is None
        assert b.stats.num_cached_tokens == len(shared)
        for prompt, got in zip((first, second), tokens):
            engine.reset()
            fresh = collect(engine.generate(prompt, params))
            assert fresh.stats.num_cached_tokens == 0 and fresh.token_ids == got


@pytest.mark.parametrize("kv_type", ["f16", "int8"])
def test_a_parked_conversation_comes_back_exactly(synth_path, kv_type, caplog):
    path = synth_path("tiny", "q8_0")
    rng = np.random.default_rng(4)
    a, b = rng.integers(10, 2000, 260).tolist(), rng.integers(10, 2000, 40).tolist()
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=8)
    caplog.set_level("INFO", logger="strata.engine")
    with Engine(EngineConfig(path, n_ctx=1024, parallel=1, device="cuda",
                             kv_type=kv_type)) as engine:
        first = collect(engine.generate(a, params))
        collect(engine.generate(b, params))  # a is parked: all of it would be lost
        again = a + first.token_ids + rng.integers(10, 2000, 12).tolist()
        res = collect(engine.generate(again, params))
        assert "restored a parked conversation of 267 tokens" in caplog.text
        assert res.stats.num_cached_tokens == 267
        engine.reset()
        assert collect(engine.generate(again, params)).token_ids == res.token_ids


def test_export_prefix_equals_the_layers_host_copies(synth_path):
    path = synth_path("tiny", "q8_0")
    with Engine(EngineConfig(path, n_ctx=256, device="cuda")) as engine:
        collect(engine.generate(list(range(10, 60)), SamplingParams(max_tokens=2)))
        kv = engine.scheduler.kvs[0]
        k, v = kv.export_prefix(30)
        assert k.shape == (kv.num_layers, kv.spec.n_kv_heads, 30, kv.spec.head_dim)
        for layer in range(kv.num_layers):
            assert np.array_equal(k[layer], kv.keys(layer)[:, :30])
            assert np.array_equal(v[layer], kv.values(layer)[:, :30])
