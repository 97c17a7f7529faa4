"""Inline flags (at the start and scoped), (?x), (?#...), possessive quantifiers and atomic
groups in engine/regex_grammar.py: a held regex takes exactly the strings Python's re takes,
and what cannot be held exactly is refused by name and place."""
from __future__ import annotations

import re

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from strata.engine.gbnf import CharSet, GrammarError, compile_grammar
from strata.engine.grammar_tree import folded
from strata.engine.regex_grammar import regex_to_gbnf


def disagreements(pattern: str, texts, search: bool = False) -> list:
    """The texts the converted `pattern` takes where re does not, or refuses where re takes."""
    grammar = compile_grammar(regex_to_gbnf(pattern, search=search))
    compiled = re.compile(pattern)
    out = []
    for text in texts:
        r = grammar.recognizer()
        got = r.feed(text.encode("utf-8")) and r.is_done
        if got != bool(compiled.search(text) if search else compiled.fullmatch(text)):
            out.append((text, got))
    return out


def python_texts(data, pattern: str, count: int, letters: str) -> list:
    """Texts re takes for `pattern` (hypothesis reads the pattern as re does), but those with
    a character outside printable ASCII, ASCII white space and `letters` (where re's Unicode
    \\d \\s differ from ours)."""
    texts = [data.draw(st.from_regex(pattern, fullmatch=True), label="taken")
             for _ in range(count)]
    return [t for t in texts if all(" " <= c <= "~" or c in "\t\n\r\v\f" or c in letters
                                    for c in t)]


def re_answers(pattern: str, texts) -> bool:
    """Whether Python's re judges every text: CPython 3.11.7's re raises SystemError ("the span
    of capturing group is wrong") on some possessive repeats of a group, e.g. '(?:(a)|b)*+' on
    'abb', a bug of its own, so it is no oracle there."""
    compiled = re.compile(pattern)
    try:
        for text in texts:
            compiled.fullmatch(text)
    except SystemError:
        return False
    return True


def compiles(pattern: str) -> bool:
    try:
        re.compile(pattern)
    except re.error:
        return False
    return True


# ---- flags, verbose mode, comments ------------------------------------------------------------
# letters whose case classes are wider than A-Z: K and the Kelvin sign, s and long s, i and
# dotless i and I with a dot; (no \w: it is ASCII here, Unicode in re)
_LETTERS = "abkKsSiIéÉ\u212aſİı"
_LEAVES = ["a", "b", "k", "K", "s", "S", "I", "é", "\u212a", "ſ", "ı", ".", "[a-k]", "[^s]",
           "[ks]", "[^\\S\\n]", "\\d", "\\s", "\\x4B", "\\N{LATIN SMALL LETTER S}", " ", "\\ ",
           "#c\n", "\\#", "\n", "(?#c)"]
_GROUPS = ["(?:", "(", "(?i:", "(?-i:", "(?s:", "(?-s:", "(?x:", "(?-x:", "(?m:", "(?i-s:",
           "(?si:", "(?a:", "(?ai:", "(?-ix:", "(?P<n>"]
_REPEATS = ["*", "+", "?", "{2}", "{,2}", "*?", " *", "(?#q)+", "{1,2}?"]
_STARTS = ["", "", "(?i)", "(?s)", "(?x)", "(?is)", "(?x)(?i)", "(?ai)", "(?m)", "(?#c)(?i)",
           "(?x) (?s)"]


def _flag_regexes(children):
    return st.one_of(
        st.tuples(children, children).map("".join),
        st.tuples(st.sampled_from(_GROUPS), children, children).map(
            lambda t: f"{t[0]}{t[1]}|{t[2]})"),
        st.tuples(st.sampled_from(_GROUPS), children).map(lambda t: f"{t[0]}{t[1]})"),
        st.tuples(children, st.sampled_from(_REPEATS)).map("".join))


FLAGGED = st.tuples(st.sampled_from(_STARTS),
                    st.recursive(st.sampled_from(_LEAVES), _flag_regexes, max_leaves=6)
                    ).map("".join)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(FLAGGED, st.lists(st.text(alphabet=_LETTERS + " #\n1", max_size=4), max_size=8),
       st.data())
def test_flagged_regex_takes_what_python_takes(pattern, texts, data):
    if not compiles(pattern):
        with pytest.raises(GrammarError):  # (what re refuses is not held either)
            regex_to_gbnf(pattern)
        return
    try:
        regex_to_gbnf(pattern)
    except GrammarError as exc:  # ((?x) can empty a group; `a*` `+` is possessive)
        assert re.search("an empty group|possessive .* not supported here", str(exc)), exc
        return
    texts = texts + python_texts(data, pattern, 4, _LETTERS)
    assert disagreements(pattern, texts) == [], pattern


@pytest.mark.parametrize("pattern, good, bad", [
    (r"(?i:k)(?-i:k)", ["kk", "Kk", "\u212ak"], ["kK", "k\u212a"]),
    (r"(?i)a(?-i:b(?i:c))", ["Abc", "abC"], ["aBc"]),
    (r"(?s:.)(?-s:.)", ["\na"], ["a\n"]),
    (r"(?s)(?-s:.).", ["a\n"], ["\na"]),
    (r"(?i-s:a.)", ["A-"], ["A\n"]),
    ("(?x) a b # a comment\n [ ]c \\  \\# ", ["ab c #"], ["a b c #", "ab c"]),
    (r"(?x:a b)c d", ["abc d"], ["abcd"]),
    (r"(?x)a(?-x: b) *", ["a", "a b", "a b b"], ["ab", "a b "]),
    (r"(?x)a +", ["aaa"], ["a "]),
    (r"a(?#comment)*b(?#c\)d)", ["aaab", "b"], ["a(b"]),
    (r"(?ai)k[s-t]", ["KS", "kt"], ["\u212as", "kſ"]),      # (?a): ASCII letters pair only
    (r"(?i)k[s-t]", ["\u212aſ", "KT"], ["kx"]),
    (r"(?m)^ab$", ["ab"], ["ab\n"]),
    (r"(?P<é>a)", ["a"], ["b"]),                           # a name re takes
])
def test_scoped_and_global_flags(pattern, good, bad):
    assert disagreements(pattern, good + bad) == []
    assert all(re.fullmatch(pattern, s) for s in good)    # (the cases say what they test)
    assert not any(re.fullmatch(pattern, s) for s in bad)


@pytest.mark.parametrize("pattern, words, position", [
    (r"a(?i)b", "the group '(?i)' sets flags for the whole pattern", 1),
    (r"(?i)a|(?s)b", "the group '(?s)'", 6),
    (r"(?q)a", "'q' is not one re knows", 0), (r"(?i-q:a)", "'q' is not one re knows", 0),
    (r"(?-a:a)", "'a' cannot be turned off", 0),
    (r"(?i-i:a)", "turns a flag on and off", 0), (r"b(?-:a)", "missing after '-'", 1),
    (r"a(?#b", "unterminated comment", 1), (r"(?x)a* ?", "multiple repeat", 7),
    (r"a(?#c)(?#d)*(?#e)+", "multiple repeat", 17), (r"(?#c)*", "nothing to repeat", 5),
    (r"(?P<1a>x)", "'1a' is not an identifier", 0),
    (r"(?P<n>a)(?P<n>b)", "'n' is used twice", 8),
])
def test_flag_faults_are_refused_by_name_and_place(pattern, words, position):
    with pytest.raises(re.error):  # (each is a fault to re too)
        re.compile(pattern)
    with pytest.raises(GrammarError) as info:
        regex_to_gbnf(pattern)
    assert words in str(info.value), str(info.value)
    assert str(info.value).endswith(f"at position {position}"), str(info.value)


@pytest.mark.parametrize("pattern, position", [("(?u)a", 0), ("(?L)a", 0), ("a(?u:b)", 1)])
def test_unicode_and_locale_flags_are_refused_by_name(pattern, position):
    """(re's (?u) makes \\d \\w \\s Unicode, which they are not here; (?L) is for bytes)"""
    with pytest.raises(GrammarError, match=r"the inline flag \(\?[uL]\) .* is not supported "
                       f"at position {position}$"):
        regex_to_gbnf(pattern)


def test_case_classes_are_pythons():
    """(?i) pairs each cased character with exactly the characters re pairs it with (İ with
    i and I, U+0390 with U+1FD3, ﬅ with ﬆ: re's simple case mappings and its own table)."""
    cased = "".join(c for c in map(chr, range(0x1E944)) if c.lower() != c or c.upper() != c)
    for c in cased:
        python = set(re.findall("(?i)" + re.escape(c), cased))
        ours = folded(CharSet([(ord(c), ord(c))]))
        assert {chr(cp) for lo, hi in ours.ranges for cp in range(lo, hi + 1)} == python, c


@pytest.mark.parametrize("pattern, good", [
    (r"(?i)i", ["İ", "ı", "I"]), ("(?i)[\u0390]", ["\u1fd3"]), ("(?i)\ufb05", ["\ufb06"]),
])
def test_ignorecase_takes_what_re_pairs(pattern, good):
    assert disagreements(pattern, good) == []


SEARCHED_MULTILINE = [r"(?m)^ab$", r"(?m)^a", r"(?m)b$", r"(?m)^a|b$", r"(?m)\Aa|b\Z",
                      r"(?m)^$", r"(?m)^(?:ab)+$"]


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(SEARCHED_MULTILINE), st.lists(st.text(alphabet="ab\n", max_size=6),
                                                     max_size=10))
def test_multiline_anchors_are_line_anchors_when_searched(pattern, texts):
    assert disagreements(pattern, texts, search=True) == [], pattern


# ---- possessive quantifiers and atomic groups -------------------------------------------------
@pytest.mark.parametrize("pattern", [
    r'[^"]*+"', r"\d++(?:\.\d++)?", r'"(?:[^"\\]|\\.)*+"', r"a*+", r"(?>ab|cd)+e",
    r"(?>a+)b", r"(?>ab?)+c", r"x{2}+x", r"(?:ab){2}+a", r"\w++\s*+=\s*+\d++", r"(?>(?>a)b)",
    r"a?+b|a", r"(?:a|b)*+", r"(?>a|b|)c",
])
def test_possessive_and_atomic_are_held_where_they_change_nothing(pattern):
    texts = ["", "a", "b", "ab", "aab", "abab", "abcde", "cde", "abe", "aaab", "xxx", "xx",
             '""', '"a"', '"a\\"b"', '"a\\"', "1", "1.5", "12.", "a1 = 2", "a=", "ac", "c"]
    assert disagreements(pattern, texts) == []


@pytest.mark.parametrize("pattern, words, position", [
    (r"a*+a", "the possessive quantifier '*+'", 1),          # re: no string at all
    (r"xa{1,3}+a", "the possessive quantifier '{1,3}+'", 2),
    (r"[ab]?+b", "the possessive quantifier '?+'", 4),
    (r"(?:a|ab)++c", "the possessive quantifier '++'", 8),  # `abab c`: takes a, then fails
    (r"(?>a|ab)c", "the atomic group (?>...)", 0),
    (r"b(?>a*?)a", "the atomic group (?>...)", 1),            # takes no a
    (r"(?>a+)a", "the atomic group (?>...)", 0),
    (r"(?>a|)a", "the atomic group (?>...)", 0),
    (r"(?:b(?>a*)|c)a", "the atomic group (?>...)", 4),
])
def test_possessive_and_atomic_that_keep_what_follows_needs_are_refused(pattern, words,
                                                                        position):
    with pytest.raises(GrammarError) as info:
        regex_to_gbnf(pattern)
    assert words in str(info.value) and "not supported here" in str(info.value)
    assert str(info.value).endswith(f"at position {position}"), str(info.value)
    greedy = re.sub(r"(?<=[*+?}])\+|\(\?>", lambda m: "" if m.group() == "+" else "(?:",
                    pattern)
    assert any(bool(re.fullmatch(greedy, t)) != bool(re.fullmatch(pattern, t))
               for t in ("", "a", "b", "aa", "aaa", "xaa", "xaaa", "ab", "abc", "ababc",
                         "bab", "baa", "bb", "ba", "ca"))  # (the greedy reading would be wrong)


def _possessive_regexes(children):
    return st.one_of(
        st.tuples(children, children).map("".join),
        st.tuples(st.sampled_from(["(?:", "(?>", "("]),
                  st.lists(children, min_size=1, max_size=3)).map(
            lambda t: t[0] + "|".join(t[1]) + ")"),
        st.tuples(children, st.sampled_from(["*", "+", "?", "{2}", "{1,2}", "{2,}"]),
                  st.sampled_from(["", "+", "+", "?"])).map("".join))


POSSESSIVE = st.recursive(st.sampled_from(["a", "b", "c", "[ab]", "[bc]", "[^a]", "."]),
                          _possessive_regexes, max_leaves=6)
_ABC = ["".join(t) for t in [()] + [(x,) for x in "abc"]
        + [(x, y) for x in "abc" for y in "abc"]
        + [(x, y, z) for x in "abc" for y in "abc" for z in "abc"]]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(POSSESSIVE, st.lists(st.text(alphabet="abc", min_size=4, max_size=7), max_size=6))
def test_possessive_and_atomic_are_exact_or_refused(pattern, texts):
    assume(compiles(pattern))
    try:
        regex_to_gbnf(pattern)
    except GrammarError as exc:
        assert re.search(r"the (possessive quantifier|atomic group) .* not supported here",
                         str(exc)), (pattern, str(exc))
        return
    assume(re_answers(pattern, _ABC + texts))
    assert disagreements(pattern, _ABC + texts) == [], pattern


def test_a_lark_regex_takes_the_verbose_flag():
    """Lark's /.../x reads its regex verbose, as the regex converter does (lark_grammar.py)."""
    from strata.engine.lark_grammar import lark_to_gbnf

    grammar = compile_grammar(lark_to_gbnf("start: WORD\nWORD: /a b+ # a comment/x\n"))
    assert grammar.recognizer().feed(b"abb") and grammar.recognizer().feed(b"ab")
    assert not grammar.recognizer().feed(b"a b")
