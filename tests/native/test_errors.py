"""Bad inputs raise ValueError naming what was wrong."""
import numpy as np
import pytest

from strata._native import kernels

from .helpers import random_weight


def test_unknown_type_id():
    with pytest.raises(ValueError, match=r"weight type 34 \(TQ1_0\) is not supported"):
        kernels.matmul(np.zeros((2, 20), np.uint8), 34, np.zeros((1, 32), np.float32))
    with pytest.raises(ValueError, match="weight type 99"):
        kernels.row_bytes(99, 32)
    assert not kernels.is_supported(99)


def test_row_bytes_needs_whole_blocks():
    with pytest.raises(ValueError,
                       match="Q4_K row needs a positive multiple of 256 columns, got 100"):
        kernels.row_bytes(12, 100)
    assert kernels.row_bytes(0, 3) == 12


def test_matmul_bad_dtypes_and_shapes():
    rng = np.random.default_rng(0)
    w = random_weight(rng, 8, 4, 64)
    x = np.ones((2, 64), np.float32)
    with pytest.raises(ValueError, match="x must have dtype float32, got float64"):
        kernels.matmul(w, 8, x.astype(np.float64))
    with pytest.raises(ValueError, match="w must have dtype uint8"):
        kernels.matmul(w.view(np.int8), 8, x)
    with pytest.raises(ValueError, match="x must have 2 dimensions"):
        kernels.matmul(w, 8, x[0])
    with pytest.raises(ValueError, match="x must be C-contiguous"):
        kernels.matmul(w, 8, np.ones((64, 2), np.float32).T)
    with pytest.raises(ValueError, match="w rows hold 68 bytes but 96 Q8_0 columns"):
        kernels.matmul(w, 8, np.ones((2, 96), np.float32))
    with pytest.raises(ValueError, match=r"out must have shape \(2, 4\)"):
        kernels.matmul(w, 8, x, out=np.zeros((4, 2), np.float32))


def test_dequantize_wrong_size():
    with pytest.raises(ValueError, match="64 Q8_0 elements take 68 bytes, got 60"):
        kernels.dequantize(np.zeros(60, np.uint8), 8, 64)


def _moe_args(E=3, H=64, F=32, T_=2, K=2):
    rng = np.random.default_rng(1)
    gate = np.stack([random_weight(rng, 8, F, H) for _ in range(E)])
    up = np.stack([random_weight(rng, 8, F, H) for _ in range(E)])
    down = np.stack([random_weight(rng, 8, H, F) for _ in range(E)])
    return dict(x=np.ones((T_, H), np.float32), gate=gate, gate_type=8, up=up, up_type=8,
                down=down, down_type=8, experts=np.zeros((T_, K), np.int32),
                weights=np.ones((T_, K), np.float32), out=np.zeros((T_, H), np.float32))


def test_moe_bad_expert_ids():
    args = _moe_args()
    args["experts"][1, 1] = 3
    with pytest.raises(ValueError, match=r"expert id 3 is out of range: ids must be in \[0, 3\)"):
        kernels.moe_ffn(**args)
    args["experts"][1, 1] = -2
    with pytest.raises(ValueError, match="expert id -2 is out of range"):
        kernels.moe_ffn(**args)


def test_moe_bad_shapes_and_dtypes():
    args = _moe_args()
    bad = dict(args, experts=args["experts"].astype(np.int64))
    with pytest.raises(ValueError, match="experts must have dtype int32, got int64"):
        kernels.moe_ffn(**bad)
    bad = dict(args, down=np.ascontiguousarray(args["down"][:, :32]))
    with pytest.raises(ValueError,
                       match=r"down has \(3, 32\) \(experts, rows\); expected \(3, 64\)"):
        kernels.moe_ffn(**bad)
    bad = dict(args, up=args["up"][:2])
    with pytest.raises(ValueError,
                       match=r"up has \(2, 32\) \(experts, rows\) but gate has \(3, 32\)"):
        kernels.moe_ffn(**bad)
    bad = dict(args, weights=np.ones((2, 3), np.float32))
    with pytest.raises(ValueError, match=r"experts \(2, 2\) and weights \(2, 3\)"):
        kernels.moe_ffn(**bad)
    bad = dict(args, gate_type=14)
    with pytest.raises(ValueError,
                       match="Q6_K row needs a positive multiple of 256 columns, got 64"):
        kernels.moe_ffn(**bad)
    bad = dict(args, out=np.zeros((2, 32), np.float32))
    with pytest.raises(ValueError, match=r"out must have shape \(2, 64\)"):
        kernels.moe_ffn(**bad)


def test_set_num_threads_rejects_negative():
    with pytest.raises(ValueError, match="threads must be >= 0, got -1"):
        kernels.set_num_threads(-1)


@pytest.mark.parametrize("num_threads", [kernels.MAX_THREADS + 1, 100_000, 2**31, 3 * 10**9])
def test_set_num_threads_rejects_more_than_it_can_start(num_threads):
    """100,000 made OpenMP segfault starting its team (2**31 - 1 aborted it, out of memory);
    2**31 and up were an OverflowError. The setting is left as it was."""
    before = kernels.get_num_threads()
    with pytest.raises(ValueError, match=f"at most {kernels.MAX_THREADS} threads, got "
                                         f"{num_threads}"):
        kernels.set_num_threads(num_threads)
    assert kernels.get_num_threads() == before


def test_set_num_threads_takes_more_than_the_cores():
    before = kernels.get_num_threads()
    rng = np.random.default_rng(5)
    w = random_weight(rng, 8, 300, 4096)
    x = rng.standard_normal((40, 4096)).astype(np.float32)
    try:
        kernels.set_num_threads(1)
        one = kernels.matmul(w, 8, x)
        kernels.set_num_threads(64)
        assert kernels.get_num_threads() == 64
        assert np.array_equal(kernels.matmul(w, 8, x), one)
    finally:
        kernels.set_num_threads(before)
