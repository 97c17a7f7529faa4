"""Tool calls that must come (OpenAI's tool_choice "required" or a named function, Anthropic's
"any" / "tool"): the answer opens with a `<tool_call>` block, after a `<think>` block when the
model writes one and at most MAX_LEAD spaces or newlines, and the stop tokens may end it only
once a call is closed. The call itself, and everything after it, is held as
tool_call_constraint.ToolCallConstraint holds calls."""
from __future__ import annotations

import numpy as np

from strata.engine.json_constraint import ThinkingLead
from strata.engine.tool_call_constraint import TOOL_OPEN, ToolCallConstraint

MAX_LEAD = 4  # spaces or newlines before the first <tool_call> (after </think>)
_LEAD_SPACE = b" \n"


class RequiredToolCallConstraint(ToolCallConstraint):
    """ToolCallConstraint whose answer starts with a call (see the module)."""

    def __init__(self, tokenizer, functions: list[dict], stop_ids, xml: bool = False,
                 starts_in_reasoning: bool = False, max_calls: int | None = None):
        super().__init__(tokenizer, functions, xml, max_calls)
        self._stop_ids = frozenset(stop_ids)
        self.think = ThinkingLead(starts_in_reasoning)  # a <think> block before the call
        self.lead = b""  # the text before the first call (after any </think>)

    @property
    def is_leading(self) -> bool:
        """No call opened yet."""
        return self.num_closed == 0 and self.call is None

    @property
    def is_free(self) -> bool:
        return not self.is_leading and super().is_free

    def _lead_status(self, text: bytes) -> int:
        """For the text before the first call: -1 refused, 0 still leading to a tag, 1 the tag
        is whole (and what follows it in `text` starts a call)."""
        rest = text.lstrip(_LEAD_SPACE)
        if len(text) - len(rest) > MAX_LEAD:
            return -1
        if len(rest) < len(TOOL_OPEN):
            return 0 if TOOL_OPEN.startswith(rest) else -1
        if not rest.startswith(TOOL_OPEN):
            return -1
        return 1 if self._run(None, b"", rest)[2] == 0 else -1

    def allows(self, token: int) -> bool:
        if not self.is_leading:
            return super().allows(token)
        if token in self._stop_ids:
            return False
        data = self._tokenizer.token_bytes(token)
        decided = self.think.allows(token, data, self._special,
                                    lambda rest: self._lead_status(rest) >= 0)
        if decided is not None:
            return decided
        if not data or (token in self._added and data != TOOL_OPEN):
            return False
        return self._lead_status(self.lead + data) >= 0

    def push(self, token: int) -> None:
        """Take `token` (one `allows` accepted)."""
        if not self.is_leading:
            super().push(token)
            return
        if token in self._stop_ids:
            return
        data = self.think.take(self._tokenizer.token_bytes(token))
        if data is None:
            return
        self.lead += data
        rest = self.lead.lstrip(_LEAD_SPACE)
        if rest.startswith(TOOL_OPEN):  # the call opens: the base holds it from here
            self.call, self._tail, _, closed = self._run(None, b"", rest)
            self.num_closed += closed
            self.lead = b""

    def candidates(self) -> np.ndarray:
        """Ids that may pass `allows` (a superset); before the first call, by the first byte
        the lead may take next (every id inside the <think> block)."""
        if not self.is_leading:
            return super().candidates()
        first = self._tokenizer.first_byte_table()
        if self.think.is_thinking:
            return np.arange(first.shape[0])
        ok = np.array([self._lead_status(self.lead + bytes((b,))) >= 0 for b in range(256)])
        mask = np.append(ok, False)[first]  # [V]
        mask[self.think.think_ids(self._tokenizer)] = True
        return np.flatnonzero(mask)
