"""Qwen3-Next's CUDA kernels (delta_net.cu) against the CPU kernels of strata._native.kernels
(conv_silu, gated_delta, gated_rmsnorm) on windows of several runs, each from its own random
state: outputs, the states written, the states read left as they were, and a run split over two
windows equal to one window bit for bit; split_q_gate and mul_sigmoid against numpy."""
import numpy as np
import pytest

from strata._native import kernels

from test_cuda_kernels import _Dev

pytestmark = pytest.mark.cuda

# Legend: R = window rows, C = conv channels, K = conv taps, Hk / Hv = key / value heads,
# Dk / Dv = key / value head dims, Lr = recurrent layers.
# (Hk, Hv, Dk, Dv, K): the tiny synth model's and Qwen3-Next-80B-A3B's
DIMS = {"tiny": (2, 4, 16, 16, 4), "80b": (16, 32, 128, 128, 4)}
# runs of one window: shorter than K-1 (1, 2), one of 5 and one of 17 rows
RUNS = (1, 5, 17, 2, 1)
NUM_RECURRENT_LAYERS, LAYER = 3, 1  # the states hold every layer; a launch touches LAYER only
EPS = 1e-6
POISON = 0x7F  # _Dev.empty's fill byte


def _channels(dims):
    Hk, Hv, Dk, Dv, K = dims
    return 2 * Hk * Dk + Hv * Dv


def _assert_close(got, want, rel):
    """max |got - want| within rel of max |want|."""
    scale = np.abs(want).max()
    error = np.abs(got.astype(np.float64) - want).max()
    assert error <= rel * scale, f"max error {error:.3g} > {rel} x {scale:.3g}"


class _Seq:
    """A sequence's double-buffered states on the device for every recurrent layer: conv
    [Lr, K-1, C], ssm [Lr, Hv, Dk, Dv]. The ins come from host arrays (random, or the outs of
    an earlier window), the outs start poisoned."""

    def __init__(self, dev, dims, conv_in, ssm_in):
        Hk, Hv, Dk, Dv, K = dims
        self.dev = dev
        self.conv_shape = (NUM_RECURRENT_LAYERS, K - 1, _channels(dims))
        self.ssm_shape = (NUM_RECURRENT_LAYERS, Hv, Dk, Dv)
        self.conv_in, self.ssm_in = conv_in, ssm_in
        self.ptrs = (dev.put(conv_in), dev.empty(4 * conv_in.size),
                     dev.put(ssm_in), dev.empty(4 * ssm_in.size))

    @classmethod
    def random(cls, dev, dims, rng):
        Hk, Hv, Dk, Dv, K = dims
        conv_in = rng.standard_normal((NUM_RECURRENT_LAYERS, K - 1, _channels(dims)))
        ssm_in = rng.standard_normal((NUM_RECURRENT_LAYERS, Hv, Dk, Dv)) * 0.1
        return cls(dev, dims, conv_in.astype(np.float32), ssm_in.astype(np.float32))

    def read(self):
        """(conv_in, conv_out, ssm_in, ssm_out) as the device holds them now."""
        return tuple(self.dev.get(ptr, shape, np.float32) for ptr, shape in
                     zip(self.ptrs, (self.conv_shape, self.conv_shape, self.ssm_shape,
                                     self.ssm_shape)))

    def check_untouched(self):
        """The ins as they were; the outs poisoned outside LAYER."""
        conv_in, conv_out, ssm_in, ssm_out = self.read()
        np.testing.assert_array_equal(conv_in, self.conv_in)
        np.testing.assert_array_equal(ssm_in, self.ssm_in)
        for out in (conv_out, ssm_out):
            others = np.delete(out, LAYER, axis=0)
            assert (others.view(np.uint8) == POISON).all(), "a layer other than LAYER written"


def _window(dev, runs, seqs):
    """Device descriptors (state [R, 4], run0 [R], run_len [R]) of a window of runs (row
    counts), run s of sequence seqs[s]."""
    state, run0, run_len = [], [], []
    for n, seq in zip(runs, seqs):
        first = len(state)
        for _ in range(n):
            state.append(seq.ptrs)
            run0.append(first)
            run_len.append(n)
    return (dev.put(np.array(state, dtype=np.uint64)), dev.put(np.array(run0, dtype=np.int32)),
            dev.put(np.array(run_len, dtype=np.int32)))


def _run_slices(runs):
    starts = np.concatenate([[0], np.cumsum(runs)])
    return [slice(int(a), int(b)) for a, b in zip(starts[:-1], starts[1:])]


def _conv(dev, dims, x, w, desc):
    """y [R, C] of conv_silu_rows over x [R, C] with taps w [C, K]."""
    K, C, R = dims[4], _channels(dims), x.shape[0]
    y = dev.empty(4 * R * C)
    dev.launch("conv_silu_rows", ((C + 127) // 128, R), (128,), "PiiPPqPPP",
               [dev.put(x), C, K, dev.put(w), desc[0], LAYER * (K - 1) * C, desc[1], desc[2],
                y])
    return y


def _delta(dev, dims, y_ptr, R, ba, A, dt_bias, desc):
    """out [R, Hv*Dv] (device) of gated_delta_rows over y [R, C] at y_ptr."""
    Hk, Hv, Dk, Dv, K = dims
    out = dev.empty(4 * R * Hv * Dv)
    dev.launch("gated_delta_rows", ((Dv + 31) // 32, Hv, R), (128,), "PiiiiiPPPfPqPPP",
               [y_ptr, _channels(dims), Hk, Hv, Dk, Dv, dev.put(ba), dev.put(A),
                dev.put(dt_bias), EPS, desc[0], LAYER * Hv * Dk * Dv, desc[1], desc[2], out])
    return out


def _delta_inputs(dims, R, rng):
    """(ba [R, 2*Hv], A [Hv], dt_bias [Hv]) as a model makes them; one alpha past softplus's
    threshold (20)."""
    Hv = dims[1]
    ba = rng.standard_normal((R, 2 * Hv)).astype(np.float32) * 2
    ba[0, Hv] = 22.0
    A = -np.exp(rng.uniform(-1.0, 1.0, Hv)).astype(np.float32)
    dt_bias = (rng.standard_normal(Hv) * 0.5).astype(np.float32)
    return ba, A, dt_bias


@pytest.mark.parametrize("shape", DIMS)
def test_conv_silu_rows_per_run(runtime, shape):
    """Each run's rows from its own conv state: y and the conv_out of LAYER as st_conv_silu
    makes them (the state bit for bit), conv_in untouched, other layers unwritten."""
    dev, rng, dims = _Dev(runtime), np.random.default_rng(), DIMS[shape]
    C, K, R = _channels(dims), dims[4], sum(RUNS)
    seqs = [_Seq.random(dev, dims, rng) for _ in RUNS]
    x = rng.standard_normal((R, C)).astype(np.float32)
    w = (rng.standard_normal((C, K)) * 0.5).astype(np.float32)
    y = dev.get(_conv(dev, dims, x, w, _window(dev, RUNS, seqs)), (R, C), np.float32)
    for rows, seq in zip(_run_slices(RUNS), seqs):
        state_out = np.empty((K - 1, C), dtype=np.float32)
        want = kernels.conv_silu(x[rows], w, seq.conv_in[LAYER], state_out=state_out)
        _assert_close(y[rows], want, 2e-5)
        np.testing.assert_array_equal(seq.read()[1][LAYER], state_out)
        seq.check_untouched()


@pytest.mark.parametrize("shape", DIMS)
def test_gated_delta_rows_per_run(runtime, shape):
    """Each run's rows from its own recurrent state: out and the ssm_out of LAYER as
    st_gated_delta makes them, ssm_in untouched, other layers unwritten."""
    dev, rng, dims = _Dev(runtime), np.random.default_rng(), DIMS[shape]
    Hk, Hv, Dk, Dv, K = dims
    C, R = _channels(dims), sum(RUNS)
    seqs = [_Seq.random(dev, dims, rng) for _ in RUNS]
    y = rng.standard_normal((R, C)).astype(np.float32)  # q | k | v per row
    ba, A, dt_bias = _delta_inputs(dims, R, rng)
    out_ptr = _delta(dev, dims, dev.put(y), R, ba, A, dt_bias, _window(dev, RUNS, seqs))
    out = dev.get(out_ptr, (R, Hv * Dv), np.float32)
    for rows, seq in zip(_run_slices(RUNS), seqs):
        yr = y[rows]
        state_out = np.empty((Hv, Dk, Dv), dtype=np.float32)
        want = kernels.gated_delta(yr[:, :Hk * Dk], yr[:, Hk * Dk:2 * Hk * Dk],
                                   yr[:, 2 * Hk * Dk:], ba[rows, :Hv], ba[rows, Hv:], A,
                                   dt_bias, seq.ssm_in[LAYER], state_out=state_out, eps=EPS)
        _assert_close(out[rows], want, 1e-4)
        _assert_close(seq.read()[3][LAYER], state_out, 1e-4)
        seq.check_untouched()


@pytest.mark.parametrize("shape", DIMS)
def test_run_split_over_two_windows_equals_one(runtime, shape):
    """conv then delta over a run of 17 rows in one window, and over its first 6 rows (after
    another sequence's run) then the other 11 from the states the first window wrote: the same
    y, out and final states bit for bit."""
    dev, rng, dims = _Dev(runtime), np.random.default_rng(), DIMS[shape]
    Hv, Dv, K = dims[1], dims[3], dims[4]
    C, n, first = _channels(dims), 17, 6
    x = rng.standard_normal((n, C)).astype(np.float32)
    w = (rng.standard_normal((C, K)) * 0.5).astype(np.float32)
    ba, A, dt_bias = _delta_inputs(dims, n, rng)
    whole = _Seq.random(dev, dims, rng)

    def run(seqs, runs, rows, x_rows, ba_rows):
        R, desc = sum(runs), _window(dev, runs, seqs)
        y = _conv(dev, dims, x_rows, w, desc)
        out = _delta(dev, dims, y, R, ba_rows, A, dt_bias, desc)
        return (dev.get(y, (R, C), np.float32)[rows],
                dev.get(out, (R, Hv * Dv), np.float32)[rows])

    y_one, out_one = run([whole], [n], slice(0, n), x, ba)
    other = _Seq.random(dev, dims, rng)
    head = _Seq(dev, dims, whole.conv_in, whole.ssm_in)
    lead_x = rng.standard_normal((3, C)).astype(np.float32)
    lead_ba = rng.standard_normal((3, 2 * Hv)).astype(np.float32)
    y_a, out_a = run([other, head], [3, first], slice(3, 3 + first),
                     np.concatenate([lead_x, x[:first]]), np.concatenate([lead_ba, ba[:first]]))
    _, conv_mid, _, ssm_mid = head.read()
    tail = _Seq(dev, dims, conv_mid, ssm_mid)
    y_b, out_b = run([tail], [n - first], slice(0, n - first), x[first:], ba[first:])
    np.testing.assert_array_equal(np.concatenate([y_a, y_b]), y_one)
    np.testing.assert_array_equal(np.concatenate([out_a, out_b]), out_one)
    _, conv_one, _, ssm_one = whole.read()
    _, conv_two, _, ssm_two = tail.read()
    np.testing.assert_array_equal(conv_two[LAYER], conv_one[LAYER])
    np.testing.assert_array_equal(ssm_two[LAYER], ssm_one[LAYER])


@pytest.mark.parametrize("head_dim", (16, 128, 200))
def test_gated_rmsnorm_rows(runtime, head_dim):
    """out as st_gated_rmsnorm makes it in place; x untouched."""
    dev, rng = _Dev(runtime), np.random.default_rng()
    R, Hv, Dv = 5, 4, head_dim
    x = rng.standard_normal((R, Hv * Dv)).astype(np.float32) * 3
    z = rng.standard_normal((R, Hv * Dv)).astype(np.float32) * 2
    w = (rng.random(Dv) + 0.5).astype(np.float32)
    xp, out = dev.put(x), dev.empty(4 * x.size)
    dev.launch("gated_rmsnorm_rows", (R, Hv), (128,), "PPPfiiP",
               [xp, dev.put(z), dev.put(w), EPS, Hv, Dv, out])
    want = kernels.gated_rmsnorm(x.copy(), z, w, EPS)
    _assert_close(dev.get(out, x.shape, np.float32), want, 1e-5)
    np.testing.assert_array_equal(dev.get(xp, x.shape, np.float32), x)


def test_split_q_gate_and_mul_sigmoid(runtime):
    """qg [R, Q, 2D] -> q, gate [R, Q*D] exactly; x * sigmoid(gate) within float32 rounding."""
    dev, rng = _Dev(runtime), np.random.default_rng()
    R, Q, D = 3, 5, 48  # R*Q*D = 720: a partial last block
    qg = rng.standard_normal((R, Q, 2 * D)).astype(np.float32)
    q, gate = dev.empty(4 * R * Q * D), dev.empty(4 * R * Q * D)
    n = R * Q * D
    dev.launch("split_q_gate", ((n + 255) // 256,), (256,), "PiiiPP",
               [dev.put(qg), R, Q, D, q, gate])
    got_q, got_gate = dev.get(q, (R, Q, D), np.float32), dev.get(gate, (R, Q, D), np.float32)
    np.testing.assert_array_equal(got_q, qg[..., :D])
    np.testing.assert_array_equal(got_gate, qg[..., D:])
    x = rng.standard_normal(n).astype(np.float32)
    xp = dev.put(x)
    dev.launch("mul_sigmoid", ((n + 255) // 256,), (256,), "PPq", [xp, gate, n])
    want = x.astype(np.float64) / (1 + np.exp(-got_gate.reshape(-1).astype(np.float64)))
    np.testing.assert_allclose(dev.get(xp, (n,), np.float32), want, rtol=2e-6, atol=1e-30)
