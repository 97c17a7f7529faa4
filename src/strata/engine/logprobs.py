"""Log probabilities of generated tokens (OpenAI's `logprobs` / `top_logprobs`; llama.cpp's
`n_probs`, and with `post_sampling_probs` the sampler chain's figures: `chain_logprob`).

A token's log probability is taken from the model's own distribution over the vocabulary: the
log-softmax of the raw logits row, before temperature, penalties, logit_bias, filters or a
constraint (vLLM's default, "raw logprobs"). So the figure says how likely the model found the
token, whatever the sampler then did, and it is the same on every backend.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from strata.errors import ModelFormatError

MAX_TOP_LOGPROBS = 20  # most alternatives a request may ask for per token (OpenAI's limit)


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log probability and the `top` most likely tokens at its position,
    as (token id, log probability), most likely first (ties: lower id first)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprob(logits, token_id: int, num_top: int, num_valid: int) -> TokenLogprob:
    """`logits` [V]: a host array, or a row the backend left on the device (one with
    `candidates`, backends/cuda/logits.py), whose figures the device reduces; ids from
    `num_valid` on (padded embedding rows) are not tokens and take no share."""
    if hasattr(logits, "candidates"):
        return _device_logprob(logits, int(token_id), num_top, num_valid)
    row = np.asarray(logits, dtype=np.float32).reshape(-1)[:num_valid]
    peak = float(row.max())
    if not np.isfinite(peak):  # NaN, +inf, or no finite logit: no distribution to read
        raise _corrupt_row(peak, int(np.argmax(row)) if peak == np.inf else None)
    # log-sum-exp, summed in float64: 150K terms of float32 would lose the small ones
    lse = peak + float(np.log(np.exp(row - peak).sum(dtype=np.float64)))
    top: tuple[tuple[int, float], ...] = ()
    if num_top > 0:
        k = min(num_top, row.shape[0])
        kth = -np.partition(-row, k - 1)[k - 1]  # the k-th highest logit
        ids = np.flatnonzero(row >= kth)  # every id tied with it too, so ties go by id
        ids = ids[np.lexsort((ids, -row[ids]))][:k]  # by logit, highest first; then lower id
        top = tuple((int(i), float(row[i]) - lse) for i in ids)
    return TokenLogprob(int(token_id), float(row[token_id]) - lse, top)


def chain_logprob(ids, probs, token_id: int, num_top: int) -> TokenLogprob:
    """llama.cpp's `post_sampling_probs` figures, as logs: the chosen token's probability in
    the distribution the sampler drew it from (`ids` and their `probs`: what is left after
    the penalties, logit_bias, temperature, top-k, top-p and min-p; a greedy pick alone with
    1), and the `num_top` likeliest of those candidates (ties: lower id first). A candidate of
    probability 0 is left out; a token picked outside them (a constraint's best allowed one)
    was certain: 1, as llama.cpp reports a token its candidates lack."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    probs = np.asarray(probs, dtype=np.float64).reshape(-1)
    keep = probs > 0
    ids, probs = ids[keep], probs[keep]
    hit = np.flatnonzero(ids == token_id)
    logprob = math.log(probs[hit[0]]) if hit.size else 0.0
    order = np.lexsort((ids, -probs))[:max(num_top, 0)]
    top = tuple((int(ids[i]), math.log(probs[i])) for i in order)
    return TokenLogprob(int(token_id), logprob, top)


def certain(token_id: int) -> TokenLogprob:
    """A token that was sure to be picked (a greedy one) in `chain_logprob`'s terms."""
    return TokenLogprob(int(token_id), 0.0, ((int(token_id), 0.0),))


def _corrupt_row(peak: float, token_id: int | None) -> ModelFormatError:
    """The error for a logits row whose largest value `peak` is not finite (NaN, +inf at
    `token_id`, or -inf: every logit -inf): log probabilities are undefined there."""
    what = ("a NaN logit" if np.isnan(peak) else "no finite logit" if peak < 0
            else f"an infinite logit (token {token_id})")
    return ModelFormatError(f"the model produced {what}, so the token's log probability is "
                            "undefined; its weights are likely corrupt (check it with "
                            "`strata-tool inspect`)")


def _device_logprob(row, token_id: int, num_top: int, num_valid: int) -> TokenLogprob:
    """The same figures from a device row without copying it: its best candidates at
    temperature 1 with their softmax mass (sum of exp(x - x_max) over the valid ids), and the
    chosen token's logit read alone when it is not among them."""
    found = row.candidates(max(num_top, 1), 1.0, None, num_valid, want_mass=True)
    if found is None:
        raise _corrupt_row(float("nan"), None)
    peak = float(found.values[0])
    if not np.isfinite(peak):
        raise _corrupt_row(peak, int(found.ids[0]))
    lse = peak + math.log(found.mass)
    hit = np.flatnonzero(found.ids == token_id)
    value = float(found.values[hit[0]]) if hit.size else row.value(token_id)
    best = zip(found.ids[:num_top], found.values[:num_top])
    top = tuple((int(i), float(v) - lse) for i, v in best)
    return TokenLogprob(token_id, value - lse, top)
