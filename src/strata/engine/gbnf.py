"""llama.cpp's GBNF grammars (the `grammar` field of llama-server's requests, `strata run
--grammar` / `--grammar-file`): `compile_grammar(text)` parses one into rules, and a
`GrammarRecognizer` reads the output's bytes and says whether they are still a prefix of a
sentence of the grammar (the sampler masks every token that would leave it).

The language, as llama.cpp's grammars write it (its grammars/README.md):
- `name ::= alternatives`, one rule per definition; `root` is where a sentence starts; a rule
  may continue over several lines; `#` starts a comment to the end of the line;
- alternatives separated by `|` (an empty one matches nothing), each a sequence of items;
- items: `"literal"`, a character class `[a-z_]` or `[^"\\\\]`, `.` (any character), a rule's
  name, a group `( ... )`, each optionally followed by `*`, `+`, `?`, `{m}`, `{m,}` or `{m,n}`;
- escapes in literals and classes: `\\n \\r \\t \\\\ \\" \\[ \\] \\- \\xHH \\uHHHH \\UHHHHHHHH`.
- token references: `<[id]>` (that token), `<text>` (the one token spelled so, e.g. `<think>`;
  text that is not exactly one token is refused by name), `!` before either (any one token but
  that one). A token item takes a whole token, whatever its bytes; with one in it a grammar
  describes the whole output, a reasoning block included, and a special token is produced
  only through a token item, never as characters.
Characters are Unicode code points, read from the output's UTF-8 (a token may end inside one).
A grammar that can reach a rule again without reading a character (left recursion) is
refused, as llama.cpp refuses it.

The recognizer is a set of stacks (as llama.cpp's is): each stack holds the positions in the
rules still to be matched, innermost last, its top a character class; an empty stack means a
sentence may end here. Reading a character keeps the stacks whose top matches it, advanced."""
from __future__ import annotations

import bisect
import functools

import numpy as np

from strata.errors import RequestError

MAX_GRAMMAR_BYTES = 64 * 1024
MAX_REPEAT = 1000           # the largest m or n of x{m,n} (each copy is a rule item)
MAX_STACKS = 4096           # a reading that leaves more stacks than this is refused
MAX_EXPANSION = 1 << 16     # stacks visited to expand one reading's stacks, then refused
MAX_ITEMS = 1 << 18         # items in all rules, repetitions written out
MAX_NESTING = 100           # groups inside groups (the parser recurses into each)
_CACHE_LIMIT = 1 << 16      # memoised steps per grammar, then the memo starts over
_CACHE_STACKS = 1 << 20     # stacks the memos of a grammar hold in all, then they start over
MAX_CODE_POINT = 0x10FFFF
_MISSING = object()
_UTF8_CLASSES = ((0, 0x7F), (0x80, 0x7FF), (0x800, 0xFFFF), (0x10000, MAX_CODE_POINT))


class GrammarError(RequestError):
    """A grammar that cannot be parsed or held; the message names the place and the cause."""


class CharSet:
    """The characters an item takes: sorted disjoint code point ranges (a negated class is
    stored as its complement)."""

    __slots__ = ("ranges",)

    def __init__(self, ranges):
        merged = []
        for lo, hi in sorted(ranges):
            if merged and lo <= merged[-1][1] + 1:
                merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
            else:
                merged.append((lo, hi))
        self.ranges = tuple(merged)

    def complement(self) -> "CharSet":
        out, start = [], 0
        for lo, hi in self.ranges:
            if lo > start:
                out.append((start, lo - 1))
            start = hi + 1
        if start <= MAX_CODE_POINT:
            out.append((start, MAX_CODE_POINT))
        return CharSet(out)

    def matches(self, cp: int) -> bool:
        for lo, hi in self.ranges:
            if cp < lo:
                return False
            if cp <= hi:
                return True
        return False

    def meets(self, lo: int, hi: int) -> bool:
        """Whether some character in [lo, hi] is in the set."""
        return any(a <= hi and lo <= b for a, b in self.ranges)

    def mark_first_bytes(self, out: np.ndarray) -> None:
        """Set out[b] for every first byte of the UTF-8 of a character in the set."""
        for a, b in self.ranges:
            for c_lo, c_hi in _UTF8_CLASSES:
                lo, hi = max(a, c_lo), min(b, c_hi)
                if lo <= hi:
                    out[_lead_byte(lo):_lead_byte(hi) + 1] = True


class TokenRef:
    """A token item: `token` (an id; None until `Grammar.bound` resolves `text`) or, negated,
    any one token but it. It reads no characters (a stack with it on top is dropped by a
    character) and takes a token whole at a token's start."""

    __slots__ = ("token", "text", "negated")

    def __init__(self, token: int | None, text: str | None, negated: bool):
        self.token, self.text, self.negated = token, text, negated

    def takes(self, token: int) -> bool:
        return (token == self.token) != self.negated

    def matches(self, cp: int) -> bool:
        return False

    def meets(self, lo: int, hi: int) -> bool:
        return False

    def mark_first_bytes(self, out: np.ndarray) -> None:
        pass


def _lead_byte(cp: int) -> int:
    return chr(cp).encode("utf-8", "surrogatepass")[0]


class Grammar:
    """Compiled rules: rules[r] is a list of alternatives, each a tuple of items (an int: a
    rule's index; a CharSet: one character). `root` is the start rule's index, `names` each
    rule's name (generated ones for groups and repetitions)."""

    def __init__(self, rules, names, root: int, text: str):
        self.rules = rules
        self.names = names
        self.root = root
        self.text = text
        self._expanded: dict = {}
        self._steps: dict = {}
        self._token_steps: dict = {}
        self._indexes: dict = {}  # state -> its index (see `index`)
        self._states: dict = {}   # each state the memos hold, once
        self._bound: dict = {}
        self._cached_stacks = 0  # stacks the three memos hold
        self.has_tokens = any(isinstance(item, TokenRef)
                              for alts in rules for alt in alts for item in alt)
        start = self._expand_all([((root, k, 0),) for k in range(len(rules[root]))])
        if start is None:
            raise GrammarError(
                f"grammar: 'root' can start in more than {MAX_STACKS} ways at once (rules "
                "whose alternatives each lead to other rules with several alternatives multiply "
                "them); factor the shared parts out so that fewer ways stay open")
        self.start = start

    def bound(self, tokenizer) -> "Grammar":
        """This grammar with its `<text>` items resolved to `tokenizer`'s ids (itself when it
        has none); GrammarError naming an item that is not exactly one token."""
        if not self.has_tokens:
            return self
        got = self._bound.get(id(tokenizer))
        if got is not None and got[0] is tokenizer:
            return got[1]

        def resolve(item):
            if not isinstance(item, TokenRef) or item.token is not None:
                return item
            token = tokenizer.token_id(item.text)
            if token is None:
                ids = tokenizer.encode(item.text, add_special=False)
                if len(ids) != 1:
                    raise GrammarError(f"the grammar's token reference {item.text} is not one "
                                       f"token of this model's vocabulary (it reads as "
                                       f"{len(ids)}); name the token by id: <[ID]>")
                token = ids[0]
            return TokenRef(int(token), item.text, item.negated)

        rules = [[tuple(resolve(item) for item in alt) for alt in alts] for alts in self.rules]
        vocab = getattr(tokenizer, "vocab_size", None)
        for alts in rules:
            for alt in alts:
                for item in alt:
                    if isinstance(item, TokenRef) and vocab is not None \
                            and not 0 <= item.token < vocab:
                        raise GrammarError(f"the grammar's token reference <[{item.token}]> is "
                                           f"outside this model's vocabulary [0, {vocab})")
        grammar = Grammar(rules, self.names, self.root, self.text)
        if len(self._bound) > 8:
            self._bound.clear()
        self._bound[id(tokenizer)] = (tokenizer, grammar)
        return grammar

    def recognizer(self) -> "GrammarRecognizer":
        return GrammarRecognizer(self)

    # ---- the stacks -------------------------------------------------------------------------
    def _expand(self, stack: tuple, budget: int) -> tuple[frozenset, int] | None:
        """(the stacks `stack` stands for with a CharSet or TokenRef on top, or empty: the
        sentence may end; the stacks visited to find them): finished alternatives popped,
        rules on top replaced by their alternatives. None when that visits more than `budget`
        stacks or leaves more than MAX_STACKS (a grammar can multiply its ways without end:
        rules of two alternatives, each naming the next)."""
        done = self._expanded.get(stack, _MISSING)
        if done is not _MISSING:
            return None if done is None or done[1] > budget else done
        out, seen, todo = [], set(), [stack]
        rules = self.rules
        while todo:
            st = todo.pop()
            if st in seen:
                continue
            seen.add(st)
            if len(out) > MAX_STACKS or len(seen) > budget:
                if len(out) > MAX_STACKS or budget == MAX_EXPANSION:  # whatever the budget
                    self._remember(self._expanded, stack, None, 0)
                return None
            if not st:
                out.append(st)
                continue
            r, a, p = st[-1]
            alt = rules[r][a]
            if p == len(alt):  # this alternative is read: back to what follows it
                todo.append(st[:-1])
                continue
            item = alt[p]
            if isinstance(item, (CharSet, TokenRef)):
                out.append(st)
                continue
            # a rule: what follows it stays below (dropped when nothing does: right
            # recursion, as in x*, keeps the stack flat), its alternatives on top
            rest = st[:-1] + ((r, a, p + 1),) if p + 1 < len(alt) else st[:-1]
            for k in range(len(rules[item])):
                todo.append(rest + ((item, k, 0),))
        result = (self._interned(frozenset(out)), len(seen))
        self._remember(self._expanded, stack, result, 0)
        return result

    def _expand_all(self, stacks) -> frozenset | None:
        """The union of the stacks' expansions; None (too ambiguous to follow) when they visit
        more than MAX_EXPANSION stacks in all or leave more than MAX_STACKS (counted the same
        whether the memo has them or not: the answer does not depend on what came before)."""
        parts, budget = [], MAX_EXPANSION
        for st in stacks:
            got = self._expand(st, budget)
            if got is None:
                return None
            budget -= got[1]
            parts.append(got[0])
        if len(parts) == 1:  # (one stack read the character: its expansion as it is)
            return parts[0]
        out = frozenset().union(*parts)
        return None if len(out) > MAX_STACKS else self._interned(out)

    def _interned(self, state: frozenset) -> frozenset:
        """The one copy of `state` the memos hold (equal states are one object: a memo entry
        costs a reference, and a lookup compares by identity)."""
        got = self._states.get(state)
        if got is None:
            self._remember(self._states, state, state, len(state))
            got = state
        return got

    def _remember(self, memo: dict, key, result, num_stacks: int) -> None:
        """Keep a memoised result (of `num_stacks` stacks); every memo starts over past
        _CACHE_LIMIT entries in one or _CACHE_STACKS stacks in all (a grammar's memory stays
        bounded)."""
        if len(memo) > _CACHE_LIMIT or self._cached_stacks > _CACHE_STACKS:
            for each in (self._expanded, self._steps, self._token_steps, self._indexes,
                         self._states):
                each.clear()
            self._cached_stacks = 0
        memo[key] = result
        self._cached_stacks += num_stacks + 1

    def step(self, state: frozenset, cp: int) -> frozenset:
        """The stacks after reading character `cp` (empty: the output left the grammar)."""
        key = (state, cp)
        got = self._steps.get(key)
        if got is not None:
            return got
        singles, ranged, _, _ = self.index(state)
        advanced = [self._advanced(st) for st in singles.get(cp, ())]
        for chars, stacks in ranged:
            if chars.matches(cp):
                advanced.extend(self._advanced(st) for st in stacks)
        # too ambiguous to follow: refused rather than slow
        result = self._expand_all(advanced) or frozenset()
        self._remember(self._steps, key, result, 0)
        return result

    def step_token(self, state: frozenset, token: int) -> frozenset:
        """The stacks after a whole token read by token items (the stacks with one on top that
        takes `token`, advanced); empty when none does."""
        key = (state, token)
        got = self._token_steps.get(key)
        if got is not None:
            return got
        advanced = []
        for st in state:
            if st:
                top = self._top(st)
                if isinstance(top, TokenRef) and top.takes(token):
                    advanced.append(self._advanced(st))
        result = (self._expand_all(advanced) or frozenset()) if advanced else frozenset()
        self._remember(self._token_steps, key, result, 0)
        return result

    def index(self, state: frozenset) -> tuple:
        """`state`'s stacks by their top character item, so that a step looks at those that
        take the character only: (code point -> the stacks whose top is that one character,
        [(a CharSet, the stacks whose top is of its ranges)] for the others, the sorted code
        points of the first, bool [256]: the first bytes the tops take)."""
        got = self._indexes.get(state)
        if got is not None:
            return got
        singles, by_ranges = {}, {}
        first = np.zeros(256, dtype=bool)
        for st in state:
            if not st:
                continue
            top = self._top(st)
            if isinstance(top, TokenRef):
                continue
            lo, hi = top.ranges[0] if len(top.ranges) == 1 else (0, -1)
            if lo == hi:
                if lo not in singles:
                    singles[lo] = []
                    first[_lead_byte(lo)] = True
                singles[lo].append(st)
            else:
                if top.ranges not in by_ranges:
                    by_ranges[top.ranges] = (top, [])
                    top.mark_first_bytes(first)
                by_ranges[top.ranges][1].append(st)
        got = (singles, list(by_ranges.values()), sorted(singles), first)
        self._remember(self._indexes, state, got, len(state))
        return got

    def _advanced(self, stack: tuple) -> tuple:
        """`stack` past the item on its top; an alternative read to its end is popped here
        (what is below it always has an item left), so that the alternatives of one rule
        that end alike share the memo of what follows them."""
        r, a, p = stack[-1]
        if p + 1 == len(self.rules[r][a]):
            return stack[:-1]
        return stack[:-1] + ((r, a, p + 1),)

    def _top(self, stack: tuple):
        r, a, p = stack[-1]
        return self.rules[r][a][p]


class GrammarRecognizer:
    """Reads the output's bytes one at a time (`feed`); `copy()` is cheap, so a token can be
    tried on a copy. `is_done`: the output so far is a whole sentence; `can_continue`: it may
    also go on."""

    __slots__ = ("grammar", "state", "partial", "need")

    def __init__(self, grammar: Grammar):
        self.grammar = grammar
        self.state = grammar.start
        self.partial = b""  # the first bytes of a character not yet whole
        self.need = 0       # its continuation bytes still to come

    def copy(self) -> "GrammarRecognizer":
        other = GrammarRecognizer.__new__(GrammarRecognizer)
        other.grammar, other.state = self.grammar, self.state
        other.partial, other.need = self.partial, self.need
        return other

    @property
    def is_done(self) -> bool:
        return not self.partial and () in self.state

    @property
    def can_continue(self) -> bool:
        return any(self.state)

    def feed(self, data: bytes) -> bool:
        """Read `data`; False (and the recognizer left unusable) when it leaves the grammar."""
        for b in data:
            if not self._byte(b):
                return False
        return True

    @property
    def has_tokens(self) -> bool:
        return self.grammar.has_tokens

    def feed_token(self, token: int, data: bytes) -> bool:
        """Read one whole token: by the token items on top (at a character's boundary), and
        its bytes `data` by the character items (b"" for a special token: it is never read as
        characters). Both may go on, and the stacks are then both's, unless the bytes end
        inside a character: the token items' reading is kept then (one partial character is
        shared by all stacks). False (the recognizer left unusable) when neither can."""
        g = self.grammar
        by_token = g.step_token(self.state, token) if not self.need else frozenset()
        chars = self.copy()
        chars.state = frozenset(st for st in self.state
                                if st and not isinstance(g._top(st), TokenRef))
        by_chars = bool(data) and bool(chars.state) and chars.feed(data)
        if by_chars and (not by_token or not chars.need):
            self.state = chars.state | by_token
            self.partial, self.need = chars.partial, chars.need
            return True
        if by_token:
            self.state, self.partial, self.need = by_token, b"", 0
            return True
        return False

    def token_candidates(self) -> tuple[frozenset, bool]:
        """(the token ids the token items on top name, whether one of them is negated: then
        any token may be taken)."""
        ids, negated = set(), False
        if self.need:
            return frozenset(), False
        for st in self.state:
            if st:
                top = self.grammar._top(st)
                if isinstance(top, TokenRef):
                    negated = negated or top.negated
                    ids.add(top.token)
        return frozenset(ids), negated

    def _byte(self, b: int) -> bool:
        if self.need:
            if b & 0xC0 != 0x80:
                return False
            self.partial += bytes((b,))
            self.need -= 1
            if self.need:
                return self._partial_fits()
            try:
                cp = ord(self.partial.decode("utf-8"))
            except UnicodeDecodeError:  # overlong or a surrogate
                return False
            self.partial = b""
            return self._char(cp)
        if b < 0x80:
            return self._char(b)
        need = 1 if 0xC2 <= b <= 0xDF else 2 if 0xE0 <= b <= 0xEF else 3 if 0xF0 <= b <= 0xF4 \
            else 0
        if not need:
            return False
        self.partial, self.need = bytes((b,)), need
        return self._partial_fits()

    def _partial_fits(self) -> bool:
        """Whether some character that starts with the bytes read so far may come next."""
        lo = max(_decode_bits(self.partial + b"\x80" * self.need),  # no overlong forms
                 _UTF8_CLASSES[len(self.partial) + self.need - 1][0])
        hi = _decode_bits(self.partial + b"\xbf" * self.need)
        singles, ranged, points, _ = self.grammar.index(self.state)
        # an overlong start (b"\xf0\x8d") leaves lo above hi, and surrogates are no characters:
        # a start that only they could finish is refused now, not at its last byte
        for a, b in ((lo, min(hi, 0xD7FF)), (max(lo, 0xE000), hi)):
            at = bisect.bisect_left(points, a)
            if a <= b and ((at < len(points) and points[at] <= b) or any(
                    chars.meets(a, b) for chars, _ in ranged)):
                return True
        return False

    def _char(self, cp: int) -> bool:
        self.state = self.grammar.step(self.state, cp)
        return bool(self.state)

    def first_bytes(self) -> np.ndarray:
        """bool [256]: the bytes the next one may be."""
        out = np.zeros(256, dtype=bool)
        if self.need:  # inside a character: the continuation bytes that keep it possible
            out[0x80:0xC0] = [self.copy()._byte(b) for b in range(0x80, 0xC0)]
            return out
        return self.grammar.index(self.state)[3].copy()


def _decode_bits(data: bytes) -> int:
    """The code point UTF-8's bit layout gives `data` (no check for overlong forms)."""
    n = len(data)
    cp = data[0] & (0x7F >> n)
    for b in data[1:]:
        cp = (cp << 6) | (b & 0x3F)
    return cp


# ---- the parser -------------------------------------------------------------------------------
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_")
_SIMPLE_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "\\": "\\", '"': '"', "[": "[", "]": "]",
                   "-": "-", "/": "/", "'": "'", "^": "^"}
_HEX_ESCAPES = {"x": 2, "u": 4, "U": 8}


class _Parser:
    """Recursive descent over the grammar's text into `rules` (alternatives of items; a rule
    name is kept as a ("name", name, pos) item until compile_grammar turns it into the rule's
    index, since a rule may be used before its definition)."""

    def __init__(self, text: str):
        self.text = text
        self.pos = 0
        self.rules: list[list] = []
        self.names: list[str] = []
        self.defined: dict[str, int] = {}
        self.index: dict[str, int] = {}
        self.num_items = 0
        self.depth = 0  # groups open at pos

    # positions and errors
    def fail(self, message: str, pos: int | None = None):
        pos = self.pos if pos is None else pos
        line = self.text.count("\n", 0, pos) + 1
        col = pos - (self.text.rfind("\n", 0, pos) + 1) + 1
        near = self.text[pos:pos + 20].split("\n")[0]
        where = f"line {line}, column {col}" + (f" (at {near!r})" if near else " (at the end)")
        raise GrammarError(f"grammar: {message} at {where}")

    def peek(self, n: int = 1) -> str:
        return self.text[self.pos:self.pos + n]

    def skip_space(self) -> None:
        text = self.text
        while self.pos < len(text):
            c = text[self.pos]
            if c in " \t\r\n":
                self.pos += 1
            elif c == "#":
                end = text.find("\n", self.pos)
                self.pos = len(text) if end < 0 else end + 1
            else:
                break

    def name_at(self, pos: int) -> str:
        end = pos
        while end < len(self.text) and self.text[end] in _NAME_CHARS:
            end += 1
        return self.text[pos:end]

    def rule_index(self, name: str) -> int:
        if name not in self.index:
            self.index[name] = len(self.rules)
            self.rules.append(None)
            self.names.append(name)
        return self.index[name]

    def new_rule(self, base: str, alts: list) -> int:
        k = len(self.rules)
        self.rules.append(alts)
        self.names.append(f"{base}#{k}")  # '#' is no name character: a generated rule
        return k

    # the grammar
    def parse(self) -> None:
        self.skip_space()
        while self.pos < len(self.text):
            start = self.pos
            name = self.name_at(self.pos)
            if not name:
                self.fail("expected a rule's name")
            self.pos += len(name)
            self.skip_space()
            if self.peek(3) != "::=":
                self.fail(f"expected '::=' after the rule name {name!r}")
            self.pos += 3
            if name in self.defined:
                self.fail(f"the rule {name!r} is defined twice", start)
            k = self.rule_index(name)
            self.defined[name] = start
            self.rules[k] = self.alternatives(name, nested=False)
            self.skip_space()

    def at_rule_start(self) -> bool:
        """Whether the text here starts the next rule's definition (`name ::=`)."""
        name = self.name_at(self.pos)
        if not name:
            return False
        save = self.pos
        self.pos += len(name)
        self.skip_space()
        is_def = self.peek(3) == "::="
        self.pos = save
        return is_def

    def alternatives(self, rule: str, nested: bool) -> list:
        alts = [self.sequence(rule, nested)]
        while self.peek() == "|":
            self.pos += 1
            alts.append(self.sequence(rule, nested))
        return alts

    def sequence(self, rule: str, nested: bool) -> tuple:
        items = []
        while True:
            self.skip_space()
            c = self.peek()
            if not c or c == "|" or (c == ")" and nested):
                break
            if c == ")":
                self.fail("unexpected ')'")
            if not nested and self.at_rule_start():
                break
            items.extend(self.repeated(rule, self.item(rule)))
        return tuple(items)

    def item(self, rule: str):
        c = self.peek()
        start = self.pos
        if c == '"':
            self.pos += 1
            chars = []
            while self.peek() != '"':
                if not self.peek():
                    self.fail("a literal is not closed", start)
                chars.append(self.char())
            self.pos += 1
            return [CharSet([(cp, cp)]) for cp in chars]
        if c == "[":
            return [self.char_class()]
        if c == ".":
            self.pos += 1
            return [CharSet([(0, MAX_CODE_POINT)])]
        if c == "(":
            if self.depth >= MAX_NESTING:
                self.fail(f"groups nest more than {MAX_NESTING} deep; name an inner group as "
                          "a rule of its own")
            self.pos += 1
            self.depth += 1
            alts = self.alternatives(rule, nested=True)
            self.depth -= 1
            self.skip_space()
            if self.peek() != ")":
                self.fail("a group is not closed", start)
            self.pos += 1
            return [self.new_rule(rule, alts)]
        if c in ("<", "!"):
            return [self.token_ref()]
        name = self.name_at(self.pos)
        if not name:
            self.fail(f"unexpected {c!r}")
        self.pos += len(name)
        return [("name", name, start)]

    def token_ref(self) -> TokenRef:
        """`<[id]>`, `<text>`, either after `!` (negated)."""
        start = self.pos
        negated = self.peek() == "!"
        if negated:
            self.pos += 1
        if self.peek() != "<":
            self.fail("'!' must be followed by a token reference <...>", start)
        self.pos += 1
        if self.peek() == "[":
            self.pos += 1
            digits = ""
            while self.peek().isdigit() and self.peek().isascii():
                digits += self.peek()
                self.pos += 1
            if not digits or self.peek(2) != "]>":
                self.fail("a token reference by id is <[ID]>, ID a number", start)
            self.pos += 2
            return TokenRef(int(digits), None, negated)
        end = self.text.find(">", self.pos)
        newline = self.text.find("\n", self.pos)
        if end < 0 or (0 <= newline < end) or end == self.pos:
            self.fail("a token reference <...> is not closed on its line", start)
        text = "<" + self.text[self.pos:end + 1]
        self.pos = end + 1
        return TokenRef(None, text, negated)

    def char(self) -> int:
        """One character of a literal or class, escapes resolved."""
        c = self.peek()
        if c != "\\":
            self.pos += 1
            return ord(c)
        start = self.pos
        e = self.text[self.pos + 1:self.pos + 2]
        if e in _SIMPLE_ESCAPES:
            self.pos += 2
            return ord(_SIMPLE_ESCAPES[e])
        if e in _HEX_ESCAPES:
            n = _HEX_ESCAPES[e]
            digits = self.text[self.pos + 2:self.pos + 2 + n]
            if len(digits) != n or any(d not in "0123456789abcdefABCDEF" for d in digits):
                self.fail(f"\\{e} takes {n} hex digits", start)
            cp = int(digits, 16)
            if cp > MAX_CODE_POINT:
                self.fail(f"\\{e}{digits} is beyond Unicode", start)
            self.pos += 2 + n
            return cp
        self.fail(f"unknown escape '\\{e}'", start)

    def char_class(self) -> CharSet:
        start = self.pos
        self.pos += 1
        negated = self.peek() == "^"
        if negated:
            self.pos += 1
        ranges = []
        while self.peek() != "]":
            if not self.peek():
                self.fail("a character class is not closed", start)
            lo = self.char()
            hi = lo
            if self.peek() == "-" and self.text[self.pos + 1:self.pos + 2] not in ("]", ""):
                self.pos += 1
                hi = self.char()
                if hi < lo:
                    self.fail("a range ends below its start", start)
            ranges.append((lo, hi))
        self.pos += 1
        chars = CharSet(ranges)
        return chars.complement() if negated else chars

    def repeated(self, rule: str, items: list) -> list:
        """The items, under the repetition that follows them, if any."""
        c = self.peek()
        if c not in ("*", "+", "?", "{"):
            return items
        start = self.pos
        if c == "{":
            end = self.text.find("}", self.pos)
            body = self.text[self.pos + 1:end] if end > 0 else ""
            parts = body.split(",")
            try:
                if end < 0 or len(parts) > 2:
                    raise ValueError
                lo = int(parts[0])
                hi = lo if len(parts) == 1 else (None if not parts[1].strip()
                                                 else int(parts[1]))
            except ValueError:
                self.fail("a repetition is written {m}, {m,} or {m,n}", start)
            if lo < 0 or (hi is not None and hi < lo) or max(lo, hi or 0) > MAX_REPEAT:
                self.fail(f"a repetition's bounds must be 0 <= m <= n <= {MAX_REPEAT}", start)
            self.pos = end + 1
        else:
            self.pos += 1
            lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
        unit = tuple(items)
        self.num_items += len(unit) * (max(lo, hi or 0) + 1)
        if self.num_items > MAX_ITEMS:
            self.fail(f"the grammar's repetitions write out more than {MAX_ITEMS} items", start)
        out = list(unit) * lo
        if hi is None:  # x* = R ::= x R | ()
            k = self.new_rule(rule, [])
            self.rules[k] = [unit + (k,), ()]
            out.append(k)
        elif hi > lo:   # (n - m) nested optionals: R ::= x R' | (), innermost last
            inner = None
            for _ in range(hi - lo):
                k = self.new_rule(rule, [unit + ((inner,) if inner is not None else ()), ()])
                inner = k
            out.append(inner)
        return out


def compile_grammar(text: str) -> Grammar:
    """Parse and check a GBNF grammar; GrammarError names what is wrong and where."""
    if not isinstance(text, str):
        raise GrammarError(f"grammar: expected the grammar's text (a string), got "
                           f"{type(text).__name__}")
    if len(text.encode("utf-8", "surrogatepass")) > MAX_GRAMMAR_BYTES:
        raise GrammarError(f"grammar: {len(text)} characters; at most {MAX_GRAMMAR_BYTES} "
                           "bytes are accepted")
    p = _Parser(text)
    p.parse()
    if "root" not in p.defined:
        raise GrammarError("grammar: no 'root' rule (the sentence starts at 'root ::= ...')")
    for k, alts in enumerate(p.rules):  # names into rule indices
        if alts is None:
            continue
        resolved = []
        for alt in alts:
            items = []
            for item in alt:
                if isinstance(item, tuple) and item[0] == "name":
                    _, name, pos = item
                    if name not in p.defined:
                        p.fail(f"the rule {name!r} is used but not defined", pos)
                    items.append(p.index[name])
                else:
                    items.append(item)
            resolved.append(tuple(items))
        p.rules[k] = resolved
    _check_left_recursion(p.rules, p.names)
    return Grammar(p.rules, p.names, p.index["root"], text)


def _check_left_recursion(rules, names) -> None:
    """Refuse a rule that can reach itself before reading a character (the stacks would grow
    without end): an edge r -> s for each rule s that can come first in r, past nullable
    items."""
    nullable = [False] * len(rules)
    changed = True
    while changed:
        changed = False
        for r, alts in enumerate(rules):
            if not nullable[r] and any(all(isinstance(i, int) and nullable[i] for i in alt)
                                       for alt in alts):
                nullable[r] = changed = True
    firsts = []
    for alts in rules:
        edges = set()
        for alt in alts:
            for item in alt:
                if isinstance(item, (CharSet, TokenRef)):  # reads a character or a token
                    break
                edges.add(item)
                if not nullable[item]:
                    break
        firsts.append(edges)
    state = [0] * len(rules)  # 0 new, 1 on the path, 2 done
    for start in range(len(rules)):
        if state[start]:
            continue
        path = [(start, iter(firsts[start]))]
        state[start] = 1
        while path:
            r, it = path[-1]
            nxt = next(it, None)
            if nxt is None:
                state[r] = 2
                path.pop()
            elif state[nxt] == 1:
                who = names[nxt].split("#")[0]  # a group's or repetition's own rule
                raise GrammarError(
                    f"grammar: the rule {who!r} can reach itself before reading a character "
                    "(left recursion, or a repetition of something that can match nothing); "
                    "rewrite it to read a character first")
            elif state[nxt] == 0:
                state[nxt] = 1
                path.append((nxt, iter(firsts[nxt])))


@functools.lru_cache(maxsize=16)
def compiled_grammar(text: str) -> Grammar:
    """compile_grammar, kept for the last few grammars (an agent sends the same one with every
    request; the compiled one keeps its memo of steps)."""
    return compile_grammar(text)
