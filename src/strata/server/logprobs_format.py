"""Generated tokens' log probabilities in the API's shapes: chat's `logprobs.content` entries
(token, logprob, bytes, top_logprobs) and the legacy completions' parallel lists (tokens,
token_logprobs, top_logprobs, text_offset). The figures come from engine/logprobs.py."""
from __future__ import annotations

import codecs
import math

from strata.engine.logprobs import TokenLogprob, certain

# What OpenAI's API reports for a token the model gives no probability a float can hold (JSON
# has no -Infinity).
LOGPROB_FLOOR = -9999.0


def _number(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else LOGPROB_FLOOR


class CharOffsets:
    """The character of a text each of its tokens starts in, fed the tokens' bytes in order:
    a character split over several tokens counts once it is whole, so each of its tokens
    (whose texts read U+FFFD) starts in it."""

    def __init__(self, start: int = 0):
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.num_chars = start

    def add(self, raw: bytes) -> int:
        """The offset of the token of bytes `raw`, the next one of the text."""
        offset = self.num_chars
        self.num_chars += len(self._decoder.decode(raw))
        return offset


def legacy_token_text(raw: bytes) -> str:
    """A token's text in the legacy lists, as OpenAI's API writes it: its UTF-8 text, or for
    a token that is not whole UTF-8 (part of a character) "bytes:" and its bytes, printable
    ASCII as itself and the others escaped ("bytes:\\xe4\\xb8"). Those lists have no `bytes`
    field, and as U+FFFD two such tokens would be one key of a `top_logprobs` object."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(chr(b) if 0x20 <= b < 0x7F and b != 0x5C else f"\\x{b:02x}"
                                  for b in raw)


class LogprobFormatter:
    """Token texts and entries for one tokenizer. A token's text is its bytes read as UTF-8
    (a token that holds part of a character shows U+FFFD there; `bytes` has them exactly),
    in the legacy lists `legacy_token_text`."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._texts: dict[int, tuple[str, list[int]]] = {}
        self._legacy_texts: dict[int, str] = {}

    def token(self, token_id: int) -> tuple[str, list[int]]:
        found = self._texts.get(token_id)
        if found is None:
            raw = self._tokenizer.token_bytes(token_id)
            found = self._texts[token_id] = (raw.decode("utf-8", errors="replace"), list(raw))
        return found

    def legacy_token(self, token_id: int) -> str:
        found = self._legacy_texts.get(token_id)
        if found is None:
            found = self._legacy_texts[token_id] = legacy_token_text(
                self._tokenizer.token_bytes(token_id))
        return found

    def chat_entry(self, lp: TokenLogprob, with_ids: bool = False) -> dict:
        """Chat's entry; `with_ids`: llama.cpp's `completion_probabilities` entry, the same
        with each token's `id`."""
        entries = []
        for token_id, logprob in ((lp.token_id, lp.logprob), *lp.top):
            text, raw = self.token(token_id)
            entry = {"id": token_id} if with_ids else {}
            entries.append(dict(entry, token=text, logprob=_number(logprob), bytes=raw))
        return dict(entries[0], top_logprobs=entries[1:])

    def prob_entry(self, lp: TokenLogprob) -> dict:
        """llama.cpp's `completion_probabilities` entry with `post_sampling_probs`: `prob`
        and `top_probs` (probabilities, those of 0 left out) for `logprob` and
        `top_logprobs`."""
        entries = []
        for token_id, logprob in ((lp.token_id, lp.logprob), *lp.top):
            text, raw = self.token(token_id)
            entries.append({"id": token_id, "token": text, "bytes": raw,
                            "prob": math.exp(logprob)})
        return dict(entries[0], top_probs=[e for e in entries[1:] if e["prob"] > 0])

    def completion_lists(self, entries: list[TokenLogprob | int], chars: CharOffsets) -> dict:
        """The legacy `logprobs` object of `entries`, `chars` counting the answer's text up to
        the first one (and on past the last). Each top_logprobs dict holds the asked-for
        alternatives and the chosen token (so up to logprobs + 1 keys, as OpenAI's API). A
        bare token id (an echoed prompt's first token) has no figures: None in both lists."""
        tokens, values, tops, offsets = [], [], [], []
        for lp in entries:
            token_id = lp if isinstance(lp, int) else lp.token_id
            text, value, top = self.legacy_token(token_id), None, None
            if not isinstance(lp, int):
                value = _number(lp.logprob)
                top = {self.legacy_token(t): _number(v) for t, v in lp.top}
                top.setdefault(text, value)
            tokens.append(text)
            values.append(value)
            tops.append(top)
            offsets.append(chars.add(self._tokenizer.token_bytes(token_id)))
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
                "text_offset": offsets}


class AnswerLogprobs:
    """One request's log probabilities, gathered from its events for the whole answer or, with
    `take`, chunk by chunk (each streamed chunk carries the tokens that arrived since the last
    one): the generated tokens' (the stop token has none) and, for an echo, the prompt's.
    Inert (every method None) when the request asked for none."""

    def __init__(self, formatter: LogprobFormatter | None, prompt_tokens=None):
        self._formatter = formatter
        self._entries: list[TokenLogprob] = []  # generated, not yet sent
        self._answer_chars: CharOffsets | None = None  # a stream's generated text so far
        self._prompt_tokens = prompt_tokens  # an echo with logprobs: the prompt, until sent
        self._prompt: list | None = None  # its first token id, then its TokenLogprobs

    @classmethod
    def of(cls, engine, options, prompt_tokens=None) -> "AnswerLogprobs":
        """`prompt_tokens`: the prompt whose figures the first event brings (an echo)."""
        if options.logprobs is None:
            return cls(None)
        return cls(LogprobFormatter(engine.tokenizer), prompt_tokens)

    @property
    def wants_prompt(self) -> bool:
        return self._formatter is not None and self._prompt_tokens is not None

    def add_prompt(self, event) -> None:
        """The first event's prompt figures (params.prompt_logprobs)."""
        if self.wants_prompt and event.prompt_logprobs is not None:
            self._prompt = [int(self._prompt_tokens[0]), *event.prompt_logprobs]
            self._prompt_tokens = None

    def add(self, event) -> None:
        if self._formatter is not None and event.logprob is not None:
            self._entries.append(event.logprob)

    def _take(self, take: bool) -> list | None:
        if self._formatter is None or (take and not self._entries):
            return None
        entries = self._entries
        if take:
            self._entries = []
        return entries

    def entries(self, take: bool = False) -> list[dict] | None:
        """Chat's entries (token, logprob, bytes, top_logprobs); None when none were asked
        (or, with `take`, none arrived since the last call)."""
        entries = self._take(take)
        return None if entries is None else [self._formatter.chat_entry(lp) for lp in entries]

    def llama(self, take: bool = False, post_sampling: bool = False,
              is_greedy: bool = False) -> list[dict] | None:
        """llama.cpp's `completion_probabilities` (chat's entries with token ids), or None
        as `entries`. `post_sampling`: as probabilities after the sampler chain (the engine's
        figures are the chain's then; a greedy pick's, `is_greedy`, are 1 for it alone)."""
        entries = self._take(take)
        if entries is None:
            return None
        if post_sampling:
            return [self._formatter.prob_entry(certain(lp.token_id) if is_greedy else lp)
                    for lp in entries]
        return [self._formatter.chat_entry(lp, with_ids=True) for lp in entries]

    def chat(self, take: bool = False) -> dict | None:
        """`{"content": [...], "refusal": None}`, or None as `entries`."""
        entries = self.entries(take)
        return None if entries is None else {"content": entries, "refusal": None}

    def completion(self, offset: int, take: bool = False) -> dict | None:
        """The legacy lists: the echoed prompt's first (once; its text from character 0),
        then the generated tokens', whose text starts at character `offset` (the echo's
        length)."""
        prompt, self._prompt = self._prompt, None
        entries = self._take(take)
        if entries is None and prompt is None:
            return None
        chars = self._answer_chars if take else CharOffsets(offset)
        if chars is None:  # a stream's first chunk: the count runs on across its chunks
            chars = self._answer_chars = CharOffsets(offset)
        out = self._formatter.completion_lists(entries or [], chars)
        if prompt is not None:
            head = self._formatter.completion_lists(prompt, CharOffsets())
            out = {key: head[key] + out[key] for key in out}
        return out
