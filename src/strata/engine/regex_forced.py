"""Where a regex's possessive quantifier or atomic group can be held as its greedy form
(engine/regex_grammar.py): `Forced`."""
from __future__ import annotations

from strata.engine.gbnf import CharSet
from strata.engine.grammar_tree import Alt, Chars, Normal, Rep, Seq

_NONE = CharSet([])


class Forced:
    """Where a possessive quantifier or atomic group takes exactly what its greedy form would.

    re keeps the first match such a part finds and never gives any of it back; a grammar
    cannot say that, but it need not where that first match is the one every match of the
    whole pattern uses. `forced(node, follow)` holds where, in any text in which a match x of
    `node` is followed by the end or by a character of `follow`, re's first match of `node`
    there is x, found without going back: a character class; a sequence of such parts; an
    alternation whose alternatives start apart (and, but for the last, match no empty text);
    a greedy repetition of a part matching no empty text whose first characters are not in
    `follow` (or a fixed count of it). Holding it greedily is then exact; else it is refused."""

    def __init__(self, reader):
        self.reader, self.nullable = reader, Normal({}).nullable
        self.firsts: dict[object, CharSet] = {}  # (nodes hash by identity)

    def check(self, alts) -> None:
        self.marks: dict[object, list] = {}
        for node, what, pos in self.reader.atomic:
            self.marks.setdefault(node, []).append((what, pos))
        if self.marks:
            for _, node, _ in alts:
                self.walk(node, _NONE)

    def walk(self, node, follow: CharSet) -> None:
        """Check the marked parts under `node`, which the end or `follow` follows."""
        for what, pos in self.marks.get(node, ()):
            if not self.forced(node, follow):
                self.reader.fail(f"{what} is not supported here: re never gives back what it "
                                 "took, and what follows may need that (it is held where what "
                                 "follows cannot start with what it matches, and only one match "
                                 "of it can be taken)", pos)
        if isinstance(node, Rep) and node.hi != 0:
            again = node.hi != 1  # (another repetition can follow)
            self.walk(node.node, _union((self.first(node.node), follow)) if again else follow)
        elif isinstance(node, Alt):
            for item in node.items:
                self.walk(item, follow)
        elif isinstance(node, Seq):
            for item, after in zip(node.items, self.afters(node.items, follow)):
                self.walk(item, after)

    def afters(self, items, follow: CharSet) -> list[CharSet]:
        """What can follow each of `items` (a sequence) when `follow` follows the last."""
        out = []
        for item in reversed(items):
            out.append(follow)
            follow = _union((self.first(item), follow)) if self.nullable(item) else self.first(item)
        return out[::-1]

    def forced(self, node, follow: CharSet) -> bool:
        if isinstance(node, Chars):
            return True
        if isinstance(node, Seq):
            return all(self.forced(item, after)
                       for item, after in zip(node.items, self.afters(node.items, follow)))
        if isinstance(node, Alt):
            later, later_nullable = None, False  # (the first characters of the later ones)
            for item in reversed(node.items):
                if later is not None:
                    if self.nullable(item) or _meet(self.first(item), later) \
                            or later_nullable and _meet(self.first(item), follow):
                        return False
                if not self.forced(item, follow):
                    return False
                later = _union((self.first(item), later or _NONE))
                later_nullable = later_nullable or self.nullable(item)
            return True
        if node.hi == 0:
            return True
        body = node.node
        if self.nullable(body) or node in self.reader.lazy and node.lo != node.hi:
            return False
        inner = follow if node.hi == 1 else _union((self.first(body), follow))
        return self.forced(body, inner) and (node.lo == node.hi
                                             or not _meet(self.first(body), follow))

    def first(self, node) -> CharSet:
        """The characters a match of `node` can start with."""
        got = self.firsts.get(node)
        if got is None:
            if isinstance(node, Chars):
                got = node.chars
            elif isinstance(node, Rep):
                got = _NONE if node.hi == 0 else self.first(node.node)
            elif isinstance(node, Alt):
                got = _union(self.first(item) for item in node.items)
            else:
                firsts = []
                for item in node.items:
                    firsts.append(self.first(item))
                    if not self.nullable(item):
                        break
                got = _union(firsts)
            self.firsts[node] = got
        return got


def _union(sets) -> CharSet:
    return CharSet(tuple(r for chars in sets for r in chars.ranges))


def _meet(a: CharSet, b: CharSet) -> bool:
    return any(b.meets(lo, hi) for lo, hi in a.ranges)
