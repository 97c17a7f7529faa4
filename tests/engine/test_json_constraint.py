"""JSON-object output (response_format): the byte recognizer against Python's json module, the
token constraint on a real vocabulary, and the sampler held to it."""
from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strata import Engine, EngineConfig
from strata.engine.generate import collect
from strata.engine.json_constraint import (MAX_DEPTH, MAX_INDENT, JsonObjectConstraint,
                                           JsonRecognizer)
from strata.engine.sampling import Sampler, SamplingParams

KEYS = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=6)
SCALARS = (st.none() | st.booleans() | st.integers(-10**12, 10**12)
           | st.floats(allow_nan=False, allow_infinity=False) | KEYS)
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(KEYS, inner, max_size=4), max_leaves=12)
OBJECTS = st.dictionaries(KEYS, VALUES, max_size=5)


def accepts(text: str | bytes) -> tuple[bool, bool]:
    """(every byte accepted, the object complete)."""
    r = JsonRecognizer()
    ok = r.feed(text.encode() if isinstance(text, str) else text)
    return ok, ok and r.is_done


def depth(value) -> int:
    if isinstance(value, dict):
        return 1 + max(map(depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(depth, value), default=0)
    return 0


@settings(max_examples=300, deadline=None)
@given(obj=OBJECTS, style=st.sampled_from(["compact", "default", "indent1", "indent2",
                                           "tabs"]),
       ascii_only=st.booleans())
def test_every_prefix_of_a_dumped_object_is_accepted(obj, style, ascii_only):
    indent = {"indent1": 1, "indent2": 2, "tabs": "\t"}.get(style)
    if indent is not None and depth(obj) * len(str(indent)) > MAX_INDENT:
        indent = None
    separators = (",", ":") if style == "compact" else None
    text = json.dumps(obj, indent=indent, separators=separators, ensure_ascii=ascii_only)
    data = text.encode()
    r = JsonRecognizer()
    for i, c in enumerate(data):
        assert r.feed(bytes((c,))), (text, i)
        assert r.is_done == (i == len(data) - 1)
    assert accepts(data) == (True, True)


@settings(max_examples=400, deadline=None)
@given(obj=OBJECTS, at=st.integers(0, 10**6), edit=st.sampled_from(["drop", "insert"]),
       char=st.sampled_from(list('{}[]":,.-+eE0123456789 \ntruefalsn\\/u\x01a')))
def test_what_it_completes_json_reads_as_an_object(obj, at, edit, char):
    """A damaged dump: whenever the recognizer takes the whole text as a complete object, the
    json module reads it as a dict; whenever the json module reads a dict from compact text
    (no whitespace but in strings), the recognizer takes it."""
    text = json.dumps(obj, separators=(",", ":"))
    at %= len(text) + 1
    text = text[:at] + text[at + 1:] if edit == "drop" else text[:at] + char + text[at:]
    ok, done = accepts(text)
    try:
        parsed = json.loads(text)
    except (ValueError, RecursionError):
        parsed = None
    if done:
        assert isinstance(parsed, dict), text
    elif isinstance(parsed, dict) and json.dumps(parsed, separators=(",", ":")) == text:
        assert False, f"{text!r} is a JSON object the recognizer refused"


@pytest.mark.parametrize("text", [
    '[1]', '   {}', '\t{}', '{}\n', '{} ', '{"a":01}', '{"a":}', '{"a" 1}', '{"a":tru}', '{"a":1,}',
    '{"a":"\x01"}', '{"a":-}', '{"a":1.}', '{"a":1e}', '{"a":1}{', "{'a':1}", '{"a":"\\x"}',
    '{"a":"\\u12g4"}', '{a:1}', '{"a":1]', '{"a":[1}', '{,}', '{"a"::1}', '{"a":NaN}',
    '{"a":  1}', '{\n\n"a":1}', '{\n' + ' ' * (MAX_INDENT + 1) + '"a":1}',
])
def test_refused(text):
    assert accepts(text)[0] is False


def test_two_leading_spaces_or_newlines():
    for text in (" {}", "\n\n{}", "\n {}"):
        assert accepts(text) == (True, True)


def test_depth_is_bounded():
    assert accepts("{" + '"a":{' * (MAX_DEPTH - 1) + "}" * MAX_DEPTH) == (True, True)
    assert accepts("{" + '"a":{' * MAX_DEPTH)[0] is False


def _json_text(tokenizer, tokens) -> str:
    return tokenizer.decode([t for t in tokens if t not in tokenizer.stop_ids])


def test_constraint_against_the_recognizer_on_a_vocabulary(tokenizer):
    """allows(t) is the recognizer's answer on t's bytes; candidates() holds every allowed id;
    stop tokens only once the object is closed."""
    c = JsonObjectConstraint(tokenizer, tokenizer.stop_ids)
    V = tokenizer.vocab_size
    rng = np.random.default_rng(0)
    for text in ['{', '{"a', '{"a":', '{"a": [1', '{"a": [1, "x"], "b"', '{"a": {}}']:
        c = JsonObjectConstraint(tokenizer, tokenizer.stop_ids)
        for t in tokenizer.encode(text, add_special=False):
            assert c.allows(t)
            c.push(t)
        allowed = {t for t in range(V) if c.allows(t)}
        assert allowed <= set(c.candidates().tolist())
        for t in rng.choice(V, 200):
            data = tokenizer.token_bytes(int(t))
            want = (int(t) not in tokenizer.special_ids and bool(data)
                    and JsonRecognizer().feed(text.encode() + data))
            if int(t) in tokenizer.stop_ids:
                want = text == '{"a": {}}'
            assert c.allows(int(t)) == want, (text, data)
    assert all(c.allows(t) for t in tokenizer.stop_ids)  # the last text closes the object


def test_a_think_block_passes_before_the_object(tokenizer):
    think, end = tokenizer.token_id("<think>"), tokenizer.token_id("</think>")
    words = tokenizer.encode(" not json at all [", add_special=False)
    c = JsonObjectConstraint(tokenizer, tokenizer.stop_ids)
    assert c.allows(think) and not c.allows(words[0]) and not c.allows(end)
    c.push(think)
    assert all(c.allows(t) for t in words + [end])
    assert not any(c.allows(t) for t in tokenizer.stop_ids)  # no stopping inside it
    for t in words + [end]:
        c.push(t)
    brace = tokenizer.encode("{", add_special=False)[0]
    assert c.allows(brace) and not c.allows(think) and not c.allows(words[0])
    started = JsonObjectConstraint(tokenizer, tokenizer.stop_ids, starts_in_reasoning=True)
    assert started.allows(words[0]) and started.allows(brace)


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.5])
def test_sampler_writes_json_objects_from_random_logits(tokenizer, temperature):
    """Random logits, nudged towards closing tokens and the end: every output is a prefix of a
    JSON object, and every one that stops is a JSON object the json module reads."""
    V = tokenizer.vocab_size
    closers = [t for t in range(V) if tokenizer.token_bytes(t) in (b"}", b"]", b'"', b",")]
    stops = sorted(tokenizer.stop_ids)
    think = tokenizer.token_id("<think>")  # no reasoning block here: random text would not end
    finished = 0
    for seed in range(12):
        rng = np.random.default_rng(seed)
        params = SamplingParams(temperature=temperature, top_k=0, top_p=1.0, min_p=0.0,
                                seed=seed, json_object=True, logit_bias={think: -100})
        sampler = Sampler(params, constraint=JsonObjectConstraint(tokenizer, tokenizer.stop_ids))
        tokens = []
        for step in range(300):
            logits = rng.standard_normal(V).astype(np.float32) * 2
            logits[closers] += min(step / 10, 8)
            logits[stops] += 8
            token = sampler.sample(logits)
            tokens.append(token)
            if token in tokenizer.stop_ids:
                break
        text = _json_text(tokenizer, tokens)
        assert JsonRecognizer().feed(text.encode()), text
        if tokens[-1] in tokenizer.stop_ids:
            finished += 1
            assert isinstance(json.loads(text), dict), text
    assert finished >= 10


def test_greedy_takes_the_best_allowed_token(tokenizer):
    V = tokenizer.vocab_size
    brace = tokenizer.encode("{", add_special=False)[0]
    word = tokenizer.encode("hello", add_special=False)[0]
    logits = np.zeros(V, dtype=np.float32)
    logits[word], logits[brace] = 9.0, 3.0  # the model would rather write text
    c = JsonObjectConstraint(tokenizer, tokenizer.stop_ids)
    assert Sampler(SamplingParams(temperature=0.0, json_object=True),
                   constraint=c).sample(logits) == brace
    plain = Sampler(SamplingParams(temperature=0.0))
    assert plain.sample(logits) == word


def test_engine_answers_with_a_json_object(tiny_model_path):
    """The engine's json_object requests end in a JSON object (greedy and sampled) and stop."""
    with Engine(EngineConfig(tiny_model_path, n_ctx=256)) as engine:
        prompt = engine.tokenize("Write a JSON object:", add_special=True)
        think = engine.tokenizer.token_id("<think>")  # random weights would think forever
        for temperature in (0.0, 1.0):
            params = SamplingParams(temperature=temperature, seed=4, max_tokens=200,
                                    json_object=True, logit_bias={think: -100})
            result = collect(engine.generate(prompt, params))
            assert JsonRecognizer().feed(result.text.encode()), result.text
            if result.finish_reason == "stop":
                assert isinstance(json.loads(result.text), dict)


def test_only_a_think_after_the_last_turn_start_opens_reasoning(tokenizer):
    """The answer starts in reasoning when the template (or a prefill) leaves `<think>` open
    after the assistant's turn start; a `<think>` inside a message (a question about the tags,
    a tool result holding code) is followed by its turn's end and opens nothing (the rendered
    text's last `<think>` without a `</think>` after it turned the whole answer into reasoning)."""
    from strata.engine.json_constraint import opens_reasoning

    def opens(text):
        return opens_reasoning(tokenizer, tokenizer.encode(text, add_special=False))

    assert opens("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n")
    assert opens("<|im_start|>assistant\n<think>\nLet me see: a prefill")
    assert not opens("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not opens("<|im_start|>assistant\n")
    question = "Why does my parser drop the text after <think> tags?"
    assert not opens(f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n")
    assert not opens("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<tool_call>"
                     "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\ns = '<think>'"
                     "\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
