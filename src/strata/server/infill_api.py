"""Code completion in an editor: llama.cpp's `/infill` (llama.vscode, llama.vim) and OpenAI's
`suffix` on `/v1/completions`. Both build the model's fill-in-the-middle prompt
(strata.model.fim); `/infill` also fits it to the context, cutting what the cursor needs
least, and answers in llama.cpp's fields, streamed as SSE without [DONE]."""
from __future__ import annotations

import logging
import time
from contextlib import closing

from flask import jsonify, request

from strata.errors import RequestError
from strata.model.fim import build_infill
from strata.server.api_error import ApiError
from strata.server.generation import GenerationRoutes, Outcome, _generated, _sse_response
from strata.server.infill_schema import InfillRequest, parse_infill_request
from strata.server.line_limits import LineLimits
from strata.server.openai_format import SSE_KEEPALIVE, sse
from strata.server.prompting import fim_tokens
from strata.server.schema import parse_json_body
from strata.server.worker import Job

log = logging.getLogger("strata.server")

# Tokens kept free for the middle when a request names no limit (at most a quarter of the
# context): what the prefix, suffix and other files may take is the rest.
DEFAULT_MIDDLE_TOKENS = 1024


class InfillRoutes(GenerationRoutes):
    def infill(self):
        started_s = time.perf_counter()
        body = parse_json_body(request.get_data())
        engine = self._engine()
        req = parse_infill_request(body, engine.n_ctx)
        self.check_model(req.model)
        fim = fim_tokens(engine, "input_prefix")
        middle = req.options.max_tokens or min(DEFAULT_MIDDLE_TOKENS, engine.n_ctx // 4)
        try:
            prompt = build_infill(engine.tokenizer, fim, req.text,
                                  engine.n_ctx - min(middle, engine.n_ctx // 2))
        except RequestError as exc:
            raise ApiError(400, f"The completion does not fit: {exc}; send a shorter 'prompt' "
                           "or start the server with a larger --ctx-size.", param="prompt",
                           code="context_length_exceeded") from None
        req.options.stop_token_ids = sorted(fim.ids)
        job = self._submit(prompt.tokens, req.options, engine)
        if prompt.is_truncated:
            log.info("request %s: the completion was cut to %d prompt tokens to leave %d for "
                     "the middle (%d of %d other files kept; the prefix's start and the "
                     "suffix's end go next)", job.request_id, len(prompt.tokens), middle,
                     prompt.num_extra, len(req.text.extra))
        reply = InfillReply(self, job, req, Outcome(len(prompt.tokens)), prompt.is_truncated,
                            started_s)
        if req.options.is_stream:
            return _sse_response(reply.stream())
        content = reply.collect()
        return jsonify(reply.result(content))


class InfillReply:
    """One /infill answer: the generated middle through the editor's limits (n_indent,
    t_max_predict_ms), then llama.cpp's result fields."""

    def __init__(self, routes: InfillRoutes, job: Job, req: InfillRequest, outcome: Outcome,
                 is_truncated: bool, started_s: float):
        self.routes, self.job, self.req, self.outcome = routes, job, req, outcome
        self.limits = LineLimits(req.min_indent, req.max_predict_ms)
        self.is_truncated = is_truncated
        self.started_s = started_s
        self.first_token_s: float | None = None
        self.num_tokens = 0
        self.events = routes._events(job)  # made in the request's context, read in a stream

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

    def collect(self) -> str:
        return "".join(p for p in self._pieces() if p is not None)

    def stream(self):
        base = {"index": 0, "stop": False, "id_slot": -1}
        try:
            for piece in self._pieces():
                if piece is None:
                    yield SSE_KEEPALIVE
                    continue
                yield sse(dict(base, content=piece, tokens=[],
                               tokens_predicted=self.num_tokens,
                               tokens_evaluated=self.outcome.num_prompt_tokens))
        except ApiError as exc:
            yield sse(exc.body())
            return
        yield sse(self.result(""))

    def _stop_type(self) -> str:
        if self.limits.is_cut or self.req.is_warm_up:
            return "limit"
        finish = self.outcome.engine_finish
        if finish == "stop":
            return "word" if self.outcome.stop_string else "eos"
        return "limit" if finish == "length" else "none"

    def result(self, content: str) -> dict:
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
            "index": 0, "content": content, "tokens": [], "id_slot": -1, "stop": True,
            "model": self.routes.state.model_id,
            "tokens_predicted": self.num_tokens,
            "tokens_evaluated": self.outcome.num_prompt_tokens,
            "tokens_cached": self.outcome.num_prompt_tokens + self.num_tokens,
            "has_new_line": self.limits.has_new_line,
            "truncated": self.is_truncated,
            "stop_type": stop_type,
            "stopping_word": self.outcome.stop_string or "",
            "timings": {
                "prompt_n": num_read, "prompt_ms": prompt_ms,
                "prompt_per_token_ms": prompt_ms / max(num_read, 1),
                "prompt_per_second": num_read / max(prompt_ms / 1000.0, 1e-9),
                "predicted_n": self.num_tokens, "predicted_ms": predicted_ms,
                "predicted_per_token_ms": predicted_ms / max(self.num_tokens, 1),
                "predicted_per_second": self.num_tokens / max(predicted_ms / 1000.0, 1e-9),
            },
        }
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
