/* SIMD unpacking of quantised rows to the (s, A, B) layout of quant.h (AVX2-level code, used by
 * the AVX2 and AVX-512 builds). The scalar unpacker in quant_ref.c defines the result. */
#include <string.h>
#include "quant.h"

#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#include "kscales_avx2.h"

static inline __m256i load256(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline void store256(uint8_t *p, __m256i v) { _mm256_storeu_si256((__m256i *)p, v); }

/* A[64] of a super-block of 16-column groups: each group's scale on its 4 lanes */
static inline void store_groups(float *A, const __m256 *a16) {
    for (int g = 0; g < 16; g += 2) _mm256_storeu_ps(A + 4 * g, two_groups_of(a16[g / 8], g % 8));
}

int st_unpack_row_simd(int qtype, const uint8_t *row, int cols, uint8_t *s, float *A, float *B) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    switch (qtype) {
    case ST_Q4_0: {
        const __m128i low4_128 = _mm_set1_epi8(0x0F);
        const __m256i offset = _mm256_set1_epi8((char)(ST_WEIGHT_BIAS - 8));
        for (int ib = 0; ib < cols / 32; ib++) {
            const uint8_t *blk = row + ib * 18;
            __m128i qs = _mm_loadu_si128((const __m128i *)(blk + 2));       /* [16] nibble pairs */
            __m128i lo = _mm_and_si128(qs, low4_128);                        /* columns 0..15 */
            __m128i hi = _mm_and_si128(_mm_srli_epi16(qs, 4), low4_128);     /* columns 16..31 */
            store256(s + ib * 32, _mm256_add_epi8(_mm256_set_m128i(hi, lo), offset));
            _mm256_storeu_ps(A + ib * 8, _mm256_set1_ps(fp16_at(blk)));
            B[ib * 2] = B[ib * 2 + 1] = 0.0f;
        }
        return 1;
    }
    case ST_Q4_1:
    case ST_Q5_0:
    case ST_Q5_1:
    case ST_IQ4_NL: {
        /* st_block32_values (quant.h), biased; B = -m for the min types */
        const int has_min = st_has_min(qtype), bytes = st_type_size(qtype);
        const __m256i bias = _mm256_set1_epi8((char)ST_WEIGHT_BIAS);
        for (int ib = 0; ib < cols / 32; ib++) {
            const uint8_t *blk = row + (int64_t)ib * bytes;
            store256(s + ib * 32, _mm256_add_epi8(st_block32_values(qtype, blk, bytes), bias));
            _mm256_storeu_ps(A + ib * 8, _mm256_set1_ps(fp16_at(blk)));
            B[ib * 2] = B[ib * 2 + 1] = has_min ? -fp16_at(blk + 2) : 0.0f;
        }
        return 1;
    }
    case ST_Q8_0: {
        const __m256i bias = _mm256_set1_epi8((char)ST_WEIGHT_BIAS);
        for (int ib = 0; ib < cols / 32; ib++) {
            const uint8_t *blk = row + ib * 34;
            store256(s + ib * 32, _mm256_xor_si256(load256(blk + 2), bias));
            _mm256_storeu_ps(A + ib * 8, _mm256_set1_ps(fp16_at(blk)));
            B[ib * 2] = B[ib * 2 + 1] = 0.0f;
        }
        return 1;
    }
    case ST_Q4_K:
    case ST_Q5_K: {
        const int is_q5 = qtype == ST_Q5_K;
        const __m256i bias = _mm256_set1_epi8((char)ST_WEIGHT_BIAS);
        const __m256i sixteen = _mm256_set1_epi8(16);
        for (int ib = 0; ib < cols / 256; ib++) {
            const uint8_t *blk = row + ib * (is_q5 ? 176 : 144);
            const uint8_t *qs = blk + (is_q5 ? 48 : 16);
            __m256i qh = is_q5 ? load256(blk + 16) : _mm256_setzero_si256();
            uint8_t *y = s + ib * 256;
            for (int j = 0; j < 4; j++) {
                __m256i q = load256(qs + 32 * j);                             /* [32] */
                __m256i lo = _mm256_and_si256(q, low4);                       /* sub-block 2j */
                __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4); /* 2j + 1 */
                if (is_q5) {
                    /* bit (sub-block index) of qh[l] is the fifth bit of column l */
                    __m256i b_lo = _mm256_set1_epi8((char)(1 << (2 * j)));
                    __m256i b_hi = _mm256_set1_epi8((char)(1 << (2 * j + 1)));
                    lo = _mm256_or_si256(lo, _mm256_and_si256(
                        _mm256_cmpeq_epi8(_mm256_and_si256(qh, b_lo), b_lo), sixteen));
                    hi = _mm256_or_si256(hi, _mm256_and_si256(
                        _mm256_cmpeq_epi8(_mm256_and_si256(qh, b_hi), b_hi), sixteen));
                }
                store256(y + 64 * j, _mm256_xor_si256(lo, bias));
                store256(y + 64 * j + 32, _mm256_xor_si256(hi, bias));
            }
            __m256 dsc, dm;  /* d * sc, dmin * m per sub-block */
            q45k_scales(blk, &dsc, &dm);
            for (int sub = 0; sub < 8; sub++)
                _mm256_storeu_ps(A + ib * 64 + sub * 8, one_group_of(dsc, sub));
            store_twice(B + ib * 16, dm);
        }
        return 1;
    }
    case ST_Q6_K: {
        const __m256i offset = _mm256_set1_epi8((char)(ST_WEIGHT_BIAS - 32));
        const __m256i high2 = _mm256_set1_epi8(0x30);
        for (int ib = 0; ib < cols / 256; ib++) {
            const uint8_t *blk = row + ib * 210;
            uint8_t *y = s + ib * 256;
            for (int n = 0; n < 2; n++) {
                __m256i ql0 = load256(blk + 64 * n);                          /* [32] */
                __m256i ql1 = load256(blk + 64 * n + 32);
                __m256i h = load256(blk + 128 + 32 * n);
                __m256i v0 = _mm256_or_si256(_mm256_and_si256(ql0, low4),
                                             _mm256_and_si256(_mm256_slli_epi16(h, 4), high2));
                __m256i v1 = _mm256_or_si256(_mm256_and_si256(ql1, low4),
                                             _mm256_and_si256(_mm256_slli_epi16(h, 2), high2));
                __m256i v2 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low4),
                                             _mm256_and_si256(h, high2));
                __m256i v3 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), low4),
                                             _mm256_and_si256(_mm256_srli_epi16(h, 2), high2));
                store256(y + 128 * n, _mm256_add_epi8(v0, offset));
                store256(y + 128 * n + 32, _mm256_add_epi8(v1, offset));
                store256(y + 128 * n + 64, _mm256_add_epi8(v2, offset));
                store256(y + 128 * n + 96, _mm256_add_epi8(v3, offset));
            }
            __m256 a16[2];
            q6k_scales(blk, a16);
            store_groups(A + ib * 64, a16);
            _mm256_storeu_ps(B + ib * 16, _mm256_setzero_ps());
            _mm256_storeu_ps(B + ib * 16 + 8, _mm256_setzero_ps());
        }
        return 1;
    }
    case ST_Q2_K:
    case ST_Q3_K: {
        /* block b = 4h + j of 32 columns: (qs[32h + l] >> 2j) & 3; Q3_K adds 4 where bit b of
         * hmask[l] is set and subtracts 4; a scale (Q2_K: and a min) per 16 columns */
        const int is_q3 = qtype == ST_Q3_K;
        const __m256i three = _mm256_set1_epi8(3), four = _mm256_set1_epi8(4);
        const __m256i offset = _mm256_set1_epi8((char)(ST_WEIGHT_BIAS - (is_q3 ? 4 : 0)));
        for (int ib = 0; ib < cols / 256; ib++) {
            const uint8_t *blk = row + ib * (is_q3 ? 110 : 84);
            const uint8_t *qs = blk + (is_q3 ? 32 : 16);
            const __m256i hm = is_q3 ? load256(blk) : _mm256_setzero_si256();
            uint8_t *y = s + ib * 256;
            for (int b = 0; b < 8; b++) {
                __m256i v = _mm256_and_si256(
                    _mm256_srl_epi16(load256(qs + 32 * (b >> 2)), _mm_cvtsi32_si128(2 * (b & 3))),
                    three);
                if (is_q3) {
                    const __m256i bit = _mm256_set1_epi8((char)(1 << b));
                    v = _mm256_or_si256(v, _mm256_and_si256(
                        _mm256_cmpeq_epi8(_mm256_and_si256(hm, bit), bit), four));
                }
                store256(y + 32 * b, _mm256_add_epi8(v, offset));
            }
            __m256 a16[2], m16[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
            if (is_q3) q3k_scales(blk, a16);
            else q2k_scales(blk, a16, m16);
            store_groups(A + ib * 64, a16);
            _mm256_storeu_ps(B + ib * 16, m16[0]);
            _mm256_storeu_ps(B + ib * 16 + 8, m16[1]);
        }
        return 1;
    }
    case ST_IQ4_XS: {
        /* block b of 32: 16 bytes of indices at 8 + 16b (low nibbles columns 0-15) into the
         * non-linear table, one scale d * (ls - 32) */
        const __m128i low4_128 = _mm_set1_epi8(0x0F);
        const __m128i table = _mm_add_epi8(
            _mm_setr_epi8(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113),
            _mm_set1_epi8((char)ST_WEIGHT_BIAS));
        for (int ib = 0; ib < cols / 256; ib++) {
            const uint8_t *blk = row + ib * 136;
            const __m256 a8 = iq4xs_scales(blk);  /* d * (ls - 32) per block */
            uint8_t *y = s + ib * 256;
            for (int b = 0; b < 8; b++) {
                __m128i q = _mm_loadu_si128((const __m128i *)(blk + 8 + 16 * b));
                __m128i lo = _mm_shuffle_epi8(table, _mm_and_si128(q, low4_128));
                __m128i hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(q, 4), low4_128));
                store256(y + 32 * b, _mm256_set_m128i(hi, lo));
                _mm256_storeu_ps(A + ib * 64 + b * 8, one_group_of(a8, b));
                B[ib * 16 + 2 * b] = B[ib * 16 + 2 * b + 1] = 0.0f;
            }
        }
        return 1;
    }
    default:
        return 0;
    }
}

int st_unpack_row_float_simd(int qtype, const uint8_t *row, int cols, float *w) {
    int i = 0;
    if (qtype == ST_F16) {
        for (; i + 8 <= cols; i += 8)
            _mm256_storeu_ps(w + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + 2 * i))));
    } else if (qtype == ST_BF16) {
        for (; i + 8 <= cols; i += 8) {
            __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(row + 2 * i)));
            _mm256_storeu_ps(w + i, _mm256_castsi256_ps(_mm256_slli_epi32(h, 16)));
        }
    } else {
        return 0;
    }
    if (i < cols) st_dequantize(qtype, row + 2 * i, w + i, cols - i);
    return 1;
}

#elif !(defined(__ARM_NEON) && defined(__aarch64__))   /* NEON: unpack_neon.c */

int st_unpack_row_float_simd(int qtype, const uint8_t *row, int cols, float *w) {
    (void)qtype; (void)row; (void)cols; (void)w;
    return 0;
}

int st_unpack_row_simd(int qtype, const uint8_t *row, int cols, uint8_t *s, float *A, float *B) {
    (void)qtype; (void)row; (void)cols; (void)s; (void)A; (void)B;
    return 0;
}

#endif
