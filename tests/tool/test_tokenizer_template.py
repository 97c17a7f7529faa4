"""The shipped tokenizer (byte-level BPE) and chat template (ChatML with tools and thinking)."""
import json

import jinja2
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from strata.tool.synth import SPECIAL_TOKENS, data_text


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_str(data_text("synth_tokenizer.json"))


@pytest.fixture(scope="module")
def template():
    """The template in a sandbox set up as Hugging Face's renderer sets it up."""
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda v, ensure_ascii=False, indent=None, separators=None, \
        sort_keys=False: json.dumps(v, ensure_ascii=ensure_ascii, indent=indent,
                                    separators=separators, sort_keys=sort_keys)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(data_text("chat_template.jinja"))


@pytest.mark.parametrize("text", [
    "Hello, world! def f(x):\n    return x ** 2  # ok\n",
    "Ünïcödé ☃ and emoji 😀, CJK 漢字, tabs\tand\r\nCRLF",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\nhm\n</think>\n\nYes",
    "   leading spaces and 1234567890 digits",
])
def test_round_trip(tokenizer, text):
    ids = tokenizer.encode(text).ids
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    assert max(ids) < tokenizer.get_vocab_size()


def test_special_tokens_are_single_ids_at_the_end(tokenizer):
    assert tokenizer.get_vocab_size() == 4096
    assert [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(4089, 4096))
    for token in SPECIAL_TOKENS:
        assert tokenizer.encode(f"a{token}b").ids == [tokenizer.token_to_id("a"),
                                                      tokenizer.token_to_id(token),
                                                      tokenizer.token_to_id("b")]


def test_qwen2_split_keeps_digits_apart_and_bpe_merges_words(tokenizer):
    ids = tokenizer.encode("12345").ids
    assert [tokenizer.id_to_token(i) for i in ids] == ["1", "2", "3", "4", "5"]
    assert len(tokenizer.encode(" return").ids) == 1  # learned from the stdlib's code


def test_template_plain_chat_with_generation_prompt(template):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": [{"type": "text", "text": "Again"}]}]
    assert template.render(messages=messages, add_generation_prompt=True) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nAgain<|im_end|>\n"
        "<|im_start|>assistant\n")
    assert template.render(messages=messages[1:2], add_generation_prompt=False) == \
        "<|im_start|>user\nHi<|im_end|>\n"


def test_template_enable_thinking(template):
    messages = [{"role": "user", "content": "Hi"}]
    off = template.render(messages=messages, add_generation_prompt=True, enable_thinking=False)
    on = template.render(messages=messages, add_generation_prompt=True, enable_thinking=True)
    assert off == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert on == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_template_tools_tool_calls_and_responses(template):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Köln?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather",
                                              "arguments": {"city": "Paris"}}},
            {"type": "function", "function": {"name": "get_weather",
                                              "arguments": '{"city": "Köln"}'}}]},
        {"role": "tool", "content": "18C"},
        {"role": "tool", "content": "15C"},
    ]
    out = template.render(messages=messages, tools=tools, add_generation_prompt=True)
    system, rest = out.split("<|im_end|>\n", 1)
    assert system.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert "\n<tools>\n" + json.dumps(tools[0]) + "\n</tools>\n" in system
    assert '<tool_call>\n{"name": <function name>, "arguments": <arguments object>}\n' \
           "</tool_call>" in system
    assert rest == (
        "<|im_start|>user\nWeather in Paris and Köln?<|im_end|>\n"
        "<|im_start|>assistant\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Köln"}}\n</tool_call>'
        "<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n18C\n</tool_response>\n"
        "<tool_response>\n15C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")
    # Without a system message the tools still get a system turn of their own.
    bare = template.render(messages=messages[1:2], tools=tools)
    assert bare.startswith("<|im_start|>system\n# Tools\n")


def test_template_rejects_bad_roles(template):
    with pytest.raises(jinja2.exceptions.TemplateError, match="unknown message role robot"):
        template.render(messages=[{"role": "robot", "content": "x"}])


def test_template_renders_a_later_system_message_where_it_stands(template):
    text = template.render(messages=[{"role": "user", "content": "x"},
                                     {"role": "system", "content": "y"}])
    assert text == "<|im_start|>user\nx<|im_end|>\n<|im_start|>system\ny<|im_end|>\n"
