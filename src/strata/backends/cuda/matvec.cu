// Decode products (windows of < MMQ_MIN_ROWS rows) on Q4_0 / Q8_0, Q4_1 / Q5_0 / Q5_1 /
// IQ4_NL, k-quant (Q2_K .. Q6_K, IQ4_XS) and grid i-quant (IQ1_S .. IQ3_S) weights: the mv_*
// kernels, with matmul.cu's arguments
// (products.cuh). Legend as
// matmul.cu: N = weight rows (outputs), K = columns, P = activation rows of a group, G = groups
// (experts).
#include "products.cuh"

// ---- decode products (windows of < MMQ_MIN_ROWS rows): mv_* ---------------------------------
// A decode row is latency-bound: the warps above issue a few 2-byte loads per lane, wait, and
// repeat. Here a warp computes mv_outputs_per_warp(K) consecutive outputs (32 / that many lanes
// each); their weight rows are one contiguous byte range, which the warp copies into shared
// memory with 16-byte cp.async copies, all in flight together (up to MV_CHUNKS per lane per
// round: rows of up to ~2.5 KiB arrive in one round trip), then decodes from there. Whole
// 16-byte reads also suit mapped host memory (offloaded experts read over PCIe).
// Per output and row: each lane sums its 32-column blocks j = lane, lane + lanes, ... in
// increasing order as (float)s * (d_w * d_x) (s = the int8 dot of one 32-value block; k-quants:
// a_w * d_x * s - m_w * d_x * sum(q), per 16 columns for Q2_K / Q3_K / Q6_K / IQ2_XS / IQ2_S /
// IQ1_M; Q4_1 / Q5_1 alike
// with their min per 32), then the lanes are summed by a butterfly: a fixed order that depends
// on K only, never on the window. Rows are staged in units of a quant block (Q4_0 / Q8_0 and
// the other 32-column types) or super-block (k-quants: 256).
// Grid (ceil(N / (MV_WARPS * mv_outputs_per_warp(K))), G), block MV_WARPS * 32 (plan.py
// mirrors mv_outputs_per_warp and says which products take these kernels).
// The expert a decode layer splits with the CPU pool (offload.cu's count_groups: num_groups [3]
// = G, that expert or -1, its cut): a grouped gate/up computes only its rows >= cut, a grouped
// down (store) only its columns >= cut, the pool the rest; cut is a multiple of 32 (of the
// down's staged unit), so a warp's outputs are all on one side of it.
#define MV_WARPS 4
#define MV_CHUNKS 5                          // 16-byte copies in flight per lane per round
#define MV_STAGE_BYTES (16 * WARP * MV_CHUNKS)  // shared bytes per staged range (2.5 KiB)
#define MV_TR 4                              // activation rows per register tile

// lanes per output: 32 for rows of >= 32 quant blocks, 16 for >= 12, else 8
__device__ __forceinline__ int mv_lanes_per_output(int K) {
    const int num_blocks = K >> 5;
    return num_blocks >= 32 ? 32 : num_blocks >= 12 ? 16 : 8;
}

// Copy bytes [src, src + num_bytes) into stage: the 16-byte-aligned chunks that cover them
// (a chunk holding one wanted byte never crosses a page, so reading it whole is safe), by
// cp.async, so every load of the warp is in flight at once and none holds a register. Returns
// the offset of src's first byte in stage. The whole warp calls it; mv_stage_wait() then
// makes the bytes visible to every lane.
__device__ __forceinline__ int mv_stage(const uint8_t *src, int num_bytes, int4 *stage) {
    const int lane = threadIdx.x & 31;
    const unsigned long long a = reinterpret_cast<unsigned long long>(src);
    const unsigned long long a0 = a & ~15ull;
    const int num_chunks = (int)((((a + num_bytes + 15) & ~15ull) - a0) >> 4);
#pragma unroll
    for (int c = 0; c < MV_CHUNKS; c++) {
        const int i = lane + WARP * c;
        if (i < num_chunks) {
            const unsigned dst = (unsigned)__cvta_generic_to_shared(stage + i);
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst),
                         "l"(a0 + 16ull * i));
        }
    }
    return (int)(a - a0);
}

__device__ __forceinline__ void mv_stage_wait() {
    asm volatile("cp.async.wait_all;\n" ::);
    __syncwarp();
}

// Free admission: write the chunks mv_stage staged for [src, src + num_bytes) to the same
// bytes at dst, whose offset within 16 bytes is src's (slot images and host copies share one
// 256-byte part layout, offload.py). The edge chunks carry bytes of the neighbouring rows or
// the part's padding: the same values as the source, which the warps reading them write too.
__device__ __forceinline__ void mv_keep(const uint8_t *src, int num_bytes, const int4 *stage,
                                        uint8_t *dst) {
    const unsigned long long a = reinterpret_cast<unsigned long long>(src);
    const unsigned long long a0 = a & ~15ull;
    const int num_chunks = (int)((((a + num_bytes + 15) & ~15ull) - a0) >> 4);
    int4 *d0 = reinterpret_cast<int4 *>(dst - (a - a0));
    for (int i = threadIdx.x & 31; i < num_chunks; i += WARP) d0[i] = stage[i];
}

// the int8 dot of one staged Q4_0 / Q8_0 block at p (2-byte aligned) with 32 activations
// (xa: values 0-15, xb: 16-31); d = the block's scale
template <int QT>
__device__ __forceinline__ int mv_block_dot(const uint8_t *p, const int4 &xa, const int4 &xb) {
    const uint16_t *h = reinterpret_cast<const uint16_t *>(p + 2);
    if (QT == ST_Q4_0) {  // byte i: value i in the low nibble, value i + 16 in the high one
        int s = 0;
        const int xlo[4] = {xa.x, xa.y, xa.z, xa.w}, xhi[4] = {xb.x, xb.y, xb.z, xb.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const uint32_t w = (uint32_t)h[2 * i] | ((uint32_t)h[2 * i + 1] << 16);
            s = __dp4a(nibbles_minus_8(w), xlo[i], s);
            s = __dp4a(nibbles_minus_8(w >> 4), xhi[i], s);
        }
        return s;
    } else {  // Q8_0: 32 int8 values
        const int xv[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
        int s = 0;
#pragma unroll
        for (int i = 0; i < 8; i++)
            s = __dp4a((int)((uint32_t)h[2 * i] | ((uint32_t)h[2 * i + 1] << 16)), xv[i], s);
        return s;
    }
}

// bytes of a staged unit: a 32-column block, or a super-block of 256 columns
template <int QT>
__host__ __device__ constexpr int mv_unit_bytes() {
    if constexpr (is_block32_type(QT)) return Block32<QT>::bytes;
    else if constexpr (is_iq_grid_type(QT)) return IqGrid<QT>::bytes;
    else
        return QT == ST_Q4_0 ? 18 : QT == ST_Q8_0 ? 34 : QT == ST_Q2_K ? 84 : QT == ST_Q3_K ? 110
               : QT == ST_Q4_K ? 144 : QT == ST_Q5_K ? 176 : QT == ST_IQ4_XS ? 136 : 210;
}

// Activation row `row`'s 32-column block `blk`: its int8 values as 8 words (16-byte aligned
// in xq) and its scale
__device__ __forceinline__ float mv_act_block(const int8_t *__restrict__ xq,
                                              const float *__restrict__ xd, int row, int K,
                                              int blk, int (&x)[8]) {
    const int4 *xp = reinterpret_cast<const int4 *>(xq + (long long)row * K + 32 * blk);
    const int4 xa = xp[0], xb = xp[1];
    x[0] = xa.x, x[1] = xa.y, x[2] = xa.z, x[3] = xa.w;
    x[4] = xb.x, x[5] = xb.y, x[6] = xb.z, x[7] = xb.w;
    return xd[(long long)row * (K >> 5) + blk];
}

// The k-quant blocks of one staged round: lane `sub` of its output takes 32-column blocks j =
// sub, sub + lanes, ... < num_j of the staged row srow (srow2: gate/up's up row), block j0 + j
// of the whole row, against activation rows arow[0 .. nt)
template <int QT, bool GATEUP>
__device__ __forceinline__ void mv_k_blocks(const uint8_t *srow, const uint8_t *srow2, int sub,
                                            int lanes, int num_j, int j0, int nt,
                                            const int (&arow)[MV_TR],
                                            const int8_t *__restrict__ xq,
                                            const float *__restrict__ xd, int K,
                                            float (&acc)[MV_TR], float (&acc2)[MV_TR]) {
    constexpr int QB = mv_unit_bytes<QT>();
    constexpr bool has_min = QT == ST_Q2_K || QT == ST_Q4_K || QT == ST_Q5_K;
    constexpr bool per16_iq = is_iq_grid_type(QT) && IqGrid<QT>::per16;
#pragma unroll 1
    for (int j = sub; j < num_j; j += lanes) {
        const int blk = j0 + j;
        int v[8], v2[8];
        float a[2], m[2], a2[2], m2[2];
        unpack_k_block<QT>(srow + (j >> 3) * QB, j & 7, v, a, m);
        if (GATEUP) unpack_k_block<QT>(srow2 + (j >> 3) * QB, j & 7, v2, a2, m2);
#pragma unroll
        for (int t = 0; t < MV_TR; t++) {
            if (t >= nt) continue;
            int x[8];
            const float dx = mv_act_block(xq, xd, arow[t], K, blk, x);
            int lo = 0, hi = 0, lo2 = 0, hi2 = 0, sq_lo = 0, sq_hi = 0;
#pragma unroll
            for (int w = 0; w < 4; w++) {
                lo = __dp4a(v[w], x[w], lo);
                hi = __dp4a(v[w + 4], x[w + 4], hi);
                if (GATEUP) {
                    lo2 = __dp4a(v2[w], x[w], lo2);
                    hi2 = __dp4a(v2[w + 4], x[w + 4], hi2);
                }
                if (has_min) {
                    sq_lo = __dp4a(0x01010101, x[w], sq_lo);
                    sq_hi = __dp4a(0x01010101, x[w + 4], sq_hi);
                }
            }
            if constexpr (QT == ST_Q3_K || QT == ST_Q6_K || per16_iq) {  // a scale per 16
                acc[t] += (float)lo * (a[0] * dx) + (float)hi * (a[1] * dx);
                if (GATEUP) acc2[t] += (float)lo2 * (a2[0] * dx) + (float)hi2 * (a2[1] * dx);
            } else if constexpr (QT == ST_Q2_K) {  // a scale and a min per 16 columns
                acc[t] += (float)lo * (a[0] * dx) - (float)sq_lo * (m[0] * dx)
                          + (float)hi * (a[1] * dx) - (float)sq_hi * (m[1] * dx);
                if (GATEUP)
                    acc2[t] += (float)lo2 * (a2[0] * dx) - (float)sq_lo * (m2[0] * dx)
                               + (float)hi2 * (a2[1] * dx) - (float)sq_hi * (m2[1] * dx);
            } else {  // Q4_K / Q5_K: one scale and min per 32 columns; IQ4_XS, IQ*: no min
                const int sq = sq_lo + sq_hi;
                acc[t] += (float)(lo + hi) * (a[0] * dx) - (float)sq * (m[0] * dx);
                if (GATEUP)
                    acc2[t] += (float)(lo2 + hi2) * (a2[0] * dx) - (float)sq * (m2[0] * dx);
            }
        }
    }
}

// The Q4_1 / Q5_0 / Q5_1 / IQ4_NL blocks of one staged round (common.cuh's Block32): lane
// `sub` of its output takes blocks j = sub, sub + lanes, ... < num_j of the staged row srow
// (srow2: gate/up's up row), block j0 + j of the whole row, against activation rows
// arow[0 .. nt); each adds a * dx * s (- b * dx * sum(q) for the types with a min, b = -m)
template <int QT, bool GATEUP>
__device__ __forceinline__ void mv_b32_blocks(const uint8_t *srow, const uint8_t *srow2, int sub,
                                              int lanes, int num_j, int j0, int nt,
                                              const int (&arow)[MV_TR],
                                              const int8_t *__restrict__ xq,
                                              const float *__restrict__ xd, int K,
                                              float (&acc)[MV_TR], float (&acc2)[MV_TR]) {
    constexpr int QB = Block32<QT>::bytes;
    constexpr bool has_min = Block32<QT>::min;
#pragma unroll 2
    for (int j = sub; j < num_j; j += lanes) {
        const int blk = j0 + j;
        int v[8], v2[8];
        float a, b, a2 = 0.0f, b2 = 0.0f;
        unpack_block32<QT>(srow + j * QB, v, a, b);
        if (GATEUP) unpack_block32<QT>(srow2 + j * QB, v2, a2, b2);
#pragma unroll
        for (int t = 0; t < MV_TR; t++) {
            if (t >= nt) continue;
            int x[8];
            const float dx = mv_act_block(xq, xd, arow[t], K, blk, x);
            int s = 0, s2 = 0, sq = 0;
#pragma unroll
            for (int w = 0; w < 8; w++) {
                s = __dp4a(v[w], x[w], s);
                if (GATEUP) s2 = __dp4a(v2[w], x[w], s2);
                if (has_min) sq = __dp4a(0x01010101, x[w], sq);
            }
            if constexpr (has_min) {
                acc[t] += (float)s * (a * dx) - (float)sq * (b * dx);
                if (GATEUP) acc2[t] += (float)s2 * (a2 * dx) - (float)sq * (b2 * dx);
            } else {
                acc[t] += (float)s * (a * dx);
                if (GATEUP) acc2[t] += (float)s2 * (a2 * dx);
            }
        }
    }
}

// A dense product's first staged round (mv_body's, for this warp; store / add: one range per
// warp), issued before kernel_entry's wait from the arguments alone: launched programmatically,
// its copies overlap the kernel before this one (docs/cuda.md, "Programmatic dependent launch").
// Dense weights only (W is the model's own, which no kernel writes): which expert a group reads
// comes from the router. mv_body takes the copies as its first round and waits for them.
template <int QT>
__device__ __forceinline__ void mv_prestage(const uint8_t *W, long long row_bytes, int N, int K,
                                            int block_x, int4 *stage_all) {
    constexpr int unit_bytes = mv_unit_bytes<QT>();
    constexpr bool is_k = QT != ST_Q4_0 && QT != ST_Q8_0 && !is_block32_type(QT);
    const int warp = threadIdx.x >> 5, outs = WARP / mv_lanes_per_output(K);
    const int n0 = (block_x * MV_WARPS + warp) * outs;
    if (n0 >= N) return;
    const int num_units = (K >> 5) / (is_k ? 8 : 1);
    const int round_units = outs > 1 ? num_units
                            : min(num_units, (MV_STAGE_BYTES - 32) / unit_bytes);
    const int num_bytes = (int)((min(outs, N - n0) - 1) * row_bytes) + round_units * unit_bytes;
    mv_stage(W + (long long)n0 * row_bytes, num_bytes, stage_all + warp * (MV_STAGE_BYTES / 16));
}

// PRESTAGE (store / add): a dense W (no expert table) is staged by mv_prestage before the wait.
// The fused q/k/v and mv_add (the attention's and the delta net's output products) ask: in
// mv_store / mv_gateup, which serve the routed experts, the early copies would cost the routed
// kernels registers (sm_90: mv_store_q4_0 48 -> 64).
template <int QT, int MODE, bool PRESTAGE = false>
__device__ __forceinline__ void mv_body(MM_BODY_PARAMS,
                                        const unsigned long long *__restrict__ atab,
                                        const unsigned long long *__restrict__ atab2) {
    // a staged unit: one block of 32 columns, or a k-quant super-block of 256
    constexpr bool is_b32 = is_block32_type(QT);
    constexpr bool is_k = QT != ST_Q4_0 && QT != ST_Q8_0 && !is_b32;
    constexpr int unit_bytes = mv_unit_bytes<QT>();
    constexpr int blocks_per_unit = is_k ? 8 : 1;  // 32-column blocks
    constexpr bool is_gateup = MODE == MODE_GATEUP;
    __shared__ int4 stage_all[MV_WARPS * (is_gateup ? 2 : 1) * (MV_STAGE_BYTES / 16)];
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    static_assert(!PRESTAGE || !is_gateup, "one staged range per warp");
    bool is_staged = PRESTAGE && wtab == nullptr && atab == nullptr;  // mv_prestage's copies
    if (is_staged) mv_prestage<QT>(W, row_bytes, N, K, block_x, stage_all);
#else
    bool is_staged = false;  // no programmatic launch below cc 9.0: nothing to overlap
#endif
    kernel_entry();
    const int g = blockIdx.y;
    if (g >= *num_groups) return;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int lanes = mv_lanes_per_output(K), outs = WARP / lanes;
    const int n0 = (block_x * MV_WARPS + warp) * outs;
    if (n0 >= N) return;  // the warp's work only: no block-wide barrier follows
    const int num_rows_w = min(outs, N - n0);          // weight rows this warp reads
    const int o = lane / lanes, sub = lane % lanes;     // this lane's output, its place there
    const int expert = groups[3 * g], first = groups[3 * g + 1], count = groups[3 * g + 2];
    // the pool computes rows / columns [0, cut) of the split expert (routed products only)
    const int cut = MODE != MODE_ADD && wtab != nullptr && expert == num_groups[1]
                    ? num_groups[2] : 0;
    if (is_gateup && n0 < cut) return;  // rows below the cut are the pool's
    const uint8_t *base = wtab ? reinterpret_cast<const uint8_t *>(wtab[expert]) : W;
    const uint8_t *base2 = !is_gateup ? base
                           : wtab2 ? reinterpret_cast<const uint8_t *>(wtab2[expert]) : W2;
    // free admission: where this expert's bytes are kept as they are staged (nullptr: nowhere)
    uint8_t *keep = atab ? reinterpret_cast<uint8_t *>(atab[expert]) : nullptr;
    uint8_t *keep2 = is_gateup && atab2 ? reinterpret_cast<uint8_t *>(atab2[expert]) : nullptr;
    int4 *stage = stage_all + warp * (is_gateup ? 2 : 1) * (MV_STAGE_BYTES / 16);
    int4 *stage2 = stage + MV_STAGE_BYTES / 16;
    const int num_blocks = K >> 5, num_units = num_blocks / blocks_per_unit;
    // a split expert's down starts at the cut's unit; with several outputs a warp then stages
    // each row's part on its own (one range would read the next row's pool columns too)
    const int u_lo = is_gateup ? 0 : cut / (32 * blocks_per_unit);
    const bool per_row = u_lo > 0 && num_rows_w > 1;
    const int row_slot = (int)((num_units - u_lo) * unit_bytes + 31) / 16;  // int4s per row
    // units per round: whole rows when a warp has several outputs (they fit), else as many of
    // the one row as the stage holds
    const int round_units = outs > 1 ? num_units
                            : min(num_units, (MV_STAGE_BYTES - 32) / unit_bytes);
    const bool is_one_round = round_units >= num_units - u_lo;
    const long long w_off = (long long)n0 * row_bytes;
    int off = 0, off2 = 0;

    for (int p0 = first; p0 < first + count; p0 += MV_TR) {
        const int nt = min(MV_TR, first + count - p0);
        int arow[MV_TR];
#pragma unroll
        for (int t = 0; t < MV_TR; t++) {
            const int p = p0 + (t < nt ? t : 0);
            arow[t] = act_rows ? act_rows[p] : p;
        }
        float acc[MV_TR], acc2[MV_TR];
#pragma unroll
        for (int t = 0; t < MV_TR; t++) acc[t] = acc2[t] = 0.0f;
        for (int s0 = u_lo; s0 < num_units; s0 += round_units) {
            const int nur = min(round_units, num_units - s0);
            const long long u_off = w_off + (long long)s0 * unit_bytes;
            if (!is_one_round || p0 == first) {
                __syncwarp();  // the previous round's reads of the stage are done
                const int num_bytes = (int)((num_rows_w - 1) * row_bytes) + nur * unit_bytes;
                if (per_row) {  // this lane's output row's part at stage + o * row_slot
                    for (int r = 0; r < num_rows_w; r++) {
                        const int at = mv_stage(base + u_off + r * row_bytes, nur * unit_bytes,
                                                stage + r * row_slot);
                        if (r == o) off = r * row_slot * 16 + at - o * (int)row_bytes;
                    }
                } else if (is_staged) {  // the first round: mv_prestage issued it (same bytes)
                    is_staged = false;
                    off = (int)(reinterpret_cast<unsigned long long>(base + u_off) & 15);
                    off2 = (int)(reinterpret_cast<unsigned long long>(base2 + u_off) & 15);
                } else {
                    off = mv_stage(base + u_off, num_bytes, stage);
                    if (is_gateup) off2 = mv_stage(base2 + u_off, num_bytes, stage2);
                }
                mv_stage_wait();
                // each byte once: the first row tile's (a split expert is never kept)
                if (keep != nullptr && p0 == first && !per_row)
                    mv_keep(base + u_off, num_bytes, stage, keep + u_off);
                if (keep2 != nullptr && p0 == first)
                    mv_keep(base2 + u_off, num_bytes, stage2, keep2 + u_off);
            }
            if (o < num_rows_w) {
                const uint8_t *srow = reinterpret_cast<const uint8_t *>(stage) + off
                                      + (long long)o * row_bytes;
                const uint8_t *srow2 = reinterpret_cast<const uint8_t *>(stage2) + off2
                                       + (long long)o * row_bytes;
                if constexpr (is_k) {
                    mv_k_blocks<QT, is_gateup>(srow, srow2, sub, lanes, nur * 8, s0 * 8, nt,
                                               arow, xq, xd, K, acc, acc2);
                } else if constexpr (is_b32) {
                    mv_b32_blocks<QT, is_gateup>(srow, srow2, sub, lanes, nur, s0, nt, arow, xq,
                                                 xd, K, acc, acc2);
                } else {
#pragma unroll 2
                    for (int j = sub; j < nur; j += lanes) {
                        const int blk = s0 + j;
                        const uint8_t *pw = srow + j * unit_bytes;
                        const float dw = __half2float(*reinterpret_cast<const __half *>(pw));
                        float dw2 = 0.0f;
                        if (is_gateup)
                            dw2 = __half2float(*reinterpret_cast<const __half *>(srow2 +
                                                                                j * unit_bytes));
#pragma unroll
                        for (int t = 0; t < MV_TR; t++) {
                            if (t < nt) {
                                // [32] int8 activations of this block, 16-byte aligned
                                const int4 *xp = reinterpret_cast<const int4 *>(
                                    xq + (long long)arow[t] * K + 32 * blk);
                                const int4 xa = xp[0], xb = xp[1];
                                const float dx = xd[(long long)arow[t] * num_blocks + blk];
                                acc[t] += (float)mv_block_dot<QT>(pw, xa, xb) * (dw * dx);
                                if (is_gateup)
                                    acc2[t] += (float)mv_block_dot<QT>(srow2 + j * unit_bytes,
                                                                       xa, xb) * (dw2 * dx);
                            }
                        }
                    }
                }
            }
        }
#pragma unroll
        for (int t = 0; t < MV_TR; t++) {
            if (t < nt) {
                float s = acc[t], s2 = acc2[t];
                for (int m = lanes >> 1; m > 0; m >>= 1) {  // every lane takes part
                    s += __shfl_xor_sync(0xffffffffu, s, m);
                    if (is_gateup) s2 += __shfl_xor_sync(0xffffffffu, s2, m);
                }
                if (sub == 0 && o < num_rows_w) {
                    const int n = n0 + o, p = p0 + t;
                    float *y = Y + (long long)(out_rows ? out_rows[p] : p) * ldy + n;
                    if (MODE == MODE_STORE) *y = bias ? s + bias[n] : s;
                    else if (MODE == MODE_ADD) *y += s;
                    else *y = silu(s) * s2;
                }
            }
        }
    }
}

#define MV_PASS W, W2, wtab, wtab2, row_bytes, N, K, xq, xd, groups, num_groups, act_rows,       \
                out_rows, bias, Y, ldy, blockIdx.x, atab, atab2
#define MV_QKV_BODY(QT)                                                                         \
    const int outs_per_block = MV_WARPS * (WARP / mv_lanes_per_output(K));                      \
    const int nbq = (Nq + outs_per_block - 1) / outs_per_block;                                 \
    const int nbkv = (Nkv + outs_per_block - 1) / outs_per_block;                               \
    const int bx = blockIdx.x;                                                                  \
    if (bx < nbq)                                                                               \
        mv_body<QT, MODE_STORE, true>(Wq, Wq, nullptr, nullptr, row_bytes, Nq, K, xq, xd,       \
                                      groups, num_groups, nullptr, nullptr, bq, Yq, Nq, bx,     \
                                      nullptr, nullptr);                                        \
    else if (bx < nbq + nbkv)                                                                   \
        mv_body<QT, MODE_STORE, true>(Wk, Wk, nullptr, nullptr, row_bytes, Nkv, K, xq, xd,      \
                                      groups, num_groups, nullptr, nullptr, bk, Yk, Nkv,        \
                                      bx - nbq, nullptr, nullptr);                              \
    else                                                                                        \
        mv_body<QT, MODE_STORE, true>(Wv, Wv, nullptr, nullptr, row_bytes, Nkv, K, xq, xd,      \
                                      groups, num_groups, nullptr, nullptr, bv, Yv, Nkv,        \
                                      bx - nbq - nbkv, nullptr, nullptr);

// Blocks per SM the store kernels are built for: the split expert's column range (the cut)
// took mv_store_q4_0 from 48 to 64 registers (8 blocks of 128 threads an SM instead of 10);
// bounded, the 32-column types stay at 48 with no spill, the 256-column ones at 56 (48 would
// spill).
__host__ __device__ constexpr int mv_store_min_blocks(int qt) {
    return qt == ST_Q4_0 || qt == ST_Q8_0 || is_block32_type(qt) ? 10 : 9;
}

// store, add, gate/up and fused q/k/v entry points of one type (runtime._kernel_names knows the
// macro; same arguments as mm_*)
#define MV_KERNELS(NAME, QT)                                                                    \
    extern "C" __global__ void __launch_bounds__(128, mv_store_min_blocks(QT))                 \
        mv_store_##NAME(MM_ARGS) {                                                              \
        mv_body<QT, MODE_STORE>(MV_PASS);                                                       \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(128) mv_add_##NAME(MM_ARGS) {                  \
        mv_body<QT, MODE_ADD, true>(MV_PASS);                                                         \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(128) mv_gateup_##NAME(MM_ARGS) {               \
        mv_body<QT, MODE_GATEUP>(MV_PASS);                                                      \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(128) mv_qkv_##NAME(QKV_ARGS) {                 \
        MV_QKV_BODY(QT)                                                                         \
    }

MV_KERNELS(q4_0, ST_Q4_0)
MV_KERNELS(q8_0, ST_Q8_0)
MV_KERNELS(q4_1, ST_Q4_1)
MV_KERNELS(q5_0, ST_Q5_0)
MV_KERNELS(q5_1, ST_Q5_1)
MV_KERNELS(iq4_nl, ST_IQ4_NL)
MV_KERNELS(q2_k, ST_Q2_K)
MV_KERNELS(q3_k, ST_Q3_K)
MV_KERNELS(q4_k, ST_Q4_K)
MV_KERNELS(q5_k, ST_Q5_K)
MV_KERNELS(q6_k, ST_Q6_K)
MV_KERNELS(iq4_xs, ST_IQ4_XS)
MV_KERNELS(iq2_xxs, ST_IQ2_XXS)
MV_KERNELS(iq2_xs, ST_IQ2_XS)
MV_KERNELS(iq2_s, ST_IQ2_S)
MV_KERNELS(iq3_xxs, ST_IQ3_XXS)
MV_KERNELS(iq3_s, ST_IQ3_S)
MV_KERNELS(iq1_s, ST_IQ1_S)
MV_KERNELS(iq1_m, ST_IQ1_M)
