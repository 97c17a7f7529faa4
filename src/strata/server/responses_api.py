"""OpenAI's Responses API (`POST /v1/responses`, the one Codex CLI speaks) over the same engine
steps as the chat endpoint: the body becomes a ChatRequest, the chat template renders it, and
the output parser's events become output items (whole, or streamed as named events). Nothing
is stored: each request carries its whole conversation (`store: false`)."""
from __future__ import annotations

from contextlib import closing

from flask import jsonify, request

from strata.server.generation import GenerationRoutes, Outcome, _generated, _sse_response
from strata.server.logprobs_format import AnswerLogprobs
from strata.server.openai_format import SSE_KEEPALIVE
from strata.server.prompting import build_chat_prompt, check_prompt_fits
from strata.server.responses_format import (REASONING_INCLUDE, OutputItems, ResponseHeader,
                                            TextLogprobs, sse_event, usage)
from strata.server.custom_tools import custom_tool_names
from strata.server.responses_schema import parse_responses_request
from strata.server.schema import parse_json_body

_ECHOED = ("instructions", "max_output_tokens", "parallel_tool_calls", "reasoning",
           "temperature", "top_p", "text", "tool_choice", "tools", "metadata")


class ResponsesRoutes(GenerationRoutes):
    def responses(self):
        body = parse_json_body(request.get_data())
        engine = self._engine()
        req = parse_responses_request(body, engine.n_ctx)
        self.check_model(req.model)
        prompt = build_chat_prompt(engine, req, "input")
        check_prompt_fits(len(prompt.tokens), engine.n_ctx, "input")
        echoed = {k: body[k] for k in _ECHOED if body.get(k) is not None}
        header = ResponseHeader(self.state.model_id, echoed)
        job, parser = self._start_chat(engine, req, prompt, request_id=header.id)
        outcome = Outcome(len(prompt.tokens))
        events = self._events(job)
        logprobs = AnswerLogprobs.of(engine, req.options)
        items = OutputItems(custom_tool_names(body.get("tools")),
                            REASONING_INCLUDE in (body.get("include") or ()))
        if req.options.is_stream:
            return _sse_response(self._stream(job, events, parser, header, outcome, logprobs,
                                              items), outcome.failure)
        text_logprobs = TextLogprobs()
        with closing(_generated(events, outcome)) as generated:
            for item in generated:
                if item is not None:
                    self._feed(parser, item, outcome, logprobs, text_logprobs, items)
        if outcome.end.error is not None:
            raise outcome.end.error
        items.finish(outcome.finish_reason(0) == "length")
        return jsonify(self._final(job, header, outcome, items.items))

    def _feed(self, parser, item, outcome: Outcome, logprobs: AnswerLogprobs,
              text_logprobs: TextLogprobs, items: OutputItems) -> list[dict]:
        """One generated token into the output items; the stream events of what changed (its
        logprob entry goes with the message text it is part of, if any)."""
        logprobs.add(item)
        was = (parser.is_in_reasoning, parser.is_inside_tool_call)
        parsed = self._parse(parser, item, outcome)
        taken = text_logprobs.feed(logprobs.entries(take=True), item.text, was, parser, parsed)
        return [payload for event, entries in zip(parsed, taken)
                for payload in items.feed(event, entries)]

    def _final(self, job, header: ResponseHeader, outcome: Outcome, output: list) -> dict:
        """The finished response: completed, or incomplete when max_output_tokens (or the
        context) cut it."""
        is_cut = outcome.finish_reason(0) == "length"
        self._log(job, outcome, "max_output_tokens" if is_cut else "completed")
        end = outcome.end
        return header.response("incomplete" if is_cut else "completed", output,
                               usage(outcome.num_prompt_tokens, end.num_cached_tokens,
                                     end.num_generated_tokens, outcome.num_reasoning_tokens),
                               "max_output_tokens" if is_cut else None)

    def _stream(self, job, events, parser, header, outcome, logprobs, items: OutputItems):
        """response.created and .in_progress, each output item's events, then
        response.completed (or .incomplete); a failure ends it with response.failed. Every
        event carries its sequence_number."""
        sequence = 0

        def send(payload: dict) -> str:
            nonlocal sequence
            payload = dict(payload, sequence_number=sequence)
            sequence += 1
            return sse_event(payload)

        text_logprobs = TextLogprobs()
        with closing(_generated(events, outcome)) as generated:
            started = header.response("in_progress", [], None)
            yield send({"type": "response.created", "response": started})
            yield send({"type": "response.in_progress", "response": started})
            for item in generated:
                if item is None:
                    yield SSE_KEEPALIVE
                    continue
                for payload in self._feed(parser, item, outcome, logprobs, text_logprobs,
                                          items):
                    yield send(payload)
        for payload in items.finish(outcome.finish_reason(0) == "length"):
            yield send(payload)
        error = outcome.end.error
        if error is not None:
            failed = header.response("failed", items.items, None,
                                     error={"code": error.code or "server_error",
                                            "message": error.message})
            yield send({"type": "response.failed", "response": failed})
            return
        final = self._final(job, header, outcome, items.items)
        kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
        yield send({"type": kind, "response": final})
