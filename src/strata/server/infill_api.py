"""Code completion in an editor: llama.cpp's `/infill` (llama.vscode, llama.vim) and OpenAI's
`suffix` on `/v1/completions`. Both build the model's fill-in-the-middle prompt
(strata.model.fim); `/infill` also fits it to the context, cutting what the cursor needs
least, and answers in llama.cpp's fields (llama_reply.py)."""
from __future__ import annotations

import logging
import time

from flask import jsonify, request

from strata.errors import RequestError
from strata.model.fim import build_infill
from strata.server.api_error import ApiError
from strata.server.generation import GenerationRoutes, Outcome, _sse_response
from strata.server.infill_schema import parse_infill_request
from strata.server.llama_reply import LlamaReply
from strata.server.logprobs_format import AnswerLogprobs
from strata.server.prompting import fim_tokens
from strata.server.schema import parse_json_body

log = logging.getLogger("strata.server")

# Tokens kept free for the middle when a request names no limit (at most a quarter of the
# context): what the prefix, suffix and other files may take is the rest.
DEFAULT_MIDDLE_TOKENS = 1024


class InfillRoutes(GenerationRoutes):
    def infill(self):
        started_s = time.perf_counter()
        body = parse_json_body(request.get_data())
        engine = self._engine()
        req = parse_infill_request(body, engine.n_ctx, engine.tokenizer)
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
        job = self._submit(prompt.tokens, req.options, engine, is_raw_prompt=True)
        if prompt.is_truncated:
            log.info("request %s: the completion was cut to %d prompt tokens to leave %d for "
                     "the middle (%d of %d other files kept; the prefix's start and the "
                     "suffix's end go next)", job.request_id, len(prompt.tokens), middle,
                     prompt.num_extra, len(req.text.extra))
        reply = LlamaReply(self, job, req, Outcome(len(prompt.tokens)), started_s,
                           AnswerLogprobs.of(engine, req.options), prompt.is_truncated,
                           req.min_indent)
        if req.options.is_stream:
            return _sse_response(reply.stream(), reply.outcome.failure)
        return jsonify(reply.collect())
