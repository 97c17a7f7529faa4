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


# ---- a hybrid model's recurrent state (qwen3next) ------------------------------------------

def _hybrid_kv(max_checkpoints=2):
    from strata.tool.presets import get_preset

    return KVCache(get_preset("tiny-qwen3next"), 32, max_checkpoints=max_checkpoints)


def test_hybrid_kv_has_cells_for_attention_layers_only():
    kv = _hybrid_kv()
    assert kv.num_layers == len(kv.spec.attention_layers) == 2
    conv_in, conv_out, ssm_in, ssm_out = kv.state.buffers()
    assert conv_in.shape == (2, 3, kv.spec.ssm_channels) and ssm_in.shape == (2, 4, 16, 16)
    assert not np.shares_memory(conv_in, conv_out) and not np.shares_memory(ssm_in, ssm_out)


def test_recurrent_state_goes_back_only_to_checkpoints():
    kv = _hybrid_kv(max_checkpoints=2)
    for n, value in ((4, 1.0), (3, 2.0), (5, 3.0)):  # three "passes", each keeping a checkpoint
        kv.state.buffers()[3][:] = value  # what the pass wrote
        kv.state.flip()
        kv.commit(n)
        kv.keep_checkpoint()
    assert kv.num_tokens == 12 and kv.state.positions() == (7, 12)  # oldest (4) dropped
    assert kv.reuse_points() == (7, 12)
    assert [kv.reusable(n) for n in (3, 7, 9, 12, 40)] == [0, 7, 7, 12, 12]
    with pytest.raises(ValueError, match="checkpoints \\[7, 12\\]"):
        kv.truncate(9)
    kv.truncate(7)
    assert kv.num_tokens == 7 and float(kv.state.buffers()[2].max()) == 2.0
    assert kv.state.positions() == (7,)
    kv.truncate(0)
    assert kv.state.positions() == () and not kv.state.buffers()[2].any()


def test_parked_state_comes_back_at_its_end_or_a_checkpoint():
    kv = _hybrid_kv()
    kv.state.buffers()[3][:] = 5.0
    kv.state.flip()
    kv.commit(6)
    kv.keep_checkpoint()
    kv.state.buffers()[3][:] = 9.0
    kv.state.flip()
    kv.commit(2)
    exported = kv.export_state()
    other = _hybrid_kv()
    other.commit(8)
    other.import_state(exported, 8)
    assert float(other.state.buffers()[2].max()) == 9.0 and other.state.positions() == (6,)
    other.truncate(6)
    assert float(other.state.buffers()[2].max()) == 5.0
    with pytest.raises(ValueError, match="no recurrent state at 7"):
        _hybrid_kv().import_state(exported, 7)


def test_ctx_checkpoints_must_be_a_count():
    from strata.errors import ConfigError

    with pytest.raises(ConfigError, match="--ctx-checkpoints"):
        _hybrid_kv(max_checkpoints=-1)


def test_export_prefix_is_the_layers_first_cells():
    kv = KVCache(SPEC, 32)
    _fill(kv, np.random.default_rng(2), 20)
    k, v = kv.export_prefix(13)
    assert k.shape == v.shape == (SPEC.n_layers, SPEC.n_kv_heads, 13, SPEC.head_dim)
    for layer in range(SPEC.n_layers):
        assert np.array_equal(k[layer], kv.keys(layer)[:, :13])
        assert np.array_equal(v[layer], kv.values(layer)[:, :13])


class _StructuredCells(KVCache):
    """A KV whose host copies are records of codes and a scale, as a GPU's int8 cells are."""
    CELL = np.dtype([("q", np.int8, (SPEC.head_dim,)), ("scale", np.float32)])

    def keys(self, layer):
        out = np.zeros((SPEC.n_kv_heads, self.num_tokens), self.CELL)
        out["scale"] = np.arange(self.num_tokens) + 100 * layer
        return out

    def values(self, layer):
        out = self.keys(layer)
        out["q"] = layer
        return out


def test_export_prefix_keeps_record_cells():
    kv = _StructuredCells(SPEC, 8, np.float16)
    kv.commit(6)
    k, v = kv.export_prefix(4)
    assert k.dtype == _StructuredCells.CELL and k.shape == (SPEC.n_layers, SPEC.n_kv_heads, 4)
    assert list(k[1, 0]["scale"]) == [100, 101, 102, 103]
    assert (v[1]["q"] == 1).all()
