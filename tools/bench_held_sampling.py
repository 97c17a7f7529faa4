"""Time the sampler on tool calls whose text is held to a grammar, with a vocabulary of
Qwen's size (no such tokenizer can be fetched here: a byte-level BPE of 150,000 tokens is
trained on random word-like text first, ~30 s, kept in /tmp). Random logits are the bad case
(a model's peaked logits mostly take the first draw).

    python tools/bench_held_sampling.py [--vocab 150000] [--draws 30]
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
    args = parser.parse_args()
    from strata.engine.json_schema import GRAMMAR_KEY
    from strata.engine.lark_grammar import lark_to_gbnf
    from strata.engine.sampling import Sampler, SamplingParams
    from strata.engine.tool_call_constraint import ToolCallConstraint

    sys.path.insert(0, str(ROOT / "tests"))
    from codex_apply_patch import APPLY_PATCH_LARK as APPLY_PATCH  # Codex's grammar

    tok = big_tokenizer(args.vocab)
    V = tok.vocab_size
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


if __name__ == "__main__":
    main()
