"""The context an engine admits: n_ctx per slot, or less where --kv-grow's slots can never
grow that far."""
import logging

import pytest

from strata.config import EngineConfig
from strata.engine.engine import Engine
from strata.engine.sampling import SamplingParams


@pytest.mark.parametrize("options,want", [
    (dict(expert_cache=4, kv_grow=24), 64),  # 4 lendable slots x 25 cells, in 64-cell tiles
    (dict(expert_cache=32, kv_grow=24), 512),  # 800 cells: n_ctx stands
    (dict(expert_cache=4), 512),  # no KV grow: every slot holds n_ctx cells
])
def test_the_context_is_what_a_slot_can_hold(wide, caplog, options, want):
    caplog.set_level(logging.WARNING, logger="strata.engine")
    with Engine(EngineConfig(wide, n_ctx=512, adapt_every=0, parallel=2, **options)) as engine:
        assert engine.n_ctx == want
        assert ("the context is 64 tokens, not the 512 of --ctx-size" in caplog.text) == \
            (want == 64)
        # a prompt of the whole admitted context reads and gives its one token
        prompt = [(7 * i) % 3000 + 10 for i in range(engine.n_ctx)]
        events = list(engine.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0)))
        assert len(events) == 1 and events[-1].finish_reason == "length"
