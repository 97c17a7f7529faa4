"""The official `openai` client's Responses API against a live server on a tiny synth model
(/v1/responses): answers equal what the engine itself generates for the template's rendering
of the same conversation, and bad requests name what was wrong while the server keeps serving."""
import json

import openai
import pytest
import requests

from strata.engine.sampling import SamplingParams
from strata.server.output_parser import parse_complete

from conftest import reference_chat

MODEL_ID = "tiny-server"
TOOL = {"type": "function", "name": "get_weather", "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}
CHAT_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": TOOL["parameters"]}}


@pytest.fixture(scope="module")
def client(live):
    with openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0,
                       timeout=60) as client:
        yield client  # closed: its pooled sockets would warn when collected


def test_response_equals_the_engine(client, reference):
    tokens, content, _, num_generated, finish = reference_chat(
        reference, [{"role": "system", "content": "You are terse."},
                    {"role": "user", "content": "Name three colours."}], 12)
    reply = client.responses.create(model=MODEL_ID, instructions="You are terse.",
                                    input="Name three colours.", max_output_tokens=12,
                                    temperature=0)
    assert reply.object == "response" and reply.id.startswith("resp_")
    assert reply.output_text == content
    assert reply.status == {"length": "incomplete", "stop": "completed"}[finish]
    if finish == "length":
        assert reply.incomplete_details.reason == "max_output_tokens"
    # the item the cut ended inside is incomplete too (items closed before it are not)
    assert reply.output[-1].status == reply.status
    assert reply.usage.input_tokens == len(tokens)
    assert reply.usage.output_tokens == num_generated
    assert reply.usage.total_tokens == len(tokens) + num_generated


def test_streamed_response_equals_the_whole_one(client, live):
    kwargs = dict(model=MODEL_ID, input=[{"role": "user", "content": [
        {"type": "input_text", "text": "Count to five."}]}], max_output_tokens=10,
        temperature=0)
    whole = client.responses.create(**kwargs)
    with client.responses.stream(**dict(kwargs, max_output_tokens=500)) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    longer = client.responses.create(**dict(kwargs, max_output_tokens=500))
    assert final.output_text == longer.output_text
    assert final.output_text.startswith(whole.output_text)
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    body = dict(kwargs, stream=True)
    with requests.post(live.url + "/v1/responses", json=body, stream=True, timeout=60) as raw:
        lines = [line for line in raw.iter_lines(decode_unicode=True)
                 if line and not line.startswith(":")]
    names = [line[len("event: "):] for line in lines[0::2]]
    payloads = [json.loads(line[len("data: "):]) for line in lines[1::2]]
    assert names == [p["type"] for p in payloads]
    assert [p["sequence_number"] for p in payloads] == list(range(len(payloads)))
    assert names[-1] == {"incomplete": "response.incomplete",
                         "completed": "response.completed"}[whole.status]
    done = [p["item"] for p in payloads if p["type"] == "response.output_item.done"]
    assert done[-1]["status"] == whole.status == payloads[-1]["response"]["output"][-1]["status"]


def test_function_call_turns_render_as_on_the_chat_endpoint(client, live):
    reply = client.responses.create(model=MODEL_ID, tools=[TOOL], max_output_tokens=2,
                                    temperature=0, instructions="Be brief.", input=[
                                        {"role": "user", "content": "Weather in Paris?"},
                                        {"type": "function_call", "call_id": "call_1",
                                         "name": "get_weather",
                                         "arguments": json.dumps({"city": "Paris"})},
                                        {"type": "function_call_output", "call_id": "call_1",
                                         "output": "18 C, sunny"}])
    chat = requests.post(live.url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL_ID, "max_tokens": 2, "temperature": 0, "tools": [CHAT_TOOL],
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]}).json()
    assert reply.usage.input_tokens == chat["usage"]["prompt_tokens"]


def test_function_calls_are_held_and_returned_as_items(client, reference):
    tok = reference.tokenizer
    bias = {tok.token_id("<tool_call>"): 100, tok.token_id("}"): 4, tok.token_id('"'): 4}
    reply = client.responses.create(
        model=MODEL_ID, input="Weather in Oslo?", tools=[TOOL], max_output_tokens=80,
        temperature=0, reasoning={"effort": "none"},
        extra_body={"logit_bias": {str(t): b for t, b in bias.items()}})
    reference.reset()
    text = reference.render_chat([{"role": "user", "content": "Weather in Oslo?"}],
                                 tools=[CHAT_TOOL], add_generation_prompt=True,
                                 enable_thinking=False)
    events = list(reference.generate(tok.encode(text, add_special=False), SamplingParams(
        temperature=0, max_tokens=80, logit_bias=bias,
        held_tool_calls=[CHAT_TOOL["function"]])))
    _, _, calls, _ = parse_complete("".join(e.text for e in events), parse_tools=True)
    served = [item for item in reply.output if item.type == "function_call"]
    assert calls and [(c.name, json.loads(c.arguments)) for c in served] == [
        (c.name, json.loads(c.arguments)) for c in calls]
    assert all(c.id.startswith("fc_") and c.call_id.startswith("call_") for c in served)


def test_json_schema_format_holds_the_answer(client, reference):
    schema = {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"],
              "additionalProperties": False}
    think = reference.tokenizer.token_id("<think>")
    note = ("Answer with one valid JSON object that follows this JSON schema, and nothing "
            "else: " + json.dumps(schema))
    _, content, _, _, finish = reference_chat(
        reference, [{"role": "system", "content": note},
                    {"role": "user", "content": "A point?"}], 60,
        template_kwargs={"enable_thinking": False}, json_object=True, json_schema=schema,
        logit_bias={think: -100})
    reply = client.responses.create(
        model=MODEL_ID, input="A point?", max_output_tokens=60, temperature=0,
        reasoning={"effort": "none"},
        text={"format": {"type": "json_schema", "name": "point", "schema": schema}},
        extra_body={"logit_bias": {str(think): -100}})
    assert reply.output_text == content
    if finish == "stop":
        assert set(json.loads(content)) <= {"x"}


@pytest.mark.parametrize("body,status,param,words", [
    ({"input": "hi", "previous_response_id": "resp_x"}, 400, "previous_response_id",
     ["keeps no responses"]),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, 400, "input[0].call_id",
     ["required"]),
    ({"input": "word " * 600}, 400, "input", ["context holds"]),
    ({"input": "hi", "model": "gpt-5"}, 404, "model", ["'gpt-5'"]),
])
def test_bad_requests_name_the_field(live, client, body, status, param, words):
    response = requests.post(live.url + "/v1/responses", json=body, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param
    for word in words:
        assert word in error["message"], error["message"]
    assert client.responses.create(model=MODEL_ID, input="still there?",
                                   max_output_tokens=1).usage.output_tokens == 1


@pytest.mark.parametrize("method,path", [("GET", "resp_123"), ("DELETE", "resp_123"),
                                         ("POST", "resp_123/cancel")])
def test_stored_responses_are_not_kept_and_say_so(live, method, path):
    response = requests.request(method, live.url + "/v1/responses/" + path, timeout=60)
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["code"] == "response_not_found" and "stores no responses" in error["message"]


def _spelled(entries: list[dict]) -> str:
    return b"".join(bytes(entry["bytes"]) for entry in entries).decode("utf-8", "replace")


def test_message_logprobs_are_the_tokens_of_its_text(live, reference):
    """The tokens of the <think> block (its close included) have no entry in the message's
    logprobs: whole and streamed, the entries spell the message's text."""
    tok = reference.tokenizer
    body = {"model": MODEL_ID, "input": "Hi there", "max_output_tokens": 24, "temperature": 0,
            "include": ["message.output_text.logprobs"],
            "logit_bias": {str(tok.token_id("<think>")): 4, str(tok.token_id("</think>")): 3}}
    reply = requests.post(live.url + "/v1/responses", json=body, timeout=60).json()
    assert [item["type"] for item in reply["output"]][:2] == ["reasoning", "message"]
    part = reply["output"][1]["content"][0]
    assert part["text"] and _spelled(part["logprobs"]) == part["text"]
    with requests.post(live.url + "/v1/responses", json=dict(body, stream=True), stream=True,
                       timeout=60) as raw:
        payloads = [json.loads(line[len("data: "):]) for line in raw.iter_lines(
            decode_unicode=True) if line.startswith("data: ")]
    deltas = [p for p in payloads if p["type"] == "response.output_text.delta"]
    assert "".join(d["delta"] for d in deltas) == part["text"]
    assert _spelled([e for d in deltas for e in d["logprobs"]]) == part["text"]
