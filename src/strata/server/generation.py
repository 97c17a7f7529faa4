"""The two generating endpoints: validate, build the prompt, queue a job on the engine thread,
then answer whole or stream it as SSE (keep-alives while waiting, errors as events)."""
from __future__ import annotations

import logging
import queue
import uuid
from contextlib import closing
from dataclasses import dataclass, field, replace

from flask import Response, jsonify, request

from strata.server.api_error import ApiError
from strata.server.best_of import CandidateScore, best_candidates, candidate_options
from strata.server.logprobs_format import AnswerLogprobs
from strata.server.openai_format import (SSE_DONE, SSE_KEEPALIVE, ResponseHeader, chat_deltas,
                                         sse, usage)
from strata.server.output_parser import (ContentDelta, OutputParser, ReasoningDelta, ToolCall,
                                         new_call_id)
from strata.server.prompting import (build_chat_prompt, check_prompt_fits,
                                     completion_prompt_tokens, fim_prompt_tokens,
                                     sampling_params)
from strata.server.chat_schema import parse_chat_request
from strata.server.schema import GenerationOptions, parse_completion_request, parse_json_body
from strata.server.worker import ChoiceQueue, Job, JobEnd, iterate_job, iterate_jobs

log = logging.getLogger("strata.server")

# A client's X-Request-Id is logged beside the request's own id, escaped, up to this length
MAX_CLIENT_ID_CHARS = 128


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

    def failure(self) -> ApiError | None:
        """The error the request ended with, if it failed."""
        return None if self.end is None else self.end.error

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

    def _submit(self, prompt_tokens: list[int], options: GenerationOptions, engine,
                events=None, choice: int = 0, is_raw_prompt: bool = False,
                request_id: str | None = None) -> Job:
        """Queue one answer (`choice` of a request's `n`, or of its best_of candidates: its
        seed is the request's + choice, so seeded choices differ and repeat); `events`: its
        job's queue (a ChoiceQueue). `is_raw_prompt`: the client wrote the prompt (no chat
        template), so a grammar holds the whole output, no <think> block before it.
        `request_id`: what every log line of the job calls it, the id the client gets
        (`job_id`); None: a new one (an answer that carries no id)."""
        if options.thinking_budget is None:  # --reasoning-budget
            options.thinking_budget = self.state.config.reasoning_budget
        if choice and options.seed is not None:
            options = replace(options, seed=(options.seed + choice) % 2**63)
        params = sampling_params(options, len(prompt_tokens), engine.n_ctx,
                                 min(engine.tokenizer.vocab_size, engine.spec.vocab),
                                 reasoning_lead=not is_raw_prompt)
        job = Job(request_id=request_id or uuid.uuid4().hex[:12], prompt_tokens=prompt_tokens,
                  params=params)
        if events is not None:
            job.events = events
        client_id = request.headers.get("X-Request-Id")
        if client_id:  # a proxy's or client's own id: grep either to find the request's lines
            log.info("request %s: the client's X-Request-Id is %s", job.request_id,
                     _printable(client_id))
        self.state.worker.submit(job)
        return job

    def _start_chat(self, engine, req, prompt, new_id=new_call_id, events=None,
                    choice: int = 0, *, request_id: str) -> tuple[Job, OutputParser]:
        """Queue a chat-shaped request whose prompt is built and checked: its tool calls held
        as the prompt's template asks; the parser that reads its output (`new_id`: the ids of
        the tool calls it finds). `request_id`, `events`, `choice`: as `_submit`."""
        req.options.held_tool_calls = prompt.held_tool_calls
        req.options.tool_call_form = prompt.tool_call_form
        # a call the request requires is held to come first (where calls are held at all)
        req.options.tool_call_required = prompt.held_tool_calls is not None and (
            req.tool_choice == "required" or isinstance(req.tool_choice, dict))
        job = self._submit(prompt.tokens, req.options, engine, events, choice,
                           request_id=request_id)
        parser = OutputParser(starts_in_reasoning=prompt.starts_in_reasoning,
                              parse_tools=prompt.is_tool_parsing,
                              param_types=prompt.param_types, new_id=new_id)
        return job, parser

    def _log(self, job: Job, outcome: Outcome, finish_reason: str) -> None:
        end = outcome.end or JobEnd()
        ttft = f"{end.ttft_s:.3f} s" if end.ttft_s is not None else "-"
        log.info("request %s: prompt %d tokens (%d reused), generated %d, ttft %s, "
                 "%.1f tokens/s, finish %s%s", job.request_id, outcome.num_prompt_tokens,
                 end.num_cached_tokens, end.num_generated_tokens, ttft,
                 end.decode_tokens_per_s, finish_reason,
                 f" (stopped: {job.stop_reason})" if job.stop_reason else
                 " (cancelled: client went away)" if end.is_cancelled else "")
        if outcome.is_call_cut:
            log.warning("request %s: the output ended inside a tool call (engine finish %s); "
                        "its text was sent as content", job.request_id, outcome.engine_finish)

    def _events(self, job: Job):
        disconnected = request.environ.get("waitress.client_disconnected")
        return iterate_job(job, self.state.config.keepalive_s, disconnected)

    def _choices(self, n: int, start, response_id: str) -> tuple[list["_Choice"], object]:
        """Start a request's `n` answers (its best_of candidates), `start(index, events,
        request_id)` building each one's _Choice (its job's events tagged into one queue, its
        log id from `response_id`: `job_id`); and the iterator over all their events (closing
        it, or the client leaving, cancels every one)."""
        shared = queue.Queue()
        choices = [start(i, ChoiceQueue(shared, i), job_id(response_id, i, n))
                   for i in range(n)]
        disconnected = request.environ.get("waitress.client_disconnected")
        events = iterate_jobs([c.job for c in choices], shared, self.state.config.keepalive_s,
                              disconnected)
        return choices, events

    @staticmethod
    def _collect(choices: list["_Choice"], events, take) -> None:
        """Read every choice's events to its end (whole answers), `take(choice, event)` for
        each; a failed choice raises its error, and closing the events cancels the others
        (a failure here must not leave the generations running)."""
        with closing(events):
            for got in events:
                if got is None:
                    continue
                choice, item = choices[got[0]], got[1]
                if not isinstance(item, JobEnd):
                    choice.score.add(item)
                    take(choice, item)
                    continue
                choice.outcome.end = item
                if item.error is not None:
                    raise item.error

    # ---- /v1/chat/completions ---------------------------------------------------------------
    def chat(self):
        body = parse_json_body(request.get_data())
        engine = self._engine()
        req = parse_chat_request(body, engine.n_ctx)
        self.check_model(req.model)
        prompt = build_chat_prompt(engine, req)
        check_prompt_fits(len(prompt.tokens), engine.n_ctx)
        asked = req.options  # the reply's logprobs are those the client asked for
        req.options = candidate_options(asked, req.best_of > req.n)

        def start(index, events, request_id):
            job, parser = self._start_chat(engine, req, prompt, events=events, choice=index,
                                           request_id=request_id)
            return _Choice(index, job, Outcome(len(prompt.tokens)),
                           AnswerLogprobs.of(engine, asked), parser)

        header = ResponseHeader("chat", self.state.model_id, custom_tools=req.custom_tools)
        choices, events = self._choices(req.best_of, start, header.id)
        if req.options.is_stream:
            return _sse_response(self._chat_stream(choices, events, header,
                                                   req.options.is_usage_streamed),
                                 lambda: _failure(choices))

        def take(choice, item):
            choice.logprobs.add(item)
            choice.pieces += self._parse(choice.parser, item, choice.outcome)

        self._collect(choices, events, take)
        answers = []
        for choice in choices:
            pieces = choice.pieces
            content = "".join(e.text for e in pieces if isinstance(e, ContentDelta))
            reasoning = "".join(e.text for e in pieces if isinstance(e, ReasoningDelta))
            calls = [e for e in pieces if isinstance(e, ToolCall)]
            finish = choice.outcome.finish_reason(len(calls))
            self._log(choice.job, choice.outcome, finish)
            answers.append(header.chat_choice(choice.index, content, reasoning, calls, finish,
                                              choice.logprobs.chat()))
        return jsonify(header.chat_completion(_best(choices, answers, req.n), _usage(choices)))

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

    def _chat_stream(self, choices, events, header, is_usage_streamed):
        def chunk(choice, delta, finish=None):  # with the tokens not sent yet, if asked
            return sse(header.chunk(delta, finish, is_usage_streamed,
                                    choice.logprobs.chat(take=True), choice.index))

        def frames(choice, item):
            choice.logprobs.add(item)
            return [chunk(choice, delta)
                    for parsed in self._parse(choice.parser, item, choice.outcome)
                    for delta in chat_deltas(parsed, header.custom_tools)]

        def end(choice):
            return choice.parser.num_tool_calls, lambda finish: chunk(choice, {}, finish)

        yield from self._stream(choices, events, header, is_usage_streamed, end, [
            sse(header.chunk({"role": "assistant", "content": ""}, None, is_usage_streamed,
                             index=c.index)) for c in choices],
            frames)

    def _stream(self, choices, events, header, is_usage_streamed, end, opening, frames,
                group=None):
        """The SSE stream of `n` choices: `opening` frames, then per event of a choice
        `frames(choice, event)`, and for each choice that ends its last chunk (`end(choice)`:
        its number of tool calls and a builder of its last chunk from the finish reason);
        a failure ends it with the error event. Then the usage chunk when asked for, and
        [DONE]."""
        with closing(events):
            yield from opening
            for got in events:
                if got is None:
                    yield SSE_KEEPALIVE
                    continue
                choice, item = choices[got[0]], got[1]
                if not isinstance(item, JobEnd):
                    yield from frames(choice, item)
                    continue
                choice.outcome.end = item
                if item.error is not None:
                    yield sse(item.error.body())
                    yield SSE_DONE
                    return
                num_calls, last_chunk = end(choice)
                finish = choice.outcome.finish_reason(num_calls)
                self._log(choice.job, choice.outcome, finish)
                yield last_chunk(finish)
        if is_usage_streamed:
            yield sse(header.usage_chunk(_usage(choices, group)))
        yield SSE_DONE

    # ---- /v1/completions ------------------------------------------------------------------
    def completions(self):
        body = parse_json_body(request.get_data())
        engine = self._engine()
        req = parse_completion_request(body, engine.n_ctx)
        self.check_model(req.model)
        is_batch = len(req.prompts) > 1
        prompts = []  # (tokens, echo) of each prompt of the batch, all checked before any runs
        for i, prompt in enumerate(req.prompts):
            param = f"prompt[{i}]" if is_batch else "prompt"
            if req.suffix is None:
                tokens = completion_prompt_tokens(engine, prompt, param)
            else:  # fill in the middle: the completion goes between prompt and suffix
                tokens = fim_prompt_tokens(engine, prompt, req.suffix)
            check_prompt_fits(len(tokens), engine.n_ctx, param)
            echo = ""
            if req.is_echo:  # the prompt as sent (token ids: their text)
                echo = prompt if isinstance(prompt, str) else engine.tokenizer.decode(prompt)
            prompts.append((tokens, echo))
        if req.suffix is not None:
            req.options.stop_token_ids = sorted(engine.tokenizer.fim.ids)
        options = candidate_options(req.options, req.best_of > req.n)

        def start(index, events, request_id):  # the reply's logprobs: those the client asked
            tokens, echo = prompts[index // req.best_of]
            # a prompt's candidate j draws with seed + j, as a request of that prompt alone
            job = self._submit(tokens, options, engine, events=events,
                               choice=index % req.best_of, is_raw_prompt=True,
                               request_id=request_id)
            return _Choice(index, job, Outcome(len(tokens)), AnswerLogprobs.of(
                engine, req.options, tokens if req.is_echo else None), echo=echo)

        header = ResponseHeader("completion", self.state.model_id)
        choices, events = self._choices(len(prompts) * req.best_of, start, header.id)
        if req.options.is_stream:
            return _sse_response(self._completion_stream(
                choices, events, header, req.options.is_usage_streamed, req.best_of),
                lambda: _failure(choices))

        def take(choice, item):
            choice.logprobs.add_prompt(item)
            choice.logprobs.add(item)
            choice.pieces.append(item.text)
            choice.outcome.engine_finish = item.finish_reason or choice.outcome.engine_finish

        self._collect(choices, events, take)
        answers = []
        for choice in choices:
            finish = choice.outcome.finish_reason(0)
            self._log(choice.job, choice.outcome, finish)
            answers.append(header.text_choice(
                choice.index, choice.echo + "".join(choice.pieces), finish,
                choice.logprobs.completion(len(choice.echo))))
        return jsonify(header.text_completion(_best(choices, answers, req.n, req.best_of),
                                              _usage(choices, req.best_of)))

    def _completion_stream(self, choices, events, header, is_usage_streamed, group):
        def chunk(choice, text, finish=None):
            return sse(header.chunk(text, finish, is_usage_streamed,
                                    choice.logprobs.completion(len(choice.echo), take=True),
                                    choice.index))

        def frames(choice, item):
            out = []
            if choice.logprobs.wants_prompt:  # the echo waits for its figures: the first event
                choice.logprobs.add_prompt(item)
                out.append(chunk(choice, choice.echo))
            choice.logprobs.add(item)
            choice.outcome.engine_finish = item.finish_reason or choice.outcome.engine_finish
            if item.text:
                out.append(chunk(choice, item.text))
            return out

        opening = [sse(header.chunk(c.echo, None, is_usage_streamed, index=c.index))
                   for c in choices if c.echo and not c.logprobs.wants_prompt]
        yield from self._stream(choices, events, header, is_usage_streamed,
                                lambda choice: (0, lambda finish: chunk(choice, "", finish)),
                                opening, frames, group)


@dataclass
class _Choice:
    """One of a request's `n` answers (or best_of candidates): its job, what it produced, how
    its log probabilities and (chat) its output are read, and its score for best_of."""
    index: int  # the candidate's (in a completions batch, prompt * best_of + candidate):
    # its seed is the request's + its candidate number
    job: Job
    outcome: Outcome
    logprobs: AnswerLogprobs
    parser: OutputParser | None = None
    pieces: list = field(default_factory=list)  # parsed events (chat) or texts (completions)
    score: CandidateScore = field(default_factory=CandidateScore)
    echo: str = ""  # a completion's prompt text, which its answer starts with (echo)


def job_id(response_id: str, index: int, num_jobs: int) -> str:
    """What the log calls job `index` of a response's `num_jobs` (its n answers, best_of
    candidates, a batch's prompts): the response's id the client got, or with several jobs
    `<id>/<index>` (a completions batch: prompt * best_of + candidate)."""
    return response_id if num_jobs == 1 else f"{response_id}/{index}"


def _printable(text: str) -> str:
    """A client's text as one safe log line's part: quoted, escaped (no newline, no control
    or non-ASCII character can forge a line), at most MAX_CLIENT_ID_CHARS of it."""
    shown = ascii(text[:MAX_CLIENT_ID_CHARS])
    if len(text) > MAX_CLIENT_ID_CHARS:
        shown += f" (its first {MAX_CLIENT_ID_CHARS} of {len(text)} characters)"
    return shown


def _best(choices: list[_Choice], answers: list[dict], n: int,
          group: int | None = None) -> list[dict]:
    """The answers of the `n` best candidates (best_of.py) of each prompt's `group` of them
    (a completions batch; None: one prompt), best first, indexed on from prompt * n; with no
    more candidates than `n` (no best_of), every answer in its order."""
    group = group or len(choices)
    if group == n:
        return answers
    out = []
    for first in range(0, len(choices), group):
        ranked = best_candidates([c.score for c in choices[first:first + group]], n)
        out += [dict(answers[first + i], index=first // group * n + rank)
                for rank, i in enumerate(ranked)]
    return out


def _usage(choices: list[_Choice], group: int | None = None) -> dict:
    """One request's usage: each prompt once (a completions batch: every `group` choices
    share one) and its first choice's cached tokens, every choice's generated tokens (every
    best_of candidate's, returned or not: all were computed)."""
    ends = [c.outcome.end or JobEnd() for c in choices]
    firsts = range(0, len(choices), group or len(choices))
    return usage(sum(choices[i].outcome.num_prompt_tokens for i in firsts),
                 sum(e.num_generated_tokens for e in ends),
                 sum(ends[i].num_cached_tokens for i in firsts),
                 sum(c.outcome.num_reasoning_tokens for c in choices))


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


def _sse_response(stream, failure=None) -> Response:
    """`failure()`: the error the stream ended with, once it has ended (None: it did not fail);
    /metrics counts the request under that error's status rather than the 200 it began with."""
    response = Response(stream, mimetype="text/event-stream",
                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    response.stream_failure = failure
    return response


def _failure(choices: list["_Choice"]) -> ApiError | None:
    return next((c.outcome.failure() for c in choices if c.outcome.failure()), None)
