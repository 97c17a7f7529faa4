"""A forced tool choice (chat's "required" or a named function or custom tool, the Responses
API's function / custom choice, Anthropic's "any" / "tool") renders the prompt "auto" renders,
every tool listed and no note added, on the packaged default model: the sampler alone holds
the answer to the forced call, and the agent's next turn ("auto") reuses the forced turn's
parked KV instead of reading the conversation again."""
from __future__ import annotations

import re

import pytest
import requests

from strata.config import EngineConfig
from strata.data import default_model_path
from strata.engine.engine import Engine
from strata.server.anthropic_schema import parse_anthropic_request
from strata.server.app import ServerConfig
from strata.server.chat_schema import parse_chat_request
from strata.server.prompting import build_chat_prompt
from strata.server.responses_schema import parse_responses_request

from live_server import start_live_server

MODEL_ID = "default-model"
SYSTEM = "You are a helpful assistant. Use the tools when they help."
QUESTION = "What is the weather in Oslo, and what time is it there?"
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CODE_REGEX = r"[0-9]{3}-[a-z]{2}"
NAMES = ["get_weather", "get_time", "code"]  # the tools each API's requests send, in order

CHAT_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": CITY,
                                      "description": "Current weather of a city"}},
    {"type": "function", "function": {"name": "get_time", "parameters": CITY,
                                      "description": "Current time in a city"}},
    {"type": "custom", "custom": {"name": "code", "description": "A booking code.", "format": {
        "type": "grammar", "grammar": {"syntax": "regex", "definition": CODE_REGEX}}}}]
RESPONSES_TOOLS = [
    {"type": "function", "name": "get_weather", "parameters": CITY,
     "description": "Current weather of a city"},
    {"type": "function", "name": "get_time", "parameters": CITY,
     "description": "Current time in a city"},
    {"type": "custom", "name": "code", "description": "A booking code.",
     "format": {"type": "grammar", "syntax": "regex", "definition": CODE_REGEX}}]
ANTHROPIC_TOOLS = [
    {"name": "get_weather", "description": "Current weather of a city", "input_schema": CITY},
    {"name": "get_time", "description": "Current time in a city", "input_schema": CITY},
    {"name": "code", "description": "A booking code.", "input_schema": {
        "type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}}]


def chat_body(tool_choice, messages=None, system=SYSTEM) -> dict:
    return {"model": MODEL_ID, "tools": CHAT_TOOLS, "tool_choice": tool_choice,
            "messages": messages or [{"role": "system", "content": system},
                                     {"role": "user", "content": QUESTION}]}


def responses_body(tool_choice, items=None, system=SYSTEM) -> dict:
    return {"model": MODEL_ID, "instructions": system, "tools": RESPONSES_TOOLS,
            "tool_choice": tool_choice, "parallel_tool_calls": False,
            "input": items or [{"type": "message", "role": "user", "content": QUESTION}]}


def anthropic_body(tool_choice, messages=None, system=SYSTEM) -> dict:
    return {"model": MODEL_ID, "system": system, "tools": ANTHROPIC_TOOLS,
            "tool_choice": tool_choice, "max_tokens": 200,
            "messages": messages or [{"role": "user", "content": QUESTION}]}


# (API, the body's builder, its parser, "auto", the forced choice, the function forced: None
# where any tool may be called)
FORCED = [
    ("chat", chat_body, parse_chat_request, "auto", "required", None),
    ("chat", chat_body, parse_chat_request, "auto",
     {"type": "function", "function": {"name": "get_time"}}, "get_time"),
    ("chat", chat_body, parse_chat_request, "auto",
     {"type": "custom", "custom": {"name": "code"}}, "code"),
    ("responses", responses_body, parse_responses_request, "auto", "required", None),
    ("responses", responses_body, parse_responses_request, "auto",
     {"type": "function", "name": "get_time"}, "get_time"),
    ("responses", responses_body, parse_responses_request, "auto",
     {"type": "custom", "name": "code"}, "code"),
    ("anthropic", anthropic_body, parse_anthropic_request, {"type": "auto"}, {"type": "any"},
     None),
    ("anthropic", anthropic_body, parse_anthropic_request, {"type": "auto"},
     {"type": "tool", "name": "get_time"}, "get_time"),
]
IDS = [f"{api}-{forced_name or 'any'}" for api, *_, forced_name in FORCED]


@pytest.fixture(scope="module")
def engine():
    engine = Engine(EngineConfig(default_model_path(), threads=2))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def live(engine):
    server = start_live_server(engine, ServerConfig(model_id=MODEL_ID))
    yield server
    server.stop()


def prompt_of(engine, parse, body: dict):
    return build_chat_prompt(engine, parse(body, engine.n_ctx))


@pytest.mark.parametrize("api, body, parse, auto, choice, forced_name", FORCED, ids=IDS)
def test_a_forced_choice_renders_the_auto_prompt(engine, api, body, parse, auto, choice,
                                                 forced_name):
    """Every tool listed and no note in the system message: the forced prompt is the "auto"
    one token for token (so it is the next turn's prefix up to the forced turn's reply); the
    calls are held to the forced function alone (a named one) or to any tool."""
    auto_prompt = prompt_of(engine, parse, body(auto))
    forced_prompt = prompt_of(engine, parse, body(choice))
    for name in NAMES:
        assert f'"name": "{name}"' in auto_prompt.text, name
    common = next((i for i, (a, b) in enumerate(zip(auto_prompt.tokens, forced_prompt.tokens))
                   if a != b), min(len(auto_prompt.tokens), len(forced_prompt.tokens)))
    assert common == len(auto_prompt.tokens), (common, len(auto_prompt.tokens))
    assert forced_prompt.tokens == auto_prompt.tokens
    held = [f["name"] for f in forced_prompt.held_tool_calls]
    assert held == ([forced_name] if forced_name else NAMES)


def test_a_response_format_note_stays_where_auto_puts_it(engine):
    """A JSON response format's instruction still follows the system prompt, forced or not."""
    fmt = {"type": "json_schema", "json_schema": {"schema": CITY}}
    prompts = [prompt_of(engine, parse_chat_request, dict(chat_body(choice), response_format=fmt))
               for choice in ("auto", "required", {"type": "function",
                                                   "function": {"name": "get_time"}})]
    assert prompts[0].text.startswith(f"<|im_start|>system\n{SYSTEM}\n\nAnswer with one valid "
                                      "JSON object that follows this JSON schema")
    assert prompts[1].tokens == prompts[2].tokens == prompts[0].tokens


PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses",
         "anthropic": "/v1/messages"}
MAX_TOKENS_FIELDS = {"chat": "max_completion_tokens", "responses": "max_output_tokens",
                     "anthropic": "max_tokens"}


@pytest.fixture(scope="module")
def ending_bias(engine) -> dict[str, int]:
    """The default model writes on inside a string: '"' and "}" (favoured) end the held
    arguments, <|im_end|> the reply after the call."""
    tokenizer = engine.tokenizer
    bias = {str(tokenizer.token_id("<|im_end|>")): 30}
    for text, value in (('"', 12), ("}", 8)):
        [token] = tokenizer.encode(text, add_special=False)
        bias[str(token)] = value
    return bias


def post(live, api: str, body: dict, bias: dict[str, int]) -> dict:
    body = dict(body, temperature=0, logit_bias=bias, **{MAX_TOKENS_FIELDS[api]: 200})
    response = requests.post(live.url + PATHS[api], json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def calls_of(api: str, reply: dict) -> list[tuple[str, str]]:
    """(name, arguments or input text) of each call in the reply."""
    if api == "chat":
        return [(c["function"]["name"], c["function"]["arguments"]) if c["type"] == "function"
                else (c["custom"]["name"], c["custom"]["input"])
                for c in reply["choices"][0]["message"].get("tool_calls") or []]
    if api == "responses":
        return [(item["name"], item.get("arguments", item.get("input")))
                for item in reply["output"]
                if item["type"] in ("function_call", "custom_tool_call")]
    return [(block["name"], block["input"]) for block in reply["content"]
            if block["type"] == "tool_use"]


def usage_of(api: str, reply: dict) -> tuple[int, int]:
    """(prompt tokens, of them reused from the parked KV)."""
    usage = reply["usage"]
    if api == "chat":
        return usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]
    if api == "responses":
        return usage["input_tokens"], usage["input_tokens_details"]["cached_tokens"]
    return (usage["input_tokens"] + usage["cache_read_input_tokens"],
            usage["cache_read_input_tokens"])


@pytest.mark.parametrize("api, body, parse, auto, choice, forced_name", FORCED, ids=IDS)
def test_a_forced_choice_still_comes_back_as_its_call(live, engine, ending_bias, api, body,
                                                      parse, auto, choice, forced_name):
    reply = post(live, api, body(choice), ending_bias)
    calls = calls_of(api, reply)
    assert calls, reply
    name, value = calls[0]
    assert name == forced_name if forced_name else name in NAMES, reply
    if name == "code" and api != "anthropic":  # a custom tool's input, held to its regex
        assert re.fullmatch(CODE_REGEX, value), value
    assert usage_of(api, reply)[0] == len(prompt_of(engine, parse, body(auto)).tokens)


def next_turn(api: str, body: dict, reply: dict) -> dict:
    """`body`'s conversation with the reply and its calls' results appended, tool_choice
    "auto", as an agent sends its next turn."""
    if api == "chat":
        message = reply["choices"][0]["message"]
        results = [{"role": "tool", "tool_call_id": c["id"], "content": "Done."}
                   for c in message["tool_calls"]]
        return dict(body, tool_choice="auto", messages=body["messages"] + [message] + results)
    if api == "responses":
        results = [{"type": "function_call_output", "call_id": item["call_id"],
                    "output": "Done."} for item in reply["output"]
                   if item["type"] == "function_call"]
        return dict(body, tool_choice="auto", input=body["input"] + reply["output"] + results)
    results = [{"type": "tool_result", "tool_use_id": block["id"], "content": "Done."}
               for block in reply["content"] if block["type"] == "tool_use"]
    return dict(body, tool_choice={"type": "auto"}, messages=body["messages"] + [
        {"role": "assistant", "content": reply["content"]},
        {"role": "user", "content": results}])


@pytest.mark.parametrize("api, body, choice", [
    ("chat", chat_body, {"type": "function", "function": {"name": "get_time"}}),
    ("chat", chat_body, "required"),
    ("responses", responses_body, {"type": "function", "name": "get_time"}),
    ("anthropic", anthropic_body, {"type": "tool", "name": "get_time"})],
    ids=["chat-named", "chat-required", "responses-named", "anthropic-named"])
def test_the_next_auto_turn_reuses_the_forced_turns_prompt(live, ending_bias, api, body,
                                                           choice):
    """Turn 1 forced, turn 2 "auto" with turn 1's reply and results appended: turn 2 reads
    again only what turn 1 did not hold (its reply as rendered, the results), not the whole
    conversation from the system prompt's first tokens. Each case's system prompt starts with
    its own words: no other test's parked conversation shares more than the template's
    header."""
    first_body = body(choice, system=f"Session {api} {choice}. {SYSTEM}")
    first = post(live, api, first_body, ending_bias)
    num_first_tokens, _ = usage_of(api, first)
    assert calls_of(api, first), first
    second = post(live, api, next_turn(api, first_body, first), ending_bias)
    num_second_tokens, num_reused = usage_of(api, second)
    assert num_second_tokens > num_first_tokens
    assert num_reused >= num_first_tokens, (num_reused, num_first_tokens)
