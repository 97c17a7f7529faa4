"""Anthropic's streamed usage: message_start already splits the prompt into the tokens read and
those reused from a parked conversation, as Anthropic's stream does, and agrees with the final
figures of message_delta."""
import json

import anthropic
import requests

MODEL_ID = "tiny-server"
MESSAGES = [{"role": "user", "content": "Write a long list of fruits, one per line."}]


def stream_events(live, **body) -> list[tuple[str, dict]]:
    body = dict(model=MODEL_ID, messages=MESSAGES, temperature=0, stream=True, **body)
    with requests.post(live.url + "/v1/messages", json=body, timeout=60) as reply:
        assert reply.status_code == 200, reply.text
        frames = [f for f in reply.text.split("\n\n") if f]
    return [(f.split("\n")[0][len("event: "):], json.loads(f.split("\n")[1][len("data: "):]))
            for f in frames]


def split(usage: dict) -> tuple[int, int]:
    return usage["input_tokens"], usage["cache_read_input_tokens"]


def test_message_start_reports_the_reused_prompt_tokens(live):
    stream_events(live, max_tokens=4)  # the conversation is parked, its prompt cached
    events = [e for e in stream_events(live, max_tokens=1) if e[0] != "ping"]
    assert events[0][0] == "message_start" and events[-2][0] == "message_delta"
    start = events[0][1]["message"]["usage"]
    final = events[-2][1]["usage"]
    assert split(final)[1] > 0  # the same prompt again: all but its last token reused
    assert split(start) == split(final)
    assert start["output_tokens"] == 0 and final["output_tokens"] == 1


def test_the_sdk_reads_the_split_from_message_start(live):
    with anthropic.Anthropic(base_url=live.url, api_key="unused", max_retries=0,
                             timeout=60) as client:
        client.messages.create(model=MODEL_ID, messages=MESSAGES, max_tokens=3,
                               extra_body={"temperature": 0})
        with client.messages.stream(model=MODEL_ID, messages=MESSAGES, max_tokens=1,
                                    extra_body={"temperature": 0}) as stream:
            first = next(iter(stream))
            final = stream.get_final_message()
    assert first.type == "message_start"
    assert first.message.usage.cache_read_input_tokens == \
        final.usage.cache_read_input_tokens > 0
    assert first.message.usage.input_tokens == final.usage.input_tokens
