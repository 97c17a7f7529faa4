"""Images, audio and files sent to the text-only model: each is served as a note in the text
where it stood (an agent's history keeps such a part on every later turn: refusing it ended the
conversation), on every API; a plain-text Anthropic document is its text."""
import pytest
import requests

NOTE = "[{} omitted: this model reads text only]"
PNG = "iVBORw0KGgo="


def prompt_tokens(live, path: str, body: dict) -> int:
    response = requests.post(live.url + path, timeout=60, json=dict(body, max_tokens=1)
                             if path != "/v1/responses" else dict(body, max_output_tokens=1))
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    return usage.get("prompt_tokens") or usage["input_tokens"] + usage.get(
        "cache_read_input_tokens", 0)


@pytest.mark.parametrize("part, what", [
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64," + PNG}}, "image"),
    ({"type": "input_audio", "input_audio": {"data": "AA==", "format": "wav"}}, "audio"),
    ({"type": "file", "file": {"file_id": "file-1"}}, "file"),
])
def test_chat_media_parts_are_notes(live, part, what):
    def body(second):
        return {"messages": [{"role": "user", "content": [
            {"type": "text", "text": "What is this?"}, second]}]}
    assert prompt_tokens(live, "/v1/chat/completions", body(part)) == prompt_tokens(
        live, "/v1/chat/completions", body({"type": "text", "text": NOTE.format(what)}))


def test_an_anthropic_tool_result_image_is_a_note(live):
    """Claude Code's Read of a PNG answers with an image block in its tool_result."""
    def body(result):
        return {"messages": [
            {"role": "user", "content": "Look at logo.png."},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1",
                                               "name": "Read", "input": {"path": "logo.png"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                          "content": result}]}],
            "tools": [{"name": "Read", "input_schema": {"type": "object", "properties": {
                "path": {"type": "string"}}}}]}
    image = [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                          "data": PNG}}]
    assert prompt_tokens(live, "/v1/messages", body(image)) == prompt_tokens(
        live, "/v1/messages", body(NOTE.format("image")))


@pytest.mark.parametrize("source, text", [
    ({"type": "text", "media_type": "text/plain", "data": "Line one."}, "Line one."),
    ({"type": "content", "content": [{"type": "text", "text": "A"},
                                     {"type": "text", "text": "B"}]}, "A\n\nB"),
    ({"type": "base64", "media_type": "application/pdf", "data": "JVBERi0="},
     NOTE.format("document")),
])
def test_an_anthropic_document_is_its_text_or_a_note(live, source, text):
    def body(block):
        return {"messages": [{"role": "user", "content": [
            {"type": "text", "text": "Summarise:"}, block]}]}
    assert prompt_tokens(live, "/v1/messages", body({"type": "document", "source": source})) \
        == prompt_tokens(live, "/v1/messages", body({"type": "text", "text": text}))


def test_responses_images_are_notes_in_messages_and_outputs(live):
    """Codex's view_image answers with an input_image in a function_call_output."""
    def body(part):
        return {"input": [
            {"role": "user", "content": [{"type": "input_text", "text": "See a.png"}, part]},
            {"type": "function_call", "call_id": "c1", "name": "view_image",
             "arguments": '{"path": "a.png"}'},
            {"type": "function_call_output", "call_id": "c1", "output": [part]}],
            "tools": [{"type": "function", "name": "view_image", "parameters": {
                "type": "object", "properties": {"path": {"type": "string"}}}}]}
    image = {"type": "input_image", "image_url": "data:image/png;base64," + PNG}
    assert prompt_tokens(live, "/v1/responses", body(image)) == prompt_tokens(
        live, "/v1/responses", body({"type": "input_text", "text": NOTE.format("image")}))
