"""rmsnorm against a float64 reference."""
import numpy as np
import pytest

from strata._native import kernels


@pytest.mark.parametrize("shape", [(1, 64), (7, 1000), (33, 16)])
def test_rmsnorm_matches_float64(shape):
    rng = np.random.default_rng(shape[0])
    x = (rng.standard_normal(shape) * 3).astype(np.float32)
    w = rng.standard_normal(shape[1]).astype(np.float32)
    eps = 1e-6
    x64 = x.astype(np.float64)
    expected = w * x64 / np.sqrt(np.mean(x64 ** 2, axis=1, keepdims=True) + eps)
    got = kernels.rmsnorm(x, w, eps)
    # three float32 roundings (rsqrt, two products) per element: 4 ulp relative
    assert np.all(np.abs(got - expected) <= 4 * 6e-8 * np.abs(expected) + 1e-30)
    out = np.empty_like(x)
    assert kernels.rmsnorm(x, w, eps, out=out) is out
    assert np.array_equal(out, got)


def test_rmsnorm_bad_inputs():
    x = np.ones((2, 8), np.float32)
    with pytest.raises(ValueError, match="w has 4 elements but x rows have 8"):
        kernels.rmsnorm(x, np.ones(4, np.float32), 1e-6)
    with pytest.raises(ValueError, match="eps must be > 0, got 0.0"):
        kernels.rmsnorm(x, np.ones(8, np.float32), 0.0)
