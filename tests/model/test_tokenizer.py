"""Tokenizer rebuilt from GGUF metadata: ids, decoding, streaming, special tokens, parity."""
from __future__ import annotations

import inspect
import json
import logging

import gguf
import numpy as np
import pytest
from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from strata.errors import ModelFormatError
from strata.model.tokenizer import LLAMA3_SPLIT, QWEN2_SPLIT, Tokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER_DEFINED = ["<think>", "</think>"]
# the parity extra's floor (pyproject.toml): older transformers read a GGUF tokenizer's
# user-defined tokens (<think>) as plain text and split some single bytes otherwise (4.57.6
# here, and the device image's), so these tests would measure that version, not Strata
TRANSFORMERS_MIN = "5.18"

SAMPLES = [
    "Hello, world!",
    "  leading spaces and trailing   ",
    "naïve café — 東京 🙂 Ünïcödé ∑ x² ≤ ∞",
    "digits 1234567890 and 3.14159, 1e-9, 0x1F",
    "def f(x):\n    return x ** 2  # square\n\n\tindented\ttabs\r\n",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<think>\nlet me see\n</think>\n\nanswer",
    "I'm sure they'll say it's what we'd've done",
    "\n\n\n   \n  x",
    "",
]


def _training_text() -> list[str]:
    # Text that ships with Python: docstrings of a few stdlib modules.
    import collections
    import email
    import functools
    import textwrap
    return [inspect.getdoc(m) or "" for m in (json, inspect, collections, email, functools,
                                              textwrap)] + SAMPLES


def train_bpe(vocab_size: int = 700) -> HFTokenizer:
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS + USER_DEFINED,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_training_text(), trainer)
    return tok


def gguf_tokenizer_meta(tok: HFTokenizer, pre: str = "qwen2", add_bos: bool = False) -> dict:
    """llama.cpp's tokenizer keys for `tok`, as GGUFModel.metadata would hold them."""
    vocab = tok.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [" ".join(m) for m in json.loads(tok.to_str())["model"]["merges"]]
    types = [3 if t in SPECIALS else 4 if t in USER_DEFINED else 1 for t in tokens]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": vocab["<|endoftext|>"],
        "tokenizer.ggml.eos_token_id": vocab["<|im_end|>"],
        "tokenizer.ggml.padding_token_id": vocab["<|endoftext|>"],
        "tokenizer.ggml.add_bos_token": add_bos,
    }


@pytest.fixture(scope="module")
def hf_tok() -> HFTokenizer:
    return train_bpe()


@pytest.fixture(scope="module")
def meta(hf_tok) -> dict:
    return gguf_tokenizer_meta(hf_tok)


@pytest.fixture(scope="module")
def tok(meta) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(meta)


@pytest.mark.parametrize("text", SAMPLES)
def test_ids_equal_the_source_tokenizer(tok, hf_tok, text):
    assert tok.encode(text) == hf_tok.encode(text).ids


@pytest.mark.parametrize("text", SAMPLES)
def test_decode_round_trip(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_special_and_user_defined_tokens_are_single_ids(tok, meta):
    tokens = meta["tokenizer.ggml.tokens"]
    for name in SPECIALS + USER_DEFINED:
        assert tok.encode(name) == [tokens.index(name)]
    ids = tok.encode("<|im_start|>user<|im_end|>")
    assert ids[0] == tokens.index("<|im_start|>") and ids[-1] == tokens.index("<|im_end|>")


def test_skip_special_drops_control_tokens_only(tok):
    ids = tok.encode("<|im_start|>hi<think>x</think><|im_end|>")
    assert tok.decode(ids, skip_special=True) == "hi<think>x</think>"


def test_ids_and_stop_ids(tok, meta):
    tokens = meta["tokenizer.ggml.tokens"]
    assert tok.vocab_size == len(tokens)
    assert tok.bos_id == tokens.index("<|endoftext|>")
    assert tok.eos_id == tokens.index("<|im_end|>")
    assert tok.stop_ids == {tokens.index("<|im_end|>"), tokens.index("<|endoftext|>")}


def test_end_of_turn_and_message_tokens_stop_generation(meta):
    # llama.cpp's eot/eom keys (a model whose turn ends on a token other than its EOS)
    tokens = meta["tokenizer.ggml.tokens"]
    eot, eom = tokens.index("<think>"), tokens.index("</think>")
    tok = Tokenizer.from_gguf_metadata(dict(meta, **{"tokenizer.ggml.eot_token_id": eot,
                                                     "tokenizer.ggml.eom_token_id": eom}))
    assert tok.stop_ids == {tokens.index("<|im_end|>"), tokens.index("<|endoftext|>"), eot, eom}
    with pytest.raises(ModelFormatError, match="eot_token_id = 9999 is outside"):
        Tokenizer.from_gguf_metadata(dict(meta, **{"tokenizer.ggml.eot_token_id": 9999}))


def test_bos_only_when_the_model_asks(hf_tok):
    with_bos = Tokenizer.from_gguf_metadata(gguf_tokenizer_meta(hf_tok, add_bos=True))
    ids = with_bos.encode("hello")
    assert ids[0] == with_bos.bos_id and ids[1:] == hf_tok.encode("hello").ids
    assert with_bos.encode("hello", add_special=False) == hf_tok.encode("hello").ids


def test_stream_decoder_holds_back_incomplete_characters(tok):
    text = "a🙂b東京é"
    ids = tok.encode(text)
    pieces = []
    dec = tok.stream_decoder()
    for i in ids:
        piece = dec.push(i)
        # Every piece is whole text: no replacement characters from split bytes.
        assert "\ufffd" not in piece
        pieces.append(piece)
    pieces.append(dec.flush())
    assert "".join(pieces) == text
    # The emoji's 4 bytes are spelled by single-byte tokens here (the BPE never saw it): some
    # pushes must have returned '' while holding bytes back.
    assert len(ids) > len(text) and "" in pieces[:-1]


def test_stream_decoder_flush_replaces_a_cut_character(tok):
    ids = tok.encode("🙂")
    dec = tok.stream_decoder()
    assert "".join(dec.push(i) for i in ids[:-1]) == ""
    assert dec.flush() == "\ufffd"


def _byte_ids(tok, data: bytes) -> list[int]:
    """The single-byte tokens spelling `data` (a byte-level BPE has one for every byte)."""
    single = {tok.token_bytes(i): i for i in range(tok.vocab_size)
              if len(tok.token_bytes(i)) == 1}
    return [single[bytes((b,))] for b in data]


@pytest.mark.parametrize("text, cut", [("東", 1), ("東", 2), ("🙂", 1), ("🙂", 3), ("é", 1)])
def test_a_character_begun_in_the_prompt_is_whole_in_the_output(tok, text, cut):
    """A prompt of token ids may end inside a character: the output's first text was a
    U+FFFD for the character's last bytes; it is the character, whole (as vLLM's)."""
    data = text.encode()
    prompt = tok.encode("x") + _byte_ids(tok, data[:cut])
    dec = tok.stream_decoder().after(prompt)
    pieces = [dec.push(i) for i in _byte_ids(tok, data[cut:]) + tok.encode("ab")]
    assert "".join(pieces) + dec.flush() == text + "ab"
    # an output that does not go on with the character drops its first bytes
    dec = tok.stream_decoder().after(prompt)
    assert "".join(dec.push(i) for i in tok.encode("ab")) + dec.flush() == "ab"
    dec = tok.stream_decoder().after(tok.encode("whole é"))  # nothing begun: as before
    assert "".join(dec.push(i) for i in _byte_ids(tok, data)) == text


def test_lone_surrogates_encode_as_replacement_characters(tok):
    # an undecodable command-line byte ("\udcff") or half of a UTF-16 pair from JSON
    assert tok.encode("a\udcffb\ud83d") == tok.encode("a\ufffdb\ufffd")
    assert tok.encode_plain("\ud800") == tok.encode("\ufffd")
    assert tok.decode(tok.encode("x\udc80")) == "x\ufffd"


def test_sentencepiece_model_is_refused(meta):
    with pytest.raises(ModelFormatError, match="'llama'"):
        Tokenizer.from_gguf_metadata(dict(meta, **{"tokenizer.ggml.model": "llama"}))


def test_missing_tokenizer_is_refused(meta):
    bad = {k: v for k, v in meta.items() if k != "tokenizer.ggml.model"}
    with pytest.raises(ModelFormatError, match="tokenizer.ggml.model"):
        Tokenizer.from_gguf_metadata(bad)
    with pytest.raises(ModelFormatError, match="tokenizer.ggml.merges"):
        Tokenizer.from_gguf_metadata({k: v for k, v in meta.items()
                                      if k != "tokenizer.ggml.merges"})


def test_unknown_pre_tokenizer_warns_and_splits_like_qwen2(meta, tok, caplog):
    with caplog.at_level(logging.WARNING, logger="strata.model.tokenizer"):
        other = Tokenizer.from_gguf_metadata(dict(meta, **{"tokenizer.ggml.pre": "mystery-pre"}))
    assert "mystery-pre" in caplog.text
    for text in SAMPLES:
        assert other.encode(text) == tok.encode(text)


def test_a_file_without_pre_tokenizer_warns_and_splits_like_qwen2(meta, tok, caplog):
    # llama.cpp's converters before the key existed (early Qwen1.5-MoE files) wrote none
    bare = {k: v for k, v in meta.items() if k != "tokenizer.ggml.pre"}
    with caplog.at_level(logging.WARNING, logger="strata.model.tokenizer"):
        other = Tokenizer.from_gguf_metadata(bare)
    assert "no tokenizer.ggml.pre" in caplog.text
    for text in SAMPLES:  # GPT-2's split differs on some (runs of newlines and spaces)
        assert other.encode(text) == tok.encode(text)


def test_llama3_split_for_llama_bpe_pre(meta, hf_tok):
    llama = Tokenizer.from_gguf_metadata(dict(meta, **{"tokenizer.ggml.pre": "llama-bpe"}))
    ref = HFTokenizer.from_str(hf_tok.to_str())
    ref.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    # qwen2 splits every digit; llama3 keeps up to three together.
    assert [p for p, _ in ref.pre_tokenizer.pre_tokenize_str("1234567")] == ["123", "456", "7"]
    for text in SAMPLES:
        assert llama.encode(text) == ref.encode(text).ids


def _write_tokenizer_gguf(path, meta: dict) -> None:
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_tokenizer_model(meta["tokenizer.ggml.model"])
    w.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    w.add_token_list(meta["tokenizer.ggml.tokens"])
    w.add_token_merges(meta["tokenizer.ggml.merges"])
    w.add_token_types(meta["tokenizer.ggml.token_type"])
    w.add_bos_token_id(meta["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"])
    w.add_pad_token_id(meta["tokenizer.ggml.padding_token_id"])
    w.add_add_bos_token(meta["tokenizer.ggml.add_bos_token"])
    # transformers' GGUF reader wants a model config too: a minimal qwen3moe one.
    for key, value in (("block_count", 1), ("context_length", 64), ("embedding_length", 8),
                       ("feed_forward_length", 8), ("attention.head_count", 1),
                       ("expert_count", 2), ("expert_used_count", 1)):
        w.add_uint32(f"qwen3moe.{key}", value)
    w.add_float32("qwen3moe.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_float32("qwen3moe.rope.freq_base", 10000.0)
    w.add_tensor("token_embd.weight", np.zeros((len(meta["tokenizer.ggml.tokens"]), 8),
                                               dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parity
def test_ids_equal_transformers_gguf_tokenizer(tmp_path, meta, tok):
    transformers = pytest.importorskip("transformers", minversion=TRANSFORMERS_MIN)
    pytest.importorskip("torch")
    _write_tokenizer_gguf(tmp_path / "tok.gguf", meta)
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="tok.gguf")
    for text in SAMPLES:
        expected = ref(text, add_special_tokens=False)["input_ids"]
        assert tok.encode(text) == expected, text
        assert tok.decode(expected) == ref.decode(expected)


@pytest.mark.parity
def test_synth_model_tokenizer_equals_transformers(tmp_path):
    transformers = pytest.importorskip("transformers", minversion=TRANSFORMERS_MIN)
    pytest.importorskip("torch")
    from strata.model.gguf_file import GGUFModel
    from strata.tool.synth import synth_model

    synth_model(tmp_path / "tiny.gguf", shape="tiny", weight_type="f16")
    with GGUFModel.open(tmp_path / "tiny.gguf") as model:
        tok = Tokenizer.from_gguf_metadata(model.metadata)
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="tiny.gguf")
    for text in SAMPLES + ["<tool_call>\n{\"name\": \"f\"}\n</tool_call>"]:
        expected = ref(text, add_special_tokens=False)["input_ids"]
        assert tok.encode(text) == expected, text
    assert tok.encode("<|im_start|>") == [tok.token_id("<|im_start|>")]


@pytest.mark.parametrize("key, value, message", [
    # ValueError and TypeError tracebacks from int()
    ("tokenizer.ggml.eos_token_id", "abc", "'tokenizer.ggml.eos_token_id' has value 'abc'"),
    ("tokenizer.ggml.bos_token_id", [1, 2], "'tokenizer.ggml.bos_token_id' has value [1, 2]"),
    ("tokenizer.ggml.eot_token_id", float("nan"), "'tokenizer.ggml.eot_token_id' has value nan"),
    ("tokenizer.ggml.fim_pre_token_id", "x", "'tokenizer.ggml.fim_pre_token_id' has value 'x'"),
    # these were read silently as token 1 and as token 5
    ("tokenizer.ggml.eos_token_id", True, "'tokenizer.ggml.eos_token_id' has value True"),
    ("tokenizer.ggml.eom_token_id", 5.5, "'tokenizer.ggml.eom_token_id' has value 5.5"),
    # and this as True: a BOS the model never asked for before every prompt
    ("tokenizer.ggml.add_bos_token", "false",
     "'tokenizer.ggml.add_bos_token' has value 'false', expected bool"),
])
def test_tokenizer_keys_of_the_wrong_type_are_named(meta, key, value, message):
    with pytest.raises(ModelFormatError) as info:
        Tokenizer.from_gguf_metadata(dict(meta, **{key: value}), source="m.gguf")
    assert message in str(info.value) and "m.gguf" in str(info.value)


def test_tokenizer_keys_of_the_right_type_still_read(meta):
    # an id stored as a float of integral value (some converters) and add_bos as 0/1
    tok = Tokenizer.from_gguf_metadata(dict(meta, **{"tokenizer.ggml.eos_token_id": 3.0,
                                                     "tokenizer.ggml.add_bos_token": 1}))
    assert (tok.eos_id, tok.add_bos) == (3, True)
