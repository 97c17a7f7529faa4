// What mmq.cu (Q4_0 / Q8_0 tiles) and mmq_k.cu (k-quant tiles) share: the block tile, the int8
// mma instructions, the exact int32 -> float conversion and the tile-slot search of grouped
// products. Legend as in mmq.cu.
#pragma once
#include "products.cuh"

#define MMQ_THREADS 128              // 4 warps: 2 over weight rows x 2 over activation rows
#define MMQ_BM 64                    // weight rows per tile (gate/up: 32 gate rows + 32 up rows)
#define MMQ_KB 8                     // quant blocks per k-tile (256 columns)
// bytes per shared row; the +16 puts the 8 rows of one fragment load on distinct banks
#define MMQ_LDS (MMQ_KB * 32 + 16)


// d[16x8] = a[16x32] . b[32x8] in int32 (a row-major weight rows, b activation rows)
__device__ __forceinline__ void mma_s8(int (&d)[4], const int (&a)[4], int b0, int b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%10,%10,%10,%10};\n"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(0));
}

// d[16x8] = a[16x16] . b[16x8] in int32: a0 / a1 hold rows gid / gid + 8, columns 4 tig .. +3
// (the first or second half of an m16n8k32 fragment's a), b0 rows 4 tig .. +3 of column gid
__device__ __forceinline__ void mma_s8_k16(int (&d)[4], int a0, int a1, int b0) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, "
        "{%7,%7,%7,%7};\n"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a0), "r"(a1), "r"(b0), "r"(0));
}

// int32 -> float for |s| < 2^22 (a block's sum: at most 32 x 127 x 127) without the conversion
// unit: s lands in the mantissa of 1.5 * 2^23, whose value then goes. Same bits as (float)s.
__device__ __forceinline__ float exact_float(int s) {
    return __int_as_float(0x4B400000 + s) - 12582912.0f;
}


// Tile slot t -> (group g, first row row0 of the group's tile): each group's rows in tiles of BN,
// groups in order. A warp scans 32 groups at a time (every warp of the block does the same, so
// no barrier is needed); false when t is past the last tile (the grid has slots for the most
// tiles a window can have: ceil(P / BN) + G).
template <int BN>
__device__ __forceinline__ bool find_tile(const int *__restrict__ groups, int num_groups, int t,
                                          int &g, int &row0) {
    const int lane = threadIdx.x & 31;
    int before = 0;  // tiles of the groups already scanned
    for (int c = 0; c < num_groups; c += 32) {
        const int gi = c + lane;
        const int tiles = gi < num_groups ? (groups[3 * gi + 2] + BN - 1) / BN : 0;
        int incl = tiles;  // inclusive prefix sum over the lanes
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int v = __shfl_up_sync(0xffffffffu, incl, o);
            if (lane >= o) incl += v;
        }
        const int total = __shfl_sync(0xffffffffu, incl, 31);
        if (t < before + total) {
            const unsigned hit = __ballot_sync(0xffffffffu, t >= before + incl - tiles &&
                                                                t < before + incl);
            const int src = __ffs(hit) - 1;
            const int start = __shfl_sync(0xffffffffu, incl - tiles, src);
            g = c + src;
            row0 = (t - before - start) * BN;
            return true;
        }
        before += total;
    }
    return false;
}

// A block's results out: accumulator c of warp (wm, wn)'s (m-tile i, n-tile j) is weight row
// gid + 8 * (c >> 1) of the m-tile and activation row 2 * tig + (c & 1) of the n-tile; gate/up
// tiles hold the gate rows in m-tile 0 and the same up rows in m-tile 1.
template <int MODE, int BN>
__device__ __forceinline__ void mmq_write(const float (&acc)[2][BN / 16][4], int wm, int wn,
                                          int gid, int tig, int num_rows, int p0, int n0, int N,
                                          const int *__restrict__ out_rows,
                                          const float *__restrict__ bias, float *__restrict__ Y,
                                          int ldy) {
#pragma unroll
    for (int j = 0; j < BN / 16; j++) {
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int local = wn * (BN / 2) + 8 * j + 2 * tig + h;
            if (local >= num_rows) continue;
            const int p = p0 + local;
            float *y = Y + (long long)(out_rows ? out_rows[p] : p) * ldy;
#pragma unroll
            for (int half = 0; half < 2; half++) {
                const int c = 2 * half + h;
                if (MODE == MODE_GATEUP) {
                    const int n = n0 + wm * 16 + gid + 8 * half;
                    if (n < N) y[n] = silu(acc[0][j][c]) * acc[1][j][c];
                } else {
#pragma unroll
                    for (int i = 0; i < 2; i++) {
                        const int n = n0 + wm * 32 + i * 16 + gid + 8 * half;
                        if (n >= N) continue;
                        if (MODE == MODE_STORE) y[n] = bias ? acc[i][j][c] + bias[n] : acc[i][j][c];
                        else y[n] += acc[i][j][c];
                    }
                }
            }
        }
    }
}

#define MMQ_PASS W, W2, wtab, wtab2, row_bytes, N, K, xq, xd, groups, num_groups, act_rows,        \
                 out_rows, bias, Y, ldy, blockIdx.x
// The entry points of one tile family: BODY<QT, MODE, BN, RAW> (mmq.cu's mmq_body, mmq_k.cu's
// mmqk_body) as store, add, gate/up and fused q/k/v kernels.
// mmq64_*: tiles of 64 activation rows (dense products of long windows); mmq32_*: tiles of 32
// (grouped experts: ~32 rows per expert in a 512-row prompt of 128 experts, top-8; dense
// products whose 64-row tiles would leave the GPU's multiprocessors idle)
#define MMQ_TILE_KERNELS(BODY, NAME, QT, BN, TAG, RAW)                                              \
    extern "C" __global__ void __launch_bounds__(MMQ_THREADS)                                       \
        mmq##BN##TAG##_store_##NAME(MM_ARGS) {                                                      \
        kernel_entry();                                                                             \
        BODY<QT, MODE_STORE, BN, RAW>(MMQ_PASS);                                                \
    }                                                                                               \
    extern "C" __global__ void __launch_bounds__(MMQ_THREADS) mmq##BN##TAG##_add_##NAME(MM_ARGS) {  \
        kernel_entry();                                                                             \
        BODY<QT, MODE_ADD, BN, RAW>(MMQ_PASS);                                                  \
    }                                                                                               \
    extern "C" __global__ void __launch_bounds__(MMQ_THREADS)                                       \
        mmq##BN##TAG##_gateup_##NAME(MM_ARGS) {                                                     \
        kernel_entry();                                                                             \
        BODY<QT, MODE_GATEUP, BN, RAW>(MMQ_PASS);                                               \
    }                                                                                               \
    extern "C" __global__ void __launch_bounds__(MMQ_THREADS)                                       \
        mmq##BN##TAG##_qkv_##NAME(QKV_ARGS) {                                                       \
        kernel_entry();                                                                             \
        const int nbq = (Nq + MMQ_BM - 1) / MMQ_BM, nbkv = (Nkv + MMQ_BM - 1) / MMQ_BM;             \
        const int bx = blockIdx.x;                                                                  \
        if (bx < nbq)                                                                               \
            BODY<QT, MODE_STORE, BN, RAW>(Wq, Wq, nullptr, nullptr, row_bytes, Nq, K, xq, xd,   \
                                         groups, num_groups, nullptr, nullptr, bq, Yq, Nq, bx);     \
        else if (bx < nbq + nbkv)                                                                   \
            BODY<QT, MODE_STORE, BN, RAW>(Wk, Wk, nullptr, nullptr, row_bytes, Nkv, K, xq, xd,  \
                                         groups, num_groups, nullptr, nullptr, bk, Yk, Nkv,         \
                                         bx - nbq);                                                 \
        else                                                                                        \
            BODY<QT, MODE_STORE, BN, RAW>(Wv, Wv, nullptr, nullptr, row_bytes, Nkv, K, xq, xd,  \
                                         groups, num_groups, nullptr, nullptr, bv, Yv, Nkv,         \
                                         bx - nbq - nbkv);                                          \
    }
