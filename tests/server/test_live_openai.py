"""The official `openai` client against a live waitress server on a tiny synth model: answers
must equal what the engine itself generates for the same prompt."""
import json

import openai
import pytest

from strata.engine.sampling import SamplingParams
from strata.server.output_parser import parse_complete

from conftest import API_KEY, reference_chat

MODEL_ID = "tiny-server"
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


@pytest.fixture(scope="module")
def client(live):
    with openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0,
                       timeout=60) as client:
        yield client  # closed: its pooled sockets would warn when collected


def test_models(client):
    models = client.models.list()
    assert [(m.id, m.owned_by, m.object) for m in models.data] == [
        (MODEL_ID, "strata", "model")]
    assert client.models.retrieve(MODEL_ID).id == MODEL_ID


def test_chat_equals_the_engine(client, reference):
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Name three colours."}]
    tokens, content, reasoning, num_generated, finish = reference_chat(reference, messages, 12)
    reply = client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=12,
                                           temperature=0)
    assert reply.object == "chat.completion"
    assert reply.id.startswith("chatcmpl-")
    choice = reply.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == content
    assert choice.finish_reason == finish
    assert choice.message.tool_calls is None
    assert reply.usage.prompt_tokens == len(tokens)
    assert reply.usage.completion_tokens == num_generated
    assert reply.usage.total_tokens == len(tokens) + num_generated


def test_streamed_chat_equals_the_whole_answer(client, reference):
    messages = [{"role": "user", "content": "Count to five."}]
    tokens, content, _, num_generated, finish = reference_chat(reference, messages, 10)
    stream = client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=10,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    with_choices = [c for c in chunks if c.choices]
    assert [c.choices[0].finish_reason for c in with_choices] == [None] * (
        len(with_choices) - 1) + [finish]
    text = "".join(c.choices[0].delta.content or "" for c in with_choices)
    assert text == content
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == []
    assert (usage_chunk.usage.prompt_tokens, usage_chunk.usage.completion_tokens) == (
        len(tokens), num_generated)
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_plain_and_streamed(client, reference):
    reference.reset()
    tokens = reference.tokenize("Once upon a time")
    events = list(reference.generate(tokens, SamplingParams(temperature=0, max_tokens=7)))
    expected = "".join(e.text for e in events)
    reply = client.completions.create(model=MODEL_ID, prompt="Once upon a time", max_tokens=7,
                                      temperature=0)
    assert reply.object == "text_completion"
    assert reply.choices[0].text == expected
    assert reply.choices[0].finish_reason == events[-1].finish_reason
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(tokens),
                                                                          len(events))
    chunks = list(client.completions.create(model=MODEL_ID, prompt="Once upon a time",
                                            max_tokens=7, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-2].choices[0].finish_reason == events[-1].finish_reason
    assert chunks[-1].usage.completion_tokens == len(events)


def test_completion_from_token_ids(client, reference):
    reply = client.completions.create(model=MODEL_ID, prompt=[5, 6, 7, 8], max_tokens=3,
                                      temperature=0)
    assert reply.usage.prompt_tokens == 4
    assert reply.usage.completion_tokens == 3 or reply.choices[0].finish_reason == "stop"


def test_second_turn_reuses_the_first_turns_tokens(client, reference):
    first = [{"role": "user", "content": "Tell me about the river Thames and its bridges."}]
    reply = client.chat.completions.create(model=MODEL_ID, messages=first, max_tokens=1,
                                           temperature=0)
    second = first + [{"role": "assistant", "content": reply.choices[0].message.content},
                      {"role": "user", "content": "And the Seine?"}]
    tokens1 = reference.tokenize(reference.render_chat(first, add_generation_prompt=True),
                                 add_special=False)
    tokens2 = reference.tokenize(reference.render_chat(second, add_generation_prompt=True),
                                 add_special=False)
    common = 0
    while common < len(tokens1) and tokens1[common] == tokens2[common]:
        common += 1
    # max_tokens=1: the one sampled token is never read back, so the KV holds exactly tokens1.
    reply2 = client.chat.completions.create(model=MODEL_ID, messages=second, max_tokens=2,
                                            temperature=0)
    assert reply2.usage.prompt_tokens == len(tokens2)
    assert reply2.usage.prompt_tokens_details.cached_tokens == common
    assert common >= len(tokens1) - 2


def test_tool_call_round_trip(client, reference):
    """An assistant turn with tool_calls and the tool's answer go through the template: the
    server's prompt is exactly the template's rendering of them."""
    messages = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_abc", "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
        {"role": "tool", "tool_call_id": "call_abc", "content": "18 C, sunny"},
    ]
    templated = [messages[0],
                 {"role": "assistant", "content": "", "tool_calls": [
                     {"id": "call_abc", "type": "function",
                      "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                 {"role": "tool", "tool_call_id": "call_abc", "content": "18 C, sunny"}]
    text = reference.render_chat(templated, tools=[WEATHER_TOOL], add_generation_prompt=True)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' \
        in text
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in text
    tokens, content, _, num_generated, finish = reference_chat(reference, templated, 6,
                                                               tools=[WEATHER_TOOL])
    reply = client.chat.completions.create(model=MODEL_ID, messages=messages,
                                           tools=[WEATHER_TOOL], max_tokens=6, temperature=0)
    assert reply.usage.prompt_tokens == len(tokens)
    assert reply.choices[0].message.content == content
    assert reply.usage.completion_tokens == num_generated


def test_a_forced_tool_choice_renders_the_auto_prompt(client, reference):
    """tool_choice "required" or a named function changes no prompt token (the sampler holds
    the call; tests/server/test_forced_tool_prefix.py has the rest); "none" lists no tools."""
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    plain = client.chat.completions.create(model=MODEL_ID, messages=messages,
                                           tools=[WEATHER_TOOL], max_tokens=1, temperature=0)
    required = client.chat.completions.create(model=MODEL_ID, messages=messages,
                                              tools=[WEATHER_TOOL], tool_choice="required",
                                              max_tokens=1, temperature=0)
    named = client.chat.completions.create(
        model=MODEL_ID, messages=messages, tools=[WEATHER_TOOL], max_tokens=1, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    expected = reference.tokenize(reference.render_chat(messages, tools=[WEATHER_TOOL],
                                                        add_generation_prompt=True),
                                  add_special=False)
    assert plain.usage.prompt_tokens == required.usage.prompt_tokens == len(expected)
    assert named.usage.prompt_tokens == len(expected)
    none = client.chat.completions.create(model=MODEL_ID, messages=messages,
                                          tools=[WEATHER_TOOL], tool_choice="none",
                                          max_tokens=1, temperature=0)
    without_tools = reference.tokenize(reference.render_chat(messages,
                                                             add_generation_prompt=True),
                                       add_special=False)
    assert none.usage.prompt_tokens == len(without_tools) < plain.usage.prompt_tokens


def test_json_response_format_and_template_kwargs(client, reference):
    messages = [{"role": "user", "content": "Give me a JSON object."}]
    reply = client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=1,
                                           temperature=0,
                                           response_format={"type": "json_object"})
    note = [{"role": "system", "content": "Answer with one valid JSON object and nothing else."}]
    expected = reference.tokenize(reference.render_chat(note + messages,
                                                        add_generation_prompt=True),
                                  add_special=False)
    assert reply.usage.prompt_tokens == len(expected)
    no_think = client.chat.completions.create(
        model=MODEL_ID, messages=messages, max_tokens=1, temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    text = reference.render_chat(messages, add_generation_prompt=True, enable_thinking=False)
    assert text.endswith("<think>\n\n</think>\n\n")
    assert no_think.usage.prompt_tokens == len(reference.tokenize(text, add_special=False))


def test_concurrent_requests_queue_on_one_engine(client, reference):
    """Requests sent at once are served one after another by the engine thread, each with
    the answer it would get alone."""
    from concurrent.futures import ThreadPoolExecutor

    prompts = ["First question?", "Second question, longer than the first one?", "Third."]
    expected = [reference_chat(reference, [{"role": "user", "content": p}], 6)[1]
                for p in prompts]

    def ask(prompt):
        reply = client.chat.completions.create(
            model=MODEL_ID, messages=[{"role": "user", "content": prompt}], max_tokens=6,
            temperature=0)
        return reply.choices[0].message.content

    with ThreadPoolExecutor(len(prompts)) as pool:
        assert list(pool.map(ask, prompts)) == expected


def test_seeded_sampling_is_repeatable(client):
    kwargs = dict(model=MODEL_ID, messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
                  temperature=1.0, top_p=0.9, seed=1234, extra_body={"top_k": 20,
                                                                     "min_p": 0.01})
    first = client.chat.completions.create(**kwargs)
    second = client.chat.completions.create(**kwargs)
    assert first.choices[0].message.content == second.choices[0].message.content


def test_api_key_is_required(live_keyed):
    with openai.OpenAI(base_url=live_keyed.url + "/v1", api_key="wrong",
                       max_retries=0) as bad, pytest.raises(openai.AuthenticationError) as info:
        bad.models.list()
    assert info.value.status_code == 401
    assert info.value.body["code"] == "invalid_api_key"
    with openai.OpenAI(base_url=live_keyed.url + "/v1", api_key=API_KEY,
                       max_retries=0) as good:
        assert [m.id for m in good.models.list().data] == [MODEL_ID]
        reply = good.chat.completions.create(model=MODEL_ID, max_tokens=2,
                                             messages=[{"role": "user", "content": "hi"}])
    assert reply.usage.completion_tokens >= 1


@pytest.mark.parametrize("temperature", [5e-324, 1e-12, 9e-6])
def test_temperatures_near_zero_are_greedy(client, temperature):
    kwargs = dict(model=MODEL_ID, messages=[{"role": "user", "content": "Hello"}],
                  max_tokens=5)
    greedy = client.chat.completions.create(temperature=0, **kwargs)
    tiny = client.chat.completions.create(temperature=temperature, **kwargs)
    assert tiny.choices[0].message.content == greedy.choices[0].message.content


def test_logit_bias_bans_and_forces_tokens(client, reference):
    """OpenAI's logit_bias through the client: the engine's greedy tokens with the same bias,
    -100 banning a token and +100 forcing one."""
    prompt = reference.tokenize("The for statement", add_special=True)

    def engine_tokens(bias):
        reference.reset()
        events = list(reference.generate(prompt, SamplingParams(temperature=0, max_tokens=6,
                                                                ignore_eos=True,
                                                                logit_bias=bias)))
        return [e.token_id for e in events], "".join(e.text for e in events)

    def served(bias):
        reply = client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=6,
                                          temperature=0, extra_body={"ignore_eos": True},
                                          logit_bias={str(t): b for t, b in bias.items()})
        return reply.choices[0].text

    plain_ids, plain = engine_tokens({})
    banned = {plain_ids[0]: -100, plain_ids[1]: 2.5}
    banned_ids, banned_text = engine_tokens(banned)
    assert plain_ids[0] not in banned_ids
    assert served(banned) == banned_text != plain
    forced = max(plain_ids)  # a token the model does write
    forced_ids, forced_text = engine_tokens({forced: 100})
    assert forced_ids == [forced] * 6
    assert served({forced: 100}) == forced_text


@pytest.mark.parametrize("response_format", [
    {"type": "json_object"},
    {"type": "json_schema", "json_schema": {"name": "point", "strict": True, "schema": {
        "type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"],
        "additionalProperties": False}}}])
def test_json_response_format_holds_the_answer_to_a_json_object(client, reference,
                                                                response_format):
    """The served answer is the engine's own json_object run on the same prompt (the format's
    instruction included); it stops only with a whole object, which the json module reads.
    The tiny model's `<think>` is banned so that random weights reach the object."""
    messages = [{"role": "user", "content": "Give me a JSON object."}]
    think = reference.tokenizer.token_id("<think>")
    kwargs = dict(model=MODEL_ID, messages=messages, max_tokens=60, temperature=0,
                  logit_bias={str(think): -100},
                  extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    reply = client.chat.completions.create(response_format=response_format, **kwargs)
    if response_format["type"] == "json_object":
        note = "Answer with one valid JSON object and nothing else."
    else:
        note = ("Answer with one valid JSON object that follows this JSON schema, and nothing "
                "else: " + json.dumps(response_format["json_schema"]["schema"]))
    reference.reset()
    text = reference.render_chat([{"role": "system", "content": note}] + messages,
                                 add_generation_prompt=True, enable_thinking=False)
    tokens = reference.tokenize(text, add_special=False)
    schema = (response_format["json_schema"]["schema"]
              if response_format["type"] == "json_schema" else None)
    events = list(reference.generate(tokens, SamplingParams(
        temperature=0, max_tokens=60, json_object=True, json_schema=schema,
        logit_bias={think: -100})))
    content = "".join(e.text for e in events)
    assert reply.choices[0].message.content == content
    assert reply.choices[0].finish_reason == events[-1].finish_reason
    if reply.choices[0].finish_reason == "stop":
        answer = json.loads(content)
        assert isinstance(answer, dict)
        if schema is not None:  # {"x": number}, nothing else
            assert set(answer) <= {"x"} and all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in answer.values())


def test_tool_calls_are_held_to_json(client, reference):
    """With tools (a template whose calls are JSON) each <tool_call> block is a call of a
    declared function whose arguments follow its parameters: the served calls are the
    engine's own held run. The opening tag is favoured so that random weights write calls."""
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    tok = reference.tokenizer
    bias = {tok.token_id("<tool_call>"): 100, tok.token_id("}"): 4, tok.token_id('"'): 4}
    reply = client.chat.completions.create(
        model=MODEL_ID, messages=messages, tools=[WEATHER_TOOL], max_tokens=80, temperature=0,
        logit_bias={str(t): b for t, b in bias.items()},
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    reference.reset()
    text = reference.render_chat(messages, tools=[WEATHER_TOOL], add_generation_prompt=True,
                                 enable_thinking=False)
    events = list(reference.generate(tok.encode(text, add_special=False), SamplingParams(
        temperature=0, max_tokens=80, logit_bias=bias,
        held_tool_calls=[WEATHER_TOOL["function"]])))
    _, _, calls, _ = parse_complete("".join(e.text for e in events), parse_tools=True)
    served = reply.choices[0].message.tool_calls or []
    assert calls and [(c.function.name, json.loads(c.function.arguments)) for c in served] == [
        (c.name, json.loads(c.arguments)) for c in calls]
    for call in served:
        arguments = json.loads(call.function.arguments)
        assert call.function.name == "get_weather" and isinstance(arguments["city"], str)


@pytest.mark.parametrize("tool_choice", ["required",
                                         {"type": "function", "function": {"name": "get_weather"}}])
def test_a_required_tool_call_is_held_to_come(client, reference, tool_choice):
    """tool_choice "required" (or a named function) holds the answer to open with a call: the
    tiny model, which answers this prompt with text, answers with a call of get_weather."""
    tok = reference.tokenizer
    kwargs = dict(model=MODEL_ID, messages=[{"role": "user", "content": "Weather in Oslo?"}],
                  tools=[WEATHER_TOOL], max_tokens=80, temperature=0,
                  logit_bias={str(tok.token_id("}")): 4, str(tok.token_id('"')): 4},
                  extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    free = client.chat.completions.create(**kwargs)
    assert free.choices[0].message.tool_calls is None
    held = client.chat.completions.create(tool_choice=tool_choice, **kwargs)
    calls = held.choices[0].message.tool_calls  # (random weights write on after it: "length")
    assert calls
    assert calls[0].function.name == "get_weather"
    assert isinstance(json.loads(calls[0].function.arguments)["city"], str)


def test_parallel_tool_calls_false_holds_one_call(client, reference):
    """With the opening tag favoured the tiny model writes call after call; with
    parallel_tool_calls false the answer holds one."""
    tok = reference.tokenizer
    kwargs = dict(model=MODEL_ID, messages=[{"role": "user", "content": "Weather in Oslo?"}],
                  tools=[WEATHER_TOOL], max_tokens=200, temperature=0,
                  logit_bias={str(tok.token_id("<tool_call>")): 100,
                              str(tok.token_id("}")): 6, str(tok.token_id('"')): 10},
                  extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    many = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    one = client.chat.completions.create(parallel_tool_calls=False, **kwargs)
    assert len(many) >= 2 and len(one.choices[0].message.tool_calls) == 1
    assert "<tool_call>" not in (one.choices[0].message.content or "")
