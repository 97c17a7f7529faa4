"""The answers of llama.cpp's native endpoints (`/completion`, `/infill`): the generated text
through an editor's limits (n_indent, t_max_predict_ms), streamed as SSE without [DONE], then
llama.cpp's result fields (stop_type, timings, ...); with `n_probs`, each token's log
probabilities as `completion_probabilities`. And the request fields both endpoints share."""
from __future__ import annotations

import time
from contextlib import closing
from dataclasses import dataclass

from strata.engine.logprobs import MAX_TOP_LOGPROBS
from strata.server.api_error import ApiError, invalid
from strata.server.generation import Outcome, _generated
from strata.server.line_limits import LineLimits
from strata.server.logprobs_format import AnswerLogprobs
from strata.server.openai_format import SSE_KEEPALIVE, sse
from strata.server.schema import (GenerationOptions, _boolean, _integer, _number, _wrong_type,
                                  llama_json_schema, parse_options)
from strata.server.slots_api import LLAMA_REPEAT_LAST_N, RANDOM_SEED, sampling_fields
from strata.server.worker import Job

# llama.cpp's seeds for "a random one": -1 and LLAMA_DEFAULT_SEED (what /props shows)
RANDOM_SEEDS = (-1, RANDOM_SEED)


@dataclass
class LlamaFields:
    """What llama.cpp's native requests share beside the sampling options."""
    options: GenerationOptions
    is_warm_up: bool = False  # n_predict 0: read the prompt into the cache, generate nothing
    max_predict_ms: int = 0  # t_max_predict_ms: past this, the next line break ends it (0: off)
    response_fields: list[str] | None = None  # only these fields in the answer
    returns_tokens: bool = False  # return_tokens: the generated ids in `tokens`
    n_predict: int = -1  # the answer's generation_settings (-1: up to the context's end)


def parse_llama_fields(body: dict, n_ctx: int, tokenizer) -> LlamaFields:
    options = parse_options(_openai_spellings(body, tokenizer), n_ctx)
    # llama.cpp's n_predict beside OpenAI's max_tokens: -1 runs to the context's end, 0 only
    # reads the prompt (an editor warming the cache with the files it will send)
    n_predict = _integer(body, "n_predict", -1, 2**31)
    is_warm_up = n_predict == 0 and options.max_tokens is None
    if options.max_tokens is None and n_predict is not None and n_predict > 0:
        options.max_tokens = min(n_predict, n_ctx)
    shown_n_predict = 0 if is_warm_up else options.max_tokens or -1
    if is_warm_up:
        options.max_tokens = 1  # the one token is not sent
    if options.repetition_penalty is None:  # llama.cpp's name for it
        options.repetition_penalty = _number(body, "repeat_penalty", 0.0, 10.0, low_open=True)
    if options.repeat_last_n is None:  # llama.cpp's window, not the OpenAI endpoints' all
        options.repeat_last_n = LLAMA_REPEAT_LAST_N
    schema = llama_json_schema(body, options)
    if schema is not None:
        options.json_object, options.json_schema = True, schema
    n_probs = _integer(body, "n_probs", 0, MAX_TOP_LOGPROBS)
    if n_probs:  # each token's figure and its n_probs best alternatives
        options.logprobs = n_probs
    # those figures as probabilities after the sampler chain (`prob`, `top_probs`)
    options.post_sampling_probs = _boolean(body, "post_sampling_probs")
    return LlamaFields(options, is_warm_up,
                       max_predict_ms=_integer(body, "t_max_predict_ms", 0, 2**31) or 0,
                       response_fields=_response_fields(body.get("response_fields")),
                       returns_tokens=_boolean(body, "return_tokens"),
                       n_predict=shown_n_predict)


def _openai_spellings(body: dict, tokenizer) -> dict:
    """`body` with llama.cpp's spellings of the fields it shares with OpenAI's API in OpenAI's,
    as llama.cpp reads them: `seed` -1 or 4294967295 a random seed, a negative `temperature`
    greedy, and `logit_bias` as [[token, bias], ...] or an object, a token given by its id or
    by a text (each of the text's tokens biased) and a bias of false banning it."""
    out = dict(body)
    seed = body.get("seed")
    if isinstance(seed, int) and not isinstance(seed, bool) and seed in RANDOM_SEEDS:
        del out["seed"]
    temperature = body.get("temperature")
    if isinstance(temperature, (int, float)) and not isinstance(temperature, bool) \
            and temperature < 0:
        out["temperature"] = 0.0
    bias = body.get("logit_bias")
    if isinstance(bias, list) or (isinstance(bias, dict) and not all(
            k.isascii() and k.isdigit() and not isinstance(v, bool) for k, v in bias.items())):
        out["logit_bias"] = _llama_logit_bias(bias, tokenizer)
    return out


def _llama_logit_bias(bias, tokenizer) -> dict[str, object]:
    """llama.cpp's `logit_bias` as OpenAI's object (token id -> bias), checked there."""
    if isinstance(bias, dict):  # the errors name "logit_bias.KEY"
        pairs = [(f"logit_bias.{k}", f"logit_bias.{k}", k, v) for k, v in bias.items()]
    else:
        pairs = []
        for i, pair in enumerate(bias):
            param = f"logit_bias[{i}]"
            if not isinstance(pair, list) or len(pair) != 2:
                raise _wrong_type(param, pair, "a [token, bias] pair")
            pairs.append((f"{param}[0]", f"{param}[1]", *pair))
    out: dict[str, object] = {}
    for token_param, bias_param, token, value in pairs:
        if value is False:  # llama.cpp's "never": the lowest bias there is here
            value = -100.0
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _wrong_type(bias_param, value, "a number or false")
        is_id = isinstance(token, int) and not isinstance(token, bool)
        if isinstance(token, str) and not (token.isascii() and token.isdigit()):
            ids = tokenizer.encode_plain(token)
            if not ids:
                raise invalid(f"'{token_param}' names an empty text: name a token by its id "
                              "or by a text.", token_param)
        elif isinstance(token, str) or (is_id and token >= 0):
            ids = [token]
        elif is_id:
            raise invalid(f"'{token_param}' is {token}, not a token id (0 or more).",
                          token_param)
        else:
            raise _wrong_type(token_param, token, "a token id or a text")
        out.update((str(t), value) for t in ids)
    return out


def _response_fields(value) -> list[str] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(f, str) and f for f in value):
        raise _wrong_type("response_fields", value, "an array of field names")
    return value


class LlamaReply:
    """One answer: `collect` (whole) or `stream`, then `result`'s fields."""

    def __init__(self, routes, job: Job, req: LlamaFields, outcome: Outcome, started_s: float,
                 logprobs: AnswerLogprobs, is_truncated: bool = False, min_indent: int = 0,
                 prompt_text: str | None = None):
        self.routes, self.job, self.req, self.outcome = routes, job, req, outcome
        self.limits = LineLimits(min_indent, req.max_predict_ms)
        self.logprobs = logprobs
        self.is_truncated = is_truncated
        self.prompt_text = prompt_text  # /completion's answer names its prompt
        self._token_ids: list[int] = []  # generated, not yet sent
        self.started_s = started_s
        self.first_token_s: float | None = None
        self.num_tokens = 0
        self.events = routes._events(job)  # made in the request's context, read in a stream
        # how completion_probabilities read: llama.cpp's post_sampling_probs, a greedy pick
        self._probs_form = {"post_sampling": req.options.post_sampling_probs,
                            "is_greedy": job.params.is_greedy}

    def _pieces(self):
        """The text to send, piece by piece (None: a keep-alive tick); stops the generation
        where a limit ends the completion, then waits for the job's end."""
        with closing(_generated(self.events, self.outcome)) as items:
            for item in items:
                if item is None:
                    yield None
                    continue
                if self.req.is_warm_up or self.limits.is_cut:
                    continue  # a warm-up's token, or one generated before the stop arrived
                self.first_token_s = self.first_token_s or time.perf_counter()
                self.num_tokens += 1
                self.logprobs.add(item)
                self._token_ids.append(item.token_id)
                self.outcome.engine_finish = item.finish_reason or self.outcome.engine_finish
                self.outcome.stop_string = item.stop_string or self.outcome.stop_string
                text = self.limits.feed(item.text)
                if item.finish_reason is not None:
                    text += self.limits.finish()
                if self.limits.is_cut and not self.job.cancel.is_set():
                    self.job.stop_reason = self.limits.cut_reason
                    self.job.cancel.set()  # the engine stops it after this window
                if text:
                    yield text
        if self.outcome.end.error is not None:
            raise self.outcome.end.error

    def collect(self) -> dict:
        """The whole answer's result fields."""
        content = "".join(p for p in self._pieces() if p is not None)
        return self.result(content, self._probs(),
                           self._take_tokens(self.req.returns_tokens))

    def _take_tokens(self, is_asked: bool = True) -> list[int]:
        """The generated ids not sent yet; `is_asked` False: none (a whole answer without
        return_tokens; a stream's pieces carry theirs always, as llama.cpp's do)."""
        taken, self._token_ids = self._token_ids, []
        return taken if is_asked else []

    def stream(self):
        base = {"index": 0, "stop": False, "id_slot": -1}
        try:
            for piece in self._pieces():
                if piece is None:
                    yield SSE_KEEPALIVE
                    continue
                chunk = dict(base, content=piece, tokens=self._take_tokens(),
                             tokens_predicted=self.num_tokens,
                             tokens_evaluated=self.outcome.num_prompt_tokens)
                probs = self._probs(take=True)  # the tokens this piece brings
                if probs is not None:
                    chunk["completion_probabilities"] = probs
                yield sse(chunk)
        except ApiError as exc:
            yield sse(exc.body())
            return
        yield sse(self.result("", self._probs(take=True), self._take_tokens()))

    def _probs(self, take: bool = False) -> list[dict] | None:
        return self.logprobs.llama(take, **self._probs_form)

    def _is_context_full(self) -> bool:
        """The generation ended for want of room in the context (or in a slot's KV), short of
        n_predict: llama.cpp's `truncated` says so too."""
        asked = self.req.options.max_tokens  # the client's (None: up to the context's end)
        return (self.outcome.engine_finish == "length" and not self.limits.is_cut
                and not self.req.is_warm_up and (asked is None or self.num_tokens < asked))

    def _stop_type(self) -> str:
        if self.limits.is_cut or self.req.is_warm_up:
            return "limit"
        finish = self.outcome.engine_finish
        if finish == "stop":
            return "word" if self.outcome.stop_string else "eos"
        return "limit" if finish == "length" else "none"

    def result(self, content: str, probs: list | None = None,
               tokens: list[int] | None = None) -> dict:
        """llama.cpp's final fields (`response_fields` picks some, "a/b" naming a nested one)."""
        end = self.outcome.end
        now = time.perf_counter()
        first = self.first_token_s or now
        num_read = self.outcome.num_prompt_tokens - end.num_cached_tokens
        prompt_ms = (first - self.started_s) * 1000.0
        predicted_ms = (now - first) * 1000.0
        stop_type = self._stop_type()
        self.routes._log(self.job, self.outcome, stop_type)
        out = {
            "index": 0, "content": content, "tokens": tokens or [], "id_slot": -1, "stop": True,
            "model": self.routes.state.model_id,
            "tokens_predicted": self.num_tokens,
            "tokens_evaluated": self.outcome.num_prompt_tokens,
            # llama.cpp's n_past: the tokens the slot's KV holds, the last generated one not
            # read back (at a full context it may not be: this was n_ctx + 1 there)
            "tokens_cached": self.outcome.num_prompt_tokens + max(self.num_tokens - 1, 0),
            "has_new_line": self.limits.has_new_line,
            "truncated": self.is_truncated or self._is_context_full(),
            "stop_type": stop_type,
            "stopping_word": self.outcome.stop_string or "",
            "generation_settings": sampling_fields(self.job.params, self.req.n_predict),
            "timings": {
                "prompt_n": num_read, "prompt_ms": prompt_ms,
                "prompt_per_token_ms": prompt_ms / max(num_read, 1),
                "prompt_per_second": num_read / max(prompt_ms / 1000.0, 1e-9),
                "predicted_n": self.num_tokens, "predicted_ms": predicted_ms,
                "predicted_per_token_ms": predicted_ms / max(self.num_tokens, 1),
                "predicted_per_second": self.num_tokens / max(predicted_ms / 1000.0, 1e-9),
            },
        }
        if self.prompt_text is not None:
            out["prompt"] = self.prompt_text
        if probs is not None:
            out["completion_probabilities"] = probs
        # as llama.cpp's: no fields named (or an empty list) gives them all
        return picked(out, self.req.response_fields) if self.req.response_fields else out


def picked(result: dict, fields: list[str]) -> dict:
    """The named fields of `result`; "timings/prompt_n" reads a nested one and keeps that
    name, as llama.cpp's `response_fields` do; a field it lacks is left out."""
    out = {}
    for name in fields:
        value = result
        for key in name.split("/"):
            if not isinstance(value, dict) or key not in value:
                break
            value = value[key]
        else:
            out[name] = value
    return out
