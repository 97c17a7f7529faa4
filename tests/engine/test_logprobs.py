"""Generated tokens' log probabilities (SamplingParams.logprobs): the figures against torch's
log_softmax of the model's own logits for the same sequence, their top alternatives, the stop
token left out, drafts and sampling changing nothing."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from sampling_ref import HostLogitRow
from strata import Engine, EngineConfig, SamplingParams
from strata.engine.logprobs import MAX_TOP_LOGPROBS, token_logprob
from strata.errors import ModelFormatError, RequestError


def torch_logprobs(row: np.ndarray, num_valid: int) -> np.ndarray:
    return torch.log_softmax(torch.from_numpy(row[:num_valid].astype(np.float64)), -1).numpy()


@settings(max_examples=200, deadline=None)
@given(arrays(np.float32, st.integers(1, 300),
              elements=st.floats(-60, 60, width=32) | st.just(-np.inf)),
       st.integers(0, MAX_TOP_LOGPROBS), st.data())
def test_a_row_equals_torch(row, num_top, data):
    num_valid = data.draw(st.integers(1, row.shape[0]))
    row[data.draw(st.integers(0, num_valid - 1))] = 3.0  # at least one finite logit
    token = data.draw(st.integers(0, num_valid - 1))
    ref = torch_logprobs(row, num_valid)
    got = token_logprob(row, token, num_top, num_valid)
    assert got.token_id == token
    if np.isfinite(ref[token]):
        assert got.logprob == pytest.approx(ref[token], abs=2e-5)
    else:
        assert got.logprob == -np.inf
    # the alternatives: the best num_top valid ids, by logit then id (padded ids never)
    order = sorted(range(num_valid), key=lambda i: (-row[i], i))[:num_top]
    assert [t for t, _ in got.top] == order
    np.testing.assert_allclose([v for _, v in got.top], ref[order], atol=2e-5)


@pytest.mark.parametrize("fill,at_3,words", [
    (-np.inf, -np.inf, "no finite logit"), (0.0, np.inf, r"an infinite logit \(token 3\)"),
    (0.0, np.nan, "a NaN logit"),
])
def test_a_row_without_a_distribution_is_a_model_error(fill, at_3, words):
    """A damaged model's row (NaN, +inf, or no finite logit), on the host or on the device,
    ends the request with an error that says so, as NaN logits do for the sampler."""
    row = np.full(8, fill, np.float32)
    row[3] = at_3
    for source in (row, HostLogitRow(row)):  # HostLogitRow: a device row's contract
        with pytest.raises(ModelFormatError, match=words + ".*weights are likely corrupt"):
            token_logprob(source, 3, 2, 8)


@pytest.mark.parametrize("value", [-1, MAX_TOP_LOGPROBS + 1, True, 1.5, "3"])
def test_params_refuse_a_bad_count(value):
    with pytest.raises(RequestError, match="logprobs"):
        SamplingParams(logprobs=value)


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    with Engine(EngineConfig(tiny_model_path, n_ctx=256, threads=2)) as engine:
        yield engine


def expected(engine, prompt: list[int], generated: list[int]) -> np.ndarray:
    """log_softmax (torch) of the model's logits at each generated token's position [T, V]."""
    model = engine.model
    tokens = np.array(prompt + generated[:-1], dtype=np.int32)
    logits = np.asarray(model.forward(tokens, model.new_kv(len(tokens) + 1), all_logits=True))
    num_valid = engine.tokenizer.vocab_size
    return np.stack([torch_logprobs(row, num_valid) for row in logits[len(prompt) - 1:]])


PROMPT_TEXT = "The list of colours is red, green, blue, red, green,"


@pytest.mark.parametrize("params", [
    dict(temperature=0.0),
    dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=11),
    dict(temperature=0.7, seed=5, repetition_penalty=1.3, logit_bias={7: 5.0}),
])
def test_events_carry_the_model_distribution(engine, params):
    engine.reset()
    prompt = engine.tokenize(PROMPT_TEXT)
    events = list(engine.generate(prompt, SamplingParams(max_tokens=12, ignore_eos=True,
                                                         logprobs=4, **params)))
    generated = [e.token_id for e in events]
    ref = expected(engine, prompt, generated)
    for i, event in enumerate(events):
        lp = event.logprob
        assert lp.token_id == event.token_id
        # the raw distribution, whatever temperature, penalties and bias did to the draw
        assert lp.logprob == pytest.approx(ref[i, event.token_id], abs=1e-4)
        best = np.argsort(-ref[i], kind="stable")[:4]
        assert [t for t, _ in lp.top] == list(best)
        np.testing.assert_allclose([v for _, v in lp.top], ref[i, best], atol=1e-4)
        if params["temperature"] == 0.0:
            assert lp.top[0][0] == event.token_id


def test_off_by_default_and_zero_alternatives(engine):
    engine.reset()
    prompt = engine.tokenize(PROMPT_TEXT)
    plain = list(engine.generate(prompt, SamplingParams(temperature=0, max_tokens=4)))
    assert all(e.logprob is None for e in plain)
    engine.reset()
    bare = list(engine.generate(prompt, SamplingParams(temperature=0, max_tokens=4,
                                                       logprobs=0)))
    assert [e.token_id for e in bare] == [e.token_id for e in plain]  # asking changes nothing
    assert all(e.logprob.top == () and e.logprob.logprob <= 0 for e in bare)


def test_the_stop_token_has_no_entry(engine):
    engine.reset()
    prompt = engine.tokenize(PROMPT_TEXT)
    first = list(engine.generate(prompt, SamplingParams(temperature=0, max_tokens=3,
                                                        ignore_eos=True)))
    stop_id = first[1].token_id  # made a stop token: the request ends on it
    engine.reset()
    events = list(engine.generate(prompt, SamplingParams(temperature=0, max_tokens=3,
                                                         stop_token_ids=[stop_id],
                                                         logprobs=1)))
    assert [e.token_id for e in events] == [first[0].token_id, stop_id]
    assert events[0].logprob is not None and events[1].logprob is None
    assert events[1].finish_reason == "stop"


def test_drafts_give_the_same_figures(tiny_model_path):
    prompt_text = "one two three one two three one two three one two"
    results = []
    for spec in ({}, dict(spec_type="ngram-simple", spec_ngram_size_n=2)):
        with Engine(EngineConfig(tiny_model_path, n_ctx=256, threads=2, **spec)) as engine:
            prompt = engine.tokenize(prompt_text)
            events = list(engine.generate(prompt, SamplingParams(
                temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)))
            results.append([(e.token_id, e.logprob) for e in events])
    plain, drafted = results
    assert [t for t, _ in plain] == [t for t, _ in drafted]
    for (_, a), (_, b) in zip(plain, drafted):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]


def prompt_expected(engine, prompt: list[int]) -> np.ndarray:
    model = engine.model
    tokens = np.array(prompt, dtype=np.int32)
    logits = np.asarray(model.forward(tokens, model.new_kv(len(tokens)), all_logits=True))
    return np.stack([torch_logprobs(row, engine.tokenizer.vocab_size) for row in logits[:-1]])


def check_prompt_figures(engine, prompt, figures, num_top):
    ref = prompt_expected(engine, prompt)
    assert len(figures) == len(prompt) - 1
    for i, lp in enumerate(figures):
        assert lp.token_id == prompt[i + 1]
        assert lp.logprob == pytest.approx(ref[i, prompt[i + 1]], abs=1e-4)
        assert [t for t, _ in lp.top] == list(np.argsort(-ref[i], kind="stable")[:num_top])


def test_prompt_logprobs_over_several_chunks(engine):
    from strata.engine.scheduler import PROMPT_LOGPROBS_CHUNK

    prompt = engine.tokenize(" ".join(f"w{i % 17}" for i in range(60)))
    assert len(prompt) > PROMPT_LOGPROBS_CHUNK  # read in more than one window
    engine.reset()
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=2)
    events = list(engine.generate(prompt, params))
    check_prompt_figures(engine, prompt, events[0].prompt_logprobs, 2)
    assert all(e.prompt_logprobs is None for e in events[1:])
    assert events[0].logprob is None  # generated tokens' figures are asked apart
    # the same prompt again: its cells are in the slot, but every row is read again
    events = list(engine.generate(prompt, params))
    assert engine.last_stats.num_cached_tokens == 0
    check_prompt_figures(engine, prompt, events[0].prompt_logprobs, 2)


def test_prompt_logprobs_beside_a_decoding_request(tiny_model_path):
    with Engine(EngineConfig(tiny_model_path, n_ctx=512, threads=2, parallel=2)) as engine:
        other = engine.submit(engine.tokenize("red green blue"),
                              SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
        engine.step()
        engine.step()  # decoding now
        prompt = engine.tokenize(" ".join(f"v{i % 13}" for i in range(60)))
        scored = engine.submit(prompt, SamplingParams(temperature=0, max_tokens=2,
                                                      ignore_eos=True, prompt_logprobs=0))
        events = []
        while not scored.is_finished:
            engine.step()
            events += scored.pop_events()
        check_prompt_figures(engine, prompt, events[0].prompt_logprobs, 0)
        assert not other.is_finished  # it decoded beside the scored prompt's windows
        while not other.is_finished:
            engine.step()
        assert other.error is None and other.stats.num_generated_tokens == 40


class _RowWithCandidates:
    """A host row answering as a device row does (backends/cuda/logits.py's contract:
    `candidates` best first, ties by id, with the softmax mass; `value` one logit), so the
    reduction that runs on GPU rows is checked here against the host's."""

    def __init__(self, row):
        self.row = row
        self.num_values_read = 0

    def candidates(self, num, temperature, penalties, num_valid, want_mass):
        from strata.backends.cuda.logits import Candidates

        assert temperature == 1.0 and penalties is None and want_mass
        valid = self.row[:num_valid].astype(np.float64)
        ids = np.array(sorted(range(num_valid), key=lambda i: (-valid[i], i))[:num])
        mass = float(np.exp(valid - valid.max()).sum())
        return Candidates(ids.astype(np.int32), valid[ids].astype(np.float32), mass)

    def value(self, token):
        self.num_values_read += 1
        return float(self.row[token])


@settings(max_examples=100, deadline=None)
@given(arrays(np.float32, st.integers(2, 200), elements=st.floats(-30, 30, width=32)),
       st.integers(0, MAX_TOP_LOGPROBS), st.data())
def test_the_device_reduction_equals_the_host_one(row, num_top, data):
    num_valid = data.draw(st.integers(1, row.shape[0]))
    token = data.draw(st.integers(0, num_valid - 1))
    device_row = _RowWithCandidates(row)
    got = token_logprob(device_row, token, num_top, num_valid)
    want = token_logprob(row, token, num_top, num_valid)
    assert got.token_id == want.token_id
    assert got.logprob == pytest.approx(want.logprob, abs=2e-5)
    assert [t for t, _ in got.top] == [t for t, _ in want.top]
    np.testing.assert_allclose([v for _, v in got.top], [v for _, v in want.top], atol=2e-5)
    in_top = token in [t for t, _ in want.top[:max(num_top, 1)]] or (
        num_top == 0 and token == sorted(range(num_valid), key=lambda i: (-row[i], i))[0])
    assert device_row.num_values_read == (0 if in_top else 1)
