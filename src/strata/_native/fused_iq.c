/* The grid i-quants' products (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S) on AVX2
 * (every x86 build): one weight row x 1-4 tokens of an ST_ACT_K act (one scale dk per 256
 * columns), straight from the super-blocks, at every token count (fused_k.c's st_fused_k_rows
 * calls st_iq_row; the rows of the 1-3 bit files that put a Qwen3-235B-A22B in 64-96 GB of RAM).
 *
 * Per 32 columns (`values32`) the grid entries go straight into a vector (4 table loads of 8
 * bytes) with, for IQ2_* / IQ3_*, their signs as +-1 bytes (the 7-bit patterns of IQ2_XXS /
 * IQ2_XS / IQ3_XXS from a table of 8 bytes each; IQ2_S / IQ3_S's 32 stored bits spread), which
 * sign the activations: maddubs(grid, sign(q)); IQ1's values (8 g +- 1) come signed from its [delta sign][index] table
 * and lend their signs to q the same way. The pairs' sums times the scales' integer factors
 * (iq_scales.h: 2 ls + 1 and the like) add up in int32 over the super-block, and convert once:
 *   acc += m * dk * sum_i sc[g] * y[i] * q[i]
 * (llama.cpp's Q8_K dots), where before session 100 the rows scaled the activations per 32
 * columns and converted, scaled and FMA'd every 32. Each token's arithmetic is its own, so a
 * token's result never depends on the tokens beside it. NEON builds take fused_k_neon.h's
 * row_iq_grid, the others fused_k.c's portable rows, both on st_iq_superblock. */
#include <string.h>
#include "quant.h"
#include "iq_scales.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "kdot_avx2.h"
#include "lane_sum.h"

static inline uint64_t u64_at(const int8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

/* 8 IQ3 values: grid entries e0 and e1 (4 values each) */
static inline uint64_t iq3_pair(const int8_t *grid, int e0, int e1) {
    return (uint64_t)st_iq_u32((const uint8_t *)grid + 4 * e0)
           | (uint64_t)st_iq_u32((const uint8_t *)grid + 4 * e1) << 32;
}

typedef struct {
    const int8_t *grid;     /* st_iq_grid_table(qtype) */
    const uint64_t *ks;     /* [128] sign patterns as 8 bytes of +-1 */
    const uint64_t *iq1;    /* [2][2048] IQ1 values */
} iq_tables;

/* the types whose signs are 7-bit pattern indices (ksigns), and those with a scale per 32 */
static inline int has_ksigns(int qtype) {
    return qtype == ST_IQ2_XXS || qtype == ST_IQ2_XS || qtype == ST_IQ3_XXS;
}

static inline int scale_per32(int qtype) {
    return qtype == ST_IQ2_XXS || qtype == ST_IQ3_XXS || qtype == ST_IQ3_S || qtype == ST_IQ1_S;
}

/* Columns 32 b .. 32 b + 31 of super-block blk: v[4] x 8 values; for the ksigns types s[4] x 8
 * bytes of +-1 (llama.cpp's keven_signs), for IQ2_S / IQ3_S their 32 sign bits returned (bit i:
 * value i negated); IQ2_* / IQ3_* give magnitudes in v, IQ1_* signed values. The bits read are
 * those of quant_ref.c's st_unpack_iq. */
static inline __attribute__((always_inline)) uint32_t values32(
        const int qtype, const uint8_t *blk, int b, const iq_tables *t, uint64_t *v,
        uint64_t *s) {
    uint32_t signs = 0;
    switch (qtype) {
    case ST_IQ2_XXS: {  /* 4 grid bytes, then 4 x 7 sign-index bits | scale << 28 */
        const uint8_t *p = blk + 2 + 8 * b;
        const uint32_t aux = st_iq_u32(p + 4);
        for (int l = 0; l < 4; l++) {
            v[l] = u64_at(t->grid + 8 * p[l]);
            s[l] = t->ks[(aux >> (7 * l)) & 127];
        }
        break;
    }
    case ST_IQ2_XS:  /* u16: 9-bit grid index | 7-bit sign index */
        for (int l = 0; l < 4; l++) {
            const uint16_t w = st_iq_u16(blk + 2 + 8 * b + 2 * l);
            v[l] = u64_at(t->grid + 8 * (w & 511));
            s[l] = t->ks[w >> 9];
        }
        break;
    case ST_IQ2_S: {  /* index byte | 2 bits of qh << 8; one sign byte per 8 values */
        const uint8_t qh = blk[66 + b];
        for (int l = 0; l < 4; l++)
            v[l] = u64_at(t->grid + 8 * (blk[2 + 4 * b + l] | (((qh >> (2 * l)) & 3) << 8)));
        signs = st_iq_u32(blk + 34 + 4 * b);
        break;
    }
    case ST_IQ3_XXS: {  /* 8 grid bytes (4 values each), then 4 x 7 sign-index bits */
        const uint8_t *p = blk + 2 + 8 * b;
        const uint32_t aux = st_iq_u32(blk + 66 + 4 * b);
        for (int l = 0; l < 4; l++) {
            v[l] = iq3_pair(t->grid, p[2 * l], p[2 * l + 1]);
            s[l] = t->ks[(aux >> (7 * l)) & 127];
        }
        break;
    }
    case ST_IQ3_S: {  /* index byte | bit of qh << 8 (4 values); one sign byte per 8 */
        const uint8_t qh = blk[66 + b];
        const uint8_t *p = blk + 2 + 8 * b;
        for (int l = 0; l < 4; l++)
            v[l] = iq3_pair(t->grid, p[2 * l] | (((qh >> (2 * l)) & 1) << 8),
                            p[2 * l + 1] | (((qh >> (2 * l + 1)) & 1) << 8));
        signs = st_iq_u32(blk + 74 + 4 * b);
        break;
    }
    case ST_IQ1_S: {  /* index byte | 3 bits of qh << 8; the delta's sign in bit 15 */
        const uint16_t qh = st_iq_u16(blk + 34 + 2 * b);
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

static inline int has_signs(int qtype) { return qtype != ST_IQ1_S && qtype != ST_IQ1_M; }

/* [32] bytes: -1 where bit i of `bits` is set, else +1 */
static inline __m256i sign_bytes(uint32_t bits) {
    const __m256i pick = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                          2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), pick);
    return _mm256_or_si256(_mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit),
                           _mm256_set1_epi8(1));
}

/* res[c] = row . token c, for NC tokens; cols a multiple of 256. Per 32 columns b: u [32]
 * magnitudes (<= 62, so a pair of products stays below 32768), s [32] the signs they give q,
 * f [16] int16 factors, groups 2b (low lane) and 2b + 1 (high lane). */
ALWAYS_INLINE void row_iq(const int NC, const int qtype, const uint8_t *row, int64_t ahead,
                          int cols, const iq_tables *tb, const st_k_tokens *t, float *res) {
    const int bytes = st_type_size(qtype);
    __m256 acc[4];
    for (int c = 0; c < NC; c++) acc[c] = _mm256_setzero_ps();
    for (int ib = 0; ib < cols / 256; ib++) {
        const uint8_t *blk = row + (int64_t)ib * bytes;
        st_prefetch(blk + ahead, bytes);
        int16_t sc[16];
        const float m = st_iq_int_scales(qtype, blk, sc);
        __m256i isum[4];
        for (int c = 0; c < NC; c++) isum[c] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int b = 0; b < 8; b++) {
            uint64_t v[4], s4[4];
            const uint32_t signs = values32(qtype, blk, b, tb, v, s4);
            const __m256i g = _mm256_set_epi64x((long long)v[3], (long long)v[2],
                                                (long long)v[1], (long long)v[0]);
            const __m256i u = has_signs(qtype) ? g : _mm256_sign_epi8(g, g);
            const __m256i s = has_ksigns(qtype)
                ? _mm256_set_epi64x((long long)s4[3], (long long)s4[2], (long long)s4[1],
                                    (long long)s4[0])
                : has_signs(qtype) ? sign_bytes(signs) : g;
            const __m256i f = scale_per32(qtype)
                ? _mm256_set1_epi16(sc[2 * b])
                : _mm256_set_m128i(_mm_set1_epi16(sc[2 * b + 1]), _mm_set1_epi16(sc[2 * b]));
            for (int c = 0; c < NC; c++)
                isum[c] = kdot_add(isum[c], u, _mm256_sign_epi8(q_at(t, c, ib * 256 + 32 * b), s),
                                   f);
        }
        k_finish(NC, t, ib, isum, NULL, m, 0.0f, acc);
    }
    for (int c = 0; c < NC; c++) res[c] = hsum8(acc[c]);
}

/* each row with its type and token count constants: the type's switches fold away */
#define IQ_BY_TOKENS(T)                                                                        \
    do {                                                                                       \
        if (n_tok == 1) row_iq(1, T, row, ahead, cols, &tb, t, res);                           \
        else if (n_tok == 2) row_iq(2, T, row, ahead, cols, &tb, t, res);                      \
        else if (n_tok == 3) row_iq(3, T, row, ahead, cols, &tb, t, res);                      \
        else row_iq(4, T, row, ahead, cols, &tb, t, res);                                      \
    } while (0)

void st_iq_row(int qtype, const uint8_t *row, int64_t ahead, int cols, const st_k_tokens *t,
               int n_tok, float *res) {
    const iq_tables tb = {st_iq_grid_table(qtype), st_iq_ksigns_pm1_table(), st_iq1_values_table()};
    switch (qtype) {
    case ST_IQ2_XXS: IQ_BY_TOKENS(ST_IQ2_XXS); break;
    case ST_IQ2_XS: IQ_BY_TOKENS(ST_IQ2_XS); break;
    case ST_IQ2_S: IQ_BY_TOKENS(ST_IQ2_S); break;
    case ST_IQ3_XXS: IQ_BY_TOKENS(ST_IQ3_XXS); break;
    case ST_IQ3_S: IQ_BY_TOKENS(ST_IQ3_S); break;
    case ST_IQ1_S: IQ_BY_TOKENS(ST_IQ1_S); break;
    default: IQ_BY_TOKENS(ST_IQ1_M);
    }
}
#undef IQ_BY_TOKENS

/* Many tokens (matmul.c: 8 and more) against the same rows: each row's super-blocks decoded
 * once (st_iq_superblock) into scratch, [nr] x (y [cols] int8, sc [cols / 16] int16,
 * m [cols / 256] float), then 4 tokens a pass over the integers. The products are row_iq's:
 * |y| is its grid magnitude and q signed by y its signed q (where y is 0 both products are 0),
 * in the same lanes, summed in int32 (exact in any order) and converted per super-block in the same steps, so a token's
 * result is bit for bit the one it gets from row_iq in a smaller batch. */
static inline int64_t unpacked_row_bytes(int cols) {
    return (int64_t)cols + cols / 16 * 2 + cols / 256 * 4;
}

int st_iq_unpack_rows(int qtype, const uint8_t *w, int64_t row_bytes, int cols, int64_t rb,
                      int nr, void *scratch) {
    if (!st_is_grid_iq(qtype)) return 0;
    const int bytes = st_type_size(qtype);
    for (int i = 0; i < nr; i++) {
        const uint8_t *row = w + (rb + i) * row_bytes;
        int8_t *y = (int8_t *)scratch + i * unpacked_row_bytes(cols);
        int16_t *sc = (int16_t *)(y + cols);
        float *m = (float *)(sc + cols / 16);
        for (int ib = 0; ib < cols / 256; ib++) {
            float mb = st_iq_superblock(qtype, row + (int64_t)ib * bytes, y + 256 * ib,
                                        sc + 16 * ib);
            memcpy(m + ib, &mb, 4);
        }
    }
    return 1;
}

ALWAYS_INLINE void unpacked_row(const int NC, const int8_t *y, int cols, const st_k_tokens *t,
                                float *res) {
    const int16_t *sc = (const int16_t *)(y + cols);
    const uint8_t *m = (const uint8_t *)(sc + cols / 16);
    __m256 acc[4];
    for (int c = 0; c < NC; c++) acc[c] = _mm256_setzero_ps();
    for (int ib = 0; ib < cols / 256; ib++) {
        __m256i isum[4];
        for (int c = 0; c < NC; c++) isum[c] = _mm256_setzero_si256();
        for (int b = 0; b < 8; b++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(y + 256 * ib + 32 * b));
            const __m256i u = _mm256_sign_epi8(v, v);
            const __m256i f = _mm256_set_m128i(_mm_set1_epi16(sc[16 * ib + 2 * b + 1]),
                                               _mm_set1_epi16(sc[16 * ib + 2 * b]));
            for (int c = 0; c < NC; c++)
                isum[c] = kdot_add(isum[c], u, _mm256_sign_epi8(q_at(t, c, ib * 256 + 32 * b), v),
                                   f);
        }
        float mb;
        memcpy(&mb, m + 4 * ib, 4);
        k_finish(NC, t, ib, isum, NULL, mb, 0.0f, acc);
    }
    for (int c = 0; c < NC; c++) res[c] = hsum8(acc[c]);
}

void st_iq_unpacked_rows(const void *scratch, int cols, int nr, const st_act *act,
                         const int32_t *tok, int64_t tok0, int n_tok, float *out, int64_t ld_out) {
    st_k_tokens tk;
    const st_k_tokens *t = &tk;
    st_k_tokens_at(act, tok, tok0, n_tok, &tk);
    float res[4];
    for (int i = 0; i < nr; i++) {
        const int8_t *y = (const int8_t *)scratch + i * unpacked_row_bytes(cols);
        if (n_tok == 1) unpacked_row(1, y, cols, t, res);
        else if (n_tok == 2) unpacked_row(2, y, cols, t, res);
        else if (n_tok == 3) unpacked_row(3, y, cols, t, res);
        else unpacked_row(4, y, cols, t, res);
        for (int c = 0; c < n_tok; c++) out[c * ld_out + i] = res[c];
    }
}

#else

int st_iq_unpack_rows(int qtype, const uint8_t *w, int64_t row_bytes, int cols, int64_t rb,
                      int nr, void *scratch) {
    (void)qtype; (void)w; (void)row_bytes; (void)cols; (void)rb; (void)nr; (void)scratch;
    return 0;  /* fused_k.c's portable rows decode each row per pass */
}

void st_iq_unpacked_rows(const void *scratch, int cols, int nr, const st_act *act,
                         const int32_t *tok, int64_t tok0, int n_tok, float *out, int64_t ld_out) {
    (void)scratch; (void)cols; (void)nr; (void)act; (void)tok; (void)tok0; (void)n_tok;
    (void)out; (void)ld_out;
}

#endif
