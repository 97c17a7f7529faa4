/* Decode-shaped dot products (1-3 tokens) straight from the grid i-quants' super-blocks (IQ1_S,
 * IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S) with AVX-512 VNNI or AVX2: the CPU pool's rows
 * of the 1-3 bit files that put a Qwen3-235B-A22B in 64-96 GB of RAM.
 *
 * Per 32 columns (`values32`) the grid entries go straight into a vector (4 table loads of 8
 * bytes) with, for IQ2_* / IQ3_*, their 32 sign bits; IQ1's values come signed from its
 * [delta sign][index] table. AVX2 signs the activations with the bits (maddubs(grid, sign(q)),
 * the tiles' products); AVX-512 VNNI makes the tiles' unsigned values 128 +- grid under the
 * bits as a mask (the offset's sum from xc). Then the tiles' lane arithmetic in
 * the tiles' column order, with the scales of quant_ref.c's st_iq_scales (the unpacked path's),
 * so a token's result is the unpacked path's bit for bit (tests/native/test_matmul.py: alone =
 * in a batch; arch_check.c for the builds this machine cannot run). Unpacking the super-block
 * into a buffer first (the SWAR st_unpack_iq) and then taking it 32 columns at a time was no
 * faster than the unpacked path: the values, not the round trip, were the cost. */
#include <string.h>
#include "quant.h"

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

typedef struct {
    const int8_t *grid;     /* st_iq_grid_table(qtype) */
    const uint8_t *ks;      /* [128] sign bytes */
    const uint64_t *iq1;    /* [2][2048] IQ1 values */
} iq_tables;

/* Columns 32 b .. 32 b + 31 of super-block blk: v[4] x 8 values and, returned, their sign bits
 * (bit i: value i negated) for IQ2_* / IQ3_* (magnitudes in v), 0 for IQ1_* (signed values in
 * v). The bits read are those of quant_ref.c's st_unpack_iq. */
static inline __attribute__((always_inline)) uint32_t values32(
        const int qtype, const uint8_t *blk, int b, const iq_tables *t, uint64_t *v) {
    uint32_t signs = 0;
    switch (qtype) {
    case ST_IQ2_XXS: {  /* 4 grid bytes, then 4 x 7 sign-index bits | scale << 28 */
        const uint8_t *p = blk + 2 + 8 * b;
        const uint32_t aux = u32_at(p + 4);
        for (int l = 0; l < 4; l++) {
            v[l] = u64_at(t->grid + 8 * p[l]);
            signs |= (uint32_t)t->ks[(aux >> (7 * l)) & 127] << (8 * l);
        }
        break;
    }
    case ST_IQ2_XS:  /* u16: 9-bit grid index | 7-bit sign index */
        for (int l = 0; l < 4; l++) {
            const uint16_t w = u16_at(blk + 2 + 8 * b + 2 * l);
            v[l] = u64_at(t->grid + 8 * (w & 511));
            signs |= (uint32_t)t->ks[w >> 9] << (8 * l);
        }
        break;
    case ST_IQ2_S: {  /* index byte | 2 bits of qh << 8; one sign byte per 8 values */
        const uint8_t qh = blk[66 + b];
        for (int l = 0; l < 4; l++)
            v[l] = u64_at(t->grid + 8 * (blk[2 + 4 * b + l] | (((qh >> (2 * l)) & 3) << 8)));
        signs = u32_at(blk + 34 + 4 * b);
        break;
    }
    case ST_IQ3_XXS: {  /* 8 grid bytes (4 values each), then 4 x 7 sign-index bits */
        const uint8_t *p = blk + 2 + 8 * b;
        const uint32_t aux = u32_at(blk + 66 + 4 * b);
        for (int l = 0; l < 4; l++) {
            v[l] = iq3_pair(t->grid, p[2 * l], p[2 * l + 1]);
            signs |= (uint32_t)t->ks[(aux >> (7 * l)) & 127] << (8 * l);
        }
        break;
    }
    case ST_IQ3_S: {  /* index byte | bit of qh << 8 (4 values); one sign byte per 8 */
        const uint8_t qh = blk[66 + b];
        const uint8_t *p = blk + 2 + 8 * b;
        for (int l = 0; l < 4; l++)
            v[l] = iq3_pair(t->grid, p[2 * l] | (((qh >> (2 * l)) & 1) << 8),
                            p[2 * l + 1] | (((qh >> (2 * l + 1)) & 1) << 8));
        signs = u32_at(blk + 74 + 4 * b);
        break;
    }
    case ST_IQ1_S: {  /* index byte | 3 bits of qh << 8; the delta's sign in bit 15 */
        const uint16_t qh = u16_at(blk + 34 + 2 * b);
        const uint64_t *vals = t->iq1 + 2048 * (qh >> 15);
        for (int l = 0; l < 4; l++)
            v[l] = vals[blk[2 + 4 * b + l] | (((qh >> (3 * l)) & 7) << 8)];
        break;
    }
    default:  /* ST_IQ1_M: per 8 values a nibble of 3 index bits and the delta's sign */
        for (int l = 0; l < 4; l++) {
            const int k = 4 * b + l;
            const int nib = (blk[32 + k / 2] >> (4 * (k & 1))) & 15;
            v[l] = t->iq1[2048 * ((nib >> 3) & 1) + (blk[k] | ((nib & 7) << 8))];
        }
        break;
    }
    return signs;
}

static inline int is_grid_iq(int qtype) {
    return qtype == ST_IQ2_XXS || qtype == ST_IQ2_XS || qtype == ST_IQ2_S
        || qtype == ST_IQ3_XXS || qtype == ST_IQ3_S || qtype == ST_IQ1_S || qtype == ST_IQ1_M;
}

static inline int has_signs(int qtype) { return qtype != ST_IQ1_S && qtype != ST_IQ1_M; }

/* one instance per (type, tokens): the type's switch in the row's loop folds away */
#define ROWS_BY_TYPE(ROW, ...)                                                                  \
    switch (qtype) {                                                                            \
    case ST_IQ2_XXS: ROWS_BY_TOKENS(ROW, ST_IQ2_XXS, __VA_ARGS__)                               \
    case ST_IQ2_XS: ROWS_BY_TOKENS(ROW, ST_IQ2_XS, __VA_ARGS__)                                 \
    case ST_IQ2_S: ROWS_BY_TOKENS(ROW, ST_IQ2_S, __VA_ARGS__)                                   \
    case ST_IQ3_XXS: ROWS_BY_TOKENS(ROW, ST_IQ3_XXS, __VA_ARGS__)                               \
    case ST_IQ3_S: ROWS_BY_TOKENS(ROW, ST_IQ3_S, __VA_ARGS__)                                   \
    case ST_IQ1_S: ROWS_BY_TOKENS(ROW, ST_IQ1_S, __VA_ARGS__)                                   \
    default: ROWS_BY_TOKENS(ROW, ST_IQ1_M, __VA_ARGS__)                                         \
    }
#define ROWS_BY_TOKENS(ROW, T, ...)                                                             \
    if (n_tok == 1) ROW(1, T, __VA_ARGS__);                                                     \
    else if (n_tok == 2) ROW(2, T, __VA_ARGS__);                                                \
    else ROW(3, T, __VA_ARGS__);                                                                \
    return 1;

#if defined(ST_USE_VNNI512) && defined(__F16C__)
#include "fused_avx512.h"

/* res[c] = row . activation row c, for NC tokens; cols a multiple of 256. A 64-column chunk j
 * of a super-block is 32-column blocks 2j and 2j + 1; its 16 lanes take groups 4j .. 4j + 3. */
ALWAYS_INLINE void row_iq(const int NC, const int qtype, const uint8_t *row, int64_t ahead,
                          int cols, const iq_tables *t, const act_rows *a, float *res) {
    const int bytes = st_type_size(qtype);
    const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const __m512i c128 = _mm512_set1_epi8((char)0x80);
    __m512 acc[3];
    for (int c = 0; c < NC; c++) acc[c] = _mm512_setzero_ps();
    float a16[16];                                              /* [16] scales per 16 columns */
    for (int ib = 0; ib < cols / 256; ib++) {
        const uint8_t *blk = row + (int64_t)ib * bytes;
        st_prefetch(blk + ahead, bytes);
        st_iq_scales(qtype, blk, a16);
        const __m512 scales = _mm512_loadu_ps(a16);
        for (int j = 0; j < 4; j++) {
            uint64_t v[8];
            const uint64_t signs = values32(qtype, blk, 2 * j, t, v)
                                   | (uint64_t)values32(qtype, blk, 2 * j + 1, t, v + 4) << 32;
            /* [64] bytes, built in registers: a 64-byte load of the 8 scalar stores would
             * wait for store forwarding to fail */
            const __m512i g = _mm512_set_epi64((long long)v[7], (long long)v[6], (long long)v[5],
                                               (long long)v[4], (long long)v[3], (long long)v[2],
                                               (long long)v[1], (long long)v[0]);
            /* the tiles' unsigned values s + 128: 128 + g, or 128 - g under a sign bit */
            const __m512i u = has_signs(qtype)
                ? _mm512_mask_sub_epi8(_mm512_add_epi8(g, c128), (__mmask64)signs, c128, g)
                : _mm512_xor_si512(g, c128);
            const __m512 scale = _mm512_permutexvar_ps(
                _mm512_add_epi32(spread, _mm512_set1_epi32(4 * j)), scales);   /* [16] */
            chunk(NC, u, scale, ib * 256 + 64 * j, 0, a, acc);
        }
    }
    for (int c = 0; c < NC; c++) res[c] = _mm512_reduce_add_ps(acc[c]);
}

int st_fused_iq_row(int qtype, const uint8_t *row, int64_t ahead, int cols, const st_act *act,
                    const int64_t *tr, int n_tok, float *res) {
    if (!is_grid_iq(qtype) || cols % 256 != 0 || n_tok < 1 || n_tok > 3) return 0;
    const int ncp = act->cols_pad;
    const iq_tables t = {st_iq_grid_table(qtype), st_iq_ksigns_table(), st_iq1_values_table()};
    act_rows a;
    for (int c = 0; c < n_tok; c++) {
        a.q[c] = act->q + tr[c] * ncp;
        a.xc[c] = act->xc + tr[c] * (ncp / ST_LANE);
        a.dx[c] = act->dx + tr[c] * (ncp / ST_LANE);
    }
    ROWS_BY_TYPE(row_iq, row, ahead, cols, &t, &a, res)
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "fused_avx2.h"

/* [32] bytes: -1 where bit i of `bits` is set, else +1 */
static inline __m256i sign_bytes(uint32_t bits) {
    const __m256i pick = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                          2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), pick);
    return _mm256_or_si256(_mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit),
                           _mm256_set1_epi8(1));
}

/* res[c] = row . activation row c, for NC tokens; cols a multiple of 256 */
ALWAYS_INLINE void avx2_row_iq(const int NC, const int qtype, const uint8_t *row, int64_t ahead,
                               int cols, const iq_tables *t, const int8_t *const *q,
                               const float *const *dx, float *res) {
    const int bytes = st_type_size(qtype);
    __m256 acc[3];
    for (int c = 0; c < NC; c++) acc[c] = _mm256_setzero_ps();
    float a16[16];                                              /* [16] scales per 16 columns */
    for (int ib = 0; ib < cols / 256; ib++) {
        const uint8_t *blk = row + (int64_t)ib * bytes;
        st_prefetch(blk + ahead, bytes);
        st_iq_scales(qtype, blk, a16);
        for (int b = 0; b < 8; b++) {                           /* groups 2b, 2b + 1 */
            uint64_t v[4];
            const uint32_t signs = values32(qtype, blk, b, t, v);
            const __m256i g = _mm256_set_epi64x((long long)v[3], (long long)v[2],   /* [32] */
                                                (long long)v[1], (long long)v[0]);
            const int k = ib * 256 + 32 * b;
            if (has_signs(qtype))
                piece_sign_mask(NC, g, sign_bytes(signs), two_groups(a16, 2 * b), k, q, dx,
                                acc);
            else
                piece_signed(NC, g, two_groups(a16, 2 * b), k, q, dx, acc);
        }
    }
    for (int c = 0; c < NC; c++) res[c] = hsum8(acc[c]);
}

int st_fused_iq_row(int qtype, const uint8_t *row, int64_t ahead, int cols, const st_act *act,
                    const int64_t *tr, int n_tok, float *res) {
    if (!is_grid_iq(qtype) || cols % 256 != 0 || n_tok < 1 || n_tok > 3) return 0;
    const int ncp = act->cols_pad;
    const iq_tables t = {st_iq_grid_table(qtype), st_iq_ksigns_table(), st_iq1_values_table()};
    const int8_t *q[3];
    const float *dx[3];
    for (int c = 0; c < n_tok; c++) {
        q[c] = act->q + tr[c] * ncp;
        dx[c] = act->dx + tr[c] * (ncp / ST_LANE);
    }
    ROWS_BY_TYPE(avx2_row_iq, row, ahead, cols, &t, q, dx, res)
}

#else

int st_fused_iq_row(int qtype, const uint8_t *row, int64_t ahead, int cols, const st_act *act,
                    const int64_t *tr, int n_tok, float *res) {
    (void)qtype; (void)row; (void)ahead; (void)cols; (void)act; (void)tr; (void)n_tok; (void)res;
    return 0;
}

#endif
