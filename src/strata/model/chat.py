"""Chat template rendering: the model's Jinja template in a sandbox, as transformers renders it."""
from __future__ import annotations

import json
from datetime import datetime
from importlib import resources

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from strata.errors import ModelFormatError, RequestError


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes HTML characters; chat templates expect plain JSON (as in HF).
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


def default_template() -> str:
    """The shipped ChatML template (used when a model carries none)."""
    return resources.files("strata.data").joinpath("chat_template.jinja").read_text("utf-8")


class ChatTemplate:
    """A compiled chat template; `render` turns messages (and tools) into the prompt text."""

    def __init__(self, template_str: str, bos_token: str = "", eos_token: str = ""):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(template_str)
        except jinja2.TemplateSyntaxError as e:
            raise ModelFormatError(
                f"chat template has a syntax error at line {e.lineno}: {e.message}; pass a "
                "working template or use the shipped ChatML one") from None
        self.source = template_str
        self.bos_token = bos_token
        self.eos_token = eos_token

    @classmethod
    def from_gguf_metadata(cls, meta: dict, tokenizer=None) -> "ChatTemplate":
        """The model's `tokenizer.chat_template`, or the shipped ChatML template."""
        template = meta.get("tokenizer.chat_template") or default_template()
        bos = eos = ""
        if tokenizer is not None:
            if tokenizer.bos_id is not None:
                bos = tokenizer.token_text(tokenizer.bos_id)
            if tokenizer.eos_id is not None:
                eos = tokenizer.token_text(tokenizer.eos_id)
        return cls(str(template), bos_token=bos, eos_token=eos)

    def render(self, messages: list[dict], tools: list[dict] | None = None,
               add_generation_prompt: bool = True, **template_kwargs) -> str:
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise RequestError("messages must be a list of objects with 'role' and 'content'")
        for i, m in enumerate(messages):
            if "role" not in m:
                raise RequestError(f"message {i} has no 'role'")
        context = dict(template_kwargs)
        context.setdefault("bos_token", self.bos_token)
        context.setdefault("eos_token", self.eos_token)
        try:
            return self._template.render(messages=messages, tools=tools,
                                         add_generation_prompt=add_generation_prompt, **context)
        except jinja2.exceptions.TemplateError as e:
            raise RequestError(f"the chat template rejected the request: {e}") from None
        except (TypeError, ValueError, KeyError, AttributeError) as e:
            raise RequestError(
                f"the chat template failed on these messages ({type(e).__name__}: {e})") from None
