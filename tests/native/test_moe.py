"""moe_ffn against a float64 numpy reference: duplicated experts, -1 ids, K = 1..8, all types."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from strata._native import kernels

from .helpers import (ALL_TYPES, FLOAT_TYPES, block_size, dequant64, float_error_bound,
                      q8_error_bound, q8_roundtrip, random_weight, silu64)


def make_moe(rng, qtypes, E, H, F):
    gate_type, up_type, down_type = qtypes
    gate = np.stack([random_weight(rng, gate_type, F, H) for _ in range(E)])   # [E, F, gb]
    up = np.stack([random_weight(rng, up_type, F, H) for _ in range(E)])       # [E, F, ub]
    down = np.stack([random_weight(rng, down_type, H, F) for _ in range(E)])   # [E, H, db]
    return gate, up, down


def reference(x, gate, up, down, qtypes, experts, weights, out):
    """float64 result and a per-element error bound for the kernel (8-bit activations where
    the weight type is quantised: x for gate/up, the SiLU product for down)."""
    gate_type, up_type, down_type = qtypes
    T_, K = experts.shape
    expected = out.astype(np.float64)
    bound = np.zeros_like(expected)
    xg = x.astype(np.float64) if gate_type in FLOAT_TYPES else q8_roundtrip(x, gate_type)
    xu = x.astype(np.float64) if up_type in FLOAT_TYPES else q8_roundtrip(x, up_type)
    for t in range(T_):
        for k in range(K):
            e = experts[t, k]
            if e < 0:
                continue
            g64, u64, d64 = (dequant64(gate[e], gate_type), dequant64(up[e], up_type),
                             dequant64(down[e], down_type))
            g, u = g64 @ xg[t], u64 @ xu[t]                                     # [F]
            h = silu64(g) * u
            y = d64 @ h                                                         # [H]
            expected[t] += weights[t, k] * y
            # float32 rounding of g and u moves h by ~|g'| * err; bound it relatively
            eg = float_error_bound(xg[t:t + 1], g64)[0]
            eu = float_error_bound(xu[t:t + 1], u64)[0]
            dh = (np.abs(u) + np.abs(g)) * (eg + eu) * 2 + np.abs(h) * 1e-6
            err = np.abs(d64) @ dh + float_error_bound(h[None, :], d64)[0]
            if down_type not in FLOAT_TYPES:
                err += q8_error_bound(h[None, :].astype(np.float32), d64, down_type)[0]
            bound[t] += weights[t, k] * err
    return expected, bound + 1e-6 * np.abs(expected) + 1e-6


def scaled_x(rng, T_, H, gate, gate_type):
    # keep gate outputs O(1) so SiLU is neither flat nor overflowing
    rms = np.sqrt(np.mean(dequant64(gate[0], gate_type) ** 2))
    return (rng.standard_normal((T_, H)) / (rms * np.sqrt(H))).astype(np.float32)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("K", [1, 2, 8])
def test_moe_ffn_matches_reference(qtype, K):
    rng = np.random.default_rng(100 * int(qtype) + K)
    E, T_ = 6, 9
    H = 2 * max(block_size(qtype), 64)
    F = 96 if block_size(qtype) <= 32 else 256       # 96: not a multiple of the 64-row item
    qtypes = (qtype, qtype, qtype)
    gate, up, down = make_moe(rng, qtypes, E, H, F)
    x = scaled_x(rng, T_, H, gate, qtype)
    experts = rng.integers(-1, E, size=(T_, K)).astype(np.int32)
    experts[0, :] = 3                                 # one token routed to the same expert K times
    experts[1, 0] = -1
    weights = rng.random((T_, K)).astype(np.float32)
    out = rng.standard_normal((T_, H)).astype(np.float32)
    expected, bound = reference(x, gate, up, down, qtypes, experts, weights, out)
    kernels.moe_ffn(x, gate, int(qtype), up, int(qtype), down, int(qtype), experts, weights, out)
    assert np.all(np.abs(out - expected) <= bound)
    if qtype in FLOAT_TYPES:
        # float32 end to end: parity with a float reference model needs ~1e-5 relative
        assert np.abs(out - expected).max() <= 1e-5 * np.abs(expected).max()


def test_moe_ffn_mixed_types_and_all_skipped():
    rng = np.random.default_rng(5)
    qtypes = (12, 1, 14)        # Q4_K gate, F16 up, Q6_K down
    E, H, F, T_, K = 4, 256, 256, 5, 3
    gate, up, down = make_moe(rng, qtypes, E, H, F)
    x = scaled_x(rng, T_, H, gate, qtypes[0])
    experts = rng.integers(0, E, size=(T_, K)).astype(np.int32)
    weights = rng.random((T_, K)).astype(np.float32)
    out = np.zeros((T_, H), dtype=np.float32)
    expected, bound = reference(x, gate, up, down, qtypes, experts, weights, out)
    kernels.moe_ffn(x, gate, 12, up, 1, down, 14, experts, weights, out)
    assert np.all(np.abs(out - expected) <= bound)
    assert np.abs(expected).max() > 1e-3
    # every id -1: out is left as it was
    before = out.copy()
    kernels.moe_ffn(x, gate, 12, up, 1, down, 14, np.full((T_, K), -1, np.int32), weights, out)
    assert np.array_equal(out, before)


def routed_layer(rng, qtypes, E, H, F, T_, K):
    """A layer's experts and T_ tokens routed to K distinct experts each: gate, up, down, x,
    experts [T_, K] int32, weights [T_, K] float32."""
    gate, up, down = make_moe(rng, qtypes, E, H, F)
    x = scaled_x(rng, T_, H, gate, qtypes[0])
    experts = np.stack([rng.permutation(E)[:K] for _ in range(T_)]).astype(np.int32)
    weights = rng.random((T_, K)).astype(np.float32)
    return gate, up, down, x, experts, weights


def test_moe_ffn_threads_agree():
    T_, H = 40, 128
    gate, up, down, x, experts, weights = routed_layer(np.random.default_rng(9), (2, 2, 2), E=8,
                                                       H=H, F=128, T_=T_, K=8)
    saved = kernels.get_num_threads()
    results = []
    try:
        for n in (1, 2):
            kernels.set_num_threads(n)
            out = np.zeros((T_, H), dtype=np.float32)
            kernels.moe_ffn(x, gate, 2, up, 2, down, 2, experts, weights, out)
            results.append(out)
    finally:
        kernels.set_num_threads(saved)
    assert np.array_equal(results[0], results[1])


def test_moe_ffn_token_alone_equals_its_batch():
    # a decode call (few pairs: the down items wait per expert, no barrier between the products)
    # gives each token the bits it gets in a 40-token call (quantized behind a team barrier)
    T_, H = 40, 128
    gate, up, down, x, experts, weights = routed_layer(np.random.default_rng(10), (2, 8, 2), E=8,
                                                       H=H, F=192, T_=T_, K=4)
    batch = np.zeros((T_, H), dtype=np.float32)
    kernels.moe_ffn(x, gate, 2, up, 8, down, 2, experts, weights, batch)
    saved = kernels.get_num_threads()
    try:
        for n in (1, 2):
            kernels.set_num_threads(n)
            for t in (0, 17, 39):
                alone = np.zeros((1, H), dtype=np.float32)
                kernels.moe_ffn(x[t:t + 1], gate, 2, up, 8, down, 2, experts[t:t + 1],
                                weights[t:t + 1], alone)
                assert np.array_equal(alone[0], batch[t]), (n, t)
    finally:
        kernels.set_num_threads(saved)


@settings(max_examples=20, deadline=None)
@given(qtype=st.sampled_from((0, 2, 8)), num_experts=st.integers(1, 5), K=st.integers(1, 8),
       num_tokens=st.integers(1, 12), hidden_blocks=st.integers(1, 3),
       width_blocks=st.integers(1, 3), seed=st.integers(0, 2**32 - 1))
def test_moe_ffn_shapes(qtype, num_experts, K, num_tokens, hidden_blocks, width_blocks, seed):
    rng = np.random.default_rng(seed)
    H, F = 32 * hidden_blocks, 32 * width_blocks
    qtypes = (qtype, qtype, qtype)
    gate, up, down = make_moe(rng, qtypes, num_experts, H, F)
    x = scaled_x(rng, num_tokens, H, gate, qtype)
    experts = rng.integers(-1, num_experts, size=(num_tokens, K)).astype(np.int32)
    weights = rng.random((num_tokens, K)).astype(np.float32)
    out = rng.standard_normal((num_tokens, H)).astype(np.float32)
    expected, bound = reference(x, gate, up, down, qtypes, experts, weights, out)
    kernels.moe_ffn(x, gate, qtype, up, qtype, down, qtype, experts, weights, out)
    assert np.all(np.abs(out - expected) <= bound)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_moe_ffn_ptrs_reads_experts_wherever_they_lie(qtype):
    # experts scattered over separate buffers, in another order than their ids: the same
    # result as the stacked tensors, bit for bit, and the rows routed to each expert counted
    rng = np.random.default_rng(300 + int(qtype))
    E, T_, K = 5, 7, 2
    H = 2 * max(block_size(qtype), 64)
    F = 96 if block_size(qtype) <= 32 else 256
    gate, up, down = make_moe(rng, (qtype, qtype, qtype), E, H, F)
    x = scaled_x(rng, T_, H, gate, qtype)
    experts = rng.integers(-1, E, size=(T_, K)).astype(np.int32)
    experts[2] = [4, 4]
    weights = rng.random((T_, K)).astype(np.float32)
    stacked = np.zeros((T_, H), dtype=np.float32)
    kernels.moe_ffn(x, gate, qtype, up, qtype, down, qtype, experts, weights, stacked)
    copies = [np.array(m[e]) for e in rng.permutation(E) for m in (gate, up, down)]
    pointers = np.zeros((3, E), dtype=np.uint64)
    for copy in copies:
        for part, stack in enumerate((gate, up, down)):
            for e in range(E):
                if copy.shape == stack[e].shape and np.array_equal(copy, stack[e]):
                    pointers[part, e] = copy.ctypes.data
    assert (pointers != 0).all()
    routed = np.full(E, 10, dtype=np.int64)
    out = np.zeros((T_, H), dtype=np.float32)
    kernels.moe_ffn_ptrs(x, pointers, qtype, qtype, qtype, F, experts, weights, out, routed)
    assert np.array_equal(out, stacked)
    expected_counts = 10 + np.bincount(experts[experts >= 0], minlength=E)
    np.testing.assert_array_equal(routed, expected_counts)


def test_moe_ffn_ptrs_refuses_bad_tables():
    x = np.zeros((1, 64), dtype=np.float32)
    ids, w, out = np.zeros((1, 1), np.int32), np.ones((1, 1), np.float32), np.zeros((1, 64),
                                                                                    np.float32)
    with pytest.raises(ValueError, match=r"pointers must be \[3, E\]"):
        kernels.moe_ffn_ptrs(x, np.ones((2, 4), np.uint64), 0, 0, 0, 32, ids, w, out)
    with pytest.raises(ValueError, match="null address"):
        kernels.moe_ffn_ptrs(x, np.zeros((3, 4), np.uint64), 0, 0, 0, 32, ids, w, out)
    with pytest.raises(ValueError, match="routed_rows has 3 entries for 4 experts"):
        kernels.moe_ffn_ptrs(x, np.ones((3, 4), np.uint64), 0, 0, 0, 32, ids, w, out,
                             np.zeros(3, np.int64))
