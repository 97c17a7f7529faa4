"""Validation of llama.cpp's `/infill` request (code completion in an editor): the current
file around the cursor, other files, and the completion's limits. Unknown fields (`samplers`,
`cache_prompt`, `t_max_prompt_ms`, ...) are ignored, as in the other endpoints."""
from __future__ import annotations

from dataclasses import dataclass

from strata.model.fim import InfillText
from strata.server.api_error import invalid
from strata.server.schema import (GenerationOptions, _integer, _number, _objects, _string,
                                  _wrong_type, parse_options)

MAX_EXTRA_FILES = 1024


@dataclass
class InfillRequest:
    model: str | None
    text: InfillText
    options: GenerationOptions
    is_warm_up: bool = False  # n_predict 0: read the prompt into the cache, generate nothing
    min_indent: int = 0  # n_indent: a new line indented less ends the completion
    max_predict_ms: int = 0  # t_max_predict_ms: past this, the next line break ends it (0: off)
    response_fields: list[str] | None = None  # only these fields in the answer


def _text(body: dict, key: str, param: str | None = None) -> str:
    value = _string(body, key, param=param)
    return "" if value is None else value


def _extra_files(value) -> list[tuple[str, str]]:
    """`input_extra`: [{filename, text}], the most useful last (llama.vscode's ring of chunks)."""
    if value is None:
        return []
    items = _objects(value, "input_extra")
    if len(items) > MAX_EXTRA_FILES:
        raise invalid(f"'input_extra' holds {len(items)} files; at most {MAX_EXTRA_FILES} are "
                      "read.", "input_extra")
    out = []
    for where, item in items:
        text = item.get("text")
        if not isinstance(text, str):
            raise _wrong_type(f"{where}.text", text, "a string")
        out.append((_text(item, "filename", f"{where}.filename"), text))
    return out


def _response_fields(value) -> list[str] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(f, str) and f for f in value):
        raise _wrong_type("response_fields", value, "an array of field names")
    return value


def parse_infill_request(body: dict, n_ctx: int) -> InfillRequest:
    options = parse_options(body, n_ctx)
    # llama.cpp's n_predict beside OpenAI's max_tokens: -1 runs to the context's end, 0 only
    # reads the prompt (an editor warming the cache with the files it will send)
    n_predict = _integer(body, "n_predict", -1, 2**31)
    is_warm_up = n_predict == 0 and options.max_tokens is None
    if options.max_tokens is None and n_predict is not None and n_predict > 0:
        options.max_tokens = min(n_predict, n_ctx)
    if is_warm_up:
        options.max_tokens = 1  # the one token is not sent
    if options.repetition_penalty is None:  # llama.cpp's name for it
        options.repetition_penalty = _number(body, "repeat_penalty", 0.0, 10.0, low_open=True)
    text = InfillText(prefix=_text(body, "input_prefix"), suffix=_text(body, "input_suffix"),
                      prompt=_text(body, "prompt"), extra=_extra_files(body.get("input_extra")),
                      filename=_string(body, "filename") or None)
    return InfillRequest(
        model=_string(body, "model"), text=text, options=options, is_warm_up=is_warm_up,
        min_indent=_integer(body, "n_indent", 0, 2**31) or 0,
        max_predict_ms=_integer(body, "t_max_predict_ms", 0, 2**31) or 0,
        response_fields=_response_fields(body.get("response_fields")))
