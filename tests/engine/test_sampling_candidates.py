"""The sampler's candidate path (logit rows left on the device) against its whole-row path:
the same tokens for the same seeds over random parameters, and a whole-row copy only where
the candidates cannot decide. Rows here are host rows with the device row's interface; the
kernel itself is checked against the same reference on the GPU (test_cuda_sample.py)."""
from __future__ import annotations

from collections import Counter

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from sampling_ref import HostLogitRow, reference_candidates
from strata.engine.sampling import Sampler, SamplingParams, penalty_entries


def _pair(params: dict, prompt: list[int]):
    return (Sampler(SamplingParams(**params), prompt_tokens=prompt),
            Sampler(SamplingParams(**params), prompt_tokens=prompt))


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), temperature=st.sampled_from([0.0, 0.3, 0.8, 1.5]),
       top_k=st.sampled_from([0, 1, 5, 40, 2000]), top_p=st.sampled_from([0.5, 0.9, 1.0]),
       min_p=st.sampled_from([0.0, 0.05, 0.3]), rep=st.sampled_from([1.0, 1.3, 0.8]),
       presence=st.sampled_from([0.0, 0.5, -0.5]), freq=st.sampled_from([0.0, 0.4]),
       padded=st.booleans(), bias=st.sampled_from(["none", "small", "ban", "force"]))
def test_candidates_give_the_tokens_of_the_whole_row(seed, temperature, top_k, top_p, min_p,
                                                     rep, presence, freq, padded, bias):
    rng = np.random.default_rng(seed)
    V = 3000
    num_valid = V - 37 if padded else V
    biased = rng.choice(num_valid, size=40, replace=False)
    logit_bias = {"none": {}, "small": {int(t): float(rng.uniform(-3, 3)) for t in biased},
                  "ban": {int(t): -100.0 for t in biased},
                  "force": {int(biased[0]): 100.0, int(biased[1]): 50.0}}[bias]
    params = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                  repetition_penalty=rep, presence_penalty=presence, frequency_penalty=freq,
                  seed=seed, logit_bias=logit_bias)
    prompt = rng.integers(0, V, size=20).tolist()
    whole, cand = _pair(params, prompt)
    for _ in range(6):
        logits = (rng.standard_normal(V) * 3).astype(np.float32)
        logits[rng.integers(0, V, size=50)] = logits.max()  # ties at the top
        host = logits.copy()
        host[num_valid:] = -np.inf
        want = whole.sample(host)
        got = cand.sample_candidates(HostLogitRow(logits), num_valid)
        assert got == want
        assert got < num_valid
        if bias == "ban":
            assert got not in logit_bias
        if bias == "force" and temperature == 0.0:
            assert got == biased[0]


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), rep=st.sampled_from([1.0, 1.3]), padded=st.booleans(),
       pad_wins=st.booleans())
def test_greedy_rows_take_the_pass_argmax(seed, rep, padded, pad_wins):
    """A greedy request without penalties takes the row's greedy_id (the pass's argmax) and asks
    no candidates; with penalties, or when the argmax is a padded id, it asks the candidates;
    the token is the whole-row path's either way."""
    rng = np.random.default_rng(seed)
    V = 3000
    num_valid = V - 37 if padded else V
    params = dict(temperature=0.0, repetition_penalty=rep, seed=seed)
    prompt = rng.integers(0, V, size=20).tolist()
    whole, cand = _pair(params, prompt)
    for _ in range(6):
        logits = (rng.standard_normal(V) * 3).astype(np.float32)
        logits[rng.integers(0, V, size=50)] = logits.max()  # ties at the top
        if pad_wins:
            logits[-1] = logits.max() + 1.0  # a padded id (when padded) is the argmax
        host = logits.copy()
        host[num_valid:] = -np.inf
        want = whole.sample(host)
        row = HostLogitRow(logits, with_greedy_id=True)
        assert cand.sample_candidates(row, num_valid) == want
        asked = rep != 1.0 or row.greedy_id >= num_valid
        assert row.num_candidate_calls == int(asked)
    nan = np.zeros(V, dtype=np.float32)
    nan[5] = np.nan
    assert Sampler(SamplingParams(temperature=0.0)).sample_candidates(
        HostLogitRow(nan, with_greedy_id=True), V) is None


def test_whole_row_copied_only_when_candidates_cannot_decide():
    V = 5000
    flat = np.zeros(V, dtype=np.float32)  # uniform: top-p 0.9 needs 4500 tokens
    row = HostLogitRow(flat)
    Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=0.9, min_p=0.0, seed=1)
            ).sample_candidates(row, V)
    assert row.num_whole_copies == 1
    peaked = np.full(V, -20.0, dtype=np.float32)
    peaked[:10] = 5.0
    row = HostLogitRow(peaked)
    Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=0.9, min_p=0.0, seed=1)
            ).sample_candidates(row, V)
    assert row.num_whole_copies == 0
    row = HostLogitRow(peaked)  # top-k above the candidates the device returns
    Sampler(SamplingParams(temperature=1.0, top_k=2000, top_p=1.0, min_p=0.0, seed=1)
            ).sample_candidates(row, V)
    assert row.num_whole_copies == 1


def test_nan_row_gives_none():
    logits = np.zeros(100, dtype=np.float32)
    logits[7] = np.nan
    for temperature in (0.0, 1.0):
        s = Sampler(SamplingParams(temperature=temperature, seed=0))
        assert s.sample_candidates(HostLogitRow(logits), 100) is None


def test_padded_ids_do_not_force_greedy_on_the_whole_row_path():
    # -inf padding used to make every sampled token greedy (isfinite over the whole row)
    logits = np.zeros(10, dtype=np.float32)
    logits[8:] = -np.inf
    s = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=3))
    assert len({s.sample(logits) for _ in range(200)}) == 8


def test_penalty_entries_carry_the_logit_bias():
    ids, rep, sub = penalty_entries({3}, Counter({5: 2}), 1.5, 0.25, 0.5, {5: 1.0, 8: -100.0})
    assert ids.tolist() == [3, 5, 8] and ids.dtype == np.int32
    np.testing.assert_array_equal(rep, np.array([1.5, 1.0, 1.0], dtype=np.float32))
    np.testing.assert_array_equal(sub, np.array([0.0, 0.25, 100.0], dtype=np.float32))
    ids, rep, sub = penalty_entries(set(), Counter(), 1.0, 0.0, 0.0, {2: 7.0})
    assert ids.tolist() == [2] and rep.tolist() == [1.0] and sub.tolist() == [-7.0]


def test_greedy_rows_with_a_bias_ask_the_candidates():
    logits = np.array([0.0, 5.0, 4.0, 1.0], dtype=np.float32)
    row = HostLogitRow(logits, with_greedy_id=True)
    sampler = Sampler(SamplingParams(temperature=0.0, logit_bias={1: -100}))
    assert sampler.sample_candidates(row, 4) == 2
    assert row.num_candidate_calls == 1


def test_penalty_entries_exact():
    from collections import Counter
    ids, rep, sub = penalty_entries({3, 5}, Counter({5: 2, 9: 1}), 1.5, 0.25, 0.5)
    np.testing.assert_array_equal(ids, [3, 5, 9])
    np.testing.assert_array_equal(rep, np.float32([1.5, 1.5, 1.0]))
    np.testing.assert_array_equal(sub, np.float32([0.0, 1.25, 0.75]))
    assert penalty_entries({3}, Counter(), 1.0, 0.0, 0.0) is None


def test_reference_ties_go_to_lowest_id():
    ids, values, _, _ = reference_candidates(np.float32([1, 3, 3, 2, 3]), 3, 1.0, None, 5, False)
    np.testing.assert_array_equal(ids, [1, 2, 4])
    np.testing.assert_array_equal(values, [3, 3, 3])
