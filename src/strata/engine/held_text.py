"""A string argument's text held to a grammar (gbnf.Grammar) while a tool call is written: a
custom tool's Lark or regex grammar, or a JSON schema's `pattern` (json_schema.py), inside
- a JSON string (`JsonText`): the bytes between the quotes, JSON's escapes decoded. Only the
  escapes `json.dumps(..., ensure_ascii=False)` writes are taken (`\\"`, `\\\\`, `\\b \\f \\n
  \\r \\t`, `\\u00XX` for the other control characters); any other character comes as itself,
  so each text has one spelling and a refused byte never hides a way on;
- an XML value of Qwen3-Coder's form (`XmlText`): the raw text between `<parameter=KEY>` and
  its `</parameter>`, as server/output_parser reads it back (one newline stripped at each end):
  an optional newline, the text, then a newline and `</parameter>`.
Both refuse a byte as soon as no sentence of the grammar can follow, so the sampler never
writes itself into a text it cannot finish."""
from __future__ import annotations

from strata.engine.gbnf import Grammar, GrammarRecognizer

# JSON's short escapes: the byte after the backslash -> the character
_SHORT_ESCAPES = {ord('"'): 0x22, ord("\\"): 0x5C, ord("b"): 0x08, ord("f"): 0x0C,
                  ord("n"): 0x0A, ord("r"): 0x0D, ord("t"): 0x09}
# the control characters json.dumps writes as \u00XX (the others have a short escape)
_U_ESCAPED = tuple(cp for cp in range(0x20) if cp not in _SHORT_ESCAPES.values())


def _takes(text: GrammarRecognizer, cp: int) -> bool:
    return text.copy().feed(chr(cp).encode())


class JsonText:
    """The contents of one JSON string held to `grammar`: `byte` each raw byte between the
    quotes (the JSON recognizer has checked JSON's own rules), `is_done` at the closing
    quote."""

    __slots__ = ("text", "escape")

    def __init__(self, grammar: Grammar):
        self.text = grammar.recognizer()
        self.escape: bytes | None = None  # an escape's bytes after its backslash, or None

    def copy(self) -> "JsonText":
        other = JsonText.__new__(JsonText)
        other.text, other.escape = self.text.copy(), self.escape
        return other

    @property
    def is_done(self) -> bool:
        return self.escape is None and self.text.is_done

    def byte(self, c: int) -> bool:
        escape = self.escape
        if escape is None:
            if c != 0x5C:
                return c != 0x22 and self.text.feed(bytes((c,)))
            if self.text.need:  # inside a character's UTF-8
                return False
            self.escape = b""
            return any(_takes(self.text, cp) for cp in (*_SHORT_ESCAPES.values(), *_U_ESCAPED))
        if not escape:
            cp = _SHORT_ESCAPES.get(c)
            if cp is not None:
                self.escape = None
                return self.text.feed(chr(cp).encode())
            self.escape = b"u"
            return c == ord("u") and any(_takes(self.text, cp) for cp in _U_ESCAPED)
        digits = escape[1:] + bytes((c,))
        fits = [cp for cp in _U_ESCAPED
                if (b"%04x" % cp).startswith(digits) and _takes(self.text, cp)]
        if not fits:  # (a byte that is not a lower-case hex digit fits none)
            return False
        if len(digits) < 4:
            self.escape = b"u" + digits
            return True
        self.escape = None
        return self.text.feed(chr(fits[0]).encode())


class XmlText:
    """One XML parameter value held to `grammar`, up to and with its closing tag (`close`,
    `</parameter>`): `byte` says 1 when the tag is whole, 0 to go on, -1 refused. The text and
    a closing tag that may be starting are followed side by side: the tag may start wherever
    the text is a whole sentence, and the first whole tag ends the value (as the reader's
    non-greedy match ends it)."""

    __slots__ = ("text", "tag", "at", "started")

    def __init__(self, grammar: Grammar, close: bytes):
        self.text: GrammarRecognizer | None = grammar.recognizer()
        self.tag = b"\n" + close
        self.at = -1          # bytes of the tag matched, -1: no tag under way
        self.started = False  # a byte of the value (or its leading newline) is read

    def copy(self) -> "XmlText":
        other = XmlText.__new__(XmlText)
        other.text = None if self.text is None else self.text.copy()
        other.tag, other.at, other.started = self.tag, self.at, self.started
        return other

    def byte(self, c: int) -> int:
        tag, text = self.tag, self.text
        at = self.at + 1 if self.at >= 0 and tag[self.at] == c else -1
        if text is not None:
            if at < 0 and c == tag[0] and text.is_done:
                at = 1
            if not self.started and c == 0x0A:
                pass  # the newline after the opening tag, which the reader strips
            elif not text.feed(bytes((c,))):
                text = None
        self.started = True
        if at == len(tag):
            return 1
        if text is None and at < 0:
            return -1
        self.text, self.at = text, at
        return 0
