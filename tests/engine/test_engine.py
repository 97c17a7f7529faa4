"""Engine generation on a tiny synth model: greedy, lengths, stop strings, KV prefix reuse."""
from __future__ import annotations

import numpy as np
import pytest

from strata import Engine, EngineConfig, SamplingParams
from strata.engine.generate import collect
from strata.errors import ConfigError, RequestError

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    with Engine(EngineConfig(tiny_model_path, n_ctx=128)) as e:
        yield e


def prompt_ids(engine, text="The quick brown fox jumps over the lazy dog."):
    ids = engine.tokenize(text)
    assert len(ids) > 5
    return ids


def reference_greedy(engine, prompt: list[int], num_tokens: int) -> list[int]:
    """Greedy tokens recomputed from scratch each step (a fresh KV per step, whole sequence)."""
    seq = list(prompt)
    out = []
    for _ in range(num_tokens):
        kv = engine.model.new_kv(len(seq))
        logits = engine.model.forward(np.asarray(seq, dtype=np.int32), kv)[-1]
        logits[engine.tokenizer.vocab_size:] = -np.inf
        out.append(int(np.argmax(logits)))
        seq.append(out[-1])
    return out


def test_greedy_matches_recompute_and_is_deterministic(engine):
    prompt = prompt_ids(engine)
    params = SamplingParams(max_tokens=12, **GREEDY)
    engine.reset()
    first = collect(engine.generate(prompt, params))
    engine.reset()
    second = collect(engine.generate(prompt, params))
    assert first.token_ids == second.token_ids == reference_greedy(engine, prompt, 12)
    assert first.text == engine.detokenize(first.token_ids, skip_special=True)


def test_max_tokens_gives_length(engine):
    res = collect(engine.generate(prompt_ids(engine), SamplingParams(max_tokens=5, **GREEDY)))
    assert res.finish_reason == "length"
    assert len(res.token_ids) == 5
    assert res.stats.num_generated_tokens == 5
    assert res.stats.num_decode_forwards == 4  # the last token is never read back
    assert res.stats.prompt_tokens_per_s > 0 and res.stats.decode_tokens_per_s > 0


def test_eos_token_stops(engine):
    prompt = prompt_ids(engine)
    engine.reset()
    free = collect(engine.generate(prompt, SamplingParams(max_tokens=6, **GREEDY)))
    # Declare the 4th greedy token a stop token: generation ends there, without its text.
    stop_id = free.token_ids[3]
    first_hit = free.token_ids.index(stop_id)
    res = collect(engine.generate(prompt, SamplingParams(max_tokens=6, stop_token_ids=[stop_id],
                                                         **GREEDY)))
    assert res.finish_reason == "stop"
    assert res.token_ids == free.token_ids[:first_hit + 1]
    assert res.text == engine.detokenize(free.token_ids[:first_hit], skip_special=True)


def _pieces(engine, token_ids):
    dec = engine.tokenizer.stream_decoder(skip_special=True)
    return [dec.push(t) for t in token_ids]


def test_stop_string_split_across_tokens(engine):
    prompt = prompt_ids(engine)
    params = SamplingParams(max_tokens=24, **GREEDY)
    engine.reset()
    free = collect(engine.generate(prompt, params))
    pieces = _pieces(engine, free.token_ids)
    # A stop string made of the end of one token's text and the start of the next one's.
    i = next(i for i in range(3, len(pieces) - 1) if pieces[i] and pieces[i + 1])
    stop = pieces[i][-1] + pieces[i + 1][0]
    expected = free.text[:free.text.find(stop)]
    events = list(engine.generate(prompt, SamplingParams(max_tokens=24, stop=[stop], **GREEDY)))
    assert events[-1].finish_reason == "stop" and events[-1].stop_string == stop
    assert all(ev.finish_reason is None for ev in events[:-1])
    assert "".join(ev.text for ev in events) == expected
    assert len(events) <= i + 2


def test_stop_string_inside_one_token(engine):
    prompt = prompt_ids(engine)
    engine.reset()
    free = collect(engine.generate(prompt, SamplingParams(max_tokens=24, **GREEDY)))
    pieces = _pieces(engine, free.token_ids)
    i = next(i for i in range(2, len(pieces)) if len(pieces[i]) >= 2)
    stop = pieces[i][1:]
    res = collect(engine.generate(prompt, SamplingParams(max_tokens=24, stop=[stop], **GREEDY)))
    assert res.finish_reason == "stop"
    assert res.text == free.text[:free.text.find(stop)]


def test_prefix_reuse_gives_same_tokens_as_fresh_engine(engine, tiny_model_path):
    p1 = prompt_ids(engine)
    params = SamplingParams(max_tokens=6, **GREEDY)
    engine.reset()
    r1 = collect(engine.generate(p1, params))
    assert r1.stats.num_cached_tokens == 0
    # The next turn extends the conversation: everything in the KV is reused (the last
    # generated token was never read back, so the KV holds p1 + 5 of the 6 tokens).
    p2 = p1 + r1.token_ids + engine.tokenize(" And then?")
    r2 = collect(engine.generate(p2, params))
    assert r2.stats.num_cached_tokens == len(p1) + 5
    assert engine.num_cached_tokens == len(p2) + 5
    # A prompt that diverges inside p1 reuses only the common part.
    p3 = p1[:4] + engine.tokenize(" something else entirely")
    r3 = collect(engine.generate(p3, params))
    assert r3.stats.num_cached_tokens == 4
    # The same prompt again: all but its last token come from the KV.
    r3b = collect(engine.generate(p3, params))
    assert r3b.stats.num_cached_tokens == len(p3) - 1
    assert r3b.token_ids == r3.token_ids
    with Engine(EngineConfig(tiny_model_path, n_ctx=128)) as fresh:
        assert collect(fresh.generate(p2, params)).token_ids == r2.token_ids
        assert collect(fresh.generate(p3, params)).token_ids == r3.token_ids


def test_prompt_read_in_chunks_gives_same_tokens(engine, tiny_model_path):
    prompt = prompt_ids(engine, "A longer prompt, so that it spans several chunks of seven "
                                "tokens each when read by the chunked engine.")
    params = SamplingParams(max_tokens=8, **GREEDY)
    engine.reset()
    whole = collect(engine.generate(prompt, params))
    with Engine(EngineConfig(tiny_model_path, n_ctx=128, prompt_chunk_tokens=7)) as chunked:
        res = collect(chunked.generate(prompt, params))
    assert res.token_ids == whole.token_ids
    assert res.stats.num_prompt_tokens == len(prompt)


def test_too_long_prompt_names_both_numbers(engine):
    with pytest.raises(RequestError, match=r"200 tokens.*holds 128"):
        engine.generate([1] * 200, SamplingParams())


def test_bad_prompts(engine):
    with pytest.raises(RequestError, match="empty"):
        engine.generate([], SamplingParams())
    with pytest.raises(RequestError, match="999999"):
        engine.generate([1, 999999], SamplingParams())
    with pytest.raises(RequestError, match=r"logit_bias names the token id 888888, outside"):
        engine.generate([1, 2], SamplingParams(logit_bias={3: 1.0, 888888: -5.0}))


def test_context_full_ends_with_length(tiny_model_path):
    with Engine(EngineConfig(tiny_model_path, n_ctx=16)) as small:
        prompt = [5, 6, 7, 8, 9, 10]
        res = collect(small.generate(prompt, SamplingParams(max_tokens=100, **GREEDY)))
    # 16 cells: 6 prompt tokens + 10 read-back tokens, and one more sampled from the last logits.
    assert res.finish_reason == "length"
    assert len(res.token_ids) == 11


def test_seeded_sampling_is_reproducible(engine):
    prompt = prompt_ids(engine)
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, max_tokens=10,
                            seed=42, ignore_eos=True)
    a = collect(engine.generate(prompt, params)).token_ids
    b = collect(engine.generate(prompt, params)).token_ids
    assert a == b


def test_chat_renders_the_template(engine):
    messages = [{"role": "user", "content": "Hello!"}]
    text = engine.render_chat(messages)
    assert text == "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n"
    engine.reset()
    res = collect(engine.chat(messages, SamplingParams(max_tokens=3, **GREEDY)))
    assert res.stats.num_prompt_tokens == len(engine.tokenize(text, add_special=False))
    engine.reset()
    direct = collect(engine.generate(engine.tokenize(text, add_special=False),
                                     SamplingParams(max_tokens=3, **GREEDY)))
    assert res.token_ids == direct.token_ids


def test_config_errors(tiny_model_path, tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        EngineConfig(tmp_path / "nope.gguf")
    with pytest.raises(ConfigError, match=r"n_ctx \(--ctx-size\) = -1 must be >= 0"):
        EngineConfig(tiny_model_path, n_ctx=-1)
    with pytest.raises(ConfigError, match=r"prompt_chunk_tokens \(--read-chunk\) = 0"):
        EngineConfig(tiny_model_path, prompt_chunk_tokens=0)
    with pytest.raises(ConfigError, match=r"seed \(--seed\) = -1"):
        EngineConfig(tiny_model_path, seed=-1)
    with pytest.raises(ConfigError, match=r"threads \(--threads\) = 'x'"):
        EngineConfig(tiny_model_path, threads="x")
    with pytest.raises(ConfigError, match="larger than the model's context length 4096; use at "
                       "most 4096, or 0 for all of it"):
        Engine(EngineConfig(tiny_model_path, n_ctx=5000))


def test_ctx_size_0_is_the_models_whole_context(tiny_model_path):
    """llama.cpp's -c 0: the context the model was trained on (tiny's 4096 here; the default
    caps it at 8192, which a longer model's 0 goes past)."""
    from strata.config import DEFAULT_MAX_CTX_TOKENS

    assert EngineConfig(tiny_model_path, n_ctx=0).resolve_n_ctx(40960) == 40960
    assert EngineConfig(tiny_model_path).resolve_n_ctx(40960) == DEFAULT_MAX_CTX_TOKENS
    with Engine(EngineConfig(tiny_model_path, n_ctx=0)) as e:
        assert e.n_ctx == 4096 and e.kv.capacity == 4096


def test_default_context_is_model_context_capped(tiny_model_path):
    with Engine(EngineConfig(tiny_model_path)) as e:
        assert e.n_ctx == 4096  # tiny's context (4096) is under the 8192 cap
        assert e.kv.capacity == 4096


def test_qwen2moe_greedy_matches_recompute(tmp_path):
    from strata.tool.synth import synth_model

    path = tmp_path / "tiny-qwen2moe.gguf"
    synth_model(path, shape="tiny-qwen2moe", weight_type="f32", seed=4)
    with Engine(EngineConfig(path, n_ctx=64)) as e:
        prompt = prompt_ids(e)
        res = collect(e.generate(prompt, SamplingParams(max_tokens=8, **GREEDY)))
        assert res.token_ids == reference_greedy(e, prompt, 8)


def test_engine_seed_applies_when_the_request_has_none(tiny_model_path):
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, max_tokens=8,
                            ignore_eos=True)
    runs = []
    for seed in (11, 11, 12):
        with Engine(EngineConfig(tiny_model_path, n_ctx=64, seed=seed)) as e:
            runs.append(collect(e.generate(prompt_ids(e), params)).token_ids)
    assert runs[0] == runs[1] != runs[2]


@pytest.mark.parametrize("value, what", [(np.nan, "NaN"), (np.inf, "infinite")])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_nan_and_infinite_logits_are_reported(tiny_model_path, tmp_path, value, what,
                                              temperature):
    # An infinite output norm weight makes every logit +-inf: a softmax of that is NaN, and
    # a token was drawn from it all the same.
    from strata.errors import ModelFormatError
    from strata.model.gguf_file import GGUFModel

    with GGUFModel.open(tiny_model_path) as m:
        offset = m.tensor("output_norm.weight").offset_bytes
    data = bytearray(tiny_model_path.read_bytes())
    data[offset:offset + 4] = np.array([value], dtype=np.float32).tobytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    with Engine(EngineConfig(bad, n_ctx=32)) as e:
        with pytest.raises(ModelFormatError, match=f"{what} logits after 0 generated tokens"):
            collect(e.generate([5, 6, 7], SamplingParams(max_tokens=4,
                                                         temperature=temperature)))
