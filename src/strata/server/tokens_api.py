"""llama.cpp's utility endpoints: `/tokenize`, `/detokenize` and `/apply-template`, answered on
the request thread (the tokenizer and the chat template need no engine step)."""
from __future__ import annotations

from flask import jsonify, request

from strata.server.api_error import invalid, missing
from strata.server.generation import GenerationRoutes
from strata.server.prompting import build_chat_prompt
from strata.server.chat_schema import parse_chat_request
from strata.server.schema import _boolean, _wrong_type, parse_json_body


def _piece(tokenizer, token_id: int) -> str | list[int]:
    """A token's text, or its bytes where they are not whole UTF-8 (part of a character)."""
    data = tokenizer.token_bytes(token_id)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return list(data)


class TokenRoutes(GenerationRoutes):
    def tokenize(self):
        body = parse_json_body(request.get_data())
        engine = self._engine()
        content = body.get("content")
        if content is None:
            raise missing("content", "the text to tokenize")
        if not isinstance(content, str):
            raise _wrong_type("content", content, "a string")
        # as llama.cpp: special tokens written in the text become their ids (parse_special
        # false: plain text), BOS only if asked
        is_bos_added = _boolean(body, "add_special")
        if _boolean(body, "parse_special", True):
            ids = engine.tokenize(content, add_special=is_bos_added)
        else:
            tokenizer = engine.tokenizer
            ids = tokenizer.encode_plain(content)
            if is_bos_added and tokenizer.add_bos and tokenizer.bos_id is not None:
                ids = [tokenizer.bos_id] + ids
        if not _boolean(body, "with_pieces"):
            return jsonify({"tokens": ids})
        tokenizer = engine.tokenizer
        return jsonify({"tokens": [{"id": i, "piece": _piece(tokenizer, i)} for i in ids]})

    def detokenize(self):
        body = parse_json_body(request.get_data())
        engine = self._engine()
        ids = body.get("tokens")
        if ids is None:
            raise missing("tokens", "an array of token ids")
        if not isinstance(ids, list):
            raise _wrong_type("tokens", ids, "an array of token ids")
        vocab = engine.tokenizer.vocab_size
        for i, token in enumerate(ids):
            if isinstance(token, bool) or not isinstance(token, int):
                raise _wrong_type(f"tokens[{i}]", token, "a token id (an integer)")
            if not 0 <= token < vocab:
                raise invalid(f"'tokens[{i}]' is {token}, outside the vocabulary [0, {vocab}).",
                              f"tokens[{i}]")
        return jsonify({"content": engine.tokenizer.decode(ids)})

    def apply_template(self):
        """The prompt the chat endpoint would read for these messages (and tools)."""
        body = parse_json_body(request.get_data())
        engine = self._engine()
        req = parse_chat_request(body, engine.n_ctx)
        # as llama.cpp's: add_generation_prompt (default true) false leaves the header out
        prompt = build_chat_prompt(engine, req, add_generation_prompt=_boolean(
            body, "add_generation_prompt", True))
        return jsonify({"prompt": prompt.text})
