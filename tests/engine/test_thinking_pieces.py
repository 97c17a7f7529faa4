"""A `<think>` block whose tags the model spells in pieces (`<`, `/`, `th`, `ink`, `>`) rather
than as the vocabulary's one token: the thinking budget and the output parser find them in the
text, as Qwen3's template and llama.cpp's reasoning parser do. Token sequences are forced
through the per-token path (TokenDecoder) with the packaged default model's tokenizer."""
from __future__ import annotations

import numpy as np
import pytest

from strata.engine.generate import GenerationStats, TokenDecoder
from strata.engine.sampling import SamplingParams
from strata.engine.thinking_budget import CLOSE, ThinkingBudget
from strata.server.output_parser import ContentDelta, OutputParser, ReasoningDelta, \
    parse_complete

from test_tool_call_constraint import feed


@pytest.fixture(scope="module")
def default_tokenizer():
    from strata.data import default_model_path
    from strata.model.gguf_file import GGUFModel
    from strata.model.tokenizer import Tokenizer

    with GGUFModel.open(default_model_path()) as gguf:
        return Tokenizer.from_gguf_metadata(gguf.metadata)


def pieces(tokenizer, *texts: str) -> list[int]:
    """The ids of each text encoded on its own: `"</", "think", ">"` spells the close in
    pieces where `"</think>"` would be its one token."""
    out = [t for text in texts for t in tokenizer.encode(text, add_special=False)]
    assert tokenizer.token_id("</think>") not in out
    return out


def forced(tokenizer, params: SamplingParams, prompt_text: str, tokens: list[int]):
    """Drive a TokenDecoder with logits that make each of `tokens` the best (a model that
    writes them): (the tokens it took, the events' texts). A constraint may take others."""
    decoder = TokenDecoder(tokenizer, params, tokenizer.encode(prompt_text, add_special=False),
                           GenerationStats())
    taken, texts = [], []
    for token in tokens:
        logits = np.zeros(tokenizer.vocab_size, dtype=np.float32)
        logits[token] = 10.0
        event = decoder.next_event(logits, has_room=True)
        taken.append(event.token_id)
        texts.append(event.text)
        if event.finish_reason is not None:
            break
    return taken, texts


PROMPT = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n"


def test_a_close_in_pieces_ends_the_budgeted_block(default_tokenizer):
    """The answer after a close spelled in pieces is the model's: the budget no longer counts
    it as thinking and forces no `</think>` into it (it did, 9 tokens into the answer)."""
    tok = default_tokenizer
    thought = pieces(tok, "Let me see", "</", "think", ">", "\n\n")
    answer = tok.encode(" The answer is four, as two and two make four.", add_special=False)
    assert len(answer) > 12
    params = SamplingParams(temperature=0, max_tokens=200, thinking_budget=12)
    taken, texts = forced(tok, params, PROMPT, thought + answer)
    assert taken == thought + answer
    content, reasoning, _, _ = parse_complete("".join(texts), starts_in_reasoning=True)
    assert (reasoning, content) == ("Let me see", "The answer is four, as two and two make four.")


def test_the_budget_counts_the_block_to_its_close_in_pieces(default_tokenizer):
    tok = default_tokenizer
    budget = ThinkingBudget(tok, 20, starts_in_reasoning=True)
    head = pieces(tok, " a b", "</", "th")  # "</th": maybe a close, maybe not yet
    assert feed(budget, head) and budget.is_thinking
    more = pieces(tok, "ought")
    assert feed(budget, more) and budget.is_thinking  # "</thought": not a close
    close = pieces(tok, "</", "think", ">")
    assert feed(budget, close + pieces(tok, "\n\nok")) and not budget.is_thinking
    # every token of the block up to the one that ends its close
    assert budget.num_thinking_tokens == len(head) + len(more) + len(close) - 1
    assert feed(budget, tok.encode(" and " * 30, add_special=False)) and not budget.is_forcing


def test_a_close_in_pieces_inside_one_token_with_text(default_tokenizer):
    """A token that ends the close and goes on (`>\\n\\n`) closes it too."""
    tok = default_tokenizer
    ids = pieces(tok, "x", "</", "think", ">\n\nThe answer")
    assert tok.token_bytes(ids[5]) == b">\n\n"
    budget = ThinkingBudget(tok, 6, starts_in_reasoning=True)
    assert feed(budget, ids[:6]) and not budget.is_thinking
    assert feed(budget, tok.encode(" and" * 10, add_special=False)) and not budget.is_forcing


def test_an_open_in_pieces_after_whitespace_starts_the_block(default_tokenizer):
    """A `<think>` that opens the output after whitespace, as one token or in pieces, opens
    the block the budget holds (the output parser reads it as reasoning)."""
    tok = default_tokenizer
    think = tok.token_id("<think>")
    for opening in ([think], tok.encode("\n", add_special=False) + [think],
                    pieces(tok, "\n", "<", "think", ">")):
        params = SamplingParams(temperature=0, max_tokens=60, thinking_budget=3)
        body = tok.encode(" one two three four five six seven", add_special=False)
        taken, texts = forced(tok, params, "<|im_start|>user\nhi<|im_end|>\n"
                              "<|im_start|>assistant\n", opening + body)
        text = "".join(texts)
        assert CLOSE.decode() in text, (opening, text)
        content, reasoning, _, _ = parse_complete(text)
        assert reasoning == "one two three" and content, (opening, text)
    text_first = ThinkingBudget(tok, 0)
    assert feed(text_first, pieces(tok, "Hi", "<", "think", ">", " x y z"))
    assert not text_first.is_thinking and not text_first.is_forcing


@pytest.mark.parametrize("starts_in_reasoning", [False, True])
def test_the_parser_splits_a_close_in_pieces_streamed(default_tokenizer, starts_in_reasoning):
    """Streamed token by token, the parser sends no partial `</th` as reasoning or content,
    and gives what the whole text gives."""
    tok = default_tokenizer
    ids = pieces(tok, "Some thought", "</", "think", ">", "\n\nThe answer")
    if not starts_in_reasoning:
        ids = [tok.token_id("<think>")] + ids
    decoder = tok.stream_decoder(skip_special=True)
    parser = OutputParser(starts_in_reasoning=starts_in_reasoning)
    events = []
    for token in ids:
        events += parser.feed(decoder.push(token))
    events += parser.feed(decoder.flush()) + parser.finish()
    assert not any("<" in e.text or ">" in e.text for e in events)
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    assert (reasoning, content) == ("Some thought", "The answer")
    whole = tok.decode(ids, skip_special=True)
    assert parse_complete(whole, starts_in_reasoning=starts_in_reasoning)[:2] == \
        (content, reasoning)


@pytest.mark.parametrize("kind", ["json", "tool_call"])
@pytest.mark.parametrize("with_budget", [False, True])
def test_a_held_answer_after_a_close_in_pieces(default_tokenizer, kind, with_budget):
    """json_object and a required tool call after a close spelled in pieces: the constraint
    leaves the block there, so it holds the answer and lets a stop token end it (it stayed
    inside the block: any text went, and no stop token until max_tokens)."""
    from strata.engine.json_constraint import JsonObjectConstraint
    from strata.engine.tool_call_required import RequiredToolCallConstraint

    from test_tool_call_constraint import WEATHER

    tok = default_tokenizer
    if kind == "json":
        c = JsonObjectConstraint(tok, tok.stop_ids, starts_in_reasoning=True)
        answer = '{"a": 1}'
    else:
        c = RequiredToolCallConstraint(tok, [WEATHER], tok.stop_ids, starts_in_reasoning=True)
        answer = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n' \
                 '</tool_call>'
    if with_budget:
        c = ThinkingBudget(tok, 50, c, starts_in_reasoning=True)
    stop = sorted(tok.stop_ids)[0]
    assert feed(c, pieces(tok, "hmm", "</", "think", ">\n\n"))
    assert not c.allows(tok.encode("hello", add_special=False)[0]) and not c.allows(stop)
    assert feed(c, tok.encode(answer, add_special=False)) and c.allows(stop)
