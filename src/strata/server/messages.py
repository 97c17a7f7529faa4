"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) over the same engine
steps as the chat endpoint: the body becomes a ChatRequest, the chat template renders it, and
the output parser's events become content blocks (whole, or streamed as named events)."""
from __future__ import annotations

from contextlib import closing

from flask import jsonify, request

from strata.server.anthropic_format import (SSE_PING, BlockStream, MessageHeader,
                                            content_blocks, error_body, new_tool_use_id,
                                            sse_event, stop_reason, usage)
from strata.server.anthropic_schema import parse_anthropic_request, parse_thinking
from strata.server.api_error import ApiError
from strata.server.generation import GenerationRoutes, Outcome, _generated, _sse_response
from strata.server.prompting import build_chat_prompt, check_prompt_fits
from strata.server.schema import parse_json_body


def _check_fits(num_prompt_tokens: int, n_ctx: int) -> None:
    """As the chat endpoint, but a prompt over the context says so in Anthropic's words
    ("prompt is too long: ..."), which agents such as Claude Code read as the cue to compact
    the conversation."""
    try:
        check_prompt_fits(num_prompt_tokens, n_ctx)
    except ApiError as exc:
        if exc.code != "context_length_exceeded":
            raise
        raise ApiError(400, f"prompt is too long: {num_prompt_tokens} tokens > {n_ctx} maximum "
                       "(the server's context); shorten the conversation or start the server "
                       "with a larger --ctx-size.", param="messages",
                       code="context_length_exceeded") from None


class MessagesRoutes(GenerationRoutes):
    def _prompt(self, body: dict, *, is_count_only: bool = False):
        engine = self._engine()
        req = parse_anthropic_request(body, engine.n_ctx, is_count_only=is_count_only)
        self.check_model(req.model)
        prompt = build_chat_prompt(engine, req)
        if not is_count_only:  # a count over the context is what a client compacts on
            _check_fits(len(prompt.tokens), engine.n_ctx)
        return engine, req, prompt

    # ---- /v1/messages/count_tokens --------------------------------------------------------
    def count_tokens(self):
        _, _, prompt = self._prompt(parse_json_body(request.get_data()), is_count_only=True)
        return jsonify({"input_tokens": len(prompt.tokens)})

    # ---- /v1/messages -----------------------------------------------------------------------
    def messages(self):
        body = parse_json_body(request.get_data())
        engine, req, prompt = self._prompt(body)
        is_thinking_omitted = parse_thinking(body.get("thinking"))[1]
        header = MessageHeader(self.state.model_id)
        job, parser = self._start_chat(engine, req, prompt, new_tool_use_id, request_id=header.id)
        outcome = Outcome(len(prompt.tokens))
        max_tokens = req.options.max_tokens
        events = self._events(job)
        if req.options.is_stream:
            return _sse_response(self._message_stream(job, events, parser, header, outcome,
                                                      max_tokens,
                                                      BlockStream(is_thinking_omitted)),
                                 outcome.failure)
        pieces = []
        with closing(_generated(events, outcome)) as items:
            for item in items:
                if item is not None:
                    pieces += self._parse(parser, item, outcome)
        if outcome.end.error is not None:
            raise outcome.end.error
        reason, stop_string = self._stop(outcome, parser.num_tool_calls, max_tokens)
        self._log(job, outcome, reason)
        return jsonify(header.message(content_blocks(pieces, is_thinking_omitted), reason,
                                      stop_string, self._usage(outcome)))

    @staticmethod
    def _stop(outcome: Outcome, num_tool_calls: int,
              max_tokens: int) -> tuple[str, str | None]:
        """The stop reason and sequence; `max_tokens`: what the client asked for."""
        is_context_full = outcome.end.num_generated_tokens < max_tokens
        reason = stop_reason(outcome.engine_finish, num_tool_calls, outcome.stop_string,
                             is_context_full)
        return reason, outcome.stop_string if reason == "stop_sequence" else None

    @staticmethod
    def _message_start(header: MessageHeader, outcome: Outcome, num_cached_tokens: int) -> str:
        # output_tokens as Anthropic's message_start: what the output counts so far (its first
        # token is in the first content event; message_delta has the final count)
        start_usage = usage(outcome.num_prompt_tokens, num_cached_tokens, 0)
        return sse_event({"type": "message_start",
                          "message": header.message([], None, None, start_usage)})

    @staticmethod
    def _usage(outcome: Outcome) -> dict:
        end = outcome.end
        return usage(outcome.num_prompt_tokens, end.num_cached_tokens, end.num_generated_tokens)

    def _message_stream(self, job, events, parser, header, outcome, max_tokens, blocks):
        """message_start, the content blocks' start / delta / stop events, then message_delta
        (stop reason, usage) and message_stop; a failure ends the stream with an error event.
        A ping goes out for each keep-alive tick.

        message_start waits for the first generated token: its usage splits the prompt into
        the tokens read and those reused from a parked conversation (as Anthropic's does),
        which only the request's placement in a slot tells. A failure before it (a request
        the engine refused, a server shutting down) is the stream's only event."""
        is_started = False
        with closing(_generated(events, outcome)) as items:
            for item in items:
                if item is None:
                    yield SSE_PING
                    continue
                if not is_started:
                    is_started = True
                    yield self._message_start(header, outcome, _cached_tokens(job, item))
                for parsed in self._parse(parser, item, outcome):
                    for event in blocks.feed(parsed):
                        yield sse_event(event)
        if outcome.end.error is not None:
            yield from (sse_event(e) for e in blocks.finish())
            yield sse_event(error_body(outcome.end.error))
            return
        if not is_started:  # ended without a token (not a failure): the end has the split
            yield self._message_start(header, outcome, outcome.end.num_cached_tokens)
        for event in blocks.finish():
            yield sse_event(event)
        reason, stop_string = self._stop(outcome, parser.num_tool_calls, max_tokens)
        self._log(job, outcome, reason)
        yield sse_event({"type": "message_delta",
                         "delta": {"stop_reason": reason, "stop_sequence": stop_string},
                         "usage": self._usage(outcome)})
        yield sse_event({"type": "message_stop"})


def _cached_tokens(job, first_event) -> int:
    """The prompt tokens reused from a parked conversation, when the request's first token
    comes: the engine thread notes them on the job before that token's event (worker.py), and
    a first event that is also the last carries the request's stats."""
    noted = job.num_cached_tokens
    if noted is not None:
        return noted
    stats = first_event.stats
    return stats.num_cached_tokens if stats is not None else 0


def is_messages_path(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")
