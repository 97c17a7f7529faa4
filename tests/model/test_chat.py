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


def test_syntax_error_names_the_key_and_line():
    with pytest.raises(ModelFormatError, match=r"\(tokenizer.chat_template\) has a syntax error "
                                               "at line 2"):
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


GENERATION = ("{% for m in messages %}{% if m.role == 'assistant' %}"
              "{% generation %}<a>{{ m.content }}</a>{% endgeneration %}"
              "{% else %}<u>{{ m.content }}</u>{% endif %}{% endfor %}")


def test_generation_blocks_render_their_body():
    # transformers' `{% generation %}` tag (marks the assistant's text for training masks)
    turns = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert ChatTemplate(GENERATION).render(turns) == "<u>q</u><a>a</a>"


def test_documents_are_none_when_not_given():
    t = ChatTemplate("{% if documents is not none %}D{% endif %}|{{ documents }}")
    assert t.render(MESSAGES) == "|None"


def _gguf_metadata(tmp_path, templates) -> dict:
    """The metadata of a GGUF holding `templates` as llama.cpp's writer stores them."""
    import gguf

    from strata.model.gguf_file import _read_metadata

    w = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "qwen3moe")
    w.add_chat_template(templates)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return _read_metadata(gguf.GGUFReader(tmp_path / "t.gguf"), "t.gguf")


def test_named_tool_use_template_renders_requests_with_tools(tmp_path):
    meta = _gguf_metadata(tmp_path, [
        {"name": "default", "template": "plain {{ messages | length }}"},
        {"name": "tool_use", "template": "tools {{ tools | length }} {{ messages | length }}"},
        {"name": "rag", "template": "rag"}])
    t = ChatTemplate.from_gguf_metadata(meta)
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert t.render(MESSAGES) == "plain 2"
    assert t.render(MESSAGES, tools=tools) == "tools 1 2"
    assert t.render(MESSAGES, tools=[]) == "plain 2"
    assert t.source == "plain {{ messages | length }}"
    # only named ones: the shipped ChatML template without tools
    t = ChatTemplate.from_gguf_metadata(
        _gguf_metadata(tmp_path, [{"name": "tool_use", "template": "T"}]))
    assert t.source == default_template() and t.render(MESSAGES, tools=tools) == "T"


def test_a_broken_tool_use_template_is_named():
    meta = {"tokenizer.chat_template": "ok", "tokenizer.chat_template.tool_use": "{% if %}"}
    with pytest.raises(ModelFormatError, match=r"template \(tokenizer.chat_template.tool_use\)"):
        ChatTemplate.from_gguf_metadata(meta)


@pytest.mark.parity
def test_generation_and_documents_match_transformers_renderer():
    pytest.importorskip("transformers")
    from transformers.utils.chat_template_utils import render_jinja_template

    turns = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    docs = "{% if documents is not none %}D{% endif %}|{{ documents }}"
    for template in (GENERATION, docs):
        expected, _ = render_jinja_template([turns], chat_template=template)
        assert ChatTemplate(template).render(turns, add_generation_prompt=False) == expected[0]
