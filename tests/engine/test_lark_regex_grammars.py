"""Regexes and Lark grammars as GBNF (engine/regex_grammar.py, engine/lark_grammar.py): the
converted grammar takes exactly the strings the original does (Python's re the reference),
and what cannot be converted is refused by name and place."""
from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strata.engine import gbnf
from strata.engine.gbnf import GrammarError, compile_grammar
from strata.engine.lark_grammar import lark_to_gbnf
from strata.engine.regex_grammar import regex_to_gbnf

from codex_apply_patch import APPLY_PATCH_LARK


def takes(text_gbnf: str, text: str) -> bool:
    r = compile_grammar(text_gbnf).recognizer()
    return r.feed(text.encode("utf-8")) and r.is_done


def python(pattern: str) -> str:
    """`pattern` as Python 3.11 reads what the converter reads: (?<name>) is (?P<name>), and a
    final `$` ends the text (ECMA-262's, not Python's before a last newline)."""
    pattern = pattern.replace("(?<", "(?P<")
    return re.sub(r"\$(?=\||$)", r"\\Z", pattern)


# ---- regexes ----------------------------------------------------------------------------------
PATTERNS = [
    r"ab*c", r"(ab|a)+b?", r"[a-c]{2,3}", r"[^a\n]+", r"a.b", r"\d+(\.\d{1,2})?", r"\w+ \s?\W",
    r"(?:a|b|)c{0,2}", r"[\]a-]+", r"a{2}|b{1,}", r"(?i)Ab", r"(?s)a.b", r"(?is)A.", r"[\d_]*é",
    r"x+?y*+", r"a\.b\-\\", r"\x61\u0062", r"(?P<n>a)(?<m>b)", r"(a*)*b", r"(a|)+", r"(a?b?)*c",
    r"(a|b?){2,}", r"(ab?){0,3}", r"a{,2}b{1,}?", r"[^\W\d]+", r"[\s\S]", r"\S\D", r"[-.]|\\",
    r"^ab$|^b", r"(?i)[^a-b]", r"[a-a]{3}", r"\0|\t\n", r"((a|b)(c|))+",
]
ALPHABET = "abcAB1_ .\n-\\xyé"


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(PATTERNS), st.text(alphabet=ALPHABET, max_size=7))
def test_a_regex_takes_what_python_matches_whole(pattern, text):
    # (ASCII classes, as the module documents)
    expected = re.fullmatch(python(pattern), text, re.ASCII)
    assert takes(regex_to_gbnf(pattern), text) == bool(expected), regex_to_gbnf(pattern)


SEARCHED = [r"ab", r"^ab", r"ab$", r"^a|b$", r"\d{2}", r"^\w+$", r"a*", r"^$", r"(a|b)c?$",
            r"a.b", r"^(ab)+$"]


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(SEARCHED), st.text(alphabet="ab1 \n", max_size=6))
def test_a_pattern_is_searched_as_json_schema_reads_it(pattern, text):
    expected = re.search(python(pattern), text, re.ASCII)
    assert takes(regex_to_gbnf(pattern, search=True), text) == bool(expected)


@pytest.mark.parametrize("pattern, good, bad", [
    (r"\u{1F600}+\U0001F601", ["\U0001F600\U0001F600\U0001F601"], ["\U0001F601"]),
    (r"(?i)é\N{GREEK SMALL LETTER SIGMA}", ["ÉΣ", "éσ", "éς"], ["eσ"]),
    (r"(?i)k", ["k", "K", "\u212a"], ["x"]),     # (Kelvin sign: k's case class, as in Python)
    (r"[\b]\v\f\a", ["\b\v\f\a"], ["b\v\f\a"]),
    (r"\012\0", ["\n\0"], ["\0\0"]),
    (r"\*\+\?\(\)\[\]\{\}\|\^\$\/\#", ["*+?()[]{}|^$/#"], []),
    (r"a{}|b{,}c|x{1,2", ["a{}", "bbbc", "c", "x{1,2"], ["a", "x"]),
])
def test_escapes_and_unicode(pattern, good, bad):
    text = regex_to_gbnf(pattern)
    for s in good:
        assert takes(text, s), (s, text)
    for s in bad:
        assert not takes(text, s), (s, text)


def test_a_named_rule_and_its_names_are_gbnf_names():
    text = regex_to_gbnf(r"(a?b?)*c|(a?b?)*d", rule="my-pattern")
    names = re.findall(r"^(\S+) ::=", text, re.M)
    assert names[0] == "my-pattern"
    assert all(re.fullmatch(r"[a-zA-Z0-9-]+", n) for n in names), names
    assert takes(text + "root ::= my-pattern\n", "abbad")


@pytest.mark.parametrize("pattern, words, position", [
    (r"(?=a)a", "lookarounds", 0), (r"a(?<!a)b", "lookarounds", 1),
    (r"(a)\1", "backreferences", 3), (r"(?P<x>a)(?P=x)", "backreferences", 8),
    (r"a\k<x>", "backreferences", 1), (r"\bword", "word boundaries", 0),
    (r"a\B", "word boundaries", 1), (r"a^b", "anchor '^'", 1), (r"a$b", "anchor '$'", 1),
    (r"(^a)", "anchor '^'", 1), (r"(a$)", "anchor '$'", 2), (r"a\Zb", "anchor '\\\\Z'", 1),
    (r"(?u)a", "inline flag (?u)", 0), (r"a(?i)b", "the group '(?i)'", 1),
    (r"(?i-i:a)", "the group '(?i-i:'", 0), (r"(?>a|ab)c", "the atomic group", 0),
    (r"a{1001}", "over 1000", 1), (r"a{3,2}", "minimum over its maximum", 1),
    (r"(a", "unbalanced '('", 0), (r"a)", "unbalanced ')'", 1), (r"[a", "unbalanced '['", 0),
    (r"a()", "empty group", 1), (r"(?:)", "empty group", 0), (r"a[]", "empty class", 1),
    (r"[^]", "empty class", 0), (r"*a", "nothing to repeat", 0), (r"a|{2}", "nothing to repeat", 2),
    (r"a**", "multiple repeat", 2), (r"a{2}{3}", "multiple repeat", 4),
    (r"[z-a]", "ends below its start", 2), (r"[\d-z]", "class shorthand", 3),
    (r"\p{L}", "escape \\p", 0), (r"\q", "escape \\q", 0), (r"a\x4", "hex digits", 1),
    (r"[[:alpha:]]", "POSIX", 1), ("a\\", "lone backslash", 1),
])
def test_what_a_regex_cannot_say_is_refused_by_name_and_place(pattern, words, position):
    with pytest.raises(GrammarError) as info:
        regex_to_gbnf(pattern)
    assert words in str(info.value)
    assert str(info.value).endswith(f"at position {position}"), str(info.value)


def test_repetitions_are_written_as_gbnf_writes_them_and_limits_are_errors():
    text = regex_to_gbnf(r"a{2,1000}")
    assert len(text) < 40  # one item under a repetition, not 1000 copies
    assert takes(text, "a" * 1000) and not takes(text, "a" * 1001) and not takes(text, "a")
    with pytest.raises(GrammarError, match="items"):       # gbnf.MAX_ITEMS, by the compiler
        regex_to_gbnf("a{1000}" * 300)
    with pytest.raises(GrammarError, match="bytes"):       # written out past the limit
        regex_to_gbnf("." * 20000)
    with pytest.raises(GrammarError, match="characters"):
        regex_to_gbnf("a" * (gbnf.MAX_GRAMMAR_BYTES + 1))
    with pytest.raises(GrammarError, match="nest more than"):
        regex_to_gbnf("(" * 101 + "a" + ")" * 101)
    deep = "(?:a|" * 90 + "b" + ")" * 90  # deeper than GBNF's groups: rules of their own
    assert takes(regex_to_gbnf(deep), "b") and takes(regex_to_gbnf(deep), "a")


# ---- Lark -------------------------------------------------------------------------------------
APPLY_PATCH = APPLY_PATCH_LARK  # Codex's apply_patch tool (its freeform form)


@pytest.mark.parametrize("patch", [
    "*** Begin Patch\n*** Add File: docs/a.md\n+# A\n+\n+text\n*** End Patch\n",
    "*** Begin Patch\n*** Delete File: old.py\n*** End Patch",
    "*** Begin Patch\n*** Update File: src/x.py\n*** Move to: src/y.py\n@@ def f():\n"
    "-    return 1\n+    return 2\n     pass\n*** End of File\n*** End Patch\n",
    "*** Begin Patch\n*** Update File: a\n@@\n-x\n*** Add File: b\n+y\n*** End Patch\n",
    "*** Begin Patch\n*** Update File: a\n*** End Patch\n",
])
def test_apply_patch_takes_patches(patch):
    assert takes(lark_to_gbnf(APPLY_PATCH), patch)


@pytest.mark.parametrize("patch", [
    "*** Add File: a\n+x\n*** End Patch\n",                         # no Begin Patch
    "*** Begin Patch\n*** Add File: a\nx\n*** End Patch\n",          # a line without its +
    "*** Begin Patch\n*** End Patch\n",                              # no hunk
    "*** Begin Patch\n*** Update File: a\n@@\n*x\n*** End Patch\n",  # no +, - or space
    "*** Begin Patch\n*** Add File: \n+x\n*** End Patch\n",          # no file name
    "*** Begin Patch\n*** Delete File: a\n*** End Patch\n\n",        # text after the end
    "*** Begin Patch\n*** Add File: a\n*** End Patch\n",             # an add without lines
    "*** Begin Patch\n*** Update File: a\n@@\n-x",                   # no End Patch
])
def test_apply_patch_refuses_malformed_patches(patch):
    assert not takes(lark_to_gbnf(APPLY_PATCH), patch)


def test_apply_patch_gbnf_has_gbnf_names():
    names = re.findall(r"^(\S+) ::=", lark_to_gbnf(APPLY_PATCH), re.M)
    assert {"root", "start", "begin-patch", "add-line", "LF"} <= set(names)
    assert all(re.fullmatch(r"[a-zA-Z0-9-]+", n) for n in names), names


def test_ignored_terminals_come_between_a_rules_tokens_only():
    grammar = lark_to_gbnf('start: "[" [NUMBER ("," NUMBER)*] "]"\n'
                           "%import common.NUMBER\n%import common.WS\n%ignore WS\n")
    for text in ("[1, 2 ,3]", " [ ] ", "[1.5e3]", "[\n  4\n]\n", "[]"):
        assert takes(grammar, text), text
    for text in ("[1 2]", "[1.  5]", "[1,]", "[,]", "[1e 3]"):
        assert not takes(grammar, text), text  # no space inside NUMBER; items needed


def test_ignore_of_several_terminals_and_of_a_literal():
    grammar = lark_to_gbnf("start: pair+\npair: CNAME \"=\" SIGNED_INT\n"
                           "%import common (CNAME, SIGNED_INT, WS_INLINE, SH_COMMENT)\n"
                           "%ignore WS_INLINE\n%ignore SH_COMMENT\n%ignore \"\\n\"\n")
    assert takes(grammar, "a = 1 # one\n b_2=-3\n\n")
    assert not takes(grammar, "a = - 1")  # not inside a terminal
    assert not takes(grammar, "2a = 1")


def test_lark_notation():
    grammar = lark_to_gbnf(r'''
// a comment
?start: greeting (_SEP greeting)~1..2 -> greetings
!greeting: "hi"i NAME
         | "yo" [NAME]
NAME.2: ("a".."z")+
_SEP: /,[ ]?/
''')
    assert takes(grammar, "Hibob,yo")
    assert takes(grammar, "hIx, yoab,yo")
    assert not takes(grammar, "HI bob,yo")       # no %ignore: no space between tokens
    assert not takes(grammar, "hibob")           # at least one more greeting
    assert not takes(grammar, "hi,yo,yo,yo")     # at most two more
    assert takes(lark_to_gbnf('start: A B\nA: "a"\nB: /b.+/si\n'), "aB\nb")
    assert takes(lark_to_gbnf('start: "\\x41\\u00e9\\n\\t\\\\\\"\\d"\n'), 'Aé\n\t\\"\\d')


def test_distinct_lark_names_stay_distinct():
    grammar = lark_to_gbnf('start: a_b A_B _a a root ROOT\na_b: "1"\nA_B: "2"\n_a: "3"\n'
                           'a: "4"\nroot: "5"\nROOT: "6"\n')
    assert takes(grammar, "123456")
    assert not takes(grammar, "123455")


def test_left_recursion_and_empty_repetitions_are_rewritten():
    grammar = lark_to_gbnf('?start: start "+" term | start "-" term | term\n'
                           'term: item* ("." item*)~0..2\nitem: "a"? | "b"\n')
    for text in ("", "a", "ab+b-", "a.b.+ab", "+", "..+."):
        assert takes(grammar, text), text
    for text in ("...", "c", "a+c"):
        assert not takes(grammar, text), text
    with pytest.raises(GrammarError, match="reach itself"):  # (indirect: refused by gbnf)
        lark_to_gbnf('start: a "x"\na: start "y" | "z"\n')


@pytest.mark.parametrize("name, good, bad", [
    ("NEWLINE", ["\n", "\r\n\n"], ["\r", ""]), ("WS", [" \t\n\f\r"], [""]),
    ("HEXDIGIT", ["f", "A"], ["g"]), ("SIGNED_INT", ["-12", "+0", "7"], ["1.", "-"]),
    ("DECIMAL", ["1.", ".5", "1.5"], ["1", "."]),
    ("FLOAT", ["1e5", "1.5E-3", ".5", "2."], ["1", "e5", "1e"]),
    ("SIGNED_NUMBER", ["-1", "+.5e+2", "3"], ["--1", "+"]),
    ("CNAME", ["_a1", "Ab"], ["1a", ""]), ("WORD", ["Ab"], ["a1"]),
    ("ESCAPED_STRING", ['""', '"a\\"b"', '"\\\\"'], ['"a"b"', '"\\"', '"a\nb"']),
    ("C_COMMENT", ["/**/", "/* a\n* b **/"], ["/* */ */", "/*/"]),
    ("CPP_COMMENT", ["// x"], ["// x\n"]), ("SH_COMMENT", ["#", "# x"], ["x"]),
    ("LCASE_LETTER", ["q"], ["Q"]), ("UCASE_LETTER", ["Q"], ["q"]),
])
def test_common_terminals(name, good, bad):
    grammar = lark_to_gbnf(f"start: X\n%import common.{name} -> X\n")
    for s in good:
        assert takes(grammar, s), s
    for s in bad:
        assert not takes(grammar, s), s


@pytest.mark.parametrize("text, words, line", [
    ('begin: "a"\n', "no rule 'start'", None),
    ("start: other\n", "'other' is used on line 1 but not defined", 1),
    ('start: "a"\n\n  | B\n', "'B' is used", 3),
    ('start: x{"a"}\n', "template use x{...} (templates are not supported)", 1),
    ('start: "a"\n_x{a}: a\n', "template _x{...} (templates are not supported)", 2),
    ('start: A\n%declare A\n', "directive %declare is not supported", 2),
    ('start: A\n%override A: "b"\n', "directive %override", 2),
    ("start: X\n%import common.NOPE -> X\n", "common.NOPE is not one", 2),
    ("start: X\n%import other.X\n", "outside lark's common library", 2),
    ('start: "a"\nstart: "b"\n', "defined twice (first on line 1)", 2),
    ("start: \"a\"\n  | /a(?=b)/\n", "regex 'a(?=b)': lookarounds", 2),
    ("start: /a/m\n", "regex flags 'm'", 1),
    ('start: "a" (\n', "'(' is not closed", 1),
    ('start: A\nA: "a" b\nb: "b"\n', "A uses the rule 'b'", 2),
    ('start: Ab\n', "'Ab' mixes cases", 1),
    ('start: "x" | start "a"\nb: b "c"\n', "every alternative of the rule 'b'", 2),
    ('start: "a" "ab".."c"\n', "two literals of one character", 1),
    ('start: "\\xZZ"\n', "hex digits", 1),
    ('start: "a" ~ 2..1\n', "~ 2..1", 1),
    ('start: "a" $\n', "unexpected '$'", 1),
])
def test_lark_faults_are_named_with_their_line(text, words, line):
    with pytest.raises(GrammarError) as info:
        lark_to_gbnf(text)
    assert words in str(info.value), str(info.value)
    assert line is None or f"line {line}" in str(info.value), str(info.value)


@settings(max_examples=400, deadline=None)
@given(st.text(alphabet='start:|()[]?*+~.."ab/\\%ignore WS\n_AB0123->{}', max_size=60))
def test_any_lark_text_converts_or_is_a_grammar_error(text):
    """Whatever a client sends as a Lark grammar is held or refused by name, never a crash
    (brackets nested 5,000 deep were a RecursionError)."""
    try:
        lark_to_gbnf(text)
    except GrammarError:
        pass


@pytest.mark.parametrize("depth", [5000])
def test_deep_brackets_are_refused_by_name(depth):
    with pytest.raises(GrammarError, match="nest"):
        lark_to_gbnf("start: " + "(" * depth + '"a"' + ")" * depth + "\n")
    with pytest.raises(GrammarError, match="nest"):
        regex_to_gbnf("(" * depth + "a" + ")" * depth)


@settings(max_examples=400, deadline=None)
@given(st.text(alphabet="ab()[]{}|?*+^$.\\-,:<>=!PdwsbuxN0129i", max_size=30),
       st.booleans())
def test_any_regex_converts_or_is_a_grammar_error(pattern, search):
    try:
        regex_to_gbnf(pattern, search=search)
    except GrammarError:
        pass
