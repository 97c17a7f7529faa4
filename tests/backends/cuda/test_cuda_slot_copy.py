"""A request that shares a long prefix with a busy slot copies that slot's cells on the GPU
backend too (fp16 and int8 KV, host copies between the slots' device cells): it reads only its
own tokens, and both answers equal the ones a fresh run gives."""
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
