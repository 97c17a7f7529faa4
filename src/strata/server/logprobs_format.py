"""Generated tokens' log probabilities in the API's shapes: chat's `logprobs.content` entries
(token, logprob, bytes, top_logprobs) and the legacy completions' parallel lists (tokens,
token_logprobs, top_logprobs, text_offset). The figures come from engine/logprobs.py."""
from __future__ import annotations

import math

from strata.engine.logprobs import TokenLogprob

# What OpenAI's API reports for a token the model gives no probability a float can hold (JSON
# has no -Infinity).
LOGPROB_FLOOR = -9999.0


def _number(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else LOGPROB_FLOOR


class LogprobFormatter:
    """Token texts and entries for one tokenizer. A token's text is its bytes read as UTF-8
    (a token that holds part of a character shows U+FFFD there; `bytes` has them exactly)."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._texts: dict[int, tuple[str, list[int]]] = {}

    def token(self, token_id: int) -> tuple[str, list[int]]:
        found = self._texts.get(token_id)
        if found is None:
            raw = self._tokenizer.token_bytes(token_id)
            found = self._texts[token_id] = (raw.decode("utf-8", errors="replace"), list(raw))
        return found

    def chat_entry(self, lp: TokenLogprob) -> dict:
        text, raw = self.token(lp.token_id)
        top = []
        for token_id, logprob in lp.top:
            alt_text, alt_raw = self.token(token_id)
            top.append({"token": alt_text, "logprob": _number(logprob), "bytes": alt_raw})
        return {"token": text, "logprob": _number(lp.logprob), "bytes": raw,
                "top_logprobs": top}

    def completion_lists(self, entries: list[TokenLogprob], offset: int) -> dict:
        """The legacy `logprobs` object of `entries`, the first token's text starting at
        character `offset` of the answer's text. Each top_logprobs dict holds the asked-for
        alternatives and the chosen token (so up to logprobs + 1 keys, as OpenAI's API)."""
        tokens, values, tops, offsets = [], [], [], []
        for lp in entries:
            text = self.token(lp.token_id)[0]
            tokens.append(text)
            values.append(_number(lp.logprob))
            top = {self.token(t)[0]: _number(v) for t, v in lp.top}
            top.setdefault(text, _number(lp.logprob))
            tops.append(top)
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
                "text_offset": offsets}
