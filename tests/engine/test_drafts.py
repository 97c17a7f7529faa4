"""Speculative decoding with n-gram drafts (--spec-type ngram-simple): the drafter's guesses,
and the scheduler keeping exactly the tokens decoding one token per window would have made
(greedy and seeded sampling, several slots, stops, max_tokens, a full context, the next turn's
reuse)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strata import Engine, EngineConfig, SamplingParams
from strata.backends.split import choose_batch_groups
from strata.engine.drafts import DraftSettings, NgramDrafter, best_length, expected_tokens
from strata.errors import ConfigError

from request_runs import run_requests

GREEDY = dict(temperature=0.0, ignore_eos=True)
NGRAM = dict(spec_type="ngram-simple", spec_ngram_size_n=3)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from strata.tool.synth import synth_model

    path = tmp_path_factory.mktemp("drafts") / "tiny.gguf"
    synth_model(path, shape="tiny", weight_type="f32", seed=3)
    return path


# ---- the drafter ------------------------------------------------------------------------------
def reference_guess(seq: list[int], n: int, limit: int) -> list[int]:
    """What followed the last earlier occurrence of seq's last n tokens, copied on past the
    sequence's end from the guess itself; brute force."""
    if len(seq) < n or limit <= 0:
        return []
    key = seq[len(seq) - n:]
    for end in range(len(seq) - 1, n - 1, -1):
        if seq[end - n:end] == key:
            out = []
            for i in range(limit):
                out.append(seq[end + i] if end + i < len(seq) else out[end + i - len(seq)])
            return out
    return []


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=40), st.integers(1, 4), st.integers(0, 8),
       st.integers(1, 39))
def test_guesses_match_a_brute_force_search(seq, n, limit, cut):
    cut = min(cut, len(seq))
    drafter = NgramDrafter(seq[:cut], n, draft_max=8)
    drafter.extend(seq[cut:])  # grown in two steps, as prompt + generated tokens
    assert drafter.guess(limit) == reference_guess(seq, n, limit)


def test_a_loop_is_guessed_past_the_sequence_end():
    drafter = NgramDrafter([5, 1, 2, 3, 1, 2], 2, draft_max=7)
    assert drafter.guess(7) == [3, 1, 2, 3, 1, 2, 3]
    assert drafter.propose(7) == [3]  # a first draft is one token (acceptance unknown)
    assert NgramDrafter([1, 2, 3, 4], 2, draft_max=7).guess(7) == []  # key seen once


def test_draft_length_follows_the_acceptance_rate():
    # (1 + a + ... + a^k) / (1 + 0.25 k) is best at k = 1 for a = 0.5, 2 for 0.7, 6 for 0.9
    assert [best_length(a, 16) for a in (0.1, 0.5, 0.7, 0.9)] == [1, 1, 2, 6]
    assert best_length(0.999, 16) == 16 and best_length(0.9, 4) == 4
    assert expected_tokens(0.5, 2) == 1.75 and expected_tokens(1.0, 3) == 4
    drafter = NgramDrafter([1, 2, 3, 4] * 10, 2, draft_max=16)
    assert drafter.acceptance == 0.5 and len(drafter.propose(100)) == 1
    for _ in range(6):  # whole drafts accepted: longer drafts
        drafter.observe(len(drafter.propose(100)), len(drafter.propose(100)))
    assert drafter.acceptance > 0.9 and len(drafter.propose(100)) >= 6
    assert len(drafter.propose(3)) == 3  # the room left
    for _ in range(4):  # first-token misses: back to one token
        drafter.observe(len(drafter.propose(100)), 0)
    assert len(drafter.propose(100)) == 1
    drafter.observe(0, 0)  # no draft: nothing learned
    assert len(drafter.propose(100)) == 1
    short = NgramDrafter([1, 2, 3, 4] * 10, 2, draft_max=16, draft_min=6)
    assert short.propose(5) == []  # the room left is under --draft-min
    assert len(short.propose(100)) == 6


def test_settings_are_checked(tiny):
    assert not DraftSettings().is_on and DraftSettings().drafter([1, 2]) is None
    for kwargs, words in [(dict(spec_type="eagle"), "--spec-type 'eagle'"),
                          (dict(draft_max=0), "--draft-max 0"),
                          (dict(draft_min=-1), "--draft-min -1"),
                          (dict(spec_ngram_size_n=0), "--spec-ngram-size-n 0"),
                          (dict(draft_min=5, draft_max=4), "more than --draft-max 4")]:
        with pytest.raises(ConfigError, match=words):
            EngineConfig(tiny, **kwargs)
    assert EngineConfig(tiny, spec_type=" NGRAM-simple ").drafts.is_on


@pytest.mark.parametrize("value,want,words", [("auto", 1, "would switch off draft tokens"),
                                              ("2", 2, "turns off draft tokens")])
def test_drafts_keep_a_split_at_one_group_unless_groups_are_given(value, want, words):
    groups, line = choose_batch_groups(value, 2, 4, drafts=True)
    assert groups == want and words in line


# ---- the engine on the real CPU model ------------------------------------------------------
def run_all(engine, prompts, params) -> list:
    """(token ids, stats) of every request, all submitted at once."""
    return [(tokens, handle.stats) for tokens, handle in run_requests(engine, prompts, params)]


PROMPTS = [[7, 7, 7, 7], [1, 2, 3, 4, 5], [10, 20, 30, 10, 20, 30, 10, 20], [99] * 12]


def test_drafts_do_not_change_the_tokens(tiny):
    params = [SamplingParams(max_tokens=90, **GREEDY),
              SamplingParams(max_tokens=70, temperature=0.9, seed=5, ignore_eos=True),
              SamplingParams(max_tokens=80, temperature=0.7, top_k=20, seed=1,
                             repetition_penalty=1.2, ignore_eos=True),
              SamplingParams(max_tokens=60, **GREEDY)]
    results = {}
    for spec in ("none", "ngram-simple"):
        with Engine(EngineConfig(tiny, n_ctx=256, threads=2, parallel=3, spec_type=spec,
                                 spec_ngram_size_n=2)) as engine:
            results[spec] = run_all(engine, PROMPTS, params)
    for (plain, _), (drafted, stats) in zip(results["none"], results["ngram-simple"]):
        assert drafted == plain
        assert stats.num_decode_tokens == len(drafted) - 1  # the first came from the prompt
    assert sum(s.num_draft_tokens for _, s in results["ngram-simple"]) > 0
    assert all(s.num_draft_tokens == 0 for _, s in results["none"])


# ---- a model that repeats: every draft after the first loop is accepted --------------------
class LoopingModel:
    """The real CPU model, its logits pushed towards a fixed loop of tokens: after token t of
    LOOP comes the next one of LOOP, after any other token LOOP[0]. The KV and every window's
    pass are the real model's."""

    LOOP = [40, 41, 42, 43, 44, 45]

    def __init__(self, model):
        self.model = model
        self.num_rows: list[int] = []  # rows of every window

    def __getattr__(self, name):
        return getattr(self.model, name)

    def forward_window(self, window, **kwargs):
        logits = np.array(self.model.forward_window(window, **kwargs))
        self.num_rows.append(window.num_rows)
        for j, row in enumerate(window.logit_rows):
            token = int(window.tokens[row])
            nxt = (self.LOOP[(self.LOOP.index(token) + 1) % len(self.LOOP)]
                   if token in self.LOOP else self.LOOP[0])
            logits[j, nxt] += 100.0
        return logits


def looping_engine(path, **config) -> Engine:
    engine = Engine(EngineConfig(path, threads=2, **config))
    engine.scheduler.model = LoopingModel(engine.model)
    return engine


def test_a_repeating_model_decodes_several_tokens_per_window(tiny):
    with looping_engine(tiny, n_ctx=256, **NGRAM) as engine:
        (tokens, stats), = run_all(engine, [[5, 6, 7]], [SamplingParams(max_tokens=100,
                                                                        **GREEDY)])
        loop = LoopingModel.LOOP
        assert tokens == [loop[i % len(loop)] for i in range(100)]
        assert stats.num_decode_tokens == 99
        # the key (3 tokens) recurs once the loop has gone round; from then on drafts of
        # 16 tokens are accepted whole
        assert stats.num_decode_forwards < 20
        assert stats.num_accepted_draft_tokens >= 80
        assert max(engine.scheduler.model.num_rows) == 17
        # the slot holds exactly the sequence: prompt and every token but the last
        assert engine.scheduler.table.tokens(0) == [5, 6, 7] + tokens[:-1]
        assert engine.kv.num_tokens == 3 + 99


def test_drafts_stop_at_max_tokens_a_stop_token_and_a_full_context(tiny):
    loop = LoopingModel.LOOP
    with looping_engine(tiny, n_ctx=64, **NGRAM) as engine:
        (tokens, stats), = run_all(engine, [[5, 6, 7]], [SamplingParams(max_tokens=37,
                                                                        **GREEDY)])
        assert len(tokens) == 37 and stats.num_accepted_draft_tokens > 0
        assert engine.kv.num_tokens == 3 + 36  # no draft reached past max_tokens
        # a stop token inside an accepted stretch: it ends the request, the rest is dropped
        params = SamplingParams(max_tokens=60, temperature=0.0, stop_token_ids=[44],
                                ignore_eos=True)
        handle = engine.submit([1, 2, 3] + loop * 3 + [40, 41], params)
        while not handle.is_finished:
            engine.step()
        events = handle.pop_events()
        assert [e.token_id for e in events] == [42, 43, 44]
        assert events[-1].finish_reason == "stop"
        # the context fills: the last token is the one the last free cell can read back
        (tokens, stats), = run_all(engine, [[9, 8, 7]], [SamplingParams(max_tokens=500,
                                                                        **GREEDY)])
        assert len(tokens) == 64 - 3 + 1 and engine.kv.num_tokens == 64


def test_the_next_turn_reuses_a_drafted_conversation(tiny):
    with looping_engine(tiny, n_ctx=256, **NGRAM) as engine:
        prompt = [5, 6, 7]
        (tokens, stats), = run_all(engine, [prompt], [SamplingParams(max_tokens=50, **GREEDY)])
        assert stats.num_accepted_draft_tokens > 0
        follow = prompt + tokens + [9, 9]
        (more, stats2), = run_all(engine, [follow], [SamplingParams(max_tokens=5, **GREEDY)])
        assert stats2.num_cached_tokens == len(prompt) + len(tokens) - 1


def test_drafts_with_an_expert_cache_and_kv_grow(tiny):
    """Decode runs of several rows through the tier's arena, and KVs that grow into lent
    expert slots as the drafted tokens fill them: the tokens stay those of no drafts."""
    params = [SamplingParams(max_tokens=150, **GREEDY),
              SamplingParams(max_tokens=120, temperature=0.8, seed=2, ignore_eos=True)]
    results = {}
    for spec in ("none", "ngram-simple"):
        with Engine(EngineConfig(tiny, n_ctx=512, threads=2, parallel=2, expert_cache=12,
                                 kv_grow=64, spec_type=spec,
                                 spec_ngram_size_n=2)) as engine:
            results[spec] = run_all(engine, PROMPTS[:2], params)
            assert engine.expert_tier.kv_lender.num_grows > 0
    assert [t for t, _ in results["ngram-simple"]] == [t for t, _ in results["none"]]
    assert sum(s.num_draft_tokens for _, s in results["ngram-simple"]) > 0
