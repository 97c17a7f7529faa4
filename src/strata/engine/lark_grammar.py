"""Lark grammars (a Responses API custom tool's `grammar` format, as Codex's apply_patch) as
GBNF text for engine/gbnf.py: `lark_to_gbnf`.

The language is the context-free reading of the grammar: each terminal's strings (its regex
read in full, engine/regex_grammar.py), concatenated as the rules say, the %ignore'd
terminals allowed before each token of a rule and at the end of the text. Lark's lexer takes
one terminal's longest match at a time, so a grammar whose tokens can run into each other
(`NAME NAME` with no separator) is held to a larger language than Lark parses; that is what
a constrained sampler can hold. Common's lazy terminals (ESCAPED_STRING, C_COMMENT) are given
the language the lexer finds: the string ends at its first unescaped quote, the comment at
its first `*/`. Directly left-recursive rules (`sum: sum "+" term | term`) are rewritten as
repetitions; a rule that reaches itself otherwise before reading a character is refused by
name."""
from __future__ import annotations

import re

from strata.engine.gbnf import (MAX_CODE_POINT, MAX_GRAMMAR_BYTES, MAX_NESTING, MAX_REPEAT,
                                CharSet, GrammarError, compiled_grammar)
from strata.engine.grammar_tree import (Alt, Chars, Normal, Ref, Rep, Seq, Writer, checked,
                                        folded, one)
from strata.engine.regex_grammar import regex_tree


# ---- Lark -------------------------------------------------------------------------------------
# Lark's common library's terminals, written here from what they mean
_FLOAT = r"[0-9]+[eE][+-]?[0-9]+|([0-9]+\.[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?"
_NUMBER = r"([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+)?"
_COMMON = {
    "LF": r"\n", "CR": r"\r", "NEWLINE": r"(\r?\n)+", "WS": r"[ \t\f\r\n]+",
    "WS_INLINE": r"[ \t]+", "DIGIT": r"[0-9]", "HEXDIGIT": r"[0-9a-fA-F]", "INT": r"[0-9]+",
    "SIGNED_INT": r"[+-]?[0-9]+", "DECIMAL": r"[0-9]+\.[0-9]*|\.[0-9]+", "FLOAT": _FLOAT,
    "SIGNED_FLOAT": f"[+-]?({_FLOAT})", "NUMBER": _NUMBER, "SIGNED_NUMBER": f"[+-]?{_NUMBER}",
    "LETTER": r"[A-Za-z]", "UCASE_LETTER": r"[A-Z]", "LCASE_LETTER": r"[a-z]",
    "WORD": r"[A-Za-z]+", "CNAME": r"[A-Za-z_][A-Za-z0-9_]*",
    # a string's inside: no newline, not ending in an odd number of backslashes
    "_STRING_INNER": r".*", "_STRING_ESC_INNER": r"([^\\\n]|\\.)*",
    "ESCAPED_STRING": r'"([^"\\\n]|\\.)*"', "SH_COMMENT": r"#[^\n]*",
    "CPP_COMMENT": r"//[^\n]*", "C_COMMENT": r"/\*([^*]|\*+[^*/])*\*+/",
}
_IGNORED = "Ignored"  # (mixed case: no Lark name maps to it)
_LARK_NAME = re.compile(r"_*[a-z][_a-z0-9]*|_*[A-Z][_A-Z0-9]*")
_TOKEN = re.compile(r"""
    (?P<space>[ \t\f\r]+|\\\n)
  | (?P<newline>\n)
  | (?P<comment>//[^\n]*)
  | (?P<string>"(?:[^"\\\n]|\\.)*"i?)
  | (?P<regex>/(?:[^/\\\n]|\\.)+/[a-zA-Z]*)
  | (?P<arrow>->)
  | (?P<range>\.\.)
  | (?P<name>[_a-zA-Z][_a-zA-Z0-9]*)
  | (?P<number>-?[0-9]+)
  | (?P<directive>%[a-z]+)
  | (?P<op>[:|()\[\]?!*+~.,{}])
""", re.VERBOSE)
_STRING_ESCAPES = {"n": 10, "f": 12, "t": 9, "r": 13, "\\": 0x5C, '"': 0x22}


class _Name:
    """A Lark name where it is used (resolved once every definition is read)."""
    __slots__ = ("name", "line")

    def __init__(self, name: str, line: int):
        self.name, self.line = name, line


class _Token:
    """One token of a rule (a terminal, a literal, a regex): the ignored terminals may come
    before it."""
    __slots__ = ("node",)

    def __init__(self, node):
        self.node = node


def _gbnf_name(name: str) -> str:
    """GBNF names are [a-zA-Z0-9-]: '_' becomes '-' ('-' is no Lark name character, and case
    keeps rules and terminals apart); a rule `root` steps aside for GBNF's own."""
    name = name.replace("_", "-")
    return "root-X" if name == "root" else name


def _lark_tokens(text: str) -> list[tuple[str, str, int]]:
    """(kind, text, line) of each token; comments and blank space dropped, newlines kept."""
    out, pos, line = [], 0, 1
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            raise GrammarError(f"lark: unexpected {text[pos:pos + 20].split(chr(10))[0]!r} "
                               f"on line {line}")
        if m.lastgroup not in ("space", "comment"):
            out.append((m.lastgroup, m.group(), line))
        line += m.group().count("\n")
        pos = m.end()
    return out


def _lark_string(token: str, line: int) -> list[int]:
    """A "literal"'s code points, its escapes read as lark reads them (\\n \\f \\t \\r \\\\ \\"
    \\xHH \\uHHHH \\UHHHHHHHH; any other backslash is itself)."""
    body = token[1:-2] if token.endswith("i") else token[1:-1]
    out, i = [], 0
    while i < len(body):
        c, e = body[i], body[i + 1:i + 2]
        if c != "\\" or not e:
            out.append(ord(c))
            i += 1
        elif e in _STRING_ESCAPES:
            out.append(_STRING_ESCAPES[e])
            i += 2
        elif e in "xuU":
            n = {"x": 2, "u": 4, "U": 8}[e]
            digits = body[i + 2:i + 2 + n]
            if not re.fullmatch(f"[0-9a-fA-F]{{{n}}}", digits) or int(digits, 16) > MAX_CODE_POINT:
                raise GrammarError(f"lark: the escape \\{e} in {token} on line {line} needs "
                                   f"{n} hex digits of a code point")
            out.append(int(digits, 16))
            i += 2 + n
        else:
            out.append(ord(c))
            i += 1
    return out


class _Lark:
    """Recursive descent over a Lark grammar's tokens into trees (with _Name and _Token)."""

    def __init__(self, text: str):
        self.tokens = _lark_tokens(text)
        self.pos = 0
        self.rules: dict[str, object] = {}  # Lark name -> tree
        self.lines: dict[str, int] = {}     # Lark name -> the line that defines it
        self.ignored: list = []
        self.term: str | None = None        # the terminal being defined, if one is
        self.depth = 0                      # brackets open: newlines inside them are space

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
        self.pos += 1
        return self.tokens[self.pos - 1]

    def skip_newlines(self) -> None:
        while self.peek("newline"):
            self.pos += 1

    def checked_name(self, name: str, line: int) -> str:
        if not _LARK_NAME.fullmatch(name):
            self.fail(f"the name {name!r} mixes cases (rules are lowercase, terminals "
                      "uppercase)", line)
        return name

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
            if self.pos < len(self.tokens) and not self.peek("newline"):
                self.fail(f"unexpected {self.tokens[self.pos][1]!r}")

    def definition(self, name: str, line: int) -> None:
        name = self.checked_name(name, line)
        if self.peek("op", "{"):
            self.fail(f"the template {name}{{...}} (templates are not supported)", line)
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
        self.term = name if name.lstrip("_")[0].isupper() else None
        self.rules[name] = self.expansions(top=True)
        self.term = None

    def directive(self, word: str, line: int) -> None:
        if word == "%ignore":
            self.term = "%ignore"
            self.ignored.append(self.expansions(top=True))
            self.term = None
        elif word == "%import":
            self.import_(line)
        else:
            self.fail(f"the directive {word} is not supported (only %import and %ignore)", line)

    def import_(self, line: int) -> None:
        if not self.peek("name", "common"):
            self.fail("an %import from outside lark's common library", line)
        self.take()
        if self.peek("op", "."):
            self.take()
            if not self.peek("name"):
                self.fail("%import common. without a name", line)
            name = self.take()[1]
            alias = name
            if self.peek("arrow"):
                self.take()
                if not self.peek("name"):
                    self.fail(f"%import common.{name} -> without a name", line)
                alias = self.take()[1]
            pairs = [(name, alias)]
        elif self.peek("op", "("):
            self.take()
            pairs = []
            while not self.peek("op", ")"):
                if not self.peek("name"):
                    self.fail("expected a name in %import common (...)", line)
                name = self.take()[1]
                pairs.append((name, name))
                if self.peek("op", ","):
                    self.take()
            self.take()
        else:
            self.fail("expected %import common.NAME or %import common (A, B)", line)
        for name, alias in pairs:
            if name not in _COMMON:
                self.fail(f"common.{name} is not one of the common terminals supported ("
                          f"{', '.join(sorted(_COMMON))})", line)
            if alias in self.rules:
                self.fail(f"{alias!r} is defined twice (first on line {self.lines[alias]})",
                          line)
            if not self.checked_name(alias, line).lstrip("_")[0].isupper():
                self.fail(f"the terminal common.{name} is imported as {alias!r}, a rule's "
                          "name", line)
            self.rules[alias] = regex_tree(_COMMON[name], f"common.{name}", "", False)
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
        return one(alts, Alt)

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
        return one(items, Seq)

    def item(self):
        atom = self.atom()
        if atom is None:
            return None
        while True:
            if self.peek("op") and self.tokens[self.pos][1] in "?*+":
                op = self.take()[1]
                atom = Rep(atom, *{"?": (0, 1), "*": (0, None), "+": (1, None)}[op])
            elif self.peek("op", "~"):
                line = self.take()[2]
                if not self.peek("number"):
                    self.fail("'~' without a count", line)
                lo = hi = int(self.take()[1])
                if self.peek("range"):
                    self.take()
                    if not self.peek("number"):
                        self.fail("'~ n..' without its end", line)
                    hi = int(self.take()[1])
                if lo < 0 or hi < lo or hi > MAX_REPEAT:
                    self.fail(f"the repetition ~ {lo}..{hi} (at most {MAX_REPEAT}, the end not "
                              "below the start)", line)
                atom = Rep(atom, lo, hi)
            else:
                return atom

    def token(self, node):
        return node if self.term else _Token(node)

    def atom(self):
        if not self.peek():
            return None
        kind, text, line = self.tokens[self.pos]
        if kind == "string":
            self.take()
            cps = _lark_string(text, line)
            fold = text.endswith("i")
            if self.peek("range"):  # "a".."z"
                self.take()
                end = _lark_string(self.take()[1], line) if self.peek("string") else None
                if end is None or len(cps) != 1 or len(end) != 1:
                    self.fail("a range \"a\"..\"z\" needs two literals of one character each",
                              line)
                if end[0] < cps[0]:
                    self.fail(f"the range {text}..{self.tokens[self.pos - 1][1]} ends below "
                              "its start", line)
                return self.token(Chars(CharSet([(cps[0], end[0])])))
            if not cps:
                self.fail(f"the empty literal {text}", line)
            chars = [CharSet([(cp, cp)]) for cp in cps]
            return self.token(one((Chars(folded(c) if fold else c) for c in chars), Seq))
        if kind == "regex":
            self.take()
            end = text.rindex("/")
            flags = text[end + 1:]
            if set(flags) - set("isx"):
                self.fail(f"the regex flags {flags!r} (only i, s and x are supported)", line)
            return self.token(regex_tree(text[1:end], f"lark: line {line}: regex", flags,
                                         anchors=False))
        if kind == "name":
            self.take()
            name = self.checked_name(text, line)
            if self.peek("op", "{"):
                self.fail(f"the template use {text}{{...}} (templates are not supported)", line)
            is_term = name.lstrip("_")[0].isupper()
            if self.term and not is_term:
                self.fail(f"{self.term} uses the rule {name!r} (a terminal is made of "
                          "terminals)", line)
            return self.token(_Name(name, line)) if is_term else _Name(name, line)
        if kind == "op" and text in "([":
            if self.depth >= MAX_NESTING:  # (the readers recurse into each)
                self.fail(f"brackets nest more than {MAX_NESTING} deep", line)
            self.take()
            self.depth += 1
            inner = self.expansions(top=False)
            close = ")" if text == "(" else "]"
            if not self.peek("op", close):
                self.fail(f"'{text}' is not closed", line)
            self.depth -= 1
            self.take()
            return inner if text == "(" else Rep(inner, 0, 1)
        return None


def _resolved(node, lark: _Lark, ignore: bool):
    """`node` with its names as GBNF references and its tokens after the ignored terminals."""
    if isinstance(node, _Name):
        if node.name not in lark.rules:
            raise GrammarError(f"lark: {node.name!r} is used on line {node.line} but not "
                               "defined")
        return Ref(_gbnf_name(node.name))
    if isinstance(node, _Token):
        inner = _resolved(node.node, lark, ignore)
        return Seq((Ref(_IGNORED), inner)) if ignore else inner
    if isinstance(node, (Seq, Alt)):
        return type(node)(_resolved(i, lark, ignore) for i in node.items)
    if isinstance(node, Rep):
        return Rep(_resolved(node.node, lark, ignore), node.lo, node.hi)
    return node


def _without_left_recursion(name: str, body, lark_name: str, line: int):
    """`a: a x | a y | z` as `a: z (x | y)*` (lark reads left recursion; gbnf does not)."""
    heads, tails = [], []
    for alt in (body.items if isinstance(body, Alt) else (body,)):
        items = alt.items if isinstance(alt, Seq) else (alt,)
        if items and isinstance(items[0], Ref) and items[0].name == name:
            tails.append(one(items[1:], Seq))
        else:
            heads.append(alt)
    if not tails:
        return body
    if not heads:
        raise GrammarError(f"lark: every alternative of the rule {lark_name!r} (line {line}) "
                           "starts with itself: it matches no text")
    return Seq((one(heads, Alt), Rep(one(tails, Alt), 0, None)))


def lark_to_gbnf(text: str) -> str:
    """GBNF text (rule `root`) for the Lark grammar `text`, from its rule `start` (see the
    module's docstring for what is read). GrammarError names what is not, and its line."""
    if not isinstance(text, str):
        raise GrammarError(f"lark: expected the grammar's text, got {type(text).__name__}")
    if len(text.encode("utf-8", "surrogatepass")) > MAX_GRAMMAR_BYTES:
        raise GrammarError(f"lark: the grammar is {len(text)} characters; at most "
                           f"{MAX_GRAMMAR_BYTES} bytes are accepted")
    lark = _Lark(text)
    lark.parse()
    if "start" not in lark.rules:
        raise GrammarError("lark: no rule 'start' (the text starts at 'start: ...')")
    ignore = bool(lark.ignored)
    bodies = {"root": Seq((Ref("start"), Ref(_IGNORED))) if ignore else Ref("start")}
    if ignore:
        bodies[_IGNORED] = Rep(one((_resolved(n, lark, False) for n in lark.ignored), Alt),
                               0, None)
    for name, node in lark.rules.items():
        is_rule = not name.lstrip("_")[0].isupper()
        body = _resolved(node, lark, ignore and is_rule)
        if is_rule:
            body = _without_left_recursion(_gbnf_name(name), body, name, lark.lines[name])
        bodies[_gbnf_name(name)] = body
    normal = Normal(bodies)
    bodies = {name: normal.normal(body) for name, body in bodies.items()}
    normal.finish(bodies)
    out = checked(Writer(bodies).write("root"), "lark")
    try:
        compiled_grammar(out)
    except GrammarError as exc:
        raise GrammarError(f"lark: the grammar cannot be held ({exc}; names are Lark's with "
                           "'_' as '-')") from None
    return out
