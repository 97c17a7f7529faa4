"""Images, audio and files in a conversation for a text-only model. Each becomes a short note
where it stood, so the model can tell the user it cannot see it, and the conversation goes on
being served: an agent's history holds such a part on every later turn (Claude Code's Read of a
PNG answers with an image block, Codex's view_image with an input_image, a pasted screenshot),
so refusing it would end the conversation for good."""
from __future__ import annotations

import logging

log = logging.getLogger("strata.server")

# the part or block types of each API that carry media, and what each is called in the note
MEDIA_KINDS = {
    "image_url": "image", "input_image": "image", "image": "image",  # chat, Responses, Anthropic
    "input_audio": "audio",                                         # chat and Responses
    "file": "file", "input_file": "file", "document": "document",   # chat, Responses, Anthropic
}


def is_media(kind) -> bool:
    return isinstance(kind, str) and kind in MEDIA_KINDS


def omitted_note(kind: str, param: str) -> str:
    """The text that stands for a media part of type `kind` at `param` (logged)."""
    what = MEDIA_KINDS[kind]
    log.info("%s: the %s left out (the model reads text only; it is told so)", param, what)
    return f"[{what} omitted: this model reads text only]"
