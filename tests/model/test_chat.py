"""Chat template rendering: ChatML, tojson, raise_exception, errors, the shipped default."""
from __future__ import annotations

import re

import pytest

from strata.errors import ModelFormatError, RequestError
from strata.model.chat import ChatTemplate, default_template

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi <there> & 東京"},
]


def test_chatml_render_exact():
    t = ChatTemplate(CHATML)
    assert t.render(MESSAGES) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi <there> & 東京<|im_end|>\n"
        "<|im_start|>assistant\n")
    assert t.render(MESSAGES, add_generation_prompt=False).endswith("東京<|im_end|>\n")


def test_trim_and_lstrip_blocks():
    t = ChatTemplate("A\n  {% if true %}\nB\n  {% endif %}\nC")
    # trim_blocks eats the newline after a block tag, lstrip_blocks the spaces before it.
    assert t.render([]) == "A\nB\nC"


def test_tojson_is_plain_json_with_options():
    t = ChatTemplate("{{ tools | tojson }}|{{ tools[0] | tojson(indent=2) }}")
    tools = [{"name": "f", "note": "<b>é</b>"}]
    assert t.render([], tools=tools) == (
        '[{"name": "f", "note": "<b>é</b>"}]|{\n  "name": "f",\n  "note": "<b>é</b>"\n}')


def test_bos_eos_and_template_kwargs():
    t = ChatTemplate("{{ bos_token }}{{ messages[0].content }}{{ eos_token }}"
                     "{% if enable_thinking is defined and not enable_thinking %}!{% endif %}",
                     bos_token="<s>", eos_token="</s>")
    assert t.render([{"role": "user", "content": "x"}]) == "<s>x</s>"
    assert t.render([{"role": "user", "content": "x"}], enable_thinking=False) == "<s>x</s>!"


def test_strftime_now():
    t = ChatTemplate("{{ strftime_now('%Y') }}")
    assert re.fullmatch(r"\d{4}", t.render([]))


def test_raise_exception_becomes_request_error():
    t = ChatTemplate("{% if messages[0].role != 'user' %}"
                     "{{ raise_exception('first message must be from the user') }}{% endif %}")
    with pytest.raises(RequestError, match="first message must be from the user"):
        t.render([{"role": "assistant", "content": "x"}])


def test_sandbox_blocks_attribute_escapes():
    t = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(RequestError, match="template"):
        t.render([])


def test_syntax_error_names_the_line():
    with pytest.raises(ModelFormatError, match="line 2"):
        ChatTemplate("ok\n{% if %}")


def test_messages_must_have_roles():
    t = ChatTemplate(CHATML)
    with pytest.raises(RequestError, match="message 1 has no 'role'"):
        t.render([{"role": "user", "content": "a"}, {"content": "b"}])
    with pytest.raises(RequestError, match="list"):
        t.render("hello")


def test_from_metadata_prefers_the_model_template():
    meta = {"tokenizer.chat_template": "X{{ messages | length }}"}
    assert ChatTemplate.from_gguf_metadata(meta).render(MESSAGES) == "X2"


def test_default_template_is_chatml():
    t = ChatTemplate.from_gguf_metadata({})
    assert t.source == default_template()
    out = t.render(MESSAGES)
    assert out.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n")
    assert "Hi <there> & 東京<|im_end|>\n" in out
    assert out.endswith("Hi <there> & 東京<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parity
@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}])
def test_default_template_matches_transformers_renderer(kwargs):
    pytest.importorskip("transformers")
    from transformers.utils.chat_template_utils import render_jinja_template

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    messages = MESSAGES + [
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather",
                                              "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny"},
    ]
    expected, _ = render_jinja_template([messages], tools=tools, chat_template=default_template(),
                                        add_generation_prompt=True, **kwargs)
    assert ChatTemplate(default_template()).render(messages, tools=tools, **kwargs) == expected[0]
