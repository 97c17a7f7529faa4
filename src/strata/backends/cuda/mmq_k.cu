// Products for prompt-sized windows of k-quant weights (Q2_K .. Q6_K and IQ4_XS: the types of
// the Q4_K_M, Q5_K_M, Q6_K, Q3_K_M, Q2_K and IQ4_XS files users download; the grid i-quants
// IQ1_S .. IQ3_S alike, common.cuh's iq_group) on int8 tensor cores. mmq.cu's arguments, block
// tile (64 weight rows) and mma fragments; tiles of 32 activation rows only (the staging below
// leaves no room in 48 KB of shared memory for 64).
//
// Legend: N = weight rows (outputs), K = columns (a multiple of 256), P = activation rows of a
// group, BN = activation rows per tile, QB = bytes of one super-block (256 columns).
// A k-tile is one super-block of every weight row of the tile:
//   1. its bytes land in shared memory by aligned 16-byte loads (sraw [64, RAW_LD]; a
//      super-block starts at any even address, so a row's copy begins o = address % 16 bytes
//      into its first piece; an aligned piece that holds a byte of the block never crosses a
//      page, so reading its other bytes cannot fault),
//   2. each (row, 32-column block) is unpacked from there into int8 values (sw [64, 256]) and
//      float scales (swd: one per 32 columns for Q4_K / Q5_K / IQ4_XS / IQ2_XXS / IQ3_XXS /
//      IQ3_S / IQ1_S, one per 16 for Q2_K, Q3_K, Q6_K, IQ2_XS, IQ2_S and IQ1_M) and mins
//      (swm, Q2_K / Q4_K / Q5_K: w = a * s - b, s >= 0),
//   3. one mma per 32 columns (scale per 32: m16n8k32) or two (m16n8k16 per 16-column group,
//      whose scales differ), each int32 result exact; an output accumulates
//      (float)s * (a * dx) (- (float)sum(q) * (b * dx)) over its groups in increasing k order
//      in one thread, so a row's result does not depend on its tile or its window's other rows.
// The values match common.cuh's decode_group (matmul.cu's dp4a kernels) and the CPU's
// unpacking bit for bit; only the float sums' order differs.
#include "mmq.cuh"

#define MMQK_BN 32

// super-block bytes, scales per 16 columns (else per 32), mins
template <int QT> struct KQuant {  // the grid i-quants (common.cuh's IqGrid)
    static_assert(is_iq_grid_type(QT), "a 256-column type");
    static constexpr int bytes = IqGrid<QT>::bytes, per16 = IqGrid<QT>::per16, min = 0;
};
template <> struct KQuant<ST_Q2_K> { static constexpr int bytes = 84, per16 = 1, min = 1; };
template <> struct KQuant<ST_Q3_K> { static constexpr int bytes = 110, per16 = 1, min = 0; };
template <> struct KQuant<ST_Q4_K> { static constexpr int bytes = 144, per16 = 0, min = 1; };
template <> struct KQuant<ST_Q5_K> { static constexpr int bytes = 176, per16 = 0, min = 1; };
template <> struct KQuant<ST_Q6_K> { static constexpr int bytes = 210, per16 = 1, min = 0; };
template <> struct KQuant<ST_IQ4_XS> { static constexpr int bytes = 136, per16 = 0, min = 0; };

// mmq.cu's mmq_body for k-quants (BN = MMQK_BN; RAW is unused: the staging is always raw).
template <int QT, int MODE, int BN, bool RAW>
__device__ __forceinline__ void mmqk_body(MM_BODY_PARAMS) {
    static_assert(BN == MMQK_BN, "k-quant tiles hold 32 activation rows");
    constexpr int NT = BN / 16;                                      // n8 tiles per warp
    constexpr int QB = KQuant<QT>::bytes, PER16 = KQuant<QT>::per16, HAS_MIN = KQuant<QT>::min;
    constexpr int PIECES = (QB + 14 + 15) / 16;  // 16-byte pieces of a block at offset <= 14
    constexpr int RAW_LD = 16 * PIECES;
    constexpr int SCALES = PER16 ? 2 : 1;        // scales (and mins) per 32-column block
    __shared__ __align__(16) int8_t sw[MMQ_BM * MMQ_LDS];   // [64, 256] weights as int8
    __shared__ __align__(16) int8_t sx[BN * MMQ_LDS];       // [BN, 256] activations
    __shared__ __align__(16) uint8_t sraw[MMQ_BM * RAW_LD];  // [64, RAW_LD] raw super-blocks
    __shared__ float swd[MMQ_BM * MMQ_KB * SCALES], swm[HAS_MIN ? MMQ_BM * MMQ_KB * SCALES : 1];
    __shared__ float sxd[BN * MMQ_KB];
    __shared__ int sxs[HAS_MIN ? BN * MMQ_KB * SCALES : 1];  // sum of the q of each group

    const MmqTile<BN, MODE> tile(W, W2, wtab, wtab2, row_bytes, N, K, xq, xd, groups, num_groups,
                                 act_rows, out_rows, bias, Y, ldy, block_x);
    if (!tile.valid) return;
    const int num_rows = tile.num_rows, p0 = tile.p0, tid = tile.tid;
    const int gid = tile.gid, tig = tile.tig;
    const int num_ktiles = K >> 8, num_kblocks = K >> 5;
    auto weight_row = [&](int r) { return tile.weight_row(r); };
    // staging units, fixed over k: raw piece u = (row u / PIECES, piece u % PIECES); unpack
    // unit u = (row u / 8, block u % 8); activation unit u = (row u / 8, block u % 8)
    constexpr int RU = (MMQ_BM * PIECES + MMQ_THREADS - 1) / MMQ_THREADS;
    constexpr int UU = MMQ_BM * MMQ_KB / MMQ_THREADS, XU = BN * MMQ_KB / MMQ_THREADS;
    const uint8_t *psrc[RU];
#pragma unroll
    for (int i = 0; i < RU; i++)
        psrc[i] = weight_row(min((tid + i * MMQ_THREADS) / PIECES, MMQ_BM - 1));
    int uoff[UU];  // address % 16 of each unpack unit's row start
#pragma unroll
    for (int i = 0; i < UU; i++)
        uoff[i] = (int)(reinterpret_cast<size_t>(weight_row((tid + i * MMQ_THREADS) / MMQ_KB))
                        & 15);
    long long xrow[XU];
    tile.act_rows_of(act_rows, xrow);
    float acc[2][NT][4] = {};

    // the next k-tile is read into registers while the current one is multiplied
    int4 wpiece[RU];
    int4 xraw[XU][2];
    float xdr[XU];
    auto load = [&](int kt) {
#pragma unroll
        for (int i = 0; i < RU; i++) {
            const int u = tid + i * MMQ_THREADS, piece = u % PIECES;
            const uint8_t *p = psrc[i] + (long long)kt * QB;
            const int o = (int)(reinterpret_cast<size_t>(p) & 15);
            if (u < MMQ_BM * PIECES && 16 * piece < o + QB)  // a plain load: experts may sit
                wpiece[i] = *reinterpret_cast<const int4 *>(p - o + 16 * piece);  // in host RAM
        }
#pragma unroll
        for (int i = 0; i < XU; i++) {
            const int b = (tid + i * MMQ_THREADS) % MMQ_KB;
            const int4 *src =
                reinterpret_cast<const int4 *>(xq + xrow[i] * K + 256LL * kt + 32 * b);
            xraw[i][0] = src[0];
            xraw[i][1] = src[1];
            xdr[i] = xd[xrow[i] * num_kblocks + 8 * kt + b];
        }
    };
    auto store = [&]() {
#pragma unroll
        for (int i = 0; i < RU; i++) {
            const int u = tid + i * MMQ_THREADS;
            if (u < MMQ_BM * PIECES)  // pieces past a row's block hold bytes nobody reads
                *reinterpret_cast<int4 *>(sraw + (u / PIECES) * RAW_LD + 16 * (u % PIECES)) =
                    wpiece[i];
        }
#pragma unroll
        for (int i = 0; i < XU; i++) {
            const int u = tid + i * MMQ_THREADS, r = u / MMQ_KB, b = u % MMQ_KB;
            int4 *dst = reinterpret_cast<int4 *>(sx + r * MMQ_LDS + 32 * b);
            dst[0] = xraw[i][0];
            dst[1] = xraw[i][1];
            sxd[r * MMQ_KB + b] = xdr[i];
            if constexpr (HAS_MIN) {  // per 16 columns when the mins are, else per 32
                const int4 h0 = xraw[i][0], h1 = xraw[i][1];
                int s = __dp4a(0x01010101, h0.x, 0);
                s = __dp4a(0x01010101, h0.y, s);
                s = __dp4a(0x01010101, h0.z, s);
                s = __dp4a(0x01010101, h0.w, s);
                int s2 = PER16 ? 0 : s;
                s2 = __dp4a(0x01010101, h1.x, s2);
                s2 = __dp4a(0x01010101, h1.y, s2);
                s2 = __dp4a(0x01010101, h1.z, s2);
                s2 = __dp4a(0x01010101, h1.w, s2);
                if constexpr (PER16) sxs[(r * MMQ_KB + b) * 2] = s;
                sxs[(r * MMQ_KB + b) * SCALES + SCALES - 1] = s2;
            }
        }
    };
    auto unpack = [&](int kt) {  // sraw -> sw, swd, swm (between two barriers)
#pragma unroll
        for (int i = 0; i < UU; i++) {
            const int u = tid + i * MMQ_THREADS, r = u / MMQ_KB, b = u % MMQ_KB;
            const uint8_t *blk = sraw + r * RAW_LD + ((uoff[i] + kt * QB) & 15);
            int v[8];
            float a[2], m[2];
            unpack_k_block<QT>(blk, b, v, a, m);
            int4 *dst = reinterpret_cast<int4 *>(sw + r * MMQ_LDS + 32 * b);
            dst[0] = make_int4(v[0], v[1], v[2], v[3]);
            dst[1] = make_int4(v[4], v[5], v[6], v[7]);
#pragma unroll
            for (int h = 0; h < SCALES; h++) {
                swd[(r * MMQ_KB + b) * SCALES + h] = a[h];
                if constexpr (HAS_MIN) swm[(r * MMQ_KB + b) * SCALES + h] = m[h];
            }
        }
    };

    load(0);
    for (int kt = 0; kt < num_ktiles; kt++) {
        store();
        __syncthreads();
        unpack(kt);
        __syncthreads();
        if (kt + 1 < num_ktiles) load(kt + 1);
        // ---- per 32-column block: the mma(s) of each (m-tile, n-tile), scaled into the sums
#pragma unroll 1
        for (int kb = 0; kb < MMQ_KB; kb++) {
            int a[2][4];
            float dw[2][2][SCALES], mw[2][2][SCALES];
#pragma unroll
            for (int i = 0; i < 2; i++) {
                tile.load_a(sw, i, kb, a[i]);
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const int unit = (tile.m_row(i) + gid + 8 * h) * MMQ_KB + kb;
#pragma unroll
                    for (int s = 0; s < SCALES; s++) {
                        dw[i][h][s] = swd[unit * SCALES + s];
                        mw[i][h][s] = 0.0f;
                        if constexpr (HAS_MIN) mw[i][h][s] = swm[unit * SCALES + s];
                    }
                }
            }
#pragma unroll
            for (int j = 0; j < NT; j++) {
                int b0, b1;
                const int cb = tile.load_b(sx, j, kb, b0, b1);
                const float dx[2] = {sxd[(cb + 2 * tig) * MMQ_KB + kb],
                                     sxd[(cb + 2 * tig + 1) * MMQ_KB + kb]};
                float qsum[2][SCALES] = {};  // [activation row 2 tig + t][group]
                if constexpr (HAS_MIN) {
#pragma unroll
                    for (int t = 0; t < 2; t++)
#pragma unroll
                        for (int h = 0; h < SCALES; h++)
                            qsum[t][h] = exact_float(
                                sxs[((cb + 2 * tig + t) * MMQ_KB + kb) * SCALES + h]);
                }
#pragma unroll
                for (int i = 0; i < 2; i++) {
                    // s[c]: weight row gid + 8 (c >> 1), activation row 2 tig + (c & 1)
                    if constexpr (PER16) {
                        int lo[4], hi[4];
                        mma_s8_k16(lo, a[i][0], a[i][1], b0);
                        mma_s8_k16(hi, a[i][2], a[i][3], b1);
#pragma unroll
                        for (int c = 0; c < 4; c++) {
                            const int h = c >> 1, t = c & 1;
                            acc[i][j][c] = fmaf(exact_float(lo[c]), dw[i][h][0] * dx[t],
                                                acc[i][j][c]);
                            if constexpr (HAS_MIN)
                                acc[i][j][c] = fmaf(qsum[t][0], -(mw[i][h][0] * dx[t]),
                                                    acc[i][j][c]);
                            acc[i][j][c] = fmaf(exact_float(hi[c]), dw[i][h][SCALES - 1] * dx[t],
                                                acc[i][j][c]);
                            if constexpr (HAS_MIN)
                                acc[i][j][c] = fmaf(qsum[t][SCALES - 1],
                                                    -(mw[i][h][SCALES - 1] * dx[t]), acc[i][j][c]);
                        }
                    } else {
                        int s[4];
                        mma_s8(s, a[i], b0, b1);
#pragma unroll
                        for (int c = 0; c < 4; c++) {
                            const int h = c >> 1, t = c & 1;
                            acc[i][j][c] = fmaf(exact_float(s[c]), dw[i][h][0] * dx[t],
                                                acc[i][j][c]);
                            if constexpr (HAS_MIN)
                                acc[i][j][c] = fmaf(qsum[t][0], -(mw[i][h][0] * dx[t]),
                                                    acc[i][j][c]);
                        }
                    }
                }
            }
        }
        __syncthreads();
    }
    mmq_write<MODE, BN>(acc, tile.wm, tile.wn, gid, tig, num_rows, p0, tile.n0, N, out_rows,
                        bias, Y, ldy);
}

MMQ_TILE_KERNELS(mmqk_body, q2_k, ST_Q2_K, 32, , false)
MMQ_TILE_KERNELS(mmqk_body, q3_k, ST_Q3_K, 32, , false)
MMQ_TILE_KERNELS(mmqk_body, q4_k, ST_Q4_K, 32, , false)
MMQ_TILE_KERNELS(mmqk_body, q5_k, ST_Q5_K, 32, , false)
MMQ_TILE_KERNELS(mmqk_body, q6_k, ST_Q6_K, 32, , false)
MMQ_TILE_KERNELS(mmqk_body, iq4_xs, ST_IQ4_XS, 32, , false)
MMQ_TILE_KERNELS(mmqk_body, iq2_xxs, ST_IQ2_XXS, 32, , false)
MMQ_TILE_KERNELS(mmqk_body, iq2_xs, ST_IQ2_XS, 32, , false)
MMQ_TILE_KERNELS(mmqk_body, iq2_s, ST_IQ2_S, 32, , false)
MMQ_TILE_KERNELS(mmqk_body, iq3_xxs, ST_IQ3_XXS, 32, , false)
MMQ_TILE_KERNELS(mmqk_body, iq3_s, ST_IQ3_S, 32, , false)
MMQ_TILE_KERNELS(mmqk_body, iq1_s, ST_IQ1_S, 32, , false)
MMQ_TILE_KERNELS(mmqk_body, iq1_m, ST_IQ1_M, 32, , false)
