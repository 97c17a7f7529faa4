"""A reasoning model's `<think>` block held to a token budget (Anthropic's
`thinking.budget_tokens`, `strata serve --reasoning-budget`): once the block has taken that
many tokens, the sampler may take only the tokens that spell CLOSE (its `</think>` as the
vocabulary's one token), and the answer goes on after it as the model writes it. The block's
tags are found in the text, as the output parser and Qwen3's template find them: a `</think>`
the model spells in pieces (`</`, `think`, `>`) closes it too. Wraps the request's other
constraint (JSON, tool calls), or none, which sees every token as before, the forced ones
included: a forced token is one it allows too, and the forcing ends where it takes none (a
grammar that refuses the `\n\n` after the close). A grammar that holds the whole output, its
`<think>` block included (token items, gbnf.py, or a raw prompt's: `holds_whole_output`), is
left be."""
from __future__ import annotations

import numpy as np

from strata.engine.json_constraint import THINK_CLOSE, THINK_OPEN, spelled_ids

CLOSE = b"\n" + THINK_CLOSE + b"\n\n"  # what a Qwen3 template expects between thought and answer
TAIL_BYTES = len(THINK_CLOSE) - 1  # the block's last bytes kept: a close may end in the next token


class ThinkingBudget:
    """The constraint interface (allows / push / candidates / is_free) over `inner` (or None)."""

    def __init__(self, tokenizer, budget_tokens: int, inner=None,
                 starts_in_reasoning: bool = False):
        if budget_tokens < 0:
            raise ValueError(f"budget_tokens must be >= 0, got {budget_tokens}")
        self._tokenizer = tokenizer
        self.inner = inner
        self.budget_tokens = budget_tokens
        self.is_thinking = starts_in_reasoning
        # the output so far, whitespace dropped, while it may still become a `<think>` that
        # opens it (the output parser's rule); None once it cannot
        self._lead: bytes | None = None if starts_in_reasoning else b""
        self._tail = b""  # the block's last TAIL_BYTES bytes
        self.num_thinking_tokens = 0
        # the inner grammar reads the block itself: forced bytes could leave its language
        self.is_held_by_inner = bool(getattr(inner, "holds_whole_output", False))
        self.forced = b""
        # the close as one token, as the model writes it and the tokenizer reads the next
        # turn's `</think>` (and an inner constraint may know it by that token only), so the
        # forced close never spells it in pieces
        self._close_id = tokenizer.token_id(THINK_CLOSE.decode())
        if starts_in_reasoning:
            self._start_forcing_if_spent()

    @property
    def is_forcing(self) -> bool:
        return bool(self.forced)

    def allows(self, token: int) -> bool:
        if self.forced:
            data = self._tokenizer.token_bytes(token)
            return (bool(data) and self.forced.startswith(data) and not self._splits_close(data)
                    and (self.inner is None or self.inner.allows(token)))
        return True if self.inner is None else self.inner.allows(token)

    @property
    def is_free(self) -> bool:
        if self.forced:
            return False
        return True if self.inner is None else getattr(self.inner, "is_free", False)

    def push(self, token: int) -> None:
        """Take `token` (one `allows` accepted)."""
        data = self._tokenizer.token_bytes(token)
        if self.inner is not None:
            self.inner.push(token)
        if self.forced:
            self.forced = self.forced[len(data):]
            self.is_thinking = False
            self._end_forcing_if_refused()
            return
        if self.is_thinking:
            self._take_thinking(data)
            return
        if self._lead is None:
            return
        self._lead = (self._lead + data).lstrip()
        if self._lead.startswith(THINK_OPEN):  # as one token or spelled in pieces
            rest, self._lead = self._lead[len(THINK_OPEN):], None
            self.is_thinking, self._tail = True, b""
            if THINK_CLOSE in rest:
                self.is_thinking = False
            else:
                self._tail = rest[-TAIL_BYTES:]
                self._start_forcing_if_spent()
        elif not THINK_OPEN.startswith(self._lead):
            self._lead = None  # the answer starts with text: no block

    def _take_thinking(self, data: bytes) -> None:
        """A token of the open block: it closes the block where it ends a `</think>` (with
        the bytes before it, a close spelled in pieces), else it counts."""
        text = self._tail + data
        if THINK_CLOSE in text:
            self.is_thinking, self._tail = False, b""
            return
        self._tail = text[-TAIL_BYTES:]
        self.num_thinking_tokens += 1
        self._start_forcing_if_spent()

    def _splits_close(self, data: bytes) -> bool:
        """Whether a forced token of `data` would spell part of the forced `</think>` and not
        all of it (as `<` or `</` would), where the vocabulary has the close as one token."""
        at = self.forced.find(THINK_CLOSE)
        return (self._close_id is not None and at >= 0 and len(data) > at
                and THINK_CLOSE not in data)

    def _start_forcing_if_spent(self) -> None:
        if self.num_thinking_tokens >= self.budget_tokens and not self.is_held_by_inner:
            self.forced = CLOSE
            self._end_forcing_if_refused()

    def _end_forcing_if_refused(self) -> None:
        """Stop forcing where no token of the rest passes `allows` (the inner constraint
        refuses them all): else the sampler would have nothing to draw."""
        forced = self.forced
        if forced and self.inner is not None and not any(
                self.allows(t) for n in range(1, len(forced) + 1)
                for t in spelled_ids(self._tokenizer, forced[:n])):
            self.forced = b""

    def candidates(self) -> np.ndarray:
        """Ids that may pass `allows` (a superset): while forcing, those whose first byte is
        the next one to spell."""
        first = self._tokenizer.first_byte_table()  # [V] int16, -1 for an empty token
        if self.forced:
            return np.flatnonzero(first == self.forced[0])
        if self.inner is None:
            return np.arange(first.shape[0])
        return self.inner.candidates()
