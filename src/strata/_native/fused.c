/* Decode-shaped dot products (1-3 tokens) straight from Q4_0 / Q8_0 blocks (AVX-512 VNNI or
 * AVX2) and, on AVX2 builds, from Q4_1 / Q5_0 / Q5_1 / IQ4_NL blocks: with no token to share an
 * unpacked row with, unpacking in registers beats a buffer. */
#include "quant.h"

#if defined(ST_USE_VNNI512) && defined(__F16C__)
#include "fused_f16.h"

/* 64 weight bytes (two blocks) as unsigned values for vpdpbusd, and the int32 lane shift that
 * turns sum(u * q) into sum(s * q): u = s + 8 for Q4_0 (so xc / 16), u = s + 128 for Q8_0. */
static inline __m512i q4_0_pair(const uint8_t *blk0, int has_second) {
    __m128i q0 = _mm_loadu_si128((const __m128i *)(blk0 + 2));
    __m128i q1 = has_second ? _mm_loadu_si128((const __m128i *)(blk0 + 20)) : _mm_setzero_si128();
    __m256i v = _mm256_set_m128i(q1, q0);                                   /* [q0 | q1] */
    __m256i low4 = _mm256_set1_epi8(0x0F);
    __m256i lo = _mm256_and_si256(v, low4);                                 /* [lo0 | lo1] */
    __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);           /* [hi0 | hi1] */
    __m512i u = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);      /* lo0 lo1 hi0 hi1 */
    return _mm512_shuffle_i64x2(u, u, _MM_SHUFFLE(3, 1, 2, 0));             /* lo0 hi0 lo1 hi1 */
}

static inline __m512i q8_0_pair(const uint8_t *blk0, int has_second) {
    __m256i a = _mm256_loadu_si256((const __m256i *)(blk0 + 2));
    __m256i b = has_second ? _mm256_loadu_si256((const __m256i *)(blk0 + 36))
                           : _mm256_set1_epi8((char)0x80);                  /* s = 0 */
    __m512i s = _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
    return _mm512_xor_si512(s, _mm512_set1_epi8((char)0x80));
}


ALWAYS_INLINE void fused_row(const int NC, int qtype, const uint8_t *row, int64_t ahead,
                             int cols, const st_act *act, const int64_t *tr, float *res) {
    const int ncp = act->cols_pad;
    const int is_q4 = qtype == ST_Q4_0;
    const int block_bytes = is_q4 ? 18 : 34;
    const int num_blocks = cols / 32;
    __m512 acc[3];
    const int8_t *q[3];
    const int32_t *xc[3];
    const float *dx[3];
    for (int c = 0; c < NC; c++) {
        acc[c] = _mm512_setzero_ps();
        q[c] = act->q + tr[c] * ncp;
        xc[c] = act->xc + tr[c] * (ncp / ST_LANE);
        dx[c] = act->dx + tr[c] * (ncp / ST_LANE);
    }
    for (int ib = 0; ib < num_blocks; ib += 2) {
        const uint8_t *blk = row + (int64_t)ib * block_bytes;
        /* every line of the pair `ahead`: one prefetch a turn left every 17th line of Q8_0's
         * 68 bytes to the hardware (one EPYC thread, 2,048 columns from RAM: 13.3 -> 18.1
         * GB/s, shuffled 11.6 -> 16.3; L2 36.2 -> 35.4) */
        st_prefetch(blk + ahead, 2 * block_bytes);
        const int has_second = ib + 1 < num_blocks;
        __m512i u = is_q4 ? q4_0_pair(blk, has_second) : q8_0_pair(blk, has_second);
        float d1 = has_second ? fp16_at(blk + block_bytes) : 0.0f;
        __m512 dw = _mm512_insertf32x8(_mm512_set1_ps(fp16_at(blk)), _mm256_set1_ps(d1), 1);
        const int k = ib * 32, lane = k / ST_LANE;
        for (int c = 0; c < NC; c++) {
            __m512i corr = _mm512_loadu_si512((const void *)(xc[c] + lane));   /* -128 sum q */
            if (is_q4) corr = _mm512_srai_epi32(corr, 4);                      /* -8 sum q */
            acc[c] = st_vnni_lane_acc(acc[c], corr, u,
                                      _mm512_loadu_si512((const void *)(q[c] + k)), dw,
                                      _mm512_loadu_ps(dx[c] + lane));
        }
    }
    for (int c = 0; c < NC; c++) res[c] = _mm512_reduce_add_ps(acc[c]);
}

#if defined(__AVX512VBMI__)
#define ST_FUSED_Q4_ROWS 1
/* Q4_0 for NR (1 or 4) weight rows at once, the activation loads shared between the rows: a
 * pair of blocks (64 columns, 36 bytes) comes in with one masked load (nothing read past the
 * pair), one vpermb puts each block's 16 quant bytes twice (for its low and its high nibbles),
 * one variable shift and a mask give the same unsigned values as q4_0_pair, and one vpermw +
 * vcvtph2ps the same scale lanes. The arithmetic after that is fused_row's, lane for lane, so
 * results are bit for bit those of fused_row and of the tiles. About half the vector uops per
 * byte of fused_row: the CPU pool's decode is compute bound without it. */
ALWAYS_INLINE void fused_q4_0_rows(const int NR, const int NC, const uint8_t *const *rows,
                                   int64_t ahead, int cols, const st_act *act,
                                   const int64_t *tr, float *res) {
    const int ncp = act->cols_pad;
    const int num_blocks = cols / 32;
    /* output byte i of a pair: quant byte (i % 16) of block (i / 32), at 2 + 18 * (i / 32) */
    const __m512i pick = _mm512_set_epi8(
        35, 34, 33, 32, 31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20,
        35, 34, 33, 32, 31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20,
        17, 16, 15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2,
        17, 16, 15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2);
    /* 16-bit shifts: 0 for the low-nibble quarters, 4 for the high ones */
    const __m512i shift = _mm512_set_epi16(4, 4, 4, 4, 4, 4, 4, 4, 0, 0, 0, 0, 0, 0, 0, 0,
                                           4, 4, 4, 4, 4, 4, 4, 4, 0, 0, 0, 0, 0, 0, 0, 0);
    /* scale words: block 0's (word 0) for lanes 0-7, block 1's (word 9) for lanes 8-15 */
    const __m512i scale_pick = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                                9, 9, 9, 9, 9, 9, 9, 9, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    __m512 acc[4][3];
    const int8_t *q[3];
    const int32_t *xc[3];
    const float *dx[3];
    for (int c = 0; c < NC; c++) {
        q[c] = act->q + tr[c] * ncp;
        xc[c] = act->xc + tr[c] * (ncp / ST_LANE);
        dx[c] = act->dx + tr[c] * (ncp / ST_LANE);
        for (int r = 0; r < NR; r++) acc[r][c] = _mm512_setzero_ps();
    }
    for (int ib = 0; ib < num_blocks; ib += 2) {
        /* the last pair of an odd count is one block: its second half reads as zeros */
        const __mmask64 bytes = ib + 1 < num_blocks ? (__mmask64)0xFFFFFFFFFULL   /* 36 */
                                                    : (__mmask64)0x3FFFFULL;      /* 18 */
        const int k = ib * 32, lane = k / ST_LANE;
        __m512i corr[3], qc[3];
        __m512 dxc[3];
        for (int c = 0; c < NC; c++) {
            corr[c] = _mm512_srai_epi32(_mm512_loadu_si512((const void *)(xc[c] + lane)), 4);
            qc[c] = _mm512_loadu_si512((const void *)(q[c] + k));              /* [64] int8 */
            dxc[c] = _mm512_loadu_ps(dx[c] + lane);                             /* [16] */
        }
        /* the rows `ahead` (the next group: rows are contiguous) asked for as one forward
         * walk, this turn's share of them (NR pairs of blocks), not as NR interleaved streams
         * of a row each: one thread on the CPU machine (EPYC), 2,048-column rows from RAM 9.5
         * -> 16.6 GB/s (shuffled 64-row chunks 8.7 -> 13.1; 768 columns 12.7 -> 14.6), the
         * same in L2; on the H200 host's Xeon the pool measured the same either way (session
         * 35, docs/offload.md) */
        st_prefetch(rows[0] + ahead + (int64_t)ib * 18 * NR, 36 * NR);
        for (int r = 0; r < NR; r++) {
            __m512i raw = _mm512_maskz_loadu_epi8(bytes, rows[r] + (int64_t)ib * 18);
            __m512i u = _mm512_and_si512(
                _mm512_srlv_epi16(_mm512_permutexvar_epi8(pick, raw), shift), low4);
            __m512 dw = _mm512_cvtph_ps(
                _mm512_castsi512_si256(_mm512_permutexvar_epi16(scale_pick, raw)));  /* [16] */
            for (int c = 0; c < NC; c++)
                acc[r][c] = st_vnni_lane_acc(acc[r][c], corr[c], u, qc[c], dw, dxc[c]);
        }
    }
    for (int r = 0; r < NR; r++)
        for (int c = 0; c < NC; c++) res[r * 3 + c] = _mm512_reduce_add_ps(acc[r][c]);
}

static void q4_0_rows(const uint8_t *w, int64_t row_bytes, int cols, int64_t rb, int nr,
                      const st_act *act, const int64_t *tr, int64_t n_tok, float *out,
                      int64_t ld_out) {
    const int64_t ahead = ST_PREFETCH_ROWS * row_bytes;
    float res[12];                                               /* [4 rows, 3 tokens] */
    int i = 0;
    for (; i + 4 <= nr; i += 4) {
        const uint8_t *rows[4];
        for (int r = 0; r < 4; r++) rows[r] = w + (rb + i + r) * row_bytes;
        if (n_tok == 1) fused_q4_0_rows(4, 1, rows, ahead, cols, act, tr, res);
        else if (n_tok == 2) fused_q4_0_rows(4, 2, rows, ahead, cols, act, tr, res);
        else fused_q4_0_rows(4, 3, rows, ahead, cols, act, tr, res);
        for (int r = 0; r < 4; r++)
            for (int64_t j = 0; j < n_tok; j++) out[j * ld_out + i + r] = res[r * 3 + j];
    }
    for (; i < nr; i++) {
        const uint8_t *rows[1] = {w + (rb + i) * row_bytes};
        if (n_tok == 1) fused_q4_0_rows(1, 1, rows, ahead, cols, act, tr, res);
        else if (n_tok == 2) fused_q4_0_rows(1, 2, rows, ahead, cols, act, tr, res);
        else fused_q4_0_rows(1, 3, rows, ahead, cols, act, tr, res);
        for (int64_t j = 0; j < n_tok; j++) out[j * ld_out + i] = res[j];
    }
}
#endif

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "fused_f16.h"
#include "lane_sum.h"

/* acc[c] += 32 columns at k of signed weight values s (one scale dw) against the int8
 * activations, in the tiles' AVX2 lane arithmetic: maddubs(|s|, q with the sign of s), pairs
 * below 2 * 128 * 127 < 32768, to 8 int32 lane sums, each times dw * dx */
ALWAYS_INLINE void signed_block(const int NC, __m256i s, __m256 dw, int k,
                                const int8_t *const *q, const float *const *dx, __m256 *acc) {
    const __m256i s_abs = _mm256_sign_epi8(s, s);
    for (int c = 0; c < NC; c++) {
        __m256i qc = _mm256_loadu_si256((const __m256i *)(q[c] + k));
        __m256i p32 = lanes_dot(s_abs, _mm256_sign_epi8(qc, s));           /* [8] lane sums */
        acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p32),
                                 _mm256_mul_ps(dw, _mm256_loadu_ps(dx[c] + k / ST_LANE)), acc[c]);
    }
}


/* NR rows (1, 2 or 4) of Q4_0 or (is_q8) Q8_0 blocks against NC tokens (1-4), res [NR, 4],
 * each row in the tiles' order and lane arithmetic, so bit for bit the tiles' result. Q4_0: the
 * nibbles u = s + 8 go to maddubs as they are (unsigned, pairs below 2 * 15 * 127), and
 * xc >> 4 = -8 * sum(q) per lane takes the 8 back, so each lane sum is sum(s * q) exactly,
 * without the offset and both signs per block and row. Q8_0: maddubs(|s|, q with the sign of
 * s), as signed_block. With the type fixed at compile time, not fused_rows' per-block branches:
 * Q8_0 6-15% a call, Q4_0 1.2-1.8x with the nibbles (docs/DEVELOPING.md). The activation's 32 q
 * and its lane corrections are loaded once per block for all rows, a row's nibbles and scale
 * once for all tokens. (With AVX-VNNI, one vpdpbusd per lane sum: lanes_dot.)
 * Shapes: u, q [32] int8; corr, lane sums [8] int32 (4 columns each); dx [8] per lane. */
ALWAYS_INLINE void block32_rows(const int NR, const int NC, const int is_q8,
                                const uint8_t *const *rows, int64_t ahead, int cols,
                                const st_act *act, const int64_t *tr, float *res) {
    const int ncp = act->cols_pad, bytes = st_type_size(is_q8 ? ST_Q8_0 : ST_Q4_0);
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    const __m256i hi_shift = _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4);
    __m256 acc[4][4];
    const int8_t *q[4];
    const float *dx[4];
    const int32_t *xc[4];
    for (int c = 0; c < NC; c++) {
        for (int r = 0; r < NR; r++) acc[r][c] = _mm256_setzero_ps();
        q[c] = act->q + tr[c] * ncp;
        dx[c] = act->dx + tr[c] * (ncp / ST_LANE);
        xc[c] = act->xc + tr[c] * (ncp / ST_LANE);
    }
    for (int ib = 0; ib < cols / 32; ib++) {
        const int k = ib * 32, lane = k / ST_LANE;
        __m256i qc[4], corr[4];
        for (int c = 0; c < NC; c++) {
            qc[c] = _mm256_loadu_si256((const __m256i *)(q[c] + k));
            corr[c] = is_q8 ? _mm256_setzero_si256() : _mm256_srai_epi32(
                _mm256_loadu_si256((const __m256i *)(xc[c] + lane)), 4);
        }
        /* besides each row's own line `ahead` (the next group), the group after the next two
         * asked for into L2 as one forward walk, this turn's share of NR rows (a constant count:
         * a loop bound read from st_type_size costs the L2 case 40%). One thread on the CPU
         * machine's EPYC (an AVX2 build), 2,048-column rows from RAM: Q4_0 12.0 -> 15-16.5
         * GB/s, Q8_0 12.5 -> 23.5, shuffled 64-row chunks of 768 columns 8.3 -> 9.5-10.5, L2
         * unchanged at ~17.5 (session 76). The walk alone, or into L1 as the AVX-512 rows ask
         * (at `ahead`), read no faster than no prefetch at all here */
        for (int o = 0; o < ((is_q8 ? 34 : 18) * NR + 32) / 64; o++)
            __builtin_prefetch(rows[0] + 3 * ahead + (int64_t)ib * (is_q8 ? 34 : 18) * NR + 64 * o,
                               0, 1);
        for (int r = 0; r < NR; r++) {
            const uint8_t *blk = rows[r] + (int64_t)ib * bytes;
            __builtin_prefetch(blk + ahead, 0, 3);
            const __m256 dw = _mm256_set1_ps(fp16_at(blk));
            __m256i u, s = _mm256_setzero_si256();
            if (is_q8) {  /* signed values: maddubs(|s|, q with the sign of s), as the tiles */
                s = _mm256_loadu_si256((const __m256i *)(blk + 2));
                u = _mm256_sign_epi8(s, s);
            } else {      /* 16 bytes in both halves; the high half shifted by 4, masked */
                const __m256i both = _mm256_broadcastsi128_si256(
                    _mm_loadu_si128((const __m128i *)(blk + 2)));
                u = _mm256_and_si256(_mm256_srlv_epi32(both, hi_shift), low4);
            }
            for (int c = 0; c < NC; c++) {
                const __m256i p32 = is_q8 ? lanes_dot(u, _mm256_sign_epi8(qc[c], s))
                                          : lanes_dot_add(corr[c], u, qc[c]);
                acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p32),
                                            _mm256_mul_ps(dw, _mm256_loadu_ps(dx[c] + lane)),
                                            acc[r][c]);
            }
        }
    }
    for (int r = 0; r < NR; r++)
        for (int c = 0; c < NC; c++) res[r * 4 + c] = hsum8(acc[r][c]);
}

/* NR rows (1, 2 or 4) of 32-column blocks: Q4_1 / Q5_0 / Q5_1 / IQ4_NL by
 * st_block32_values; res [NR, 4]. Each row keeps its own accumulators in the tiles' order, so
 * several rows at once change no result; they only give the core independent chains (one
 * row's FMAs wait on each other) and share the activation loads. For the min types (Q4_1,
 * Q5_1: w = d q + m) B [NR, ldb] gets -m per 16 columns and the tiles' st_min_term is
 * subtracted, so the result is the tiles' bit for bit. */
#define ST_FUSED_BLOCK32 1
ALWAYS_INLINE void fused_rows(const int NR, const int NC, int qtype, const uint8_t *const *rows,
                              int64_t ahead, int cols, const st_act *act, const int64_t *tr,
                              float *B, int ldb, float *res) {
    const int ncp = act->cols_pad, bytes = st_type_size(qtype), has_min = st_has_min(qtype);
    __m256 acc[4][4];
    const int8_t *q[4];
    const float *dx[4];
    for (int c = 0; c < NC; c++) {
        for (int r = 0; r < NR; r++) acc[r][c] = _mm256_setzero_ps();
        q[c] = act->q + tr[c] * ncp;
        dx[c] = act->dx + tr[c] * (ncp / ST_LANE);
    }
    for (int ib = 0; ib < cols / 32; ib++) {
        for (int r = 0; r < NR; r++) {
            const uint8_t *blk = rows[r] + (int64_t)ib * bytes;
            __builtin_prefetch(blk + ahead, 0, 3);
            const __m256i s = st_block32_values(qtype, blk, bytes);        /* [32] int8 */
            if (has_min) B[r * ldb + 2 * ib] = B[r * ldb + 2 * ib + 1] = -fp16_at(blk + 2);
            signed_block(NC, s, _mm256_set1_ps(fp16_at(blk)), ib * 32, q, dx, acc[r]);
        }
    }
    for (int r = 0; r < NR; r++)
        for (int c = 0; c < NC; c++) {
            res[r * 4 + c] = hsum8(acc[r][c]);
            if (has_min)  /* B's padding groups are zero, as the unpacked row's */
                res[r * 4 + c] -= st_min_term(B + r * ldb, act->xs + tr[c] * (ncp / ST_GROUP),
                                              ncp / ST_GROUP);
        }
}


/* n (1, 2 or 4) rows of qtype, a constant where it is called, for n_tok (1-4) tokens: NR and NC
 * as constants of the kernels, Q4_0 / Q8_0 by block32_rows, the others by fused_rows */
#define ST_BY_SHAPE(CALL)                                                                  \
    do {                                                                                   \
        if (n_tok == 4) CALL(1, 4);                                                        \
        else if (n == 4 && n_tok == 1) CALL(4, 1);                                         \
        else if (n == 4) CALL(4, 2);                                                       \
        else if (n == 2) CALL(2, 3);                                                       \
        else if (n_tok == 1) CALL(1, 1);                                                   \
        else if (n_tok == 2) CALL(1, 2);                                                   \
        else CALL(1, 3);                                                                   \
    } while (0)
ALWAYS_INLINE void block32_step(const int qtype, int n, int n_tok, const uint8_t *const *rows,
                                int64_t ahead, int cols, const st_act *act, const int64_t *tr,
                                float *B, int ldb, float *res) {
#define ST_BLOCK32(NR, NC) \
    block32_rows(NR, NC, qtype == ST_Q8_0, rows, ahead, cols, act, tr, res)
#define ST_OTHER32(NR, NC) fused_rows(NR, NC, qtype, rows, ahead, cols, act, tr, B, ldb, res)
    if (qtype == ST_Q4_0 || qtype == ST_Q8_0) ST_BY_SHAPE(ST_BLOCK32);
    else ST_BY_SHAPE(ST_OTHER32);
#undef ST_BLOCK32
#undef ST_OTHER32
}
#undef ST_BY_SHAPE
#endif

#if (defined(ST_USE_VNNI512) || (defined(__AVX2__) && defined(__FMA__))) && defined(__F16C__)

static int q8_rows(int qtype, const uint8_t *w, int64_t row_bytes, int cols, int64_t rb, int nr,
                   const st_act *act, const int32_t *tok, int64_t tok0, int64_t n_tok,
                   float *out, int64_t ld_out) {
#if defined(ST_FUSED_BLOCK32)
    /* AVX2: Q4_0 / Q8_0 (block32_rows) take 4 tokens in one pass too, the others 1-3 */
    const int64_t most = qtype == ST_Q4_0 || qtype == ST_Q8_0 ? 4 : 3;
#else
    const int64_t most = 3;
#endif
    if (n_tok < 1 || n_tok > most || !act->is_quant) return 0;
    int64_t tr[4];
    for (int64_t j = 0; j < n_tok; j++) tr[j] = tok ? (int64_t)tok[j] : tok0 + j;
#if defined(ST_FUSED_BLOCK32)  /* AVX2: every type of 32-column blocks */
    if (st_block_size(qtype) != 32) return 0;
    const int num_groups = act->cols_pad / ST_GROUP;
    float B[4 * num_groups];  /* [4, groups] the min types' B per 16 columns, zero past cols */
    for (int r = 0; r < 4; r++)
        for (int g = cols / ST_GROUP; g < num_groups; g++) B[r * num_groups + g] = 0.0f;
    const int64_t ahead = ST_PREFETCH_ROWS * row_bytes;
    float res4[16];                                              /* [4 rows, 4 tokens] */
    /* 4 rows at a time for 1-2 tokens (8 accumulators), 2 for 3 (6: AVX2 has 16 registers),
     * one for 4 (4 accumulators; with two rows, 8, the pool's Q4_0 experts at 4 rows each ran
     * 20-25% slower on the CPU machine's AVX2 EPYC, session 97) */
    const int step = n_tok <= 2 ? 4 : n_tok == 3 ? 2 : 1;
    for (int i = 0; i < nr; ) {
        const int n = nr - i >= step ? step : 1;
        const uint8_t *rows[4];
        for (int r = 0; r < n; r++) rows[r] = w + (rb + i + r) * row_bytes;
        switch (qtype) {  /* each type's rows with the type a constant */
        case ST_Q4_0: block32_step(ST_Q4_0, n, (int)n_tok, rows, ahead, cols, act, tr, B,
                                   num_groups, res4); break;
        case ST_Q8_0: block32_step(ST_Q8_0, n, (int)n_tok, rows, ahead, cols, act, tr, B,
                                   num_groups, res4); break;
        case ST_Q4_1: block32_step(ST_Q4_1, n, (int)n_tok, rows, ahead, cols, act, tr, B,
                                   num_groups, res4); break;
        case ST_Q5_0: block32_step(ST_Q5_0, n, (int)n_tok, rows, ahead, cols, act, tr, B,
                                   num_groups, res4); break;
        case ST_Q5_1: block32_step(ST_Q5_1, n, (int)n_tok, rows, ahead, cols, act, tr, B,
                                   num_groups, res4); break;
        default: block32_step(ST_IQ4_NL, n, (int)n_tok, rows, ahead, cols, act, tr, B,
                              num_groups, res4);
        }
        for (int r = 0; r < n; r++)
            for (int64_t j = 0; j < n_tok; j++) out[j * ld_out + i + r] = res4[r * 4 + j];
        i += n;
    }
    return 1;
#else  /* AVX-512 VNNI: Q4_0 and Q8_0 */
    if (qtype != ST_Q4_0 && qtype != ST_Q8_0) return 0;
#if defined(ST_FUSED_Q4_ROWS)
    if (qtype == ST_Q4_0) {
        q4_0_rows(w, row_bytes, cols, rb, nr, act, tr, n_tok, out, ld_out);
        return 1;
    }
#endif
    const int64_t ahead = ST_PREFETCH_ROWS * row_bytes;
    float res[4];
    /* the type a constant of fused_row's loop, as the AVX2 rows' */
#define ST_ROW_OF(QTYPE)                                                                 \
    do {                                                                                 \
        if (n_tok == 1) fused_row(1, QTYPE, row, ahead, cols, act, tr, res);            \
        else if (n_tok == 2) fused_row(2, QTYPE, row, ahead, cols, act, tr, res);       \
        else fused_row(3, QTYPE, row, ahead, cols, act, tr, res);                       \
    } while (0)
    for (int i = 0; i < nr; i++) {
        const uint8_t *row = w + (rb + i) * row_bytes;
        if (qtype == ST_Q8_0) ST_ROW_OF(ST_Q8_0);
        else ST_ROW_OF(ST_Q4_0);
        for (int64_t j = 0; j < n_tok; j++) out[j * ld_out + i] = res[j];
    }
#undef ST_ROW_OF
    return 1;
#endif
}

#else

static int q8_rows(int qtype, const uint8_t *w, int64_t row_bytes, int cols, int64_t rb, int nr,
                   const st_act *act, const int32_t *tok, int64_t tok0, int64_t n_tok,
                   float *out, int64_t ld_out) {
    (void)qtype; (void)w; (void)row_bytes; (void)cols; (void)rb; (void)nr; (void)act;
    (void)tok; (void)tok0; (void)n_tok; (void)out; (void)ld_out;
    return 0;
}

#endif

int st_fused_rows(int qtype, const uint8_t *w, int64_t row_bytes, int cols, int64_t rb, int nr,
                  const st_act *act, const int32_t *tok, int64_t tok0, int64_t n_tok,
                  float *out, int64_t ld_out) {
    if (act->is_quant == ST_ACT_K) {  /* k- and grid i-quants: fused_k.c's rows, every build */
        if (n_tok < 1 || n_tok > 4 || st_act_kind(qtype) != ST_ACT_K) return 0;
        st_fused_k_rows(qtype, w, row_bytes, cols, rb, nr, act, tok, tok0, (int)n_tok, out,
                        ld_out);
        return 1;
    }
    return q8_rows(qtype, w, row_bytes, cols, rb, nr, act, tok, tok0, n_tok, out, ld_out);
}

/* ---- float weights (F32 / F16 / BF16), 1-3 tokens: convert in registers, no row buffer ---- */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>

static inline __m512 load_w16(int qtype, const uint8_t *row, int k, __mmask16 mask) {
    if (qtype == ST_F32) return _mm512_maskz_loadu_ps(mask, row + 4 * (int64_t)k);
    __m256i h = _mm256_maskz_loadu_epi16(mask, row + 2 * (int64_t)k);          /* [16] */
    if (qtype == ST_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); /* BF16 */
}

static inline __attribute__((always_inline)) void float_row(
        const int NC, int qtype, const uint8_t *row, int cols, const float *const *x,
        float *res) {
    __m512 acc[3];
    for (int c = 0; c < NC; c++) acc[c] = _mm512_setzero_ps();
    /* same lanes and order as the tiles' float path: results agree bit for bit */
    for (int k = 0; k < cols; k += 16) {
        __mmask16 mask = cols - k >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (cols - k)) - 1);
        __m512 w = load_w16(qtype, row, k, mask);
        for (int c = 0; c < NC; c++) acc[c] = _mm512_fmadd_ps(w, _mm512_loadu_ps(x[c] + k), acc[c]);
    }
    for (int c = 0; c < NC; c++) res[c] = _mm512_reduce_add_ps(acc[c]);
}

int st_fused_float_rows(int qtype, const uint8_t *w, int64_t row_bytes, int cols, int64_t rb,
                        int nr, const st_act *act, const int32_t *tok, int64_t tok0,
                        int64_t n_tok, float *out, int64_t ld_out) {
    if (n_tok < 1 || n_tok > 3 || act->is_quant) return 0;
    const float *x[3];
    for (int64_t j = 0; j < n_tok; j++)
        x[j] = act->xf + (tok ? (int64_t)tok[j] : tok0 + j) * act->cols_pad;
    float res[3];
    for (int i = 0; i < nr; i++) {
        const uint8_t *row = w + (rb + i) * row_bytes;
        if (n_tok == 1) float_row(1, qtype, row, cols, x, res);
        else if (n_tok == 2) float_row(2, qtype, row, cols, x, res);
        else float_row(3, qtype, row, cols, x, res);
        for (int64_t j = 0; j < n_tok; j++) out[j * ld_out + i] = res[j];
    }
    return 1;
}

#else

int st_fused_float_rows(int qtype, const uint8_t *w, int64_t row_bytes, int cols, int64_t rb,
                        int nr, const st_act *act, const int32_t *tok, int64_t tok0,
                        int64_t n_tok, float *out, int64_t ld_out) {
    (void)qtype; (void)w; (void)row_bytes; (void)cols; (void)rb; (void)nr; (void)act;
    (void)tok; (void)tok0; (void)n_tok; (void)out; (void)ld_out;
    return 0;
}

#endif
