// Products of activation rows with GGUF weight rows, read straight from the quantised blocks.
// One kernel family serves the dense projections, the grouped routed experts (each distinct
// expert once per window, all its rows together) and the shared expert.
//
// Legend: N = weight rows (outputs), K = columns (dot length), P = activation rows of a group,
// G = groups (experts), TR = activation rows per register tile, NR = outputs per warp.
// Quantised weights meet 8-bit activations (as the CPU backend and llama.cpp's Q8_0): per 32
// columns dx = max|x| / 127, q = rint(x / dx); a group of 16 columns contributes
// a * dx * sum(s * q) - b * dx * sum(q) (dp4a). Float weights (F32/F16/BF16) meet float rows.
#include "products.cuh"

#define TR 4            // activation rows per tile: each decoded weight group serves TR rows
#define MM_WARPS 4      // warps per block
#define NR 4            // outputs n per warp: each activation load serves NR weight rows
#define MM_GROUP_UNROLL 2  // 16-column groups decoded together per lane (store / add modes)


// groups: [G, 3] (expert, first pair, pair count) with *num_groups in use. Grouped products find
// each expert's matrix through wtab[expert] (and W2's through wtab2[expert]): device pointers,
// so an expert may sit in a VRAM slot or in mapped host memory; dense ones (wtab NULL) read W.
// Pair p of a group
// reads activation row act_rows[p] (p itself when act_rows is NULL) and writes output row
// out_rows[p] (p when NULL). Each warp computes NR consecutive outputs n (each activation load
// serves NR weight rows), TR activation rows at a time. Grid: (ceil(N / (MM_WARPS * NR)), G),
// block MM_WARPS * 32. A (row, n) result is summed in the same order whatever else the window
// holds, so a slot's rows do not depend on the other slots.
template <int QT, int MODE>
__device__ __forceinline__ void mm_body(
    const uint8_t *__restrict__ W, const uint8_t *__restrict__ W2,
    const unsigned long long *__restrict__ wtab, const unsigned long long *__restrict__ wtab2,
    long long row_bytes, int N, int K, const float *__restrict__ xf,
    const int8_t *__restrict__ xq, const float *__restrict__ xd, const int *__restrict__ groups,
    const int *__restrict__ num_groups, const int *__restrict__ act_rows,
    const int *__restrict__ out_rows, const float *__restrict__ bias, float *__restrict__ Y,
    int ldy, int block_x) {
    const int g = blockIdx.y;
    if (g >= *num_groups) return;
    const int lane = threadIdx.x & 31;
    const int n0 = (block_x * MM_WARPS + (threadIdx.x >> 5)) * NR;
    if (n0 >= N) return;
    const int nr = min(NR, N - n0);
    const int expert = groups[3 * g], first = groups[3 * g + 1], count = groups[3 * g + 2];
    const uint8_t *base = wtab ? reinterpret_cast<const uint8_t *>(wtab[expert]) : W;
    const uint8_t *base2 = MODE != MODE_GATEUP ? base
                           : wtab2 ? reinterpret_cast<const uint8_t *>(wtab2[expert]) : W2;
    const uint8_t *wrow[NR], *wrow2[NR];  // [K] blocks each
#pragma unroll
    for (int j = 0; j < NR; j++) {
        const long long off = (long long)(n0 + min(j, nr - 1)) * row_bytes;
        wrow[j] = base + off;
        wrow2[j] = base2 + off;
    }
    constexpr bool is_float = QT == ST_F32 || QT == ST_F16 || QT == ST_BF16;
    constexpr bool has_min = QT == ST_Q2_K || QT == ST_Q4_K || QT == ST_Q5_K || QT == ST_Q4_1
                             || QT == ST_Q5_1;
    const int num_groups16 = K >> 4, num_xblocks = K >> 5;

    for (int p0 = first; p0 < first + count; p0 += TR) {
        const int nt = min(TR, first + count - p0);
        int arow[TR];
#pragma unroll
        for (int t = 0; t < TR; t++) {
            const int p = p0 + (t < nt ? t : 0);
            arow[t] = act_rows ? act_rows[p] : p;
        }
        float acc[NR][TR], acc2[NR][TR];
#pragma unroll
        for (int j = 0; j < NR; j++)
#pragma unroll
            for (int t = 0; t < TR; t++) acc[j][t] = acc2[j][t] = 0.0f;

        if constexpr (is_float) {
            // unrolled so several weight/activation loads are in flight (latency, not FLOPs,
            // bounds a decode row)
#pragma unroll 8
            for (int c = lane; c < K; c += WARP) {
                float w[NR], w2[NR];
#pragma unroll
                for (int j = 0; j < NR; j++) {
                    w[j] = load_float_weight<QT>(wrow[j], c);
                    w2[j] = MODE == MODE_GATEUP ? load_float_weight<QT>(wrow2[j], c) : 0.0f;
                }
#pragma unroll
                for (int t = 0; t < TR; t++) {
                    if (t < nt) {
                        const float x = xf[(long long)arow[t] * K + c];
#pragma unroll
                        for (int j = 0; j < NR; j++) {
                            acc[j][t] = fmaf(w[j], x, acc[j][t]);
                            if (MODE == MODE_GATEUP) acc2[j][t] = fmaf(w2[j], x, acc2[j][t]);
                        }
                    }
                }
            }
        } else {
            // groups of several iterations decoded together: more loads in flight per lane
            // (a decode row is latency-bound); gate/up holds twice the registers per group
            constexpr int group_unroll = MODE == MODE_GATEUP ? 2 : MM_GROUP_UNROLL;
#pragma unroll group_unroll
            for (int gi = lane; gi < num_groups16; gi += WARP) {
                int v[NR][4], v2[NR][4];
                float a[NR], b[NR], a2[NR], b2[NR];
#pragma unroll
                for (int j = 0; j < NR; j++) {
                    decode_group<QT>(wrow[j], gi, v[j], a[j], b[j]);
                    if (MODE == MODE_GATEUP) decode_group<QT>(wrow2[j], gi, v2[j], a2[j], b2[j]);
                }
#pragma unroll
                for (int t = 0; t < TR; t++) {
                    if (t < nt) {
                        // [16] int8 activations of this group, 16-byte aligned
                        const int4 xv = *reinterpret_cast<const int4 *>(
                            xq + (long long)arow[t] * K + 16 * gi);
                        const float dx = xd[(long long)arow[t] * num_xblocks + (gi >> 1)];
                        int sq = 0;
                        if constexpr (has_min) {
                            sq = __dp4a(0x01010101, xv.x, 0);
                            sq = __dp4a(0x01010101, xv.y, sq);
                            sq = __dp4a(0x01010101, xv.z, sq);
                            sq = __dp4a(0x01010101, xv.w, sq);
                        }
#pragma unroll
                        for (int j = 0; j < NR; j++) {
                            int s = __dp4a(v[j][0], xv.x, 0);
                            s = __dp4a(v[j][1], xv.y, s);
                            s = __dp4a(v[j][2], xv.z, s);
                            s = __dp4a(v[j][3], xv.w, s);
                            float part = a[j] * (dx * (float)s);
                            if constexpr (has_min) part -= b[j] * (dx * (float)sq);
                            acc[j][t] += part;
                            if (MODE == MODE_GATEUP) {
                                int s2 = __dp4a(v2[j][0], xv.x, 0);
                                s2 = __dp4a(v2[j][1], xv.y, s2);
                                s2 = __dp4a(v2[j][2], xv.z, s2);
                                s2 = __dp4a(v2[j][3], xv.w, s2);
                                float part2 = a2[j] * (dx * (float)s2);
                                if constexpr (has_min) part2 -= b2[j] * (dx * (float)sq);
                                acc2[j][t] += part2;
                            }
                        }
                    }
                }
            }
        }
#pragma unroll
        for (int j = 0; j < NR; j++) {
            if (j >= nr) break;
            const int n = n0 + j;
#pragma unroll
            for (int t = 0; t < TR; t++) {
                if (t < nt) {
                    const float s = warp_sum(acc[j][t]);
                    const float s2 = MODE == MODE_GATEUP ? warp_sum(acc2[j][t]) : 0.0f;
                    if (lane == 0) {
                        const int p = p0 + t;
                        float *y = Y + (long long)(out_rows ? out_rows[p] : p) * ldy + n;
                        if (MODE == MODE_STORE) *y = bias ? s + bias[n] : s;
                        else if (MODE == MODE_ADD) *y += s;
                        else *y = silu(s) * s2;
                    }
                }
            }
        }
    }
}

#define MM_PASS W, W2, wtab, wtab2, row_bytes, N, K, xf, xq, xd, groups, num_groups, act_rows,     \
                out_rows, bias, Y, ldy, blockIdx.x
#define QKV_BODY(QT)                                                                                \
    const int nbq = (Nq + MM_WARPS * NR - 1) / (MM_WARPS * NR);                                     \
    const int nbkv = (Nkv + MM_WARPS * NR - 1) / (MM_WARPS * NR);                                   \
    const int bx = blockIdx.x;                                                                      \
    if (bx < nbq)                                                                                   \
        mm_body<QT, MODE_STORE>(Wq, Wq, nullptr, nullptr, row_bytes, Nq, K, xf, xq, xd, groups,   \
                                num_groups,                                                 \
                                nullptr, nullptr, bq, Yq, Nq, bx);                                  \
    else if (bx < nbq + nbkv)                                                                       \
        mm_body<QT, MODE_STORE>(Wk, Wk, nullptr, nullptr, row_bytes, Nkv, K, xf, xq, xd, groups,  \
                                num_groups,                                                 \
                                nullptr, nullptr, bk, Yk, Nkv, bx - nbq);                           \
    else                                                                                            \
        mm_body<QT, MODE_STORE>(Wv, Wv, nullptr, nullptr, row_bytes, Nkv, K, xf, xq, xd, groups,  \
                                num_groups,                                                 \
                                nullptr, nullptr, bv, Yv, Nkv, bx - nbq - nbkv);

#define MM_KERNELS(NAME, QT)                                                                        \
    extern "C" __global__ void __launch_bounds__(MM_WARPS * 32) mm_store_##NAME(MM_ARGS) {          \
        kernel_entry();                                                                             \
        mm_body<QT, MODE_STORE>(MM_PASS);                                                           \
    }                                                                                               \
    extern "C" __global__ void __launch_bounds__(MM_WARPS * 32) mm_add_##NAME(MM_ARGS) {            \
        kernel_entry();                                                                             \
        mm_body<QT, MODE_ADD>(MM_PASS);                                                             \
    }                                                                                               \
    extern "C" __global__ void __launch_bounds__(MM_WARPS * 32) mm_gateup_##NAME(MM_ARGS) {         \
        kernel_entry();                                                                             \
        mm_body<QT, MODE_GATEUP>(MM_PASS);                                                          \
    }                                                                                               \
    extern "C" __global__ void __launch_bounds__(MM_WARPS * 32) mm_qkv_##NAME(QKV_ARGS) {           \
        kernel_entry();                                                                             \
        QKV_BODY(QT)                                                                                \
    }

MM_KERNELS(f32, ST_F32)
MM_KERNELS(f16, ST_F16)
MM_KERNELS(bf16, ST_BF16)
MM_KERNELS(q8_0, ST_Q8_0)
MM_KERNELS(q4_0, ST_Q4_0)
MM_KERNELS(q4_1, ST_Q4_1)
MM_KERNELS(q5_0, ST_Q5_0)
MM_KERNELS(q5_1, ST_Q5_1)
MM_KERNELS(iq4_nl, ST_IQ4_NL)
MM_KERNELS(q2_k, ST_Q2_K)
MM_KERNELS(q3_k, ST_Q3_K)
MM_KERNELS(q4_k, ST_Q4_K)
MM_KERNELS(q5_k, ST_Q5_K)
MM_KERNELS(q6_k, ST_Q6_K)
MM_KERNELS(iq4_xs, ST_IQ4_XS)
MM_KERNELS(iq2_xxs, ST_IQ2_XXS)
MM_KERNELS(iq2_xs, ST_IQ2_XS)
MM_KERNELS(iq2_s, ST_IQ2_S)
MM_KERNELS(iq3_xxs, ST_IQ3_XXS)
MM_KERNELS(iq3_s, ST_IQ3_S)
MM_KERNELS(iq1_s, ST_IQ1_S)
MM_KERNELS(iq1_m, ST_IQ1_M)


// x [T, K] float -> q [T, K] int8, d [T, K/32]: per 32 columns d = max|x| / 127, q = rint(x / d)
// (as the CPU's quantize_row). One warp per 32 columns; grid ceil(T*K/32 / 8), block 256.
extern "C" __global__ void quantize_q8(const float *__restrict__ x, long long num_blocks,
                                       int8_t *__restrict__ q, float *__restrict__ d) {
    kernel_entry();
    const long long blk = (long long)blockIdx.x * 8 + (threadIdx.x >> 5);
    if (blk >= num_blocks) return;
    const int lane = threadIdx.x & 31;
    const float v = x[blk * 32 + lane];
    const float amax = warp_max(fabsf(v));
    const float dd = amax / 127.0f;
    const float id = dd > 0.0f ? 1.0f / dd : 0.0f;
    q[blk * 32 + lane] = (int8_t)__float2int_rn(v * id);
    if (lane == 0) d[blk] = dd;
}
