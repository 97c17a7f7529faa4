"""The sampler's best allowed token found through the vocabulary's prefix tree
(engine/best_allowed.py's best_in_tree, tokenizer.PrefixTree): the same token as asking every id in
logit order, on random logits (ties, -inf, NaN) at the states of several held outputs."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from strata.engine.gbnf import compile_grammar
from strata.engine.json_constraint import JsonObjectConstraint, TextConstraint
from strata.engine.json_schema import GRAMMAR_KEY
from strata.engine.lark_grammar import lark_to_gbnf
from strata.engine import best_allowed
from strata.engine.sampling import Sampler, SamplingParams
from strata.engine.thinking_budget import ThinkingBudget
from strata.engine.tool_call_constraint import ToolCallConstraint
from strata.engine.tool_call_required import RequiredToolCallConstraint
from strata.model.tokenizer import PrefixTree, Tokenizer
from strata.tool.synth import synth_tokenizer_meta

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from codex_apply_patch import APPLY_PATCH_LARK  # noqa: E402

CITY = {"type": "object", "required": ["city", "code"], "additionalProperties": False,
        "properties": {"city": {"enum": ["Zürich", "Zagreb", "Zaragoza", "Zwolle", "北京"]},
                       "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]+$"},
                       "rank": {"enum": [1, 12, 120, 2.5]},
                       "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 2}}}
PATCH = {"name": "apply_patch", "parameters": {
    "type": "object", "required": ["input"], "additionalProperties": False,
    "properties": {"input": {"type": "string", GRAMMAR_KEY: lark_to_gbnf(APPLY_PATCH_LARK)}}}}
WEATHER = {"name": "get_weather", "parameters": CITY}
TIME = {"name": "get_time", "parameters": {"type": "object", "properties": {}}}
SQL = 'root ::= "SELECT " [a-z]+ " FROM " [a-z_]+ (" WHERE " [a-z]+ " = " [0-9]+)? ";"'


# plain tokens no merge makes: one spelled as another plain one (`ok`), and ones whose shorter
# prefixes a constraint refuses where it takes them (see test_irregular_tokens)
ODD = ["ok", "Ċ</think>", "Ċ<", "Ċ</", "ĠFROM", "<t", "xyz", "</think>x", "<think>Ċ"]


def odd_tokenizer(plain_think: bool = False) -> Tokenizer:
    """The synth vocabulary padded (FIM tokens, empty [PAD] ones), and ODD after it;
    `plain_think`: its `<think>` a plain token, not an added one."""
    meta = synth_tokenizer_meta(4200)
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = list(meta["tokenizer.ggml.token_type"])
    if plain_think:
        types[tokens.index("<think>")] = 1
    meta["tokenizer.ggml.tokens"] = tokens + ODD
    meta["tokenizer.ggml.token_type"] = types + [1] * len(ODD)
    return Tokenizer.from_gguf_metadata(meta)


@pytest.fixture(scope="module")
def tok():
    return odd_tokenizer()


def odd(tok, text: str) -> int:
    return tok.vocab_size - len(ODD) + ODD.index(text)


def reference(constraint, logits: np.ndarray) -> int | None:
    """Every id asked in logit order (ties: the lowest id) after the argmax, finite ones only."""
    best = int(np.argmax(logits))
    if constraint.allows(best):
        return best
    ids = np.flatnonzero(np.isfinite(logits))
    for token in ids[np.lexsort((ids, -logits[ids]))].tolist():
        if constraint.allows(token):
            return token
    return None


def random_logits(rng, size: int, kind: int) -> np.ndarray:
    if kind == 0:
        return (rng.standard_normal(size) * 3).astype(np.float32)
    logits = rng.integers(0, 3, size).astype(np.float32)  # many ties
    logits[rng.random(size) < 0.3] = -np.inf
    if kind == 2:
        logits[rng.integers(0, size, 3)] = np.nan
        logits[rng.integers(0, size)] = np.inf
    return logits


def walk(tok, constraint, text: str, steps: int, seed: int) -> int:
    """Take `text`, then `steps` picks (each pushed): the sampler's pick is the reference's at
    every one. The number of picks the tree made (the argmax refused, the constraint's
    judgement following the bytes)."""
    for t in tok.encode(text, add_special=False):
        assert constraint.allows(t), tok.token_bytes(t)
        constraint.push(t)
    sampler = Sampler(SamplingParams(temperature=0.0), constraint=constraint)
    assert sampler._prefix_tree() is not None
    rng = np.random.default_rng(seed)
    searched = 0
    for step in range(steps):
        logits = random_logits(rng, tok.vocab_size, step % 3)
        want = reference(constraint, logits)
        searched += want is not None and want != int(np.argmax(logits)) and \
            best_allowed.irregular_ids(constraint) is not None
        assert sampler._best_allowed(logits) == want, (step, tok.token_bytes(want or 0))
        if want is None:
            break
        constraint.push(want)
    return searched


def test_prefix_tree_by_brute_force():
    spellings = [b"ab", b"", b"a", b"abc", b"b", b"ab", b"", b"abd", b"x", b"abcd", b"b\x00",
                 b"\xff", b"ac"]
    tree = PrefixTree.of(spellings)
    assert tree.order.tolist() == sorted(range(len(spellings)), key=lambda i: (spellings[i], i))
    assert (tree.order[tree.position] == np.arange(len(spellings))).all()
    nodes = sorted(set(spellings))  # node n is the n-th distinct spelling (b"" the root)
    assert len(tree.start) == len(nodes) + 1
    for n, data in enumerate(nodes):
        own = tree.order[tree.start[n]:tree.start[n + 1]].tolist()
        assert own == [i for i, s in enumerate(spellings) if s == data]
        subtree = set(tree.order[tree.start[n]:tree.end[n]].tolist())
        assert subtree == {i for i, s in enumerate(spellings) if s.startswith(data)}
        kids = tree.children[tree.child_at[n]:tree.child_at[n + 1]].tolist()
        assert kids == [k for k, s in enumerate(nodes) if k and s != data and s.startswith(data)
                        and max((p for p in nodes if s.startswith(p) and p != s), key=len)
                        == data]


def test_prefix_tree_of_the_vocabulary(tok):
    tree = tok.prefix_tree()
    assert tok.prefix_tree() is tree  # made once
    spell = tok.token_bytes
    assert [spell(int(t)) for t in tree.order] == sorted(spell(t) for t in range(tok.vocab_size))
    for n in range(1, len(tree.start) - 1, 97):  # each node's subtree: the ids its bytes start
        data = spell(int(tree.order[tree.start[n]]))
        assert set(tree.order[tree.start[n]:tree.end[n]].tolist()) == {
            t for t in range(tok.vocab_size) if spell(t).startswith(data)}


@pytest.mark.parametrize("case", ["schema", "schema thinking", "json", "gbnf", "gbnf tokens",
                                  "gbnf negated", "gbnf stops"])
def test_held_text(tok, case):
    stops = set(tok.stop_ids)
    if case.startswith("schema"):
        c = JsonObjectConstraint(tok, stops, schema=CITY,
                                 starts_in_reasoning=case.endswith("thinking"))
        text = "so</think>" if case.endswith("thinking") else ""
        text += '{"city": "Z'
    elif case == "json":
        c, text = JsonObjectConstraint(tok, stops), '{"a": ["x\\'
    elif case == "gbnf stops":  # a plain token as a stop: allowed only at the sentence's end
        stops.add(tok.encode(" FROM", add_special=False)[0])
        c, text = TextConstraint(tok, stops, compile_grammar(SQL).recognizer()), "SELECT ab"
    elif case == "gbnf":
        c, text = TextConstraint(tok, stops, compile_grammar(SQL).recognizer()), "SELECT ab"
    else:  # token items: a named one is asked by its id; a negated one takes any token
        item = "!<think>" if case == "gbnf negated" else "<think>"
        grammar = compile_grammar(f'root ::= {item} "ok" [a-z]* "."').bound(tok)
        c, text = TextConstraint(tok, stops, grammar.recognizer()), ""
    searched = walk(tok, c, text, 25, 1)
    assert searched > 0 or case == "gbnf negated"


@pytest.mark.parametrize("xml", [False, True])
def test_apply_patch_in_a_call(tok, xml):
    prefix = ("<tool_call>\n<function=apply_patch>\n<parameter=input>\n" if xml else
              '<tool_call>\n{"name": "apply_patch", "arguments": {"input": "')
    for seed, text in enumerate(["", "*** Begin", "*** Begin Patch\n*** Update File: a\n@@"]):
        text = text.replace("\n", "\\n") if not xml else text
        assert walk(tok, ToolCallConstraint(tok, [PATCH], xml=xml), prefix + text, 20, seed)


@pytest.mark.parametrize("xml", [False, True])
def test_tool_calls(tok, xml):
    opening = "<tool_call>\n<function=" if xml else '<tool_call>\n{"name": "get_'
    assert walk(tok, ToolCallConstraint(tok, [WEATHER, TIME], xml=xml, max_calls=1),
                "Let me see. " + opening, 40, 3)
    required = RequiredToolCallConstraint(tok, [WEATHER], tok.stop_ids, xml=xml,
                                          starts_in_reasoning=True)
    assert walk(tok, required, "hm</think>\n", 40, 4)


def test_a_thinking_budget(tok):
    """Forcing its close the budget refuses `\\n</` but takes `\\n</think>`: asked id by id."""
    inner = JsonObjectConstraint(tok, tok.stop_ids)
    walk(tok, ThinkingBudget(tok, 2, inner, starts_in_reasoning=True), "", 12, 5)
    c = ThinkingBudget(tok, 1, JsonObjectConstraint(tok, tok.stop_ids))
    assert walk(tok, c, "<think>", 12, 10)


def test_the_tree_asks_few_tokens(tok):
    """Where a few long tokens fit (the patch's `*** Begin` wants ` Patch`), the walk asks the
    constraint of a small part of the vocabulary, not of every id whose first byte fits."""
    c = ToolCallConstraint(tok, [PATCH])
    for t in tok.encode('<tool_call>\n{"name": "apply_patch", "arguments": {"input": "*** Begin',
                        add_special=False):
        c.push(t)
    asked = []
    allows = c.allows
    c.allows = lambda t: asked.append(t) or allows(t)
    sampler = Sampler(SamplingParams(temperature=0.0), constraint=c)
    num_first = len(c.candidates())  # the ids whose first byte fits: a space
    rng = np.random.default_rng(7)
    logits = (rng.standard_normal(tok.vocab_size) * 3).astype(np.float32)
    logits[tok.encode(" Patch", add_special=False)] = -50  # the one way on: last of all
    token = sampler._best_allowed(logits)
    assert tok.token_bytes(token) in (b" ", b" P", b" Pa", b" Pat", b" Patc", b" Patch")
    assert len(asked) < num_first / 4, (len(asked), num_first)
    assert token == reference(c, logits)


def test_one_spelling_ties_go_to_the_lowest_id(tok):
    """Two plain tokens spelled `ok`, of one logit, the best allowed: the lower id."""
    c = JsonObjectConstraint(tok, tok.stop_ids)
    for t in tok.encode('{"a": "', add_special=False):
        c.push(t)
    first, second = sorted(t for t in range(tok.vocab_size) if tok.token_bytes(t) == b"ok")
    logits = (np.random.default_rng(2).standard_normal(tok.vocab_size) * 3).astype(np.float32)
    logits[[first, second]] = logits.max() + 1
    logits[tok.token_id("<|im_start|>")] = logits.max() + 1  # the argmax, refused
    sampler = Sampler(SamplingParams(temperature=0.0), constraint=c)
    assert sampler._best_allowed(logits) == reference(c, logits) == first
    logits[second] += 1e-6  # now the later one is better
    assert sampler._best_allowed(logits) == second


def plain_stop(tok, text: str) -> set[int]:
    (token,) = [t for t in range(tok.vocab_size) if tok.token_bytes(t) == text.encode()]
    return set(tok.stop_ids) | {token}


IRREGULAR = {  # a token allowed whose shorter prefix, a plain token, is refused
    # `<think>` at the start of a JSON answer ("<" refused): an added token or a plain one
    "think": (lambda tok: JsonObjectConstraint(tok, tok.stop_ids), "", "<think>"),
    # an added token is never held text, a plain one that starts with its spelling may be
    "added prefix": (lambda tok: JsonObjectConstraint(tok, tok.stop_ids), '{"a": "',
                     "</think>x"),
    # forcing the close: `\n</` splits it, `\n</think>` does not (the inner constraint
    # starts in reasoning too, as generate.py builds it: the budget forces only what it takes)
    "forced close": (lambda tok: ThinkingBudget(tok, 0, JsonObjectConstraint(
        tok, tok.stop_ids, starts_in_reasoning=True), starts_in_reasoning=True), "",
        "Ċ</think>"),
    # a first token spelled `<think>` and more opens the block as `<think>` does ("<" refused)
    "think and more": (lambda tok: JsonObjectConstraint(tok, tok.stop_ids), "", "<think>Ċ"),
    # a plain stop token before the sentence's end (" F"), refused whatever its bytes
    "plain stop": (lambda tok: TextConstraint(tok, plain_stop(tok, " F"), compile_grammar(
        SQL).recognizer()), "SELECT ab", "ĠFROM"),
    # a grammar's token item naming a token whose first byte is no character of it
    "token item": (lambda tok: TextConstraint(tok, tok.stop_ids, compile_grammar(
        f'root ::= "a" <[{odd(tok, "xyz")}]> "."').bound(tok).recognizer()), "a", "xyz"),
    # a plain stop token ("<") before the required call
    "required stop": (lambda tok: RequiredToolCallConstraint(
        tok, [WEATHER], plain_stop(tok, "<")), "", "<t"),
}


@pytest.mark.parametrize("plain_think", [False, True])
@pytest.mark.parametrize("case", sorted(IRREGULAR))
def test_irregular_tokens(case, plain_think):
    """The token is the best allowed one, the argmax refused: the walk must not drop it with
    the subtree of its refused prefix."""
    tok = odd_tokenizer(plain_think)
    make, text, favoured = IRREGULAR[case]
    assert (tok.token_id("<think>") in tok.added_ids) != plain_think
    favoured = odd(tok, favoured) if favoured in ODD else tok.token_id(favoured)
    rng = np.random.default_rng(len(case))
    for _ in range(3):
        c = make(tok)
        for t in tok.encode(text, add_special=False):
            c.push(t)
        logits = (rng.standard_normal(tok.vocab_size) * 3).astype(np.float32)
        logits[favoured] = logits.max() + 1
        refused = next(t for t in range(tok.vocab_size) if not c.allows(t))
        logits[refused] = logits[favoured] + 1
        assert reference(c, logits) == favoured
        assert Sampler(SamplingParams(temperature=0.0), constraint=c)._best_allowed(
            logits) == favoured
