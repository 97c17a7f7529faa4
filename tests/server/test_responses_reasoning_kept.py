"""Reasoning across Responses turns for clients that keep no state and send reasoning items
back without their text (Codex: store false, `include: ["reasoning.encrypted_content"]`, the
item returned with that field and no reasoning_text content): the text rides in the field,
marked as this server's, and is read back from it, so the next prompt holds the reasoning the
model wrote (a Qwen3 thinking template renders it for the turns of a tool loop)."""
import requests

from strata.server.responses_format import REASONING_INCLUDE, REASONING_MARK
from strata.server.responses_schema import parse_responses_request

MODEL_ID = "tiny-server"


def _reasoning_items(live, reference, include):
    think = reference.tokenizer.token_id("<think>")  # the tiny model opens no block itself
    body = {"model": MODEL_ID, "input": "Think first.", "max_output_tokens": 12,
            "temperature": 0, "store": False, "logit_bias": {str(think): 100}}
    if include:
        body["include"] = [REASONING_INCLUDE]
    reply = requests.post(live.url + "/v1/responses", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    return [item for item in reply.json()["output"] if item["type"] == "reasoning"]


def test_reasoning_rides_in_encrypted_content_when_asked(live, reference):
    kept = _reasoning_items(live, reference, include=True)
    assert kept and kept[0]["content"][0]["text"]
    for item in kept:
        assert item["encrypted_content"] == REASONING_MARK + item["content"][0]["text"]
    plain = _reasoning_items(live, reference, include=False)
    assert plain and all("encrypted_content" not in item for item in plain)


def _turn(reasoning_item: dict) -> dict:
    req = parse_responses_request({"input": [
        {"role": "user", "content": "List the files."},
        reasoning_item,
        {"type": "function_call", "call_id": "c1", "name": "shell",
         "arguments": '{"command": "ls"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "a.txt"}],
        "tools": [{"type": "function", "name": "shell", "parameters": {
            "type": "object", "properties": {"command": {"type": "string"}}}}]}, 512)
    return next(m for m in req.messages if m["role"] == "assistant")


def test_the_reasoning_codex_sends_back_is_read_from_the_field():
    # as Codex serialises it: no id, no content, the summary empty, the field as received
    assert _turn({"type": "reasoning", "summary": [],
                  "encrypted_content": REASONING_MARK + "ls shows the files."}
                 )["reasoning_content"] == "ls shows the files."
    # another server's ciphertext is nothing this server can read; content wins over the field
    assert not _turn({"type": "reasoning", "summary": [],
                      "encrypted_content": "gAAAAABo..."}).get("reasoning_content")
    assert _turn({"type": "reasoning", "summary": [],
                  "content": [{"type": "reasoning_text", "text": "own"}],
                  "encrypted_content": REASONING_MARK + "kept"})["reasoning_content"] == "own"
