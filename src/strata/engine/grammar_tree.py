"""The tree that engine/regex_grammar.py and engine/lark_grammar.py read regexes and Lark
grammars into, its normal form (a repetition of what can match no text repeats only its
non-empty part, so gbnf does not see a rule reach itself before reading a character) and
its GBNF text for engine/gbnf.py. Used for a Responses API custom tool's `grammar` format
and a JSON schema's `pattern`."""
from __future__ import annotations

import functools
import re

from strata.engine.gbnf import MAX_CODE_POINT, MAX_GRAMMAR_BYTES, CharSet, GrammarError


# ---- the tree both readers build --------------------------------------------------------------
class Chars:
    __slots__ = ("chars",)

    def __init__(self, chars: CharSet):
        self.chars = chars


class Seq:
    __slots__ = ("items",)

    def __init__(self, items):
        self.items = tuple(items)


class Alt:
    __slots__ = ("items",)

    def __init__(self, items):
        self.items = tuple(items)


class Rep:
    __slots__ = ("node", "lo", "hi")

    def __init__(self, node, lo: int, hi: int | None):
        self.node, self.lo, self.hi = node, lo, hi


class Ref:
    """A rule by its GBNF name."""
    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name


def one(items, kind):
    items = tuple(items)
    return items[0] if len(items) == 1 else kind(items)


ANY = CharSet([(0, MAX_CODE_POINT)])
NOT_NEWLINE = CharSet([(10, 10)]).complement()
_DIGIT = CharSet([(0x30, 0x39)])
_WORD = CharSet([(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)])
_SPACE = CharSet([(9, 13), (32, 32)])
SHORTHANDS = {"d": _DIGIT, "D": _DIGIT.complement(), "w": _WORD, "W": _WORD.complement(),
              "s": _SPACE, "S": _SPACE.complement()}
CONTROL = {"n": 10, "r": 13, "t": 9, "f": 12, "v": 11, "a": 7}
BRACES = re.compile(r"\{(\d*)(,(\d*))?\}")


@functools.lru_cache(maxsize=1)
def _case_classes() -> tuple:
    """(code point, the others of its case class) for every cased character, as Python's re
    pairs them under IGNORECASE (asked of re: its simple case mappings join i and İ, and its
    table joins lower case letters with one upper case form, as U+0390 and U+1FD3, ﬅ and ﬆ)."""
    cased = "".join(c for c in map(chr, range(0x1E944))  # past the last cased script (Adlam)
                    if c.lower() != c or c.upper() != c)
    out = []
    for c in cased:
        others = tuple(ord(o) for o in re.findall("(?i)" + re.escape(c), cased) if o != c)
        if others:
            out.append((ord(c), others))
    return tuple(out)


def folded(chars: CharSet) -> CharSet:
    extra = [(cp, cp) for cp, others in _case_classes()
             if not chars.matches(cp) and any(chars.matches(o) for o in others)]
    return CharSet(chars.ranges + tuple(extra)) if extra else chars


# ---- repetitions of what can be empty -----------------------------------------------------------
class Normal:
    """Rewrites x* (and x{m,n}) where x can match the empty string as y* with y the non-empty
    strings of x: GBNF refuses a repetition that can loop without reading (and it would make
    the recognizer's stacks ambiguous). Rules referred to (`bodies`: GBNF name -> tree) get a
    rule `<name>-Xn` for their non-empty strings where one is needed (`helpers`)."""

    def __init__(self, bodies: dict):
        self.bodies = bodies
        self.nullable_refs = _fixpoint(bodies, self._nullable)
        self.nonempty_refs = _fixpoint(bodies, self._nonempty)
        self.helpers: dict[str, object] = {}
        self.pending: list[str] = []

    def _nullable(self, node, known) -> bool:
        if isinstance(node, Chars):
            return False
        if isinstance(node, Ref):
            return known.get(node.name, False)
        if isinstance(node, Rep):
            return node.lo == 0 or node.hi == 0 or self._nullable(node.node, known)
        parts = (self._nullable(i, known) for i in node.items)
        return all(parts) if isinstance(node, Seq) else any(parts)

    def _nonempty(self, node, known) -> bool:
        if isinstance(node, Chars):
            return True
        if isinstance(node, Ref):
            return known.get(node.name, False)
        if isinstance(node, Rep):
            return node.hi != 0 and self._nonempty(node.node, known)
        return any(self._nonempty(i, known) for i in node.items)

    def nullable(self, node) -> bool:
        return self._nullable(node, self.nullable_refs)

    def normal(self, node):
        if isinstance(node, (Chars, Ref)):
            return node
        if isinstance(node, (Seq, Alt)):
            return type(node)(self.normal(i) for i in node.items)
        body = self.normal(node.node)
        if node.hi == 0:
            return Seq(())
        if self.nullable(body):
            body = self.nonempty(body)
            return Seq(()) if body is None else Rep(body, 0, node.hi)
        return Rep(body, node.lo, node.hi)

    def nonempty(self, node):
        """A tree for the non-empty strings of the normal tree `node` (None: it has none)."""
        if isinstance(node, Chars):
            return node
        if isinstance(node, Ref):
            if not self.nullable(node):
                return node
            if not self.nonempty_refs.get(node.name, False):
                return None
            name = node.name + "-Xn"
            if name not in self.helpers:
                self.helpers[name] = None
                self.pending.append(node.name)
            return Ref(name)
        if isinstance(node, Rep):
            if node.hi == 0:
                return None
            return node if node.lo else Rep(node.node, 1, node.hi)
        if isinstance(node, Alt):
            alts = [a for a in map(self.nonempty, node.items) if a is not None]
            return one(alts, Alt) if alts else None
        items = node.items
        suffix = [None] * len(items)  # suffix[i]: items[i:], sharing suffix[i + 1]
        for i in range(len(items) - 1, -1, -1):
            suffix[i] = Seq((items[i],) + ((suffix[i + 1],) if i + 1 < len(items) else ()))
        out = None  # the non-empty strings of items[i:]
        for i in range(len(items) - 1, -1, -1):
            if not self.nullable(items[i]):
                out = suffix[i]
                continue
            head = self.nonempty(items[i])
            alts = [] if head is None else [
                Seq((head, suffix[i + 1])) if i + 1 < len(items) else head]
            alts += [out] if out is not None else []
            out = one(alts, Alt) if alts else None
        return out

    def finish(self, bodies: dict) -> None:
        """Add the `-Xn` rules asked for to `bodies` (normal trees)."""
        while self.pending:
            name = self.pending.pop()
            self.helpers[name + "-Xn"] = bodies[name + "-Xn"] = self.nonempty(bodies[name])


def _fixpoint(bodies: dict, test) -> dict:
    known = dict.fromkeys(bodies, False)
    changed = True
    while changed:
        changed = False
        for name, body in bodies.items():
            if not known[name] and test(body, known):
                known[name] = changed = True
    return known


# ---- GBNF text --------------------------------------------------------------------------------
_HOIST_DEPTH = 32  # parentheses deeper than this become rules (gbnf.MAX_NESTING)


class Writer:
    """GBNF text for the rules reachable from a start: each tree written where it is used,
    except parts used in several places or nested deep, which get a rule `<rule>-Xh<k>` of
    their own (the text stays linear in the size of the shared trees)."""

    def __init__(self, bodies: dict):
        self.bodies = bodies
        self.uses: dict[int, int] = {}
        seen = set()
        todo = list(bodies.values())
        while todo:
            node = todo.pop()
            self.uses[id(node)] = self.uses.get(id(node), 0) + 1
            if id(node) in seen:
                continue
            seen.add(id(node))
            if isinstance(node, (Seq, Alt)):
                todo.extend(node.items)
            elif isinstance(node, Rep):
                todo.append(node.node)
        self.hoisted: dict[int, str] = {}
        self.queue: list[tuple[str, object]] = []
        self.queued: set[str] = set()
        self.count = 0

    def write(self, start: str) -> str:
        self.want(start)
        lines = []
        while self.queue:
            name, node = self.queue.pop(0)
            self.base = name.split("-Xh")[0]
            lines.append(f"{name} ::= {self.expr(node, 'alt', 0, top=True)}")
        return "\n".join(lines) + "\n"

    def want(self, name: str) -> str:
        if name not in self.queued:
            self.queued.add(name)
            self.queue.append((name, self.bodies[name]))
        return name

    def expr(self, node, ctx: str, depth: int, top: bool = False) -> str:
        if isinstance(node, Ref):
            return self.want(node.name)
        if isinstance(node, Chars):
            return _chars_text(node.chars, ctx)
        if not top and (depth >= _HOIST_DEPTH or self.uses.get(id(node), 0) > 1
                        and not (isinstance(node, Rep)
                                 and isinstance(node.node, (Chars, Ref)))):
            name = self.hoisted.get(id(node))
            if name is None:
                self.count += 1
                name = self.hoisted[id(node)] = f"{self.base}-Xh{self.count}"
                self.queued.add(name)
                self.queue.append((name, node))
            return name
        if isinstance(node, Rep):
            lo, hi = node.lo, node.hi
            if (lo, hi) == (1, 1):
                return self.expr(node.node, ctx, depth)
            suffix = {(0, None): "*", (1, None): "+", (0, 1): "?"}.get((lo, hi))
            if suffix is None:
                suffix = (f"{{{lo}}}" if lo == hi else f"{{{lo},}}" if hi is None
                          else f"{{{lo},{hi}}}")
            body = self.expr(node.node, "atom", depth + 1)
            if isinstance(node.node, Rep) and body[-1] in "*+?}":
                body = f"( {body} )"
            return body + suffix
        if isinstance(node, Alt):
            text = " | ".join(self.expr(i, "alt", depth + 1) for i in node.items)
            return text if ctx == "alt" else f"( {text} )"
        parts, run = [], []
        for item in node.items:
            if isinstance(item, Chars) and len(item.chars.ranges) == 1 \
                    and item.chars.ranges[0][0] == item.chars.ranges[0][1]:
                run.append(item.chars.ranges[0][0])
                continue
            if run:
                parts.append(_literal(run))
                run = []
            parts.append(self.expr(item, "seq", depth + 1))
        if run:
            parts.append(_literal(run))
        parts = [p for p in parts if p != '""'] or ['""']
        # under a repetition a literal of several characters is grouped, as is a sequence
        is_atom = len(parts) == 1 and (len(run) <= 1 or parts[0] != _literal(run))
        return " ".join(parts) if ctx != "atom" or is_atom else f"( {' '.join(parts)} )"


def _char_text(cp: int, specials: str) -> str:
    if 0x20 <= cp < 0x7F and chr(cp) not in specials:
        return chr(cp)
    named = {10: "\\n", 13: "\\r", 9: "\\t", 0x5C: "\\\\", 0x22: '\\"', 0x5B: "\\[",
             0x5D: "\\]"}
    if cp in named and chr(cp) in specials + "\n\r\t":
        return named[cp]
    return f"\\x{cp:02X}" if cp < 0x100 else f"\\u{cp:04X}" if cp < 0x10000 else f"\\U{cp:08X}"


def _literal(cps) -> str:
    return '"' + "".join(_char_text(cp, '"\\') for cp in cps) + '"'


def _chars_text(chars: CharSet, ctx: str) -> str:
    ranges = chars.ranges
    if len(ranges) == 1 and ranges[0][0] == ranges[0][1]:
        return _literal([ranges[0][0]])
    if ranges == ((0, MAX_CODE_POINT),):
        return "."
    negated = chars.complement().ranges
    if not ranges or ranges[-1][1] == MAX_CODE_POINT and len(negated) < len(ranges):
        return "[^" + _ranges_text(negated) + "]"
    return "[" + _ranges_text(ranges) + "]"


def _ranges_text(ranges) -> str:
    # '-' and '^' as hex: llama.cpp's classes know no escape for them
    out = []
    for lo, hi in ranges:
        text = _char_text(lo, "\\]-[^")
        if hi > lo:
            text += ("" if hi == lo + 1 else "-") + _char_text(hi, "\\]-[^")
        out.append(text)
    return "".join(out)


def checked(text: str, what: str) -> str:
    size = len(text.encode("utf-8"))
    if size > MAX_GRAMMAR_BYTES:
        raise GrammarError(f"{what}: its GBNF form is {size} bytes, over the "
                           f"{MAX_GRAMMAR_BYTES} a grammar may have")
    return text
