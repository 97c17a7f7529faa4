"""Sampling: validated request parameters and the logits -> token step.

Order (as transformers applies them): penalties, temperature, top-k, top-p, min-p, draw.
"""
from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

import numpy as np

from strata.engine.best_allowed import best_in_tree, irregular_ids, spelled_irregular
from strata.engine.logprobs import MAX_TOP_LOGPROBS
from strata.errors import RequestError


@dataclass
class SamplingParams:
    """How to pick tokens. temperature 0 means greedy; top_k 0 means no top-k cut."""

    temperature: float = 0.8
    top_p: float = 0.95
    top_k: int = 40
    min_p: float = 0.05
    repetition_penalty: float = 1.0
    # llama.cpp's repeat_last_n: the repetition penalty covers the last N tokens (prompt and
    # generated) only; -1 every token (the default), 0 none
    repeat_last_n: int = -1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int = 256
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # OpenAI's logit_bias: token id -> a number in [-100, 100] added to its logit after the
    # penalties (-100 all but bans the token, 100 all but forces it)
    logit_bias: dict[int, float] = field(default_factory=dict)
    # the output is one JSON object (after any <think> block): engine/json_constraint.py;
    # json_schema: that object also follows this JSON schema, as engine/json_schema.py holds it
    json_object: bool = False
    json_schema: dict | None = None
    # llama.cpp's GBNF grammar: the output (after any <think> block) is a sentence of it,
    # engine/gbnf.py; excludes json_object and held_tool_calls
    grammar: str | None = None
    # a reasoning model's <think> block may come before what json_object or grammar hold (a
    # chat template's prompt); False: they hold the whole output, as llama.cpp's grammars do
    # (a raw prompt: /completion, /infill, /v1/completions, `strata run --raw`)
    reasoning_lead: bool = True
    # each <tool_call> block a call of one of these functions ({"name", "parameters"}), in the
    # form tool_call_form says ("json": Qwen's, "xml": Qwen3-Coder's <function=...>):
    # engine/tool_call_constraint.py (the server sets both from the chat template)
    held_tool_calls: list[dict] | None = None
    tool_call_form: str = "json"
    # the answer opens with a call (tool_choice "required" or a named function):
    # engine/tool_call_required.py
    tool_call_required: bool = False
    # at most this many calls (None: any; 1 for OpenAI's parallel_tool_calls false)
    max_tool_calls: int | None = None
    # at most this many tokens inside a reasoning model's <think> block, then it is closed
    # (engine/thinking_budget.py); None: no budget
    thinking_budget: int | None = None
    # OpenAI's logprobs: each generated token's log probability and this many alternatives
    # (0 to logprobs.MAX_TOP_LOGPROBS) on its event (engine/logprobs.py); None: none
    logprobs: int | None = None
    # the same for every prompt token after the first (the completions endpoint's echo): the
    # prompt is then read whole, reusing no cached prefix, its rows' logits all returned
    prompt_logprobs: int | None = None
    # llama.cpp's post_sampling_probs: those figures are the sampler chain's (the distribution
    # the token was drawn from: logprobs.chain_logprob), not the model's raw ones
    post_sampling_probs: bool = False

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._check_logit_bias()
        if self.held_tool_calls is not None:
            if not isinstance(self.held_tool_calls, list) or not all(
                    isinstance(f, dict) and isinstance(f.get("name"), str) and f["name"]
                    for f in self.held_tool_calls) or not self.held_tool_calls:
                raise RequestError(f"held_tool_calls = {self.held_tool_calls!r} is invalid: it "
                                   "must be a non-empty list of functions with a 'name'")
            if self.tool_call_form not in ("json", "xml"):
                raise RequestError(f"tool_call_form = {self.tool_call_form!r} is invalid: it "
                                   "must be 'json' or 'xml'")
            if self.json_object:
                raise RequestError("json_object and held_tool_calls exclude each other: an "
                                   "answer is either one JSON object or text with tool calls")
        elif self.tool_call_required or self.max_tool_calls is not None:
            raise RequestError("tool_call_required and max_tool_calls need held_tool_calls: "
                               "the functions the calls may name")
        if self.thinking_budget is not None and (
                isinstance(self.thinking_budget, bool)
                or not isinstance(self.thinking_budget, int) or self.thinking_budget < 0):
            raise RequestError(f"thinking_budget = {self.thinking_budget!r} is invalid: it must "
                               "be an integer >= 0 or None")
        if self.max_tool_calls is not None and (
                isinstance(self.max_tool_calls, bool) or not isinstance(self.max_tool_calls, int)
                or self.max_tool_calls < 1):
            raise RequestError(f"max_tool_calls = {self.max_tool_calls!r} is invalid: it must "
                               "be an integer >= 1 or None")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or not 0 <= value <= MAX_TOP_LOGPROBS):
                raise RequestError(f"{name} = {value!r} is invalid: it must be an integer "
                                   f"from 0 to {MAX_TOP_LOGPROBS} (alternatives per token) "
                                   "or None")
        if self.grammar is not None:
            if self.json_object or self.held_tool_calls is not None:
                raise RequestError("grammar excludes json_object and held_tool_calls: the "
                                   "answer follows one of them")
            if not isinstance(self.grammar, str):
                raise RequestError(f"grammar = {self.grammar!r} is invalid: it must be a GBNF "
                                   "grammar's text or None")
            from strata.engine.gbnf import compiled_grammar

            compiled_grammar(self.grammar)  # GrammarError (a RequestError) names the fault
        if self.json_schema is not None:
            if not isinstance(self.json_schema, dict):
                raise RequestError(f"json_schema = {self.json_schema!r} is invalid: it must be "
                                   "a JSON schema (a dict) or None")
            from strata.engine.json_schema import compile_schema

            try:
                compile_schema(self.json_schema)
            except RecursionError:
                raise RequestError("json_schema is nested too deeply to hold") from None
        self._check()

    def _check_logit_bias(self) -> None:
        bias = self.logit_bias or {}
        if not isinstance(bias, dict):
            raise RequestError(f"logit_bias = {bias!r} is invalid: it must be a dict of token "
                               "id -> bias")
        clean = {}
        for token, value in bias.items():
            if (not isinstance(token, (int, np.integer)) or isinstance(token, bool)
                    or token < 0):
                raise RequestError(f"logit_bias key {token!r} is invalid: it must be a "
                                   "non-negative token id")
            if (not isinstance(value, (int, float, np.number)) or isinstance(value, bool)
                    or not np.isfinite(value) or not -100 <= value <= 100):
                raise RequestError(f"logit_bias[{token}] = {value!r} is invalid: it must be a "
                                   "number in [-100, 100]")
            if value != 0:
                clean[int(token)] = float(value)
        self.logit_bias = clean

    def _check(self) -> None:
        def bad(name: str, rule: str):
            raise RequestError(f"{name} = {getattr(self, name)!r} is invalid: it must be {rule}")

        def is_number(name: str) -> bool:
            v = getattr(self, name)
            return isinstance(v, (int, float)) and not isinstance(v, bool) and np.isfinite(v)

        def is_int(name: str) -> bool:
            v = getattr(self, name)
            return isinstance(v, (int, np.integer)) and not isinstance(v, bool)

        for name in ("temperature", "top_p", "min_p", "repetition_penalty",
                     "presence_penalty", "frequency_penalty"):
            if not is_number(name):
                bad(name, "a finite number")
        for name in ("top_k", "max_tokens", "repeat_last_n"):
            if not is_int(name):
                bad(name, "an integer")
        if self.repeat_last_n < -1:
            bad("repeat_last_n", ">= -1 (-1: every token, 0: none)")
        if self.temperature < 0:
            bad("temperature", ">= 0 (0 picks the most likely token)")
        if not 0 < self.top_p <= 1:
            bad("top_p", "in (0, 1]")
        if self.top_k < 0:
            bad("top_k", ">= 0 (0 disables top-k)")
        if not 0 <= self.min_p <= 1:
            bad("min_p", "in [0, 1]")
        if self.repetition_penalty <= 0:
            bad("repetition_penalty", "> 0 (1 disables it)")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                bad(name, "in [-2, 2]")
        if self.max_tokens < 1:
            bad("max_tokens", ">= 1")
        if self.seed is not None and (not is_int("seed") or self.seed < 0):
            bad("seed", "a non-negative integer, or None for a random seed")
        if not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "a list of non-empty strings")
        if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) and t >= 0
                   for t in self.stop_token_ids):
            bad("stop_token_ids", "a list of non-negative token ids")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0


MAX_REFUSED = 16  # draws a constraint may refuse before the sampler takes its best allowed token


def _ranked(logits: np.ndarray, ids: np.ndarray, k: int | None) -> np.ndarray:
    """Of `ids`, the k (None: all) of the largest logits, largest first, ties lowest id first."""
    if k is not None and k < ids.shape[0]:
        ids = ids[np.argpartition(-logits[ids], k)[:k]]
    return ids[np.lexsort((ids, -logits[ids]))]


def greedy(logits: np.ndarray) -> int:
    """argmax; ties go to the lowest id (numpy's argmax returns the first maximum)."""
    return int(np.argmax(logits))


def penalty_entries(seen: set[int], generated: Counter, repetition_penalty: float,
                    presence_penalty: float, frequency_penalty: float,
                    logit_bias: dict[int, float] | None = None):
    """The penalties and the logit bias as per-token entries (ids int32 ascending, repetition
    factor float32 (1 = none), subtraction float32), or None when none applies. A token's
    logit x becomes (x / f if x > 0 else x * f) - s: the repetition penalty (HF/llama.cpp) on
    every token in `seen` (prompt and generated, or the last repeat_last_n); the presence
    and frequency penalties (vLLM's OpenAI server) on the generated tokens and their counts,
    less the token's bias (OpenAI's logit_bias, added after the penalties). The device's
    candidates take the same entries."""
    is_rep = repetition_penalty != 1.0 and bool(seen)
    is_count = (presence_penalty != 0.0 or frequency_penalty != 0.0) and bool(generated)
    bias = logit_bias or {}
    if not (is_rep or is_count or bias):
        return None
    # numpy throughout: a long context's `seen` holds tens of thousands of ids, every token
    rep_ids = (np.fromiter(seen, dtype=np.int64, count=len(seen)) if is_rep
               else np.zeros(0, np.int64))
    counts = generated if is_count else {}
    count_ids = np.fromiter(counts.keys(), dtype=np.int64, count=len(counts))
    bias_ids = np.fromiter(bias.keys(), dtype=np.int64, count=len(bias))
    ids = np.unique(np.concatenate((rep_ids, count_ids, bias_ids)))  # sorted, distinct
    rep = np.ones(len(ids), dtype=np.float32)
    rep[np.searchsorted(ids, rep_ids)] = np.float32(repetition_penalty)
    n = np.zeros(len(ids), dtype=np.float32)
    n[np.searchsorted(ids, count_ids)] = np.fromiter(counts.values(), dtype=np.float32,
                                                     count=len(counts))
    sub = np.where(n > 0, n * np.float32(frequency_penalty) + np.float32(presence_penalty),
                   np.float32(0)).astype(np.float32)
    if bias:
        sub[np.searchsorted(ids, bias_ids)] -= np.fromiter(bias.values(), dtype=np.float32,
                                                           count=len(bias))
    return ids.astype(np.int32), rep, sub


def apply_penalties(logits: np.ndarray, seen: set[int], generated: Counter,
                    repetition_penalty: float, presence_penalty: float,
                    frequency_penalty: float,
                    logit_bias: dict[int, float] | None = None) -> np.ndarray:
    """The logits after the penalties and bias of `penalty_entries` (a copy; the input when
    none)."""
    entries = penalty_entries(seen, generated, repetition_penalty, presence_penalty,
                              frequency_penalty, logit_bias)
    if entries is None:
        return logits
    ids, rep, sub = entries
    out = logits.astype(np.float32, copy=True)
    x = out[ids]
    x = np.where(rep != 1, np.where(x > 0, x / rep, x * rep), x)
    out[ids] = np.where(sub != 0, x - sub, x)
    return out


def filter_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float,
                 min_p: float) -> tuple[np.ndarray, np.ndarray]:
    """(candidate ids, their probabilities summing to 1) after temperature, top-k, top-p, min-p.

    With any filter on, candidates are sorted by probability, highest first (ties: lowest id
    first); with none, they are all ids in id order. Only the tokens that can survive are
    sorted, so a 150k vocabulary costs a few partitions rather than a full sort."""
    with np.errstate(over="ignore"):
        z = logits.astype(np.float64) / temperature  # [V]
    if not np.isfinite(z.max()):
        # A temperature so small that logits / temperature overflows: its limit is greedy.
        # (-inf entries, e.g. padded ids, are fine: their weight is 0.)
        return np.array([greedy(logits)]), np.ones(1)
    ids = _top_k_ids(z, top_k) if 0 < top_k < z.shape[0] else None  # [K] ascending, or all
    zk = z if ids is None else z[ids]
    z_max = zk.max()
    weights = np.exp(zk - z_max)
    total = weights.sum()
    # Top-p and min-p each keep a prefix of the sorted order, i.e. every value above some
    # threshold: find a threshold that keeps a superset of both, then cut exactly below.
    threshold = -np.inf
    if min_p > 0.0:
        threshold = z_max + np.log(min_p) - 1e-9
    if top_p < 1.0:
        threshold = max(threshold, _top_p_threshold(zk, weights, total, top_p))
    if ids is None and top_p >= 1.0 and min_p <= 0.0:
        return np.arange(z.shape[0]), weights / total
    sel = np.flatnonzero(zk >= threshold)
    order = sel[np.argsort(-zk[sel], kind="stable")]  # stable on ascending ids: ties lowest first
    cand = order if ids is None else ids[order]
    return cut_sorted(cand, weights[order] / total, top_p, min_p)


def cut_sorted(cand: np.ndarray, probs: np.ndarray, top_p: float,
               min_p: float) -> tuple[np.ndarray, np.ndarray]:
    """Top-p and min-p over candidates sorted best first with their probabilities (of the
    whole distribution); returns the survivors and their renormalised probabilities."""
    if top_p < 1.0:
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        keep = int(np.searchsorted(np.cumsum(probs), top_p - 1e-12)) + 1
        cand, probs = cand[:keep], probs[:keep]
    if min_p > 0.0:
        mask = probs >= min_p * probs[0]
        cand, probs = cand[mask], probs[mask]
    return cand, probs / probs.sum()


def _top_k_ids(z: np.ndarray, k: int) -> np.ndarray:
    """Ascending ids of the k largest values; ties at the boundary go to the lowest ids."""
    kth = np.partition(z, -k)[-k]
    above = np.flatnonzero(z > kth)
    tied = np.flatnonzero(z == kth)[: k - above.shape[0]]
    return np.sort(np.concatenate([above, tied]))


def _top_p_threshold(z: np.ndarray, weights: np.ndarray, total: float, top_p: float) -> float:
    """A value v such that the tokens with z >= v hold at least top_p of the mass (-inf: all)."""
    n = z.shape[0]
    k = 64
    while k < n:
        v = np.partition(z, n - k)[n - k]  # the k-th largest value
        # A margin over top_p so that rounding in the exact cut below cannot need more tokens.
        if weights[z >= v].sum() >= (top_p + 1e-9) * total:
            return float(v)
        k *= 8
    return -np.inf


class Sampler:
    """Picks the next token from logits; remembers the tokens it has seen for the penalties.
    With a `constraint` (allows(token), push(token), candidates(): json_constraint.py) only
    tokens it allows are picked: a refused draw is masked and drawn again. Its best allowed
    token is found in the vocabulary's prefix tree (engine/best_allowed.py), which takes
    `allows` to read a token's bytes in order: where it refuses a plain token, it refuses every
    plain token that starts with those bytes (best_allowed.irregular_ids names the tokens
    judged otherwise)."""

    def __init__(self, params: SamplingParams, prompt_tokens: list[int] | None = None,
                 constraint=None):
        self.params = params
        self.rng = np.random.default_rng(params.seed)
        # (through numpy: an agent's prompt is tens of thousands of tokens, placed between
        # two windows of the other slots)
        prompt = np.asarray(prompt_tokens if prompt_tokens is not None else [],
                            dtype=np.int64)
        self._last_n = params.repeat_last_n
        self._recent = None  # the last N tokens and their counts, with repeat_last_n N > 0
        if self._last_n > 0:
            tail = prompt[max(len(prompt) - self._last_n, 0):].tolist()  # all if shorter
            self._recent = (deque(tail), Counter(tail))
            self.seen: set[int] = set(self._recent[1])
        else:
            self.seen = set(prompt.tolist()) if self._last_n else set()
        self.generated: Counter = Counter()
        self.constraint = constraint
        # the last pick's candidates and their probabilities: what the draw chose from (a
        # greedy or forced pick alone with 1); logprobs.chain_logprob reads them
        self.last_candidates: tuple[np.ndarray, np.ndarray] | None = None
        self._prefix = None  # _prefix_tree()

    def accept(self, token_id: int) -> None:
        """Record a generated token for the penalties (and the constraint)."""
        token_id = int(token_id)
        if self._recent is not None:  # the window of the repetition penalty slides
            window, counts = self._recent
            window.append(token_id)
            counts[token_id] += 1
            self.seen.add(token_id)
            if len(window) > self._last_n:
                old = window.popleft()
                counts[old] -= 1
                if not counts[old]:
                    del counts[old]
                    self.seen.discard(old)
        elif self._last_n:
            self.seen.add(token_id)
        self.generated[token_id] += 1
        if self.constraint is not None:
            self.constraint.push(token_id)

    def sample(self, logits: np.ndarray) -> int:
        """The next token for logits [V]; also records it."""
        p = self.params
        logits = np.asarray(logits).reshape(-1)
        logits = apply_penalties(logits, self.seen, self.generated, p.repetition_penalty,
                                 p.presence_penalty, p.frequency_penalty, p.logit_bias)
        if self.constraint is not None:
            token = self._constrained(logits)
        elif p.is_greedy:
            token = self._certain(greedy(logits))
        else:
            ids, probs = filter_probs(logits, p.temperature, p.top_k, p.top_p, p.min_p)
            token = self._draw(ids, probs)
        self.accept(token)
        return token

    def _certain(self, token: int) -> int:
        """`token`, a pick that was sure (greedy, or forced by a constraint)."""
        self.last_candidates = (np.array([token]), np.ones(1))
        return token

    def _constrained(self, logits: np.ndarray) -> int:
        """A token the constraint allows: greedy, the best allowed one; sampled, a draw from the
        filtered distribution with each refused token masked and the rest renormalised
        (MAX_REFUSED draws, then the best allowed). If the constraint allows nothing, the
        unconstrained pick (its grammar has no way on, e.g. a finished object under
        ignore_eos)."""
        p = self.params
        allows = self.constraint.allows
        candidates = None  # the constraint's, asked once a pick (no token is taken between)
        if not p.is_greedy:
            ids, probs = filter_probs(logits, p.temperature, p.top_k, p.top_p, p.min_p)
            for attempt in range(MAX_REFUSED):
                if ids.shape[0] == 0 or not probs.sum() > 0:
                    break
                token = self._draw(ids, probs / probs.sum())
                if allows(token):
                    return token
                keep = ids != token
                if attempt == 0:  # refused: of the rest, only the candidates can pass (a
                    # superset of the allowed ids, so the allowed ones keep their odds; a
                    # grammar that takes few ids refused all 16 draws of a wide vocabulary)
                    candidates = self.constraint.candidates()
                    keep &= _id_mask(candidates, logits.shape[0])[ids]
                ids, probs = ids[keep], probs[keep]
        token = self._best_allowed(logits, candidates)
        if token is None:
            if p.is_greedy:
                return self._certain(greedy(logits))
            ids, probs = filter_probs(logits, p.temperature, p.top_k, p.top_p, p.min_p)
            return self._draw(ids, probs)
        return self._certain(token)

    def _best_allowed(self, logits: np.ndarray,
                      candidates: np.ndarray | None = None) -> int | None:
        """The allowed token of the largest finite logit (ties: the lowest id) among the
        constraint's candidates, or None: the argmax when allowed, else a search of the
        vocabulary's prefix tree (engine/best_allowed.py), or where that cannot be used the best 64
        candidates, then all, in logit order."""
        allows = self.constraint.allows
        best = greedy(logits)
        if allows(best):
            return best
        if candidates is None:
            candidates = self.constraint.candidates()
        candidates = candidates[candidates < logits.shape[0]]
        prefix = self._prefix_tree()
        irregular = irregular_ids(self.constraint) if prefix is not None else None
        if irregular is not None:
            return best_in_tree(self.constraint.allows, logits, candidates, *prefix, irregular)
        for k in (64, None):
            for token in _ranked(logits, candidates, k):
                if np.isfinite(logits[token]) and allows(int(token)):
                    return int(token)
        return None

    def _prefix_tree(self):
        """(the PrefixTree of the constraint's tokenizer, `spelled_irregular` of it), or None
        where the constraint names no tokenizer (each keeps its own as `_tokenizer`)."""
        if self._prefix is None:
            tokenizer = getattr(self.constraint, "_tokenizer", None)
            if tokenizer is None or not hasattr(tokenizer, "prefix_tree"):
                return None
            tree = tokenizer.prefix_tree()
            self._prefix = (tree, spelled_irregular(tokenizer, tree))
        return self._prefix

    def sample_candidates(self, row, num_valid: int) -> int | None:
        """The next token for a logit row left on the device (`row.candidates`, see
        backends/cuda/logits.py): the device applies the penalties and bias and returns the best
        candidates; the same filters and draw as `sample` run on them. Falls back to the whole
        row when the candidates cannot decide (no top-k and a top-p/min-p cut beyond them).
        A greedy request without penalties or bias takes the row's `greedy_id` (the pass's argmax)
        when the row has one among the valid ids. None: the row holds a NaN."""
        p = self.params
        if self.constraint is not None and not getattr(self.constraint, "is_free", False):
            return self._sample_whole(row, num_valid)  # it reads token by token: on the host
        pen = penalty_entries(self.seen, self.generated, p.repetition_penalty,
                              p.presence_penalty, p.frequency_penalty, p.logit_bias)
        best = getattr(row, "greedy_id", None) if p.is_greedy and pen is None else None
        if best is not None and best < num_valid:  # the pass's argmax: -1 for a NaN row
            if best < 0:
                return None
            token = self._certain(best)
        elif p.is_greedy:
            found = row.candidates(1, 1.0, pen, num_valid, want_mass=False)
            if found is None:
                return None
            token = self._certain(int(found.ids[0]))
        else:
            has_top_k = 0 < p.top_k < num_valid
            if has_top_k and p.top_k > row.max_candidates:
                return self._sample_whole(row, num_valid)
            num = p.top_k if has_top_k else min(row.max_candidates, num_valid)
            found = row.candidates(num, p.temperature, pen, num_valid, want_mass=not has_top_k)
            if found is None:
                return None
            with np.errstate(over="ignore"):
                z = found.values.astype(np.float64) / p.temperature  # [C] best first
            if not np.isfinite(z[0]):
                token = self._certain(int(found.ids[0]))  # as filter_probs: the limit is greedy
            else:
                weights = np.exp(z - z[0])
                total = found.mass if not has_top_k else weights.sum()
                probs = weights / total
                if not has_top_k and not self._decided_by(probs, num_valid):
                    return self._sample_whole(row, num_valid)
                ids, probs = cut_sorted(found.ids, probs, p.top_p, p.min_p)
                token = self._draw(ids, probs)
        self.accept(token)
        return token

    def _decided_by(self, probs: np.ndarray, num_valid: int) -> bool:
        """Whether the best candidates hold every token top-p / min-p would keep."""
        p = self.params
        if probs.shape[0] >= num_valid:
            return True
        if p.top_p < 1.0 and np.cumsum(probs)[-1] >= p.top_p + 1e-9:
            return True
        return p.min_p > 0.0 and probs[-1] < p.min_p * probs[0]

    def _sample_whole(self, row, num_valid: int) -> int | None:
        logits = np.array(np.asarray(row), dtype=np.float32).reshape(-1)
        logits[num_valid:] = -np.inf
        if np.isnan(logits.max()):
            return None
        return self.sample(logits)

    def _draw(self, ids: np.ndarray, probs: np.ndarray) -> int:
        # Inverse-CDF draw: one uniform number per token keeps a seed's sequence stable.
        self.last_candidates = (ids, probs)
        u = self.rng.random()
        pos = min(int(np.searchsorted(np.cumsum(probs), u, side="right")), ids.shape[0] - 1)
        return int(ids[pos])


def _id_mask(ids: np.ndarray, size: int) -> np.ndarray:
    """bool [size]: `ids` (those below size)."""
    mask = np.zeros(size, dtype=bool)
    mask[ids[ids < size]] = True
    return mask
