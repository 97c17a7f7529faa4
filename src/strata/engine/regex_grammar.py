"""Regular expressions (Python's / ECMA-262's common syntax) as GBNF text for engine/gbnf.py:
`regex_to_gbnf`. `\\d \\w \\s` have their ASCII meanings ([0-9], [A-Za-z0-9_],
[ \\t\\n\\v\\f\\r]); `.` is any character but `\\n`; the flags i, s, m, x and a (at the
pattern's start, or scoped: `(?i:...)`, `(?-i:...)`) are Python's, `(?i)` pairing letters as
Python's re does. Lazy quantifiers are the same language as greedy ones; possessive ones and
atomic groups only where they are too (their match forced: engine/regex_forced.py), else
refused. What is not regular (backreferences, lookarounds, word boundaries) is refused by name."""
from __future__ import annotations

import re
import unicodedata

from strata.engine.gbnf import (MAX_CODE_POINT, MAX_GRAMMAR_BYTES, MAX_NESTING, MAX_REPEAT,
                                CharSet, GrammarError, compiled_grammar)
from strata.engine.grammar_tree import (ANY, BRACES, CONTROL, NOT_NEWLINE, SHORTHANDS, Alt,
                                        Chars, Normal, Rep, Seq, Writer, checked, folded, one)
from strata.engine.regex_forced import Forced

_FLAGS = "aimsx"  # the inline flags read (u, L: Unicode classes, locale, are not held)
_FLAG_NAMES = {"u": "(?u) (Unicode \\d \\w \\s; they are ASCII here)",
               "L": "(?L) (locale-dependent matching)"}
_COMMENT = re.compile(r"\(\?#(?:[^\\)]|\\.)*\)", re.S)  # (escaped pairs, as re reads them)
_VERBOSE_SPACE = " \t\n\r\v\f"
_NEWLINE = CharSet([(10, 10)])


def _ascii_folded(chars: CharSet) -> CharSet:
    """`chars` with the other case of each ASCII letter in it ((?ai): re pairs only those)."""
    extra = [(max(lo, a) + shift, min(hi, b) + shift) for lo, hi in chars.ranges
             for a, b, shift in ((0x41, 0x5A, 32), (0x61, 0x7A, -32)) if lo <= b and a <= hi]
    return CharSet(chars.ranges + tuple(extra)) if extra else chars


# ---- regexes ----------------------------------------------------------------------------------
class _RegexReader:
    """Recursive descent over a pattern into (anchored at the start, tree, anchored at the end)
    for each top-level alternative; an anchor is True, False, or "line" ((?m)'s ^ and $)."""

    def __init__(self, pattern: str, where: str, flags: str = "", anchors: bool = True):
        self.p, self.pos, self.where, self.anchors, self.depth = pattern, 0, where, anchors, 0
        self.flags = frozenset(flags)
        self.atomic: list[tuple[object, str, int]] = []  # (node, what it is, where) to check
        self.lazy: set[Rep] = set()  # the lazy repetitions
        self.names: set[str] = set()

    def fail(self, what: str, pos: int | None = None):
        pos = self.pos if pos is None else pos
        shown = self.p if len(self.p) <= 80 else self.p[:77] + "..."
        raise GrammarError(f"{self.where} {shown!r}: {what} at position {pos}")

    def peek(self, n: int = 1) -> str:
        return self.p[self.pos:self.pos + n]

    def skip(self) -> None:
        """Past what re reads as nothing: (?#...), and under (?x) white space and # comments."""
        while True:
            if self.p.startswith("(?#", self.pos):
                m = _COMMENT.match(self.p, self.pos)
                if m is None:
                    self.fail("an unterminated comment '(?#'")
                self.pos = m.end()
            elif "x" in self.flags and self.peek() and self.peek() in _VERBOSE_SPACE:
                self.pos += 1
            elif "x" in self.flags and self.peek() == "#":
                end = self.p.find("\n", self.pos)
                self.pos = len(self.p) if end < 0 else end + 1
            else:
                return

    def flag_letters(self, letters: str, start: int, on: bool = True) -> frozenset:
        for flag in letters:
            if flag in _FLAG_NAMES:
                self.fail(f"the inline flag {_FLAG_NAMES[flag]} is not supported", start)
            if flag not in (_FLAGS if on else "imsx"):
                self.fail(f"the inline flag {flag!r} is not one re knows"
                          if on or flag not in _FLAGS else
                          f"the flag {flag!r} cannot be turned off", start)
        return frozenset(letters)

    def read(self) -> list[tuple[object, object, object]]:
        while True:  # flags for the whole pattern come first (re refuses them later)
            self.skip()
            m = re.compile(r"\(\?([a-zA-Z]+)\)").match(self.p, self.pos)
            if m is None:
                break
            self.flags |= self.flag_letters(m.group(1), self.pos)
            self.pos = m.end()
        alts = [self.sequence(top=True)]
        while self.peek() == "|":
            self.pos += 1
            alts.append(self.sequence(top=True))
        if self.peek() == ")":
            self.fail("unbalanced ')'")
        Forced(self).check(alts)
        return alts

    def alternatives(self):
        alts = [self.sequence(top=False)[1]]
        while self.peek() == "|":
            self.pos += 1
            alts.append(self.sequence(top=False)[1])
        return alts

    def sequence(self, top: bool):
        items, first, last = [], False, False
        while True:
            self.skip()
            c, start = self.peek(), self.pos
            if not c or c in "|)":
                break
            if c == "^" or self.peek(2) == "\\A":
                if not (top and self.anchors and not items and not first):
                    self.fail(f"the anchor {self.peek(1 if c == '^' else 2)!r} is only "
                              "supported at the start of the pattern or of a top-level "
                              "alternative")
                self.pos += 1 if c == "^" else 2
                first = "line" if c == "^" and "m" in self.flags else True
                continue
            if c == "$" or self.peek(2) in ("\\Z", "\\z"):
                self.pos += 1 if c == "$" else 2
                self.skip()
                if not (top and self.anchors) or self.peek() not in ("", "|"):
                    self.fail(f"the anchor {self.p[start:start + 1 + (c != '$')]!r} is only "
                              "supported at the end of the pattern or of a top-level "
                              "alternative", start)
                last = "line" if c == "$" and "m" in self.flags else True
                continue
            if c in "*+?" or (c == "{" and self.brace_at()):
                self.fail(f"nothing to repeat before {c!r}")
            items.append(self.quantified(self.atom()))
        return first, one(items, Seq), last

    def quantified(self, node):
        self.skip()
        start = self.pos
        got = self.quantifier()
        if got is None:
            return node
        node = Rep(node, *got)
        if self.peek() == "?":
            self.pos += 1
            self.lazy.add(node)
        elif self.peek() == "+":
            self.pos += 1
            self.atomic.append((node, f"the possessive quantifier {self.p[start:self.pos]!r}",
                                start))
        self.skip()
        if self.peek() and self.peek() in "*+?" or (self.peek() == "{" and self.brace_at()):
            self.fail("a quantifier follows another (multiple repeat)")
        return node

    def brace_at(self):
        m = BRACES.match(self.p, self.pos)
        return m if m and (m.group(1) or m.group(2) is not None) else None

    def quantifier(self):
        c, start = self.peek(), self.pos
        if c and c in "*+?":
            self.pos += 1
            return {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
        m = self.brace_at() if c == "{" else None
        if m is None:
            return None
        lo = int(m.group(1) or 0)
        hi = lo if m.group(2) is None else (int(m.group(3)) if m.group(3) else None)
        if hi is not None and hi < lo:
            self.fail(f"the repetition {m.group(0)} has its minimum over its maximum", start)
        if max(lo, hi or 0) > MAX_REPEAT:
            self.fail(f"the repetition {m.group(0)} is over {MAX_REPEAT}", start)
        self.pos = m.end()
        return lo, hi

    def fold(self, chars: CharSet) -> CharSet:
        if "i" not in self.flags:
            return chars
        return _ascii_folded(chars) if "a" in self.flags else folded(chars)

    def atom(self):
        c = self.peek()
        if c == "(":
            return self.group()
        if c == "[":
            return self.char_class()
        if c == ".":
            self.pos += 1
            return Chars(ANY if "s" in self.flags else NOT_NEWLINE)
        got = self.escape(in_class=False) if c == "\\" else None
        if isinstance(got, CharSet):
            return Chars(got)
        if got is None:
            self.pos += 1
            got = ord(c)
        return Chars(self.fold(CharSet([(got, got)])))

    def group(self):
        start, flags = self.pos, self.flags
        if self.depth >= MAX_NESTING:
            self.fail(f"groups nest more than {MAX_NESTING} deep")
        rest = self.p[self.pos + 1:]
        scoped = re.match(r"\?([a-zA-Z]*)(?:(-)([a-zA-Z]*))?:", rest)
        atomic = rest.startswith("?>")
        if not rest.startswith("?"):
            self.pos += 1
        elif scoped:
            on = self.flag_letters(scoped.group(1), start)
            off = self.flag_letters(scoped.group(3) or "", start, on=False)
            if scoped.group(2) and not off:
                self.fail("a flag is missing after '-' in the group "
                          f"{'(' + scoped.group(0)!r}", start)
            if on & off:
                self.fail(f"the group {'(' + scoped.group(0)!r} turns a flag on and off", start)
            self.flags = (flags | on) - off
            self.pos += 1 + scoped.end()
        elif atomic:
            self.pos += 3
        elif m := re.match(r"\?P?<(\w+)>", rest):
            if not m.group(1).isidentifier() or m.group(1) in self.names:
                self.fail(f"the group name {m.group(1)!r} is " + (
                    "used twice" if m.group(1) in self.names else "not an identifier"))
            self.names.add(m.group(1))
            self.pos += 1 + m.end()
        elif rest.startswith(("?=", "?!", "?<=", "?<!")):
            self.fail(f"lookarounds ({rest[:3].rstrip('(')}...) are not supported")
        elif rest.startswith("?P="):
            self.fail("backreferences ((?P=name)) are not supported")
        elif m := re.match(r"\?[a-zA-Z]+\)", rest):
            self.fail(f"the group {'(' + m.group(0)!r} sets flags for the whole pattern, so it "
                      "must come at the pattern's start (a part takes (?flags:...))")
        else:
            self.fail(f"the group {('(' + rest)[:4]!r}... is not supported (only (...), (?:...), "
                      "(?P<name>...), (?<name>...), (?>...), (?flags:...), and (?flags) at the "
                      "pattern's start)")
        self.depth += 1
        alts = self.alternatives()
        self.depth -= 1
        self.flags = flags
        if self.peek() != ")":
            self.fail("unbalanced '(' (the group is not closed)", start)
        self.pos += 1
        if len(alts) == 1 and isinstance(alts[0], Seq) and not alts[0].items:
            self.fail("an empty group", start)
        node = one(alts, Alt)
        if atomic:
            self.atomic.append((node, "the atomic group (?>...)", start))
        return node

    def char_class(self):
        start = self.pos
        self.pos += 1
        negated = self.peek() == "^"
        self.pos += negated
        if self.peek() == "]":
            self.fail("an empty class [] (write \\] for a ']' in a class)", start)
        ranges, shorthands = [], []
        while (c := self.peek()) != "]":
            if not c:
                self.fail("unbalanced '[' (the class is not closed)", start)
            if self.peek(2) == "[:":
                self.fail("POSIX classes ([:name:]) are not supported")
            lo = self.class_char()
            if isinstance(lo, CharSet):
                if self.peek() == "-" and self.p[self.pos + 1:self.pos + 2] not in ("]", ""):
                    self.fail("a range starts at a class shorthand")
                shorthands.extend(lo.ranges)
                continue
            if self.peek() == "-" and self.p[self.pos + 1:self.pos + 2] not in ("]", ""):
                dash = self.pos
                self.pos += 1
                hi = self.class_char()
                if isinstance(hi, CharSet):
                    self.fail("a range ends in a class shorthand", dash)
                if hi < lo:
                    self.fail(f"the range {chr(lo)!r}-{chr(hi)!r} ends below its start", dash)
                ranges.append((lo, hi))
            else:
                ranges.append((lo, lo))
        self.pos += 1
        chars = CharSet(self.fold(CharSet(ranges)).ranges + tuple(shorthands))
        return Chars(chars.complement() if negated else chars)

    def class_char(self):
        if self.peek() == "\\":
            return self.escape(in_class=True)
        self.pos += 1
        return ord(self.p[self.pos - 1])

    def escape(self, in_class: bool):
        """The escape at pos (read): a code point or a CharSet."""
        start = self.pos
        e = self.p[self.pos + 1:self.pos + 2]
        if not e:
            self.fail("the pattern ends in a lone backslash")
        self.pos += 2
        if e in SHORTHANDS:
            return SHORTHANDS[e]
        if e in CONTROL:
            return CONTROL[e]
        if e == "b" and in_class:
            return 8  # backspace
        if e in "bB":
            self.fail(f"word boundaries (\\{e}) are not supported", start)
        if e in "AZz":
            self.fail(f"the anchor \\{e} is only supported at the ends of the pattern", start)
        if e == "0":
            m = re.match(r"[0-7]{0,2}", self.p[self.pos:])
            self.pos += m.end()
            return int("0" + m.group(0), 8)
        if e in "123456789" or e == "k":
            self.fail(f"backreferences (\\{e}) are not supported", start)
        if e in "xuU":
            if e == "u" and self.peek() == "{":
                m = re.match(r"\{([0-9a-fA-F]{1,6})\}", self.p[self.pos:])
                n = m.end() if m else 0
                digits = m.group(1) if m else ""
            else:
                n = {"x": 2, "u": 4, "U": 8}[e]
                digits = self.p[self.pos:self.pos + n]
                if not re.fullmatch(r"[0-9a-fA-F]+", digits) or len(digits) != n:
                    digits = ""
            if not digits or int(digits, 16) > MAX_CODE_POINT:
                self.fail(f"the escape \\{e} needs its hex digits (of a Unicode code point)",
                          start)
            self.pos += n
            return int(digits, 16)
        if e == "N" and (m := re.match(r"\{([^}]*)\}", self.p[self.pos:])):
            try:
                cp = ord(unicodedata.lookup(m.group(1)))
            except KeyError:
                self.fail(f"no character is named {m.group(1)!r}", start)
            self.pos += m.end()
            return cp
        if e.isascii() and e.isalnum():
            self.fail(f"the escape \\{e} is not supported", start)
        return ord(e)


def regex_tree(pattern: str, where: str, flags: str, anchors: bool, search: bool = False):
    alts = _RegexReader(pattern, where, flags, anchors).read()
    if not search:
        return one((node for _, node, _ in alts), Alt)
    anywhere = Rep(Chars(ANY), 0, None)
    ends = {False: (anywhere,), True: (),  # "line": the text's end, or a newline
            "line": (Rep(Seq((anywhere, Chars(_NEWLINE))), 0, 1),)}

    def within(first, node, last):
        after = ends[last] if last != "line" else (Rep(Seq((Chars(_NEWLINE), anywhere)), 0, 1),)
        return Seq(ends[first] + (node,) + after)
    if len({(first, last) for first, _, last in alts}) == 1:
        return within(alts[0][0], one((node for _, node, _ in alts), Alt), alts[0][2])
    return Alt(within(*alt) for alt in alts)


def regex_to_gbnf(pattern: str, *, search: bool = False, rule: str = "root") -> str:
    """GBNF rules, `rule` first, for the strings `pattern` matches in full (`search`: the
    strings that contain a match, as JSON Schema's `pattern`; `^` / `$` anchor that end).
    GrammarError names a construct it cannot hold and its position in the pattern."""
    if not isinstance(pattern, str):
        raise GrammarError(f"regex: expected a string, got {type(pattern).__name__}")
    if len(pattern) > MAX_GRAMMAR_BYTES:
        raise GrammarError(f"regex: {len(pattern)} characters; at most {MAX_GRAMMAR_BYTES} "
                           "are accepted")
    tree = regex_tree(pattern, "regex", "", anchors=True, search=search)
    bodies = {rule: Normal({}).normal(tree)}
    text = checked(Writer(bodies).write(rule), f"regex {pattern[:80]!r}")
    if rule == "root":
        compiled_grammar(text)
    return text
