/* Decode-shaped dot products (1-3 tokens, 1-4 in the AVX2 rows) straight from k-quant
 * super-blocks (Q2_K .. Q6_K, IQ4_XS) with AVX-512 VNNI or with AVX2; the layouts are those of
 * quant_ref.c's unpack_blocks. */
#include "quant.h"

#if defined(__AVX2__)
#include <immintrin.h>
/* v with `value` added (or-ed) in the bytes whose bit n of `bits` is set: a k-quant's extra
 * bit (Q3_K's hmask, Q5_K's qh) joining its low bits */
static inline __m256i or_where_bit(__m256i v, __m256i bits, int n, __m256i value) {
    const __m256i b = _mm256_set1_epi8((char)(1 << n));
    return _mm256_or_si256(v, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(bits, b), b),
                                               value));
}

/* byte-wise bit n of `bits` moved to bit `to` (value: 1 << to in every byte), 0 elsewhere:
 * or_where_bit's term in one shift and one and, for the AVX2 rows (n, to constants there) */
static inline __m256i bit_to(__m256i bits, int n, int to, __m256i value) {
    return _mm256_and_si256(n <= to ? _mm256_slli_epi16(bits, to - n)
                                    : _mm256_srli_epi16(bits, n - to), value);
}

/* byte-wise (v >> n) & 3 of 32 bytes */
static inline __m256i two_bits(__m256i v, int n) {
    return _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(n)), _mm256_set1_epi8(3));
}
#endif

#if defined(ST_USE_VNNI512) && defined(__F16C__)
#include "fused_avx512.h"

/* 4 words just computed in scalar registers as one vector, built in registers: a 16-byte load
 * of the 4 stores would wait for store forwarding to fail (docs/DEVELOPING.md) */
static inline __m128i words4(const uint32_t *w) {
    return _mm_setr_epi32((int)w[0], (int)w[1], (int)w[2], (int)w[3]);
}

static inline __m512i join256(__m256i lo, __m256i hi) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

/* super-block ib of a row of `bytes`-byte super-blocks, the row ST_PREFETCH_ROWS ahead asked for */
static inline const uint8_t *superblock(const uint8_t *row, int ib, int bytes, int64_t ahead) {
    const uint8_t *blk = row + (int64_t)ib * bytes;
    st_prefetch(blk + ahead, bytes);
    return blk;
}

ALWAYS_INLINE void row_q45k(const int NC, int is_q5, const uint8_t *row, int64_t ahead,
                            int cols, const act_rows *a, float *res) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), sixteen = _mm256_set1_epi8(16);
    /* lanes of a 64-column chunk: 8 of sub-block 2j, then 8 of 2j + 1 */
    const __m512i halves = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    /* group g (16 columns) has the min of sub-block g / 2, at 8 + g / 2 in ab */
    const __m512i pairs = _mm512_setr_epi32(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14,
                                            15, 15);
    __m512 acc[3];
    float B[cols / ST_GROUP];  /* dmin * m per 16-column group, as the tiles' B */
    for (int c = 0; c < NC; c++) acc[c] = _mm512_setzero_ps();
    for (int ib = 0; ib < cols / 256; ib++) {
        const uint8_t *blk = superblock(row, ib, is_q5 ? 176 : 144, ahead);
        const float d = fp16_at(blk), dmin = fp16_at(blk + 2);
        const uint8_t *qs = blk + (is_q5 ? 48 : 16);
        const __m256i qh = is_q5 ? _mm256_loadu_si256((const __m256i *)(blk + 16))
                                 : _mm256_setzero_si256();
        /* the 12 scale bytes to [sc 0..7, m 0..7] (llama.cpp's utmp shuffle), then floats:
         * ab = [d * sc (8) | dmin * m (8)] */
        uint32_t utmp[4];
        memcpy(utmp, blk + 4, 12);
        utmp[3] = ((utmp[2] >> 4) & 0x0f0f0f0fu) | (((utmp[1] >> 6) & 0x03030303u) << 4);
        const uint32_t mins_lo = utmp[1] & 0x3f3f3f3fu;
        utmp[1] = (utmp[2] & 0x0f0f0f0fu) | (((utmp[0] >> 6) & 0x03030303u) << 4);
        utmp[2] = mins_lo;
        utmp[0] &= 0x3f3f3f3fu;
        /* (a load of the 4 stores: built in registers instead, as Q3_K's, it measured no
         * faster here, docs/offload.md) */
        const __m512 sc_m = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
            _mm_loadu_si128((const __m128i *)utmp)));
        const __m512 ab = _mm512_mul_ps(sc_m, _mm512_insertf32x8(_mm512_set1_ps(d),
                                                                 _mm256_set1_ps(dmin), 1));
        for (int j = 0; j < 4; j++) {
            __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
            __m256i lo = _mm256_and_si256(q, low4);                          /* sub-block 2j */
            __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);    /* 2j + 1 */
            if (is_q5) {
                lo = or_where_bit(lo, qh, 2 * j, sixteen);
                hi = or_where_bit(hi, qh, 2 * j + 1, sixteen);
            }
            __m512 scale = _mm512_permutexvar_ps(
                _mm512_add_epi32(halves, _mm512_set1_epi32(2 * j)), ab);    /* [16] */
            chunk(NC, join256(lo, hi), scale, ib * 256 + 64 * j, -1, a, acc);
        }
        _mm512_storeu_ps(B + ib * 16, _mm512_permutexvar_ps(pairs, ab));  /* dmin * m */
    }
    /* the mins, sum over groups of dmin * m * dx * sum(q), in the tiles' order (st_min_term):
     * a token's result does not depend on the tokens beside it */
    for (int c = 0; c < NC; c++) {
        res[c] = _mm512_reduce_add_ps(acc[c]);
        res[c] -= st_min_term(B, a->xs[c], cols / ST_GROUP);
    }
}

ALWAYS_INLINE void row_q6k(const int NC, const uint8_t *row, int64_t ahead, int cols,
                           const act_rows *a, float *res) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), high2 = _mm256_set1_epi8(0x30);
    /* lane l of a 64-column chunk belongs to group l / 4 */
    const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    __m512 acc[3];
    for (int c = 0; c < NC; c++) acc[c] = _mm512_setzero_ps();
    for (int ib = 0; ib < cols / 256; ib++) {
        const uint8_t *blk = superblock(row, ib, 210, ahead);
        const int8_t *scales = (const int8_t *)(blk + 192);
        const __m512 d = _mm512_set1_ps(fp16_at(blk + 208));
        /* [16] group scales d * sc[g] */
        const __m512 a16 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
            _mm_loadu_si128((const __m128i *)scales))));
        for (int n = 0; n < 2; n++) {
            __m256i ql0 = _mm256_loadu_si256((const __m256i *)(blk + 64 * n));
            __m256i ql1 = _mm256_loadu_si256((const __m256i *)(blk + 64 * n + 32));
            __m256i h = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * n));
            __m256i v0 = _mm256_or_si256(_mm256_and_si256(ql0, low4),
                                         _mm256_and_si256(_mm256_slli_epi16(h, 4), high2));
            __m256i v1 = _mm256_or_si256(_mm256_and_si256(ql1, low4),
                                         _mm256_and_si256(_mm256_slli_epi16(h, 2), high2));
            __m256i v2 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low4),
                                         _mm256_and_si256(h, high2));
            __m256i v3 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), low4),
                                         _mm256_and_si256(_mm256_srli_epi16(h, 2), high2));
            /* groups 8n .. 8n + 3, then 8n + 4 .. 8n + 7 */
            __m512 s0 = _mm512_permutexvar_ps(_mm512_add_epi32(spread, _mm512_set1_epi32(8 * n)), a16);
            __m512 s1 = _mm512_permutexvar_ps(_mm512_add_epi32(spread, _mm512_set1_epi32(8 * n + 4)), a16);
            /* u = s + 32: the correction is -32 * sum(q) = xc >> 2 */
            chunk(NC, join256(v0, v1), s0, ib * 256 + 128 * n, 2, a, acc);
            chunk(NC, join256(v2, v3), s1, ib * 256 + 128 * n + 64, 2, a, acc);
        }
    }
    for (int c = 0; c < NC; c++) res[c] = _mm512_reduce_add_ps(acc[c]);
}

/* Q2_K / Q3_K: 64-column chunk c (0..3) of a super-block holds 32-column blocks 2c and 2c + 1,
 * block b = 4h + j being the 2-bit values (qs[32h + l] >> 2j) & 3; lane l of the chunk has
 * the scale of 16-column group 4c + l / 4. Q2_K: u = those values, a scale and a min per group
 * (w = a * u - m). Q3_K: u = value + 4 where bit b of hmask[l] is set, w = a * (u - 4). */
ALWAYS_INLINE void row_q23k(const int NC, int is_q3, const uint8_t *row, int64_t ahead,
                            int cols, const act_rows *a, float *res) {
    const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const __m256i four = _mm256_set1_epi8(4);
    const int bytes = is_q3 ? 110 : 84;
    __m512 acc[3];
    float B[is_q3 ? 1 : cols / ST_GROUP];  /* Q2_K: dmin * m per group, as the tiles' B */
    for (int c = 0; c < NC; c++) acc[c] = _mm512_setzero_ps();
    for (int ib = 0; ib < cols / 256; ib++) {
        const uint8_t *blk = superblock(row, ib, bytes, ahead);
        __m512 a16, m16 = _mm512_setzero_ps();  /* [16] group scales (and Q2_K's mins) */
        __m256i hm = _mm256_setzero_si256();
        const uint8_t *qs;
        if (is_q3) {
            /* the 12 scale bytes to 16 six-bit scales in group order (llama.cpp's aux shuffle:
             * low 4 bits from bytes 0-7, high 2 from bytes 8-11), then d * (scale - 32) */
            uint32_t aux[4];
            memcpy(aux, blk + 96, 12);
            const uint32_t tmp = aux[2];
            aux[2] = ((aux[0] >> 4) & 0x0f0f0f0fu) | (((tmp >> 4) & 0x03030303u) << 4);
            aux[3] = ((aux[1] >> 4) & 0x0f0f0f0fu) | (((tmp >> 6) & 0x03030303u) << 4);
            aux[0] = (aux[0] & 0x0f0f0f0fu) | ((tmp & 0x03030303u) << 4);
            aux[1] = (aux[1] & 0x0f0f0f0fu) | (((tmp >> 2) & 0x03030303u) << 4);
            const __m512i sc = _mm512_sub_epi32(_mm512_cvtepu8_epi32(words4(aux)),
                                                _mm512_set1_epi32(32));
            a16 = _mm512_mul_ps(_mm512_set1_ps(fp16_at(blk + 108)), _mm512_cvtepi32_ps(sc));
            hm = _mm256_loadu_si256((const __m256i *)blk);
            qs = blk + 32;
        } else {
            const __m512i sm = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)blk));
            a16 = _mm512_mul_ps(_mm512_set1_ps(fp16_at(blk + 80)), _mm512_cvtepi32_ps(
                _mm512_and_si512(sm, _mm512_set1_epi32(15))));
            m16 = _mm512_mul_ps(_mm512_set1_ps(fp16_at(blk + 82)), _mm512_cvtepi32_ps(
                _mm512_srli_epi32(sm, 4)));
            qs = blk + 16;
        }
        for (int c = 0; c < 4; c++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * (c >> 1)));
            __m256i lo = two_bits(q, 4 * (c & 1)), hi = two_bits(q, 4 * (c & 1) + 2);
            if (is_q3) {
                lo = or_where_bit(lo, hm, 2 * c, four);
                hi = or_where_bit(hi, hm, 2 * c + 1, four);
            }
            __m512 scale = _mm512_permutexvar_ps(
                _mm512_add_epi32(spread, _mm512_set1_epi32(4 * c)), a16);
            /* Q3_K: u = s + 4, the correction -4 * sum(q) = xc >> 5 */
            chunk(NC, join256(lo, hi), scale, ib * 256 + 64 * c, is_q3 ? 5 : -1, a, acc);
        }
        if (!is_q3) _mm512_storeu_ps(B + ib * 16, m16);
    }
    for (int c = 0; c < NC; c++) {  /* the mins in the tiles' order (st_min_term) */
        res[c] = _mm512_reduce_add_ps(acc[c]);
        if (!is_q3) res[c] -= st_min_term(B, a->xs[c], cols / ST_GROUP);
    }
}

/* IQ4_XS: 64-column chunk c holds blocks 2c and 2c + 1, each 16 bytes of indices (low nibbles
 * columns 0-15, high 16-31) into the non-linear table; u = table value + 128, one scale
 * d * (ls - 32) per block (lanes 0-7: block 2c, 8-15: 2c + 1). */
ALWAYS_INLINE void row_iq4xs(const int NC, const uint8_t *row, int64_t ahead, int cols,
                             const act_rows *a, float *res) {
    const __m256i table = _mm256_broadcastsi128_si256(_mm_setr_epi8(
        1, 24, 45, 63, 79, 93, 106, 118, (char)129, (char)141, (char)153, (char)166, (char)181,
        (char)197, (char)217, (char)241));
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    const __m512i halves = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    __m512 acc[3];
    for (int c = 0; c < NC; c++) acc[c] = _mm512_setzero_ps();
    for (int ib = 0; ib < cols / 256; ib++) {
        const uint8_t *blk = superblock(row, ib, 136, ahead);
        uint16_t sh;
        memcpy(&sh, blk + 2, 2);
        int32_t ls[8];
        for (int b = 0; b < 8; b++)
            ls[b] = (((blk[4 + b / 2] >> (4 * (b & 1))) & 15) | (((sh >> (2 * b)) & 3) << 4)) - 32;
        const __m512i ls16 = _mm512_zextsi256_si512(_mm256_setr_epi32(      /* [8 | 8 zeros] */
            ls[0], ls[1], ls[2], ls[3], ls[4], ls[5], ls[6], ls[7]));
        const __m512 a8 = _mm512_mul_ps(_mm512_set1_ps(fp16_at(blk)), _mm512_cvtepi32_ps(ls16));
        for (int c = 0; c < 4; c++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(blk + 8 + 32 * c));
            const __m256i lo = _mm256_and_si256(q, low4);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
            const __m256i u0 = _mm256_shuffle_epi8(table, _mm256_permute2x128_si256(lo, hi, 0x20));
            const __m256i u1 = _mm256_shuffle_epi8(table, _mm256_permute2x128_si256(lo, hi, 0x31));
            __m512 scale = _mm512_permutexvar_ps(
                _mm512_add_epi32(halves, _mm512_set1_epi32(2 * c)), a8);
            /* u = s + 128: the correction is xc itself */
            chunk(NC, join256(u0, u1), scale, ib * 256 + 64 * c, 0, a, acc);
        }
    }
    for (int c = 0; c < NC; c++) res[c] = _mm512_reduce_add_ps(acc[c]);
}

int st_fused_k_row(int qtype, const uint8_t *row, int64_t ahead, int cols, const st_act *act,
                   const int64_t *tr, int n_tok, float *res) {
    const int ncp = act->cols_pad;
    act_rows a;
    for (int c = 0; c < n_tok; c++) {
        a.q[c] = act->q + tr[c] * ncp;
        a.xc[c] = act->xc + tr[c] * (ncp / ST_LANE);
        a.dx[c] = act->dx + tr[c] * (ncp / ST_LANE);
        a.xs[c] = act->xs + tr[c] * (ncp / ST_GROUP);
    }
    /* each row function specialised for 1, 2 and 3 tokens (NC a constant in its loops) */
#define BY_TOKENS(CALL_1, CALL_2, CALL_3) \
    do { if (n_tok == 1) CALL_1; else if (n_tok == 2) CALL_2; else CALL_3; return 1; } while (0)
    /* the k-quant pairs' flags as constants too (a flag read at run time costs a compare and
     * branch per chunk, as on AVX2) */
#define BY_FLAG(ROW, FLAG)                                                              \
    BY_TOKENS(ROW(1, FLAG, row, ahead, cols, &a, res), ROW(2, FLAG, row, ahead, cols, &a, res), \
              ROW(3, FLAG, row, ahead, cols, &a, res))
    if (qtype == ST_Q4_K) BY_FLAG(row_q45k, 0);
    if (qtype == ST_Q5_K) BY_FLAG(row_q45k, 1);
    if (qtype == ST_Q2_K) BY_FLAG(row_q23k, 0);
    if (qtype == ST_Q3_K) BY_FLAG(row_q23k, 1);
#undef BY_FLAG
    if (qtype == ST_Q6_K)
        BY_TOKENS(row_q6k(1, row, ahead, cols, &a, res), row_q6k(2, row, ahead, cols, &a, res),
                  row_q6k(3, row, ahead, cols, &a, res));
    if (qtype == ST_IQ4_XS)
        BY_TOKENS(row_iq4xs(1, row, ahead, cols, &a, res),
                  row_iq4xs(2, row, ahead, cols, &a, res),
                  row_iq4xs(3, row, ahead, cols, &a, res));
#undef BY_TOKENS
    return 0;
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
/* AVX2 (with or without AVX-VNNI), 1-4 tokens (4: one pass where 4 tokens took the unpacked
 * tiles, session 97; matmul.c's FUSED_ONE_PASS). A 32-column piece is maddubs (or vpdpbusd)
 * over the weight values and the int8 activations, summed to 8 int32 lanes of 4 columns, each scaled by (weight scale * activation
 * scale dx): tiles.c's AVX2 lane arithmetic, in the same column order. Q3_K's, Q6_K's and
 * IQ4_XS's signed values take maddubs(|s|, q with the sign of s), as the tiles do, so a token's
 * result is the tiles' bit for bit; the min types (Q2_K, Q4_K, Q5_K) take their unsigned values
 * and subtract the mins from xs = dx * sum(q) per 16-column group by the tiles' st_min_term
 * over the row's dmin * m, so theirs are the tiles' bit for bit too. */
#include "fused_avx2.h"

/* Q4_K / Q5_K: 144- / 176-byte super-blocks of 256 columns, 8 sub-blocks of 32 with a 6-bit
 * scale and min (w = d * sc * u - dmin * m); 32 bytes qs hold sub-block 2j in the low nibbles,
 * 2j + 1 in the high ones; Q5_K's fifth bits are bits 2j / 2j + 1 of qh [32]. */
ALWAYS_INLINE void avx2_row_q45k(const int NC, int is_q5, const uint8_t *row, int64_t ahead,
                                 int cols, const int8_t *const *q, const float *const *dx,
                                 const float *const *xs, float *res) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), sixteen = _mm256_set1_epi8(16);
    const int bytes = is_q5 ? 176 : 144;
    __m256 acc[4];
    float B[cols / ST_GROUP];  /* dmin * m per 16-column group, as the tiles' B */
    for (int c = 0; c < NC; c++) acc[c] = _mm256_setzero_ps();
    for (int ib = 0; ib < cols / 256; ib++) {
        const uint8_t *blk = row + (int64_t)ib * bytes;
        st_prefetch(blk + ahead, bytes);
        __m256 dsc, dm;  /* d * sc and dmin * m per sub-block */
        q45k_scales(blk, &dsc, &dm);
        store_twice(B + ib * 16, dm);  /* each min for its two 16-column groups */
        const uint8_t *qs = blk + (is_q5 ? 48 : 16);
        const __m256i qh = is_q5 ? _mm256_loadu_si256((const __m256i *)(blk + 16))
                                 : _mm256_setzero_si256();
        for (int j = 0; j < 4; j++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
            __m256i lo = _mm256_and_si256(v, low4);                          /* sub-block 2j */
            __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);    /* 2j + 1 */
            if (is_q5) {
                lo = _mm256_or_si256(lo, bit_to(qh, 2 * j, 4, sixteen));
                hi = _mm256_or_si256(hi, bit_to(qh, 2 * j + 1, 4, sixteen));
            }
            const int k = ib * 256 + 64 * j;
            piece(NC, lo, one_group_of(dsc, 2 * j), k, q, dx, acc);
            piece(NC, hi, one_group_of(dsc, 2 * j + 1), k + 32, q, dx, acc);
        }
    }
    for (int c = 0; c < NC; c++) {  /* the mins in the tiles' order (st_min_term) */
        res[c] = hsum8(acc[c]);
        res[c] -= st_min_term(B, xs[c], cols / ST_GROUP);
    }
}

/* Q6_K: 210-byte super-blocks (ql [128], qh [64], int8 scales [16], d): 16 groups of 16 columns,
 * w = d * sc * (u - 32), u 6 bits; half n (128 columns) takes ql[64n ..], qh[32n ..] (fused_k's
 * AVX-512 row_q6k has the same layout). */
ALWAYS_INLINE void avx2_row_q6k(const int NC, const uint8_t *row, int64_t ahead, int cols,
                                const int8_t *const *q, const float *const *dx, float *res) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), high2 = _mm256_set1_epi8(0x30);
    const __m256i thirty_two = _mm256_set1_epi8(32);
    __m256 acc[4];
    for (int c = 0; c < NC; c++) acc[c] = _mm256_setzero_ps();
    for (int ib = 0; ib < cols / 256; ib++) {
        const uint8_t *blk = row + (int64_t)ib * 210;
        st_prefetch(blk + ahead, 210);
        __m256 a16[2];  /* d * sc per group: groups 0-7, 8-15 */
        q6k_scales(blk, a16);
        for (int n = 0; n < 2; n++) {
            const __m256i ql0 = _mm256_loadu_si256((const __m256i *)(blk + 64 * n));
            const __m256i ql1 = _mm256_loadu_si256((const __m256i *)(blk + 64 * n + 32));
            const __m256i h = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * n));
            const __m256i v[4] = {
                _mm256_or_si256(_mm256_and_si256(ql0, low4),
                                _mm256_and_si256(_mm256_slli_epi16(h, 4), high2)),
                _mm256_or_si256(_mm256_and_si256(ql1, low4),
                                _mm256_and_si256(_mm256_slli_epi16(h, 2), high2)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low4),
                                _mm256_and_si256(h, high2)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), low4),
                                _mm256_and_si256(_mm256_srli_epi16(h, 2), high2))};
            for (int p = 0; p < 4; p++) {  /* columns 128n + 32p .. + 31: groups g, g + 1 */
                const __m256 scale = two_groups_of(a16[n], 2 * p);  /* groups 8n + 2p, + 1 */
                piece_signed(NC, _mm256_sub_epi8(v[p], thirty_two), scale,
                             ib * 256 + 128 * n + 32 * p, q, dx, acc);
            }
        }
    }
    for (int c = 0; c < NC; c++) res[c] = hsum8(acc[c]);
}

/* Q2_K / Q3_K (the layout of the AVX-512 row_q23k): 64-column chunk c holds 32-column blocks
 * 2c (groups 4c, 4c + 1) and 2c + 1 (groups 4c + 2, 4c + 3), the 2-bit values of block
 * 4h + j at (qs[32h + l] >> 2j) & 3. Q2_K: w = a * u - m per group; Q3_K: u = value + 4 where
 * bit b of hmask[l] is set, w = a * (u - 4). */
ALWAYS_INLINE void avx2_row_q23k(const int NC, int is_q3, const uint8_t *row, int64_t ahead,
                                 int cols, const int8_t *const *q, const float *const *dx,
                                 const float *const *xs, float *res) {
    const __m256i four = _mm256_set1_epi8(4);
    const int bytes = is_q3 ? 110 : 84;
    __m256 acc[4];
    float B[is_q3 ? 1 : cols / ST_GROUP];  /* Q2_K: dmin * m per group, as the tiles' B */
    for (int c = 0; c < NC; c++) acc[c] = _mm256_setzero_ps();
    for (int ib = 0; ib < cols / 256; ib++) {
        const uint8_t *blk = row + (int64_t)ib * bytes;
        st_prefetch(blk + ahead, bytes);
        __m256 a16[2];  /* the group scales: groups 0-7, 8-15 */
        __m256i hm = _mm256_setzero_si256();
        const uint8_t *qs;
        if (is_q3) {
            q3k_scales(blk, a16);
            hm = _mm256_loadu_si256((const __m256i *)blk);
            qs = blk + 32;
        } else {
            __m256 m16[2];  /* dmin * m per group */
            q2k_scales(blk, a16, m16);
            _mm256_storeu_ps(B + ib * 16, m16[0]);
            _mm256_storeu_ps(B + ib * 16 + 8, m16[1]);
            qs = blk + 16;
        }
        for (int c = 0; c < 4; c++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * (c >> 1)));
            __m256i lo = two_bits(v, 4 * (c & 1)), hi = two_bits(v, 4 * (c & 1) + 2);
            const int k = ib * 256 + 64 * c;
            if (is_q3) {  /* signed values, as the tiles take them: the same bits */
                lo = _mm256_sub_epi8(_mm256_or_si256(lo, bit_to(hm, 2 * c, 2, four)), four);
                hi = _mm256_sub_epi8(_mm256_or_si256(hi, bit_to(hm, 2 * c + 1, 2, four)), four);
                piece_signed(NC, lo, two_groups_of(a16[c >> 1], 4 * (c & 1)), k, q, dx, acc);
                piece_signed(NC, hi, two_groups_of(a16[c >> 1], 4 * (c & 1) + 2), k + 32, q, dx,
                             acc);
            } else {
                piece(NC, lo, two_groups_of(a16[c >> 1], 4 * (c & 1)), k, q, dx, acc);
                piece(NC, hi, two_groups_of(a16[c >> 1], 4 * (c & 1) + 2), k + 32, q, dx, acc);
            }
        }
    }
    for (int c = 0; c < NC; c++) {  /* Q2_K's mins in the tiles' order (st_min_term) */
        res[c] = hsum8(acc[c]);
        if (!is_q3) res[c] -= st_min_term(B, xs[c], cols / ST_GROUP);
    }
}

/* IQ4_XS: 136-byte super-blocks, 8 blocks of 32 columns, each 16 bytes of indices (low nibbles
 * columns 0-15, high 16-31) into the non-linear table, one scale d * (ls - 32) per block. */
ALWAYS_INLINE void avx2_row_iq4xs(const int NC, const uint8_t *row, int64_t ahead, int cols,
                                  const int8_t *const *q, const float *const *dx, float *res) {
    const __m256i table = _mm256_broadcastsi128_si256(_mm_setr_epi8(
        -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113));
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    __m256 acc[4];
    for (int c = 0; c < NC; c++) acc[c] = _mm256_setzero_ps();
    for (int ib = 0; ib < cols / 256; ib++) {
        const uint8_t *blk = row + (int64_t)ib * 136;
        st_prefetch(blk + ahead, 136);
        const __m256 a8 = iq4xs_scales(blk);  /* d * (ls - 32) per block */
        for (int c = 0; c < 4; c++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 8 + 32 * c));
            const __m256i lo = _mm256_and_si256(v, low4);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
            const __m256i s0 = _mm256_shuffle_epi8(table, _mm256_permute2x128_si256(lo, hi, 0x20));
            const __m256i s1 = _mm256_shuffle_epi8(table, _mm256_permute2x128_si256(lo, hi, 0x31));
            const int k = ib * 256 + 64 * c;
            piece_signed(NC, s0, one_group_of(a8, 2 * c), k, q, dx, acc);
            piece_signed(NC, s1, one_group_of(a8, 2 * c + 1), k + 32, q, dx, acc);
        }
    }
    for (int c = 0; c < NC; c++) res[c] = hsum8(acc[c]);
}

int st_fused_k_row(int qtype, const uint8_t *row, int64_t ahead, int cols, const st_act *act,
                   const int64_t *tr, int n_tok, float *res) {
    const int ncp = act->cols_pad;
    const int8_t *q[4];
    const float *dx[4], *xs[4];
    for (int c = 0; c < n_tok; c++) {
        q[c] = act->q + tr[c] * ncp;
        dx[c] = act->dx + tr[c] * (ncp / ST_LANE);
        xs[c] = act->xs + tr[c] * (ncp / ST_GROUP);
    }
    /* Q3_K / Q5_K pass their flag as a constant: a flag read at run time costs its rows a
     * compare and branch per piece */
    if (qtype == ST_IQ4_XS) {
        if (n_tok == 1) avx2_row_iq4xs(1, row, ahead, cols, q, dx, res);
        else if (n_tok == 2) avx2_row_iq4xs(2, row, ahead, cols, q, dx, res);
        else if (n_tok == 3) avx2_row_iq4xs(3, row, ahead, cols, q, dx, res);
        else avx2_row_iq4xs(4, row, ahead, cols, q, dx, res);
        return 1;
    }
    if (qtype == ST_Q2_K) {
        if (n_tok == 1) avx2_row_q23k(1, 0, row, ahead, cols, q, dx, xs, res);
        else if (n_tok == 2) avx2_row_q23k(2, 0, row, ahead, cols, q, dx, xs, res);
        else if (n_tok == 3) avx2_row_q23k(3, 0, row, ahead, cols, q, dx, xs, res);
        else avx2_row_q23k(4, 0, row, ahead, cols, q, dx, xs, res);
        return 1;
    }
    if (qtype == ST_Q3_K) {
        if (n_tok == 1) avx2_row_q23k(1, 1, row, ahead, cols, q, dx, xs, res);
        else if (n_tok == 2) avx2_row_q23k(2, 1, row, ahead, cols, q, dx, xs, res);
        else if (n_tok == 3) avx2_row_q23k(3, 1, row, ahead, cols, q, dx, xs, res);
        else avx2_row_q23k(4, 1, row, ahead, cols, q, dx, xs, res);
        return 1;
    }
    if (qtype == ST_Q6_K) {
        if (n_tok == 1) avx2_row_q6k(1, row, ahead, cols, q, dx, res);
        else if (n_tok == 2) avx2_row_q6k(2, row, ahead, cols, q, dx, res);
        else if (n_tok == 3) avx2_row_q6k(3, row, ahead, cols, q, dx, res);
        else avx2_row_q6k(4, row, ahead, cols, q, dx, res);
        return 1;
    }
    if (qtype == ST_Q5_K) {
        if (n_tok == 1) avx2_row_q45k(1, 1, row, ahead, cols, q, dx, xs, res);
        else if (n_tok == 2) avx2_row_q45k(2, 1, row, ahead, cols, q, dx, xs, res);
        else if (n_tok == 3) avx2_row_q45k(3, 1, row, ahead, cols, q, dx, xs, res);
        else avx2_row_q45k(4, 1, row, ahead, cols, q, dx, xs, res);
        return 1;
    }
    if (n_tok == 1) avx2_row_q45k(1, 0, row, ahead, cols, q, dx, xs, res);
    else if (n_tok == 2) avx2_row_q45k(2, 0, row, ahead, cols, q, dx, xs, res);
    else if (n_tok == 3) avx2_row_q45k(3, 0, row, ahead, cols, q, dx, xs, res);
    else avx2_row_q45k(4, 0, row, ahead, cols, q, dx, xs, res);
    return 1;
}

#else

int st_fused_k_row(int qtype, const uint8_t *row, int64_t ahead, int cols, const st_act *act,
                   const int64_t *tr, int n_tok, float *res) {
    (void)qtype; (void)row; (void)ahead; (void)cols; (void)act; (void)tr; (void)n_tok; (void)res;
    return 0;
}

#endif
