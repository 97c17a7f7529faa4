"""Chat template rendering: the model's Jinja template in a sandbox, as transformers renders it."""
from __future__ import annotations

import json
from datetime import datetime
from importlib import resources

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
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


class _GenerationTag(Extension):
    """transformers' `{% generation %}...{% endgeneration %}`: it marks the assistant's text
    for training masks; rendering keeps the body as it is (in a scope of its own, as there)."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _compile(template_str: str, key: str) -> jinja2.Template:
    """The template of metadata key `key` compiled as transformers compiles chat templates."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template_str)
    except jinja2.TemplateSyntaxError as e:
        raise ModelFormatError(
            f"the chat template ({key}) has a syntax error at line {e.lineno}: {e.message}; "
            f"fix it in the GGUF (gguf-py's gguf_new_metadata.py rewrites metadata) or remove "
            f"{key} (without it Strata renders with its shipped ChatML template)") from None


def default_template() -> str:
    """The shipped ChatML template (used when a model carries none)."""
    return resources.files("strata.data").joinpath("chat_template.jinja").read_text("utf-8")


class ChatTemplate:
    """A compiled chat template; `render` turns messages (and tools) into the prompt text.
    `tool_use`: the template for requests with tools, where the model has a separate one."""

    def __init__(self, template_str: str, bos_token: str = "", eos_token: str = "",
                 tool_use: str | None = None):
        self._template = _compile(template_str, "tokenizer.chat_template")
        self._tool_use = (None if tool_use is None
                          else _compile(tool_use, "tokenizer.chat_template.tool_use"))
        self.source = template_str
        self.bos_token = bos_token
        self.eos_token = eos_token

    @classmethod
    def from_gguf_metadata(cls, meta: dict, tokenizer=None) -> "ChatTemplate":
        """The model's `tokenizer.chat_template`, or the shipped ChatML template; and its
        named `tokenizer.chat_template.tool_use`, as llama.cpp's writer stores a model's
        templates by name (transformers and llama.cpp render requests with tools by it)."""
        template = meta.get("tokenizer.chat_template") or default_template()
        tool_use = meta.get("tokenizer.chat_template.tool_use") or None
        bos = eos = ""
        if tokenizer is not None:
            if tokenizer.bos_id is not None:
                bos = tokenizer.token_text(tokenizer.bos_id)
            if tokenizer.eos_id is not None:
                eos = tokenizer.token_text(tokenizer.eos_id)
        return cls(str(template), bos_token=bos, eos_token=eos,
                   tool_use=None if tool_use is None else str(tool_use))

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
        context.setdefault("documents", None)  # as transformers passes it
        template = self._tool_use if tools and self._tool_use is not None else self._template
        try:
            return template.render(messages=messages, tools=tools,
                                   add_generation_prompt=add_generation_prompt, **context)
        except jinja2.exceptions.TemplateError as e:
            raise RequestError(f"the chat template rejected the request: {e}") from None
        except (TypeError, ValueError, KeyError, AttributeError) as e:
            raise RequestError(
                f"the chat template failed on these messages ({type(e).__name__}: {e})") from None
