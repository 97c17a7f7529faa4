"""Request shapes coding-agent clients send on every turn (learned from their sources: opencode
through the Vercel AI SDK's OpenAI-compatible provider, Codex CLI's Responses requests, Qwen
Code, the openai SDK echoing a reply back): each is served, and the prompt the template gets is
the one those messages mean."""
import pytest
import requests

from strata.server.api_error import ApiError
from strata.server.chat_schema import parse_chat_request

from conftest import N_CTX_TOKENS

READ = {"type": "function", "function": {
    "name": "read", "description": "Read a file.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                   "required": ["path"]}}}


def prompt_size(engine, messages, tools=None, **template_kwargs) -> int:
    text = engine.render_chat(messages, tools=tools, add_generation_prompt=True,
                              **template_kwargs)
    return len(engine.tokenize(text, add_special=False))


def chat(live, **body) -> dict:
    body = {"model": "tiny-server", "max_tokens": 1, **body}
    response = requests.post(live.url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_opencode_system_prompt_in_two_messages(live_one_system, reference):
    """opencode sends its system prompt as two system messages (a header, then the rest); a
    template that takes one system message gets them joined (it refused the request)."""
    messages = [{"role": "system", "content": "You are opencode."},
                {"role": "system", "content": "Working directory: /repo"},
                {"role": "user", "content": "List the files."}]
    reply = chat(live_one_system, messages=messages, tools=[READ])
    joined = [{"role": "system", "content": "You are opencode.\n\nWorking directory: /repo"},
              messages[2]]
    assert reply["usage"]["prompt_tokens"] == prompt_size(reference, joined, [READ])


def test_only_the_leading_system_messages_are_joined(live_one_system):
    """A system message after the conversation began is left to the template (this one
    refuses it), not moved to the front."""
    body = {"model": "tiny-server", "max_tokens": 1,
            "messages": [{"role": "user", "content": "hi"},
                         {"role": "system", "content": "late"}]}
    response = requests.post(live_one_system.url + "/v1/chat/completions", json=body,
                             timeout=60)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "template_error"


@pytest.mark.parametrize("role", ["system", "developer"])
def test_the_shipped_template_takes_a_later_system_message_where_it_stands(live, reference,
                                                                           role):
    """Agents add system (Codex: developer) messages mid-conversation; the shipped template
    renders each as a system turn in its place, as Qwen3's does (it refused them)."""
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello."},
                {"role": role, "content": "The user is in a hurry."},
                {"role": "user", "content": "Files?"}]
    reply = chat(live, messages=messages)
    as_system = [dict(m, role="system") if m["role"] == "developer" else m for m in messages]
    text = reference.render_chat(as_system, add_generation_prompt=True)
    assert "Hello.<|im_end|>\n<|im_start|>system\nThe user is in a hurry.<|im_end|>\n" \
        "<|im_start|>user\nFiles?" in text
    assert reply["usage"]["prompt_tokens"] == prompt_size(reference, as_system)


def test_tool_call_arguments_empty_or_already_decoded(live, reference):
    """A call without arguments streamed as "" by some servers, and arguments sent as an
    object (Ollama's form), come back in the history: read as {} and as that object."""
    history = [{"role": "user", "content": "Read a.py twice."},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c1", "type": "function",
                    "function": {"name": "read", "arguments": ""}},
                   {"id": "c2", "type": "function",
                    "function": {"name": "read", "arguments": {"path": "a.py"}}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "x = 1"},
               {"role": "tool", "tool_call_id": "c2", "content": "x = 1"}]
    reply = chat(live, messages=history, tools=[READ])
    expected = [history[0],
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function",
                     "function": {"name": "read", "arguments": {}}},
                    {"id": "c2", "type": "function",
                     "function": {"name": "read", "arguments": {"path": "a.py"}}}]},
                history[2], history[3]]
    assert reply["usage"]["prompt_tokens"] == prompt_size(reference, expected, [READ])


def test_an_echoed_reply_without_content_or_with_a_refusal_part(live, reference):
    """The openai SDK echoes a reply as it came: `content: null` where the answer was all
    reasoning, `refusal` parts in an assistant's content array."""
    history = [{"role": "user", "content": "Think."},
               {"role": "assistant", "content": None, "reasoning_content": "Hm.",
                "refusal": None, "tool_calls": None},
               {"role": "user", "content": "Now answer."},
               {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't."}]},
               {"role": "user", "content": "Why?"}]
    reply = chat(live, messages=history)
    expected = [history[0], {"role": "assistant", "content": ""}, history[2],
                {"role": "assistant", "content": "I can't."}, history[4]]
    assert reply["usage"]["prompt_tokens"] == prompt_size(reference, expected)


def test_reasoning_is_read_as_reasoning_content():
    """vLLM and OpenRouter name an answer's reasoning `reasoning`; a client echoes it so."""
    body = {"messages": [{"role": "user", "content": "q"},
                         {"role": "assistant", "content": "a", "reasoning": "thought"},
                         {"role": "user", "content": "q2"}]}
    messages = parse_chat_request(body, N_CTX_TOKENS).messages
    assert messages[1]["reasoning_content"] == "thought"


def test_reasoning_effort_none_turns_thinking_off(live, reference):
    """`reasoning_effort` (the openai SDK's, the AI SDK's, Qwen Code's "none") is the
    template's enable_thinking, as `reasoning.effort` is on /v1/responses;
    chat_template_kwargs, where sent, wins."""
    messages = [{"role": "user", "content": "Hello."}]
    off = prompt_size(reference, messages, enable_thinking=False)
    assert off > prompt_size(reference, messages)
    reply = chat(live, messages=messages, reasoning_effort="none")
    assert reply["usage"]["prompt_tokens"] == off
    reply = chat(live, messages=messages, reasoning_effort="none",
                 chat_template_kwargs={"enable_thinking": True})
    on = prompt_size(reference, messages, enable_thinking=True)
    assert reply["usage"]["prompt_tokens"] == on
    # another provider's level leaves the template's default (a 400 would fail every turn)
    other = parse_chat_request({"messages": messages, "reasoning_effort": "max"}, N_CTX_TOKENS)
    assert other.chat_template_kwargs == {}
    with pytest.raises(ApiError, match="'reasoning_effort' must be a string"):
        parse_chat_request({"messages": messages, "reasoning_effort": 2}, N_CTX_TOKENS)


CODEX_TOOLS = [{"type": "web_search", "external_web_access": False},
               {"type": "function", "name": "read", "description": "Read a file.",
                "strict": False, "parameters": READ["function"]["parameters"]}]


def test_codex_web_search_tool_is_left_out(live, reference):
    """Codex sends a hosted web_search tool on every turn by default: the model is offered the
    function tools only (it was a 400 on every turn), and a web_search_call item in the history
    is left out."""
    body = {"model": "tiny-server", "max_output_tokens": 1, "store": False,
            "tools": CODEX_TOOLS, "tool_choice": "auto",
            "include": ["reasoning.encrypted_content"],
            "input": [{"type": "message", "role": "user",
                       "content": [{"type": "input_text", "text": "Find the docs."}]},
                      {"type": "web_search_call", "id": "ws_1", "status": "completed",
                       "action": {"type": "search", "query": "docs"}},
                      {"type": "message", "role": "assistant",
                       "content": [{"type": "output_text", "text": "Found none."}]},
                      {"type": "message", "role": "user",
                       "content": [{"type": "input_text", "text": "Read a.py."}]}]}
    response = requests.post(live.url + "/v1/responses", json=body, timeout=60)
    assert response.status_code == 200, response.text
    messages = [{"role": "user", "content": "Find the docs."},
                {"role": "assistant", "content": "Found none."},
                {"role": "user", "content": "Read a.py."}]
    assert response.json()["usage"]["input_tokens"] == prompt_size(reference, messages, [READ])
    forced = dict(body, tool_choice={"type": "web_search"})
    response = requests.post(live.url + "/v1/responses", json=forced, timeout=60)
    assert response.status_code == 400
    assert "runs no hosted tools" in response.json()["error"]["message"]


def test_seed_minus_one_is_a_random_seed():
    """Chat UIs written for llama-server send `seed: -1` for "unset": a random seed, not a 400."""
    from strata.server.schema import parse_options

    assert parse_options({"seed": -1}, N_CTX_TOKENS).seed is None
    assert parse_options({"seed": 7}, N_CTX_TOKENS).seed == 7
    with pytest.raises(ApiError, match="seed"):
        parse_options({"seed": -2}, N_CTX_TOKENS)
    with pytest.raises(ApiError, match="seed"):
        parse_options({"seed": True}, N_CTX_TOKENS)
