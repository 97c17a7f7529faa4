"""Qwen3-Next's gated delta net kernels (causal conv + SiLU, the gated delta rule, the gated
RMSNorm) against float64 numpy references on fresh random inputs, and against transformers.
Legend: T = rows, C = channels, K = taps, Hk / Hv = key / value heads, Dk / Dv = head dims."""
import numpy as np
import pytest

from strata._native import kernels

REL = 1e-5


pytestmark = pytest.mark.usefixtures("one_thread")


def _assert_close(actual, ref, rel=REL):
    """Within rel of the reference, measured against its largest magnitude (float32 sums)."""
    assert actual.shape == ref.shape
    np.testing.assert_allclose(actual, ref, rtol=rel, atol=rel * max(np.abs(ref).max(), 1e-30))


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _randn(rng, *shape, scale=1.0):
    return (scale * rng.standard_normal(shape)).astype(np.float32)


# ---- causal conv + SiLU -----------------------------------------------------------------------

def _conv_ref(x, w, state):
    """float64 (y [T, C], new state [K-1, C]) of silu(depthwise causal conv)."""
    T, K = x.shape[0], w.shape[1]
    xin = np.concatenate([state, x]).astype(np.float64)                # [K-1+T, C]
    y = np.array([(w.astype(np.float64).T * xin[t:t + K]).sum(0) for t in range(T)])
    return _silu(y.reshape(T, x.shape[1])), xin[T:]


def _make_conv(rng, T, C, K):
    return _randn(rng, T, C), _randn(rng, C, K, scale=0.5), _randn(rng, K - 1, C)


@pytest.mark.parametrize("K", [4, 2])
@pytest.mark.parametrize("T", [1, 2, 7])
def test_conv_silu_matches_reference(T, K):
    rng = np.random.default_rng(T * 10 + K)
    x, w, state = _make_conv(rng, T, 300, K)  # two channel blocks, the second one partial
    y_ref, state_ref = _conv_ref(x, w, state)
    state_out = np.full_like(state, np.nan)
    y = kernels.conv_silu(x, w, state, state_out)
    _assert_close(y, y_ref)
    np.testing.assert_array_equal(state_out, state_ref.astype(np.float32))


@pytest.mark.parametrize("T", [0, 1, 2, 3, 5])
def test_conv_silu_in_place_state(T):
    rng = np.random.default_rng(T)
    x, w, state = _make_conv(rng, T, 40, 4)
    y_ref, state_ref = _conv_ref(x, w, state)
    y = kernels.conv_silu(x, w, state)  # T < K-1 shifts the state within itself
    assert y.shape == (T, 40)
    if T:
        _assert_close(y, y_ref)
    np.testing.assert_array_equal(state, state_ref.astype(np.float32))


@pytest.mark.parametrize("T1, T2", [(1, 1), (2, 5), (5, 1), (1, 6)])
def test_conv_silu_chained_calls_equal_one_call(T1, T2):
    rng = np.random.default_rng(T1 * 7 + T2)
    x, w, state = _make_conv(rng, T1 + T2, 24, 4)
    whole_state = state.copy()
    whole = kernels.conv_silu(x, w, whole_state)
    first = kernels.conv_silu(x[:T1], w, state)
    second = kernels.conv_silu(x[T1:], w, state)
    np.testing.assert_array_equal(np.concatenate([first, second]), whole)
    np.testing.assert_array_equal(state, whole_state)


def test_conv_silu_reads_a_column_slice():
    rng = np.random.default_rng(1)
    T, C, K = 6, 20, 4
    wide = _randn(rng, T, C + 9)
    x, w, state = wide[:, 5:5 + C], _randn(rng, C, K), _randn(rng, K - 1, C)
    state_c = state.copy()
    y = kernels.conv_silu(x, w, state)
    np.testing.assert_array_equal(y, kernels.conv_silu(np.ascontiguousarray(x), w, state_c))
    np.testing.assert_array_equal(state, state_c)


@pytest.mark.parametrize("threads", [2, 3, 0])
def test_conv_silu_same_bits_on_any_thread_count(threads):
    rng = np.random.default_rng(threads)
    x, w, state = _make_conv(rng, 40, 1000, 4)
    ref_state = state.copy()
    ref = kernels.conv_silu(x, w, ref_state)
    kernels.set_num_threads(threads)
    y = kernels.conv_silu(x, w, state)
    np.testing.assert_array_equal(y, ref)
    np.testing.assert_array_equal(state, ref_state)


# ---- gated delta rule -------------------------------------------------------------------------

def _delta_ref(q, k, v, beta_logit, alpha, A, dt_bias, state, eps=1e-6):
    """float64 (out [T, Hv*Dv], new state [Hv, Dk, Dv]) of the gated delta rule."""
    T = q.shape[0]
    Hv, Dk, Dv = state.shape
    group = Hv // (q.shape[1] // Dk)
    f64 = np.float64
    q = np.repeat(q.astype(f64).reshape(T, -1, Dk), group, axis=1)    # [T, Hv, Dk]
    k = np.repeat(k.astype(f64).reshape(T, -1, Dk), group, axis=1)    # [T, Hv, Dk]
    v = v.astype(f64).reshape(T, Hv, Dv)
    qn = q / np.sqrt((q * q).sum(-1, keepdims=True) + eps) / np.sqrt(Dk)
    kn = k / np.sqrt((k * k).sum(-1, keepdims=True) + eps)
    x = alpha.astype(f64) + dt_bias.astype(f64)                        # [T, Hv]
    g = A.astype(f64) * np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20))))
    beta = 1.0 / (1.0 + np.exp(-beta_logit.astype(f64)))              # [T, Hv]
    S = state.astype(f64).copy()
    out = np.zeros((T, Hv, Dv))
    for t in range(T):
        S *= np.exp(g[t])[:, None, None]
        kv = np.einsum("hkv,hk->hv", S, kn[t])
        delta = (v[t] - kv) * beta[t][:, None]
        S += kn[t][:, :, None] * delta[:, None, :]
        out[t] = np.einsum("hkv,hk->hv", S, qn[t])
    return out.reshape(T, Hv * Dv), S


def _make_delta(rng, T, Hk, Hv, Dk, Dv, pad=0):
    """Inputs of one sequence: q, k, v as column slices of one [T, 2*Hk*Dk + Hv*Dv + pad]
    matrix, beta_logit and alpha of one [T, 2*Hv + pad] matrix (contiguous when pad is 0
    and the slices are copied)."""
    qkv = _randn(rng, T, 2 * Hk * Dk + Hv * Dv + pad)
    ba = _randn(rng, T, 2 * Hv + pad)
    ends = np.cumsum([Hk * Dk, Hk * Dk, Hv * Dv])
    q, k, v = qkv[:, :ends[0]], qkv[:, ends[0]:ends[1]], qkv[:, ends[1]:ends[2]]
    A = -rng.uniform(0.05, 2.0, Hv).astype(np.float32)
    dt_bias = _randn(rng, Hv)
    state = _randn(rng, Hv, Dk, Dv, scale=0.5)
    return [q, k, v, ba[:, :Hv], ba[:, Hv:2 * Hv], A, dt_bias, state]


SHAPES = [(2, 4, 16, 8), (1, 1, 8, 8), (4, 8, 32, 32), (1, 2, 8, 130)]  # Hk, Hv, Dk, Dv


@pytest.mark.parametrize("Hk, Hv, Dk, Dv", SHAPES)
@pytest.mark.parametrize("T", [1, 5])
def test_gated_delta_matches_reference(T, Hk, Hv, Dk, Dv):
    rng = np.random.default_rng(T + Hk + Hv + Dk + Dv)
    args = [a.copy() for a in _make_delta(rng, T, Hk, Hv, Dk, Dv)]  # separate arrays
    out_ref, state_ref = _delta_ref(*args)
    state = args[-1]
    out = kernels.gated_delta(*args)  # in place
    _assert_close(out, out_ref)
    _assert_close(state, state_ref)


@pytest.mark.parametrize("Hk, Hv, Dk, Dv", SHAPES)
def test_gated_delta_reads_strided_rows(Hk, Hv, Dk, Dv):
    """Column slices of wide matrices (read in place) == separate arrays (packed first)."""
    rng = np.random.default_rng(Dv)
    args = _make_delta(rng, 6, Hk, Hv, Dk, Dv, pad=3)
    assert args[0].strides[0] > 4 * args[0].shape[1]
    separate = [a.copy() for a in args]
    out = kernels.gated_delta(*args)
    np.testing.assert_array_equal(out, kernels.gated_delta(*separate))
    np.testing.assert_array_equal(args[-1], separate[-1])


@pytest.mark.parametrize("T1, T2", [(1, 1), (3, 4), (6, 1)])
def test_gated_delta_chained_calls_equal_one_call(T1, T2):
    rng = np.random.default_rng(T1 * 3 + T2)
    *rows, A, dt_bias, state = _make_delta(rng, T1 + T2, 2, 4, 16, 8, pad=2)
    whole_state = state.copy()
    whole = kernels.gated_delta(*rows, A, dt_bias, whole_state)
    first = kernels.gated_delta(*(r[:T1] for r in rows), A, dt_bias, state)
    second = kernels.gated_delta(*(r[T1:] for r in rows), A, dt_bias, state)
    np.testing.assert_array_equal(np.concatenate([first, second]), whole)
    np.testing.assert_array_equal(state, whole_state)


@pytest.mark.parametrize("T", [0, 1, 4])
def test_gated_delta_double_buffered_leaves_state_in(T):
    rng = np.random.default_rng(T)
    *rest, state = _make_delta(rng, T, 2, 4, 16, 72)
    before = state.copy()
    state_out = np.full_like(state, np.nan)
    out = kernels.gated_delta(*rest, state, state_out)
    np.testing.assert_array_equal(state, before)
    in_place = kernels.gated_delta(*rest, state)
    np.testing.assert_array_equal(out, in_place)
    np.testing.assert_array_equal(state_out, state)
    if T == 0:
        np.testing.assert_array_equal(state_out, before)


@pytest.mark.parametrize("threads", [2, 3, 0])
def test_gated_delta_same_bits_on_any_thread_count(threads):
    rng = np.random.default_rng(threads)
    *rest, state = _make_delta(rng, 9, 4, 8, 32, 130)
    ref_state = state.copy()
    ref = kernels.gated_delta(*rest, ref_state)
    kernels.set_num_threads(threads)
    out = kernels.gated_delta(*rest, state)
    np.testing.assert_array_equal(out, ref)
    np.testing.assert_array_equal(state, ref_state)


def test_gated_delta_softplus_past_its_threshold():
    rng = np.random.default_rng(5)
    q, k, v, beta_logit, alpha, A, dt_bias, state = _make_delta(rng, 4, 1, 2, 8, 8)
    alpha = np.array([[30.0, -30.0], [19.5, 20.5], [-100.0, 90.0], [0.0, 1.0]], np.float32)
    A = np.array([-0.01, -0.02], np.float32)
    dt_bias = np.zeros(2, np.float32)
    out_ref, state_ref = _delta_ref(q, k, v, beta_logit, alpha, A, dt_bias, state)
    out = kernels.gated_delta(q, k, v, beta_logit, alpha, A, dt_bias, state)
    assert np.isfinite(out).all()
    _assert_close(out, out_ref)
    _assert_close(state, state_ref)


# ---- gated RMSNorm ----------------------------------------------------------------------------

def _rmsnorm_ref(x, z, w, eps):
    T, Dv = x.shape[0], w.shape[0]
    xh = x.astype(np.float64).reshape(T, -1, Dv)
    xh = xh / np.sqrt((xh * xh).mean(-1, keepdims=True) + eps) * w.astype(np.float64)
    return xh.reshape(x.shape) * _silu(z.astype(np.float64))


@pytest.mark.parametrize("T, Hv, Dv", [(1, 4, 8), (5, 3, 32), (40, 8, 128)])
def test_gated_rmsnorm_matches_reference(T, Hv, Dv):
    rng = np.random.default_rng(T + Hv + Dv)
    x = _randn(rng, T, Hv * Dv, scale=3.0)
    wide = _randn(rng, T, Hv * Dv + 7)
    z, w = wide[:, 7:], _randn(rng, Dv)
    ref = _rmsnorm_ref(x, z, w, 1e-6)
    out = kernels.gated_rmsnorm(x, z, w, 1e-6)
    assert out is x
    _assert_close(x, ref)


# ---- argument checks --------------------------------------------------------------------------

def test_conv_silu_names_bad_arguments():
    rng = np.random.default_rng(0)
    x, w, state = _make_conv(rng, 3, 8, 4)
    with pytest.raises(ValueError, match="x must have dtype float32"):
        kernels.conv_silu(x.astype(np.float64), w, state)
    with pytest.raises(ValueError, match="x must have contiguous rows"):
        kernels.conv_silu(np.asfortranarray(x), w, state)
    with pytest.raises(ValueError, match="w must have shape"):
        kernels.conv_silu(x, w[:4], state)
    with pytest.raises(ValueError, match="state_in must have shape"):
        kernels.conv_silu(x, w, state[:2])
    with pytest.raises(ValueError, match="state_out must have state_in's shape"):
        kernels.conv_silu(x, w, state, np.zeros((3, 9), np.float32))
    with pytest.raises(ValueError, match="state_out must be state_in itself or not overlap"):
        wide = np.zeros((4, 8), np.float32)
        kernels.conv_silu(x, w, wide[:3], wide[1:])
    state.flags.writeable = False
    with pytest.raises(ValueError, match="state_in must be writable"):
        kernels.conv_silu(x, w, state)


def test_gated_delta_names_bad_arguments():
    rng = np.random.default_rng(0)
    q, k, v, b, a, A, dt_bias, state = _make_delta(rng, 3, 2, 4, 16, 8)

    def call(**changes):
        args = dict(q=q, k=k, v=v, beta_logit=b, alpha=a, A=A, dt_bias=dt_bias, state_in=state)
        args.update(changes)
        return kernels.gated_delta(**args)

    with pytest.raises(ValueError, match="v must have T = 3 rows"):
        call(v=v[:2])
    with pytest.raises(ValueError, match="alpha must have T = 3 rows"):
        call(alpha=a[:2])
    with pytest.raises(ValueError, match="q must have contiguous rows"):
        call(q=q[:, ::2])
    with pytest.raises(ValueError, match="k must have dtype float32"):
        call(k=k.astype(np.float64))
    with pytest.raises(ValueError, match="v must have shape"):
        call(v=v[:, :-8])
    with pytest.raises(ValueError, match="q rows of 48 values must be Hk heads"):
        call(q=_randn(rng, 3, 48))
    with pytest.raises(ValueError, match="k must have shape"):
        call(k=_randn(rng, 3, 16))
    with pytest.raises(ValueError, match="A must have Hv = 4 values"):
        call(A=A[:3])
    with pytest.raises(ValueError, match="dt_bias must have dtype float32"):
        call(dt_bias=dt_bias.astype(np.float64))
    with pytest.raises(ValueError, match="state_in must have 3 dimensions"):
        call(state_in=state.reshape(4, -1))
    with pytest.raises(ValueError, match="alpha must have shape"):
        call(alpha=a[:, :3])
    with pytest.raises(ValueError, match="state_out must have state_in's shape"):
        kernels.gated_delta(q, k, v, b, a, A, dt_bias, state, state[:2].copy())


def test_gated_rmsnorm_names_bad_arguments():
    x, z, w = np.ones((2, 16), np.float32), np.ones((2, 16), np.float32), np.ones(8, np.float32)
    with pytest.raises(ValueError, match="x rows of 16 values are not whole heads"):
        kernels.gated_rmsnorm(x, z, w[:5])
    with pytest.raises(ValueError, match="z must have x's shape"):
        kernels.gated_rmsnorm(x, z[:, :8], w)
    with pytest.raises(ValueError, match="x must be C-contiguous"):
        kernels.gated_rmsnorm(np.ones((2, 32), np.float32)[:, ::2], z, w)


# ---- transformers ---------------------------------------------------------------------------

@pytest.mark.parity
def test_matches_transformers_qwen3_next():
    torch = pytest.importorskip("torch")
    qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    rng = np.random.default_rng(11)
    T, Hk, Hv, Dk, Dv, K = 5, 2, 4, 16, 8, 4
    q, k, v, b, a, A, dt_bias, state = [x.copy() for x in _make_delta(rng, T, Hk, Hv, Dk, Dv)]
    mixed = np.concatenate([q, k, v], axis=1)                          # [T, C]
    C = mixed.shape[1]
    conv_w, conv_state = _randn(rng, C, K, scale=0.5), _randn(rng, K - 1, C)

    torch_state = torch.zeros(1, C, K)  # transformers keeps K inputs, the oldest unused
    torch_state[0, :, 1:] = torch.from_numpy(conv_state.T.copy())
    y_torch = qwen3_next.causal_conv1d_update(
        torch.from_numpy(mixed.T.copy())[None], torch_state, torch.from_numpy(conv_w),
        None, "silu")[0].T.numpy()
    y = kernels.conv_silu(mixed, conv_w, conv_state)
    _assert_close(y, y_torch.astype(np.float64), rel=1e-5)
    np.testing.assert_array_equal(conv_state, torch_state[0, :, 1:].T.numpy())

    g = A * torch.nn.functional.softplus(torch.from_numpy(a + dt_bias)).numpy()
    heads = [torch.from_numpy(x.reshape(1, T, -1, d)) for x, d in ((q, Dk), (k, Dk), (v, Dv))]
    # each q/k head serves Hv // Hk consecutive value heads: repeated here, as the model's
    # forward does (transformers 5.24 repeats inside the function, older ones only before it)
    heads[:2] = [h.repeat_interleave(Hv // Hk, dim=2) for h in heads[:2]]
    out_torch, state_torch = qwen3_next.torch_recurrent_gated_delta_rule(
        *heads, g=torch.from_numpy(g[None]), beta=torch.sigmoid(torch.from_numpy(b[None])),
        initial_state=torch.from_numpy(state[None].copy()), output_final_state=True,
        use_qk_l2norm_in_kernel=True)
    out = kernels.gated_delta(q, k, v, b, a, A, dt_bias, state)
    _assert_close(out, out_torch.reshape(T, -1).numpy().astype(np.float64))
    _assert_close(state, state_torch[0].numpy().astype(np.float64))

    norm = qwen3_next.Qwen3NextRMSNormGated(Dv, eps=1e-6)
    w, z = _randn(rng, Dv), _randn(rng, T, Hv * Dv)
    with torch.no_grad():
        norm.weight.copy_(torch.from_numpy(w))
        ref = norm(torch.from_numpy(out.reshape(T, Hv, Dv)),
                   torch.from_numpy(z.reshape(T, Hv, Dv))).reshape(T, -1).numpy()
    _assert_close(kernels.gated_rmsnorm(out, z, w, 1e-6), ref.astype(np.float64))
