"""A slot file (llama.cpp's slot restore) whose reuse points or recurrent checkpoints are not
token counts of the file: refused with a RequestError before the slot changes (a negative point
was installed as a slot of -3 tokens: every later request in that slot failed)."""
from __future__ import annotations

import pytest

from strata import Engine, EngineConfig, SamplingParams
from strata.engine.conversations import ParkedConversation
from strata.engine.generate import collect
from strata.errors import RequestError

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
PROMPT = list(range(20, 40))


@pytest.mark.parametrize("which", ["tiny", "hybrid"])
def test_a_negative_reuse_point_is_refused_and_the_slot_kept(tiny_model_path, hybrid_path,
                                                             which):
    path = tiny_model_path if which == "tiny" else hybrid_path
    with Engine(EngineConfig(path, n_ctx=160, parallel=1)) as engine:
        first = collect(engine.generate(PROMPT, GREEDY))
        tokens, (k, v, state), points, nbytes = engine.scheduler.export_slot(0)
        if state is not None:  # a hybrid file with a state where the bogus point says
            end, live, checkpoints = state
            state = (end, live, {**checkpoints, -3: live})
        with pytest.raises(RequestError, match=r"reuse points \[-3\] are not token counts"):
            engine.scheduler.install_slot(0, ParkedConversation(
                0, tokens, (k, v, state), nbytes, (-3,)))
        assert engine.scheduler.table.tokens(0) == tokens  # the slot is as it was
        assert engine.scheduler.kvs[0].num_tokens == len(tokens)
        again = collect(engine.generate(PROMPT, GREEDY))
        assert again.token_ids == first.token_ids


def test_a_checkpoint_at_no_tokens_is_refused(hybrid_path):
    with Engine(EngineConfig(hybrid_path, n_ctx=160, parallel=1)) as engine:
        first = collect(engine.generate(PROMPT, GREEDY))
        tokens, (k, v, (end, live, checkpoints)), points, nbytes = \
            engine.scheduler.export_slot(0)
        bogus = (end, live, {-3: live, **checkpoints})
        with pytest.raises(RequestError, match="recurrent states are not of this model"):
            engine.scheduler.install_slot(0, ParkedConversation(
                0, tokens, (k, v, bogus), nbytes, points))
        # a later prompt sharing 10 tokens went back to the bogus checkpoint (a 500)
        shorter = collect(engine.generate(PROMPT[:10] + [7, 8], GREEDY))
        assert shorter.stats.num_cached_tokens == 0
        assert collect(engine.generate(PROMPT, GREEDY)).token_ids == first.token_ids
