"""The default model's corpus (Python's own PSF-licensed prose) and its byte-level BPE tokenizer.

Plain text: the language reference topics of `pydoc_data.topics` and the stdlib's docstrings
(read with `ast` from the sorted source files, never imported); chat pairs: questions about those
topics and names, answered by their first paragraphs. Another Python version gives another corpus.
"""
from __future__ import annotations

import ast
import hashlib
import json
import platform
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from strata.model.chat import ChatTemplate, default_template
from strata.tool.synth import SPECIAL_TOKENS, TEXT_TAGS

NUM_LEARNED_TOKENS = 4089  # + 7 special tokens = 4096 ids
QWEN2_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# stdlib folders that are tests, demos or GUI tools rather than library documentation.
_SKIP_PARTS = {"test", "tests", "idlelib", "lib2to3", "turtledemo", "site-packages",
               "__pycache__", "ensurepip", "pydoc_data"}
_TOPIC_QUESTIONS = ("What is {s}?", "Tell me about {s}.", "Explain {s}.", "How does {s} work?")
_MIN_DOC_CHARS = 40
_ANSWER_CHARS = 500  # answers take whole paragraphs until they reach this many characters
_MAX_ANSWER_PARAGRAPHS = 5
_SECTION = re.compile(r"^(?P<title>[^\n]+)\n(?P<rule>[=\-~^*]{3,})$", re.M)


@dataclass(frozen=True)
class Corpus:
    """Training documents (plain text, or chat turns rendered with the shipped template)."""

    plain: list[str]
    chat: list[str]
    python_version: str

    @property
    def documents(self) -> list[str]:
        return self.plain + self.chat

    @property
    def sha256(self) -> str:
        text = json.dumps(self.documents, ensure_ascii=False)
        return hashlib.sha256(text.encode("utf-8")).hexdigest()


# ---------------------------------------------------------------- text clean-up

def unwrap(text: str) -> str:
    """Join hard-wrapped prose lines into one line per paragraph; keep indented blocks (code,
    grammar) and list items on their own lines."""
    out = []
    for para in re.split(r"\n\s*\n", text.strip("\n")):
        lines = para.split("\n")
        if any(line.startswith((" ", "\t")) for line in lines):
            out.append(para.rstrip())
            continue
        joined: list[str] = []
        for line in lines:
            is_item = re.match(r"(\* |- |\d+\. )", line) is not None
            if joined and not is_item:
                joined[-1] += " " + line.strip()
            else:
                joined.append(line.strip())
        out.append("\n".join(joined))
    return "\n\n".join(p for p in out if p)


def first_paragraphs(text: str) -> str:
    paras = text.split("\n\n")
    taken: list[str] = []
    for para in paras:
        taken.append(para)
        # A paragraph ending in ':' introduces the block after it: never end an answer there.
        is_full = (sum(len(p) for p in taken) >= _ANSWER_CHARS
                   or len(taken) >= _MAX_ANSWER_PARAGRAPHS)
        if is_full and not para.endswith(":"):
            break
    return "\n\n".join(taken)


def _subject(title: str) -> str:
    """'The "for" statement' -> 'the for statement', 'Code Objects' -> 'code objects' (as a
    user would type it); acronyms such as 'OR' stay."""
    words = title.replace('"', "").split()
    return " ".join(w.lower() if w[:1].isupper() and not w[1:2].isupper() else w for w in words)


# ---------------------------------------------------------------- the sources

def topic_sections() -> list[tuple[str, str]]:
    """(title, unwrapped body) of every pydoc topic and of its major sections, in key order."""
    from pydoc_data.topics import topics

    out = []
    for key in sorted(topics):
        text = topics[key]
        marks = list(_SECTION.finditer(text))
        for i, m in enumerate(marks):
            end = marks[i + 1].start() if i + 1 < len(marks) else len(text)
            body = unwrap(text[m.end():end])
            is_major = i == 0 or m.group("rule")[0] == "=" or " " in m.group("title")
            if body and is_major:
                out.append((m.group("title").strip(), body))
    return out


def stdlib_files() -> list[tuple[str, Path]]:
    """(module name, path) of the stdlib's public library modules, sorted by path."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in sorted(stdlib.rglob("*.py")):
        rel = path.relative_to(stdlib)
        parts = rel.with_suffix("").parts
        # Private modules are skipped, and by the same rule packages' __init__ files (the
        # shipped model was trained so: `json.dumps` is not in its corpus, `json.decoder` is).
        if _SKIP_PARTS.intersection(rel.parts) or any(p.startswith("_") for p in parts):
            continue
        out.append((".".join(parts), path))
    return out


def module_docstrings(module: str, path: Path) -> list[tuple[str, str, str]]:
    """(kind, qualified name, unwrapped docstring) of a module and its public classes and
    functions, in source order; [] when the file does not parse."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    out = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                if child.name.startswith("_"):
                    continue
                name = f"{prefix}.{child.name}"
                doc = ast.get_docstring(child)
                if doc and len(doc) >= _MIN_DOC_CHARS:
                    kind = "class" if isinstance(child, ast.ClassDef) else "function"
                    out.append((kind, name, unwrap(doc)))
                if isinstance(child, ast.ClassDef):
                    visit(child, name)

    doc = ast.get_docstring(tree)
    if doc and len(doc) >= _MIN_DOC_CHARS:
        out.append(("module", module, unwrap(doc)))
    visit(tree, module)
    return out


# ---------------------------------------------------------------- the corpus

def build_corpus() -> Corpus:
    template = ChatTemplate(default_template())

    def chat(question: str, answer: str) -> str:
        return template.render([{"role": "user", "content": question},
                                {"role": "assistant", "content": answer}],
                               add_generation_prompt=False)

    plain, chats = [], []
    for title, body in topic_sections():
        plain.append(f"{title}\n\n{body}")
        answer = first_paragraphs(body)
        for question in _TOPIC_QUESTIONS:
            chats.append(chat(question.format(s=_subject(title)), answer))
    for module, path in stdlib_files():
        entries = module_docstrings(module, path)
        if not entries:
            continue
        plain.append("\n\n".join(f"{name}\n{doc}" for _, name, doc in entries))
        for kind, name, doc in entries:
            question = {"module": f"What is the {name} module?",
                        "class": f"What is {name}?",
                        "function": f"What does {name} do?"}[kind]
            chats.append(chat(question, first_paragraphs(doc)))
    return Corpus(plain=plain, chat=chats, python_version=platform.python_version())


def _chat_text(chat: str) -> str:
    """A chat document without its special tokens (the BPE trainer must not learn them)."""
    return re.sub("|".join(re.escape(t) for t in SPECIAL_TOKENS), "\n", chat)


def train_tokenizer(corpus: Corpus) -> Tokenizer:
    """Byte-level BPE (qwen2 split) on the corpus, with synth's special tokens last."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=NUM_LEARNED_TOKENS, min_frequency=2,
                                  show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    texts = corpus.plain + [_chat_text(c) for c in corpus.chat]
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    tok.add_tokens([AddedToken(t, special=t not in TEXT_TAGS, normalized=False)
                    for t in SPECIAL_TOKENS])
    return tok


def tokenizer_meta(tok: Tokenizer) -> dict[str, object]:
    """llama.cpp's tokenizer.* GGUF keys for `tok` (as synth writes them) with the template."""
    doc = json.loads(tok.to_str())
    vocab = dict(doc["model"]["vocab"])
    for added in doc["added_tokens"]:
        vocab[added["content"]] = added["id"]
    tokens = [""] * len(vocab)
    for token, token_id in vocab.items():
        tokens[token_id] = token
    specials = {t for t in SPECIAL_TOKENS if t not in TEXT_TAGS}
    merges = [m if isinstance(m, str) else " ".join(m) for m in doc["model"]["merges"]]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3 if t in specials else 4 if t in TEXT_TAGS else 1
                                      for t in tokens],
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.eos_token_id": tokens.index("<|im_end|>"),
        "tokenizer.ggml.padding_token_id": tokens.index("<|endoftext|>"),
        "tokenizer.ggml.bos_token_id": tokens.index("<|endoftext|>"),
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": default_template(),
    }
