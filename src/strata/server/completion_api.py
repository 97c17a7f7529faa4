"""llama.cpp's native `POST /completion` (also `/completions`): a raw prompt (text, token ids,
or a mix of both) and llama.cpp's fields (`n_predict`, `repeat_penalty`, `n_probs`,
`t_max_predict_ms`, `n_indent`, `return_tokens`, `response_fields`), answered as llama-server
answers (llama_reply.py); what scripts and front ends written for llama-server send. Fields
that pick llama.cpp's own machinery (`id_slot`, `cache_prompt`, `samplers`) are read as hints
Strata makes its own choice on: any slot, prompts always cached."""
from __future__ import annotations

import time

from flask import jsonify, request

from strata.server.api_error import ApiError, invalid
from strata.server.generation import GenerationRoutes, Outcome, _sse_response
from strata.server.llama_reply import LlamaReply, parse_llama_fields
from strata.server.logprobs_format import AnswerLogprobs
from strata.server.prompting import check_prompt_fits, completion_prompt_tokens
from strata.server.schema import _integer, _string, _wrong_type, parse_json_body


class CompletionRoutes(GenerationRoutes):
    def completion(self):
        started_s = time.perf_counter()
        body = parse_json_body(request.get_data())
        engine = self._engine()
        fields = parse_llama_fields(body, engine.n_ctx, engine.tokenizer)
        self.check_model(_string(body, "model"))
        tokens, text = _prompt(engine, body.get("prompt"))
        check_prompt_fits(len(tokens), engine.n_ctx, "prompt")
        job = self._submit(tokens, fields.options, engine, is_raw_prompt=True)
        reply = LlamaReply(self, job, fields, Outcome(len(tokens)), started_s,
                           AnswerLogprobs.of(engine, fields.options),
                           min_indent=_integer(body, "n_indent", 0, 2**31) or 0,
                           prompt_text=text)
        if fields.options.is_stream:
            return _sse_response(reply.stream(), reply.outcome.failure)
        return jsonify(reply.collect())


def _prompt(engine, prompt) -> tuple[list[int], str]:
    """The prompt's tokens and text: a string (with the model's BOS, as llama.cpp adds it),
    token ids, a list mixing strings and ids (only a leading string gets the BOS), or
    llama.cpp's `{"prompt_string": ...}`. As llama.cpp reads it, an array with no token id at
    its top is a list of prompts: one prompt in it is answered, several are refused."""
    if prompt is None:
        raise ApiError(400, "'prompt' is required: a string, an array of token ids, or an "
                       "array mixing strings and token ids.", param="prompt",
                       code="missing_required_parameter")
    param = "prompt"
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list, dict))
                                                   for p in prompt):
        if len(prompt) > 1:  # ["a", "b"] is two prompts to llama.cpp, not "ab"
            raise invalid(f"'prompt' holds several prompts ({len(prompt)}: an array of "
                          "strings or of arrays is a list of prompts); this server answers one "
                          "prompt per request: send each in a request of its own.", "prompt")
        prompt, param = prompt[0], "prompt[0]"  # a list of one prompt: that prompt
    if isinstance(prompt, dict):
        if prompt.get("multimodal_data"):
            raise invalid(f"'{param}.multimodal_data' is not supported: this server reads "
                          "text only; send the prompt without images or audio.",
                          f"{param}.multimodal_data", "unsupported_value")
        param += ".prompt_string"
        prompt = prompt.get("prompt_string")
        if prompt is None:
            raise _wrong_type(param, prompt, "a string or an array of strings and token ids")
    if isinstance(prompt, str):
        pieces = [prompt]
    elif isinstance(prompt, list):
        pieces = prompt
    else:
        raise _wrong_type(param, prompt, "a string or an array of strings and token ids")
    tokens: list[int] = []
    for i, piece in enumerate(pieces):
        if isinstance(piece, str):
            tokens += engine.tokenize(piece, add_special=i == 0)
        elif _is_token_id(piece):
            tokens += completion_prompt_tokens(engine, [piece], param)
        else:
            raise _wrong_type(f"{param}[{i}]", piece, "a string or a token id")
    if not tokens:
        raise invalid(f"'{param}' is empty: send at least one character or token.", param)
    text = prompt if isinstance(prompt, str) else engine.tokenizer.decode(tokens)
    return tokens, text


def _is_token_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
