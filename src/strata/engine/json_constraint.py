"""Output held to one JSON object (OpenAI's `response_format` json_object and json_schema): a
byte-level recognizer of JSON's syntax (RFC 8259) that the sampler asks, token by token,
whether the token keeps the output a prefix of a JSON object. A refused token is masked and the
draw repeated (sampling.Sampler). A `<think>` block before the object is let through as the
model writes it. A json_schema's structure is held by json_schema.SchemaRecognizer, a subclass
through the hooks at the end of JsonRecognizer; the schema also reaches the model as an
instruction in the prompt (server/prompting.py)."""
from __future__ import annotations

import bisect

import numpy as np

WHITESPACE = frozenset(b" \t\n\r")
INDENT = frozenset(b" \t")
HEX = frozenset(b"0123456789abcdefABCDEF")
DIGITS = frozenset(b"0123456789")
ESCAPES = frozenset(b'"\\/bfnrt')
LITERALS = {ord("t"): b"true", ord("f"): b"false", ord("n"): b"null"}
# Whitespace between two tokens of JSON (as llama.cpp's JSON grammar has it): none, one space,
# or a newline and at most MAX_INDENT spaces or tabs. Enough for pretty-printed JSON, not for a
# model that would pad forever instead of closing the object. Before the "{" at most
# MAX_LEADING spaces or newlines (a reasoning model writes "\n\n" after its `</think>`); none
# after the "}": the answer is the object.
MAX_INDENT = 20
MAX_LEADING = 2
MAX_DEPTH = 128
THINK_OPEN, THINK_CLOSE = b"<think>", b"</think>"

# What the recognizer expects next.
START = 0         # whitespace, then the object's "{"
VALUE = 1         # a value (after ":" or an array's ",")
VALUE_OR_END = 2  # a value or "]" (after "[")
KEY = 3           # a string key (after an object's ",")
KEY_OR_END = 4    # a key or "}" (after "{")
COLON = 5
NEXT = 6          # "," or the container's closing bracket
STRING = 7
ESCAPE = 8        # after a backslash in a string
UNICODE = 9       # the 4 hex digits of a \u escape
NUMBER = 10
LITERAL = 11      # true, false, null
DONE = 12         # the object is closed: whitespace only

# Number states: which byte may come next; the ones marked can end the number.
N_SIGN, N_ZERO, N_INT, N_DOT, N_FRAC, N_EXP, N_EXP_SIGN, N_EXP_DIGITS = range(8)
NUMBER_ENDS = frozenset((N_ZERO, N_INT, N_FRAC, N_EXP_DIGITS))


class JsonRecognizer:
    """Reads bytes one at a time and says whether they are still a prefix of one JSON object
    (whitespace around it allowed). `copy()` is cheap, so a token can be tried on a copy.
    `is_any_value`: one JSON value of any kind instead of an object, after at most one space or
    one newline and its indent; it is done at its last byte (a number: at the byte after it,
    which the step then refuses, leaving the mode DONE)."""

    __slots__ = ("stack", "mode", "is_key", "left", "number", "literal", "at", "run")

    def __init__(self, is_any_value: bool = False):
        self.stack = bytearray()  # the open containers, b"{" or b"["
        self.mode = VALUE if is_any_value else START
        self.is_key = False       # the string being read is an object's key
        self.left = 0             # hex digits left in a \u escape
        self.number = N_SIGN
        self.literal = b""
        self.at = 0               # bytes of the literal read
        self.run = 0              # whitespace bytes in a row (the first is " " or a newline)

    def copy(self) -> "JsonRecognizer":
        other = self.__class__.__new__(self.__class__)
        other.stack = bytearray(self.stack)
        other.mode, other.is_key, other.left = self.mode, self.is_key, self.left
        other.number, other.literal, other.at, other.run = (self.number, self.literal,
                                                            self.at, self.run)
        return other

    @property
    def is_done(self) -> bool:
        """The object is complete."""
        return self.mode == DONE

    @property
    def can_continue(self) -> bool:
        """Whether more may follow: not once the object is complete."""
        return self.mode != DONE

    def first_bytes(self) -> np.ndarray:
        """bool [256]: the bytes that may come next (shared, do not write to it)."""
        key = (self.mode, self.stack[-1] if self.stack else 0, len(self.stack) >= MAX_DEPTH,
               self.is_key, self.left, self.number, self.literal, self.at, self.run)
        found = _FIRST_BYTES.get(key)
        if found is None:
            found = np.array([self.copy()._step(b) for b in range(256)])
            _FIRST_BYTES[key] = found
        return found

    @property
    def is_started(self) -> bool:
        return self.mode != START

    def feed(self, data: bytes) -> bool:
        """Read `data`; False (and a state to throw away) at the first byte that cannot follow."""
        for c in data:
            if not self._step(c):
                return False
        return True

    def _step(self, c: int) -> bool:
        mode = self.mode
        if mode == STRING:
            if c == 0x22:  # "
                if not self._string_end():
                    return False
                if self.is_key:
                    self.mode = COLON
                else:
                    self._value_done()
                return True
            if c == 0x5C:  # backslash
                self.mode = ESCAPE
                return self._string_byte(c)
            return c >= 0x20 and self._string_byte(c)  # no raw control bytes; UTF-8 passes
        if mode == ESCAPE:
            if c in ESCAPES:
                self.mode = STRING
                return self._string_byte(c)
            if c == ord("u"):
                self.mode, self.left = UNICODE, 4
                return self._string_byte(c)
            return False
        if mode == UNICODE:
            if c not in HEX or not self._string_byte(c):
                return False
            self.left -= 1
            if self.left == 0:
                self.mode = STRING
            return True
        if mode == NUMBER:
            if self._number_step(c):
                return True
            if self.number not in NUMBER_ENDS or not self._number_end():
                return False
            self._value_done()  # the byte ends the number: read it as what follows a value
            mode = self.mode
        elif mode == LITERAL:
            if c != self.literal[self.at]:
                return False
            self.at += 1
            if self.at == len(self.literal):
                self._value_done()
            return True
        if c in WHITESPACE:
            return self._whitespace(c, mode)
        self.run = 0
        if mode == START:
            return c == ord("{") and self._open(c, KEY_OR_END)
        if mode == VALUE or mode == VALUE_OR_END:
            if mode == VALUE_OR_END and c == ord("]"):
                return self._close()
            return self._start_value(c)
        if mode == KEY or mode == KEY_OR_END:
            if mode == KEY_OR_END and c == ord("}"):
                return self._close()
            if c == 0x22 and self._key_allowed():
                self.mode, self.is_key = STRING, True
                return True
            return False
        if mode == COLON:
            if c == ord(":"):
                self.mode = VALUE
                return True
            return False
        if mode == NEXT:
            is_object = self.stack[-1] == ord("{")
            if c == ord(","):
                self.mode = KEY if is_object else VALUE
                return self._comma_allowed(is_object)
            if c == (ord("}") if is_object else ord("]")):
                return self._close()
            return False
        return False  # DONE: only whitespace

    def _whitespace(self, c: int, mode: int) -> bool:
        if mode == START:
            self.run += 1
            return c in b" \n" and self.run <= MAX_LEADING
        if mode == DONE:
            return False
        if self.run == 0:
            self.run = 1 if c == ord(" ") else MAX_INDENT + 2 if c == ord("\n") else 0
            return self.run > 0
        if self.run == 1 or c not in INDENT:  # after one space, or a second newline
            return False
        self.run -= 1  # a newline's run counts down its indent
        return self.run > 1

    def _start_value(self, c: int) -> bool:
        if not self._value_allowed(c):
            return False
        if c == ord("{"):
            return self._open(c, KEY_OR_END)
        if c == ord("["):
            return self._open(c, VALUE_OR_END)
        if c == 0x22:
            self.mode, self.is_key = STRING, False
            return True
        if c == ord("-") or c in DIGITS:
            self.mode = NUMBER
            self.number = N_SIGN if c == ord("-") else N_ZERO if c == ord("0") else N_INT
            return True
        literal = LITERALS.get(c)
        if literal is not None:
            self.mode, self.literal, self.at = LITERAL, literal, 1
            return True
        return False

    def _number_step(self, c: int) -> bool:
        n, is_digit = self.number, c in DIGITS
        if not self._number_byte_allowed(c):
            return False
        if n == N_SIGN:
            if not is_digit:
                return False
            self.number = N_ZERO if c == ord("0") else N_INT
        elif n in (N_ZERO, N_INT, N_FRAC):
            if is_digit and n != N_ZERO:
                return True
            if c == ord(".") and n != N_FRAC:
                self.number = N_DOT
            elif c in b"eE":
                self.number = N_EXP
            else:
                return False
        elif n == N_DOT:
            if not is_digit:
                return False
            self.number = N_FRAC
        elif n == N_EXP:
            if c in b"+-":
                self.number = N_EXP_SIGN
            elif is_digit:
                self.number = N_EXP_DIGITS
            else:
                return False
        else:  # N_EXP_SIGN, N_EXP_DIGITS
            if not is_digit:
                return False
            self.number = N_EXP_DIGITS
        return True

    def _open(self, c: int, mode: int) -> bool:
        if len(self.stack) >= MAX_DEPTH:
            return False
        self.stack.append(c)
        self.mode = mode
        self._opened(c)
        return True

    def _close(self) -> bool:
        if not self._close_allowed():
            return False
        self.stack.pop()
        self._closed()
        self._value_done()
        return True

    # ---- hooks for a schema (json_schema.SchemaRecognizer); plain JSON allows everything ----
    def _string_byte(self, c: int) -> bool:
        return True

    def _string_end(self) -> bool:
        return True

    def _key_allowed(self) -> bool:
        return True

    def _value_allowed(self, c: int) -> bool:
        return True

    def _number_byte_allowed(self, c: int) -> bool:
        return True

    def _number_end(self) -> bool:
        return True

    def _comma_allowed(self, is_object: bool) -> bool:
        return True

    def _close_allowed(self) -> bool:
        return True

    def _opened(self, c: int) -> None:
        pass

    def _closed(self) -> None:
        pass

    def _value_done(self) -> None:
        self.mode = NEXT if self.stack else DONE


_FIRST_BYTES: dict[tuple, np.ndarray] = {}  # JsonRecognizer.first_bytes by state: a few hundred


def spelled_ids(tokenizer, data: bytes, is_prefix: bool = False) -> list[int]:
    """The ids spelled exactly `data` (`is_prefix`: spelled `data` and maybe more), in the
    prefix tree's order: a vocabulary may spell `<think>` twice (its added token and a plain
    one), and the model may write either. A bisection of the vocabulary's prefix tree (made
    once per tokenizer)."""
    order, spelling = tokenizer.prefix_tree().order, tokenizer.token_bytes
    at = bisect.bisect_left(range(order.shape[0]), data, key=lambda p: spelling(int(order[p])))
    out = []
    while at < order.shape[0]:
        spelled = spelling(int(order[at]))
        if not (spelled.startswith(data) if is_prefix else spelled == data):
            break
        out.append(int(order[at]))
        at += 1
    return out


def opens_reasoning(tokenizer, prompt_tokens, tail: int = 4096) -> bool:
    """Whether the prompt leaves a `<think>` open where the answer starts (a reasoning model's
    template opens one after the assistant's turn start, or a prefill does), so the output
    starts in reasoning. Only the text after the prompt's last special token counts (at most
    `tail` tokens): a `<think>` in a message (a user's question about the tags, a tool result
    holding code) is followed by its turn's end, and must not turn the answer into reasoning."""
    special = tokenizer.special_ids
    tokens = prompt_tokens[-tail:]
    start = len(tokens)
    while start > 0:
        token = int(tokens[start - 1])
        if token in special and tokenizer.token_bytes(token) not in (THINK_OPEN, THINK_CLOSE):
            break
        start -= 1
    text = b"".join(tokenizer.token_bytes(int(t)) for t in tokens[start:])
    return text.rfind(THINK_OPEN) > text.rfind(THINK_CLOSE)


class ThinkingLead:
    """A reasoning model's `<think>` ... `</think>` block before the held text: its `<think>` as
    the first token, or the output starts inside one (`starts_in_reasoning`). Inside it any
    token but a special one passes; the bytes after `</think>` are the held text's. The close
    is found in the text, as the output parser finds it: spelled in pieces (`</`, `think`,
    `>`) it ends the block too."""

    def __init__(self, starts_in_reasoning: bool = False):
        self.is_thinking = starts_in_reasoning
        self.is_first = not starts_in_reasoning  # nothing taken yet: a <think> may open
        self._tail = b""  # the block's last bytes: a close may end in the next token

    def _close_end(self, data: bytes) -> int:
        """Where in `data` the block's `</think>` ends (with the bytes before it), or -1."""
        at = (self._tail + data).find(THINK_CLOSE)
        return -1 if at < 0 else at + len(THINK_CLOSE) - len(self._tail)

    def allows(self, token: int, data: bytes, special, rest_ok) -> bool | None:
        """Whether the block takes the token (`rest_ok(bytes)`: whether the held text may start
        with what follows `</think>`), or None when the token is the held text's to decide."""
        if self.is_thinking:
            return self._block_takes(token, data, special, rest_ok)
        if self.is_first and data.startswith(THINK_OPEN):
            # a token spelled `<think>` and more (`<think>\n`) opens the block as the output
            # parser reads it: what follows the tag is the block's
            rest = data[len(THINK_OPEN):]
            return not rest or self._block_takes(token, rest, special, rest_ok)
        return None

    def _block_takes(self, token: int, data: bytes, special, rest_ok) -> bool:
        end = self._close_end(data)
        return token not in special and (end < 0 or rest_ok(data[end:]))

    def take(self, data: bytes) -> bytes | None:
        """Push a token's bytes: those the held text reads (after `</think>`), or None while
        the block takes them."""
        is_first, self.is_first = self.is_first, False
        if not self.is_thinking and is_first and data.startswith(THINK_OPEN):
            self.is_thinking, data = True, data[len(THINK_OPEN):]
        if self.is_thinking:
            end = self._close_end(data)
            if end < 0:
                self._tail = (self._tail + data)[1 - len(THINK_CLOSE):]
                return None
            self.is_thinking, self._tail = False, b""
            return data[end:]
        return data

    def think_ids(self, tokenizer) -> list[int]:
        """The ids spelled `<think>` (and maybe more) while one may open the block (each opens
        it: the text is what the output parser reads)."""
        return spelled_ids(tokenizer, THINK_OPEN, is_prefix=True) if self.is_first else []


class TextConstraint:
    """Which tokens may come next so that the output's bytes stay accepted by `recognizer`
    (copy(), feed(bytes) -> bool, is_done, can_continue, first_bytes(): a JSON object's here,
    a GBNF grammar's in gbnf.py): `allows(token)` before the draw, `push(token)` once it is
    taken. A `<think>` ... `</think>` block may come first (its `<think>` as the first token, or
    the output starts inside one: `starts_in_reasoning`); the stop tokens are allowed only once
    the recognizer is done. Special tokens and tags (the tokenizer's added ones) never are,
    inside the held text."""

    def __init__(self, tokenizer, stop_ids, recognizer, starts_in_reasoning: bool = False,
                 reasoning_lead: bool = True):
        self._tokenizer = tokenizer
        self._stop_ids = frozenset(stop_ids)
        self._special = tokenizer.special_ids
        self._added = tokenizer.added_ids  # tags such as <tool_call>: never inside the text
        self.think = ThinkingLead(starts_in_reasoning)
        self.recognizer = recognizer
        # a GBNF grammar with token items (gbnf.TokenRef) reads whole tokens too, and it
        # describes the whole output: no reasoning block of its own before it; nor is there
        # one where the caller says the whole output is held (`reasoning_lead` False)
        self._by_token = bool(getattr(recognizer, "has_tokens", False))
        # (a thinking budget over it then forces nothing: its close would leave the language)
        self.holds_whole_output = self._by_token or not reasoning_lead
        if self.holds_whole_output:
            self.think.is_thinking = self.think.is_first = False

    @property
    def is_done(self) -> bool:
        return not self.think.is_thinking and self.recognizer.is_done

    def allows(self, token: int) -> bool:
        if token in self._stop_ids:
            return self.is_done
        data = self._tokenizer.token_bytes(token)
        decided = self.think.allows(token, data, self._special,
                                    lambda rest: self.recognizer.copy().feed(rest))
        if decided is not None:
            return decided
        if self._by_token:  # a special token only by a token item, never as characters
            plain = token not in self._added and token not in self._special
            return self.recognizer.copy().feed_token(token, data if plain else b"")
        if token in self._added or not data:
            return False
        return self.recognizer.copy().feed(data)

    def push(self, token: int) -> None:
        """Take `token` (one `allows` accepted)."""
        if token in self._stop_ids:
            return
        data = self.think.take(self._tokenizer.token_bytes(token))
        if data is not None and self._by_token:
            plain = token not in self._added and token not in self._special
            self.recognizer.feed_token(token, data if plain else b"")
        elif data is not None:
            self.recognizer.feed(data)

    def first_bytes(self) -> np.ndarray:
        """bool [256]: the bytes a token may start with now (inside reasoning: all)."""
        if self.think.is_thinking:
            return np.ones(256, dtype=bool)
        return self.recognizer.first_bytes()

    def candidates(self) -> np.ndarray:
        """Ids that may pass `allows`, by their first byte (a superset; ascending)."""
        stops = np.array(sorted(self._stop_ids), dtype=np.int64)
        if self.is_done and not self.recognizer.can_continue:  # only the end of the turn, or
            # a <think> block before it (a grammar of only the empty text)
            return np.union1d(stops, np.array(self.think.think_ids(self._tokenizer),
                                              dtype=np.int64))
        first = self._tokenizer.first_byte_table()  # [V] int16, -1 for an empty token
        # [257]: index -1, an empty token, is free reasoning's only (the held text refuses it)
        ok = np.append(self.first_bytes(), self.think.is_thinking)
        mask = ok[first]  # [V] (a mask, not a union of id arrays: that sorted 150k ids)
        mask[self.think.think_ids(self._tokenizer)] = True
        if self._by_token:  # the ids the token items on top name, or any (a negated one)
            ids, negated = self.recognizer.token_candidates()
            if negated:
                mask[:] = True
            for token in ids:
                if 0 <= token < len(mask):
                    mask[token] = True
        if self.is_done:  # the text may end here or go on
            mask[stops[stops < len(mask)]] = True
        return np.flatnonzero(mask)


class JsonObjectConstraint(TextConstraint):
    """The output is one JSON object (following `schema` where given, as json_schema.py holds
    it), after any `<think>` block."""

    def __init__(self, tokenizer, stop_ids, starts_in_reasoning: bool = False,
                 schema: dict | None = None, reasoning_lead: bool = True):
        if schema is None:
            recognizer = JsonRecognizer()
        else:  # the schema's structure too (json_schema.py says what is held)
            from strata.engine.json_schema import SchemaRecognizer, compile_schema

            recognizer = SchemaRecognizer(compile_schema(schema))
        super().__init__(tokenizer, stop_ids, recognizer, starts_in_reasoning, reasoning_lead)
