"""The two generating endpoints: validate, build the prompt, queue a job on the engine thread,
then answer whole or stream it as SSE (keep-alives while waiting, errors as events)."""
from __future__ import annotations

import logging
import uuid
from contextlib import closing
from dataclasses import dataclass, field

from flask import Response, jsonify, request

from strata.server.api_error import ApiError
from strata.server.logprobs_format import AnswerLogprobs
from strata.server.openai_format import (SSE_DONE, SSE_KEEPALIVE, ResponseHeader, chat_deltas,
                                         sse, usage)
from strata.server.output_parser import (ContentDelta, OutputParser, ReasoningDelta, ToolCall,
                                         new_call_id)
from strata.server.prompting import (build_chat_prompt, check_prompt_fits,
                                     completion_prompt_tokens, fim_prompt_tokens,
                                     sampling_params)
from strata.server.schema import (GenerationOptions, parse_chat_request,
                                  parse_completion_request, parse_json_body)
from strata.server.worker import Job, JobEnd, iterate_job

log = logging.getLogger("strata.server")


@dataclass
class Outcome:
    """What one request produced, for the final chunk, the usage and the log line."""
    num_prompt_tokens: int
    end: JobEnd | None = None
    engine_finish: str | None = None
    is_call_cut: bool = False
    tool_calls: list = field(default_factory=list)
    stop_string: str | None = None  # the stop string that ended the output, if one did
    num_reasoning_tokens: int = 0  # generated inside a <think> block

    def finish_reason(self, num_tool_calls: int) -> str:
        if self.engine_finish == "length" or self.engine_finish is None:
            return "length"
        return "tool_calls" if num_tool_calls else "stop"

    def usage(self) -> dict:
        end = self.end or JobEnd()
        return usage(self.num_prompt_tokens, end.num_generated_tokens, end.num_cached_tokens,
                     self.num_reasoning_tokens)


class GenerationRoutes:
    def __init__(self, state):
        self.state = state

    # ---- shared steps ---------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        names = self.state.model_names
        if model is not None and model not in names:
            served = " or ".join(repr(n) for n in names)
            raise ApiError(404, f"The model {model!r} does not exist; this server serves "
                           f"{served} (see GET /v1/models; `strata serve --alias` adds "
                           "names).", param="model", code="model_not_found")

    def _engine(self):
        worker = self.state.worker
        if worker.state != "ok":
            raise worker.unavailable()
        return worker.engine

    def _submit(self, prompt_tokens: list[int], options: GenerationOptions, engine) -> Job:
        if options.thinking_budget is None:  # --reasoning-budget
            options.thinking_budget = self.state.config.reasoning_budget
        params = sampling_params(options, len(prompt_tokens), engine.n_ctx,
                                 min(engine.tokenizer.vocab_size, engine.spec.vocab))
        job = Job(request_id=uuid.uuid4().hex[:12], prompt_tokens=prompt_tokens, params=params)
        self.state.worker.submit(job)
        return job

    def _start_chat(self, engine, req, prompt, new_id=new_call_id) -> tuple[Job, OutputParser]:
        """Queue a chat-shaped request whose prompt is built and checked: its tool calls held
        as the prompt's template asks; the parser that reads its output (`new_id`: the ids of
        the tool calls it finds)."""
        req.options.held_tool_calls = prompt.held_tool_calls
        req.options.tool_call_form = prompt.tool_call_form
        # a call the request requires is held to come first (where calls are held at all)
        req.options.tool_call_required = prompt.held_tool_calls is not None and (
            req.tool_choice == "required" or isinstance(req.tool_choice, dict))
        job = self._submit(prompt.tokens, req.options, engine)
        parser = OutputParser(starts_in_reasoning=prompt.starts_in_reasoning,
                              parse_tools=prompt.is_tool_parsing,
                              param_types=prompt.param_types, new_id=new_id)
        return job, parser

    def _log(self, job: Job, outcome: Outcome, finish_reason: str) -> None:
        end = outcome.end or JobEnd()
        ttft = f"{end.ttft_s:.3f} s" if end.ttft_s is not None else "-"
        log.info("request %s: prompt %d tokens (%d cached), generated %d, ttft %s, "
                 "%.1f tokens/s, finish %s%s", job.request_id, outcome.num_prompt_tokens,
                 end.num_cached_tokens, end.num_generated_tokens, ttft,
                 end.decode_tokens_per_s, finish_reason,
                 f" (stopped: {job.stop_reason})" if job.stop_reason else
                 " (cancelled: client went away)" if end.is_cancelled else "")
        if outcome.is_call_cut:
            log.warning("request %s: the output ended inside a tool call (engine finish %s); "
                        "the partial call was dropped", job.request_id, outcome.engine_finish)

    def _events(self, job: Job):
        disconnected = request.environ.get("waitress.client_disconnected")
        return iterate_job(job, self.state.config.keepalive_s, disconnected)

    # ---- /v1/chat/completions ---------------------------------------------------------------
    def chat(self):
        body = parse_json_body(request.get_data())
        engine = self._engine()
        req = parse_chat_request(body, engine.n_ctx)
        self.check_model(req.model)
        prompt = build_chat_prompt(engine, req)
        check_prompt_fits(len(prompt.tokens), engine.n_ctx)
        job, parser = self._start_chat(engine, req, prompt)
        header = ResponseHeader("chat", self.state.model_id)
        outcome = Outcome(len(prompt.tokens))
        events = self._events(job)
        logprobs = AnswerLogprobs.of(engine, req.options)
        if req.options.is_stream:
            return _sse_response(self._chat_stream(job, events, parser, header, outcome,
                                                   req.options.is_usage_streamed, logprobs))
        pieces = []
        with closing(_generated(events, outcome)) as items:  # a failure here must not leave
            for item in items:                                 # the generation running
                if item is not None:
                    logprobs.add(item)
                    pieces += self._parse(parser, item, outcome)
        if outcome.end.error is not None:
            raise outcome.end.error
        content = "".join(e.text for e in pieces if isinstance(e, ContentDelta))
        reasoning = "".join(e.text for e in pieces if isinstance(e, ReasoningDelta))
        calls = [e for e in pieces if isinstance(e, ToolCall)]
        finish = outcome.finish_reason(len(calls))
        self._log(job, outcome, finish)
        return jsonify(header.chat_completion(content, reasoning, calls, finish,
                                              outcome.usage(), logprobs.chat()))

    @staticmethod
    def _parse(parser: OutputParser, event, outcome: Outcome) -> list:
        was_reasoning = parser.is_in_reasoning
        out = parser.feed(event.text)
        # a token of <think> ... </think>, either tag included
        outcome.num_reasoning_tokens += was_reasoning or parser.is_in_reasoning
        if event.finish_reason is not None:
            outcome.engine_finish = event.finish_reason
            outcome.stop_string = event.stop_string
            outcome.is_call_cut = parser.is_inside_tool_call
            out += parser.finish()
        return out

    def _chat_stream(self, job, events, parser, header, outcome, is_usage_streamed,
                     logprobs=None):
        logprobs = logprobs or AnswerLogprobs(None)

        def chunk(delta, finish=None):  # the tokens not yet sent go with the next chunk
            return sse(header.chunk(delta, finish, is_usage_streamed, logprobs.chat(take=True)))

        with closing(_generated(events, outcome)) as items:
            yield sse(header.chunk({"role": "assistant", "content": ""}, None,
                                   is_usage_streamed))
            for item in items:
                if item is None:
                    yield SSE_KEEPALIVE
                    continue
                logprobs.add(item)
                for parsed in self._parse(parser, item, outcome):
                    for delta in chat_deltas(parsed):
                        yield chunk(delta)
        yield from self._stream_end(job, header, outcome, parser.num_tool_calls,
                                    lambda finish: chunk({}, finish), is_usage_streamed)

    # ---- /v1/completions ------------------------------------------------------------------
    def completions(self):
        body = parse_json_body(request.get_data())
        engine = self._engine()
        req = parse_completion_request(body, engine.n_ctx)
        self.check_model(req.model)
        if req.suffix is None:
            tokens = completion_prompt_tokens(engine, req.prompt)
        else:  # fill in the middle: the completion goes between prompt and suffix
            tokens = fim_prompt_tokens(engine, req.prompt, req.suffix)
            req.options.stop_token_ids = sorted(engine.tokenizer.fim.ids)
        check_prompt_fits(len(tokens), engine.n_ctx, "prompt")
        job = self._submit(tokens, req.options, engine)
        header = ResponseHeader("completion", self.state.model_id)
        outcome = Outcome(len(tokens))
        events = self._events(job)
        echo = ""
        if req.is_echo:  # the prompt as sent (token ids: their text)
            echo = req.prompt if isinstance(req.prompt, str) else \
                engine.tokenizer.decode(req.prompt)
        logprobs = AnswerLogprobs.of(engine, req.options, tokens if req.is_echo else None)
        if req.options.is_stream:
            return _sse_response(self._completion_stream(job, events, header, outcome,
                                                         req.options.is_usage_streamed, echo,
                                                         logprobs))
        pieces = [echo]
        with closing(_generated(events, outcome)) as items:
            for item in items:
                if item is not None:
                    logprobs.add_prompt(item)
                    logprobs.add(item)
                    pieces.append(item.text)
                    outcome.engine_finish = item.finish_reason or outcome.engine_finish
        if outcome.end.error is not None:
            raise outcome.end.error
        finish = outcome.finish_reason(0)
        self._log(job, outcome, finish)
        return jsonify(header.text_completion("".join(pieces), finish, outcome.usage(),
                                              logprobs.completion(len(echo))))

    def _completion_stream(self, job, events, header, outcome, is_usage_streamed, echo,
                           logprobs):
        def chunk(text, finish=None):
            return sse(header.chunk(text, finish, is_usage_streamed,
                                    logprobs.completion(len(echo), take=True)))

        with closing(_generated(events, outcome)) as items:
            if echo and not logprobs.wants_prompt:
                yield sse(header.chunk(echo, None, is_usage_streamed))
            for item in items:
                if item is None:
                    yield SSE_KEEPALIVE
                    continue
                if logprobs.wants_prompt:  # the echo waits for its figures: the first event
                    logprobs.add_prompt(item)
                    yield sse(header.chunk(echo, None, is_usage_streamed,
                                           logprobs.completion(len(echo), take=True)))
                logprobs.add(item)
                outcome.engine_finish = item.finish_reason or outcome.engine_finish
                if item.text:
                    yield chunk(item.text)
        yield from self._stream_end(job, header, outcome, 0, lambda finish: chunk("", finish),
                                    is_usage_streamed)

    def _stream_end(self, job, header, outcome, num_calls, last_chunk, is_usage_streamed):
        """A stream's end: the job's error, or the chunk `last_chunk(finish)` (finish from
        `num_calls` tool calls), then the usage chunk when asked for; then [DONE]."""
        if outcome.end.error is not None:
            yield sse(outcome.end.error.body())
            yield SSE_DONE
            return
        finish = outcome.finish_reason(num_calls)
        self._log(job, outcome, finish)
        yield last_chunk(finish)
        if is_usage_streamed:
            yield sse(header.usage_chunk(outcome.usage()))
        yield SSE_DONE


def _generated(events, outcome: Outcome):
    """A job's events up to its JobEnd, which goes to `outcome.end`; None for each keep-alive
    tick. Closing this closes `events`: a client that went away cancels its generation."""
    try:
        for item in events:
            if isinstance(item, JobEnd):
                outcome.end = item
                return
            yield item
    finally:
        events.close()


def _sse_response(stream) -> Response:
    return Response(stream, mimetype="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
