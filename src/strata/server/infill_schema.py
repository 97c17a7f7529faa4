"""Validation of llama.cpp's `/infill` request (code completion in an editor): the current
file around the cursor, other files, and the completion's limits. Unknown fields (`samplers`,
`cache_prompt`, `t_max_prompt_ms`, ...) are ignored, as in the other endpoints."""
from __future__ import annotations

from dataclasses import dataclass

from strata.model.fim import InfillText
from strata.server.api_error import invalid
from strata.server.llama_reply import LlamaFields, parse_llama_fields
from strata.server.schema import _integer, _objects, _string, _wrong_type

MAX_EXTRA_FILES = 1024


@dataclass
class InfillRequest(LlamaFields):
    model: str | None = None
    text: InfillText | None = None
    min_indent: int = 0  # n_indent: a new line indented less ends the completion


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


def parse_infill_request(body: dict, n_ctx: int, tokenizer) -> InfillRequest:
    fields = parse_llama_fields(body, n_ctx, tokenizer)
    text = InfillText(prefix=_text(body, "input_prefix"), suffix=_text(body, "input_suffix"),
                      prompt=_text(body, "prompt"), extra=_extra_files(body.get("input_extra")),
                      filename=_string(body, "filename") or None)
    return InfillRequest(**vars(fields), model=_string(body, "model"), text=text,
                         min_indent=_integer(body, "n_indent", 0, 2**31) or 0)
