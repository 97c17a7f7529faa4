"""llama.cpp's post_sampling_probs figures (logprobs.chain_logprob): the distribution the
sampler drew from, after its filters, against a float64 reference."""
import math

import numpy as np

from strata.engine.logprobs import certain, chain_logprob
from strata.engine.sampling import filter_probs


def test_chain_figures_are_the_filtered_distribution():
    rng = np.random.default_rng(3)
    logits = rng.normal(0, 2, 500).astype(np.float32)
    ids, probs = filter_probs(logits, 0.7, 5, 1.0, 0.0)
    best = np.argsort(-logits.astype(np.float64), kind="stable")[:5]
    z = logits[best].astype(np.float64) / 0.7
    expected = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
    lp = chain_logprob(ids, probs, int(best[2]), 3)
    assert math.isclose(math.exp(lp.logprob), expected[2], rel_tol=1e-9)
    assert [t for t, _ in lp.top] == best[:3].tolist()
    assert np.allclose([math.exp(v) for _, v in lp.top], expected[:3], rtol=1e-9)
    every = chain_logprob(ids, probs, int(best[0]), 20)  # no more than the candidates
    assert len(every.top) == 5 and math.isclose(sum(math.exp(v) for _, v in every.top), 1.0)


def test_ties_zero_and_outside_tokens():
    ids, probs = np.array([9, 4, 7]), np.array([0.4, 0.4, 0.0])
    lp = chain_logprob(ids, probs, 9, 3)
    assert [t for t, _ in lp.top] == [4, 9]  # a tie: the lower id first; a zero left out
    outside = chain_logprob(ids, probs, 5, 2)  # a constraint's pick the candidates lack
    assert outside.logprob == 0.0
    assert certain(5) == chain_logprob(np.array([5]), np.ones(1), 5, 4)
