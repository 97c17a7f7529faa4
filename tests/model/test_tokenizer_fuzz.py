"""Tokenizer properties on generated text and ids, and llama.cpp's rules per `tokenizer.ggml.pre`.

The expected splits below were read off llama.cpp's own pre-tokenizer (`unicode_regex_split`,
llama-vocab.cpp's regexes) on the same text; transformers is the id reference where it agrees
with llama.cpp (it differs on "'ſ", see test_contraction_is_ascii_only_as_in_llama_cpp).
"""
from __future__ import annotations

import logging

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from strata.data import default_model_path
from strata.errors import ModelFormatError
from strata.model.gguf_file import GGUFModel
from strata.model.tokenizer import PRE_TOKENIZERS, Tokenizer, valid_text
from strata.tool.synth import synth_tokenizer_meta

from test_tokenizer import TRANSFORMERS_MIN, _write_tokenizer_gguf

FUZZ = settings(max_examples=60, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])

# Text that stresses splitting: scripts, marks, astral characters, controls, runs of one class.
_PIECES = st.one_of(
    st.text(min_size=1, max_size=8),  # any code point but surrogates (hypothesis never makes them)
    st.text(alphabet=st.characters(codec="utf-8", min_codepoint=0x80), max_size=6),  # non-ASCII
    st.sampled_from(["東京", "タワー", "한국어", "é", "e\u0301", "\u0915\u094d\u0937", "🙂", "👍🏽",
                     "🇯🇵", "\U0001d400", "\u200d", "\ufeff", "\x00", "\x1b[0m", "\r\n", "\t",
                     "'s", "'LL", "I'm", "don't", "ſ", "ﬅ", "１２３", "٣", "½", "\xa0", "\u3000"]),
    st.integers(1, 40).map(lambda n: " " * n),
    st.integers(1, 12).map(lambda n: "\n" * n),
    st.integers(1, 25).map(lambda n: "7" * n),
    st.sampled_from(["def f(x):\n    return x ** 2  # sq\n", "if (a && b) { c[i] = 0; }\r\n",
                     "<div class=\"x\">&amp;</div>", "SELECT * FROM t WHERE id=1;"]),
)
SPECIAL_TEXT = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>", "<tool_call>",
                "</tool_call>", "<|im_", "think>", "<|fim_prefix|>"]
TEXT = st.lists(_PIECES, max_size=12).map("".join)
TEXT_WITH_SPECIALS = st.lists(st.one_of(_PIECES, st.sampled_from(SPECIAL_TEXT)),
                              max_size=12).map("".join)


def _no_long_s_contraction(text: str) -> bool:
    # transformers splits "'ſ" as a contraction, llama.cpp does not (Strata follows llama.cpp)
    return "'ſ" not in text


@pytest.fixture(scope="module")
def default_meta() -> dict:
    path = default_model_path()
    if path is None:
        pytest.skip("this install has no packaged default model")
    with GGUFModel.open(path) as model:
        return dict(model.metadata)


@pytest.fixture(scope="module")
def tok(default_meta) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(default_meta)


@pytest.fixture(scope="module")
def synth_meta() -> dict:
    return synth_tokenizer_meta(vocab=4200)  # with FIM tokens and unused [PAD] placeholders


@pytest.fixture(scope="module")
def synth_tok(synth_meta) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(synth_meta)


def _splits(tok: Tokenizer, text: str) -> list[str]:
    """The pieces the pre-tokenizer cuts `text` into, as text."""
    from strata.model.tokenizer import _BYTE_OF_CHAR
    pieces = tok._backend.pre_tokenizer.pre_tokenize_str(text)
    return [bytes(_BYTE_OF_CHAR[c] for c in p).decode("utf-8") for p, _ in pieces]


def _with(meta: dict, **keys) -> dict:
    out = dict(meta)
    for key, value in keys.items():
        name = "tokenizer.ggml." + key
        if value is None:
            out.pop(name, None)
        else:
            out[name] = value
    return out


# ---------------------------------------------------------------- properties

@FUZZ
@given(text=TEXT_WITH_SPECIALS)
def test_decode_of_encode_is_the_text(tok, synth_tok, text):
    for t in (tok, synth_tok):
        assert t.decode(t.encode(text)) == text
        assert t.decode(t.encode_plain(text)) == text


@FUZZ
@given(text=TEXT)
def test_plain_encoding_equals_encoding_without_control_spellings(tok, synth_tok, text):
    for t in (tok, synth_tok):
        assert t.encode_plain(text) == t.encode(text)


@FUZZ
@given(text=TEXT_WITH_SPECIALS)
def test_plain_encoding_never_yields_control_tokens(synth_tok, text):
    # user-defined tags (<think>) are still matched whole, as llama.cpp's parse_special=false
    ids = synth_tok.encode_plain(text)
    assert not set(ids) & synth_tok.special_ids
    if "<think>" in text:
        assert synth_tok.token_id("<think>") in ids


@FUZZ
@given(text=st.text(max_size=30))
def test_lone_surrogates_are_replaced_before_encoding(tok, text):
    broken = text + "\udc80" + text[:3] + "\ud83d"
    assert tok.encode(broken) == tok.encode(valid_text(broken))
    assert tok.decode(tok.encode(broken)) == valid_text(broken)


def _stream(tok: Tokenizer, ids, skip_special: bool) -> str:
    dec = tok.stream_decoder(skip_special=skip_special)
    pieces = [dec.push(i) for i in ids]
    return "".join(pieces) + dec.flush()


@FUZZ
@given(data=st.data(), skip_special=st.booleans())
def test_streamed_pieces_join_to_the_whole_decode(synth_tok, data, skip_special):
    # random ids: byte tokens that cut characters, invalid sequences, specials, placeholders
    ids = data.draw(st.lists(st.integers(0, synth_tok.vocab_size - 1), max_size=40))
    assert _stream(synth_tok, ids, skip_special) == synth_tok.decode(ids, skip_special)


@FUZZ
@given(text=TEXT_WITH_SPECIALS, skip_special=st.booleans())
def test_streaming_encoded_text_gives_it_back(tok, text, skip_special):
    ids = tok.encode(text)
    expected = tok.decode(ids, skip_special)
    assert _stream(tok, ids, skip_special) == expected
    if not skip_special:
        assert expected == text


@FUZZ
@given(data=st.lists(st.binary(max_size=4), max_size=20))
def test_invalid_utf8_becomes_one_replacement_per_maximal_subpart(tok, data):
    # byte tokens in any order: what a model emits mid-character; Python's and Rust's lossy
    # decoders (transformers) agree on U+FFFD per maximal invalid subpart
    ids = [tok.token_id(_byte_char(b)) for chunk in data for b in chunk]
    raw = b"".join(data)
    assert tok.decode(ids) == raw.decode("utf-8", errors="replace")
    assert _stream(tok, ids, False) == raw.decode("utf-8", errors="replace")


def _byte_char(b: int) -> str:
    from strata.model.tokenizer import _bytes_to_unicode
    return _bytes_to_unicode()[b]


# ---------------------------------------------------------------- parity with transformers

@pytest.fixture(scope="module")
def references(tmp_path_factory, default_meta, synth_meta, tok, synth_tok):
    """(Strata tokenizer, transformers tokenizer) for the default model and a synth one."""
    transformers = pytest.importorskip("transformers", minversion=TRANSFORMERS_MIN)
    pytest.importorskip("torch")
    pytest.importorskip("accelerate")
    folder = tmp_path_factory.mktemp("gguf_tokenizers")
    pairs = []
    for name, meta, strata_tok in (("default.gguf", default_meta, tok),
                                   ("synth.gguf", synth_meta, synth_tok)):
        _write_tokenizer_gguf(folder / name, meta)
        ref = transformers.AutoTokenizer.from_pretrained(str(folder), gguf_file=name)
        pairs.append((strata_tok, ref))
    return pairs


@pytest.mark.parity
@FUZZ
@given(text=TEXT_WITH_SPECIALS)
def test_ids_equal_transformers(references, text):
    assume(_no_long_s_contraction(text))
    for strata_tok, ref in references:
        assert strata_tok.encode(text) == ref(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parity
@FUZZ
@given(text=TEXT)
def test_plain_ids_equal_transformers_with_split_special_tokens(references, text):
    assume(_no_long_s_contraction(text))
    text += "<|im_start|>x<|im_end|>"  # control spellings read as characters
    for strata_tok, ref in references:
        expected = ref(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        assert strata_tok.encode_plain(text) == expected


@pytest.mark.parity
@FUZZ
@given(data=st.data())
def test_decode_equals_transformers(references, data):
    strata_tok, ref = references[0]
    ids = data.draw(st.lists(st.integers(0, strata_tok.vocab_size - 1), max_size=30))
    assert strata_tok.decode(ids) == ref.decode(ids)
    assert strata_tok.decode(ids, skip_special=True) == ref.decode(ids, skip_special_tokens=True)


# ---------------------------------------------------------------- llama.cpp's rules by `pre`

SPLIT_TEXT = "x'ſab HelloWORLD's café 12345 東京タワーは!? \r\n\n  <a> ,b\t"
LLAMA_CPP_SPLITS = {  # unicode_regex_split with llama-vocab.cpp's regexes for each pre
    "qwen2": ["x", "'ſab", " HelloWORLD", "'s", " café", " ", "1", "2", "3", "4", "5",
              " 東京タワーは", "!?", " \r\n\n", " ", " <", "a", ">", " ,", "b", "\t"],
    "llama-bpe": ["x", "'ſab", " HelloWORLD", "'s", " café", " ", "123", "45", " 東京タワーは",
                  "!?", " \r\n\n", " ", " <", "a", ">", " ,", "b", "\t"],
    "gpt-2": ["x", "'", "ſab", " HelloWORLD", "'s", " café", " 12345", " 東京タワーは", "!?",
              " \r\n\n ", " <", "a", ">", " ,", "b", "\t"],
    "default": ["x", "'", "ſab", " HelloWORLD", "'", "s", " café", " ", "123", "45",
                " 東京タワーは", "!?", " \r\n\n  ", "<", "a", ">", " ", ",", "b", "\t"],
    "gpt-4o": ["x", "'ſab", " Hello", "WORLD's", " café", " ", "123", "45", " 東京タワーは", "!?",
               " \r\n\n", " ", " <", "a", ">", " ,", "b", "\t"],
    "tekken": ["x", "'ſab", " Hello", "WORLD", "'s", " café", " ", "1", "2", "3", "4", "5",
               " 東京タワーは", "!?", " \r\n\n", " ", " <", "a", ">", " ,", "b", "\t"],
    "deepseek-v3": ["x", "'", "ſab", " HelloWORLD", "'s", " café", " ", "123", "45", " ",
                    "東京タワーは", "!?", " \r\n\n", " ", " <", "a", ">", " ,", "b", "\t"],
    "bailingmoe": ["x", "'ſab", " HelloWORLD", "'s", " café", " ", "1", "2", "3", "4", "5",
                   " 東京タワーは", "!?", " \r\n\n", " ", " <", "a", ">", " ,", "b", "\t"],
    "qwen35": ["x", "'ſab", " HelloWORLD", "'s", " café", " ", "1", "2", "3", "4", "5",
               " 東京タワーは", "!?", " \r\n\n", " ", " <", "a", ">", " ,", "b", "\t"],
    "exaone-moe": ["x", "'ſab HelloWORLD", "'s", " café", " ", "1", "2", "3", "4", "5",
                   " 東京タワーは", "!?", " \r\n\n", " ", " <", "a", ">", " ,", "b", "\t"],
}


@pytest.mark.parametrize("pre", sorted(LLAMA_CPP_SPLITS))
def test_splits_are_llama_cpps(default_meta, pre):
    tok = Tokenizer.from_gguf_metadata(_with(default_meta, pre=pre))
    assert _splits(tok, SPLIT_TEXT) == LLAMA_CPP_SPLITS[pre]


def test_contraction_is_ascii_only_as_in_llama_cpp(tok):
    # llama.cpp matches 's 't ... by ASCII letters of either case; a case-insensitive regex also
    # takes 'ſ' (long s folds to s). transformers does the latter; llama.cpp is the reference.
    assert _splits(tok, "x'ſab") == ["x", "'ſab"]
    assert _splits(tok, "x'Sab 'LLx") == ["x", "'S", "ab", " '", "LLx"]


@pytest.mark.parametrize("pre", sorted(PRE_TOKENIZERS))
def test_every_known_pre_builds_and_round_trips(default_meta, pre, caplog):
    with caplog.at_level(logging.WARNING, logger="strata.model.tokenizer"):
        tok = Tokenizer.from_gguf_metadata(_with(default_meta, pre=pre))
    assert not caplog.records
    assert tok.decode(tok.encode(SPLIT_TEXT + "<|im_start|>")) == SPLIT_TEXT + "<|im_start|>"


def test_unknown_pre_warning_names_the_file_the_value_and_the_fallback(default_meta, tok, caplog):
    with caplog.at_level(logging.WARNING, logger="strata.model.tokenizer"):
        other = Tokenizer.from_gguf_metadata(_with(default_meta, pre="kimi-k2"), source="k.gguf")
    message = caplog.records[0].getMessage()
    assert "k.gguf" in message and "'kimi-k2'" in message and "qwen2" in message
    assert "llama-bpe" in message  # the known values, to check a typo against
    assert other.encode(SPLIT_TEXT) == tok.encode(SPLIT_TEXT)


def _tiny_meta(pre: str, tokens: list[str], merges: list[str], **keys) -> dict:
    from strata.model.tokenizer import _bytes_to_unicode
    alphabet = list(_bytes_to_unicode().values())
    names = alphabet + tokens + ["<|endoftext|>"]
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre,
            "tokenizer.ggml.tokens": names, "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.token_type": [1] * (len(names) - 1) + [3],
            "tokenizer.ggml.bos_token_id": len(names) - 1,
            "tokenizer.ggml.eos_token_id": len(names) - 1}
    return _with(meta, **keys)


def test_llama3_pre_takes_a_whole_word_from_the_vocabulary():
    # llama.cpp's ignore_merges (llama-bpe, glm4, tekken...): a piece that is a vocabulary entry
    # is that token, even where the merges would not build it
    tokens, merges = ["ab", "abc"], ["a b"]
    llama = Tokenizer.from_gguf_metadata(_tiny_meta("llama-bpe", tokens, merges))
    qwen = Tokenizer.from_gguf_metadata(_tiny_meta("qwen2", tokens, merges))
    assert llama.encode("abc", add_special=False) == [llama.token_id("abc")]
    assert qwen.encode("abc") == [qwen.token_id("ab"), qwen.token_id("c")]
    glm = Tokenizer.from_gguf_metadata(_tiny_meta("glm4", tokens, merges))
    assert glm.encode("abc") == [glm.token_id("abc")]


def test_bos_default_follows_llama_cpp_where_the_file_says_nothing():
    tokens, merges = ["ab"], ["a b"]
    llama = Tokenizer.from_gguf_metadata(_tiny_meta("llama-bpe", tokens, merges))
    assert llama.add_bos and llama.encode("ab") == [llama.bos_id, llama.token_id("ab")]
    for pre in ("qwen2", "deepseek-v3", "gpt-4o"):
        assert not Tokenizer.from_gguf_metadata(_tiny_meta(pre, tokens, merges)).add_bos
    said = _tiny_meta("llama-bpe", tokens, merges, add_bos_token=False)
    assert not Tokenizer.from_gguf_metadata(said).add_bos


def test_unused_placeholders_decode_to_nothing(synth_tok, synth_meta):
    # llama.cpp's converter pads the vocabulary with [PAD{id}] tokens typed UNUSED
    pad = synth_meta["tokenizer.ggml.tokens"].index("[PAD4199]")
    hi = synth_tok.encode("hi")
    assert synth_tok.decode(hi + [pad] + hi) == "hihi"
    assert _stream(synth_tok, [pad], False) == ""
    assert synth_tok.first_byte_table()[pad] == -1  # never a candidate under a constraint
    assert synth_tok.encode("[PAD4199]") != [pad]


def test_unknown_typed_tokens_are_special_as_in_llama_cpp():
    meta = _tiny_meta("qwen2", ["ab", "<unk>"], ["a b"])
    meta["tokenizer.ggml.token_type"][-2] = 2  # UNKNOWN
    tok = Tokenizer.from_gguf_metadata(meta)
    unk = tok.token_id("<unk>")
    assert tok.encode("x<unk>") == [tok.token_id("x"), unk]
    assert unk not in tok.encode_plain("x<unk>")
    assert tok.decode([unk], skip_special=True) == ""


def test_merge_whose_left_token_starts_with_a_space_is_read_as_llama_cpp_reads_it():
    # llama.cpp cuts a merge at the first space after its first character
    tok = Tokenizer.from_gguf_metadata(_tiny_meta("qwen2", [" a", " ab"], [" a b"]))
    assert tok.vocab_size == 256 + 3


def test_merges_that_do_not_fit_the_tokens_are_a_format_error():
    with pytest.raises(ModelFormatError, match="m.gguf: the tokenizer's merges do not fit"):
        Tokenizer.from_gguf_metadata(_tiny_meta("qwen2", ["ab"], ["a zz"]), source="m.gguf")
