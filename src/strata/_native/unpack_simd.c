/* SIMD unpacking of quantised rows to the (s, A, B) layout of quant.h (AVX2-level code, used by
 * the AVX2 and AVX-512 builds) for the tiles of the 32-column block types; the k-quants are
 * never unpacked (fused_k.c's rows take every token count). The scalar unpacker in quant_ref.c
 * defines the result. */
#include <string.h>
#include "quant.h"

#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#include "fused_f16.h"

static inline __m256i load256(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline void store256(uint8_t *p, __m256i v) { _mm256_storeu_si256((__m256i *)p, v); }

int st_unpack_row_simd(int qtype, const uint8_t *row, int cols, uint8_t *s, float *A, float *B) {
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
