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

// One block's tile: outputs n0 .. n0 + OUTS of tile x, rows row0 .. of group g (find_tile), the
// matrices it reads (expert e's at wtab[e] / wtab2[e] for grouped products), and this thread's
// place: warp (wm, wn) computes two m16 tiles of weight rows x BN/2 activation rows, lane =
// (gid, tig) of the mma fragments. valid is false when the block has nothing to do.
template <int BN, int MODE>
struct MmqTile {
    static constexpr int OUTS = MODE == MODE_GATEUP ? MMQ_BM / 2 : MMQ_BM;  // outputs per block
    bool valid;
    int n0, num_rows, p0, tid, wm, wn, gid, tig;
    const uint8_t *base, *base2;
    long long row_bytes;
    int N;

    __device__ __forceinline__ MmqTile(MM_BODY_PARAMS) : row_bytes(row_bytes), N(N) {
        int g, row0;
        n0 = block_x * OUTS;
        valid = n0 < N && find_tile<BN>(groups, *num_groups, blockIdx.y, g, row0);
        if (!valid) return;
        const int first = groups[3 * g + 1], count = groups[3 * g + 2];
        const int expert = groups[3 * g];
        num_rows = min(BN, count - row0);
        p0 = first + row0;
        base = wtab ? reinterpret_cast<const uint8_t *>(wtab[expert]) : W;
        base2 = MODE != MODE_GATEUP ? base
                : wtab2 ? reinterpret_cast<const uint8_t *>(wtab2[expert]) : W2;
        tid = threadIdx.x;
        const int lane = tid & 31, warp = tid >> 5;
        wm = warp & 1;
        wn = warp >> 1;
        gid = lane >> 2;
        tig = lane & 3;
    }

    // weight row r (0 .. 63) of the tile: gate/up tiles hold OUTS gate rows, then the same up
    // rows; rows past N repeat the last one
    __device__ __forceinline__ const uint8_t *weight_row(int r) const {
        const int local = MODE == MODE_GATEUP ? r % OUTS : r;
        const uint8_t *m = MODE == MODE_GATEUP && r >= OUTS ? base2 : base;
        return m + (long long)min(n0 + local, N - 1) * row_bytes;
    }

    // the activation rows of this thread's staging units u = tid + i * MMQ_THREADS: row u / KB
    // of the tile (rows past the group's repeat its last), through act_rows when given
    template <int XU>
    __device__ __forceinline__ void act_rows_of(const int *__restrict__ act_rows,
                                                long long (&xrow)[XU]) const {
#pragma unroll
        for (int i = 0; i < XU; i++) {
            const int p = p0 + min((tid + i * MMQ_THREADS) / MMQ_KB, num_rows - 1);
            xrow[i] = act_rows ? act_rows[p] : p;
        }
    }

    // the first weight row of m-tile i (gate/up: the gate tile, then the up tile)
    __device__ __forceinline__ int m_row(int i) const {
        return MODE == MODE_GATEUP ? i * 32 + wm * 16 : wm * 32 + i * 16;
    }

    // the a fragment of m-tile i at 32-column block kb of sw [64, MMQ_LDS]
    __device__ __forceinline__ void load_a(const int8_t *sw, int i, int kb, int (&a)[4]) const {
        const int8_t *s0 = sw + (m_row(i) + gid) * MMQ_LDS + 32 * kb + 4 * tig;
        const int8_t *s1 = s0 + 8 * MMQ_LDS;
        a[0] = *reinterpret_cast<const int *>(s0);
        a[1] = *reinterpret_cast<const int *>(s1);
        a[2] = *reinterpret_cast<const int *>(s0 + 16);
        a[3] = *reinterpret_cast<const int *>(s1 + 16);
    }

    // the b fragment of n-tile j at block kb of sx [BN, MMQ_LDS]; cb = its first row
    __device__ __forceinline__ int load_b(const int8_t *sx, int j, int kb, int &b0,
                                          int &b1) const {
        const int cb = wn * (BN / 2) + 8 * j;
        const int8_t *x0 = sx + (cb + gid) * MMQ_LDS + 32 * kb + 4 * tig;
        b0 = *reinterpret_cast<const int *>(x0);
        b1 = *reinterpret_cast<const int *>(x0 + 16);
        return cb;
    }
};

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
