"""A reasoning model's `<think>` block held to a token budget (Anthropic's
`thinking.budget_tokens`, `strata serve --reasoning-budget`): once the block has taken that
many tokens, the sampler may take only the tokens that spell CLOSE (its `</think>` as the
vocabulary's one token, as the model and the parsers know it), and the answer goes on
after it as the model writes it. Wraps the request's other constraint (JSON, tool calls), or
none, which sees every token as before, the forced ones included; a grammar with token items
(gbnf.py) holds the whole output, its `<think>` block included, so the budget leaves it be."""
from __future__ import annotations

import numpy as np

from strata.engine.json_constraint import THINK_CLOSE, THINK_OPEN

CLOSE = b"\n" + THINK_CLOSE + b"\n\n"  # what a Qwen3 template expects between thought and answer


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
        self.is_first = not starts_in_reasoning   # a <think> may open the answer
        self.num_thinking_tokens = 0
        # the inner grammar reads the block itself: forced bytes could leave its language
        self.is_held_by_inner = bool(getattr(getattr(inner, "recognizer", None), "has_tokens",
                                             False))
        self.forced = b""
        # the close as one token: the inner constraint, the output parser and the next turn's
        # template know `</think>` by it, so the forced close never spells it in pieces
        self._close_id = tokenizer.token_id(THINK_CLOSE.decode())
        if starts_in_reasoning:
            self._start_forcing_if_spent()

    @property
    def is_forcing(self) -> bool:
        return bool(self.forced)

    def allows(self, token: int) -> bool:
        if self.forced:
            data = self._tokenizer.token_bytes(token)
            return bool(data) and self.forced.startswith(data) and not self._splits_close(data)
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
        is_first, self.is_first = self.is_first, False
        if self.forced:
            self.forced = self.forced[len(data):]
            self.is_thinking = False
            return
        if not self.is_thinking:
            if is_first and data == THINK_OPEN:
                self.is_thinking = True
                self._start_forcing_if_spent()
            return
        if THINK_CLOSE in data:
            self.is_thinking = False
            return
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

    def candidates(self) -> np.ndarray:
        """Ids that may pass `allows` (a superset): while forcing, those whose first byte is
        the next one to spell."""
        first = self._tokenizer.first_byte_table()  # [V] int16, -1 for an empty token
        if self.forced:
            return np.flatnonzero(first == self.forced[0])
        if self.inner is None:
            return np.arange(first.shape[0])
        return self.inner.candidates()
