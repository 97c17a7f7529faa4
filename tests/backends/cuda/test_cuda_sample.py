"""Sampling candidates on the device (sample.cu) against the float64 reference of
tests/sampling_ref.py, and the engine's sampler on rows left on the device against the same
sampler on the copied logits."""
from collections import Counter

import numpy as np
import pytest

from sampling_ref import reference_candidates
from strata.backends.cuda.logits import LogitReader
from strata.backends.window import Window
from strata.engine.json_constraint import JsonObjectConstraint, JsonRecognizer
from strata.engine.sampling import Sampler, SamplingParams, penalty_entries
from strata.model.gguf_file import GGUFModel
from strata.model.tokenizer import Tokenizer

pytestmark = pytest.mark.cuda


class _Rows:
    """Logit rows [N, V] uploaded to the device with a LogitReader over them."""

    def __init__(self, runtime, logits):
        self.buf = runtime.upload(np.ascontiguousarray(logits, dtype=np.float32))
        self.reader = LogitReader(runtime, lambda: int(self.buf), logits.shape[1])


@pytest.mark.parametrize("V", [1000, 151936])
@pytest.mark.parametrize("num", [1, 40, 1000, 1024])
def test_candidates_equal_reference(runtime, V, num):
    rng = np.random.default_rng(V + num)
    N = 3
    logits = (rng.standard_normal((N, V)) * 4).astype(np.float32)
    logits[1, rng.integers(0, V, size=300)] = logits[1].max()  # many ties at the top
    logits[2, :] = np.round(logits[2] * 2) / 2  # ties everywhere
    rows = _Rows(runtime, logits)
    for n in range(N):
        seen = set(rng.integers(0, V, size=500).tolist())
        gen = Counter(rng.integers(0, V, size=30).tolist())
        biased = rng.integers(0, V - 17, size=40)
        values = rng.choice([-100.0, -2.5, 3.0, 60.0], 40)
        bias = {int(t): float(b) for t, b in zip(biased, values)}
        for pen in (None, penalty_entries(seen, gen, 1.3, 0.4, 0.2),
                    penalty_entries(seen, gen, 1.3, 0.4, 0.2, bias),
                    penalty_entries(set(), Counter(), 1.0, 0.0, 0.0, bias)):
            for num_valid in (V, V - 17):
                for want_mass, temp in ((False, 1.0), (True, 0.7)):
                    got = rows.reader.candidates(n, 0, num, temp, pen, num_valid, want_mass)
                    ids, values, mass, has_nan = reference_candidates(
                        logits[n], num, temp, pen, num_valid, want_mass)
                    assert not has_nan
                    np.testing.assert_array_equal(got.ids, ids)
                    np.testing.assert_array_equal(got.values, values)
                    if want_mass:
                        assert abs(got.mass - mass) <= 1e-12 * mass


def test_candidates_report_nan(runtime):
    logits = np.zeros((1, 5000), dtype=np.float32)
    logits[0, 4321] = np.nan
    rows = _Rows(runtime, logits)
    for num in (10, 1):  # the select and the greedy rows' block max
        assert rows.reader.candidates(0, 0, num, 1.0, None, 5000, num > 1) is None
        assert rows.reader.candidates(0, 0, num, 1.0, None, 4000, num > 1) is not None


def test_argmax_rows_lowest_id_on_ties_and_minus_one_for_nan(runtime):
    """The pass's greedy ids (argmax_rows), which greedy requests without penalties take: the
    largest value's lowest id (ties, -0 against +0), -1 for a row holding a NaN."""
    rng = np.random.default_rng(5)
    V = 151936
    logits = (rng.standard_normal((4, V)) * 3).astype(np.float32)
    logits[1, [7, 90000, 151935]] = 50.0  # ties: the lowest id
    logits[2, :] = -1.0
    logits[2, 123] = -0.0
    logits[2, 45] = 0.0  # -0 == +0: the lowest id
    logits[3, 99999] = np.nan
    buf, out = runtime.upload(logits), runtime.alloc(4 * 4)
    runtime.kernel("argmax_rows").prepare((4,), (1024,), "PiP", [int(buf), V, int(out)]).launch(
        runtime.stream_handle)
    runtime.synchronize()
    got = np.empty(4, dtype=np.int32)
    runtime.drv.memcpy_dtoh(got, out)
    assert got.tolist() == [int(np.argmax(logits[0])), 7, 45, -1]


def test_engine_sampler_on_device_rows_equals_copied_rows(synth_path):
    from strata.backends.cuda import CudaModel

    gguf = GGUFModel.open(synth_path("tiny", "q8_0"))
    model = CudaModel(gguf)
    tokenizer = Tokenizer.from_gguf_metadata(gguf.metadata)
    V = model.spec.vocab
    kvs = [model.new_kv(64) for _ in range(3)]
    prompts = [np.arange(5 + i, dtype=np.int32) for i in range(3)]
    bias = {int(t): b for t, b in zip(np.arange(7, V, 97), np.tile([-100.0, 2.0, 8.0], V))}
    params = [SamplingParams(temperature=0.0, seed=1, logit_bias=bias),
              SamplingParams(temperature=0.9, top_k=20, top_p=0.9, repetition_penalty=1.2,
                             seed=2, logit_bias=bias),
              SamplingParams(temperature=1.2, top_k=0, top_p=0.95, min_p=0.02, seed=3,
                             json_object=True,  # a JSON answer: the whole row, on the host
                             logit_bias={tokenizer.token_id("<think>"): -100})]

    def samplers():
        return [Sampler(p, prompt_tokens=t.tolist(), constraint=JsonObjectConstraint(
            tokenizer, tokenizer.stop_ids) if p.json_object else None)
            for p, t in zip(params, prompts)]
    on_device, on_host = samplers(), samplers()
    runs = list(zip(kvs, prompts))
    answer = []  # the JSON request's tokens
    for _ in range(12):
        window = Window.build(runs, logits="last")
        rows = model.forward_window_lazy(window)
        host = np.asarray(rows)  # [3, V] the same pass's logits, copied
        for i in range(3):  # the pass's greedy ids, which greedy requests take
            assert window.logits_of(rows, i)[-1].greedy_id == int(np.argmax(
                window.logits_of(host, i)[-1]))
        tokens = []
        for i in range(3):
            a = on_device[i].sample_candidates(window.logits_of(rows, i)[-1], V)
            b = on_host[i].sample(window.logits_of(host, i)[-1])
            assert a == b
            tokens.append(a)
        answer.append(tokens[2])
        runs = [(kv, np.array([t], dtype=np.int32)) for kv, t in zip(kvs, tokens)]
    answer = b"".join(tokenizer.token_bytes(t) for t in answer if t not in tokenizer.stop_ids)
    assert answer.startswith(b"{") and JsonRecognizer().feed(answer), answer
    rows_then = rows
    model.forward_window_lazy(Window.build(runs, logits="last"))
    with pytest.raises(Exception, match="earlier pass"):
        np.asarray(rows_then)


def _device_rows_equal_copied_rows(model, samplers, prompt_len: int, num_steps: int,
                                   num_cells: int) -> list[list[int]]:
    """Decode one request per sampler of `samplers()` in windows: each token sampled on the
    row left on the device equals the same sampler's on the copied row. The tokens of each."""
    on_device, on_host = samplers(), samplers()
    n, V = len(on_device), model.spec.vocab
    kvs = [model.new_kv(num_cells) for _ in range(n)]
    runs = [(kv, np.arange(prompt_len + i, dtype=np.int32)) for i, kv in enumerate(kvs)]
    outs = [[] for _ in range(n)]
    for _ in range(num_steps):
        window = Window.build(runs, logits="last")
        rows = model.forward_window_lazy(window)
        host = np.asarray(rows)  # [n, V] the same pass's logits, copied
        for i in range(n):
            token = on_device[i].sample_candidates(window.logits_of(rows, i)[-1], V)
            assert token == on_host[i].sample(window.logits_of(host, i)[-1])
            outs[i].append(token)
        runs = [(kv, np.array([out[-1]], dtype=np.int32)) for kv, out in zip(kvs, outs)]
    return outs


def test_held_tool_calls_on_device_rows_equal_copied_rows(synth_path):
    """A required call (JSON form, greedy, one call at most) and calls in the XML form with
    typed values (sampled): rows left on the device give the copied rows' tokens, and the
    required answer opens with a call."""
    from strata.backends.cuda import CudaModel
    from strata.engine.tool_call_constraint import ToolCallConstraint
    from strata.engine.tool_call_required import RequiredToolCallConstraint

    gguf = GGUFModel.open(synth_path("tiny", "q8_0"))
    model = CudaModel(gguf)
    tokenizer = Tokenizer.from_gguf_metadata(gguf.metadata)
    weather = {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}
    no_think = {tokenizer.token_id("<think>"): -100, tokenizer.token_id('"'): 6,
                tokenizer.token_id("}"): 4}
    params = [SamplingParams(temperature=0.0, held_tool_calls=[weather], logit_bias=no_think,
                             tool_call_required=True, max_tool_calls=1),
              SamplingParams(temperature=1.0, top_k=40, seed=5, held_tool_calls=[weather],
                             tool_call_form="xml",
                             logit_bias={tokenizer.token_id("<tool_call>"): 8})]

    def samplers():
        return [Sampler(params[0], constraint=RequiredToolCallConstraint(
                    tokenizer, [weather], tokenizer.stop_ids, max_calls=1)),
                Sampler(params[1], constraint=ToolCallConstraint(tokenizer, [weather],
                                                                 xml=True))]
    answer = _device_rows_equal_copied_rows(model, samplers, 5, 40, 128)[0]
    text = b"".join(tokenizer.token_bytes(t) for t in answer).lstrip()
    assert text.startswith(b"<tool_call>"), text


def test_thinking_budget_on_device_rows_equals_copied_rows(synth_path):
    """A <think> block held to 4 tokens (greedy and sampled): rows left on the device give the
    copied rows' tokens, the close spelled after the budget."""
    from strata.engine.thinking_budget import CLOSE, ThinkingBudget

    gguf = GGUFModel.open(synth_path("tiny", "q8_0"))
    from strata.backends.cuda import CudaModel

    model = CudaModel(gguf)
    tokenizer = Tokenizer.from_gguf_metadata(gguf.metadata)
    close = {tokenizer.token_id("</think>"): -100}
    params = [SamplingParams(temperature=0.0, thinking_budget=4, logit_bias=close),
              SamplingParams(temperature=0.9, top_k=30, seed=6, thinking_budget=4,
                             logit_bias=close)]

    def samplers():
        return [Sampler(p, constraint=ThinkingBudget(tokenizer, 4, starts_in_reasoning=True))
                for p in params]
    for out in _device_rows_equal_copied_rows(model, samplers, 7, 14, 64):
        text = b"".join(tokenizer.token_bytes(t) for t in out)
        assert CLOSE in text and b"".join(tokenizer.token_bytes(t) for t in out[:4]) + CLOSE \
            == text[:text.index(CLOSE) + len(CLOSE)]


def test_engine_on_the_gpu_answers_with_a_sentence_of_a_grammar(synth_path):
    """A GBNF grammar on the CUDA engine (rows left on the device; a held answer samples the
    whole row on the host): greedy and sampled answers follow it beside a plain request in the
    same windows, the greedy one equal to the CPU engine's."""
    import re

    from request_runs import run_requests
    from strata import Engine, EngineConfig

    path = synth_path("tiny", "f32")
    gbnf = 'root ::= "The answer is " [0-9]{1,3} ("%" | " apples")'
    greedy = {}
    for device in ("cuda", "cpu"):
        with Engine(EngineConfig(path, n_ctx=256, parallel=3, device=device)) as engine:
            prompt = engine.tokenize("How many?", add_special=True)
            think = engine.tokenizer.token_id("<think>")
            params = [SamplingParams(temperature=0.0, max_tokens=24)] + [
                SamplingParams(temperature=t, seed=5, max_tokens=64, grammar=gbnf,
                               logit_bias={think: -100}) for t in (0.0, 1.0)]
            runs = run_requests(engine, [prompt] * 3, params)
            for tokens, handle in runs[1:]:
                text = engine.detokenize([t for t in tokens
                                          if t not in engine.tokenizer.stop_ids])
                assert re.fullmatch(r"The answer is [0-9]{1,3}(?:%| apples)", text), text
                assert len(tokens) < 64  # ended by the grammar, not by max_tokens
            greedy[device] = runs[1][0]
    assert greedy["cuda"] == greedy["cpu"]
