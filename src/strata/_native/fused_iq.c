/* Decode-shaped dot products (1-3 tokens) straight from the grid i-quants' super-blocks (IQ1_S,
 * IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S) on AVX2 builds: the CPU pool's rows of the
 * 1-3 bit files that put a Qwen3-235B-A22B in 64-96 GB of RAM.
 *
 * Per 32 columns the grid values go straight into a vector (4 table loads of 8 bytes) and, for
 * IQ2_* / IQ3_*, their 32 sign bits become +-1 bytes that sign the activations instead; then
 * the tiles' AVX2 lane arithmetic in the tiles' column order (st_iq_scales gives the scales the
 * unpacked path uses), so a token's result is the unpacked path's bit for bit
 * (tests/native/test_matmul.py: alone = in a batch). Unpacking the super-block into a buffer
 * first (quant_ref.c's SWAR st_unpack_iq) and then taking it 32 columns at a time was no faster
 * than the unpacked path: the values, not the round trip, were the cost. AVX-512 builds keep
 * the unpacked path: their tiles sum 16 lanes per vector, another float order. */
#include "quant.h"

#if !defined(ST_USE_VNNI512) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "fused_avx2.h"

static inline int is_grid_iq(int qtype) {
    return qtype == ST_IQ2_XXS || qtype == ST_IQ2_XS || qtype == ST_IQ2_S
        || qtype == ST_IQ3_XXS || qtype == ST_IQ3_S || qtype == ST_IQ1_S || qtype == ST_IQ1_M;
}

/* acc[c] += 32 columns at k of grid magnitudes g (all >= 0) whose values are negated where
 * sgn is -1 (else +1): maddubs(g, q with the sign of sgn), the same products and pairs as
 * piece_signed's maddubs(|s|, q with the sign of s) for s = g * sgn */
ALWAYS_INLINE void piece_sign_mask(const int NC, __m256i g, __m256i sgn, __m256 scale, int k,
                                   const int8_t *const *q, const float *const *dx,
                                   __m256 *acc) {
    const __m256i ones = _mm256_set1_epi16(1);
    for (int c = 0; c < NC; c++) {
        const __m256i qc = _mm256_loadu_si256((const __m256i *)(q[c] + k));
        const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(g, _mm256_sign_epi8(qc, sgn)),
                                            ones);
        acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p),
                                 _mm256_mul_ps(scale, _mm256_loadu_ps(dx[c] + k / ST_LANE)),
                                 acc[c]);
    }
}

/* [32] bytes: -1 where bit i of `bits` is set, else +1 */
static inline __m256i sign_bytes(uint32_t bits) {
    const __m256i pick = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                          2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), pick);
    return _mm256_or_si256(_mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit),
                           _mm256_set1_epi8(1));
}

static inline uint64_t u64_at(const int8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

static inline uint32_t u32_at(const void *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

static inline uint16_t u16_at(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

/* 8 IQ3 values: grid entries e0 and e1 (4 values each) */
static inline uint64_t iq3_pair(const int8_t *grid, int e0, int e1) {
    return (uint64_t)u32_at(grid + 4 * e0) | (uint64_t)u32_at(grid + 4 * e1) << 32;
}

static inline __m256i four_u64(uint64_t v0, uint64_t v1, uint64_t v2, uint64_t v3) {
    return _mm256_set_epi64x((long long)v3, (long long)v2, (long long)v1, (long long)v0);
}

/* res[c] = row . activation row c, for NC tokens; cols a multiple of 256. Per 32 columns
 * (sub-block b of super-block ib) the values come from the grid as 4 x 8 bytes: magnitudes
 * and 32 sign bits for IQ2_* / IQ3_*, signed values for IQ1_* (quant_ref.c's st_unpack_iq
 * reads the same bits 8 values at a time). */
ALWAYS_INLINE void avx2_row_iq(const int NC, const int qtype, const uint8_t *row, int64_t ahead,
                               int cols, const int8_t *const *q, const float *const *dx,
                               float *res) {
    const int bytes = st_type_size(qtype);
    const int8_t *grid = st_iq_grid_table(qtype);
    const uint8_t *ks = st_iq_ksigns_table();
    const uint64_t *iq1 = st_iq1_values_table();                /* [2][2048] */
    __m256 acc[3];
    for (int c = 0; c < NC; c++) acc[c] = _mm256_setzero_ps();
    float a[16];                                                /* [16] scales per 16 columns */
    for (int ib = 0; ib < cols / 256; ib++) {
        const uint8_t *blk = row + (int64_t)ib * bytes;
        st_prefetch(blk + ahead, bytes);
        st_iq_scales(qtype, blk, a);
        for (int b = 0; b < 8; b++) {
            const int k = ib * 256 + 32 * b;
            const __m256 scale = two_groups(a, 2 * b);
            __m256i g;
            uint32_t signs = 0;
            switch (qtype) {
            case ST_IQ2_XXS: {  /* 4 grid bytes, then 4 x 7 sign-index bits */
                const uint8_t *p = blk + 2 + 8 * b;
                const uint32_t aux = u32_at(p + 4);
                g = four_u64(u64_at(grid + 8 * p[0]), u64_at(grid + 8 * p[1]),
                             u64_at(grid + 8 * p[2]), u64_at(grid + 8 * p[3]));
                for (int l = 0; l < 4; l++) signs |= (uint32_t)ks[(aux >> (7 * l)) & 127] << (8 * l);
                break;
            }
            case ST_IQ2_XS: {  /* u16: 9-bit grid index | 7-bit sign index */
                uint16_t v[4];
                for (int l = 0; l < 4; l++) {
                    v[l] = u16_at(blk + 2 + 8 * b + 2 * l);
                    signs |= (uint32_t)ks[v[l] >> 9] << (8 * l);
                }
                g = four_u64(u64_at(grid + 8 * (v[0] & 511)), u64_at(grid + 8 * (v[1] & 511)),
                             u64_at(grid + 8 * (v[2] & 511)), u64_at(grid + 8 * (v[3] & 511)));
                break;
            }
            case ST_IQ2_S: {  /* index byte | 2 bits of qh << 8; one sign byte per 8 values */
                const uint8_t qh = blk[66 + b];
                int idx[4];
                for (int l = 0; l < 4; l++) idx[l] = blk[2 + 4 * b + l] | (((qh >> (2 * l)) & 3) << 8);
                g = four_u64(u64_at(grid + 8 * idx[0]), u64_at(grid + 8 * idx[1]),
                             u64_at(grid + 8 * idx[2]), u64_at(grid + 8 * idx[3]));
                signs = u32_at(blk + 34 + 4 * b);
                break;
            }
            case ST_IQ3_XXS: {  /* 8 grid bytes (4 values each), then 4 x 7 sign-index bits */
                const uint8_t *p = blk + 2 + 8 * b;
                const uint32_t aux = u32_at(blk + 66 + 4 * b);
                g = four_u64(iq3_pair(grid, p[0], p[1]), iq3_pair(grid, p[2], p[3]),
                             iq3_pair(grid, p[4], p[5]), iq3_pair(grid, p[6], p[7]));
                for (int l = 0; l < 4; l++) signs |= (uint32_t)ks[(aux >> (7 * l)) & 127] << (8 * l);
                break;
            }
            case ST_IQ3_S: {  /* index byte | bit of qh << 8 (4 values); one sign byte per 8 */
                const uint8_t qh = blk[66 + b];
                int idx[8];
                for (int e = 0; e < 8; e++) idx[e] = blk[2 + 8 * b + e] | (((qh >> e) & 1) << 8);
                g = four_u64(iq3_pair(grid, idx[0], idx[1]), iq3_pair(grid, idx[2], idx[3]),
                             iq3_pair(grid, idx[4], idx[5]), iq3_pair(grid, idx[6], idx[7]));
                signs = u32_at(blk + 74 + 4 * b);
                break;
            }
            case ST_IQ1_S: {  /* signed values 8 g +- 1: index byte | 3 bits of qh, delta sign */
                const uint16_t qh = u16_at(blk + 34 + 2 * b);
                const uint64_t *v = iq1 + 2048 * (qh >> 15);
                g = four_u64(v[blk[2 + 4 * b] | ((qh & 7) << 8)],
                             v[blk[3 + 4 * b] | (((qh >> 3) & 7) << 8)],
                             v[blk[4 + 4 * b] | (((qh >> 6) & 7) << 8)],
                             v[blk[5 + 4 * b] | (((qh >> 9) & 7) << 8)]);
                piece_signed(NC, g, scale, k, q, dx, acc);
                continue;
            }
            default: {  /* ST_IQ1_M: per 8 values a nibble: 3 index bits, the delta sign */
                uint64_t v[4];
                for (int l = 0; l < 4; l++) {
                    const int kk = 4 * b + l;
                    const int nib = (blk[32 + kk / 2] >> (4 * (kk & 1))) & 15;
                    v[l] = iq1[2048 * ((nib >> 3) & 1) + (blk[kk] | ((nib & 7) << 8))];
                }
                piece_signed(NC, four_u64(v[0], v[1], v[2], v[3]), scale, k, q, dx, acc);
                continue;
            }
            }
            piece_sign_mask(NC, g, sign_bytes(signs), scale, k, q, dx, acc);
        }
    }
    for (int c = 0; c < NC; c++) res[c] = hsum8(acc[c]);
}

int st_fused_iq_row(int qtype, const uint8_t *row, int64_t ahead, int cols, const st_act *act,
                    const int64_t *tr, int n_tok, float *res) {
    if (!is_grid_iq(qtype) || cols % 256 != 0 || n_tok < 1 || n_tok > 3) return 0;
    const int ncp = act->cols_pad;
    const int8_t *q[3];
    const float *dx[3];
    for (int c = 0; c < n_tok; c++) {
        q[c] = act->q + tr[c] * ncp;
        dx[c] = act->dx + tr[c] * (ncp / ST_LANE);
    }
    /* one instance per (type, tokens): the switch in the row's loop folds away */
#define ROWS_OF(T) \
    if (n_tok == 1) avx2_row_iq(1, T, row, ahead, cols, q, dx, res); \
    else if (n_tok == 2) avx2_row_iq(2, T, row, ahead, cols, q, dx, res); \
    else avx2_row_iq(3, T, row, ahead, cols, q, dx, res); \
    return 1;
    switch (qtype) {
    case ST_IQ2_XXS: ROWS_OF(ST_IQ2_XXS)
    case ST_IQ2_XS: ROWS_OF(ST_IQ2_XS)
    case ST_IQ2_S: ROWS_OF(ST_IQ2_S)
    case ST_IQ3_XXS: ROWS_OF(ST_IQ3_XXS)
    case ST_IQ3_S: ROWS_OF(ST_IQ3_S)
    case ST_IQ1_S: ROWS_OF(ST_IQ1_S)
    default: ROWS_OF(ST_IQ1_M)
    }
#undef ROWS_OF
}

#else

int st_fused_iq_row(int qtype, const uint8_t *row, int64_t ahead, int cols, const st_act *act,
                    const int64_t *tr, int n_tok, float *res) {
    (void)qtype; (void)row; (void)ahead; (void)cols; (void)act; (void)tr; (void)n_tok; (void)res;
    return 0;
}

#endif
