"""Sampling: parameter validation, each filter on hand-computed examples, seeds, distribution."""
from __future__ import annotations

import re
from collections import Counter

import numpy as np
import pytest

from strata.engine.sampling import (Sampler, SamplingParams, apply_penalties, filter_probs,
                                    greedy)
from strata.errors import RequestError

P4 = np.log(np.array([0.1, 0.2, 0.3, 0.4]))


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -1), ("min_p", -0.1),
    ("min_p", 1.1), ("repetition_penalty", 0.0), ("presence_penalty", 2.5),
    ("frequency_penalty", -3), ("max_tokens", 0), ("temperature", float("nan")),
    ("top_k", 2.5), ("seed", "x"), ("seed", -1), ("stop", [""]), ("stop_token_ids", [-1]),
    ("max_tokens", True), ("repeat_last_n", -2), ("repeat_last_n", 1.5),
])
def test_bad_params_name_field_and_value(field, value):
    with pytest.raises(RequestError, match=f"{field} = {re.escape(repr(value))}"):
        SamplingParams(**{field: value})


def test_stop_string_becomes_a_list():
    assert SamplingParams(stop="END").stop == ["END"]


def test_greedy_ties_go_to_lowest_id():
    assert greedy(np.array([1.0, 3.0, 3.0, 2.0], dtype=np.float32)) == 1


def test_repetition_penalty_divides_positive_multiplies_negative():
    logits = np.array([2.0, -1.0, 0.5, 1.0], dtype=np.float32)
    out = apply_penalties(logits, {0, 1}, Counter(), 2.0, 0.0, 0.0)
    np.testing.assert_array_equal(out, [1.0, -2.0, 0.5, 1.0])
    np.testing.assert_array_equal(logits, [2.0, -1.0, 0.5, 1.0])  # input untouched


def test_presence_and_frequency_penalties_count_generated_tokens():
    logits = np.zeros(4, dtype=np.float32)
    out = apply_penalties(logits, {0, 1, 3}, Counter({0: 1, 1: 2}), 1.0, 0.5, 0.25)
    # token 3 was only in the prompt: no presence/frequency penalty for it
    np.testing.assert_allclose(out, [-0.75, -1.0, 0.0, 0.0])


def test_all_penalties_together():
    logits = np.array([2.0, -1.0, 0.5, 1.0], dtype=np.float32)
    out = apply_penalties(logits, {0, 1, 2}, Counter({2: 3}), 2.0, 0.5, 0.25)
    # rep: [1, -2, 0.25, 1]; then token 2: 0.25 - (3 * 0.25 + 0.5) = -1.0
    np.testing.assert_allclose(out, [1.0, -2.0, -1.0, 1.0])


def test_logit_bias_is_added_after_the_penalties():
    logits = np.array([2.0, -1.0, 0.5, 1.0], dtype=np.float32)
    out = apply_penalties(logits, {0, 1, 2}, Counter({2: 3}), 2.0, 0.5, 0.25,
                          {0: -3.0, 3: 1.5})
    # the penalties as above: [1, -2, -1, 1]; then token 0 - 3 and token 3 + 1.5
    np.testing.assert_allclose(out, [-2.0, -2.0, -1.0, 2.5])
    out = apply_penalties(logits, set(), Counter(), 1.0, 0.0, 0.0, {1: 100.0})
    np.testing.assert_allclose(out, [2.0, 99.0, 0.5, 1.0])


def test_logit_bias_bans_and_forces_a_token():
    logits = np.array([0.0, 5.0, 4.0, 1.0], dtype=np.float32)
    assert Sampler(SamplingParams(temperature=0.0, logit_bias={1: -100})).sample(logits) == 2
    assert Sampler(SamplingParams(temperature=0.0, logit_bias={3: 100})).sample(logits) == 3
    sampler = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=5,
                                     logit_bias={1: -100, 2: -100}))
    assert {sampler.sample(logits) for _ in range(200)} == {0, 3}


@pytest.mark.parametrize("bias,words", [
    ({-1: 1.0}, "logit_bias key -1"), ({"3": 1.0}, "logit_bias key '3'"),
    ({True: 1.0}, "logit_bias key True"), ({3: 100.5}, "logit_bias[3] = 100.5"),
    ({3: float("inf")}, "logit_bias[3] = inf"), ({3: "x"}, "logit_bias[3] = 'x'"),
    ([1, 2], "logit_bias = [1, 2]"),
])
def test_bad_logit_bias_names_the_entry(bias, words):
    with pytest.raises(RequestError, match=re.escape(words)):
        SamplingParams(logit_bias=bias)


def test_logit_bias_drops_zeros_and_keeps_ints():
    params = SamplingParams(logit_bias={np.int64(4): 2, 7: 0.0})
    assert params.logit_bias == {4: 2.0} and type(next(iter(params.logit_bias))) is int


def test_no_filters_keeps_every_id():
    ids, probs = filter_probs(P4, 1.0, 0, 1.0, 0.0)
    assert ids.tolist() == [0, 1, 2, 3]
    np.testing.assert_allclose(probs, [0.1, 0.2, 0.3, 0.4])
    ids, probs = filter_probs(P4, 1.0, 4, 1.0, 0.0)  # top-k of the whole vocabulary: no cut
    assert ids.tolist() == [0, 1, 2, 3]


def _reference_filter(logits, temperature, top_k, top_p, min_p):
    """Straightforward version: full stable sort, then each filter in turn (float64)."""
    z = logits.astype(np.float64) / temperature
    order = np.argsort(-z, kind="stable")
    if top_k > 0:
        order = order[:top_k]
    p = np.exp(z[order] - z[order].max())
    p /= p.sum()
    if top_p < 1:
        keep = int(np.argmax(np.cumsum(p) >= top_p - 1e-12)) + 1
        order, p = order[:keep], p[:keep] / p[:keep].sum()
    if min_p > 0:
        mask = p >= min_p * p[0]
        order, p = order[mask], p[mask] / p[mask].sum()
    return order, p


@pytest.mark.parametrize("seed", range(6))
def test_fast_filters_equal_the_full_sort_on_a_large_vocabulary(seed):
    rng = np.random.default_rng(seed)
    logits = (rng.normal(size=50000) * rng.uniform(0.5, 4)).astype(np.float32)
    logits[rng.integers(0, 50000, 300)] = logits.max()  # ties at the top
    logits[rng.integers(0, 50000, 300)] = np.float32(1.5)  # ties in the middle
    for top_k, top_p, min_p in [(0, 0.9, 0.0), (0, 1.0, 0.05), (0, 0.5, 0.01), (100, 0.95, 0.0),
                                (0, 0.999, 0.0), (7, 1.0, 0.0), (0, 0.2, 0.5)]:
        temperature = float(rng.uniform(0.3, 1.5))
        ids, probs = filter_probs(logits, temperature, top_k, top_p, min_p)
        ref_ids, ref_probs = _reference_filter(logits, temperature, top_k, top_p, min_p)
        assert ids.tolist() == ref_ids.tolist(), (top_k, top_p, min_p)
        np.testing.assert_allclose(probs, ref_probs, rtol=1e-9)


def test_temperature_sharpens():
    ids, probs = filter_probs(P4, 0.5, 0, 1.0, 0.0)
    # p^(1/T) renormalised, in id order (no filter): [.01, .04, .09, .16] / .30
    assert ids.tolist() == [0, 1, 2, 3]
    np.testing.assert_allclose(probs, np.array([0.01, 0.04, 0.09, 0.16]) / 0.30)


def test_top_k():
    ids, probs = filter_probs(P4, 1.0, 2, 1.0, 0.0)
    assert ids.tolist() == [3, 2]
    np.testing.assert_allclose(probs, [4 / 7, 3 / 7])


def test_top_k_ties_keep_lowest_ids():
    ids, _ = filter_probs(np.array([1.0, 2.0, 2.0, 2.0, 0.0]), 1.0, 2, 1.0, 0.0)
    assert ids.tolist() == [1, 2]


def test_top_p_keeps_smallest_prefix_reaching_p():
    ids, probs = filter_probs(P4, 1.0, 0, 0.7, 0.0)
    assert ids.tolist() == [3, 2]
    np.testing.assert_allclose(probs, [4 / 7, 3 / 7])
    ids, probs = filter_probs(P4, 1.0, 0, 0.71, 0.0)
    assert ids.tolist() == [3, 2, 1]
    np.testing.assert_allclose(probs, np.array([0.4, 0.3, 0.2]) / 0.9)
    ids, _ = filter_probs(P4, 1.0, 0, 0.05, 0.0)
    assert ids.tolist() == [3]


def test_min_p_relative_to_the_top_token():
    ids, probs = filter_probs(P4, 1.0, 0, 1.0, 0.5)  # keep p >= 0.2
    assert ids.tolist() == [3, 2, 1]
    np.testing.assert_allclose(probs, np.array([0.4, 0.3, 0.2]) / 0.9)
    ids, _ = filter_probs(P4, 1.0, 0, 1.0, 0.6)  # keep p >= 0.24
    assert ids.tolist() == [3, 2]


def test_filters_chain_in_order():
    # top-k 3 -> [.4,.3,.2]/.9; top-p 0.5 -> .444 < .5 so keep 2 -> [4/7, 3/7]; min-p 0.8 -> 1 left.
    ids, probs = filter_probs(P4, 1.0, 3, 0.5, 0.0)
    assert ids.tolist() == [3, 2]
    ids, probs = filter_probs(P4, 1.0, 3, 0.5, 0.8)
    assert ids.tolist() == [3] and probs.tolist() == [1.0]


def test_greedy_sampler_with_penalty_avoids_repeats():
    s = Sampler(SamplingParams(temperature=0, repetition_penalty=4.0), prompt_tokens=[3])
    # 0.4 / 4 < 0.3: the prompt's token 3 loses to token 2 (logits are positive here).
    logits = np.array([0.1, 0.2, 0.3, 0.4], dtype=np.float32)
    assert s.sample(logits) == 2
    assert s.sample(logits) == 1  # 2 is now seen too: 0.3/4 < 0.2
    assert s.seen == {1, 2, 3}
    assert s.generated == Counter({2: 1, 1: 1})


def test_repeat_last_n_windows_the_repetition_penalty():
    """llama.cpp's repeat_last_n: the penalty covers the last N tokens, prompt and generated
    (-1 all, 0 none); presence and frequency stay on every generated token."""
    logits = np.array([0.1, 0.2, 0.3, 0.4, 0.35], dtype=np.float32)
    s = Sampler(SamplingParams(temperature=0, repetition_penalty=4.0, repeat_last_n=2),
                prompt_tokens=[3, 3, 2, 4])
    assert s.seen == {2, 4}  # the prompt's last two
    assert s.sample(logits) == 3  # 4 and 2 penalised, 3 fell out of the window
    assert s.seen == {4, 3}
    assert s.sample(logits) == 2  # 4 and 3 penalised; 2 has left the window
    assert s.seen == {3, 2}
    assert s.sample(logits) == 4
    assert s.generated == Counter({3: 1, 2: 1, 4: 1})
    none = Sampler(SamplingParams(temperature=0, repetition_penalty=4.0, repeat_last_n=0),
                   prompt_tokens=[3])
    assert none.sample(logits) == 3 and none.sample(logits) == 3 and not none.seen
    every = Sampler(SamplingParams(temperature=0, repetition_penalty=4.0, repeat_last_n=-1),
                    prompt_tokens=[3, 4])
    assert every.seen == {3, 4} and every.sample(logits) == 2


def test_repeat_last_n_longer_than_the_prompt_covers_the_whole_prompt():
    """A window longer than the prompt holds every prompt token, not its last (2 len - N)."""
    for last_n in (4, 5, 6, 9):
        s = Sampler(SamplingParams(temperature=0, repetition_penalty=4.0, repeat_last_n=last_n),
                    prompt_tokens=[1, 2, 3])
        assert s.seen == {1, 2, 3}, last_n
    s = Sampler(SamplingParams(temperature=0, repetition_penalty=4.0, repeat_last_n=5),
                prompt_tokens=[3, 2, 1])
    logits = np.array([0.1, 0.4, 0.3, 0.35], dtype=np.float32)
    assert s.sample(logits) == 0  # 1, 2 and 3 are all in the window: each penalised
    assert s.sample(logits) == 1  # the window of 5 holds [3, 2, 1, 0]: 0 penalised too


def test_frequency_penalty_grows_with_each_repeat():
    s = Sampler(SamplingParams(temperature=0, frequency_penalty=0.3), prompt_tokens=[0])
    logits = np.array([1.0, 0.5, 0.0], dtype=np.float32)
    # 1.0 -> 0.7 -> 0.4 (< 0.5): the prompt token 0 itself is not penalised.
    assert [s.sample(logits) for _ in range(4)] == [0, 0, 1, 0]


def _draws(seed, n=30, vocab=50):
    rng = np.random.default_rng(123)
    logits = [rng.normal(size=vocab).astype(np.float32) for _ in range(n)]
    s = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed))
    return [s.sample(x) for x in logits]


def test_same_seed_same_tokens():
    assert _draws(7) == _draws(7)
    assert _draws(7) != _draws(8)


def test_draw_follows_the_distribution():
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    s = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=0))
    n = 20000
    counts = np.bincount([s.sample(np.log(probs)) for _ in range(n)], minlength=4)
    chi2 = float(((counts - n * probs) ** 2 / (n * probs)).sum())
    assert chi2 < 16.27  # chi-square, 3 degrees of freedom, p = 0.001


def test_filtered_tokens_are_never_drawn():
    s = Sampler(SamplingParams(temperature=1.0, top_k=2, top_p=1.0, min_p=0.0, seed=1))
    drawn = {s.sample(P4) for _ in range(500)}
    assert drawn == {2, 3}


def test_a_denormal_temperature_samples_like_greedy():
    logits = np.array([0.5, 3.0, -1.0, 2.9], dtype=np.float32)
    params = SamplingParams(temperature=1e-310, top_k=0, top_p=1.0, min_p=0.0, seed=1)
    assert Sampler(params, []).sample(logits) == 1
