"""Prompt-window kernels against float64 references on fresh random inputs: the tensor-core
attention (attention_prompt beside attention_singles, and attention_group.cu for decode rows
deep in their context; fp16 and int8 KV cells, chunks beside decode rows, a row's bits
independent of its window), the wide pair grouping, and the plan's choice of both from
plan.MMQ_MIN_ROWS rows."""
import functools
import operator

import numpy as np
import pytest

from strata.backends.cuda.plan import (ATT_SINGLE_BLOCKS, ATT_SPLITS, ATTENTION_GROUP_FMT,
                                       ATTENTION_GROUP_MERGE_FMT, ATTENTION_PROMPT_FMT,
                                       ATTENTION_SINGLES_FMT, CELLS_FP16, CELLS_INT8,
                                       GQA_SPLITS, GROUP_WIDE_THREADS, INT_MAX, PA_ROWS,
                                       PA_WARPS, attention_group_launch,
                                       attention_group_merge_launch, attention_group_part_floats,
                                       attention_kernels, attention_prompt_shared_bytes,
                                       prompt_kernels)

from test_cuda_kernels import _Dev, _q8, attention_reference, grouped_reference, run_attention

pytestmark = pytest.mark.cuda

# Error per output / max |V| of its head. Q and P enter the fp16 mma as hi + lo pairs (~22 bits)
# and K/V cells are fp16: float32-like sums. int8 cells are dequantised to fp16 in shared memory
# (relative 2^-12 per value, far below their own 8-bit rounding).
PROMPT_ATT_TOLERANCE = {False: 1e-4, True: 2e-3}  # by is_int8


def _slot_cache(rng, L, KVH, C, D, is_int8):
    """One KV's device bytes and its float64 cells [L, 2, KVH, C, D] as the kernels read them."""
    cells = rng.standard_normal((L, 2, KVH, C, D)).astype(np.float32)
    if not is_int8:
        half = cells.astype(np.float16)
        return half.view(np.uint8).reshape(-1), half.astype(np.float64)
    scales = (np.abs(cells).max(axis=-1) / 127).astype(np.float32)  # [L, 2, KVH, C]
    codes = np.rint(cells / scales[..., None]).astype(np.int8)
    raw = np.concatenate([codes.view(np.uint8).reshape(-1), scales.view(np.uint8).reshape(-1)])
    return raw, codes.astype(np.float64) * scales[..., None].astype(np.float64)


def run_prompt_attention(dev, q, bases, positions, capacity, layer, num_layers, num_kv_heads,
                         want_q8, deep_from=None, kernels=None, singles=True):
    """attention_prompt(_i8) + attention_singles_d* as a prompt-sized window plan launches
    them, with attention_group.cu between them for the singles at `deep_from` or past it when
    given (a deep plan's); returns (out [R, Q, D], outq [R, Q*D], outd [R, Q*D/32]).
    `kernels`: attention_prompt.cu's kernels to launch (default: those for the bases' cell
    types, as a plan picks them); singles False leaves the single rows unwritten."""
    R, Q, D = q.shape
    group = Q // num_kv_heads
    warps = min(group, PA_WARPS)
    out, outq, outd = dev.empty(4 * R * Q * D), dev.empty(R * Q * D), dev.empty(R * Q * D // 8)
    part = dev.empty(4 * R * Q * ATT_SPLITS * (2 + D))
    counts = dev.empty(4 * R * Q, fill=0)
    common = [dev.put(q), out, outq if want_q8 else 0, outd if want_q8 else 0,
              dev.put(np.array(bases, dtype=np.uint64)), dev.put(positions.astype(np.int32)),
              dev.put(np.full(R, capacity, dtype=np.int32)), R]
    dims = [layer, num_layers, Q, num_kv_heads, D, D ** -0.5]
    if kernels is None:
        kernels = prompt_kernels(functools.reduce(
            operator.or_, (CELLS_INT8 if int(b) & 1 else CELLS_FP16 for b in bases)))
    for name in kernels:
        dev.launch(name, ((R + PA_ROWS - 1) // PA_ROWS, num_kv_heads,
                          (group + warps - 1) // warps), (32 * warps,), ATTENTION_PROMPT_FMT,
                   [*common, *dims], shared_bytes=attention_prompt_shared_bytes(D))
    if deep_from is not None:
        name, grid, block = attention_group_launch(R, Q, num_kv_heads, D)
        group_part = dev.empty(4 * attention_group_part_floats(R, Q, D))
        slot_rows = dev.empty(4 * grid[0])
        dev.launch(name, grid, block, ATTENTION_GROUP_FMT,
                   [*common, 1, *dims, group_part, slot_rows, deep_from])
        name, grid, block = attention_group_merge_launch(R, Q, D)
        dev.launch(name, grid, block, ATTENTION_GROUP_MERGE_FMT,
                   [*common[:-1], Q, D, GQA_SPLITS, group_part, slot_rows])
    if singles:
        dev.launch(attention_kernels(D)[1], (min(R, ATT_SINGLE_BLOCKS), Q, ATT_SPLITS), (128,),
                   ATTENTION_SINGLES_FMT,
                   [*common, *dims, part, counts, INT_MAX if deep_from is None else deep_from])
    assert not dev.get(counts, (R * Q,), np.int32).any()  # every split merged, counters reset
    return (dev.get(out, (R, Q, D), np.float32), dev.get(outq, (R, Q * D), np.int8),
            dev.get(outd, (R, Q * D // 32), np.float32))


# (query heads, KV heads, head dim): tiny's shape, GQA 4, Qwen3-30B-A3B's (8 heads a group),
# and 16 heads a group (two blocks along z)
SHAPES = [(4, 2, 16), (8, 2, 64), (32, 4, 128), (16, 1, 32)]


# deep_from: every single attention.cu's, the decode row at 300 attention_group.cu's
@pytest.mark.parametrize("deep_from", (None, 64))
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", SHAPES)
def test_prompt_attention_against_float64(runtime, num_heads, num_kv_heads, head_dim,
                                          deep_from):
    """A window of a 37-row chunk (fp16, after 90 cached cells), a decode row, a 20-row chunk
    over int8 cells from position 0, a decode row and two draft rows crossing a KV tile: every
    row near float64; decode rows equal a decode window's bits; the fused 8-bit form exact."""
    dev, rng = _Dev(runtime), np.random.default_rng()
    Q, KVH, D, L, C, layer = num_heads, num_kv_heads, head_dim, 2, 320, 1
    # (first position, rows, int8 cells) per slot, in window order
    slots = [(90, 37, False), (300, 1, False), (0, 20, True), (5, 1, False), (63, 2, False)]
    bases, positions, cells, rows_of, is_int8_row = [], [], [], [], []
    for first, n, is_int8 in slots:
        raw, dense = _slot_cache(rng, L, KVH, C, D, is_int8)
        base = dev.put(raw) | int(is_int8)
        rows_of.append(list(range(len(positions), len(positions) + n)))
        for i in range(n):
            bases.append(base)
            positions.append(first + i)
            cells.append(dense)
            is_int8_row.append(is_int8)
    positions = np.array(positions, dtype=np.int32)
    R = len(positions)
    q = rng.standard_normal((R, Q, D)).astype(np.float32)
    want_q8 = D % 32 == 0
    got, outq, outd = run_prompt_attention(dev, q, bases, positions, C, layer, L, KVH, want_q8,
                                           deep_from)
    errors = {False: [0.0], True: [0.0]}
    for r in range(R):
        for h in range(Q):
            kvh = h // (Q // KVH)
            keys = cells[r][layer, 0, kvh, :positions[r] + 1]
            values = cells[r][layer, 1, kvh, :positions[r] + 1]
            want = attention_reference(q[r, h], keys, values)
            errors[is_int8_row[r]].append(np.abs(got[r, h] - want).max() / np.abs(values).max())
    print(f"prompt attention Q={Q} KVH={KVH} D={D}: max error / max |V|: fp16 cells "
          f"{max(errors[False]):.1e}, int8 cells {max(errors[True]):.1e}")
    for is_int8, tolerance in PROMPT_ATT_TOLERANCE.items():
        assert max(errors[is_int8]) < tolerance
    singles = rows_of[1] + rows_of[3]
    alone, _, _ = run_attention(dev, q[singles], [bases[r] for r in singles], positions[singles],
                                C, layer, L, KVH, want_q8=False, deep_from=deep_from)
    np.testing.assert_array_equal(got[singles], alone)
    if want_q8:
        q8, d8 = _q8(got.reshape(R, Q * D))
        np.testing.assert_array_equal(outq, q8)
        np.testing.assert_array_equal(outd, d8)


def test_prompt_attention_rows_independent_of_window(runtime):
    """A chunk's rows give the same bits alone, cut short, and shifted inside a window (other
    tile positions, other neighbours in their 16-row tile)."""
    dev, rng = _Dev(runtime), np.random.default_rng()
    Q, KVH, D, L, C, layer = 32, 4, 128, 1, 256, 0
    raw_a, _ = _slot_cache(rng, L, KVH, C, D, False)
    raw_b, _ = _slot_cache(rng, L, KVH, C, D, True)
    base_a, base_b = dev.put(raw_a), dev.put(raw_b) | 1
    n, first = 45, 100
    pos_a = np.arange(first, first + n, dtype=np.int32)
    q_a = rng.standard_normal((n, Q, D)).astype(np.float32)

    def run(bases, positions, q):
        return run_prompt_attention(dev, q, bases, np.asarray(positions, dtype=np.int32), C,
                                    layer, L, KVH, want_q8=True)[0]

    alone = run([base_a] * n, pos_a, q_a)
    short = run([base_a] * 20, pos_a[:20], q_a[:20])
    np.testing.assert_array_equal(short, alone[:20])
    # 5 rows of another (int8) chunk first, a decode row of a third KV after
    q_b = rng.standard_normal((5, Q, D)).astype(np.float32)
    q_c = rng.standard_normal((1, Q, D)).astype(np.float32)
    mixed = run([base_b] * 5 + [base_a] * n + [dev.put(raw_a)],
                [7, 8, 9, 10, 11] + list(pos_a) + [30], np.concatenate([q_b, q_a, q_c]))
    np.testing.assert_array_equal(mixed[5:5 + n], alone)


def test_prompt_kernels_write_their_cell_types_rows(runtime):
    """attention_prompt writes the rows of fp16 KVs' chunks only and attention_prompt_i8 those
    of int8 KVs' (whichever 16-row tiles they share); the other rows keep what was there, and
    each row's bits are the same whether the other kernel ran or not."""
    dev, rng = _Dev(runtime), np.random.default_rng()
    Q, KVH, D, L, C, layer = 32, 4, 128, 1, 256, 0
    # an fp16 chunk of 21 rows, an int8 chunk of 19 (sharing the second 16-row tile), a
    # decode row over int8 cells, another fp16 chunk of 7
    chunks = [(False, 30, 21), (True, 0, 19), (True, 99, 1), (False, 140, 7)]
    bases, positions, is_int8 = [], [], []
    for int8, first, n in chunks:
        raw, _ = _slot_cache(rng, L, KVH, C, D, int8)
        base = dev.put(raw) | int(int8)
        bases += [base] * n
        positions += range(first, first + n)
        is_int8 += [int8] * n
    positions, is_int8 = np.array(positions, dtype=np.int32), np.array(is_int8)
    q = rng.standard_normal((len(bases), Q, D)).astype(np.float32)

    def run(kernels):
        return run_prompt_attention(dev, q, bases, positions, C, layer, L, KVH, want_q8=True,
                                    kernels=kernels, singles=False)

    both = run(["attention_prompt", "attention_prompt_i8"])
    fp16, int8 = run(["attention_prompt"]), run(["attention_prompt_i8"])
    poison = np.full(Q * D, 0x7F7F7F7F, dtype=np.uint32).view(np.float32)
    single = np.zeros(len(bases), dtype=bool)
    single[21 + 19] = True
    for alone, mine in ((fp16, ~is_int8), (int8, is_int8 & ~single)):
        written = ~(alone[0].reshape(len(bases), -1) == poison).all(axis=1)
        np.testing.assert_array_equal(written, mine)
        for got, want in zip(alone, both):
            np.testing.assert_array_equal(got[mine], want[mine])
    assert (both[0][single].view(np.uint32) == 0x7F7F7F7F).all()  # the singles kernel's


def test_plan_takes_prompt_kernels_from_the_threshold(synth_path):
    """Windows of >= MMQ_MIN_ROWS rows launch attention_prompt + attention_singles_d* and
    group_pairs_wide in every layer; smaller ones keep attention_d* (and the one-launch
    router); plans of windows with a row deep in its context add attention_group.cu's kernel
    and its merge launch before the decode / singles one."""
    from strata.backends.cuda import CudaModel
    from strata.backends.cuda import plan as cuda_plan
    from strata.model.gguf_file import GGUFModel

    gpu = CudaModel(GGUFModel.open(synth_path("tiny", "q4_0")))
    with gpu.runtime.active():
        small, large, deep_small, deep_large = (
            list(gpu._plan(rows, 1, deep).launches.names())
            for deep in (False, True) for rows in (cuda_plan.MMQ_MIN_ROWS - 1,
                                                   cuda_plan.MMQ_MIN_ROWS))
    spec = gpu.spec
    L = spec.n_layers
    decode, singles = cuda_plan.attention_kernels(spec.head_dim)
    group = cuda_plan.attention_group_kernel(spec.head_dim, spec.n_heads // spec.n_kv_heads)[0]
    assert small.count(decode) == L
    assert not {"attention_prompt", singles, "group_pairs_wide", group} & set(small)
    assert large.count("attention_prompt") == large.count(singles) == L
    assert large.count("group_pairs_wide") == L
    assert not {decode, "group_pairs", group} & set(large)
    merge = "attention_group_merge"
    for plain, deep, last in ((small, deep_small, decode), (large, deep_large, singles)):
        assert [n for n in deep if n not in (group, merge)] == plain
        assert deep.count(group) == deep.count(merge) == L
        assert all(deep[i + 1: i + 3] == [merge, last] for i, n in enumerate(deep) if n == group)
    # every row deep: a decode window's plan swaps attention_d* for the group kernel; a prompt
    # window's keeps attention_prompt and singles (its rows beside their slot's need them)
    with gpu.runtime.active():
        all_small, all_large = (list(gpu._plan(rows, 1, cuda_plan.DEEP_ALL).launches.names())
                                for rows in (cuda_plan.MMQ_MIN_ROWS - 1, cuda_plan.MMQ_MIN_ROWS))
    assert all_small == [m for n in small for m in ([group, merge] if n == decode else [n])]
    assert all_large == deep_large
    # the KVs' cell types: int8 KVs' prompt windows swap in attention_prompt_i8, mixed ones
    # launch both kernels; decode windows' plans are the same whatever their KVs' cells
    with gpu.runtime.active():
        int8, mixed = (list(gpu._plan(cuda_plan.MMQ_MIN_ROWS, 1, cuda_plan.DEEP_NONE,
                                      cells).launches.names())
                       for cells in (cuda_plan.CELLS_INT8,
                                     cuda_plan.CELLS_INT8 | cuda_plan.CELLS_FP16))
        assert gpu._plan(4, 1, cuda_plan.DEEP_NONE, cuda_plan.CELLS_INT8) is gpu._plan(4, 1)
    i8 = "attention_prompt_i8"
    assert int8 == [i8 if n == "attention_prompt" else n for n in large]
    assert mixed == [m for n in large
                     for m in (["attention_prompt", i8] if n == "attention_prompt" else [n])]


@pytest.mark.parametrize("num_experts, experts_per_row, num_rows",
                         [(128, 8, 512), (60, 4, 37), (8, 2, 23), (128, 8, 1), (128, 8, 5000)])
def test_group_pairs_wide(runtime, num_experts, experts_per_row, num_rows):
    """Exact grouping (experts ascending, pairs in order within one) over skewed routing, one or
    many pairs per warp; the same as group_pairs."""
    dev, rng = _Dev(runtime), np.random.default_rng()
    E, K, R = num_experts, experts_per_row, num_rows
    P = R * K
    skew = 0.93 ** np.arange(E)  # a few experts take most pairs, as trained routers do
    ids = np.stack([rng.choice(E, K, replace=False, p=skew / skew.sum())
                    for _ in range(R)]).astype(np.int32)  # [R, K]
    want_groups, want_act, want_out = grouped_reference(ids, E)
    for name, block, shared in (("group_pairs_wide", GROUP_WIDE_THREADS,
                                 4 * (GROUP_WIDE_THREADS // 32 + 1) * E),
                                ("group_pairs", 256, 4 * (2 * E + 1024))):
        groups, num_groups = dev.empty(12 * E), dev.empty(4)
        act_rows, out_rows = dev.empty(4 * P), dev.empty(4 * P)
        dev.launch(name, (1,), (block,), "PiiiPPPP",
                   [dev.put(ids), P, K, E, groups, num_groups, act_rows, out_rows],
                   shared_bytes=shared)
        assert dev.get(num_groups, (1,), np.int32)[0] == len(want_groups)
        np.testing.assert_array_equal(dev.get(groups, (len(want_groups), 3), np.int32),
                                      want_groups)
        np.testing.assert_array_equal(dev.get(act_rows, (P,), np.int32), want_act)
        np.testing.assert_array_equal(dev.get(out_rows, (P,), np.int32), want_out)
