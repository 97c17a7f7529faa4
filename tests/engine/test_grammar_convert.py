"""Regexes and Lark grammars as GBNF (engine/grammar_convert.py): the converted grammar takes
exactly the strings the original does, and what cannot be converted is refused by name."""
from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strata.engine.gbnf import GrammarError, compile_grammar
from strata.engine.grammar_convert import lark_to_gbnf, regex_to_gbnf


def takes(gbnf: str, text: str) -> bool:
    r = compile_grammar(gbnf).recognizer()
    return r.feed(text.encode()) and r.is_done


PATTERNS = [r"ab*c", r"(ab|a)+b?", r"[a-c]{2,3}", r"[^a\n]+", r"a.b", r"\d+(\.\d{1,2})?",
            r"\w+ \s?\W", r"(?:a|b|)c{0,2}", r"[\]a-]+", r"a{2}|b{1,}", r"(?i)Ab", r"(?s)a.b",
            r"[\d_]*é", r"x+?y*+", r"a\.b\-\\", r"\x61\u0062", r"(?P<n>a)(?<m>b)"]
ALPHABET = "abcAB1_ .\n-\\xyé"


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(PATTERNS), st.text(alphabet=ALPHABET, max_size=7))
def test_a_regex_takes_what_python_matches_whole(pattern, text):
    # (ASCII classes, as the module documents; lazy and possessive forms read alike; Python
    # 3.11 spells a named group (?P<name>) only)
    python = pattern.replace("+?", "+").replace("*+", "*").replace("(?<", "(?P<")
    expected = re.fullmatch(python, text, re.ASCII)
    assert takes(regex_to_gbnf(pattern), text) == bool(expected), regex_to_gbnf(pattern)


@settings(max_examples=150, deadline=None)
@given(st.sampled_from([r"ab", r"^ab", r"ab$", r"^a|b$", r"\d{2}", r"^\w+$"]),
       st.text(alphabet="ab1 ", max_size=6))
def test_a_pattern_is_searched_as_json_schema_reads_it(pattern, text):
    assert takes(regex_to_gbnf(pattern, search=True), text) == bool(re.search(pattern, text))


@pytest.mark.parametrize("pattern, words", [
    (r"(?=a)a", "lookaround"), (r"(?<!a)b", "lookaround"), (r"(a)\1", "backreference"),
    (r"\bword", "word boundary"), (r"a^b", "anchor"), (r"a$b", "anchor"), (r"(?m)a", "flag"),
    (r"a{2000}", "repetition beyond"), (r"(a", "not closed"), (r"a)", "closes no group"),
    (r"[a", "not closed"), (r"*a", "repeats nothing"), (r"[z-a]", "below its start"),
    (r"\p{L}", "Unicode property"), (r"a**", "repetition of a repetition"),
    (r"[[:alpha:]]", "POSIX"),
])
def test_what_a_regex_cannot_say_is_refused_by_name(pattern, words):
    with pytest.raises(GrammarError, match=words):
        regex_to_gbnf(pattern)


# Codex's apply_patch tool (its freeform form), as Codex sends it
APPLY_PATCH = r'''start: begin_patch hunk+ end_patch
begin_patch: "*** Begin Patch" LF
end_patch: "*** End Patch" LF?

hunk: add_hunk | delete_hunk | update_hunk
add_hunk: "*** Add File: " filename LF add_line+
delete_hunk: "*** Delete File: " filename LF
update_hunk: "*** Update File: " filename LF change_move? change?

filename: /(.+)/
add_line: "+" /(.*)/ LF -> line

change_move: "*** Move to: " filename LF
change: (change_context | change_line)+ eof_line?
change_context: ("@@" | "@@ " /(.+)/) LF
change_line: ("+" | "-" | " ") /(.*)/ LF
eof_line: "*** End of File" LF

%import common.LF
'''


@pytest.mark.parametrize("patch", [
    "*** Begin Patch\n*** Add File: docs/a.md\n+# A\n+\n+text\n*** End Patch\n",
    "*** Begin Patch\n*** Delete File: old.py\n*** End Patch",
    "*** Begin Patch\n*** Update File: src/x.py\n*** Move to: src/y.py\n@@ def f():\n"
    "-    return 1\n+    return 2\n     pass\n*** End of File\n*** End Patch\n",
    "*** Begin Patch\n*** Update File: a\n@@\n-x\n*** Add File: b\n+y\n*** End Patch\n",
])
def test_apply_patch_takes_patches(patch):
    assert takes(lark_to_gbnf(APPLY_PATCH), patch)


@pytest.mark.parametrize("patch", [
    "*** Add File: a\n+x\n*** End Patch\n",                       # no Begin Patch
    "*** Begin Patch\n*** Add File: a\nx\n*** End Patch\n",        # a line without its +
    "*** Begin Patch\n*** End Patch\n",                            # no hunk
    "*** Begin Patch\n*** Update File: a\n@@\n*x\n*** End Patch\n",  # no +, - or space
    "*** Begin Patch\n*** Add File: \n+x\n*** End Patch\n",        # no file name
    "*** Begin Patch\n*** Delete File: a\n*** End Patch\n\n",      # text after the end
])
def test_apply_patch_refuses_malformed_patches(patch):
    assert not takes(lark_to_gbnf(APPLY_PATCH), patch)


def test_ignored_terminals_come_between_a_rules_items_only():
    grammar = lark_to_gbnf('start: "[" [NUMBER ("," NUMBER)*] "]"\n'
                           "%import common.NUMBER\n%import common.WS\n%ignore WS\n")
    for text in ("[1, 2 ,3]", " [ ] ", "[1.5e3]", "[\n  4\n]\n"):
        assert takes(grammar, text), text
    for text in ("[1 2]", "[1.  5]", "[1,]", "[,]"):
        assert not takes(grammar, text), text  # no space inside NUMBER; items needed


def test_lark_notation():
    grammar = lark_to_gbnf(r'''
// a comment
?start: greeting (_SEP greeting)~1..2 -> greetings
!greeting: "hi"i NAME
         | "yo" [NAME]
NAME.2: ("a".."z")+
_SEP: /,[ ]?/
''')
    assert takes(grammar, "HI bob,yo, hI x") is False  # no space inside a rule's items
    assert takes(grammar, "Hibob,yo")
    assert takes(grammar, "hIx, yoab,yo")
    assert not takes(grammar, "hibob")          # at least one more greeting
    assert not takes(grammar, "hi,yo,yo,yo")    # at most two more
    assert takes(lark_to_gbnf('start: A B\nA: "a"\nB: /b+/s\n'), "abbb")


@pytest.mark.parametrize("text, words", [
    ('begin: "a"\n', "no rule 'start'"),
    ("start: other\n", "'other' is used on line 1 but not defined"),
    ('start: x{"a"}\n_x{a}: a\n', "template"),
    ("start: A\n%declare A\n", "directive %declare"),
    ("start: X\n%import common.NOPE -> X\n", "common.NOPE"),
    ('start: "a"\nstart: "b"\n', "defined twice"),
    ("start: /a(?=b)/\n", "lookaround"),
    ('start: "a" (\n', "not closed"),
    ("start: expr\nexpr: expr \"+\" \"1\" | \"1\"\n", None),  # left recursion: gbnf says
])
def test_lark_faults_are_named(text, words):
    if words is None:
        with pytest.raises(GrammarError, match="reach itself"):
            compile_grammar(lark_to_gbnf(text))
        return
    with pytest.raises(GrammarError, match=re.escape(words)):
        lark_to_gbnf(text)
