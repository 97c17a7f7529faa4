"""Fill-in-the-middle: finding a model's FIM tokens, plain-text encoding, and the exact token
layout and cuts of a completion's prompt."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strata.errors import ModelFormatError, RequestError
from strata.model.fim import FIM_KEYS, FimTokens, InfillText, build_infill, find_fim_tokens
from strata.model.tokenizer import Tokenizer
from strata.tool.synth import FIM_TOKENS, synth_tokenizer_meta

BASE_VOCAB = 4096  # the shipped synth tokenizer
FIM_IDS = dict(zip(("prefix", "middle", "suffix", "pad", "repo", "sep"),
                   range(BASE_VOCAB, BASE_VOCAB + 6)))  # Qwen's order, after the base


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf_metadata(synth_tokenizer_meta(BASE_VOCAB + 64))


def test_synth_vocabulary_with_room_holds_qwens_fim_tokens(tok):
    assert tok.fim == FimTokens(**FIM_IDS)
    assert [tok.token_text(i) for i in range(BASE_VOCAB, BASE_VOCAB + 6)] == list(FIM_TOKENS)
    assert tok.fim.ids == frozenset(range(BASE_VOCAB, BASE_VOCAB + 6))
    # typed user-defined in the file, as in Qwen's; control tokens here, as llama.cpp makes them
    meta = synth_tokenizer_meta(BASE_VOCAB + 64)
    assert meta["tokenizer.ggml.token_type"][BASE_VOCAB:BASE_VOCAB + 7] == [4] * 6 + [5]
    assert all(tok.is_special(i) for i in tok.fim.ids)
    assert tok.decode([FIM_IDS["prefix"], 64], skip_special=True) == "a"


def test_a_vocabulary_without_room_has_none():
    assert Tokenizer.from_gguf_metadata(synth_tokenizer_meta(BASE_VOCAB)).fim is None
    assert Tokenizer.from_gguf_metadata(synth_tokenizer_meta(BASE_VOCAB + 5)).fim is None


def test_keys_win_over_spellings():
    meta = synth_tokenizer_meta(BASE_VOCAB + 64)
    meta[FIM_KEYS["prefix"]] = 4110
    meta[FIM_KEYS["sep"]] = 4111
    fim = Tokenizer.from_gguf_metadata(meta).fim
    assert (fim.prefix, fim.suffix, fim.middle, fim.sep) == (4110, FIM_IDS["suffix"],
                                                             FIM_IDS["middle"], 4111)


def test_a_key_outside_the_vocabulary_is_a_format_error():
    meta = synth_tokenizer_meta(BASE_VOCAB + 64)
    meta[FIM_KEYS["middle"]] = BASE_VOCAB + 64
    with pytest.raises(ModelFormatError, match="fim_mid_token_id = 4160 is outside"):
        Tokenizer.from_gguf_metadata(meta)


def test_the_three_needed_tokens_or_nothing():
    spellings = {"<|fim_prefix|>": 1, "<|fim_suffix|>": 2, "<fim_middle>": 3, "<filename>": 4}
    fim = find_fim_tokens({}, spellings.get, 10)
    assert fim == FimTokens(prefix=1, suffix=2, middle=3, sep=4)
    del spellings["<fim_middle>"]
    assert find_fim_tokens({}, spellings.get, 10) is None
    assert find_fim_tokens({FIM_KEYS["middle"]: 7}, spellings.get, 10).middle == 7


def test_plain_encoding_keeps_control_spellings_as_text(tok):
    text = "x = '<|fim_prefix|>' + '<|im_end|>'"
    plain = tok.encode_plain(text)
    assert not set(plain) & (tok.fim.ids | tok.special_ids)
    assert tok.decode(plain) == text
    assert FIM_IDS["prefix"] in tok.encode(text)  # the prompt encoding reads them as tokens


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_characters="<"), max_size=60))
def test_plain_encoding_equals_encoding_where_no_token_is_spelled(tok, text):
    assert tok.encode_plain(text) == tok.encode(text, add_special=False)


def _layout(tok, *parts):
    """Token ids of a layout: ints stay, strings are encoded as plain text."""
    out = []
    for part in parts:
        out += [part] if isinstance(part, int) else tok.encode_plain(part)
    return out


def test_layout_of_a_completion(tok):
    f = FIM_IDS
    got = build_infill(tok, tok.fim, InfillText("def f(x):\n    ", "\n\nprint(f(2))\n", "ret"))
    assert got.tokens == _layout(tok, f["prefix"], "def f(x):\n    ", f["suffix"],
                                 "\n\nprint(f(2))\n", f["middle"], "ret")
    assert (got.num_extra, got.is_truncated) == (0, False)


def test_layout_with_other_files_and_a_path(tok):
    f = FIM_IDS
    text = InfillText("a", "b", extra=[("u.py", "import os"), ("v.py", "x = 1\n")])
    got = build_infill(tok, tok.fim, text)
    assert got.tokens == _layout(tok, f["repo"], "project\n", f["sep"], "u.py\nimport os\n",
                                 f["sep"], "v.py\nx = 1\n", f["sep"], "untitled\n", f["prefix"],
                                 "a", f["suffix"], "b", f["middle"])
    assert got.num_extra == 2
    named = build_infill(tok, tok.fim, InfillText("a", "b", filename="src/m.py"))
    assert named.tokens == _layout(tok, f["repo"], "project\n", f["sep"], "src/m.py\n",
                                   f["prefix"], "a", f["suffix"], "b", f["middle"])


def test_other_files_need_a_file_separator(tok):
    fim = FimTokens(prefix=FIM_IDS["prefix"], suffix=FIM_IDS["suffix"],
                    middle=FIM_IDS["middle"])
    got = build_infill(tok, fim, InfillText("a", "b", extra=[("u.py", "import os")],
                                            filename="m.py"))
    assert got.tokens == _layout(tok, fim.prefix, "a", fim.suffix, "b", fim.middle)
    assert (got.num_extra, got.is_truncated) == (0, True)


def test_without_a_repository_token_the_files_come_first(tok):
    fim = FimTokens(prefix=FIM_IDS["prefix"], suffix=FIM_IDS["suffix"],
                    middle=FIM_IDS["middle"], sep=FIM_IDS["sep"])
    got = build_infill(tok, fim, InfillText("a", "b", extra=[("u.py", "x\n")]))
    assert got.tokens == _layout(tok, fim.sep, "u.py\nx\n", fim.sep, "untitled\n", fim.prefix,
                                 "a", fim.suffix, "b", fim.middle)


def test_a_model_that_wants_bos_gets_it_first():
    meta = dict(synth_tokenizer_meta(BASE_VOCAB + 64), **{"tokenizer.ggml.add_bos_token": True})
    tok = Tokenizer.from_gguf_metadata(meta)
    got = build_infill(tok, tok.fim, InfillText("a", "b"))
    assert got.tokens[:2] == [tok.bos_id, FIM_IDS["prefix"]]


PREFIX = "".join(f"line_{i} = {i}\n" for i in range(40))
SUFFIX = "".join(f"after_{i}()\n" for i in range(40))


def test_cuts_keep_the_prefixs_end_and_the_suffixs_start(tok):
    prefix, suffix = tok.encode_plain(PREFIX), tok.encode_plain(SUFFIX)
    limit = 3 + 100
    got = build_infill(tok, tok.fim, InfillText(PREFIX, SUFFIX), limit)
    assert len(got.tokens) == limit and got.is_truncated
    # the suffix gets a quarter of the room, the prefix the rest
    assert got.tokens == ([FIM_IDS["prefix"]] + prefix[-75:] + [FIM_IDS["suffix"]]
                          + suffix[:25] + [FIM_IDS["middle"]])


def test_a_short_prefix_leaves_its_room_to_the_suffix(tok):
    suffix = tok.encode_plain(SUFFIX)
    got = build_infill(tok, tok.fim, InfillText("x = ", SUFFIX), 3 + 60)
    n_prefix = len(tok.encode_plain("x = "))
    assert got.tokens[-(61 - n_prefix):-1] == suffix[:60 - n_prefix]
    assert len(got.tokens) == 63


def test_other_files_go_first_the_earliest_first(tok):
    files = [(f"f{i}.py", f"value_{i} = {i}\n") for i in range(5)]
    whole = build_infill(tok, tok.fim, InfillText("a", "b", extra=files))
    per_file = len(_layout(tok, 0, "f0.py\nvalue_0 = 0\n"))
    got = build_infill(tok, tok.fim, InfillText("a", "b", extra=files),
                       len(whole.tokens) - per_file)  # one file too many
    assert got.num_extra == 4 and got.is_truncated
    repo = len(_layout(tok, 0, "project\n"))
    assert got.tokens == whole.tokens[:repo] + whole.tokens[repo + per_file:]
    assert tok.decode(got.tokens).startswith("<|repo_name|>project\n<|file_sep|>f1.py\n")


def test_a_fixed_part_over_the_limit_is_refused(tok):
    typed = "one two three four five six seven eight nine ten"
    fixed = 3 + len(tok.encode_plain(typed))
    with pytest.raises(RequestError, match=f"fixed part .* is {fixed} tokens, more than the "
                                           f"{fixed - 1} the context leaves"):
        build_infill(tok, tok.fim, InfillText("a", "b", prompt=typed), fixed - 1)
    assert len(build_infill(tok, tok.fim, InfillText("a", "b", prompt=typed), fixed).tokens) \
        == fixed  # nothing of the file is left, but it fits


@settings(max_examples=80, deadline=None)
@given(prefix=st.text(max_size=80), suffix=st.text(max_size=80), typed=st.text(max_size=6),
       files=st.lists(st.tuples(st.text(max_size=5), st.text(max_size=30)), max_size=4),
       limit=st.integers(30, 200))
def test_any_completion_fits_its_limit_and_keeps_its_frame(tok, prefix, suffix, typed, files,
                                                           limit):
    text = InfillText(prefix, suffix, typed, files)
    try:
        got = build_infill(tok, tok.fim, text, limit)
    except RequestError:
        assert 3 + len(tok.encode_plain(typed)) > limit - 10  # only a long fixed part fails
        return
    assert len(got.tokens) <= limit
    ids = got.tokens
    assert ids.count(FIM_IDS["prefix"]) == ids.count(FIM_IDS["suffix"]) == 1
    assert ids.count(FIM_IDS["middle"]) == 1 and ids.index(FIM_IDS["middle"]) == (
        len(ids) - 1 - len(tok.encode_plain(typed)))
    assert ids.count(FIM_IDS["sep"]) == (got.num_extra + 1 if got.num_extra else 0)
    whole = build_infill(tok, tok.fim, text)
    assert got.is_truncated == (len(got.tokens) < len(whole.tokens) or not whole.num_extra
                                == got.num_extra)
