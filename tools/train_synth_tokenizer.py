"""Train the byte-level BPE tokenizer shipped as `strata/data/synth_tokenizer.json`.

Corpus: the running Python's stdlib `LICENSE.txt` plus every top-level `*.py` module of the stdlib
(sorted by name, no subpackages), so anyone with CPython 3.11 can rebuild the same file.
Usage: `python tools/train_synth_tokenizer.py [OUT.json]` (default: the shipped path).
"""
from __future__ import annotations

import sys
import sysconfig
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from strata.tool.synth import SPECIAL_TOKENS, TEXT_TAGS

# 4089 learned tokens + 7 special tokens = 4096 ids in all (a multiple of 256 for k-quants).
NUM_LEARNED_TOKENS = 4089
# Qwen2's pre-tokenizer split (llama.cpp's "qwen2" pre-tokenizer).
QWEN2_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
DEFAULT_OUT = (Path(__file__).resolve().parents[1] / "src" / "strata" / "data"
               / "synth_tokenizer.json")


def corpus_files() -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [stdlib / "LICENSE.txt"] + sorted(stdlib.glob("*.py"))
    return [f for f in files if f.is_file()]


def iter_corpus(files: list[Path]):
    for path in files:
        yield path.read_text(encoding="utf-8", errors="replace")


def build_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    return tok


def train(out_path: Path) -> Tokenizer:
    files = corpus_files()
    tok = build_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=NUM_LEARNED_TOKENS,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(iter_corpus(files), trainer=trainer, length=len(files))
    # Appended after training so the special ids come last, as in Qwen's vocabularies. As there,
    # the reasoning and tool-call tags are added but not special: they stay in decoded text.
    tok.add_tokens([AddedToken(t, special=t not in TEXT_TAGS, normalized=False)
                    for t in SPECIAL_TOKENS])
    out_path.write_text(tok.to_str(pretty=False), encoding="utf-8")
    return tok


def main(argv: list[str]) -> int:
    out_path = Path(argv[1]) if len(argv) > 1 else DEFAULT_OUT
    tok = train(out_path)
    print(f"wrote {out_path}: {tok.get_vocab_size()} tokens from {len(corpus_files())} files, "
          f"{out_path.stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
