"""The engine on a hybrid model (qwen3next: gated delta-net layers with a recurrent state):
prefix reuse only where the state exists (the slot's end, checkpoints), parking with the state,
drafts turned off; every answer equals a fresh engine's."""
from __future__ import annotations

import logging

from strata import Engine, EngineConfig, SamplingParams
from strata.engine.generate import collect

GREEDY = dict(temperature=0.0, ignore_eos=True)


def fresh_tokens(path, prompt, params) -> list[int]:
    with Engine(EngineConfig(path, n_ctx=160)) as fresh:
        result = collect(fresh.generate(prompt, params))
        assert result.stats.num_cached_tokens == 0
        return result.token_ids


def test_reuse_goes_to_the_end_or_a_checkpoint(hybrid_path):
    params = SamplingParams(max_tokens=6, **GREEDY)
    with Engine(EngineConfig(hybrid_path, n_ctx=160)) as engine:
        p1 = engine.tokenize("The quick brown fox jumps over the lazy dog, twice.")
        r1 = collect(engine.generate(p1, params))
        assert r1.stats.num_cached_tokens == 0
        kv = engine.scheduler.kvs[0]
        assert kv.reuse_points() == (len(p1) - 1, len(p1) + 5)
        # the next turn extends everything the slot holds: its state at the end
        p2 = p1 + r1.token_ids + engine.tokenize(" And then?")
        r2 = collect(engine.generate(p2, params))
        assert r2.stats.num_cached_tokens == len(p1) + 5
        # a turn that keeps p1 but not the reply (a template rendering it anew): the
        # checkpoint before p1's last token
        p3 = p1 + engine.tokenize(" Something else.")
        r3 = collect(engine.generate(p3, params))
        assert r3.stats.num_cached_tokens == len(p1) - 1
        # the same prompt again: all but its last token, from its own checkpoint
        r3b = collect(engine.generate(p3, params))
        assert r3b.stats.num_cached_tokens == len(p3) - 1
        assert r3b.token_ids == r3.token_ids
        # diverging inside p1, before any checkpoint: nothing to go back to
        p4 = p1[:4] + engine.tokenize(" a different story")
        r4 = collect(engine.generate(p4, params))
        assert r4.stats.num_cached_tokens == 0
    for prompt, result in ((p2, r2), (p3, r3), (p4, r4)):
        assert fresh_tokens(hybrid_path, prompt, params) == result.token_ids


def test_parked_conversation_comes_back_with_its_state(hybrid_path):
    params = SamplingParams(max_tokens=5, **GREEDY)
    with Engine(EngineConfig(hybrid_path, n_ctx=160, parallel=1)) as engine:
        a1 = engine.tokenize("Conversation A starts here with a question.")
        ra = collect(engine.generate(a1, params))
        b1 = engine.tokenize("Conversation B is about something else.")
        collect(engine.generate(b1, params))  # parks A
        assert engine.scheduler.conversations.num_entries == 1
        a2 = a1 + ra.token_ids + engine.tokenize(" Go on.")
        ra2 = collect(engine.generate(a2, params))  # A restored from the parked copy
        assert ra2.stats.num_cached_tokens == len(a1) + 4
        a3 = a1 + engine.tokenize(" Go elsewhere.")  # parks A's second turn, restores at a1-1
        ra3 = collect(engine.generate(a3, params))
        assert ra3.stats.num_cached_tokens == len(a1) - 1
    assert fresh_tokens(hybrid_path, a2, params) == ra2.token_ids
    assert fresh_tokens(hybrid_path, a3, params) == ra3.token_ids


def test_chunked_prompt_and_batched_slots_equal_fresh(hybrid_path):
    params = SamplingParams(max_tokens=8, **GREEDY)
    prompts = ["One prompt that is long enough to be read in several chunks of five.",
               "Another one.", "A third, of middling length, for the third slot."]
    config = EngineConfig(hybrid_path, n_ctx=160, parallel=3, prompt_chunk_tokens=5)
    with Engine(config) as engine:
        ids = [engine.tokenize(p) for p in prompts]
        handles = [engine.submit(p, params) for p in ids]
        while not all(h.is_finished for h in handles):
            assert engine.step()
        got = [[e.token_id for e in h.pop_events()] for h in handles]
    for prompt, tokens in zip(ids, got):
        assert fresh_tokens(hybrid_path, prompt, params) == tokens


def test_drafts_are_turned_off(hybrid_path, caplog):
    params = SamplingParams(max_tokens=6, **GREEDY)
    config = EngineConfig(hybrid_path, n_ctx=160, spec_type="ngram-simple")
    with caplog.at_level(logging.WARNING, logger="strata.engine"):
        with Engine(config) as engine:
            prompt = engine.tokenize("a b a b a b a b")
            result = collect(engine.generate(prompt, params))
    assert "drafts off" in caplog.text
    assert result.stats.num_draft_tokens == 0
    assert fresh_tokens(hybrid_path, prompt, params) == result.token_ids


def test_no_checkpoints_reuses_only_the_end(hybrid_path):
    params = SamplingParams(max_tokens=4, **GREEDY)
    with Engine(EngineConfig(hybrid_path, n_ctx=160, ctx_checkpoints=0)) as engine:
        p1 = engine.tokenize("Checkpoints are off for this engine.")
        r1 = collect(engine.generate(p1, params))
        assert engine.scheduler.kvs[0].reuse_points() == (len(p1) + 3,)
        r2 = collect(engine.generate(p1 + r1.token_ids + [5], params))
        assert r2.stats.num_cached_tokens == len(p1) + 3
        r3 = collect(engine.generate(p1, params))
        assert r3.stats.num_cached_tokens == 0 and r3.token_ids == r1.token_ids


def test_a_layer_range_keeps_the_layer_pattern_and_costs(hybrid_path):
    """A stage of a layer split sees which of its layers are recurrent as the whole model
    does; the split planner counts cells for attention layers only, a state for the others."""
    from strata.backends.cuda.stage import LayerRange
    from strata.backends.split import layer_costs
    from strata.model.gguf_file import GGUFModel

    with GGUFModel.open(hybrid_path) as gguf:
        spec = gguf.spec
        assert spec.recurrent_layers == (0, 2) and spec.attention_layers == (1, 3)
        for first, stop in ((0, 1), (1, 4), (1, 3), (3, 4)):
            stage = LayerRange(gguf, first, stop).spec
            assert stage.first_layer == first
            assert [stage.is_recurrent(i) for i in range(stop - first)] == \
                [spec.is_recurrent(i) for i in range(first, stop)]
        costs = layer_costs(gguf)
        assert costs.kv_bytes_per_token[0] == costs.kv_bytes_per_token[2] == 0
        assert costs.kv_bytes_per_token[1] == 2 * spec.n_kv_heads * spec.head_dim * 2


def test_a_parked_conversation_goes_back_to_its_oldest_checkpoint(hybrid_path):
    """A parked entry restored for a prompt that keeps only its oldest checkpoint, with every
    checkpoint taken: the state goes in at that checkpoint (restored at the entry's end, the
    checkpoint kept there pushed the one the prompt needed out: the request failed)."""
    params = SamplingParams(max_tokens=4, **GREEDY)
    config = EngineConfig(hybrid_path, n_ctx=160, parallel=1, ctx_checkpoints=1)
    with Engine(config) as engine:
        a1 = engine.tokenize("Conversation A asks a question here.")
        ra = collect(engine.generate(a1, params))
        collect(engine.generate(engine.tokenize("Conversation B, elsewhere."), params))
        parked = engine.scheduler.conversations
        key = parked.keys()[0]
        assert parked.get(key).reuse_points == (len(a1) - 1, len(a1) + 3)
        again = collect(engine.generate(a1, params))  # the same prompt: A's checkpoint
        assert again.stats.num_cached_tokens == len(a1) - 1
        assert again.token_ids == ra.token_ids
        assert engine.scheduler.kvs[0].state.positions() == (len(a1) - 1,)
    assert fresh_tokens(hybrid_path, a1, params) == again.token_ids


def test_a_slot_file_whose_points_miss_its_states_is_refused_and_the_slot_kept(hybrid_path):
    """A hand-made or damaged slot file naming a reuse point where it holds no recurrent state
    is a RequestError (a 400) before the slot changes (it failed inside the restore, a 500 with
    the slot's cells half replaced)."""
    import pytest

    from strata.engine.conversations import ParkedConversation
    from strata.errors import RequestError

    params = SamplingParams(max_tokens=4, **GREEDY)
    with Engine(EngineConfig(hybrid_path, n_ctx=160, parallel=1)) as engine:
        prompt = engine.tokenize("A slot file is saved from this conversation.")
        first = collect(engine.generate(prompt, params))
        tokens, arrays, points, nbytes = engine.scheduler.export_slot(0)
        bogus = tuple(sorted(set(points) | {3}))  # no state was kept at 3 tokens
        with pytest.raises(RequestError, match=r"do not match its recurrent states \(none at"):
            engine.scheduler.install_slot(0, ParkedConversation(
                0, tokens[:4], arrays, nbytes, (3,)))
        assert engine.scheduler.table.tokens(0) == tokens  # the slot is as it was
        again = collect(engine.generate(prompt, params))
        assert again.token_ids == first.token_ids
        assert engine.scheduler.install_slot(0, ParkedConversation(
            0, tokens, arrays, nbytes, bogus)) == len(tokens)  # the end still restores
