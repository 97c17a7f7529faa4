"""The model's tokenizer, rebuilt from GGUF metadata: byte-level BPE through `tokenizers`.

Also the incremental detokenizer used for streaming (complete UTF-8 pieces only).
"""
from __future__ import annotations

import codecs
import logging
import re
import threading
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
from tokenizers import AddedToken, Regex, decoders, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import BPE

from strata.errors import ModelFormatError
from strata.model.arch import metadata_value
from strata.model.fim import FimTokens, find_fim_tokens, token_id_from_metadata

log = logging.getLogger(__name__)

# llama.cpp's token types (tokenizer.ggml.token_type).
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED = 1, 2, 3, 4, 5

# Split regexes by `tokenizer.ggml.pre`, as llama.cpp (src/llama-vocab.cpp) names and runs them.
# llama.cpp spells the contractions case by case: the models' own `(?i:'s|...)` also takes 'ſ'
# (U+017F, which case-folds to s), so "'ſx" would split as "'ſ" + "x" where llama.cpp keeps "'ſx".
CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
QWEN2_SPLIT = (CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN35_SPLIT = (CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_SPLIT = (CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# llama.cpp's stand-ins for the \p{Lu}/\p{Ll} runs of o200k-style regexes: any letter but a-z
# ("upper") and any letter but A-Z ("lower"); marks end a word there.
_UPPER, _LOWER = r"(?:(?=\p{L})[^a-z])", r"(?:(?=\p{L})[^A-Z])"
GPT4O_SPLIT = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{CONTRACTIONS}?"
               rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{CONTRACTIONS}?"
               r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
TEKKEN_SPLIT = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+"
                rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
                r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
DEEPSEEK3_SPLITS = (r"\p{N}{1,3}", r"[一-龥぀-ゟ゠-ヿ]+",
                    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+"
                    r"|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+"
                    r"|\s+(?!\S)|\s+")
BAILINGMOE_SPLIT = (r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+")
EXAONE_MOE_SPLIT = (CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}"
                    r"| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+")
# llama.cpp's "default": punctuation runs first, then GPT-2's regex, then digits in threes.
DEFAULT_SPLITS = (r"[\p{P}\$\+<=>\^~\|]+",
                  r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
                  r"\p{N}+", r"[0-9][0-9][0-9]")


@dataclass(frozen=True)
class PreTokenizerRule:
    """How llama.cpp pre-tokenizes for one `tokenizer.ggml.pre` value."""
    splits: tuple[str, ...]  # regexes applied one after another, each to the previous pieces
    ignore_merges: bool = False  # a piece that is a whole vocabulary entry is that token
    add_bos: bool = False  # BOS before a prompt where the file has no add_bos_token key


def _rules(names: str, rule: PreTokenizerRule) -> dict[str, PreTokenizerRule]:
    return dict.fromkeys(names.split(), rule)


PRE_TOKENIZERS = {
    **_rules("qwen2 deepseek-r1-qwen kormo f2llmv2 megrez stablelm2 hunyuan solar-open grok-2",
             PreTokenizerRule((QWEN2_SPLIT,))),
    **_rules("qwen35", PreTokenizerRule((QWEN35_SPLIT,))),
    **_rules("llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano",
             PreTokenizerRule((LLAMA3_SPLIT,), ignore_merges=True, add_bos=True)),
    **_rules("dbrx smaug-bpe chatglm-bpe", PreTokenizerRule((LLAMA3_SPLIT,))),
    **_rules("glm4 glm5", PreTokenizerRule((LLAMA3_SPLIT,), ignore_merges=True)),
    **_rules("gpt-2 phi-2 mpt olmo jais exaone4 trillion gigachat a.x-4.0 mellum granite-docling"
             " gpt2", PreTokenizerRule((GPT2_SPLIT,))),  # gpt2: Strata's own older alias
    **_rules("gpt-4o llama4 kanana2 talkie minimax-m2", PreTokenizerRule((GPT4O_SPLIT,))),
    **_rules("tekken", PreTokenizerRule((TEKKEN_SPLIT,), ignore_merges=True, add_bos=True)),
    **_rules("deepseek-v3 hunyuan-dense joyai-llm hy_v4", PreTokenizerRule(DEEPSEEK3_SPLITS)),
    **_rules("bailingmoe bailingmoe2 llada-moe", PreTokenizerRule((BAILINGMOE_SPLIT,))),
    **_rules("exaone-moe", PreTokenizerRule((EXAONE_MOE_SPLIT,))),
    **_rules("default", PreTokenizerRule(DEFAULT_SPLITS)),
}

# Names of end-of-turn tokens that also stop generation (chat models end a turn with them).
STOP_TOKEN_NAMES = ("<|im_end|>", "<|endoftext|>")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (the byte-level alphabet)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(printable, map(chr, chars)))


_BYTE_OF_CHAR = {c: b for b, c in _bytes_to_unicode().items()}


def _token_bytes(token: str, is_added: bool) -> bytes:
    """The bytes a vocabulary entry stands for. Added tokens are literal text; others are
    spelled in the byte-level alphabet (a char outside it is taken as its own UTF-8)."""
    if is_added:
        return token.encode("utf-8")
    out = bytearray()
    for ch in token:
        b = _BYTE_OF_CHAR.get(ch)
        if b is None:
            out += ch.encode("utf-8")
        else:
            out.append(b)
    return bytes(out)


class StreamDecoder:
    """Turns token ids into text pieces as they arrive, holding back the bytes of an incomplete
    multi-byte character until the rest arrives (invalid bytes become U+FFFD)."""

    def __init__(self, tokenizer: "Tokenizer", skip_special: bool = False):
        self._tok = tokenizer
        self._skip_special = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._lead = b""  # a character's first bytes that ended the prompt (`after`)

    def after(self, prompt_tokens: list[int]) -> "StreamDecoder":
        """Start after `prompt_tokens`: where they end inside a character (a prompt given as
        token ids), the character the first tokens complete is text of the output, whole (as
        vLLM's detokenizer has it), not a U+FFFD for its last bytes; where the output does not
        go on with that character, its first bytes are dropped."""
        tail = b"".join(self._tok.token_bytes(t) for t in prompt_tokens[-4:]
                        if t not in self._tok.special_ids)
        self._lead = _incomplete_character(tail)
        return self

    def push(self, token_id: int) -> str:
        """The text that is complete after this token ('' while a character is incomplete)."""
        if self._skip_special and token_id in self._tok.special_ids:
            return ""
        data = self._tok.token_bytes(token_id)
        if self._lead:
            lead, self._lead = self._lead, b""
            if data and _continues(lead, data):
                data = lead + data
                if _incomplete_character(data) == data:  # still short of its last bytes
                    self._lead = data
                    return ""
        return self._utf8.decode(data)

    def flush(self) -> str:
        """Whatever is held back, as replacement characters (call at the end of a stream)."""
        return self._utf8.decode(b"", final=True)


def _utf8_length(lead: int) -> int:
    """Bytes of the UTF-8 character that starts with byte `lead` (0: not a lead byte)."""
    return 2 if 0xC2 <= lead <= 0xDF else 3 if 0xE0 <= lead <= 0xEF else \
        4 if 0xF0 <= lead <= 0xF4 else 0


def _incomplete_character(data: bytes) -> bytes:
    """The first bytes of a character at the end of `data` that its last bytes would
    complete (b"" where it ends at a character's end)."""
    for back in range(1, min(4, len(data)) + 1):
        b = data[-back]
        if b & 0xC0 != 0x80:  # a lead byte or ASCII: the last character starts here
            need = _utf8_length(b)
            return data[-back:] if need > back else b""
    return b""


def _continues(lead: bytes, data: bytes) -> bool:
    """Whether `data` goes on with the character `lead` begins, as valid UTF-8."""
    whole = (lead + data)[:_utf8_length(lead[0])]
    try:
        whole.decode("utf-8")
        return True
    except UnicodeDecodeError as exc:  # short of its end, but valid so far: "unexpected end"
        return exc.start == 0 and exc.reason == "unexpected end of data"


@dataclass(frozen=True)
class PrefixTree:
    """Tokens as a tree of byte strings: a node is one distinct spelling (node 0 is b"", the
    root, tokens or not), its parent the longest other node that is a prefix of it. With the
    tokens sorted by (bytes, id), a node's own tokens and its subtree are runs of positions;
    its children's subtrees tile its subtree after its own tokens. N = nodes."""

    order: np.ndarray     # int32 [V]: the token ids by (bytes, id)
    position: np.ndarray  # int32 [V]: each id's place in `order`
    start: np.ndarray     # int32 [N + 1]: node n's own tokens are order[start[n]:start[n + 1]]
    end: np.ndarray       # int32 [N]: its subtree is order[start[n]:end[n]]
    child_at: np.ndarray  # int32 [N + 1]: its children are children[child_at[n]:child_at[n + 1]]
    children: np.ndarray  # int32 [N - 1]: every node but the root, grouped by parent, in order

    @classmethod
    def of(cls, spellings: list[bytes]) -> "PrefixTree":
        num_tokens = len(spellings)
        order = sorted(range(num_tokens), key=lambda i: (spellings[i], i))
        spelled, start, parent, end = [b""], [0], [-1], [num_tokens]
        path = [0]  # the nodes whose subtree is open: each a prefix of the next
        for at, token in enumerate(order):
            data = spellings[token]
            if data == spelled[-1]:
                continue  # one more token of the last node (the root's: an empty token)
            while not data.startswith(spelled[path[-1]]):  # the root's b"" stops it
                end[path.pop()] = at
            parent.append(path[-1])
            path.append(len(spelled))
            spelled.append(data)
            start.append(at)
            end.append(num_tokens)
        start.append(num_tokens)
        parent = np.array(parent[1:], dtype=np.int32)  # [N - 1], node 1 on
        order = np.array(order, dtype=np.int32)
        position = np.empty(num_tokens, dtype=np.int32)
        position[order] = np.arange(num_tokens, dtype=np.int32)
        return cls(order=order, position=position, start=np.array(start, dtype=np.int32),
                   end=np.array(end, dtype=np.int32),
                   child_at=np.concatenate(([0], np.cumsum(np.bincount(
                       parent, minlength=len(spelled))))).astype(np.int32),
                   children=(np.argsort(parent, kind="stable") + 1).astype(np.int32))


class Tokenizer:
    """Byte-level BPE tokenizer of a GGUF model (`tokenizer.ggml.model == "gpt2"`)."""

    def __init__(self, backend: HFTokenizer, tokens: list[str], special_ids: set[int],
                 added_ids: set[int], bos_id: int | None, eos_id: int | None, add_bos: bool,
                 fim: FimTokens | None = None, end_ids: Iterable[int] = (),
                 unused_ids: Iterable[int] = ()):
        """`end_ids`: tokens besides EOS that end a turn (llama.cpp's eot/eom ids).
        `unused_ids`: tokens of type UNUSED (the converter's padding entries of Qwen's
        vocabulary, e.g. '[PAD151669]'), which decode to nothing, as in llama.cpp."""
        self._backend = backend
        self._plain_backend: HFTokenizer | None = None  # encode_plain's, made on first use
        self._plain_lock = threading.Lock()
        self.fim = fim  # the fill-in-the-middle tokens, None where the model has none
        self._tokens = tokens
        self.special_ids = frozenset(special_ids)
        # every token matched whole in text: the special ones and user-defined tags (<think>)
        self.added_ids = frozenset(added_ids) | self.special_ids
        unused = frozenset(unused_ids)
        self._bytes = [b"" if i in unused else _token_bytes(t, i in self.added_ids)
                       for i, t in enumerate(tokens)]
        self._first_bytes = None  # first_byte_table()
        self._prefix_tree: PrefixTree | None = None  # prefix_tree()
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.add_bos = add_bos
        stops = [eos_id] if eos_id is not None else []
        stops += end_ids
        stops += [backend.token_to_id(name) for name in STOP_TOKEN_NAMES]
        self.stop_ids = frozenset(i for i in stops if i is not None)

    @classmethod
    def from_gguf_metadata(cls, meta: dict, source: str = "model") -> "Tokenizer":
        """Rebuild the tokenizer from llama.cpp's `tokenizer.ggml.*` keys."""
        model = meta.get("tokenizer.ggml.model")
        if model is None:
            raise ModelFormatError(f"{source}: no tokenizer.ggml.model key; the file has no "
                                   "tokenizer (Strata needs one embedded in the GGUF)")
        if model != "gpt2":
            raise ModelFormatError(
                f"{source}: tokenizer.ggml.model is {model!r}; Strata supports only 'gpt2' "
                "(byte-level BPE, as Qwen models use)")
        tokens = meta.get("tokenizer.ggml.tokens")
        merges = meta.get("tokenizer.ggml.merges")
        if not tokens or merges is None:
            missing = "tokenizer.ggml.tokens" if not tokens else "tokenizer.ggml.merges"
            raise ModelFormatError(f"{source}: metadata key {missing!r} is missing or empty")
        tokens = [str(t) for t in tokens]
        types = list(meta.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens))
        if len(types) != len(tokens):
            raise ModelFormatError(f"{source}: {len(types)} token types for {len(tokens)} tokens")
        vocab = {}
        for i, tok in enumerate(tokens):
            vocab.setdefault(tok, i)  # a duplicate spelling keeps its first id, as llama.cpp does
        pairs = []
        for m in merges:
            m = str(m)
            cut = m.find(" ", 1)  # from 1, as llama.cpp: a left token may start with a space
            if cut < 0:
                raise ModelFormatError(f"{source}: merge {m!r} is not two tokens split by a space")
            pairs.append((m[:cut], m[cut + 1:]))
        rule = _pre_tokenizer_rule(meta.get("tokenizer.ggml.pre"), source)
        try:
            bpe = BPE(vocab=vocab, merges=pairs, dropout=None, fuse_unk=False,
                      continuing_subword_prefix="", end_of_word_suffix="",
                      ignore_merges=rule.ignore_merges)
        except Exception as e:  # tokenizers' own error, e.g. a merge of a token not in the vocab
            raise ModelFormatError(f"{source}: the tokenizer's merges do not fit its tokens: "
                                   f"{e}; the metadata is corrupt") from e
        backend = HFTokenizer(bpe)
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(split), behavior="isolated") for split in rule.splits]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        backend.decoder = decoders.ByteLevel()

        # llama.cpp treats an UNKNOWN token like a control one: matched in text and skippable
        special_ids = {i for i, t in enumerate(types) if t in (TOKEN_CONTROL, TOKEN_UNKNOWN)}
        user_ids = {i for i, t in enumerate(types) if t == TOKEN_USER_DEFINED}
        fim = find_fim_tokens(meta, vocab.get, len(tokens), source)
        if fim is not None:  # as llama.cpp does: FIM tokens are control tokens whatever their
            special_ids |= fim.ids  # type (Qwen's files mark them user-defined)
            user_ids -= fim.ids
        # Control tokens are special (skippable in decode); user-defined ones (e.g. `<think>`)
        # are plain added tokens. Both are matched whole in text, so each encodes as one id.
        backend.add_special_tokens(
            [AddedToken(tokens[i], normalized=False, special=True) for i in sorted(special_ids)])
        backend.add_tokens(
            [AddedToken(tokens[i], normalized=False, special=False) for i in sorted(user_ids)])

        def opt_id(key: str) -> int | None:
            return token_id_from_metadata(meta, key, len(tokens), source)

        add_bos = meta.get("tokenizer.ggml.add_bos_token", rule.add_bos)
        if metadata_value(add_bos, bool) is None:
            raise ModelFormatError(f"{source}: metadata key 'tokenizer.ggml.add_bos_token' has "
                                   f"value {add_bos!r}, expected bool; the metadata is corrupt")
        end_ids = [opt_id(f"tokenizer.ggml.{key}_token_id") for key in ("eot", "eom")]
        return cls(backend, tokens, special_ids, special_ids | user_ids,
                   bos_id=opt_id("tokenizer.ggml.bos_token_id"),
                   eos_id=opt_id("tokenizer.ggml.eos_token_id"),
                   add_bos=metadata_value(add_bos, bool), fim=fim,
                   end_ids=[i for i in end_ids if i is not None],
                   unused_ids=[i for i, t in enumerate(types) if t == TOKEN_UNUSED])

    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    def token_text(self, token_id: int) -> str:
        return self._tokens[token_id]

    def token_bytes(self, token_id: int) -> bytes:
        return self._bytes[token_id]

    def first_byte_table(self) -> np.ndarray:
        """int16 [V]: each token's first byte, -1 for a token of no bytes (made once)."""
        if self._first_bytes is None:
            self._first_bytes = np.array([b[0] if b else -1 for b in self._bytes],
                                         dtype=np.int16)
        return self._first_bytes

    def prefix_tree(self) -> "PrefixTree":
        """The vocabulary's tokens as a tree of their bytes (made once: ~0.2 s for 150k)."""
        if self._prefix_tree is None:
            self._prefix_tree = PrefixTree.of(self._bytes)
        return self._prefix_tree

    def token_id(self, text: str) -> int | None:
        """The id of a vocabulary entry spelled exactly `text` (e.g. '<|im_end|>'), or None."""
        return self._backend.token_to_id(text)

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in the text become their single ids.
        `add_special` prepends BOS when the model asks for it (tokenizer.ggml.add_bos_token)."""
        ids = self._backend.encode(valid_text(text), add_special_tokens=False).ids
        if add_special and self.add_bos and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    def encode_plain(self, text: str) -> list[int]:
        """Token ids of `text` read as plain text: a control token's spelling in it (e.g. a
        source file that names '<|fim_prefix|>') is encoded as characters, not as the token."""
        with self._plain_lock:
            if self._plain_backend is None:
                self._plain_backend = HFTokenizer.from_str(self._backend.to_str())
                self._plain_backend.encode_special_tokens = True
        return self._plain_backend.encode(valid_text(text), add_special_tokens=False).ids

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        special = self.special_ids if skip_special else frozenset()
        data = b"".join(self._bytes[i] for i in ids if i not in special)
        return data.decode("utf-8", errors="replace")

    def stream_decoder(self, skip_special: bool = False) -> StreamDecoder:
        return StreamDecoder(self, skip_special)

    def is_special(self, token_id: int) -> bool:
        return token_id in self.special_ids


LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def valid_text(text: str) -> str:
    """`text` with each lone UTF-16 surrogate (a command-line argument's undecodable byte, a
    JSON escape of half a pair) as U+FFFD: the tokenizer takes only whole characters."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return LONE_SURROGATE.sub("\ufffd", text)
    return text


def _pre_tokenizer_rule(pre, source: str) -> PreTokenizerRule:
    if pre is None:  # a file from llama.cpp's converter before the key (April 2024)
        log.warning("%s: no tokenizer.ggml.pre key; splitting text the qwen2 way, as the Qwen "
                    "models Strata runs do (llama.cpp would split it its 'default' way)", source)
        return PRE_TOKENIZERS["qwen2"]
    rule = PRE_TOKENIZERS.get(str(pre))
    if rule is None:
        log.warning("%s: tokenizer.ggml.pre is %r, a pre-tokenizer Strata does not know; it splits "
                    "the text the qwen2 way instead, so the token ids can differ from the model's "
                    "own (llama.cpp refuses such a file). Known values: %s", source, str(pre),
                    ", ".join(sorted(PRE_TOKENIZERS)))
        return PRE_TOKENIZERS["qwen2"]
    return rule
