"""A GBNF grammar cannot make the engine thread's work or memory grow without bound: a grammar
whose ways multiply is refused by name, a reading too costly to follow is refused, a step looks
only at the stacks that can take the character, and a grammar's memos stay bounded."""
from __future__ import annotations

import pytest

from strata.engine import gbnf
from strata.engine.gbnf import GrammarError, compile_grammar


def _doubling_chain(num_rules: int) -> str:
    """Each rule two alternatives naming the next: 2 ** num_rules ways open at the start."""
    rules = "\n".join(f'r{i} ::= r{i + 1} "a" | r{i + 1} "b"' for i in range(num_rules))
    return f'root ::= r0\n{rules}\nr{num_rules} ::= "x"'


def test_a_grammar_whose_ways_multiply_is_refused_by_name():
    # 2^13 = 8192 stacks at the start (each step would look at them all); 2^40 would never
    # finish expanding and would fill the memory
    for num_rules in (13, 40):
        with pytest.raises(GrammarError, match=r"more than 4096 ways"):
            compile_grammar(_doubling_chain(num_rules))
    assert len(compile_grammar(_doubling_chain(10)).start) == 1024  # within the limit: held


def test_a_reading_that_expands_past_the_budget_is_refused_not_followed():
    # 3000 optional "a"s: reading one "a" leaves 3000 stacks, each expanding the rest of the
    # chain: millions of stacks visited for one character (it took 40 s a token); refused
    g = compile_grammar("root ::= " + '"a"? ' * 3000 + '"!"')
    r = g.recognizer()
    assert not r.copy().feed(b"a")
    assert r.feed(b"!") and r.is_done
    # a short chain is followed as before
    r = compile_grammar("root ::= " + '"a"? ' * 20 + '"!"').recognizer()
    assert r.feed(b"a" * 20 + b"!") and r.is_done


def test_a_step_looks_only_at_the_stacks_that_take_the_character(monkeypatch):
    alternatives = " | ".join(f'"{chr(0x100 + i)}"' for i in range(2000))
    g = compile_grammar(f"root ::= [a-z] ({alternatives})")
    r = g.recognizer()
    assert r.feed(b"q") and len(r.state) == 2000
    calls = []
    real = gbnf.CharSet.matches
    monkeypatch.setattr(gbnf.CharSet, "matches",
                        lambda self, cp: calls.append(cp) or real(self, cp))
    for cp in (0x100, 0x500, 0x7CF):  # each a step from a state of 2000 stacks
        assert r.copy().feed(chr(cp).encode())
    assert not r.copy().feed(chr(0x100 + 2000).encode())
    assert len(calls) == 0  # one-character tops are looked up, not tried one by one


def test_a_grammars_memos_stay_bounded(monkeypatch):
    monkeypatch.setattr(gbnf, "_CACHE_STACKS", 5000)
    alternatives = " | ".join(f'[a-z] "{chr(0x100 + i)}"' for i in range(1000))
    g = compile_grammar(f"root ::= ({alternatives})+")
    r = g.recognizer()
    for i in range(300):  # a different alternative each time: a new memo entry each step
        assert r.feed(b"k" + chr(0x100 + (i * 7) % 1000).encode())
        held = (sum(len(s) for s in g._states) + len(g._steps) + len(g._expanded)
                + sum(len(s) for s in g._indexes))
        assert held <= 5000 + 3 * 1001 + 3, i  # the limit, plus the entries that crossed it
