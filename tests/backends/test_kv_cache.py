"""KVCache: append / commit / truncate keep exact cells, and a full cache says so."""
import numpy as np
import pytest

from strata.engine.kv import KV_KEY_TILE, KVCache
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
    # V: [3 layers, 2 heads, 10 cells, 8] float32; K: one whole 64-key tile per head
    assert kv.nbytes == 3 * 2 * 10 * 8 * 4 + 3 * 2 * KV_KEY_TILE * 8 * 4


def test_keys_across_tiles_and_their_stored_layout():
    rng = np.random.default_rng(6)
    kv = KVCache(SPEC, 2 * KV_KEY_TILE + 20)
    chunks = [_fill(kv, rng, n) for n in (KV_KEY_TILE - 1, 2, KV_KEY_TILE + 10)]
    keys = np.concatenate([c[1][0] for c in chunks], axis=1)  # layer 1, [2, 139, 8]
    np.testing.assert_array_equal(kv.keys(1), keys)
    k_cells, v_cells = kv.cells
    assert k_cells.shape == (3, 2, 3, 8, KV_KEY_TILE) and v_cells.shape == (3, 2, 148, 8)
    # key t of head j is column t % TILE of tile t // TILE
    for t in (0, KV_KEY_TILE - 1, KV_KEY_TILE, 138):
        np.testing.assert_array_equal(k_cells[1, :, t // KV_KEY_TILE, :, t % KV_KEY_TILE],
                                      keys[:, t])
    np.testing.assert_array_equal(v_cells[1, :, :139], np.concatenate(
        [c[1][1] for c in chunks], axis=1))


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


def test_bad_capacity_and_dtype():
    with pytest.raises(ConfigError, match="capacity 0 tokens must be positive"):
        KVCache(SPEC, 0)
    with pytest.raises(ConfigError, match="KV cells of int8 are not supported"):
        KVCache(SPEC, 4, dtype=np.int8)
