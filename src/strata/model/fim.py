"""Fill-in-the-middle (code completion): a model's FIM tokens and the prompt of one completion.

A model trained for it (Qwen2.5-Coder, Qwen3-Coder, StarCoder, DeepSeek-Coder) writes the text
between a prefix and a suffix when they come in its token layout, other files first:
    <|repo_name|>NAME\\n<|file_sep|>PATH\\nTEXT\\n ... <|file_sep|>PATH\\n
    <|fim_prefix|>PREFIX<|fim_suffix|>SUFFIX<|fim_middle|>PROMPT
(the first line, Qwen's repository-level form, only with other files or the current file's path)
and ends the middle with its end-of-text token (or another FIM token).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from strata.errors import ModelFormatError, RequestError
from strata.model.arch import metadata_value

# llama.cpp's GGUF keys for the FIM tokens (gguf.Keys.Tokenizer.FIM_*_ID).
FIM_KEYS = {
    "prefix": "tokenizer.ggml.fim_pre_token_id",
    "suffix": "tokenizer.ggml.fim_suf_token_id",
    "middle": "tokenizer.ggml.fim_mid_token_id",
    "pad": "tokenizer.ggml.fim_pad_token_id",
    "repo": "tokenizer.ggml.fim_rep_token_id",
    "sep": "tokenizer.ggml.fim_sep_token_id",
}
# Where a file has no key: the token's spelling in the byte-level BPE vocabularies that have
# one (Qwen2.5/Qwen3, StarCoder 2, StarCoder 1 and SantaCoder, DeepSeek-Coder).
FIM_SPELLINGS = {
    "prefix": ("<|fim_prefix|>", "<fim_prefix>", "<fim-prefix>", "<｜fim▁begin｜>"),
    "suffix": ("<|fim_suffix|>", "<fim_suffix>", "<fim-suffix>", "<｜fim▁hole｜>"),
    "middle": ("<|fim_middle|>", "<fim_middle>", "<fim-middle>", "<｜fim▁end｜>"),
    "pad": ("<|fim_pad|>", "<fim_pad>", "<fim-pad>"),
    "repo": ("<|repo_name|>", "<repo_name>", "<reponame>"),
    "sep": ("<|file_sep|>", "<file_sep>", "<filename>"),
}
UNNAMED_FILE = "untitled"  # the current file's path when other files come and it has none
UNNAMED_REPO = "project"  # the <|repo_name|> line's name (no client sends one)


@dataclass(frozen=True)
class FimTokens:
    """The ids of a model's FIM tokens; the last three only where its vocabulary has them."""
    prefix: int
    suffix: int
    middle: int
    pad: int | None = None
    repo: int | None = None
    sep: int | None = None

    @property
    def ids(self) -> frozenset[int]:
        """Every FIM token: none belongs in a middle, so each ends one."""
        values = (self.prefix, self.suffix, self.middle, self.pad, self.repo, self.sep)
        return frozenset(i for i in values if i is not None)


def find_fim_tokens(meta: dict, token_id: Callable[[str], int | None], num_tokens: int,
                    source: str = "model") -> FimTokens | None:
    """The model's FIM tokens from llama.cpp's keys, else by their known spellings; None when
    the prefix, suffix or middle token is missing (the model does no fill-in-the-middle)."""
    found: dict[str, int | None] = {}
    for role, key in FIM_KEYS.items():
        found[role] = token_id_from_metadata(meta, key, num_tokens, source)
        if found[role] is not None:
            continue
        ids = (token_id(spelling) for spelling in FIM_SPELLINGS[role])
        found[role] = next((i for i in ids if i is not None), None)
    if None in (found["prefix"], found["suffix"], found["middle"]):
        return None
    return FimTokens(**found)


def token_id_from_metadata(meta: dict, key: str, num_tokens: int,
                           source: str = "model") -> int | None:
    """The token id metadata key `key` gives (None where the file has no such key), checked:
    an integer inside the vocabulary of `num_tokens`, else ModelFormatError naming the key."""
    value = meta.get(key)
    if value is None:
        return None
    token_id = metadata_value(value, int)
    if token_id is None:
        raise ModelFormatError(f"{source}: metadata key {key!r} has value {value!r}, expected "
                               "a token id (an integer); the metadata is corrupt")
    if not 0 <= token_id < num_tokens:
        raise ModelFormatError(f"{source}: {key} = {value} is outside the vocabulary "
                               f"of {num_tokens} tokens")
    return token_id


@dataclass
class InfillText:
    """What one completion knows: the current file around the cursor, the start of the
    middle already typed (`prompt`) and other files as (path, text), the most useful last."""
    prefix: str
    suffix: str
    prompt: str = ""
    extra: Sequence[tuple[str, str]] = ()
    filename: str | None = None  # the current file's path, where the client gives it


@dataclass
class InfillPrompt:
    tokens: list[int]
    num_extra: int       # other files kept (the last ones given)
    is_truncated: bool   # the prefix's start, the suffix's end or a file was left out


def build_infill(tokenizer, fim: FimTokens, text: InfillText,
                 max_tokens: int | None = None) -> InfillPrompt:
    """The prompt tokens of a completion, at most `max_tokens` of them (None: no limit).

    What does not fit is cut in this order: other files (the first ones given), then the
    prefix's start and the suffix's end, the suffix keeping at most a quarter of the room the
    prefix needs. Raises RequestError when the fixed part (special tokens, current path,
    `prompt`) alone is over the limit. Users' text never becomes a special token."""
    encode = tokenizer.encode_plain
    prefix, suffix, typed = encode(text.prefix), encode(text.suffix), encode(text.prompt)
    # other files need the file separator; without one they are left out
    extra = [encode(f"{path}\n{body}" + ("" if body.endswith("\n") else "\n"))
             for path, body in text.extra] if fim.sep is not None else []
    head = [tokenizer.bos_id] if tokenizer.add_bos and tokenizer.bos_id is not None else []
    path = text.filename or (UNNAMED_FILE if extra else None)
    repo, current = [], []  # the repository line; after the other files, the current path
    if path is not None and fim.sep is not None:
        repo = [fim.repo] + encode(UNNAMED_REPO + "\n") if fim.repo is not None else []
        current = [fim.sep] + encode(path + "\n")
    fixed = len(head) + len(repo) + len(current) + 3 + len(typed)
    if max_tokens is None:
        max_tokens = fixed + len(prefix) + len(suffix) + sum(len(e) + 1 for e in extra)
    room = max_tokens - fixed
    if room < 0:
        raise RequestError(f"the completion's fixed part (FIM tokens, path and prompt) is "
                           f"{fixed} tokens, more than the {max_tokens} the context leaves")
    num_suffix = min(len(suffix), room // 4)
    num_prefix = min(len(prefix), room - num_suffix)
    num_suffix = min(len(suffix), room - num_prefix)
    room -= num_prefix + num_suffix
    kept: list[list[int]] = []
    for tokens in reversed(extra):
        if len(tokens) + 1 > room:
            break
        kept.insert(0, [fim.sep] + tokens)
        room -= len(tokens) + 1
    if not kept and text.filename is None:
        repo, current = [], []  # a path line only introduces the current file after others
    out = head + repo + [t for file in kept for t in file] + current
    out += [fim.prefix] + prefix[len(prefix) - num_prefix:]
    out += [fim.suffix] + suffix[:num_suffix] + [fim.middle] + typed
    is_truncated = (num_prefix < len(prefix) or num_suffix < len(suffix)
                    or len(kept) < len(text.extra))
    return InfillPrompt(out, len(kept), is_truncated)
