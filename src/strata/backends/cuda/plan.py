"""A window plan: every kernel launch of one forward pass over R rows (N of them with logits),
prepared once with fixed device addresses. Per-window data (tokens, positions, KV bases, logit
rows) lives in a device descriptor uploaded before each run, so a plan replays unchanged, as a
launch list or as a captured CUDA graph.
"""
from __future__ import annotations

import os

import numpy as np

from strata._native import cuda_driver
from strata.backends.cuda.runtime import align
from strata.model.arch import ModelSpec

# Legend: R = rows of the workspace (max rows of a window), P = R * K (row, expert) pairs,
# H = hidden, Q/KVH = heads, D = head dim, E = experts, K = experts per row, F = expert width,
# S = shared-expert width, V = vocabulary, G = groups (distinct experts) at most min(E, P).

MM_FMT = "PPPPqiiPPPPPPPPPiPP"  # products.cuh MM_ARGS
MM_ROWS = 16  # outputs per block of the product kernels (MM_WARPS * NR in matmul.cu)
# the kernels' constants: ATT_SPLITS in attention.cu, GQA_WARPS and GQA_PART_ROWS in
# attention_group.cu, ROUTER_WARPS, ROUTER_RT and GROUP_CHUNK in router.cu. GQA_SPLITS is
# attention_group.cu's grid z (its kernels read the split count from there): one value for every
# launch, since it sets the order of a row's sums (64 was slower: docs/cuda.md, session 40).
ATT_SPLITS, ROUTER_WARPS, ROUTER_RT, GROUP_CHUNK = 4, 4, 8, 1024
GQA_WARPS, GQA_SPLITS, GQA_PART_ROWS = 8, 32, 32
# Decode rows at a position of at least ATT_DEEP_FROM cells take attention_group.cu's kernel (a
# block per GQA group and split: each K/V cell read once per group; tensor cores), the others
# attention.cu's (a block per query head: each cell read once per head, but a short context
# costs one memory round trip). A row's path depends on its own position only, so its bits never
# depend on its window; a window with no row that deep runs a plan without the group launches.
# H200, Qwen3-30B-A3B's heads (32 over 4 KV heads of 128), microseconds a layer per kernel alone
# at positions 0 / 1K / 2K / 4K / 16K / 64K, one row: attention_d4 4.6 / 10.1 / 16.9 / 30.2 /
# 109.7 / 449.2, attention_group_mma_d128 6.8 / 14.1 / 15.6 / 20.6 / 28.1 / 66.1; 4 rows:
# 4.7 / 24.2 / 42.6 / 78.7 / 299.2 / 1,177.2 against 7.1 / 15.2 / 18.0 / 20.8 / 50.0 / 115.5
# (docs/cuda.md, "Deep in a context"). STRATA_ATT_DEEP_FROM=N moves the threshold (0: every row
# the group kernel's; "off": none).
ATT_DEEP_FROM = 2048
# How deep a window's rows sit (model.py's deep_level, the plan's key): none at ATT_DEEP_FROM,
# some, or every row of a decode window (whose plan then launches no attention_d*, whose blocks
# would all return at once: 485 launches a Qwen3-30B-A3B token instead of 533, 0.4% of it).
DEEP_NONE, DEEP_SOME, DEEP_ALL = 0, 1, 2
ATT_GROUP_FORM = "mma"
INT_MAX = 2 ** 31 - 1
# Prompt-sized windows (>= MMQ_MIN_ROWS rows): attention_prompt.cu's tensor-core attention for
# rows whose slot has other rows beside them (PA_ROWS rows x up to PA_WARPS heads per block), the
# other rows by attention.cu's attention_singles (ATT_SINGLE_BLOCKS blocks walk the rows);
# group_pairs_wide (GROUP_WIDE_THREADS threads) groups the pairs. Head dims the kernel takes:
PA_ROWS, PA_WARPS, ATT_SINGLE_BLOCKS, GROUP_WIDE_THREADS = 16, 8, 16, 1024
PA_HEAD_DIMS = (16, 32, 64, 128)  # STRATA_PROMPT_ATTN=old: attention_d* for every window
PA_CELLS = 64  # cells of attention_prompt.cu's K/V tiles
# The KV cell types among a window's KVs (a plan's key beside its depth): attention_prompt.cu has
# a kernel per type (attention_prompt for fp16 cells, attention_prompt_i8 for int8), each
# writing its type's rows; a prompt window's plan launches the ones its KVs need.
CELLS_FP16, CELLS_INT8 = 1, 2
PROMPT_KERNELS = ((CELLS_FP16, "attention_prompt"), (CELLS_INT8, "attention_prompt_i8"))
GROUP_WIDE_MAX_SHARED_BYTES = 48 * 1024
NORM_MAX_HIDDEN = 8192  # combine_norm / one-pass RMSNorm: hidden % 4 == 0 and at most this
# Windows of at least MMQ_MIN_ROWS rows (or logit rows, for the head) take mmq.cu's tiled
# products: int8 tensor cores for these weight types, a shared-memory tiled float kernel for
# dense float ones; smaller (decode) windows keep matmul.cu's dp4a warps. A row's result depends
# only on which family ran it, never on its window's other rows. Crossover measured on the H200
# (qwen3-30b-a3b Q4_0, tools/bench_mmq.py): dp4a 6% faster at 16 rows, mmq 17% faster at 24.
MMQ_MIN_ROWS = 20
# Types of 32-column blocks take mmq.cu's tiles; Q4_1 / Q5_1 add a min term from the activation
# blocks' sums (as mmq_k.cu's Q4_K). Q4_1, Q5_0, Q5_1 and IQ4_NL are what llama.cpp's k-quant
# files hold in rows whose length is not a multiple of 256 (Q5_0 / Q5_1 / IQ4_NL for Q4_K /
# Q5_K / Q2_K-Q3_K-IQ4_XS), and Q4_1 / Q5_1 whole-file presets; K need only be a multiple of 32.
MMQ_TYPES = ("q4_0", "q8_0", "q4_1", "q5_0", "q5_1", "iq4_nl")
# k-quants take mmq_k.cu's tiles (32 activation rows only: its staging fills the shared memory);
# STRATA_MMQ_K=0 keeps them on the dp4a kernels (to measure one against the other in one build).
# The grid i-quants (super-blocks of 256, common.cuh's iq_group) take them too.
MMQ_K_TYPES = ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_xs", "iq2_xxs", "iq2_xs", "iq2_s",
               "iq3_xxs", "iq3_s", "iq1_s", "iq1_m")
# mmq.cu's block tiles: 64 weight rows (outputs; gate/up: 32 of each) x 64 or 32 activation rows
MMQ_OUTPUTS = 64
# Dense products take 64-row tiles when that still makes this many blocks (the H200 has 132
# multiprocessors), else 32-row ones; grouped experts always take 32. At 512 rows: q/k/v (640
# blocks) 4.1 ms with 64-row tiles vs 6.5 with 32, the output projection (256) 5.6 vs 5.2.
MMQ_MIN_BLOCKS_64 = 512
# Q4_0 weights whose rows hold a multiple of MMQ_RAW_COLS columns take mmq.cu's RAW kernels
# (mmq64r_* / mmq32r_*): each row's k-tile read by 16-byte loads into shared memory, then
# unpacked there (the 2-byte reads of 18-byte blocks kept the L1 93% busy, Nsight Compute).
# STRATA_MMQ_STAGE=words keeps the word-by-word staging (to measure one against the other).
MMQ_RAW_COLS = 256
MMF_OUTS, MMF_ROWS, MMF_THREADS = 32, 16, 128  # outputs x rows per block of mmq.cu's float kernel
# Decode windows' products on every quantised type: matvec.cu's mv_* kernels (weight rows staged by
# cp.async, MV_WARPS warps per block, mv_outputs_per_warp(K) outputs per warp), the routed down
# too, over hbuf quantised by quantize_q8 (see _build). One family for every decode window,
# resident or offloaded, so a row's bits never depend on its window or on where its experts
# live. STRATA_DECODE_MM=dp4a keeps mm_* everywhere, STRATA_DECODE_DOWN=mm for the routed down
# only (to measure one against the other in one build).
MV_WARPS = 4
# Programmatic dependent launch (runtime.py; cc >= 9.0, on unless STRATA_PDL=0) for windows of
# at most this many rows: there the q/k/v and output products and the router stage their
# weights before the wait. H200, synth qwen3-30b-a3b Q4_0, graph replay per window
# (decode_breakdown.py, one process each, alternating): 1 row 2.791 / 2.792 ms with it against
# 2.854 without and 2.874 before the early weights; 2 rows 3.538 / 3.540 / 3.540 against 3.553 /
# 3.557 / 3.558 (0.5%: too little to take untested); 3 rows 4.354 / 4.352 / 4.347 against
# 4.312 / 4.313 / 4.309 and 4 rows 5.185 / 5.186 against 5.026 / 5.028 (slower). bench_cuda.py
# against the tree before (no PDL): tg128 359.0 / 362.9 vs 346.2 / 345.3, 1 slot 341.5 / 342.8
# vs 336.7 / 336.5. Earlier, without the early weights, PDL on windows of <= 4 rows measured
# within the spread (291.3 / 611.1 vs 289.2 / 630.3 tokens/s, 1 / 4 slots).
PDL_MAX_ROWS = 1


def pdl_max_rows() -> int:
    """PDL_MAX_ROWS, or STRATA_PDL_ROWS (read when a plan is built: to measure other window
    sizes with PDL in one build)."""
    raw = os.environ.get("STRATA_PDL_ROWS", "").strip()
    return int(raw) if raw.isdigit() else PDL_MAX_ROWS


MV_TYPES = MMQ_TYPES + MMQ_K_TYPES


def _dims_per_lane(head_dim: int) -> int:
    """The attention kernels' dims per lane: ceil(D / 32) rounded up to 1, 2, 4 or 8."""
    return next(n for n in (1, 2, 4, 8) if 32 * n >= head_dim)


def attention_kernels(head_dim: int) -> tuple[str, str]:
    """attention.cu's decode and singles kernels for this head dim (D <= 256)."""
    per_lane = _dims_per_lane(head_dim)
    return f"attention_d{per_lane}", f"attention_singles_d{per_lane}"


def attention_prompt_shared_bytes(head_dim: int) -> int:
    """attention_prompt's dynamic shared memory: 2 buffers of a K and a V tile [PA_CELLS, D + 8]
    halves (runtime.DYNAMIC_SHARED_MAX holds the most, at D = 128)."""
    return 2 * 2 * PA_CELLS * (head_dim + 8) * 2


def prompt_kernels(cells: int) -> list[str]:
    """attention_prompt.cu's kernels for a window whose KVs hold the cell types `cells`
    (CELLS_FP16 | CELLS_INT8 bits)."""
    if not cells or cells & ~(CELLS_FP16 | CELLS_INT8):
        raise ValueError(f"cells {cells!r} is not a mask of CELLS_FP16 and CELLS_INT8")
    return [name for bit, name in PROMPT_KERNELS if cells & bit]


def attention_group_kernel(head_dim: int, group: int, env=None) -> tuple[str, int]:
    """attention_group.cu's kernel for this head dim and GQA group (query heads per KV head),
    and the heads per block it takes: a tensor-core form (8 heads a block) for D = 32, 64 or
    128, else the SIMT form with the group's size rounded up to 1, 2, 4 or 8, at most 8 (4 at 8
    dims per lane: registers). STRATA_ATT_GROUP=simt takes the SIMT form for every D (to
    measure one against the other in one build)."""
    form = (os.environ if env is None else env).get("STRATA_ATT_GROUP", ATT_GROUP_FORM)
    if head_dim in (32, 64, 128) and form == "mma":
        return f"attention_group_mma_d{head_dim}", 8
    per_lane = _dims_per_lane(head_dim)
    most = 4 if per_lane == 8 else 8
    heads = next(n for n in (1, 2, 4, 8) if n >= min(group, most))
    return f"attention_group_d{per_lane}_g{heads}", heads


def attention_group_launch(num_rows: int, n_heads: int, n_kv_heads: int, head_dim: int,
                           ) -> tuple[str, tuple[int, int, int], tuple[int]]:
    """(kernel, grid, block) of attention_group.cu over a window of `num_rows` rows: grid
    (min(R, GQA_PART_ROWS), KVH x the blocks of each GQA group, GQA_SPLITS)."""
    group = n_heads // n_kv_heads
    name, heads = attention_group_kernel(head_dim, group)
    grid = (min(num_rows, GQA_PART_ROWS), n_kv_heads * -(-group // heads), GQA_SPLITS)
    return name, grid, (32 * GQA_WARPS,)


def attention_group_part_floats(num_rows: int, n_heads: int, head_dim: int,
                                splits: int = GQA_SPLITS) -> int:
    """Floats of attention_group.cu's split partials for a window of `num_rows` rows:
    [slots, Q, splits, 4 + D] (m, l, two unused, acc[D]), slots = PR = min(R, GQA_PART_ROWS)
    for the rows the merge launch folds, and PR more past GQA_PART_ROWS rows (a block's
    rows without a slot, folded by that block)."""
    slots = min(num_rows, GQA_PART_ROWS)
    if num_rows > GQA_PART_ROWS:
        slots *= 2
    return slots * n_heads * splits * (4 + head_dim)


def attention_group_merge_launch(num_rows: int, n_heads: int, head_dim: int,
                                 ) -> tuple[str, tuple[int, int], tuple[int]]:
    """(kernel, grid, block) of attention_group_merge, the launch after attention_group.cu's
    group kernel that folds its split partials: a block per (slot, query head), a thread per
    dim (whole warps)."""
    return ("attention_group_merge", (min(num_rows, GQA_PART_ROWS), n_heads),
            (32 * -(-head_dim // 32),))


def attention_deep_from(spec: ModelSpec, env=None) -> int | None:
    """The position from which a decode row takes attention_group.cu (ATT_DEEP_FROM, or
    STRATA_ATT_DEEP_FROM), or None when no row does: "off", or heads the group kernel does
    not take (query heads not a multiple of the KV heads)."""
    raw = (os.environ if env is None else env).get("STRATA_ATT_DEEP_FROM", "").strip()
    if raw == "off" or spec.n_heads % spec.n_kv_heads:
        return None
    return int(raw) if raw.isdigit() else ATT_DEEP_FROM


ATTENTION_FMT = "PPPPPPPiiiiifPPi"  # attention.cu's attention_d*: ATTENTION_ARGS, layer, ...
ATTENTION_SINGLES_FMT = "PPPPPPPiiiiiifPPi"  # attention_singles_d*: ATTENTION_ARGS, R, layer, ..
ATTENTION_GROUP_FMT = "PPPPPPPiiiiiiifPPi"  # attention_group_*: ATTENTION_ARGS, R, singles, ...
ATTENTION_GROUP_MERGE_FMT = "PPPPPPPiiiPP"  # attention_group_merge: ATTENTION_ARGS, Q, ...
ATTENTION_PROMPT_FMT = "PPPPPPPiiiiiif"  # attention_prompt(_i8): ATTENTION_ARGS, R, layer, ...


def mv_outputs_per_warp(num_cols: int) -> int:
    """Outputs per warp of matvec.cu's mv_* kernels (its mv_lanes_per_output, mirrored)."""
    num_blocks = num_cols // 32
    return 32 // (32 if num_blocks >= 32 else 16 if num_blocks >= 12 else 8)


def _mv_blocks(w) -> int | None:
    """Blocks along x of an mv_* launch over matrix w, or None when mm_* should run it."""
    if w.suffix not in MV_TYPES or os.environ.get("STRATA_DECODE_MM", "mv") == "dp4a":
        return None
    outputs = MV_WARPS * mv_outputs_per_warp(w.cols)
    return (w.rows + outputs - 1) // outputs


def keeps_misses(model, num_rows: int) -> bool:
    """Do windows of num_rows rows keep the experts they read over PCIe (free admission,
    offload.cu's keep_misses)? Decode-sized windows once the tier turned it on (it checked
    experts_can_keep). Called before every window: no more than two comparisons."""
    tier = model.tier
    return tier is not None and tier.admission_on and num_rows < MMQ_MIN_ROWS


def experts_can_keep(model) -> bool:
    """Does every routed product of a decode window run an mv_* kernel (every quantised type;
    they write what they stage), so that such windows can keep their misses?"""
    return all(experts_can_keep_layer(ly) for ly in model.layers)


def experts_can_keep_layer(ly) -> bool:
    """experts_can_keep for one layer."""
    if os.environ.get("STRATA_DECODE_DOWN", "mv") == "mm":
        return False
    return ly.gate_exps.suffix == ly.up_exps.suffix and all(
        _mv_blocks(w) is not None for w in (ly.gate_exps, ly.down_exps))


def _mmq_type(w) -> bool:
    """Does mmq.cu or mmq_k.cu have tensor-core tiles for w's type?"""
    return w.suffix in MMQ_TYPES or (w.suffix in MMQ_K_TYPES
                                     and os.environ.get("STRATA_MMQ_K", "1") != "0")


def _dense_tile_rows(w, num_out_tiles: int, num_rows: int) -> int:
    if w.suffix in MMQ_K_TYPES:
        return 32
    return 64 if num_out_tiles * ((num_rows + 63) // 64) >= MMQ_MIN_BLOCKS_64 else 32


# 32-column quant blocks: the decode products' staged unit for these; 256 for the others
_BLOCK32_SUFFIXES = frozenset({"q4_0", "q8_0", "q4_1", "q5_0", "q5_1", "iq4_nl"})


def expert_split_step(model, ly) -> int:
    """Columns of layer ly's down per staged unit (its quant block: 32, or 256 for k-quants and
    the grid i-quants) when a decode window may split one of its experts between the GPU and
    the CPU pool by columns (offload.cu's count_groups; matvec.cu computes the GPU's side), 0
    when it may not: a routed product off the mv_* kernels, float experts, or an expert width
    of one unit."""
    if ly.down_exps.is_float or not experts_can_keep_layer(ly):
        return 0
    step = 32 if ly.down_exps.suffix in _BLOCK32_SUFFIXES else 256
    F = model.spec.expert_ffn
    return step if F % step == 0 and F // step >= 2 else 0


def _mmq_kernel(mode: str, w, w2, grouped: bool, num_rows: int, num_pairs: int = 0,
                max_groups: int = 1):
    """(kernel name, grid, block) of mmq.cu for this product over a window of num_rows rows
    (grouped: num_pairs (row, expert) pairs in at most max_groups groups), or None when
    matmul.cu's kernels should run it."""
    if num_rows < MMQ_MIN_ROWS:
        return None
    if _mmq_type(w) and (w2 is None or w2.suffix == w.suffix):
        outputs = MMQ_OUTPUTS // 2 if mode == "gateup" else MMQ_OUTPUTS
        num_out_tiles = (w.rows + outputs - 1) // outputs
        if grouped:  # tile slots: the most tiles of 32 rows the groups can need
            tile_rows, slots = 32, (num_pairs + 31) // 32 + max_groups
        else:
            tile_rows = _dense_tile_rows(w, num_out_tiles, num_rows)
            slots = (num_rows + tile_rows - 1) // tile_rows
        raw = (w.suffix == "q4_0" and w.cols % MMQ_RAW_COLS == 0
               and os.environ.get("STRATA_MMQ_STAGE", "raw") != "words")
        name = f"mmq{tile_rows}{'r' if raw else ''}_{mode}_{w.suffix}"
        return name, (num_out_tiles, slots), (128,)
    if w.is_float and not grouped and mode != "gateup":
        return (f"mmf_{mode}_{w.suffix}",
                ((w.rows + MMF_OUTS - 1) // MMF_OUTS, 1, (num_rows + MMF_ROWS - 1) // MMF_ROWS),
                (MMF_THREADS,))
    return None


class Workspace:
    """Device buffers for windows of up to `max_rows` rows of which up to `max_logit_rows`
    (default: all) want logits, carved from one allocation, and the pinned host descriptor
    mirrored into the device descriptor. Logits are [N, V]: a 4096-row prompt window with one
    logit row needs 0.6 MB of them, not 2.5 GB (Qwen3's vocabulary)."""

    def __init__(self, runtime, spec: ModelSpec, max_rows: int,
                 max_logit_rows: int | None = None):
        R, H, K = max_rows, spec.hidden, spec.n_experts_used
        P, F, S, V = R * K, spec.expert_ffn, max(spec.shared_ffn, 1), spec.vocab
        N = R if max_logit_rows is None else max(1, min(int(max_logit_rows), R))
        hybrid = bool(spec.recurrent_layers)
        C, VI = (spec.ssm_channels, spec.ssm_inner) if hybrid else (0, 0)
        wide = max(H, spec.q_dim, VI)
        gated_q = spec.q_dim if spec.has_attn_gate else 0
        self.max_rows, self.max_logit_rows, self.hybrid = R, N, hybrid
        f4, i4, i1 = 4, 4, 1
        sizes = {
            # descriptor: kv_base u64 [R], then tokens, pos, cap, logit_rows int32 [R] each;
            # a hybrid model's then: state u64 [R, 4] (conv in/out, ssm in/out of the row's
            # sequence), run0 and run_len int32 [R] (its run's first row and length)
            "desc": 8 * R + 4 * 4 * R + (40 * R if hybrid else 0),
            "x": f4 * R * H,                  # [R, H] the residual stream
            "hf": f4 * R * wide,              # [R, max(H, Q*D)] normed rows / attention output
            "hq": i1 * R * wide,              # its 8-bit form
            "hd": f4 * R * wide // 32,        # and scales per 32 columns
            "qb": f4 * R * (spec.q_dim + gated_q),  # [R, Q*D] ([R, Q, 2D]: query + gate heads)
            "qq": f4 * R * gated_q,           # [R, Q*D] the queries of a gated attention
            "gate": f4 * R * gated_q,         # [R, Q*D] and its gate
            # a gated delta-net layer's: q | k | v [R, C] before and after the conv, z [R, VI],
            # beta logits | alpha [R, 2*Hv], the delta rule's output [R, VI]
            "rq": f4 * R * C, "ry": f4 * R * C, "rz": f4 * R * VI,
            "rba": f4 * R * 2 * spec.ssm_heads, "rcore": f4 * R * VI,
            "kb": f4 * R * spec.kv_dim,       # [R, KVH*D]
            "vb": f4 * R * spec.kv_dim,       # [R, KVH*D]
            "router": f4 * R * spec.n_experts,  # [R, E]
            "ids": i4 * P, "wts": f4 * P,     # [R, K] each
            # num_groups [3]: G, then the expert a decode layer splits with the CPU pool (-1
            # none) and the pool's columns of it (offload.cu's count_groups; matvec.cu reads it)
            "groups": i4 * 3 * min(spec.n_experts, P), "num_groups": i4 * 3,
            "act_rows": i4 * P, "out_rows": i4 * P,
            "hbuf": f4 * P * F, "hbq": i1 * P * F, "hbd": f4 * P * F // 32,  # [P, F]
            "ybuf": f4 * P * H,               # [P, H] each pair's down product
            "sg": f4 * R * S, "sgq": i1 * R * S, "sgd": f4 * R * S // 32 + 4,  # [R, S]
            "so": f4 * R * H, "sl": f4 * R,   # shared expert output [R, H], gate logit [R]
            "logits": f4 * N * V,             # [N <= max_logit_rows, V]
            "argmax": i4 * R,
            # attention partials per split [R, Q, ATT_SPLITS, 2 + D] (m, l, acc[D])
            "att_part": f4 * R * spec.n_heads * ATT_SPLITS * (2 + spec.head_dim),
            # last-block counters, zero between launches: attention [R*Q], router [1 + tiles]
            "att_counts": i4 * R * spec.n_heads,
            # attention_group.cu's partials [slots, Q, GQA_SPLITS, 4 + D] and each slot's row
            # [min(R, GQA_PART_ROWS)] (-1: none), which its merge launch reads
            "att_group_part": f4 * attention_group_part_floats(R, spec.n_heads, spec.head_dim),
            "att_group_rows": i4 * min(R, GQA_PART_ROWS),
            "router_counts": i4 * (2 + (R + ROUTER_RT - 1) // ROUTER_RT),
        }
        self.offsets: dict[str, int] = {}
        total = 0
        for name, num_bytes in sizes.items():
            self.offsets[name] = total
            total += align(num_bytes)
        self.nbytes = total
        self._buf = runtime.alloc(total)
        self.base = int(self._buf)
        # the kernels leave them zero again; no split expert until a tier launch sets one
        for name in ("att_counts", "router_counts", "num_groups"):
            runtime.drv.memset_d32(self.ptr(name), 0, sizes[name] // 4)
        self.host_desc = runtime.pinned(sizes["desc"], np.uint8)
        self.host_kv = self.host_desc[:8 * R].view(np.uint64)  # [R]
        ints = self.host_desc[8 * R:].view(np.int32)
        self.host_tokens, self.host_pos = ints[:R], ints[R:2 * R]
        self.host_cap, self.host_logit_rows = ints[2 * R:3 * R], ints[3 * R:4 * R]
        if hybrid:
            self.host_state = self.host_desc[24 * R:56 * R].view(np.uint64).reshape(R, 4)
            runs = self.host_desc[56 * R:64 * R].view(np.int32)
            self.host_run0, self.host_run_len = runs[:R], runs[R:]
        self.host_logits = runtime.pinned((N, V), np.float32)  # [N, V] read back
        self.host_argmax = runtime.pinned((R,), np.int32)

    def ptr(self, name: str) -> int:
        return self.base + self.offsets[name]

    def desc(self, field: str) -> int:
        R = self.max_rows
        at = {"kv": 0, "tokens": 8 * R, "pos": 12 * R, "cap": 16 * R, "logit_rows": 20 * R,
              "state": 24 * R, "run0": 56 * R, "run_len": 60 * R}
        return self.ptr("desc") + at[field]


def prompt_attention(num_rows: int, spec: ModelSpec) -> bool:
    """Does a window of `num_rows` rows run attention_prompt (beside attention_singles_d*)?"""
    return not (num_rows < MMQ_MIN_ROWS or spec.head_dim not in PA_HEAD_DIMS
                or spec.n_heads % spec.n_kv_heads
                or os.environ.get("STRATA_PROMPT_ATTN", "mma") == "old")


class WindowPlan:
    """The launches of one window shape (R rows, N logit rows) over a workspace. `deep_from`:
    None, or the position from which rows take attention_group.cu (a window with a row that
    deep; model.py decides per window); `deep_all`: every row is that deep and the window is
    a decode one (no attention_d* launch); `cells`: the KV cell types of the window's KVs
    (CELLS_FP16 | CELLS_INT8: which attention_prompt.cu kernels a prompt window launches)."""

    def __init__(self, model, ws: Workspace, num_rows: int, num_logit_rows: int,
                 deep_from: int | None = None, deep_all: bool = False,
                 cells: int = CELLS_FP16):
        self.num_rows, self.num_logit_rows = num_rows, num_logit_rows
        self.cells = cells
        self.deep_from = deep_from
        self.deep_all = deep_all and deep_from is not None
        self._model, self._ws, self._rt = model, ws, model.runtime
        # dense "groups": one group of all R rows, one of the N logit rows
        self._static = self._rt.upload(np.array([0, 0, num_rows, 0, 0, num_logit_rows, 1],
                                                dtype=np.int32))
        self.launches = cuda_driver.LaunchList()
        self.graph = None
        # per layer (first, stop): the launches that read its routed experts (gate/up .. down);
        # a prompt window streaming its experts (stream.py) puts its copy waits around them
        self.expert_spans: list[tuple[int, int]] = []
        # {name: {layer: (first, stop)}} of the tier's launches: "grouping" (all after the
        # layer's grouping), inside it "guess" (the guessed copies' wait), "pulls" (pull_rare),
        # "publish" (the rows to the pool), and "pool" (the combine with the pool, its wait):
        # a streamed window's timeline marks them (stream.py, STRATA_STREAM_TIMELINE)
        self.tier_spans: dict[str, dict[int, tuple[int, int]]] = {}
        # free admission: its expert products write the misses they read into offered slots
        self.keeps_misses = keeps_misses(model, num_rows)
        self._programmatic = num_rows <= pdl_max_rows()
        # read-ahead (DeviceTier.reads_ahead): per layer the side stream's fork and join events
        self.ahead_events: dict[int, tuple] = {}
        self._build()

    # ---- helpers --------------------------------------------------------------------------
    def mark_span(self, name: str, layer: int, first: int) -> None:
        """The launches from `first` to now are `layer`'s span `name` (tier_spans)."""
        if len(self.launches) > first:
            self.tier_spans.setdefault(name, {})[layer] = (first, len(self.launches))

    def _add(self, kernel: str, grid, block, fmt: str, args, shared_bytes: int = 0) -> None:
        k = self._rt.kernel(kernel)
        self.launches.append(k.prepare(grid, block, fmt, args, shared_bytes,
                                       programmatic=self._programmatic))

    def _quantize(self, src: str, dst_q: str, dst_d: str, num_values: int) -> None:
        num_blocks = num_values // 32
        self._add("quantize_q8", ((num_blocks + 7) // 8,), (256,), "PqPP",
                  [self._ws.ptr(src), num_blocks, self._ws.ptr(dst_q), self._ws.ptr(dst_d)])

    def _mm(self, mode: str, w, act: str, out: str, *, w2=None, bias=None,
            grouped: bool = False, out_rows: bool = False, act_rows: bool = False,
            logit_rows: bool = False, use_mv: bool = True,
            keep: tuple[int, int] = (0, 0)) -> None:
        """Y[out] (mode store/add/gateup) = W x over activation buffer family `act` (float
        `act`, 8-bit `act`q/`act`d, e.g. hf/hq/hd): over the window's R rows (the N logit rows
        with logit_rows), or per expert group with grouped. use_mv False keeps a decode
        window's product on the dp4a mm_* warps. keep: the free-admission tables of W and W2
        (device_tier.py; only an mv_* kernel reads them, and only they are asked to)."""
        ws = self._ws
        xf = ws.ptr(act)
        xq, xd = (ws.ptr({"hf": "hq", "hbuf": "hbq", "sg": "sgq"}[act]),
                  ws.ptr({"hf": "hd", "hbuf": "hbd", "sg": "sgd"}[act]))
        static = int(self._static)
        if grouped:
            groups, num_groups = ws.ptr("groups"), ws.ptr("num_groups")
            spec = self._model.spec
            max_groups = min(spec.n_experts, self.num_rows * spec.n_experts_used)
        else:
            groups = static + (12 if logit_rows else 0)
            num_groups, max_groups = static + 24, 1
        kernel, grid, block = f"mm_{mode}_{w.suffix}", ((w.rows + MM_ROWS - 1) // MM_ROWS,
                                                        max_groups), (128,)
        tiled = _mmq_kernel(mode, w, w2, grouped,
                            self.num_logit_rows if logit_rows else self.num_rows,
                            self.num_rows * self._model.spec.n_experts_used, max_groups)
        if tiled is not None:
            kernel, grid, block = tiled
        elif use_mv and _mv_blocks(w) is not None and (w2 is None or w2.suffix == w.suffix):
            kernel, grid = f"mv_{mode}_{w.suffix}", (_mv_blocks(w), max_groups)
        if keep != (0, 0) and not kernel.startswith("mv_"):
            raise RuntimeError(f"{kernel} cannot keep the experts it reads (only mv_* can)")
        self._add(kernel, grid, block, MM_FMT,
                  [w.ptr, w2.ptr if w2 is not None else 0, w.table_ptr if grouped else 0,
                   w2.table_ptr if grouped and w2 is not None else 0, w.row_bytes, w.rows,
                   w.cols, xf, xq, xd, groups, num_groups,
                   ws.ptr("act_rows") if act_rows else 0, ws.ptr("out_rows") if out_rows else 0,
                   bias.ptr if bias is not None else 0, ws.ptr(out), w.rows, *keep])

    def _qkv(self, ly) -> None:
        """The q, k, v projections: one launch when the three share a type, else three."""
        tiled = _mmq_kernel("store", ly.wq, None, False, self.num_rows)
        if not ly.wq.qtype == ly.wk.qtype == ly.wv.qtype or (tiled and ly.wq.is_float):
            self._mm("store", ly.wq, "hf", "qb", bias=ly.bq)
            self._mm("store", ly.wk, "hf", "kb", bias=ly.bk)
            self._mm("store", ly.wv, "hf", "vb", bias=ly.bv)
            return
        ws, static = self._ws, int(self._static)
        num_blocks = sum((w.rows + MM_ROWS - 1) // MM_ROWS for w in (ly.wq, ly.wk, ly.wv))
        kernel, grid = f"mm_qkv_{ly.wq.suffix}", (num_blocks, 1)
        if tiled is None and _mv_blocks(ly.wq) is not None:
            kernel = f"mv_qkv_{ly.wq.suffix}"
            grid = (sum(_mv_blocks(w) for w in (ly.wq, ly.wk, ly.wv)), 1)
        if tiled is not None:  # q, k and v output tiles along x, row tiles along y
            num_blocks = sum((w.rows + MMQ_OUTPUTS - 1) // MMQ_OUTPUTS
                             for w in (ly.wq, ly.wk, ly.wv))
            tile_rows = _dense_tile_rows(ly.wq, num_blocks, self.num_rows)
            kernel = f"mmq{tile_rows}_qkv_{ly.wq.suffix}"
            grid = (num_blocks, (self.num_rows + tile_rows - 1) // tile_rows)
        biases = [b.ptr if b is not None else 0 for b in (ly.bq, ly.bk, ly.bv)]
        self._add(kernel, grid, (128,), "PPPqiiiPPPPPPPPPPP",
                  [ly.wq.ptr, ly.wk.ptr, ly.wv.ptr, ly.wq.row_bytes, ly.wq.rows, ly.wk.rows,
                   ly.wq.cols, ws.ptr("hf"), ws.ptr("hq"), ws.ptr("hd"), static, static + 24,
                   *biases, ws.ptr("qb"), ws.ptr("kb"), ws.ptr("vb")])

    def _norm(self, weight_ptr: int, rows: int, quantize: bool, gather: bool = False) -> None:
        ws, H = self._ws, self._model.spec.hidden
        self._add("rmsnorm_q8", (rows,), (256,), "PPfiPPPP",
                  [ws.ptr("x"), weight_ptr, self._model.eps, H,
                   ws.desc("logit_rows") if gather else 0, ws.ptr("hf"),
                   ws.ptr("hq") if quantize else 0, ws.ptr("hd") if quantize else 0])

    def _attention(self, li: int, fuse_q: bool, q: str = "qb") -> None:
        """Attention of every row (queries in `q`) over its KV into hf [R, Q*D] (+ hq/hd when
        fuse_q): in prompt-sized windows attention_prompt (rows beside rows of their slot) and
        attention_singles_d* (the rest, as attention_d*), else attention_d* for all rows; in a
        plan with deep_from, rows at least that deep (of all, or of the rest) take
        attention_group.cu's kernel instead. `li`: the layer's index among the attention
        layers (its cells in the KV)."""
        ws, spec, R = self._ws, self._model.spec, self.num_rows
        Q, KVH, D = spec.n_heads, spec.n_kv_heads, spec.head_dim
        L = len(spec.attention_layers)
        outs = [ws.ptr(q), ws.ptr("hf"), ws.ptr("hq") if fuse_q else 0,
                ws.ptr("hd") if fuse_q else 0, ws.desc("kv"), ws.desc("pos"), ws.desc("cap")]
        split = [ws.ptr("att_part"), ws.ptr("att_counts")]
        dims = [li, L, Q, KVH, D, self._model.attn_scale]
        decode, singles = attention_kernels(D)
        deep_from = INT_MAX if self.deep_from is None else self.deep_from
        prompt = prompt_attention(R, self._model.spec)
        if prompt:
            group = Q // KVH
            warps = min(group, PA_WARPS)
            grid = ((R + PA_ROWS - 1) // PA_ROWS, KVH, (group + warps - 1) // warps)
            for name in prompt_kernels(self.cells):
                self._add(name, grid, (32 * warps,), ATTENTION_PROMPT_FMT, [*outs, R, *dims],
                          shared_bytes=attention_prompt_shared_bytes(D))
        if self.deep_from is not None:
            name, grid, block = attention_group_launch(R, Q, KVH, D)
            self._add(name, grid, block, ATTENTION_GROUP_FMT,
                      [*outs, R, int(prompt), *dims, ws.ptr("att_group_part"),
                       ws.ptr("att_group_rows"), deep_from])
            _, grid, block = attention_group_merge_launch(R, Q, D)
            self._add("attention_group_merge", grid, block, "PPPPPPPiiiPP",
                      [*outs, Q, D, GQA_SPLITS, ws.ptr("att_group_part"),
                       ws.ptr("att_group_rows")])
        if prompt:
            self._add(singles, (min(R, ATT_SINGLE_BLOCKS), Q, ATT_SPLITS), (128,),
                      ATTENTION_SINGLES_FMT, [*outs, R, *dims, *split, deep_from])
        elif not self.deep_all:
            self._add(decode, (R, Q, ATT_SPLITS), (128,), ATTENTION_FMT,
                      [*outs, *dims, *split, deep_from])

    def _router(self, ly) -> None:
        """Router logits, softmax + top-k and the pairs grouped by expert: one launch for a
        float router over a window that matmul.cu would run (a decode window), else the
        product followed by router_topk and group_pairs."""
        ws, spec, R = self._ws, self._model.spec, self.num_rows
        E, K, H = spec.n_experts, spec.n_experts_used, spec.hidden
        group_shared_bytes = 4 * (2 * E + GROUP_CHUNK)
        outs = [ws.ptr(n) for n in ("router", "ids", "wts", "groups", "num_groups", "act_rows",
                                    "out_rows")]
        w = ly.router
        if w.is_float and H % 4 == 0 and _mmq_kernel("store", w, None, False, R) is None:
            grid = ((E + ROUTER_WARPS - 1) // ROUTER_WARPS, (R + ROUTER_RT - 1) // ROUTER_RT)
            self._add(f"router_{w.suffix}", grid, (32 * ROUTER_WARPS,), "PqiiPiiiPPPPPPPP",
                      [w.ptr, w.row_bytes, E, H, ws.ptr("hf"), R, K, int(spec.norm_topk),
                       *outs, ws.ptr("router_counts")],
                      shared_bytes=4 * ROUTER_WARPS * E + group_shared_bytes)
            return
        self._mm("store", w, "hf", "router")  # [R, E] logits
        self._add("router_topk", (R,), (32,), "PiiiPP",
                  [outs[0], E, K, int(spec.norm_topk), outs[1], outs[2]], shared_bytes=4 * E)
        # the most threads whose per-warp counts [warps + 1, E] fit the shared memory (512 for
        # Qwen3-Next's 512 experts: the one-block group_pairs took 19 of a 512-row window's
        # 125 ms there, H200)
        threads = next((t for t in (GROUP_WIDE_THREADS, GROUP_WIDE_THREADS // 2,
                                    GROUP_WIDE_THREADS // 4)
                        if 4 * (t // 32 + 1) * E <= GROUP_WIDE_MAX_SHARED_BYTES), 0)
        if R >= MMQ_MIN_ROWS and threads:
            self._add("group_pairs_wide", (1,), (threads,), "PiiiPPPP",
                      [outs[1], R * K, K, E, *outs[3:]],
                      shared_bytes=4 * (threads // 32 + 1) * E)
            return
        self._add("group_pairs", (1,), (256,), "PiiiPPPP", [outs[1], R * K, K, E, *outs[3:]],
                  shared_bytes=group_shared_bytes)

    def _gated_or_plain_attention(self, ly) -> None:
        """x += the attention of every row [R, H]. A gated one (qwen3next) projects each head's
        query and gate together, and scales the attention output by sigmoid(gate)."""
        m, ws, spec, R = self._model, self._ws, self._model.spec, self.num_rows
        Q, KVH, D = spec.n_heads, spec.n_kv_heads, spec.head_dim
        gated = spec.has_attn_gate
        self._qkv(ly)  # qb [R, Q*D] ([R, Q, 2D] gated), kb [R, KVH*D], vb [R, KVH*D]
        q = "qb"
        if gated:  # qq, gate [R, Q*D]
            q = "qq"
            self._add("split_q_gate", ((R * Q * D + 255) // 256,), (256,), "PiiiPP",
                      [ws.ptr("qb"), R, Q, D, ws.ptr("qq"), ws.ptr("gate")])
        self._add("qk_rope_append", (R, Q + 2 * KVH), (32,), "PPPPPPfPPPiiiiii",
                  [ws.ptr(q), ws.ptr("kb"), ws.ptr("vb"),
                   ly.q_norm.ptr if ly.q_norm else 0, ly.k_norm.ptr if ly.k_norm else 0,
                   m.inv_freq.ptr, m.eps, ws.desc("kv"), ws.desc("pos"), ws.desc("cap"),
                   ly.cache_index, len(spec.attention_layers), Q, KVH, D, spec.n_rot])
        # hf [R, Q*D]; its 8-bit form in the same kernel when heads are whole blocks of 32
        fuse_q = not ly.wo.is_float and D % 32 == 0 and not gated
        self._attention(ly.cache_index, fuse_q, q)
        if gated:  # hf *= sigmoid(gate)
            self._add("mul_sigmoid", ((R * Q * D + 255) // 256,), (256,), "PPq",
                      [ws.ptr("hf"), ws.ptr("gate"), R * Q * D])
        if not ly.wo.is_float and not fuse_q:
            self._quantize("hf", "hq", "hd", R * Q * D)
        self._mm("add", ly.wo, "hf", "x")  # x += attention [R, H]

    def _delta_net(self, ly) -> None:
        """x += a gated delta-net layer over the rows [R, H]: each run's rows in order from its
        sequence's state (the descriptor's state, run0, run_len), hf (+ hq/hd) normed in."""
        ws, spec, R = self._ws, self._model.spec, self.num_rows
        C, K, VI = spec.ssm_channels, spec.ssm_conv, spec.ssm_inner
        Hk, Hv, Dk, Dv = spec.ssm_groups, spec.ssm_heads, spec.ssm_state, spec.ssm_v_dim
        ci, eps = ly.cache_index, self._model.eps
        runs = [ws.desc("state")]
        runs_tail = [ws.desc("run0"), ws.desc("run_len")]
        self._mm("store", ly.ssm_qkv, "hf", "rq")  # [R, C] q | k | v
        self._mm("store", ly.ssm_gate, "hf", "rz")  # [R, VI] z
        self._mm("store", ly.ssm_ba, "hf", "rba")  # [R, 2*Hv] beta logits | alpha
        # ry [R, C] = silu(causal conv); the conv state of each run's sequence moves on
        self._add("conv_silu_rows", ((C + 127) // 128, R), (128,), "PiiPPqPPP",
                  [ws.ptr("rq"), C, K, ly.conv_w.ptr, *runs, ci * (K - 1) * C, *runs_tail,
                   ws.ptr("ry")])
        # rcore [R, VI]: the delta rule per (value head, 32-column panel), runs in order
        self._add("gated_delta_rows", ((Dv + 31) // 32, Hv, R), (128,), "PiiiiiPPPfPqPPP",
                  [ws.ptr("ry"), C, Hk, Hv, Dk, Dv, ws.ptr("rba"), ly.ssm_a.ptr,
                   ly.ssm_dt.ptr, eps, *runs, ci * Hv * Dk * Dv, *runs_tail, ws.ptr("rcore")])
        # hf [R, VI] = w * rmsnorm(core) * silu(z) per value head
        self._add("gated_rmsnorm_rows", (R, Hv), (128,), "PPPfiiP",
                  [ws.ptr("rcore"), ws.ptr("rz"), ly.ssm_norm.ptr, eps, Hv, Dv, ws.ptr("hf")])
        if not ly.ssm_out.is_float:
            self._quantize("hf", "hq", "hd", R * VI)
        self._mm("add", ly.ssm_out, "hf", "x")  # x += [R, H]

    # ---- the pass -------------------------------------------------------------------------
    def _build(self) -> None:
        m, ws, spec = self._model, self._ws, self._model.spec
        R, N = self.num_rows, self.num_logit_rows
        H, K, F = spec.hidden, spec.n_experts_used, spec.expert_ffn
        P = R * K
        ahead = m.tier is not None and m.tier.reads_ahead(R)
        guesses = m.tier is not None and m.tier.guesses(R)
        if ahead:  # layer 0's likeliest experts staged while the window starts (device_tier.py)
            m.tier.add_read_ahead(self, 0)
        if m.is_first:  # later stages of a layer split find x [R, H] copied in
            emb = m.embd
            self._add(f"embed_{emb.suffix}", (R,), (256,), "PqiPP",
                      [emb.ptr, emb.row_bytes, H, ws.desc("tokens"), ws.ptr("x")])
        is_normed = False  # the previous layer's combine_norm already wrote hf (+ hq, hd)
        for li, ly in enumerate(m.layers):
            # -- attention, or a hybrid model's gated delta net
            if not is_normed:
                self._norm(ly.attn_norm.ptr, R, quantize=m.quantize_h)
            if ly.is_recurrent:
                self._delta_net(ly)  # x += the gated delta net of the rows [R, H]
            else:
                self._gated_or_plain_attention(ly)  # x += attention [R, H]
            if guesses and li + 1 < len(m.layers):  # the next layer's routing guessed from
                m.tier.add_guess(self, li + 1)  # x [R, H] and published (guess.py)
            # -- the routed experts
            self._norm(ly.ffn_norm.ptr, R, quantize=m.quantize_h)
            self._router(ly)  # router [R, E], ids / wts [R, K], the pairs grouped by expert
            at = len(self.launches)
            if m.tier is not None:  # counts [E] of this layer; CPU groups out, rows to the pool
                m.tier.add_after_grouping(self, li)  # (and the misses it keeps: keeps_misses)
            self.mark_span("grouping", li, at)
            keep = m.tier.keep_tables(li) if self.keeps_misses else ((0, 0), (0, 0))
            # gate/up + SiLU per distinct expert over its rows: hbuf [P (grouped order), F]
            first_expert_launch = len(self.launches)
            self._mm("gateup", ly.gate_exps, "hf", "hbuf", w2=ly.up_exps, grouped=True,
                     act_rows=True, keep=keep[0])
            if not ly.down_exps.is_float:
                self._quantize("hbuf", "hbq", "hbd", P * F)
            # down per distinct expert: ybuf [P (pair r*K + k), H]. mv over the quantize_q8
            # rows: H200, qwen3-30b-a3b Q4_0, tokens/s 1 / 4 / 8 slots 344.5 / 771.7 / 923.7 vs
            # 318.3 / 665.9 / 795.3 on the dp4a mm_* warps (9.2 vs 13.9 us per layer, ncu: the
            # mm grid of 1,024 blocks at 127 registers took two waves). An mv kernel quantising
            # hbuf's rows itself (every warp redoing it) was slower than both in an earlier build.
            self._mm("store", ly.down_exps, "hbuf", "ybuf", grouped=True, out_rows=True,
                     use_mv=os.environ.get("STRATA_DECODE_DOWN", "mv") != "mm", keep=keep[1])
            self.expert_spans.append((first_expert_launch, len(self.launches)))
            if ahead and li + 1 < len(m.layers):  # the link is idle until the next routing
                m.tier.add_read_ahead(self, li + 1)
            shared = (0, 0)
            if ly.shexp_w_gate is not None:
                S = spec.shared_ffn
                self._mm("gateup", ly.shexp_w_gate, "hf", "sg", w2=ly.shexp_w_up)  # [R, S]
                if not ly.shexp_w_down.is_float:
                    self._quantize("sg", "sgq", "sgd", R * S)
                self._mm("store", ly.shexp_w_down, "sg", "so")  # [R, H]
                self._add("gate_logit_rows", ((R + 3) // 4,), (128,), "PPiiP",
                          [ws.ptr("hf"), ly.shexp_gate.ptr, R, H, ws.ptr("sl")])  # [R]
                shared = (ws.ptr("so"), ws.ptr("sl"))
            is_pooled = m.tier is not None and m.tier.pools(R)
            is_normed = (li + 1 < len(m.layers) and H % 4 == 0 and H <= NORM_MAX_HIDDEN
                         and not is_pooled)
            at = len(self.launches)
            if is_pooled:  # wait for the CPU pool; its y added, CPU pairs left out
                m.tier.add_combine(self, li, shared)
            elif is_normed:  # x += combine, then the next layer's attention norm, one launch
                quantize = m.quantize_h
                self._add("combine_norm", (R,), (256,), "PPPiiPPPfPPP",
                          [ws.ptr("x"), ws.ptr("ybuf"), ws.ptr("wts"), K, H, *shared,
                           m.layers[li + 1].attn_norm.ptr, m.eps, ws.ptr("hf"),
                           ws.ptr("hq") if quantize else 0, ws.ptr("hd") if quantize else 0])
            else:
                self._add("moe_combine", ((R * H + 255) // 256,), (256,), "PPPiiiPP",
                          [ws.ptr("x"), ws.ptr("ybuf"), ws.ptr("wts"), R, K, H, *shared])
            if is_pooled:
                self.mark_span("pool", li, at)
        if not m.is_last:  # a layer split's next stage takes x [R, H] from here
            return
        # -- the head over the N logit rows
        self._norm(m.out_norm.ptr, N, quantize=not m.head.is_float, gather=True)
        self._mm("store", m.head, "hf", "logits", logit_rows=True)  # [N, V]
        self._add("argmax_rows", (N,), (1024,), "PiP",
                  [ws.ptr("logits"), spec.vocab, ws.ptr("argmax")])

    # ---- running --------------------------------------------------------------------------
    def run(self, stream: int, use_graph: bool) -> None:
        streamer = getattr(getattr(self._model, "expert_arena", None), "streamer", None)
        if streamer is not None and streamer.is_ready_for(self.num_rows):
            streamer.run(self, stream)  # experts copied into staging slots first (stream.py)
            return
        if use_graph:
            if self.graph is None:
                self.graph = cuda_driver.Graph(self.launches, stream)
            self.graph.launch(stream)
        else:
            self.launches.run(stream)
