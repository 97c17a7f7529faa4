"""mmq.cu against float64 references on fresh random inputs: the int8 tensor-core products (dense,
fused q/k/v, grouped gate/up + SiLU and down over uneven expert groups) and the tiled float
product; a row's result does not depend on its tile or on its window's other rows; the plan
picks these kernels for prompt-sized windows only."""
import numpy as np
import pytest

from strata.backends.cuda import plan as cuda_plan
from strata.backends.window import Window
from strata.model.gguf_file import GGUFModel

from cuda_synth import B32_TYPES, IQ_TYPES
from test_cuda_kernels import _Dev, _acts, _q8, _weights

pytestmark = pytest.mark.cuda

# mmq.cu: 32-column block types (Q4_1 / Q5_1 with a min term), K a multiple of 32
MMQ_TYPES = ("q4_0", "q8_0") + B32_TYPES
# mmq_k.cu: 32-row tiles of k-quant and grid i-quant super-blocks
K_TYPES = ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_xs") + IQ_TYPES
FMT = "PPPPqiiPPPPPPPPPiPP"
BM, BN, BNG = 64, 64, 32  # mmq.cu's tiles: outputs, rows dense / grouped


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def _rel(got: np.ndarray, want: np.ndarray) -> float:
    assert np.isfinite(got).all()  # the poisoned outputs were all written
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def _silu(v: np.ndarray) -> np.ndarray:
    return v / (1 + np.exp(-v))


@pytest.mark.parametrize("tile_rows", (64, 32))
@pytest.mark.parametrize("weight_type", MMQ_TYPES)
@pytest.mark.parametrize("num_out, num_cols, num_rows", [(200, 768, 100), (72, 320, 17),
                                                         (130, 1408, 45)])
def test_dense_products(runtime, weight_type, num_out, num_cols, num_rows, tile_rows):
    """store (+ bias), add and gate/up over T rows; N not a multiple of the 64-output tile, K of
    320 ends in a partial k-tile (10 blocks of 32 = 8 + 2), K of 1408 (Qwen1.5-MoE's expert
    down, 44 blocks: 5 k-tiles + 4 blocks)."""
    _check_dense_products(runtime, weight_type, num_out, num_cols, num_rows, tile_rows)


@pytest.mark.parametrize("weight_type", K_TYPES)
@pytest.mark.parametrize("num_out, num_cols, num_rows", [(200, 768, 100), (72, 512, 17)])
def test_k_quant_products(runtime, weight_type, num_out, num_cols, num_rows):
    """mmq_k.cu's store (+ bias), add and gate/up; 768 columns of Q6_K are rows of 630 bytes,
    so every other row's super-blocks start 6 bytes into a 16-byte piece."""
    _check_dense_products(runtime, weight_type, num_out, num_cols, num_rows, 32)


def _check_dense_products(runtime, weight_type, num_out, num_cols, num_rows, tile_rows):
    dev, rng = _Dev(runtime), np.random.default_rng()
    N, K, T = num_out, num_cols, num_rows
    (raw0, w0), (raw1, w1) = _weights(weight_type, N, K, rng), _weights(weight_type, N, K, rng)
    x = rng.standard_normal((T, K)).astype(np.float32)
    xr, (q, d) = _acts(x, weight_type), _q8(x)
    xq, xd = dev.put(q), dev.put(d)
    group = dev.put(np.array([0, 0, T, 1], dtype=np.int32))
    bias = rng.standard_normal(N).astype(np.float32)
    y = dev.empty(4 * T * N)

    def run(kernel, raw, raw2, bias_ptr, out, num_out_tiles):
        dev.launch(kernel, (num_out_tiles, _cdiv(T, tile_rows)), (128,), FMT,
                   [dev.put(raw), dev.put(raw2) if raw2 is not None else 0, 0, 0,
                    raw.shape[1], N, K, 0, xq, xd, group, group + 12, 0, 0, bias_ptr, out, N, 0, 0])

    run(f"mmq{tile_rows}_store_{weight_type}", raw0, None, dev.put(bias), y, _cdiv(N, BM))
    want = xr @ w0.T + bias
    assert _rel(dev.get(y, (T, N), np.float32), want) < 1e-5
    run(f"mmq{tile_rows}_add_{weight_type}", raw1, None, 0, y, _cdiv(N, BM))
    want = want + xr @ w1.T
    assert _rel(dev.get(y, (T, N), np.float32), want) < 1e-5
    out = dev.empty(4 * T * N)
    run(f"mmq{tile_rows}_gateup_{weight_type}", raw0, raw1, 0, out, _cdiv(N, BM // 2))
    want = _silu(xr @ w0.T) * (xr @ w1.T)
    assert _rel(dev.get(out, (T, N), np.float32), want) < 1e-5


@pytest.mark.parametrize("weight_type, tile_rows", [(t, n) for t in MMQ_TYPES for n in (64, 32)]
                         + [(t, 32) for t in K_TYPES])
def test_fused_qkv(runtime, weight_type, tile_rows):
    dev, rng = _Dev(runtime), np.random.default_rng()
    Nq, Nkv, K, T = 200, 40, 512, 70
    mats = [_weights(weight_type, n, K, rng) for n in (Nq, Nkv, Nkv)]
    x = rng.standard_normal((T, K)).astype(np.float32)
    xr, (q, d) = _acts(x, weight_type), _q8(x)
    group = dev.put(np.array([0, 0, T, 1], dtype=np.int32))
    biases = [rng.standard_normal(n).astype(np.float32) for n in (Nq, Nkv, Nkv)]
    outs = [dev.empty(4 * T * n) for n in (Nq, Nkv, Nkv)]
    dev.launch(f"mmq{tile_rows}_qkv_{weight_type}",
               (_cdiv(Nq, BM) + 2 * _cdiv(Nkv, BM), _cdiv(T, tile_rows)),
               (128,), "PPPqiiiPPPPPPPPPPP",
               [*[dev.put(raw) for raw, _ in mats], mats[0][0].shape[1], Nq, Nkv, K, 0,
                dev.put(q), dev.put(d), group, group + 12, *[dev.put(b) for b in biases], *outs])
    for (raw, w), b, out, n in zip(mats, biases, outs, (Nq, Nkv, Nkv)):
        assert _rel(dev.get(out, (T, n), np.float32), xr @ w.T + b) < 1e-5


@pytest.mark.parametrize("tile_rows", (64, 32))
@pytest.mark.parametrize("num_out, num_cols, num_rows", [(200, 768, 100), (72, 2048, 17),
                                                         (130, 256, 70)])
def test_raw_staging_equals_word_staging(runtime, num_out, num_cols, num_rows, tile_rows):
    """Q4_0 rows of a multiple of 256 columns: the RAW kernels (mmq64r_* / mmq32r_*: 16-byte
    loads of each row's k-tile, unpacked in shared memory) give the word-staged kernels' bits,
    for store + bias, add, gate/up and the fused q/k/v."""
    dev, rng = _Dev(runtime), np.random.default_rng()
    N, K, T = num_out, num_cols, num_rows
    (raw0, w0), (raw1, w1) = _weights("q4_0", N, K, rng), _weights("q4_0", N, K, rng)
    x = rng.standard_normal((T, K)).astype(np.float32)
    xr, (q, d) = _acts(x, "q4_0"), _q8(x)
    xq, xd = dev.put(q), dev.put(d)
    group = dev.put(np.array([0, 0, T, 1], dtype=np.int32))
    bias = dev.put(rng.standard_normal(N).astype(np.float32))
    w0d, w1d = dev.put(raw0), dev.put(raw1)

    def run(tag, kind, w, w2, b, out):
        outputs = BM // 2 if kind == "gateup" else BM
        dev.launch(f"mmq{tile_rows}{tag}_{kind}_q4_0", (_cdiv(N, outputs), _cdiv(T, tile_rows)),
                   (128,), FMT, [w, w2, 0, 0, raw0.shape[1], N, K, 0, xq, xd, group,
                                 group + 12, 0, 0, b, out, N, 0, 0])

    got = {}
    for tag in ("r", ""):
        y, h = dev.empty(4 * T * N), dev.empty(4 * T * N)
        run(tag, "store", w0d, 0, bias, y)
        run(tag, "add", w1d, 0, 0, y)
        run(tag, "gateup", w0d, w1d, 0, h)
        got[tag] = (dev.get(y, (T, N), np.float32), dev.get(h, (T, N), np.float32))
    for raw_out, word_out in zip(got["r"], got[""]):
        np.testing.assert_array_equal(raw_out, word_out)
    want_y = xr @ w0.T + dev.get(bias, (N,), np.float32) + xr @ w1.T
    assert _rel(got["r"][0], want_y) < 1e-5
    assert _rel(got["r"][1], _silu(xr @ w0.T) * (xr @ w1.T)) < 1e-5

    Nq, Nkv = N, 40
    mats = [_weights("q4_0", n, K, rng) for n in (Nq, Nkv, Nkv)]
    ptrs = [dev.put(raw) for raw, _ in mats]
    qkv = {}
    for tag in ("r", ""):
        outs = [dev.empty(4 * T * n) for n in (Nq, Nkv, Nkv)]
        dev.launch(f"mmq{tile_rows}{tag}_qkv_q4_0",
                   (_cdiv(Nq, BM) + 2 * _cdiv(Nkv, BM), _cdiv(T, tile_rows)), (128,),
                   "PPPqiiiPPPPPPPPPPP", [*ptrs, mats[0][0].shape[1], Nq, Nkv, K, 0, xq, xd,
                                          group, group + 12, 0, 0, 0, *outs])
        qkv[tag] = [dev.get(o, (T, n), np.float32) for o, n in zip(outs, (Nq, Nkv, Nkv))]
    for raw_out, word_out, (_, w) in zip(qkv["r"], qkv[""], mats):
        np.testing.assert_array_equal(raw_out, word_out)
        assert _rel(raw_out, xr @ w.T) < 1e-5


def test_raw_staging_grouped_experts(runtime):
    """The grouped RAW kernels read experts through pointer tables (separate allocations) and
    give the word-staged kernels' bits: gate/up over gathered rows, down scattered."""
    dev, rng = _Dev(runtime), np.random.default_rng()
    E, T, F, H = 5, 160, 72, 512
    groups, act_rows, experts = _uneven_groups(rng, T)
    G, P = len(groups) // 3, len(act_rows)
    g = dev.put(np.concatenate([groups, [G]]).astype(np.int32))
    gate, up = [[_weights("q4_0", F, H, rng) for _ in range(E)] for _ in range(2)]
    tables = [dev.put(np.array([dev.put(m[e][0]) for e in range(E)], dtype=np.uint64))
              for m in (gate, up)]
    q, d = _q8(rng.standard_normal((T, H)).astype(np.float32))
    outs = {}
    for tag in ("r", ""):
        hbuf = dev.empty(4 * P * F)
        dev.launch(f"mmq32{tag}_gateup_q4_0", (_cdiv(F, BM // 2), _cdiv(P, BNG) + E), (128,),
                   FMT, [0, 0, tables[0], tables[1], gate[0][0].shape[1], F, H, 0, dev.put(q),
                         dev.put(d), g, g + 12 * G, dev.put(act_rows), 0, 0, hbuf, F, 0, 0])
        outs[tag] = dev.get(hbuf, (P, F), np.float32)
    np.testing.assert_array_equal(outs["r"], outs[""])
    N2, K2 = 136, 768
    down = [_weights("q4_0", N2, K2, rng) for _ in range(E)]
    table = dev.put(np.array([dev.put(down[e][0]) for e in range(E)], dtype=np.uint64))
    hq, hd = _q8(rng.standard_normal((P, K2)).astype(np.float32))
    out_rows = dev.put(rng.permutation(P).astype(np.int32))
    for tag in ("r", ""):
        y = dev.empty(4 * P * N2)
        dev.launch(f"mmq32{tag}_store_q4_0", (_cdiv(N2, BM), _cdiv(P, BNG) + E), (128,), FMT,
                   [0, 0, table, 0, down[0][0].shape[1], N2, K2, 0, dev.put(hq), dev.put(hd),
                    g, g + 12 * G, 0, out_rows, 0, y, N2, 0, 0])
        outs[tag] = dev.get(y, (P, N2), np.float32)
    np.testing.assert_array_equal(outs["r"], outs[""])


def _uneven_groups(rng, num_rows: int):
    """Expert groups of 1, 0, 150 (> 128), 37 and 9 rows: (groups [G, 3], act_rows, experts)
    in grouped order; each expert's rows distinct, as top-k routing gives."""
    members = {0: [5], 1: [], 2: list(range(150)),
               3: sorted(rng.choice(num_rows, 37, replace=False)),
               4: sorted(rng.choice(num_rows, 9, replace=False))}
    groups, act_rows, experts = [], [], []
    for e, rows in members.items():
        if rows:
            groups += [e, len(act_rows), len(rows)]
            act_rows += list(rows)
            experts += [e] * len(rows)
    return np.array(groups, dtype=np.int32), np.array(act_rows, dtype=np.int32), experts


@pytest.mark.parametrize("weight_type", MMQ_TYPES + K_TYPES)
def test_grouped_experts(runtime, weight_type):
    """Grouped gate/up + SiLU (rows gathered through act_rows) and down (outputs scattered
    through out_rows), each expert read through a pointer table of separate allocations."""
    dev, rng = _Dev(runtime), np.random.default_rng()
    # F not a multiple of the 32 gate/up outputs; H of 10 blocks (k-quants: 2 super-blocks);
    # the down's K2 = 2H: 20 blocks, or 44 (1408) for the k-quant files' fallback types
    E, T, F, H = 5, 160, 72, 512 if weight_type in K_TYPES else 320
    groups, act_rows, experts = _uneven_groups(rng, T)
    G, P = len(groups) // 3, len(act_rows)
    g = dev.put(np.concatenate([groups, [G]]).astype(np.int32))
    gate, up = [_weights(weight_type, F, H, rng) for _ in range(E)], \
        [_weights(weight_type, F, H, rng) for _ in range(E)]
    tables = [dev.put(np.array([dev.put(m[e][0]) for e in range(E)], dtype=np.uint64))
              for m in (gate, up)]
    x = rng.standard_normal((T, H)).astype(np.float32)
    xr, (q, d) = _acts(x, weight_type), _q8(x)
    hbuf = dev.empty(4 * P * F)
    # tile slots: every tile the groups need (9 here) and E spare ones that find no tile
    dev.launch(f"mmq32_gateup_{weight_type}", (_cdiv(F, BM // 2), _cdiv(P, BNG) + E), (128,), FMT,
               [0, 0, tables[0], tables[1], gate[0][0].shape[1], F, H, 0, dev.put(q),
                dev.put(d), g, g + 12 * G, dev.put(act_rows), 0, 0, hbuf, F, 0, 0])
    want = np.stack([_silu(xr[r] @ gate[e][1].T) * (xr[r] @ up[e][1].T)
                     for r, e in zip(act_rows, experts)])  # [P, F]
    assert _rel(dev.get(hbuf, (P, F), np.float32), want) < 1e-5

    # down: fresh [P, K2] rows in grouped order, outputs scattered to pair rows
    N2, K2 = 136, 1408 if weight_type in B32_TYPES else 2 * H
    down = [_weights(weight_type, N2, K2, rng) for _ in range(E)]
    table = dev.put(np.array([dev.put(down[e][0]) for e in range(E)], dtype=np.uint64))
    h = rng.standard_normal((P, K2)).astype(np.float32)
    hr, (hq, hd) = _acts(h, weight_type), _q8(h)
    out_rows = rng.permutation(P).astype(np.int32)
    y = dev.empty(4 * P * N2)
    dev.launch(f"mmq32_store_{weight_type}", (_cdiv(N2, BM), _cdiv(P, BNG) + E), (128,), FMT,
               [0, 0, table, 0, down[0][0].shape[1], N2, K2, 0, dev.put(hq), dev.put(hd),
                g, g + 12 * G, 0, dev.put(out_rows), 0, y, N2, 0, 0])
    want = np.empty((P, N2))
    for p, e in enumerate(experts):
        want[out_rows[p]] = hr[p] @ down[e][1].T
    assert _rel(dev.get(y, (P, N2), np.float32), want) < 1e-5


@pytest.mark.parametrize("weight_type, num_cols", [(t, 1024) for t in MMQ_TYPES + K_TYPES]
                         + [(t, 1408) for t in B32_TYPES])
def test_row_result_independent_of_tile(runtime, weight_type, num_cols):
    """Rows 37..86 computed alone (another tile position), with 32-row tiles and inside all
    100 rows give the same bits (K = 1408: a partial last k-tile)."""
    dev, rng = _Dev(runtime), np.random.default_rng()
    N, K, T = 130, num_cols, 100
    raw, _ = _weights(weight_type, N, K, rng)
    q, d = _q8(rng.standard_normal((T, K)).astype(np.float32))
    args = [dev.put(raw), 0, 0, 0, raw.shape[1], N, K, 0, dev.put(q), dev.put(d)]
    outs = []
    runs = [("mmq64_store", 0, T, BN), ("mmq64_store", 37, 50, BN), ("mmq32_store", 37, 50, BNG)]
    if weight_type in K_TYPES:
        runs = [("mmq32_store", 0, T, BNG), ("mmq32_store", 37, 50, BNG),
                ("mmq32_store", 30, 57, BNG)]
    for kernel, first, count, tile in runs:
        group = dev.put(np.array([0, first, count, 1], dtype=np.int32))
        y = dev.empty(4 * T * N)
        dev.launch(f"{kernel}_{weight_type}", (_cdiv(N, BM), _cdiv(count, tile)), (128,),
                   FMT, args + [group, group + 12, 0, 0, 0, y, N, 0, 0])
        outs.append(dev.get(y, (T, N), np.float32)[37:87])
    np.testing.assert_array_equal(outs[1], outs[0])
    np.testing.assert_array_equal(outs[2], outs[0])


@pytest.mark.parametrize("weight_type", ("f32", "f16", "bf16"))
@pytest.mark.parametrize("num_cols", (2048, 100))
def test_float_products(runtime, weight_type, num_cols):
    """The tiled float kernel (the F32 router): store + bias and add, K of 2048 and of 100 (a
    partial 64-column step), N and T not multiples of 32; rows computed alone are the same."""
    dev, rng = _Dev(runtime), np.random.default_rng()
    N, K, T = 130, num_cols, 70
    (raw0, w0), (raw1, w1) = _weights(weight_type, N, K, rng), _weights(weight_type, N, K, rng)
    x = rng.standard_normal((T, K)).astype(np.float32)
    xf, xr = dev.put(x), x.astype(np.float64)
    bias = rng.standard_normal(N).astype(np.float32)

    def run(kernel, raw, first, count, bias_ptr, y):
        group = dev.put(np.array([0, first, count, 1], dtype=np.int32))
        dev.launch(kernel, (_cdiv(N, cuda_plan.MMF_OUTS), 1, _cdiv(count, cuda_plan.MMF_ROWS)),
                   (cuda_plan.MMF_THREADS,), FMT,
                   [dev.put(raw), 0, 0, 0, raw.shape[1], N, K, xf, 0, 0, group, group + 12, 0, 0,
                    bias_ptr, y, N, 0, 0])

    y = dev.empty(4 * T * N)
    run(f"mmf_store_{weight_type}", raw0, 0, T, dev.put(bias), y)
    want = xr @ w0.T + bias
    full = dev.get(y, (T, N), np.float32)
    assert _rel(full, want) < 1e-5
    alone = dev.empty(4 * T * N)
    run(f"mmf_store_{weight_type}", raw0, 21, 40, dev.put(bias), alone)
    np.testing.assert_array_equal(dev.get(alone, (T, N), np.float32)[21:61], full[21:61])
    run(f"mmf_add_{weight_type}", raw1, 0, T, 0, y)
    assert _rel(dev.get(y, (T, N), np.float32), want + xr @ w1.T) < 1e-5


def _tokens(n, vocab, seed):
    return np.random.default_rng(seed).integers(0, vocab, size=n).astype(np.int32)


@pytest.mark.parametrize("shape, weight_type", [("tiny", "q4_0"), ("tiny-qwen2moe", "q8_0"),
                                                ("tiny", "f32"), ("tiny", "q4_k"),
                                                ("tiny-qwen2moe", "q6_k"), ("tiny", "q5_0"),
                                                ("tiny-qwen2moe", "q4_1"), ("tiny", "q5_1"),
                                                ("tiny-qwen2moe", "iq4_nl")])
def test_plan_uses_mmq_from_the_threshold_and_windows_equal_solo(synth_path, shape,
                                                                 weight_type):
    """Windows of >= MMQ_MIN_ROWS rows launch mmq.cu's kernels, smaller ones matmul.cu's; two
    prompt chunks in one window (both over the threshold alone) equal their solo passes bit for
    bit."""
    from strata.backends.cuda import CudaModel

    gpu = CudaModel(GGUFModel.open(synth_path(shape, weight_type)))
    with gpu.runtime.active():
        small = set(gpu._plan(cuda_plan.MMQ_MIN_ROWS - 1, 1).launches.names())
        large = set(gpu._plan(cuda_plan.MMQ_MIN_ROWS, 1).launches.names())
    assert not any(n.startswith(("mmq", "mmf")) for n in small)
    if weight_type == "f32":
        assert {"mmf_store_f32", "mmf_add_f32"} <= large
    else:
        assert {f"mmq32_qkv_{weight_type}", f"mmq32_add_{weight_type}",
                f"mmq32_gateup_{weight_type}", f"mmq32_store_{weight_type}",
                "mmf_store_f32"} <= large  # the router stays F32
    vocab = gpu.spec.vocab
    chunks = [_tokens(cuda_plan.MMQ_MIN_ROWS + n, vocab, seed=60 + n) for n in (4, 1)]
    prompts = [_tokens(n, vocab, seed=70 + n) for n in (3, 8)]
    solo = []
    for p, c in zip(prompts, chunks):
        kv = gpu.new_kv(64)
        gpu.forward(p, kv)
        solo.append(gpu.forward(c, kv, all_logits=True))
    kvs = [gpu.new_kv(64) for _ in prompts]
    for p, kv in zip(prompts, kvs):
        gpu.forward(p, kv)
    window = Window.build(list(zip(kvs, chunks)), logits="all")
    logits = gpu.forward_window(window)
    for i in range(2):
        np.testing.assert_array_equal(window.logits_of(logits, i), solo[i])


@pytest.mark.parametrize("weight_type", ("q4_0",) + K_TYPES + B32_TYPES)
def test_mmq_and_dp4a_prompts_agree(synth_path, monkeypatch, weight_type):
    """A prompt of MMQ_MIN_ROWS + 24 tokens through mmq and through the dp4a kernels (threshold
    raised): the same function up to float rounding. Rows agree to ~1e-7 until a router
    near-tie flips a row's experts under that rounding (the coarse synth Q2_K does at row ~8);
    the rows after it attend to the changed row, so they move by a few percent and their argmax
    may change. A wrong product would show on the first rows."""
    from strata.backends.cuda import CudaModel

    path = synth_path("tiny", weight_type)
    threshold_before = cuda_plan.MMQ_MIN_ROWS
    best = None
    # A near-tie belongs to a prompt, a wrong product to every prompt: the coarsest i-quants
    # (the IQ2 synths) tie as early as row 0 or 1 on some prompts (seen on the H200: iq2_xxs
    # parts at row 0 with seed 9 and at rows 37 / 11 / 7 with seeds 1 / 2 / 3), so the test
    # takes the best of three prompts
    for seed in (9, 1, 2):
        prompt = _tokens(threshold_before + 24, GGUFModel.open(path).spec.vocab, seed=seed)
        outs = []
        for threshold in (threshold_before, 1 << 30):
            monkeypatch.setattr(cuda_plan, "MMQ_MIN_ROWS", threshold)
            gpu = CudaModel(GGUFModel.open(path))
            outs.append(gpu.forward(prompt, gpu.new_kv(64), all_logits=True))
        monkeypatch.setattr(cuda_plan, "MMQ_MIN_ROWS", threshold_before)
        errors = np.abs(outs[0] - outs[1]).max(axis=1) / np.abs(outs[1]).max()
        parted = np.flatnonzero(errors > 1e-4)
        first_parted = int(parted[0]) if len(parted) else len(errors)
        print(f"{weight_type} mmq vs dp4a, prompt {seed}, |diff| / logit scale per row: median "
              f"{np.median(errors):.1e}, max {errors.max():.1e}; rows equal to float rounding "
              f"before row {first_parted}")
        if best is None or first_parted > best[0]:
            best = (first_parted, outs)
        if first_parted >= 5:
            break
    first_parted, outs = best
    assert first_parted >= 5
    np.testing.assert_array_equal(np.argmax(outs[0][:first_parted], 1),
                                  np.argmax(outs[1][:first_parted], 1))
