"""Grammars of other notations as GBNF text (engine/gbnf.py), so that the sampler can hold to
them what it holds to llama.cpp's grammars: a Responses API custom tool's input (its format's
`syntax` "regex" or "lark") and a JSON schema's `pattern`.

- `regex_to_gbnf(pattern, search=...)`: a regular expression in the common subset of Python's
  `re` and ECMAScript: literals and escapes (`\\n \\r \\t \\f \\v \\0 \\xHH \\uHHHH \\u{H...}`,
  escaped punctuation), `\\d \\w \\s` and their negations (ASCII digits, word characters
  `[A-Za-z0-9_]` and whitespace), `.` (any character but a newline), classes with ranges and
  negation, groups (`( )`, `(?: )`, named), alternation, `* + ? {m} {m,} {m,n} {,n}` (lazy
  and possessive forms read alike: the language is the same), `^` / `$` (`\\A`, `\\Z`, `\\z`)
  at the ends of the whole pattern or of its top-level alternatives, and a leading `(?i)`
  (letters of either case) or `(?s)` (`.` takes newlines too). `search=False`: the strings
  the pattern matches whole (a custom tool's regex); `search=True`: the strings holding a
  match (JSON Schema's `pattern`, unanchored unless `^` / `$` say otherwise).
  Backreferences, lookarounds and `\\b` are not regular in this sense (or not at all) and
  are refused by name, as is anything else not listed.
- `lark_to_gbnf(text)`: a Lark grammar (lark's own notation, as OpenAI's custom tools use
  it), from its rule `start`: rules and terminals (`?rule`, `!rule`, `_rule`, `TERM.2`),
  alternatives on following lines after `|`, `"literal"i`, `"a".."z"`, `/regex/flags` (flags
  i, s), groups, `[optional]`, `? * +`, `~ n`, `~ n..m`, aliases `-> name` (dropped),
  `//` comments, `%import common.NAME [-> ALIAS]` and `%import common (A, B)` for the common
  library's usual terminals, and `%ignore` (the ignored terminals may come between any two
  items of a rule and around the whole text, never inside a terminal). Lark reads text with
  a lexer (each terminal's longest match) before its parser; what a sampler can hold is the
  context-free language of the rules over the terminals' texts, which is what this writes:
  a text it takes may, rarely, lex otherwise in lark. Templates, `%declare`, `%override`,
  `%extend` and left-recursive rules (gbnf refuses those) are refused by name.

Every failure is a GrammarError naming the construct and where it is."""
from __future__ import annotations

import ast
import re

from strata.engine.gbnf import MAX_CODE_POINT, MAX_GRAMMAR_BYTES, MAX_REPEAT, CharSet, GrammarError

_ANY = CharSet([(0, MAX_CODE_POINT)])
_NOT_NEWLINE = CharSet([(0x0A, 0x0A)]).complement()
_DIGIT = CharSet([(0x30, 0x39)])
_WORD = CharSet([(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)])
_SPACE = CharSet([(0x09, 0x0D), (0x20, 0x20)])
_SHORTHANDS = {"d": _DIGIT, "w": _WORD, "s": _SPACE, "D": _DIGIT.complement(),
               "W": _WORD.complement(), "S": _SPACE.complement()}
_CHAR_ESCAPES = {"n": 0x0A, "r": 0x0D, "t": 0x09, "f": 0x0C, "v": 0x0B, "0": 0x00, "a": 0x07}
_REFUSED_ESCAPES = {"b": "a word boundary \\b", "B": "a non-boundary \\B",
                    "G": "\\G", "k": "a named backreference \\k", "p": "a Unicode property \\p",
                    "P": "a Unicode property \\P", "N": "a named character \\N",
                    "c": "a control escape \\c"}


def _union(sets) -> CharSet:
    return CharSet([r for s in sets for r in s.ranges])


def _folded(chars: CharSet) -> CharSet:
    """`chars` with each ASCII letter's other case (the `i` flag)."""
    extra = []
    for lo, hi in chars.ranges:
        for a, b, shift in ((0x41, 0x5A, 0x20), (0x61, 0x7A, -0x20)):
            x, y = max(lo, a), min(hi, b)
            if x <= y:
                extra.append((x + shift, y + shift))
    return CharSet(list(chars.ranges) + extra) if extra else chars


# ---- writing GBNF ----------------------------------------------------------------------------
def _escaped(cp: int) -> str:
    if 0x20 <= cp < 0x7F and chr(cp) not in '"\\[]-^':
        return chr(cp)
    if cp <= 0xFF:
        return f"\\x{cp:02X}"
    if cp <= 0xFFFF:
        return f"\\u{cp:04X}"
    return f"\\U{cp:08X}"


def _single(chars: CharSet) -> int | None:
    """The one character `chars` takes, or None."""
    r = chars.ranges
    return r[0][0] if len(r) == 1 and r[0][0] == r[0][1] else None


def _literal_char(cp: int) -> str:
    return '\\"' if cp == 0x22 else "\\\\" if cp == 0x5C else _escaped(cp)


def _class_text(chars: CharSet) -> str:
    if not chars.ranges:
        raise GrammarError("grammar: a character class that takes no character")
    if chars.ranges == _ANY.ranges:
        return "."
    cp = _single(chars)
    if cp is not None:
        return '"' + _literal_char(cp) + '"'
    return "[" + "".join(_escaped(a) if a == b else f"{_escaped(a)}-{_escaped(b)}"
                         for a, b in chars.ranges) + "]"


# A parsed expression: ("set", CharSet) | ("seq", [expr]) | ("alt", [expr])
# | ("rep", expr, lo, hi or None) | ("ref", gbnf name)
def _text(expr) -> str:
    kind = expr[0]
    if kind == "set":
        return _class_text(expr[1])
    if kind == "ref":
        return expr[1]
    if kind == "seq":  # runs of single characters as one literal
        parts, run = [], ""
        for e in expr[1]:
            cp = _single(e[1]) if e[0] == "set" else None
            if cp is not None:
                run += _literal_char(cp)
                continue
            if run:
                parts.append(f'"{run}"')
                run = ""
            parts.append(_text(e))
        if run:
            parts.append(f'"{run}"')
        return " ".join(parts) if parts else '""'
    if kind == "alt":
        return "(" + " | ".join(_text(e) for e in expr[1]) + ")"
    _, inner, lo, hi = expr
    body = _text(inner)
    if inner[0] in ("seq", "rep"):
        body = f"({body})"
    if (lo, hi) == (0, None):
        return body + "*"
    if (lo, hi) == (1, None):
        return body + "+"
    if (lo, hi) == (0, 1):
        return body + "?"
    if hi is None:
        return f"{body}{{{lo},}}"
    return f"{body}{{{lo}}}" if lo == hi else f"{body}{{{lo},{hi}}}"


def _checked_size(text: str) -> str:
    if len(text.encode()) > MAX_GRAMMAR_BYTES:
        raise GrammarError(f"grammar: {len(text.encode())} bytes once written as a grammar; at "
                           f"most {MAX_GRAMMAR_BYTES} are held")
    return text


# ---- regular expressions ---------------------------------------------------------------------
class _Regex:
    """Recursive descent over a pattern into the expressions above."""

    def __init__(self, pattern: str, flags: str = ""):
        self.p = pattern
        self.pos = 0
        self.fold = "i" in flags
        self.dotall = "s" in flags
        self.depth = 0

    def fail(self, what: str, pos: int | None = None):
        pos = self.pos if pos is None else pos
        raise GrammarError(f"regex: {what} at position {pos} of {self.p[:80]!r}")

    def peek(self, n: int = 1) -> str:
        return self.p[self.pos:self.pos + n]

    def parse_top(self) -> list[tuple[bool, bool, tuple]]:
        """The top-level alternatives: (anchored at the start, at the end, the expression)."""
        for flag in re.findall(r"\A\(\?([a-z]+)\)", self.p)[:1]:
            unknown = set(flag) - set("is")
            if unknown:
                self.fail(f"the inline flag {''.join(sorted(unknown))!r} (only i and s are "
                          "read)")
            self.fold = self.fold or "i" in flag
            self.dotall = self.dotall or "s" in flag
            self.pos = len(flag) + 3
        out = []
        while True:
            start = self.take_anchor(("^", "\\A"))
            items = self.sequence(top=True)
            end = self.take_anchor(("$", "\\Z", "\\z"))
            out.append((start, end, ("seq", items)))
            if self.peek() == "|":
                self.pos += 1
                continue
            if self.pos < len(self.p):
                self.fail(f"unexpected {self.peek()!r}" if self.peek() != ")" else
                          "a ')' that closes no group")
            return out

    def take_anchor(self, anchors) -> bool:
        for a in anchors:
            if self.p.startswith(a, self.pos):
                self.pos += len(a)
                return True
        return False

    def alternatives(self):
        alts = [("seq", self.sequence(top=False))]
        while self.peek() == "|":
            self.pos += 1
            alts.append(("seq", self.sequence(top=False)))
        return alts[0] if len(alts) == 1 else ("alt", alts)

    def sequence(self, top: bool) -> list:
        items = []
        while self.pos < len(self.p):
            c = self.peek()
            if c in "|)":
                break
            if c in "^$" or self.p.startswith(("\\A", "\\Z", "\\z"), self.pos):
                width = 1 if c in "^$" else 2
                is_end = c == "$" or self.p[self.pos + 1] in "Zz"
                if top and is_end and self.p[self.pos + width:self.pos + width + 1] in ("", "|"):
                    break  # parse_top takes it
                self.fail(f"the anchor {self.peek(width)!r} inside the pattern (anchors are "
                          "read only at its ends)")
            items.append(self.quantified(self.atom()))
        return items

    def atom(self):
        c = self.peek()
        if c == "(":
            return self.group()
        if c == "[":
            return ("set", self.char_class())
        if c == ".":
            self.pos += 1
            return ("set", _ANY if self.dotall else _NOT_NEWLINE)
        if c == "\\":
            got = self.escape(in_class=False)
            return ("set", self.folded(got))
        if c in "*+?":
            self.fail(f"{c!r} repeats nothing")
        if c == "{" and self.quantifier_at(self.pos):
            self.fail("'{' repeats nothing")
        self.pos += 1  # any other character, "]" and "{" included, is itself
        return ("set", self.folded(CharSet([(ord(c), ord(c))])))

    def folded(self, chars: CharSet) -> CharSet:
        return _folded(chars) if self.fold else chars

    def group(self):
        start = self.pos
        self.pos += 1
        if self.peek() == "?":
            head = self.p[self.pos:self.pos + 3]
            if head.startswith("?:"):
                self.pos += 2
            elif head.startswith(("?P<", "?<")) and not head.startswith(("?<=", "?<!")):
                end = self.p.find(">", self.pos)
                if end < 0:
                    self.fail("a group's name is not closed", start)
                self.pos = end + 1
            elif head.startswith(("?=", "?!", "?<=", "?<!")):
                self.fail("a lookaround (?=, ?!, ?<=, ?<!) (not held: no grammar says it)",
                          start)
            elif head.startswith("?P="):
                self.fail("a backreference (?P=name) (not held)", start)
            elif head.startswith("?#"):
                end = self.p.find(")", self.pos)
                if end < 0:
                    self.fail("a comment group is not closed", start)
                self.pos = end + 1
                return ("seq", [])
            else:
                self.fail(f"the group {('(' + head)!r} (only (...), (?:...) and named groups "
                          "are read; inline flags only at the very start)", start)
        self.depth += 1
        if self.depth > 100:
            self.fail("groups nested more than 100 deep", start)
        inner = self.alternatives()
        self.depth -= 1
        if self.peek() != ")":
            self.fail("a group is not closed", start)
        self.pos += 1
        return inner

    def escape(self, in_class: bool) -> CharSet:
        start = self.pos
        e = self.p[self.pos + 1:self.pos + 2]
        if not e:
            self.fail("a pattern ends in a backslash", start)
        self.pos += 2
        if e in _SHORTHANDS:
            return _SHORTHANDS[e]
        if e in _CHAR_ESCAPES and not (e == "0" and self.peek().isdigit()):
            return CharSet([(_CHAR_ESCAPES[e], _CHAR_ESCAPES[e])])
        if e == "b" and in_class:
            return CharSet([(0x08, 0x08)])
        if e in _REFUSED_ESCAPES:
            self.fail(f"{_REFUSED_ESCAPES[e]} (not held)", start)
        if e.isdigit():
            self.fail(f"a backreference \\{e} (not held)", start)
        if e in "xuU":
            if e == "u" and self.peek() == "{":
                end = self.p.find("}", self.pos)
                digits = self.p[self.pos + 1:end] if end > 0 else ""
                self.pos = end + 1
            else:
                n = {"x": 2, "u": 4, "U": 8}[e]
                digits = self.p[self.pos:self.pos + n]
                self.pos += n
            if not digits or not re.fullmatch(r"[0-9a-fA-F]+", digits) or len(digits) > 8 \
                    or int(digits, 16) > MAX_CODE_POINT:
                self.fail(f"\\{e} takes hex digits of a code point", start)
            cp = int(digits, 16)
            return CharSet([(cp, cp)])
        if e.isalnum():
            self.fail(f"the escape \\{e}", start)
        return CharSet([(ord(e), ord(e))])  # escaped punctuation: itself

    def char_class(self) -> CharSet:
        start = self.pos
        self.pos += 1
        negated = self.peek() == "^"
        if negated:
            self.pos += 1
        sets, first = [], True
        while True:
            c = self.peek()
            if not c:
                self.fail("a character class is not closed", start)
            if c == "]" and not first:
                break
            first = False
            if self.p.startswith("[:", self.pos):
                self.fail("a POSIX class [:name:]", self.pos)
            lo_set = self.escape(in_class=True) if c == "\\" else self.single()
            if self.peek() == "-" and self.p[self.pos + 1:self.pos + 2] not in ("]", ""):
                if len(lo_set.ranges) != 1 or lo_set.ranges[0][0] != lo_set.ranges[0][1]:
                    self.fail("a range from a class shorthand", self.pos)
                self.pos += 1
                hi_set = self.escape(in_class=True) if self.peek() == "\\" else self.single()
                if len(hi_set.ranges) != 1 or hi_set.ranges[0][0] != hi_set.ranges[0][1]:
                    self.fail("a range to a class shorthand", self.pos)
                lo, hi = lo_set.ranges[0][0], hi_set.ranges[0][0]
                if hi < lo:
                    self.fail("a range that ends below its start", start)
                sets.append(CharSet([(lo, hi)]))
            else:
                sets.append(lo_set)
        self.pos += 1
        chars = self.folded(_union(sets))
        return chars.complement() if negated else chars

    def single(self) -> CharSet:
        c = self.peek()
        self.pos += 1
        return CharSet([(ord(c), ord(c))])

    def quantifier_at(self, pos: int):
        return re.match(r"\{(\d*)(?:(,)(\d*))?\}", self.p[pos:])

    def quantified(self, expr):
        while True:
            c = self.peek()
            start = self.pos
            if c and c in "*+?":
                self.pos += 1
                lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
            elif c == "{" and self.quantifier_at(self.pos) and \
                    self.quantifier_at(self.pos).group(0) != "{}" and \
                    self.quantifier_at(self.pos).group(0) != "{,}":
                found = self.quantifier_at(self.pos)
                self.pos += len(found.group(0))
                lo = int(found.group(1) or 0)
                hi = (int(found.group(3)) if found.group(3) else None) if found.group(2) else lo
                if hi is not None and hi < lo:
                    self.fail("a repetition {m,n} with n below m", start)
                if max(lo, hi or 0) > MAX_REPEAT:
                    self.fail(f"a repetition beyond {MAX_REPEAT}", start)
            else:
                return expr
            if self.peek() in ("?", "+"):  # lazy, possessive: the same strings
                self.pos += 1
            if expr[0] == "rep":
                self.fail("a repetition of a repetition (put it in a group)", start)
            expr = ("rep", expr, lo, hi)


def _regex_expr(pattern: str, search: bool, flags: str = ""):
    """The expression of `pattern`'s strings (see regex_to_gbnf)."""
    alts = []
    for at_start, at_end, expr in _Regex(pattern, flags).parse_top():
        items = list(expr[1])
        if search and not at_start:
            items.insert(0, ("rep", ("set", _ANY), 0, None))
        if search and not at_end:
            items.append(("rep", ("set", _ANY), 0, None))
        alts.append(("seq", items))
    return alts[0] if len(alts) == 1 else ("alt", alts)


def regex_to_gbnf(pattern: str, *, search: bool = False, rule: str = "root") -> str:
    """GBNF text whose rule `rule` takes the strings `pattern` matches whole (`search`: the
    strings holding a match of it). GrammarError names what is not read."""
    if not isinstance(pattern, str):
        raise GrammarError(f"regex: expected a string, got {type(pattern).__name__}")
    return _checked_size(f"{rule} ::= {_text(_regex_expr(pattern, search))}\n")


# ---- Lark ------------------------------------------------------------------------------------
# Lark's common library's terminals, as what they take (written here from what they mean)
_FLOAT = r"[0-9]+[eE][+-]?[0-9]+|([0-9]+\.[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?"
_ANY_CHAR = r"[\s\S]"
_COMMON = {
    "LF": r"\n", "CR": r"\r", "NEWLINE": r"(\r?\n)+", "WS": r"[ \t\f\r\n]+",
    "WS_INLINE": r"[ \t]+", "DIGIT": r"[0-9]", "HEXDIGIT": r"[0-9a-fA-F]", "INT": r"[0-9]+",
    "SIGNED_INT": r"[+-]?[0-9]+", "DECIMAL": r"[0-9]+\.[0-9]*|\.[0-9]+",
    "_EXP": r"[eE][+-]?[0-9]+", "FLOAT": _FLOAT, "SIGNED_FLOAT": f"[+-]?({_FLOAT})",
    "NUMBER": f"{_FLOAT}|[0-9]+", "SIGNED_NUMBER": f"[+-]?({_FLOAT}|[0-9]+)",
    "LETTER": r"[A-Za-z]", "UCASE_LETTER": r"[A-Z]", "LCASE_LETTER": r"[a-z]",
    "WORD": r"[A-Za-z]+", "CNAME": r"[A-Za-z_][A-Za-z0-9_]*",
    "_STRING_INNER": f"{_ANY_CHAR}*", "_STRING_ESC_INNER": f'([^"\\\\]|\\\\{_ANY_CHAR})*',
    "ESCAPED_STRING": f'"([^"\\\\]|\\\\{_ANY_CHAR})*"', "SH_COMMENT": r"#[^\n]*",
    "CPP_COMMENT": r"//[^\n]*", "C_COMMENT": r"/\*([^*]|\*+[^*/])*\*+/",
}
_IGNORE = "lark-ignored"
_TOKEN = re.compile(r"""
    (?P<space>[ \t\f\r]+|\\\n)
  | (?P<newline>\n)
  | (?P<comment>//[^\n]*)
  | (?P<string>"(?:[^"\\\n]|\\.)*"i?)
  | (?P<regex>/(?:[^/\\\n]|\\.)+/[imslux]*)
  | (?P<arrow>->)
  | (?P<range>\.\.)
  | (?P<name>[_a-zA-Z][_a-zA-Z0-9]*)
  | (?P<number>[0-9]+)
  | (?P<directive>%[a-z]+)
  | (?P<op>[:|()\[\]?!*+~.,{}])
""", re.VERBOSE)


def _lark_tokens(text: str) -> list[tuple[str, str, int]]:
    """(kind, text, line) of each token; comments and blank space dropped, newlines kept."""
    out, pos, line = [], 0, 1
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            raise GrammarError(f"lark: unexpected {text[pos:pos + 20]!r} on line {line}")
        kind = m.lastgroup
        if kind not in ("space", "comment"):
            out.append((kind, m.group(), line))
        line += m.group().count("\n")
        pos = m.end()
    return out


def _lark_string(token: str, line: int):
    """A "literal" (with its i flag) as an expression."""
    fold = token.endswith("i")
    body = token[1:-2] if fold else token[1:-1]
    try:
        value = ast.literal_eval('"' + body + '"')
    except (SyntaxError, ValueError):
        raise GrammarError(f"lark: the literal {token} on line {line} is not a string") from None
    chars = [CharSet([(ord(c), ord(c))]) for c in value]
    return ("seq", [("set", _folded(s) if fold else s) for s in chars])


# In the Lark tree: ("term", expr) is a literal's or a regex's text (one token: nothing is
# ignored inside it), ("name", lark name) a reference


class _Lark:
    def __init__(self, text: str):
        self.tokens = _lark_tokens(text)
        self.pos = 0
        self.rules: dict[str, tuple] = {}   # Lark name -> expression
        self.lines: dict[str, int] = {}     # Lark name -> the line that defines it
        self.used: dict[str, int] = {}      # Lark name -> a line that uses it
        self.aliases: dict[str, str] = {}   # an imported terminal's name here -> common's
        self.ignored: list[str] = []
        self.depth = 0  # brackets open: newlines inside them are space

    def fail(self, what: str, line: int | None = None):
        if line is None:
            line = self.tokens[min(self.pos, len(self.tokens) - 1)][2] if self.tokens else 1
        raise GrammarError(f"lark: {what} on line {line}")

    def peek(self, kind: str | None = None, text: str | None = None) -> bool:
        while self.depth and self.pos < len(self.tokens) and self.tokens[self.pos][0] == "newline":
            self.pos += 1
        if self.pos >= len(self.tokens):
            return False
        k, t, _ = self.tokens[self.pos]
        return (kind is None or k == kind) and (text is None or t == text)

    def take(self):
        token = self.tokens[self.pos]
        self.pos += 1
        return token

    def skip_newlines(self) -> None:
        while self.peek("newline"):
            self.pos += 1

    def parse(self) -> None:
        while True:
            self.skip_newlines()
            if self.pos >= len(self.tokens):
                return
            kind, text, line = self.take()
            if kind == "directive":
                self.directive(text, line)
            elif kind == "name":
                self.definition(text, line)
            elif kind == "op" and text in "?!" and self.peek("name"):
                self.definition(self.take()[1], line)
            else:
                self.fail(f"expected a rule, a terminal or a directive, got {text!r}", line)

    def definition(self, name: str, line: int) -> None:
        if self.peek("op", "{"):
            self.fail(f"the template {name}{{...}} (templates are not read)", line)
        if self.peek("op", "."):  # a priority: NAME.2 or rule.2
            self.take()
            if not self.peek("number"):
                self.fail(f"a priority after {name}. that is not a number", line)
            self.take()
        if not self.peek("op", ":"):
            self.fail(f"expected ':' after {name!r}", line)
        self.take()
        if name in self.rules:
            self.fail(f"{name!r} is defined twice (first on line {self.lines[name]})", line)
        self.lines[name] = line
        self.rules[name] = self.expansions(top=True)

    def directive(self, word: str, line: int) -> None:
        if word == "%ignore":
            self.ignored.append(self.atom_line(line))
        elif word == "%import":
            self.import_(line)
        else:
            self.fail(f"the directive {word} (only %import and %ignore are read)", line)
        if self.pos < len(self.tokens) and not self.peek("newline"):
            self.fail(f"unexpected {self.tokens[self.pos][1]!r} after {word}", line)

    def atom_line(self, line: int):
        expr = self.expansions(top=True)
        name = f"{_IGNORE}-{len(self.ignored)}"
        self.rules[name] = expr
        self.lines[name] = line
        return name

    def import_(self, line: int) -> None:
        if not (self.peek("name") and self.tokens[self.pos][1] == "common"):
            self.fail("an %import from outside lark's common library", line)
        self.take()
        names = []
        if self.peek("op", "."):
            self.take()
            if not self.peek("name"):
                self.fail("%import common. without a name", line)
            names.append(self.take()[1])
            alias = names[0]
            if self.peek("arrow"):
                self.take()
                alias = self.take()[1]
            pairs = [(names[0], alias)]
        elif self.peek("op", "("):
            self.take()
            pairs = []
            while not self.peek("op", ")"):
                if not self.peek("name"):
                    self.fail("expected a name in %import common (...)", line)
                n = self.take()[1]
                pairs.append((n, n))
                if self.peek("op", ","):
                    self.take()
            self.take()
        else:
            self.fail("expected %import common.NAME or %import common (A, B)", line)
        for name, alias in pairs:
            if name not in _COMMON:
                self.fail(f"common.{name} (the terminals read are "
                          f"{', '.join(sorted(k for k in _COMMON if not k.startswith('_')))})",
                          line)
            if alias in self.rules:
                self.fail(f"{alias!r} is defined twice", line)
            self.rules[alias] = ("term", _regex_expr(_COMMON[name], search=False))
            self.lines[alias] = line

    def expansions(self, top: bool):
        """Alternatives up to the end of the definition (top: a later line starting with `|`
        goes on) or to the closing bracket."""
        alts = [self.alternative()]
        while True:
            if top:
                save = self.pos
                self.skip_newlines()
                if not self.peek("op", "|"):
                    self.pos = save
                    break
            elif not self.peek("op", "|"):
                break
            self.take()
            alts.append(self.alternative())
        return alts[0] if len(alts) == 1 else ("alt", alts)

    def alternative(self):
        items = []
        while True:
            if self.peek("arrow"):  # an alias names the tree's node: nothing to hold
                self.take()
                if not self.peek("name"):
                    self.fail("'->' without a name")
                self.take()
                break
            item = self.item()
            if item is None:
                break
            items.append(item)
        return ("seq", items)

    def item(self):
        atom = self.atom()
        if atom is None:
            return None
        while True:
            if self.peek("op") and self.tokens[self.pos][1] in "?*+":
                op = self.take()[1]
                atom = ("rep", atom, *{"?": (0, 1), "*": (0, None), "+": (1, None)}[op])
            elif self.peek("op", "~"):
                line = self.take()[2]
                if not self.peek("number"):
                    self.fail("'~' without a count", line)
                lo = int(self.take()[1])
                hi = lo
                if self.peek("range"):
                    self.take()
                    if not self.peek("number"):
                        self.fail("'~ n..' without its end", line)
                    hi = int(self.take()[1])
                if hi < lo or hi > MAX_REPEAT:
                    self.fail(f"the repetition ~ {lo}..{hi} (at most {MAX_REPEAT}, the end not "
                              "below the start)", line)
                atom = ("rep", atom, lo, hi)
            else:
                return atom

    def atom(self):
        if not self.peek():
            return None
        kind, text, line = self.tokens[self.pos]
        if kind == "string":
            self.take()
            expr = _lark_string(text, line)
            if self.peek("range"):  # "a".."z"
                self.take()
                if not self.peek("string"):
                    self.fail("'..' without its end literal", line)
                end = _lark_string(self.take()[1], line)
                if len(expr[1]) != 1 or len(end[1]) != 1:
                    self.fail("a range between literals of more than one character", line)
                lo, hi = expr[1][0][1].ranges[0][0], end[1][0][1].ranges[0][0]
                if hi < lo:
                    self.fail("a range that ends below its start", line)
                return ("term", ("set", CharSet([(lo, hi)])))
            return ("term", expr)
        if kind == "regex":
            self.take()
            end = text.rindex("/")
            flags = text[end + 1:]
            if set(flags) - set("is"):
                self.fail(f"the regex flags {flags!r} (only i and s are read)", line)
            try:
                return ("term", _regex_expr(text[1:end].replace("\\/", "/"), search=False,
                                            flags=flags))
            except GrammarError as exc:
                raise GrammarError(f"lark: line {line}: {exc}") from None
        if kind == "name":
            self.take()
            if self.peek("op", "{"):
                self.fail(f"the template use {text}{{...}} (templates are not read)", line)
            self.used.setdefault(text, line)
            return ("name", text)
        if kind == "op" and text in "([":
            self.take()
            self.depth += 1
            inner = self.expansions(top=False)
            close = ")" if text == "(" else "]"
            if not self.peek("op", close):
                self.fail(f"'{text}' is not closed", line)
            self.depth -= 1
            self.take()
            return inner if text == "(" else ("rep", inner, 0, 1)
        return None


def _gbnf_name(name: str) -> str:
    return ("t-" if name.lstrip("_")[:1].isupper() else "r-") + name


def lark_to_gbnf(text: str) -> str:
    """GBNF text (rule `root`) for the Lark grammar `text`, from its rule `start` (see the
    module's docstring for what is read). GrammarError names what is not."""
    if not isinstance(text, str):
        raise GrammarError(f"lark: expected the grammar's text, got {type(text).__name__}")
    lark = _Lark(text)
    lark.parse()
    if "start" not in lark.rules:
        raise GrammarError("lark: no rule 'start' (the text starts at 'start: ...')")
    for name, line in lark.used.items():
        if name not in lark.rules:
            raise GrammarError(f"lark: {name!r} is used on line {line} but not defined")
    ignore = ("ref", _IGNORE) if lark.ignored else None
    lines = []
    if ignore:
        lines.append(f"{_IGNORE} ::= ({' | '.join(_gbnf_name(n) for n in lark.ignored)})*")
        lines.append(f"root ::= {_IGNORE} {_gbnf_name('start')} {_IGNORE}")
    else:
        lines.append(f"root ::= {_gbnf_name('start')}")
    for name, expr in lark.rules.items():
        is_rule = not name.lstrip("_")[:1].isupper() and not name.startswith(_IGNORE)
        body = _resolved(expr, ignore if is_rule else None)
        lines.append(f"{_gbnf_name(name)} ::= {_text(body)}")
    return _checked_size("\n".join(lines) + "\n")


def _resolved(expr, ignore):
    """`expr` with Lark names as GBNF references and, in a rule (`ignore` given), the ignored
    terminals allowed between any two of its items."""
    kind = expr[0]
    if kind == "name":
        return ("ref", _gbnf_name(expr[1]))
    if kind == "term":
        return expr[1]
    if kind == "alt":
        return ("alt", [_resolved(e, ignore) for e in expr[1]])
    if kind == "seq":
        items = [_resolved(e, ignore) for e in expr[1]]
        if ignore and len(items) > 1:
            spaced = [items[0]]
            for item in items[1:]:
                spaced += [ignore, item]
            items = spaced
        return ("seq", items)
    _, inner, lo, hi = expr
    inner = _resolved(inner, ignore)
    if not ignore or hi == 1:  # (one at most: no gap between two)
        return ("rep", inner, lo, hi)
    # x+ with gaps: x (ignored x)*; x~m..n: x (ignored x){m-1,n-1}, optional when m is 0
    rest = ("rep", ("seq", [ignore, inner]), max(lo - 1, 0), None if hi is None else hi - 1)
    first = ("seq", [inner, rest])
    return first if lo >= 1 else ("rep", first, 0, 1)
