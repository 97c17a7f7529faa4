// Products for prompt-sized windows: int8 tensor-core tiles (mma.sync m16n8k32) for weights of
// 32-column blocks (Q4_0, Q8_0, Q4_1, Q5_0, Q5_1, IQ4_NL) meeting 8-bit activations, and a
// shared-memory tiled float kernel for F32/F16/BF16 (the router). Same arguments as matmul.cu's
// mm_* kernels; plan.py picks these from R rows on.
//
// Legend: N = weight rows (outputs), K = columns, P = activation rows of a group (pairs),
// BM = weight rows per block tile, BN = activation rows per block tile, KB = quant blocks of 32
// columns per k-tile. One mma k-step is one 32-value block of both operands: its int32 result
// is exact, and each output accumulates (float)s * (d_w * d_x) over its blocks in increasing
// k order in one thread, so a row's result does not depend on the tile it lands in or on the
// other rows of its window. Q4_1 / Q5_1 (w = d * q + m) add the min term: each activation
// block's sum of q is taken once as the block is staged (sxs), and an output adds
// -(b * d_x) * sum(q) (b = -m, common.cuh's Block32) right after the block's product term.
#include "mmq.cuh"

#define MMQ_RAW_ROW (MMQ_KB * 18)    // bytes of one weight row's k-tile of Q4_0 blocks (RAW)
#define MMF_OUTS 32                  // float kernel: 32 outputs x 16 rows per block,
#define MMF_ROWS 16                  // 64 columns per step
#define MMF_KC 64
#define MMF_THREADS 128

// a block's bytes, the offsets of its quant words (qs) and fifth bits (qh; 0: none), a min
template <int QT> struct BlockBytes {  // Q4_1, Q5_0, Q5_1, IQ4_NL: common.cuh's Block32
    static constexpr int value = Block32<QT>::bytes, qs = Block32<QT>::qs, qh = Block32<QT>::qh;
    static constexpr int min = Block32<QT>::min;
};
template <> struct BlockBytes<ST_Q4_0> {
    static constexpr int value = 18, qs = 2, qh = 0, min = 0;
};
template <> struct BlockBytes<ST_Q8_0> {
    static constexpr int value = 34, qs = 2, qh = 0, min = 0;
};

// groups: [G, 3] (expert, first pair, pair count), *num_groups in use (dense products: one group
// of all rows). Block (x, y) computes the output columns of tile x for tile slot y (a tile of BN
// rows of one group, find_tile). Grouped products read expert e's matrix at wtab[e] (W2's at
// wtab2[e]); dense ones (wtab NULL) read W. Pair p reads activation row act_rows[p] (p when NULL)
// and writes output row out_rows[p] (p when NULL). Warp (wm, wn) computes two m16 tiles of weight
// rows x BN/2 activation rows; gate/up tiles hold 32 gate rows then the same 32 up rows, and a
// warp's two m-tiles are one gate and one up tile, so SiLU(gate) * up happens in registers.
template <int QT, int MODE, int BN, bool RAW>
__device__ __forceinline__ void mmq_body(MM_BODY_PARAMS) {
    constexpr int NT = BN / 16;                                    // n8 tiles per warp
    constexpr int QB = BlockBytes<QT>::value, QS = BlockBytes<QT>::qs, QH = BlockBytes<QT>::qh;
    constexpr bool HAS_MIN = BlockBytes<QT>::min;
    static_assert(!RAW || QT == ST_Q4_0, "RAW staging is Q4_0's");
    __shared__ __align__(16) int8_t sw[MMQ_BM * MMQ_LDS];  // [BM, KB * 32] weights as int8
    __shared__ __align__(16) int8_t sx[BN * MMQ_LDS];      // [BN, KB * 32] activations
    __shared__ float swd[MMQ_BM * MMQ_KB], sxd[BN * MMQ_KB];  // their block scales
    // Q4_1 / Q5_1: each weight block's b (= -m) and each activation block's sum of q
    __shared__ float swm[HAS_MIN ? MMQ_BM * MMQ_KB : 1];
    __shared__ int sxs[HAS_MIN ? BN * MMQ_KB : 1];
    // RAW (Q4_0, K % 256 == 0): each weight row's k-tile (MMQ_KB blocks, MMQ_RAW_ROW bytes,
    // 16-byte aligned) lands here by 16-byte loads, then is unpacked into sw
    __shared__ __align__(16) int8_t sraw[RAW ? MMQ_BM * MMQ_RAW_ROW : 16];

    const MmqTile<BN, MODE> tile(W, W2, wtab, wtab2, row_bytes, N, K, xq, xd, groups, num_groups,
                                 act_rows, out_rows, bias, Y, ldy, block_x);
    if (!tile.valid) return;
    const int num_rows = tile.num_rows, p0 = tile.p0, tid = tile.tid;
    const int num_kblocks = K >> 5;

    // rows of this thread's staging work, fixed over k: weight rows and activation rows.
    // Not RAW: unit u = (row u / KB, block u % KB). RAW: unit u = (row u / PIECES, 16-byte
    // piece u % PIECES of the row's k-tile).
    auto weight_row = [&](int r) { return tile.weight_row(r); };
    constexpr int PIECES = MMQ_RAW_ROW / 16;
    constexpr int RU = (MMQ_BM * PIECES + MMQ_THREADS - 1) / MMQ_THREADS;  // pieces per thread
    constexpr int SRC = RAW ? RU : MMQ_BM * MMQ_KB / MMQ_THREADS;
    const uint8_t *wsrc[SRC];
#pragma unroll
    for (int i = 0; i < SRC; i++) {
        const int u = tid + i * MMQ_THREADS;
        if (RAW)
            wsrc[i] = weight_row(min(u / PIECES, MMQ_BM - 1)) + 16 * (u % PIECES);
        else
            wsrc[i] = weight_row(u / MMQ_KB);
    }
    long long xrow[BN * MMQ_KB / MMQ_THREADS];
    tile.act_rows_of(act_rows, xrow);
    float acc[2][NT][4] = {};

    // The next k-tile is read into registers while the current one is multiplied, so global
    // latency overlaps the mma work: raw weight words + scale, activation int4s + scale.
    constexpr int WU = MMQ_BM * MMQ_KB / MMQ_THREADS, XU = BN * MMQ_KB / MMQ_THREADS;
    constexpr int WWORDS = QT == ST_Q8_0 ? 8 : 4;  // words of int8 (Q8_0), else of nibbles
    uint32_t wraw[RAW ? 1 : WU][WWORDS];
    int4 wpiece[RAW ? RU : 1];
    float wdr[WU], xdr[XU];
    float wmr[HAS_MIN ? WU : 1];    // Q4_1 / Q5_1: the blocks' m
    uint32_t wqh[QH ? WU : 1];      // Q5_0 / Q5_1: their fifth bits
    int4 xraw[XU][2];
    auto load = [&](int kb0, int nkb) {
        if constexpr (RAW) {  // nkb == MMQ_KB: K % 256 == 0
#pragma unroll
            for (int i = 0; i < RU; i++)
                if (tid + i * MMQ_THREADS < MMQ_BM * PIECES)
                    wpiece[i] =  // a plain load: experts may sit in mapped host memory
                        *reinterpret_cast<const int4 *>(wsrc[i] + (long long)kb0 * QB);
        } else {
#pragma unroll
            for (int i = 0; i < WU; i++) {
                const int b = (tid + i * MMQ_THREADS) % MMQ_KB;
                if (b < nkb) {
                    const uint8_t *blk = wsrc[i] + (long long)(kb0 + b) * QB;
                    wdr[i] = read_f16(blk);
                    if constexpr (HAS_MIN) wmr[i] = read_f16(blk + 2);
                    if constexpr (QH != 0) wqh[i] = read_u32_a2(blk + QH);
#pragma unroll
                    for (int w = 0; w < WWORDS; w++) wraw[i][w] = read_u32_a2(blk + QS + 4 * w);
                }
            }
        }
#pragma unroll
        for (int i = 0; i < XU; i++) {
            const int b = (tid + i * MMQ_THREADS) % MMQ_KB;
            if (b < nkb) {
                const int4 *src = reinterpret_cast<const int4 *>(
                    xq + xrow[i] * K + 32LL * (kb0 + b));
                xraw[i][0] = src[0];
                xraw[i][1] = src[1];
                xdr[i] = xd[xrow[i] * num_kblocks + kb0 + b];
            }
        }
    };
    // block b of weight row r into sw / swd from its scale and 16 bytes of nibbles (Q4_0)
    auto put_q4 = [&](int r, int b, float d, const uint32_t (&w4)[4]) {
        int4 *dst = reinterpret_cast<int4 *>(sw + r * MMQ_LDS + 32 * b);
        int lo[4], hi[4];  // low nibbles: columns 0-15, high: 16-31; value - 8
#pragma unroll
        for (int w = 0; w < 4; w++) {
            lo[w] = nibbles_minus_8(w4[w]);
            hi[w] = nibbles_minus_8(w4[w] >> 4);
        }
        dst[0] = make_int4(lo[0], lo[1], lo[2], lo[3]);
        dst[1] = make_int4(hi[0], hi[1], hi[2], hi[3]);
        swd[r * MMQ_KB + b] = d;
    };
    // RAW: the staged k-tile -> sw / swd (between two barriers)
    auto unpack_raw = [&]() {
#pragma unroll
        for (int i = 0; i < WU; i++) {
            const int u = tid + i * MMQ_THREADS, r = u / MMQ_KB, b = u % MMQ_KB;
            const uint16_t *h =  // the block: fp16 scale, 16 bytes of nibbles (2-byte aligned)
                reinterpret_cast<const uint16_t *>(sraw + r * MMQ_RAW_ROW + QB * b);
            uint32_t w4[4];
#pragma unroll
            for (int w = 0; w < 4; w++)
                w4[w] = (uint32_t)h[1 + 2 * w] | ((uint32_t)h[2 + 2 * w] << 16);
            put_q4(r, b, __half2float(*reinterpret_cast<const __half *>(h)), w4);
        }
    };
    auto store = [&](int nkb) {
        if constexpr (RAW) {
#pragma unroll
            for (int i = 0; i < RU; i++) {
                const int u = tid + i * MMQ_THREADS;
                if (u < MMQ_BM * PIECES)
                    *reinterpret_cast<int4 *>(sraw + (u / PIECES) * MMQ_RAW_ROW +
                                              16 * (u % PIECES)) = wpiece[i];
            }
        } else {
#pragma unroll
            for (int i = 0; i < WU; i++) {
                const int u = tid + i * MMQ_THREADS, r = u / MMQ_KB, b = u % MMQ_KB;
                if (b >= nkb) continue;
                if constexpr (QT == ST_Q4_0) {
                    put_q4(r, b, wdr[i], wraw[i]);
                } else if constexpr (QT == ST_Q8_0) {
                    int4 *dst = reinterpret_cast<int4 *>(sw + r * MMQ_LDS + 32 * b);
                    dst[0] = make_int4(wraw[i][0], wraw[i][1], wraw[i][2], wraw[i][3]);
                    dst[1] = make_int4(wraw[i][WWORDS - 4], wraw[i][WWORDS - 3],
                                       wraw[i][WWORDS - 2], wraw[i][WWORDS - 1]);
                    swd[r * MMQ_KB + b] = wdr[i];
                } else {  // Q4_1, Q5_0, Q5_1, IQ4_NL: common.cuh's Block32 values
                    uint32_t qh = 0;
                    if constexpr (QH != 0) qh = wqh[i];
                    int lo[4], hi[4];
#pragma unroll
                    for (int w = 0; w < 4; w++) {
                        lo[w] = block32_word<QT>(wraw[i][w], qh, 0, w);
                        hi[w] = block32_word<QT>(wraw[i][w], qh, 1, w);
                    }
                    int4 *dst = reinterpret_cast<int4 *>(sw + r * MMQ_LDS + 32 * b);
                    dst[0] = make_int4(lo[0], lo[1], lo[2], lo[3]);
                    dst[1] = make_int4(hi[0], hi[1], hi[2], hi[3]);
                    swd[r * MMQ_KB + b] = wdr[i];
                    if constexpr (HAS_MIN) swm[r * MMQ_KB + b] = -wmr[i];
                }
            }
        }
#pragma unroll
        for (int i = 0; i < XU; i++) {
            const int u = tid + i * MMQ_THREADS, r = u / MMQ_KB, b = u % MMQ_KB;
            if (b < nkb) {
                int4 *dst = reinterpret_cast<int4 *>(sx + r * MMQ_LDS + 32 * b);
                dst[0] = xraw[i][0];
                dst[1] = xraw[i][1];
                sxd[r * MMQ_KB + b] = xdr[i];
                if constexpr (HAS_MIN) {
                    const int4 h0 = xraw[i][0], h1 = xraw[i][1];
                    int sq = __dp4a(0x01010101, h0.x, 0);
                    sq = __dp4a(0x01010101, h0.y, sq);
                    sq = __dp4a(0x01010101, h0.z, sq);
                    sq = __dp4a(0x01010101, h0.w, sq);
                    sq = __dp4a(0x01010101, h1.x, sq);
                    sq = __dp4a(0x01010101, h1.y, sq);
                    sq = __dp4a(0x01010101, h1.z, sq);
                    sq = __dp4a(0x01010101, h1.w, sq);
                    sxs[r * MMQ_KB + b] = sq;
                }
            }
        }
    };

    load(0, min(MMQ_KB, num_kblocks));
    for (int kb0 = 0; kb0 < num_kblocks; kb0 += MMQ_KB) {
        const int nkb = min(MMQ_KB, num_kblocks - kb0);
        store(nkb);
        __syncthreads();
        if constexpr (RAW) {  // sraw -> sw, which the previous tile's mma no longer reads
            unpack_raw();
            __syncthreads();
        }
        if (kb0 + MMQ_KB < num_kblocks)
            load(kb0 + MMQ_KB, min(MMQ_KB, num_kblocks - kb0 - MMQ_KB));
        // ---- one mma per (m-tile, n-tile) and block, scaled into the float sums
        for (int kb = 0; kb < nkb; kb++) {
            int a[2][4];
            float dw[2][2], mw[2][2] = {};
            const int gid = tile.gid, tig = tile.tig;
#pragma unroll
            for (int i = 0; i < 2; i++) {
                tile.load_a(sw, i, kb, a[i]);
                dw[i][0] = swd[(tile.m_row(i) + gid) * MMQ_KB + kb];
                dw[i][1] = swd[(tile.m_row(i) + gid + 8) * MMQ_KB + kb];
                if constexpr (HAS_MIN) {
                    mw[i][0] = swm[(tile.m_row(i) + gid) * MMQ_KB + kb];
                    mw[i][1] = swm[(tile.m_row(i) + gid + 8) * MMQ_KB + kb];
                }
            }
#pragma unroll
            for (int j = 0; j < NT; j++) {
                int b0, b1;
                const int cb = tile.load_b(sx, j, kb, b0, b1);
                const float dx0 = sxd[(cb + 2 * tig) * MMQ_KB + kb];
                const float dx1 = sxd[(cb + 2 * tig + 1) * MMQ_KB + kb];
#pragma unroll
                for (int i = 0; i < 2; i++) {
                    int s[4];
                    mma_s8(s, a[i], b0, b1);
                    // s[0]: (row gid, col 2t), s[1]: (gid, 2t+1), s[2]/s[3]: rows gid + 8
                    acc[i][j][0] = fmaf(exact_float(s[0]), dw[i][0] * dx0, acc[i][j][0]);
                    acc[i][j][1] = fmaf(exact_float(s[1]), dw[i][0] * dx1, acc[i][j][1]);
                    acc[i][j][2] = fmaf(exact_float(s[2]), dw[i][1] * dx0, acc[i][j][2]);
                    acc[i][j][3] = fmaf(exact_float(s[3]), dw[i][1] * dx1, acc[i][j][3]);
                    if constexpr (HAS_MIN) {  // - b * dx * sum(q), b = -m
                        const float q0 = exact_float(sxs[(cb + 2 * tig) * MMQ_KB + kb]);
                        const float q1 = exact_float(sxs[(cb + 2 * tig + 1) * MMQ_KB + kb]);
                        acc[i][j][0] = fmaf(q0, -(mw[i][0] * dx0), acc[i][j][0]);
                        acc[i][j][1] = fmaf(q1, -(mw[i][0] * dx1), acc[i][j][1]);
                        acc[i][j][2] = fmaf(q0, -(mw[i][1] * dx0), acc[i][j][2]);
                        acc[i][j][3] = fmaf(q1, -(mw[i][1] * dx1), acc[i][j][3]);
                    }
                }
            }
        }
        __syncthreads();
    }
    mmq_write<MODE, BN>(acc, tile.wm, tile.wn, tile.gid, tile.tig, num_rows, p0, tile.n0, N,
                        out_rows, bias, Y, ldy);
}

// Float weights (F32 / F16 / BF16) meet float rows (the router of a quantised model): a tile of
// MMF_OUTS outputs x MMF_ROWS rows per block, 2 x 2 per thread, MMF_KC columns staged per step
// while the next step's columns are read into registers; each output sums its columns in
// increasing order from zero in one thread (its bits do not depend on the tile). Small tiles so
// a router's 128 outputs x 512 rows still make 128 blocks.
template <int QT, int MODE>
__device__ __forceinline__ void mmf_body(
    const uint8_t *__restrict__ W, long long row_bytes, int N, int K,
    const float *__restrict__ xf, const int *__restrict__ groups,
    const int *__restrict__ num_groups, const int *__restrict__ act_rows,
    const int *__restrict__ out_rows, const float *__restrict__ bias, float *__restrict__ Y,
    int ldy) {
    __shared__ float sw[MMF_OUTS][MMF_KC + 1], sx[MMF_ROWS][MMF_KC + 1];  // [32, 64], [16, 64]
    constexpr int WU = MMF_OUTS * MMF_KC / MMF_THREADS, XU = MMF_ROWS * MMF_KC / MMF_THREADS;
    constexpr int RSTEP = MMF_THREADS / MMF_KC;  // rows staged per pass
    const int g = blockIdx.y;
    if (g >= *num_groups) return;
    const int first = groups[3 * g + 1], count = groups[3 * g + 2];
    const int row0 = blockIdx.z * MMF_ROWS, n0 = blockIdx.x * MMF_OUTS;
    if (row0 >= count || n0 >= N) return;
    const int num_rows = min(MMF_ROWS, count - row0), p0 = first + row0;
    const int tid = threadIdx.x, tx = tid % (MMF_OUTS / 2), ty = tid / (MMF_OUTS / 2);
    // staging: thread reads column tid % MMF_KC of rows tid / MMF_KC + RSTEP * i
    const int sc = tid % MMF_KC, sr = tid / MMF_KC;
    const uint8_t *wsrc[WU];
    long long xrow[XU];
#pragma unroll
    for (int i = 0; i < WU; i++)
        wsrc[i] = W + (long long)min(n0 + sr + RSTEP * i, N - 1) * row_bytes;
#pragma unroll
    for (int i = 0; i < XU; i++) {
        const int p = p0 + min(sr + RSTEP * i, num_rows - 1);
        xrow[i] = (act_rows ? act_rows[p] : p) * (long long)K;
    }
    float wr[WU], xr[XU];
    auto load = [&](int k0) {
        const int col = k0 + sc;
        const bool in = col < K;
#pragma unroll
        for (int i = 0; i < WU; i++) wr[i] = in ? load_float_weight<QT>(wsrc[i], col) : 0.0f;
#pragma unroll
        for (int i = 0; i < XU; i++) xr[i] = in ? xf[xrow[i] + col] : 0.0f;
    };
    float acc[2][2] = {{0.0f, 0.0f}, {0.0f, 0.0f}};
    load(0);
    for (int k0 = 0; k0 < K; k0 += MMF_KC) {
        const int kc = min(MMF_KC, K - k0);
#pragma unroll
        for (int i = 0; i < WU; i++) sw[sr + RSTEP * i][sc] = wr[i];
#pragma unroll
        for (int i = 0; i < XU; i++) sx[sr + RSTEP * i][sc] = xr[i];
        __syncthreads();
        if (k0 + MMF_KC < K) load(k0 + MMF_KC);
        auto column = [&](int c) {  // column c of the step into the 2 x 2 sums
            const float w0 = sw[tx][c], w1 = sw[tx + MMF_OUTS / 2][c];
            const float x0 = sx[ty][c], x1 = sx[ty + MMF_ROWS / 2][c];
            acc[0][0] = fmaf(w0, x0, acc[0][0]);
            acc[0][1] = fmaf(w0, x1, acc[0][1]);
            acc[1][0] = fmaf(w1, x0, acc[1][0]);
            acc[1][1] = fmaf(w1, x1, acc[1][1]);
        };
        if (kc == MMF_KC) {
#pragma unroll 16
            for (int c = 0; c < MMF_KC; c++) column(c);
        } else {
            for (int c = 0; c < kc; c++) column(c);
        }
        __syncthreads();
    }
#pragma unroll
    for (int j = 0; j < 2; j++) {
        const int local = ty + (MMF_ROWS / 2) * j;
        if (local >= num_rows) continue;
        const int p = p0 + local;
        float *y = Y + (long long)(out_rows ? out_rows[p] : p) * ldy;
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const int n = n0 + tx + (MMF_OUTS / 2) * i;
            if (n >= N) continue;
            if (MODE == MODE_STORE) y[n] = bias ? acc[i][j] + bias[n] : acc[i][j];
            else y[n] += acc[i][j];
        }
    }
}

#define MMF_PASS W, row_bytes, N, K, xf, groups, num_groups, act_rows, out_rows, bias, Y, ldy
#define MMQ_KERNELS(NAME, QT)                                                                       \
    MMQ_TILE_KERNELS(mmq_body, NAME, QT, 64, , false)                                               \
    MMQ_TILE_KERNELS(mmq_body, NAME, QT, 32, , false)
// mmq64r_* / mmq32r_*: the same with RAW staging (Q4_0 weights whose K is a multiple of 256)

#define MMF_KERNELS(NAME, QT)                                                                       \
    extern "C" __global__ void __launch_bounds__(MMF_THREADS) mmf_store_##NAME(MM_ARGS) {           \
        kernel_entry();                                                                             \
        mmf_body<QT, MODE_STORE>(MMF_PASS);                                                         \
    }                                                                                               \
    extern "C" __global__ void __launch_bounds__(MMF_THREADS) mmf_add_##NAME(MM_ARGS) {             \
        kernel_entry();                                                                             \
        mmf_body<QT, MODE_ADD>(MMF_PASS);                                                           \
    }

MMQ_KERNELS(q4_0, ST_Q4_0)
MMQ_TILE_KERNELS(mmq_body, q4_0, ST_Q4_0, 64, r, true)
MMQ_TILE_KERNELS(mmq_body, q4_0, ST_Q4_0, 32, r, true)
MMQ_KERNELS(q8_0, ST_Q8_0)
MMQ_KERNELS(q4_1, ST_Q4_1)
MMQ_KERNELS(q5_0, ST_Q5_0)
MMQ_KERNELS(q5_1, ST_Q5_1)
MMQ_KERNELS(iq4_nl, ST_IQ4_NL)
MMF_KERNELS(f32, ST_F32)
MMF_KERNELS(f16, ST_F16)
MMF_KERNELS(bf16, ST_BF16)
