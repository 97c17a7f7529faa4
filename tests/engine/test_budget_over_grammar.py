"""A thinking budget over a held output (engine/thinking_budget.py over json_constraint.py's
TextConstraint): the budget never makes the sampler take a token its inner constraint refuses,
whether the grammar holds the whole output (a raw prompt's, `reasoning_lead` False) or only
the answer after the `<think>` block, and a first token spelled `<think>` and more opens the
block for both."""
from __future__ import annotations

import numpy as np
import pytest

from strata.engine.gbnf import compile_grammar
from strata.engine.generate import collect
from strata.engine.json_constraint import (JsonObjectConstraint, JsonRecognizer,
                                           TextConstraint)
from strata.engine.thinking_budget import CLOSE, ThinkingBudget
from strata.model.tokenizer import Tokenizer
from strata.server.prompting import sampling_params
from strata.server.schema import GenerationOptions
from strata.tool.synth import synth_tokenizer_meta

from test_tool_call_constraint import feed, ids

SELECT = 'root ::= "SELECT " [a-z]+ ";"'  # no whitespace before it: the close's "\n\n" is refused
TOKEN_ITEMS = 'root ::= <think> [a-z ]* </think> "ok"'
POINT = {"type": "object", "required": ["x"], "properties": {"x": {"type": "integer"}}}


def held(tokenizer, kind: str, **kw):
    if kind == "json":
        return JsonObjectConstraint(tokenizer, tokenizer.stop_ids, **kw)
    if kind == "schema":
        return JsonObjectConstraint(tokenizer, tokenizer.stop_ids, schema=POINT, **kw)
    grammar = {"select": SELECT, "token items": TOKEN_ITEMS}[kind]
    return TextConstraint(tokenizer, tokenizer.stop_ids,
                          compile_grammar(grammar).bound(tokenizer).recognizer(), **kw)


def test_a_raw_prompts_grammar_is_not_forced(tokenizer):
    """A raw prompt that leaves `<think>` open, its JSON holding the whole output: the budget
    leaves it be (the forced `</think>` was pushed into the JSON, which refuses it)."""
    json = held(tokenizer, "json", starts_in_reasoning=True, reasoning_lead=False)
    c = ThinkingBudget(tokenizer, 0, json, starts_in_reasoning=True)
    assert not c.is_forcing
    assert not c.allows(tokenizer.token_id("</think>"))
    assert feed(c, ids(tokenizer, '{"a": 1}')) and json.is_done and not c.is_forcing


def test_the_close_goes_on_only_as_far_as_the_grammar_takes_it(tokenizer):
    """A grammar after the block that takes no whitespace: the close is forced, its "\\n\\n"
    is not (it was fed to the grammar, which then refused every answer)."""
    select = held(tokenizer, "select", starts_in_reasoning=True)
    c = ThinkingBudget(tokenizer, 1, select, starts_in_reasoning=True)
    assert feed(c, ids(tokenizer, " x"))
    assert c.is_forcing
    assert feed(c, ids(tokenizer, "\n") + [tokenizer.token_id("</think>")])
    assert not c.is_forcing and not select.think.is_thinking
    assert not c.allows(ids(tokenizer, "\n\n")[0]) and not c.allows(ids(tokenizer, "\n")[0])
    assert feed(c, ids(tokenizer, "SELECT ab;")) and select.is_done


def test_a_first_token_of_think_and_more_opens_the_block():
    """A plain token spelled `<think>\\n` as the first one opens the block, as the output
    parser and the budget read it; its "\\n" is reasoning (the JSON refused it: `<`)."""
    meta = synth_tokenizer_meta(4200)
    meta["tokenizer.ggml.tokens"] = list(meta["tokenizer.ggml.tokens"]) + ["<think>Ċ"]
    meta["tokenizer.ggml.token_type"] = list(meta["tokenizer.ggml.token_type"]) + [1]
    tok = Tokenizer.from_gguf_metadata(meta)
    opening = tok.vocab_size - 1
    assert tok.token_bytes(opening) == b"<think>\n"
    for kind in ("json", "schema", "select"):
        inner = held(tok, kind)
        c = ThinkingBudget(tok, 2, inner)
        assert c.allows(opening) and opening in c.candidates(), kind
        c.push(opening)
        assert inner.think.is_thinking and c.is_thinking, kind
        assert feed(c, ids(tok, " a b")) and c.is_forcing, kind
    whole = held(tok, "json", reasoning_lead=False)  # the JSON holds it all: no block
    assert not whole.allows(opening) and opening not in whole.candidates()
    later = held(tok, "json")
    assert feed(later, ids(tok, "\n")) and not later.allows(opening)  # first only


def test_a_close_in_the_opening_token_ends_the_block():
    meta = synth_tokenizer_meta(4200)
    meta["tokenizer.ggml.tokens"] = list(meta["tokenizer.ggml.tokens"]) + ["<think></think>{"]
    meta["tokenizer.ggml.token_type"] = list(meta["tokenizer.ggml.token_type"]) + [1]
    tok = Tokenizer.from_gguf_metadata(meta)
    both = tok.vocab_size - 1
    json = held(tok, "json")
    assert json.allows(both)
    json.push(both)
    assert not json.think.is_thinking and json.recognizer.is_started
    assert not held(tok, "select").allows(both)  # "{" is no SELECT


@pytest.mark.parametrize("kind", ["json", "schema", "select", "token items"])
@pytest.mark.parametrize("reasoning_lead", [True, False])
@pytest.mark.parametrize("starts_in_reasoning", [True, False])
def test_every_token_taken_is_one_the_inner_allows(tokenizer, kind, reasoning_lead,
                                                   starts_in_reasoning):
    """Random walks through each stack generate.py builds (the same `starts_in_reasoning`
    for both): whatever the budget takes, the inner constraint allows."""
    for budget in (0, 1, 3):
        rng = np.random.default_rng(budget)
        inner = held(tokenizer, kind, starts_in_reasoning=starts_in_reasoning,
                     reasoning_lead=reasoning_lead)
        c = ThinkingBudget(tokenizer, budget, inner, starts_in_reasoning=starts_in_reasoning)
        guide = [tokenizer.token_id("<think>")] + ids(tokenizer, " a b c d e")
        for step in range(14):
            allowed = [int(t) for t in c.candidates() if c.allows(int(t))]
            if not allowed:
                break
            taken = (guide[step] if step < len(guide) and guide[step] in allowed
                     else allowed[int(rng.integers(len(allowed)))])
            assert inner.allows(taken), (kind, budget, step, tokenizer.token_bytes(taken))
            c.push(taken)


def test_a_raw_prompt_with_a_budget_gets_json_only(tiny_model_path):
    """/completion's request (a raw prompt that opens `<think>`, json_schema, the server's
    --reasoning-budget), built as the server builds it: the answer is JSON, no `</think>`."""
    from strata.config import EngineConfig
    from strata.engine.engine import Engine

    with Engine(EngineConfig(tiny_model_path, n_ctx=256, threads=1)) as engine:
        prompt = engine.tokenize("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
                                 "<think>\n", add_special=False)
        for seed, budget in [(4, 0), (0, 2), (9, 5)]:
            options = GenerationOptions(max_tokens=16, temperature=1.0, seed=seed,
                                        json_object=True, json_schema=POINT,
                                        thinking_budget=budget)
            params = sampling_params(options, len(prompt), engine.n_ctx,
                                     engine.tokenizer.vocab_size, reasoning_lead=False)
            engine.reset()
            text = collect(engine.generate(prompt, params)).text
            assert "</think>" not in text and JsonRecognizer().feed(text.encode()), (seed, text)


def test_a_chat_prompts_grammar_answers_after_the_forced_close(tiny_model_path):
    """A grammar after the block (a chat template's prompt) with a budget: the forced close,
    then a sentence of the grammar (the "\\n\\n" forced into it left nothing it took)."""
    from strata.config import EngineConfig
    from strata.engine.engine import Engine
    from strata.engine.sampling import SamplingParams

    with Engine(EngineConfig(tiny_model_path, n_ctx=256, threads=1)) as engine:
        prompt = engine.tokenize("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
                                 "<think>\n", add_special=False)
        for seed in (1, 2):
            engine.reset()
            result = collect(engine.generate(prompt, SamplingParams(
                max_tokens=24, temperature=1.0, seed=seed, thinking_budget=2,
                grammar='root ::= "SELECT " [a-c]{1,4} ";"')))
            assert CLOSE.rstrip() in result.text.encode(), result.text
            answer = result.text.split("</think>", 1)[1]
            assert answer.startswith("SELECT ") and answer.endswith(";"), result.text
