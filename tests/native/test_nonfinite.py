"""A NaN or inf in an activation row reaches that row's results as NaN (so the sampler can
refuse it; float weights times an inf may give +-inf, as numpy does) on every weight type and
kernel path, and leaves the other rows as they were."""
import numpy as np
import pytest

from strata._native import kernels

from .helpers import ALL_TYPES, FLOAT_TYPES, block_size, random_weight
from .test_moe import make_moe


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("num_tokens", [1, 2, 5, 12])   # the fused rows and the tiles
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
def test_a_non_finite_activation_gives_nan_in_its_row_only(qtype, num_tokens, bad):
    rng = np.random.default_rng(int(qtype) + 7 * num_tokens)
    rows, cols = 21, 2 * max(block_size(qtype), 64)
    w = random_weight(rng, qtype, rows, cols)
    x = rng.standard_normal((num_tokens, cols)).astype(np.float32)
    clean = kernels.matmul(w, int(qtype), x)
    bad_row = num_tokens // 2
    x[bad_row, 37] = bad                         # one element: the rest of its block is finite
    got = kernels.matmul(w, int(qtype), x)
    if qtype in FLOAT_TYPES and not np.isnan(bad):
        assert not np.isfinite(got[bad_row]).any()
    else:
        assert np.isnan(got[bad_row]).all()
    others = np.arange(num_tokens) != bad_row
    assert np.array_equal(got[others], clean[others])


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_a_row_of_nan_gives_nan(qtype):
    """A hidden state gone NaN is NaN in every column after rmsnorm: its logits stay NaN (a
    build whose quantiser skipped NaN in its max gave 0 for every logit, a silent token 0)."""
    rng = np.random.default_rng(3 + int(qtype))
    cols = 2 * max(block_size(qtype), 64)
    w = random_weight(rng, qtype, 9, cols)
    for num_tokens in (1, 6):
        x = np.full((num_tokens, cols), np.nan, dtype=np.float32)
        assert np.isnan(kernels.matmul(w, int(qtype), x)).all()


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_moe_row_with_a_nan_is_nan_and_its_neighbours_are_not(qtype):
    rng = np.random.default_rng(11 + int(qtype))
    E, T_, K = 4, 7, 2
    H = 2 * max(block_size(qtype), 64)
    F = 64 if block_size(qtype) <= 32 else 256
    gate, up, down = make_moe(rng, (qtype, qtype, qtype), E, H, F)
    x = (0.05 * rng.standard_normal((T_, H))).astype(np.float32)
    experts = rng.integers(0, E, size=(T_, K)).astype(np.int32)
    weights = rng.random((T_, K)).astype(np.float32)
    clean = np.zeros((T_, H), np.float32)
    kernels.moe_ffn(x, gate, int(qtype), up, int(qtype), down, int(qtype), experts, weights,
                    clean)
    x[2, 5] = np.nan
    out = np.zeros((T_, H), np.float32)
    kernels.moe_ffn(x, gate, int(qtype), up, int(qtype), down, int(qtype), experts, weights,
                    out)
    assert np.isnan(out[2]).all()
    others = np.arange(T_) != 2
    assert np.array_equal(out[others], clean[others])
