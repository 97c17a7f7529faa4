/* The grid i-quants' products (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S) on AVX2
 * (every x86 build): one weight row x 1-4 tokens of an ST_ACT_K act (one scale dk per 256
 * columns), straight from the super-blocks, at every token count (fused_k.c's st_fused_k_rows
 * calls st_iq_rows; the rows of the 1-3 bit files that put a Qwen3-235B-A22B in 64-96 GB of RAM).
 *
 * Per 32 columns (`values32`) the grid entries go straight into a vector (4 table loads of 8
 * bytes, or IQ3's 8 of 4), at indices that `indices32` computes a super-block at a time where
 * they take bits from two places, with, for IQ2_* / IQ3_*, their signs as +-1 bytes (the 7-bit
 * patterns of IQ2_XXS / IQ3_XXS from a table of 8 bytes each; IQ2_S / IQ3_S's 32 stored bits
 * spread, and IQ2_XS's once their parity completes them), which sign the activations:
 * maddubs(grid, sign(q)); IQ1's values (8 g +- 1) come signed from its [delta sign][index]
 * table and lend their signs to q the same way. The pairs' sums times the scales' integer factors
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
static inline uint64_t iq3_pair(const int8_t *grid, uint32_t e0, uint32_t e1) {
    return (uint64_t)st_iq_u32((const uint8_t *)grid + 4 * e0)
           | (uint64_t)st_iq_u32((const uint8_t *)grid + 4 * e1) << 32;
}

/* 32 IQ3 values: the 4-value grid entries at idx[0 .. 7] */
static inline __m256i iq3_grid32(const int8_t *grid, const uint32_t *idx) {
    const uint8_t *g = (const uint8_t *)grid;
    return _mm256_setr_epi32((int)st_iq_u32(g + 4 * idx[0]), (int)st_iq_u32(g + 4 * idx[1]),
                             (int)st_iq_u32(g + 4 * idx[2]), (int)st_iq_u32(g + 4 * idx[3]),
                             (int)st_iq_u32(g + 4 * idx[4]), (int)st_iq_u32(g + 4 * idx[5]),
                             (int)st_iq_u32(g + 4 * idx[6]), (int)st_iq_u32(g + 4 * idx[7]));
}

typedef struct {
    const int8_t *grid;     /* st_iq_grid_table(qtype) */
    const uint64_t *ks;     /* [128] sign patterns as 8 bytes of +-1 */
    const uint64_t *iq1;    /* [2][2048] IQ1 values */
} iq_tables;

/* st_type_size(qtype), a constant in each row */
static inline int iq_bytes(int qtype) {
    switch (qtype) {
    case ST_IQ2_XXS: return 66;
    case ST_IQ2_XS: return 74;
    case ST_IQ2_S: return 82;
    case ST_IQ3_XXS: return 98;
    case ST_IQ3_S: return 110;
    case ST_IQ1_S: return 50;
    default: return 56;  /* ST_IQ1_M */
    }
}

/* the types whose signs are 7-bit pattern indices (ksigns), and those with a scale per 32 */
static inline int has_ksigns(int qtype) {
    return qtype == ST_IQ2_XXS || qtype == ST_IQ3_XXS;
}

static inline int scale_per32(int qtype) {
    return qtype == ST_IQ2_XXS || qtype == ST_IQ3_XXS || qtype == ST_IQ3_S || qtype == ST_IQ1_S;
}

/* the types whose grid indices take bits from two places (IQ2_XS's sign index too): all 32 of a
 * super-block's computed at once by indices32, for values32 to load */
static inline int has_indices(int qtype) {
    return qtype == ST_IQ2_XS || qtype == ST_IQ2_S || qtype == ST_IQ1_S || qtype == ST_IQ1_M;
}

/* gi[32]: the grid indices of super-block blk (IQ1_M's with the delta's sign as bit 11, its
 * table's second half); sb[32]: IQ2_XS's signs, 8 a byte (bit i: value i negated), from the 7
 * stored bits and their parity (st_set_iq_ksigns holds gguf's patterns to that rule). Vector
 * operations on 8-16 indices at a time, where values32 spent 3-6 scalar ones on each (the bits
 * read are st_unpack_iq's) */
static inline __attribute__((always_inline)) void indices32(const int qtype, const uint8_t *blk,
                                                            uint16_t *gi, uint8_t *sb) {
    if (qtype == ST_IQ2_XS) {  /* u16: 9-bit grid index | 7 sign bits << 9 */
        /* the 8th sign makes the count of negatives even: bit 7 set where the 7 bits' parity,
         * that of the nibble s ^ (s >> 4), is odd */
        const __m256i odd = _mm256_setr_epi8(0, -128, -128, 0, -128, 0, 0, -128,
                                             -128, 0, 0, -128, 0, -128, -128, 0,
                                             0, -128, -128, 0, -128, 0, 0, -128,
                                             -128, 0, 0, -128, 0, -128, -128, 0);
        __m256i s8[2];
        for (int h = 0; h < 2; h++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(blk + 2 + 32 * h));
            _mm256_storeu_si256((__m256i *)(gi + 16 * h),
                                _mm256_and_si256(q, _mm256_set1_epi16(511)));
            const __m256i s7 = _mm256_srli_epi16(q, 9);
            const __m256i nib = _mm256_and_si256(_mm256_xor_si256(s7, _mm256_srli_epi16(s7, 4)),
                                                 _mm256_set1_epi16(15));
            s8[h] = _mm256_or_si256(s7, _mm256_shuffle_epi8(odd, nib));  /* [16] u16 < 256 */
        }
        /* packus interleaves the lanes: [0..7 16..23 8..15 24..31] back into order */
        _mm256_storeu_si256((__m256i *)sb, _mm256_permute4x64_epi64(
            _mm256_packus_epi16(s8[0], s8[1]), _MM_SHUFFLE(3, 1, 2, 0)));
    } else if (qtype == ST_IQ2_S) {  /* index byte k | bits 2 (k % 4) .. + 1 of qh[k / 4] << 8 */
        const __m128i spread = _mm_setr_epi8(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
        const __m256i up = _mm256_setr_epi16(256, 64, 16, 4, 256, 64, 16, 4,
                                             256, 64, 16, 4, 256, 64, 16, 4);
        for (int h = 0; h < 2; h++) {
            const __m128i qh = _mm_shuffle_epi8(_mm_cvtsi32_si128((int)st_iq_u32(blk + 66 + 4 * h)),
                                                spread);
            const __m256i hi = _mm256_and_si256(_mm256_mullo_epi16(_mm256_cvtepu8_epi16(qh), up),
                                                _mm256_set1_epi16(0x300));
            const __m256i lo =
                _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(blk + 2 + 16 * h)));
            _mm256_storeu_si256((__m256i *)(gi + 16 * h), _mm256_or_si256(lo, hi));
        }
    } else if (qtype == ST_IQ1_S) {
        /* index byte k | bits 3 (k % 4) .. + 2 of u16 qh[k / 4] << 8 | its bit 15 (the delta's
         * sign) << 11: 8 at a time, each qh repeated 4 times, shifted left by 8, 5, 2 (mullo)
         * or right by 1 (mulhi) */
        const __m128i mlo = _mm_setr_epi16(256, 32, 4, 0, 256, 32, 4, 0);
        const __m128i mhi = _mm_setr_epi16(0, 0, 0, -32768, 0, 0, 0, -32768);
        const __m128i spread = _mm_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3);
        for (int h = 0; h < 4; h++) {
            const __m128i qh = _mm_shuffle_epi8(_mm_cvtsi32_si128((int)st_iq_u32(blk + 34 + 4 * h)),
                                                spread);
            const __m128i bits = _mm_and_si128(
                _mm_or_si128(_mm_mullo_epi16(qh, mlo), _mm_mulhi_epu16(qh, mhi)),
                _mm_set1_epi16(0x700));
            const __m128i delta = _mm_and_si128(_mm_srli_epi16(qh, 4), _mm_set1_epi16(0x800));
            const __m128i qs =
                _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(blk + 2 + 8 * h)));
            _mm_storeu_si128((__m128i *)(gi + 8 * h), _mm_or_si128(qs, _mm_or_si128(bits, delta)));
        }
    } else {  /* ST_IQ1_M: index byte k | nibble k of qh << 8 (3 index bits, the delta's sign) */
        const __m128i qh = _mm_loadu_si128((const __m128i *)(blk + 32));
        const __m128i m4 = _mm_set1_epi8(15);
        const __m128i lo = _mm_and_si128(qh, m4), hi = _mm_and_si128(_mm_srli_epi16(qh, 4), m4);
        const __m128i nib[2] = {_mm_unpacklo_epi8(lo, hi), _mm_unpackhi_epi8(lo, hi)};
        for (int h = 0; h < 2; h++) {
            const __m128i qs = _mm_loadu_si128((const __m128i *)(blk + 16 * h));
            _mm_storeu_si128((__m128i *)(gi + 16 * h), _mm_unpacklo_epi8(qs, nib[h]));
            _mm_storeu_si128((__m128i *)(gi + 16 * h + 8), _mm_unpackhi_epi8(qs, nib[h]));
        }
    }
}

/* Columns 32 b .. 32 b + 31 of super-block blk: v[4] x 8 values; for the ksigns types s[4] x 8
 * bytes of +-1 (llama.cpp's keven_signs), for IQ2_S / IQ3_S their 32 sign bits returned (bit i:
 * value i negated); IQ2_* / IQ3_* give magnitudes in v, IQ1_* signed values. The bits read are
 * those of quant_ref.c's st_unpack_iq. */
static inline __attribute__((always_inline)) uint32_t values32(
        const int qtype, const int by32, const uint8_t *blk, int b, const iq_tables *t,
        const uint16_t *gi, const uint8_t *sb, uint64_t *v, __m256i *g3, uint64_t *s) {
    uint32_t signs = 0;
    switch (qtype) {
    case ST_IQ2_XXS: {  /* 4 grid bytes, then 4 x 7 sign-index bits | scale << 28 */
        const uint8_t *p = blk + 2 + 8 * b;
        const uint32_t aux = st_iq_u32(p + 4);
        for (int l = 0; l < 4; l++) {
            v[l] = u64_at(t->grid + 8 * (size_t)p[l]);
            s[l] = t->ks[(aux >> (7 * l)) & 127];
        }
        break;
    }
    case ST_IQ2_XS:  /* indices32's grid indices and sign bytes */
        for (int l = 0; l < 4; l++) v[l] = u64_at(t->grid + 8 * (size_t)gi[4 * b + l]);
        signs = st_iq_u32(sb + 4 * b);
        break;
    case ST_IQ2_S:  /* indices32's; one sign byte per 8 values */
        for (int l = 0; l < 4; l++) v[l] = u64_at(t->grid + 8 * (size_t)gi[4 * b + l]);
        signs = st_iq_u32(blk + 34 + 4 * b);
        break;
    case ST_IQ3_XXS: {  /* 8 grid bytes (4 values each), then 4 x 7 sign-index bits */
        const uint8_t *p = blk + 2 + 8 * b;
        const uint32_t aux = st_iq_u32(blk + 66 + 4 * b);
        const uint32_t idx[8] = {p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7]};
        if (by32) *g3 = iq3_grid32(t->grid, idx);
        for (int l = 0; l < 4; l++) {
            if (!by32) v[l] = iq3_pair(t->grid, idx[2 * l], idx[2 * l + 1]);
            s[l] = t->ks[(aux >> (7 * l)) & 127];
        }
        break;
    }
    case ST_IQ3_S: {  /* index byte | bit l of qh << 8 (4 values each); one sign byte per 8 */
        const __m256i lo =
            _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 2 + 8 * b)));
        const __m256i hi = _mm256_and_si256(
            _mm256_sllv_epi32(_mm256_set1_epi32(blk[66 + b]),
                              _mm256_setr_epi32(8, 7, 6, 5, 4, 3, 2, 1)),
            _mm256_set1_epi32(256));
        uint32_t idx[8];
        _mm256_storeu_si256((__m256i *)idx, _mm256_or_si256(lo, hi));
        *g3 = iq3_grid32(t->grid, idx);  /* iq3_by32: always */
        signs = st_iq_u32(blk + 74 + 4 * b);
        break;
    }
    default:  /* ST_IQ1_S, ST_IQ1_M: indices32's, the delta's sign picking the table's half */
        for (int l = 0; l < 4; l++) v[l] = t->iq1[gi[4 * b + l]];
        break;
    }
    return signs;
}

/* IQ3 rows: 32 values a vector from 8 grid loads (iq3_grid32: more shuffles, fewer scalar
 * operations) rather than 4 pairs of them (iq3_pair); the first wins where the indices cost
 * the most, IQ3_S's (9 bits), and at 1-2 tokens, where the products leave the vector ports free */
static inline int iq3_by32(int NC, int qtype) {
    return qtype == ST_IQ3_S || (qtype == ST_IQ3_XXS && NC <= 2);
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
    const int bytes = iq_bytes(qtype);
    __m256 acc[4];
    for (int c = 0; c < NC; c++) acc[c] = _mm256_setzero_ps();
    for (int ib = 0; ib < cols / 256; ib++) {
        const uint8_t *blk = row + (int64_t)ib * bytes;
        st_prefetch(blk + ahead, bytes);
        int16_t sc[16];
        const float m = st_iq_int_scales(qtype, blk, sc);
        uint16_t gi[32];
        uint8_t sb[32];
        if (has_indices(qtype)) indices32(qtype, blk, gi, sb);
        __m256i isum[4];
        for (int c = 0; c < NC; c++) isum[c] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int b = 0; b < 8; b++) {
            uint64_t v[4], s4[4];
            __m256i g3 = _mm256_setzero_si256();
            const int by32 = iq3_by32(NC, qtype);
            const uint32_t signs = values32(qtype, by32, blk, b, tb, gi, sb, v, &g3, s4);
            const __m256i g = by32 ? g3
                : _mm256_set_epi64x((long long)v[3], (long long)v[2], (long long)v[1],
                                    (long long)v[0]);
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

/* rows [rb, rb + nr) of one type and token count, both constants: the type's switches fold
 * away, and the tables and the switch cost once a block */
ALWAYS_INLINE void rows_iq(const int NC, const int qtype, const uint8_t *w, int64_t row_bytes,
                           int cols, int64_t rb, int nr, const st_k_tokens *t, float *out,
                           int64_t ld_out) {
    const iq_tables tb = {st_iq_grid_table(qtype), st_iq_ksigns_pm1_table(), st_iq1_values_table()};
    const int64_t ahead = ST_PREFETCH_ROWS * row_bytes;
    for (int i = 0; i < nr; i++) {
        float res[4];
        row_iq(NC, qtype, w + (rb + i) * row_bytes, ahead, cols, &tb, t, res);
        for (int c = 0; c < NC; c++) out[c * ld_out + i] = res[c];
    }
}

#define IQ_BY_TOKENS(T)                                                                        \
    do {                                                                                       \
        if (n_tok == 1) rows_iq(1, T, w, row_bytes, cols, rb, nr, t, out, ld_out);             \
        else if (n_tok == 2) rows_iq(2, T, w, row_bytes, cols, rb, nr, t, out, ld_out);        \
        else if (n_tok == 3) rows_iq(3, T, w, row_bytes, cols, rb, nr, t, out, ld_out);        \
        else rows_iq(4, T, w, row_bytes, cols, rb, nr, t, out, ld_out);                        \
    } while (0)

void st_iq_rows(int qtype, const uint8_t *w, int64_t row_bytes, int cols, int64_t rb, int nr,
                const st_k_tokens *t, int n_tok, float *out, int64_t ld_out) {
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
