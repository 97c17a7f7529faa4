"""One request's per-token logic: sample, detokenize, match stop strings; its stats and events.

The scheduler (scheduler.py) owns the model, the slots and the KV; this module owns what happens
per token of one request."""
from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from strata.engine.json_constraint import JsonObjectConstraint, TextConstraint, opens_reasoning
from strata.engine.logprobs import TokenLogprob, chain_logprob, token_logprob
from strata.engine.sampling import Sampler, SamplingParams
from strata.engine.tool_call_constraint import ToolCallConstraint
from strata.engine.thinking_budget import ThinkingBudget
from strata.engine.tool_call_required import RequiredToolCallConstraint
from strata.errors import ModelFormatError
from strata.model.tokenizer import Tokenizer

FINISH_STOP = "stop"      # end-of-sequence / stop token / stop string
FINISH_LENGTH = "length"  # max_tokens reached, or the context is full


@dataclass
class GenerationStats:
    """Counts and timings of one request. Prompt time covers reading the uncached prompt tokens
    up to the first token's logits; decode time covers sampling and the decode forwards after
    it (not the time the consumer spends between events)."""

    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_generated_tokens: int = 0
    num_decode_forwards: int = 0
    num_draft_tokens: int = 0  # --spec-type: guesses read by decode windows
    num_accepted_draft_tokens: int = 0  # guesses that were what the sampler drew
    prompt_seconds: float = 0.0
    decode_seconds: float = 0.0

    @property
    def num_prompt_tokens_computed(self) -> int:
        return self.num_prompt_tokens - self.num_cached_tokens

    @property
    def prompt_tokens_per_s(self) -> float:
        n = self.num_prompt_tokens_computed
        return n / self.prompt_seconds if self.prompt_seconds > 0 else 0.0

    @property
    def num_decode_tokens(self) -> int:
        """Tokens the decode windows gave: one per window plus every accepted draft."""
        return self.num_decode_forwards + self.num_accepted_draft_tokens

    @property
    def decode_tokens_per_s(self) -> float:
        n = self.num_decode_tokens
        return n / self.decode_seconds if self.decode_seconds > 0 else 0.0


@dataclass
class GenerationEvent:
    """One generated token: its id, the text it completes (may be '' while held back), and on
    the last event the finish reason and the request's stats."""

    token_id: int
    text: str
    finish_reason: str | None = None
    stats: GenerationStats | None = None
    stop_string: str | None = None  # on the last event: the stop string that ended it, if one
    # the token's log probability and alternatives, when the request asks (params.logprobs)
    logprob: TokenLogprob | None = None
    # on the first event, when the request asks (params.prompt_logprobs): prompt tokens 1..n-1
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None


@dataclass
class GenerationResult:
    """A whole request collected (see `collect`)."""

    text: str
    token_ids: list[int]
    finish_reason: str
    stats: GenerationStats = field(default_factory=GenerationStats)


def collect(events: Iterator[GenerationEvent]) -> GenerationResult:
    pieces, ids = [], []
    for ev in events:
        pieces.append(ev.text)
        ids.append(ev.token_id)
        if ev.finish_reason is not None:
            return GenerationResult("".join(pieces), ids, ev.finish_reason, ev.stats)
    raise RuntimeError("generation ended without a finish reason")  # a bug, not a user error


class StopStringMatcher:
    """Finds stop strings in streamed text, across token boundaries. Text that may be the start
    of a stop string is held back until it is known not to be; a found stop string and
    everything after it are dropped."""

    def __init__(self, stop: list[str]):
        self.stop = [s for s in stop if s]
        self._held = ""
        self.is_stopped = False
        self.matched: str | None = None  # the stop string found (the earliest in the text)

    def push(self, text: str) -> str:
        """Feed new text; returns what is now safe to emit."""
        if self.is_stopped:
            return ""
        if not self.stop:
            return text
        buf = self._held + text
        hits = [(i, s) for i, s in ((buf.find(s), s) for s in self.stop) if i >= 0]
        if hits:
            self.is_stopped = True
            self._held = ""
            first, self.matched = min(hits, key=lambda hit: hit[0])
            return buf[:first]
        keep = self._longest_partial_suffix(buf)
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """At the end of generation: held text turned out not to be a stop string."""
        out, self._held = ("" if self.is_stopped else self._held), ""
        return out

    def _longest_partial_suffix(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:n]):
                    best = n
                    break
        return best


class TokenDecoder:
    """The per-token logic of one request, shared by every path that generates: sample from
    logits, detokenize, match stop tokens and stop strings, enforce max_tokens and the context.

    The caller runs the forward passes (one sequence or a window of many) and feeds each
    request's logits to `next_event`; decode timings are the caller's to add to the stats."""

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams, prompt_tokens: list[int],
                 stats: GenerationStats):
        self.params = params
        self.stats = stats
        constraint = None
        if params.json_object:  # the stop tokens may end it only once the object is closed
            constraint = JsonObjectConstraint(
                tokenizer, set(params.stop_token_ids) | tokenizer.stop_ids,
                starts_in_reasoning=opens_reasoning(tokenizer, prompt_tokens),
                schema=params.json_schema, reasoning_lead=params.reasoning_lead)
        elif params.grammar is not None:  # the stop tokens only at a sentence's end
            from strata.engine.gbnf import compiled_grammar

            constraint = TextConstraint(
                tokenizer, set(params.stop_token_ids) | tokenizer.stop_ids,
                compiled_grammar(params.grammar).bound(tokenizer).recognizer(),
                starts_in_reasoning=opens_reasoning(tokenizer, prompt_tokens),
                reasoning_lead=params.reasoning_lead)
        elif params.tool_call_required:  # the stop tokens only after a call
            constraint = RequiredToolCallConstraint(
                tokenizer, params.held_tool_calls,
                set(params.stop_token_ids) | tokenizer.stop_ids,
                xml=params.tool_call_form == "xml",
                starts_in_reasoning=opens_reasoning(tokenizer, prompt_tokens),
                max_calls=params.max_tool_calls)
        elif params.held_tool_calls:
            constraint = ToolCallConstraint(tokenizer, params.held_tool_calls,
                                            xml=params.tool_call_form == "xml",
                                            max_calls=params.max_tool_calls)
        if params.thinking_budget is not None:  # the <think> block closed at its budget
            constraint = ThinkingBudget(tokenizer, params.thinking_budget, constraint,
                                        starts_in_reasoning=opens_reasoning(tokenizer,
                                                                            prompt_tokens))
        self._sampler = Sampler(params, prompt_tokens=prompt_tokens, constraint=constraint)
        self._stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            self._stop_ids |= tokenizer.stop_ids
        self._detok = tokenizer.stream_decoder(skip_special=True).after(prompt_tokens)
        self._matcher = StopStringMatcher(params.stop)
        self._vocab_tokens = tokenizer.vocab_size

    def next_event(self, logits: np.ndarray, has_room: bool) -> GenerationEvent:
        """Sample the next token from `logits` [V]. `has_room`: the sequence's KV can take one
        more token (else the token cannot be read back and the request ends with "length").
        An event without a finish reason means: read the token back and call again."""
        stats = self.stats
        t0 = time.perf_counter()
        if hasattr(logits, "candidates"):
            # a row left on the device (CUDA): it picks candidates, padded ids excluded
            token = self._sampler.sample_candidates(logits, self._vocab_tokens)
        else:
            logits = np.asarray(logits).reshape(-1)
            token = None
            # max is NaN if any logit is, +inf if one is, -inf if none is finite: one pass
            peak = logits[:self._vocab_tokens].max()
            if np.isfinite(peak):
                if logits.shape[0] > self._vocab_tokens:
                    # Padded embedding rows have no token text: never pick them.
                    logits = logits.copy()
                    logits[self._vocab_tokens:] = -np.inf
                token = self._sampler.sample(logits)
            else:  # no distribution to sample: a softmax of it is NaN
                what = ("NaN" if np.isnan(peak) else "infinite" if peak > 0
                        else "no finite")
                raise ModelFormatError(
                    f"the model produced {what} logits after {stats.num_generated_tokens} "
                    "generated tokens; its weights are likely corrupt (check it with "
                    "`strata-tool inspect`)")
        if token is None:
            raise ModelFormatError(
                f"the model produced NaN logits after {stats.num_generated_tokens} generated "
                "tokens; its weights are likely corrupt (check it with `strata-tool inspect`)")
        lp = None
        if self.params.logprobs is not None and token not in self._stop_ids:
            # a stop token is not output: no entry
            if self.params.post_sampling_probs:  # what the sampler drew from (llama.cpp's)
                lp = chain_logprob(*self._sampler.last_candidates, token, self.params.logprobs)
            else:  # the row as the model gave it (logprobs.py)
                lp = token_logprob(logits, token, self.params.logprobs, self._vocab_tokens)
        stats.decode_seconds += time.perf_counter() - t0
        stats.num_generated_tokens += 1
        if token in self._stop_ids:
            return GenerationEvent(token, self._tail_text(), FINISH_STOP, stats,
                                   self._matcher.matched, lp)
        text = self._matcher.push(self._detok.push(token))
        if self._matcher.is_stopped:
            return GenerationEvent(token, text, FINISH_STOP, stats, self._matcher.matched, lp)
        if stats.num_generated_tokens < self.params.max_tokens and has_room:
            return GenerationEvent(token, text, logprob=lp)
        # max_tokens reached, or the context is full so the token cannot be read back.
        text += self._tail_text()
        finish = FINISH_STOP if self._matcher.is_stopped else FINISH_LENGTH
        return GenerationEvent(token, text, finish, stats, self._matcher.matched, lp)

    def _tail_text(self) -> str:
        # Held-back bytes and held-back text are final now: release what is not a stop.
        return self._matcher.push(self._detok.flush()) + self._matcher.flush()
