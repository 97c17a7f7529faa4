"""Time the sampler on tool calls whose text is held to a grammar, with a vocabulary of
Qwen's size (no such tokenizer can be fetched here: a byte-level BPE of 150,000 tokens is
trained on random word-like text first, ~30 s, kept in /tmp). Random logits are the bad case
(a model's peaked logits mostly take the first draw). Two tables: tool calls written token by
token; then the pick alone (nothing taken) at fixed states where the constraint refuses most
tokens whose first byte it takes (the sampler's worst case: its best allowed token).

    python tools/bench_held_sampling.py [--vocab 150000] [--draws 30] [--picks 40]
"""
from __future__ import annotations

import argparse
import json
import random
import string
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def big_tokenizer(vocab: int):
    from strata.model.tokenizer import Tokenizer

    cache = Path(f"/tmp/strata-bench-vocab-{vocab}.json")
    if not cache.exists():
        from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
        from tokenizers import Tokenizer as HFTokenizer

        sys.path.insert(0, str(ROOT / "tests" / "model"))
        import test_tokenizer as tt  # its GGUF keys of a trained tokenizer

        rng = random.Random(0)
        alphabet = string.ascii_letters + string.digits + "_-./:+*=\n\t ()[]{}\"'<>#,;é中"
        words = (" ".join("".join(rng.choice(alphabet) for _ in range(rng.randint(2, 9)))
                          for _ in range(12)) for _ in range(400_000))
        tok = HFTokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(tt.QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tok.decoder = decoders.ByteLevel()
        tok.train_from_iterator(words, trainers.BpeTrainer(
            vocab_size=vocab, special_tokens=tt.SPECIALS + tt.USER_DEFINED,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
        cache.write_text(json.dumps(tt.gguf_tokenizer_meta(tok)))
    return Tokenizer.from_gguf_metadata(json.loads(cache.read_text()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=150_000)
    parser.add_argument("--draws", type=int, default=30)
    parser.add_argument("--picks", type=int, default=40, help="picks timed at each state")
    args = parser.parse_args()
    from strata.engine.json_schema import GRAMMAR_KEY
    from strata.engine.lark_grammar import lark_to_gbnf
    from strata.engine.sampling import Sampler, SamplingParams
    from strata.engine.tool_call_constraint import ToolCallConstraint

    sys.path.insert(0, str(ROOT / "tests"))
    from codex_apply_patch import APPLY_PATCH_LARK as APPLY_PATCH  # Codex's grammar

    tok = big_tokenizer(args.vocab)
    V = tok.vocab_size
    t0 = time.perf_counter()
    tok.prefix_tree()  # once per tokenizer: not the first pick's
    print(f"prefix tree of {V} tokens: {1e3 * (time.perf_counter() - t0):.0f} ms")
    for name, gbnf in (("apply_patch", lark_to_gbnf(APPLY_PATCH)), ("digits", "root ::= [0-9]+")):
        tool = {"name": "t", "parameters": {"type": "object", "required": ["input"],
                                            "additionalProperties": False, "properties": {
                                                "input": {"type": "string", GRAMMAR_KEY: gbnf}}}}
        for xml in (False, True):
            prefix = ("<tool_call>\n<function=t>\n<parameter=input>\n" if xml else
                      '<tool_call>\n{"name": "t", "arguments": {"input": "')
            for temperature in (0.0, 1.0):
                constraint = ToolCallConstraint(tok, [tool], xml=xml)
                for t in tok.encode(prefix, add_special=False):
                    constraint.push(t)
                sampler = Sampler(SamplingParams(temperature=temperature, top_k=0, top_p=1.0,
                                                 min_p=0.0, seed=1), constraint=constraint)
                rng = np.random.default_rng(0)
                times = []
                for _ in range(args.draws):  # each token taken: the call goes on
                    logits = rng.standard_normal(V).astype(np.float32) * 3
                    t0 = time.perf_counter()
                    sampler.sample(logits)
                    times.append(time.perf_counter() - t0)
                print(f"{name:12s} {'xml ' if xml else 'json'} temperature {temperature}: "
                      f"median {1e3 * np.median(times):.1f} ms, max {1e3 * max(times):.1f} ms")

    held_states(tok, APPLY_PATCH, args.picks)


def held_states(tok, apply_patch: str, picks: int) -> None:
    """Time `Sampler._constrained` (the pick, without taking the token) at each state."""
    from strata.engine.gbnf import compiled_grammar
    from strata.engine.json_constraint import JsonObjectConstraint, TextConstraint
    from strata.engine.json_schema import GRAMMAR_KEY
    from strata.engine.lark_grammar import lark_to_gbnf
    from strata.engine.sampling import Sampler, SamplingParams
    from strata.engine.tool_call_constraint import ToolCallConstraint

    patch = {"name": "apply_patch", "parameters": {
        "type": "object", "required": ["input"], "additionalProperties": False,
        "properties": {"input": {"type": "string", GRAMMAR_KEY: lark_to_gbnf(apply_patch)}}}}
    cities = {"type": "object", "required": ["city"], "additionalProperties": False,
              "properties": {"city": {"enum": ["Zürich", "Zagreb", "Zaragoza", "Zwolle"]},
                             "country_code": {"type": "string", "pattern": "^[A-Z]{2}$"},
                             "population": {"type": "integer"}}}
    weather = {"name": "get_weather", "parameters": cities}
    sql = 'root ::= "SELECT " [a-z]+ " FROM " [a-z]+ (" WHERE " [a-z]+ " = " [0-9]+)? ";"'
    stops = tok.stop_ids
    json_call = '<tool_call>\n{"name": "apply_patch", "arguments": {"input": "'
    xml_call = "<tool_call>\n<function=apply_patch>\n<parameter=input>\n"
    states = [  # (name, a new constraint, the text it has taken)
        ("patch json: *** Begin|", lambda: ToolCallConstraint(tok, [patch]),
         json_call + "*** Begin"),
        ("patch json: after \\|", lambda: ToolCallConstraint(tok, [patch]),
         json_call + "*** Begin Patch\\"),
        ("patch json: *** Update|", lambda: ToolCallConstraint(tok, [patch]),
         json_call + "*** Begin Patch\\n*** Update"),
        ("patch xml: *** Begin|", lambda: ToolCallConstraint(tok, [patch], xml=True),
         xml_call + "*** Begin"),
        ("patch xml: @@ line|", lambda: ToolCallConstraint(tok, [patch], xml=True),
         xml_call + "*** Begin Patch\n*** Update File: a.py\n@@"),
        ("schema: a key|", lambda: JsonObjectConstraint(tok, stops, schema=cities), '{"'),
        ("schema: an enum|", lambda: JsonObjectConstraint(tok, stops, schema=cities),
         '{"city": "'),
        ("schema: a pattern|", lambda: JsonObjectConstraint(tok, stops, schema=cities),
         '{"city": "Zagreb", "country_code": "'),
        ("call xml: a key|", lambda: ToolCallConstraint(tok, [weather], xml=True),
         "<tool_call>\n<function=get_weather>\n<parameter="),
        ("json: after \\|", lambda: JsonObjectConstraint(tok, stops), '{"a": "x\\'),
        ("gbnf: SELECT a|", lambda: TextConstraint(
            tok, stops, compiled_grammar(sql).recognizer(), reasoning_lead=False),
         "SELECT name"),
    ]
    print(f"\nthe pick alone at a held state ({picks} random logit rows each): "
          "greedy | temperature 1")
    for name, make, text in states:
        constraint = make()
        for t in tok.encode(text, add_special=False):
            if not constraint.allows(t):
                raise SystemExit(f"{name}: the constraint refuses {tok.token_bytes(t)!r}")
            constraint.push(t)
        figures = []
        for temperature in (0.0, 1.0):
            sampler = Sampler(SamplingParams(temperature=temperature, top_k=0, top_p=1.0,
                                             min_p=0.0, seed=1), constraint=constraint)
            rng = np.random.default_rng(0)
            times = []
            for _ in range(picks):
                logits = rng.standard_normal(tok.vocab_size).astype(np.float32) * 3
                t0 = time.perf_counter()
                sampler._constrained(logits)
                times.append(time.perf_counter() - t0)
            figures.append(f"median {1e3 * np.median(times):5.1f} ms, max "
                           f"{1e3 * max(times):5.1f} ms")
        print(f"  {name:26s} {figures[0]} | {figures[1]}")


if __name__ == "__main__":
    main()
