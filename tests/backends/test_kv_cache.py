"""KVCache: append / commit / truncate keep exact cells, and a full cache says so."""
import numpy as np
import pytest

from strata.engine.kv import KVCache
from strata.errors import ConfigError, RequestError
from strata.model.arch import ModelSpec

SPEC = ModelSpec(arch="qwen3moe", n_layers=3, hidden=32, n_heads=4, n_kv_heads=2, head_dim=8,
                 n_experts=4, n_experts_used=2, expert_ffn=16, vocab=100)


def _rows(rng, num_tokens):
    return (rng.standard_normal((2, num_tokens, 8)).astype(np.float32),
            rng.standard_normal((2, num_tokens, 8)).astype(np.float32))


def _fill(kv, rng, num_tokens):
    """Append num_tokens rows to every layer and commit; return what was written per layer."""
    written = [_rows(rng, num_tokens) for _ in range(SPEC.n_layers)]
    for layer, (k, v) in enumerate(written):
        keys, values = kv.append(layer, k, v)
        assert keys.shape == (2, kv.num_tokens + num_tokens, 8)
        np.testing.assert_array_equal(keys[:, -num_tokens:], k)
        np.testing.assert_array_equal(values[:, -num_tokens:], v)
    kv.commit(num_tokens)
    return written


def test_append_commit_and_views():
    rng = np.random.default_rng(0)
    kv = KVCache(SPEC, 10)
    assert kv.num_tokens == 0 and kv.capacity == 10 and kv.room_tokens == 10
    first = _fill(kv, rng, 3)
    second = _fill(kv, rng, 1)
    assert kv.num_tokens == 4 and kv.room_tokens == 6
    for layer in range(SPEC.n_layers):
        np.testing.assert_array_equal(
            kv.keys(layer), np.concatenate([first[layer][0], second[layer][0]], axis=1))
        np.testing.assert_array_equal(
            kv.values(layer), np.concatenate([first[layer][1], second[layer][1]], axis=1))
    assert kv.nbytes == 2 * 3 * 2 * 10 * 8 * 4


def test_uncommitted_rows_are_not_part_of_the_sequence():
    rng = np.random.default_rng(1)
    kv = KVCache(SPEC, 8)
    _fill(kv, rng, 2)
    k, v = _rows(rng, 3)
    kv.append(0, k, v)  # a pass that failed before commit
    assert kv.num_tokens == 2 and kv.keys(0).shape == (2, 2, 8)


def test_truncate_then_refill_overwrites_the_tail():
    rng = np.random.default_rng(2)
    kv = KVCache(SPEC, 8)
    first = _fill(kv, rng, 5)
    kv.truncate(2)
    assert kv.num_tokens == 2
    new = _fill(kv, rng, 3)
    np.testing.assert_array_equal(kv.keys(1)[:, :2], first[1][0][:, :2])
    np.testing.assert_array_equal(kv.keys(1)[:, 2:], new[1][0])
    with pytest.raises(ValueError, match="cannot truncate a KV cache of 5 tokens to 6"):
        kv.truncate(6)
    kv.clear()
    assert kv.num_tokens == 0


def test_full_cache_raises_request_error():
    rng = np.random.default_rng(3)
    kv = KVCache(SPEC, 4)
    _fill(kv, rng, 3)
    assert kv.can_append(1) and not kv.can_append(2)
    k, v = _rows(rng, 2)
    with pytest.raises(RequestError, match="holds 3 of 4 tokens and cannot take 2 more"):
        kv.append(0, k, v)
    with pytest.raises(RequestError):
        kv.commit(2)
    assert kv.num_tokens == 3


def test_dtype_is_a_parameter():
    kv = KVCache(SPEC, 4, dtype=np.float16)
    k, v = _rows(np.random.default_rng(4), 1)
    keys, _ = kv.append(0, k, v)
    assert keys.dtype == np.float16
    np.testing.assert_array_equal(keys[:, 0], k[:, 0].astype(np.float16))


def test_bad_capacity():
    with pytest.raises(ConfigError, match="capacity 0 tokens must be positive"):
        KVCache(SPEC, 0)
