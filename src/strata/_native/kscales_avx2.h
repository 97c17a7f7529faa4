/* The k-quants' super-block scales decoded in registers, 8 or 16 at once and converted as
 * vectors: what the AVX2 decode rows (fused_k.c) and the tiles' unpacking (unpack_simd.c) read.
 * A scalar loop converting them one by one into arrays, which the pieces then loaded back, cost
 * the decode rows 25-70% a row (docs/DEVELOPING.md, session 98). Each value is quant_ref.c's
 * (d * (float)sc, the same bits). Include only under __AVX2__ && __F16C__. */
#pragma once
#include <stdint.h>
#include <string.h>
#include <immintrin.h>
#include "fused_f16.h"

/* [8] floats d * (the low 8 bytes of v, unsigned / signed) */
static inline __m256 scaled_u8(__m128i v, __m256 d) {
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)), d);
}

static inline __m256 scaled_i8(__m128i v, __m256 d) {
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), d);
}

/* scale g of 8 in a register on all 8 lanes */
static inline __m256 one_group_of(__m256 a8, int g) {
    return _mm256_permutevar8x32_ps(a8, _mm256_set1_epi32(g));
}

/* lanes 0-3 scale g, 4-7 scale g + 1 (g <= 6): a 32-column piece of two 16-column groups */
static inline __m256 two_groups_of(__m256 a8, int g) {
    return _mm256_permutevar8x32_ps(
        a8, _mm256_add_epi32(_mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1), _mm256_set1_epi32(g)));
}

/* out[16] = each of the 8 values twice (a sub-block's min for its two 16-column groups) */
static inline void store_twice(float *out, __m256 a8) {
    _mm256_storeu_ps(out, _mm256_permutevar8x32_ps(a8, _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3)));
    _mm256_storeu_ps(out + 8,
                     _mm256_permutevar8x32_ps(a8, _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7)));
}

/* Q4_K / Q5_K (d, dmin, 12 scale bytes): d * sc and dmin * m of the 8 sub-blocks, the 6-bit
 * pairs of scale_min_k4 by 32-bit words. Each word its own load: a memcpy of the 12 bytes into
 * an array went through the stack. */
static inline void q45k_scales(const uint8_t *blk, __m256 *dsc, __m256 *dm) {
    uint32_t w0, w1, w2;
    memcpy(&w0, blk + 4, 4);
    memcpy(&w1, blk + 8, 4);
    memcpy(&w2, blk + 12, 4);
    const uint64_t sc_hi = (w2 & 0x0f0f0f0fu) | (((w0 >> 6) & 0x03030303u) << 4);
    const uint64_t m_hi = ((w2 >> 4) & 0x0f0f0f0fu) | (((w1 >> 6) & 0x03030303u) << 4);
    *dsc = scaled_u8(_mm_cvtsi64_si128((int64_t)((w0 & 0x3f3f3f3fu) | sc_hi << 32)),
                     _mm256_set1_ps(fp16_at(blk)));
    *dm = scaled_u8(_mm_cvtsi64_si128((int64_t)((w1 & 0x3f3f3f3fu) | m_hi << 32)),
                    _mm256_set1_ps(fp16_at(blk + 2)));
}

/* Q2_K (16 bytes: scale in the low nibble, min in the high one; d, dmin at 80): d * sc and
 * dmin * m of the 16 groups, [2] each (groups 0-7, 8-15) */
static inline void q2k_scales(const uint8_t *blk, __m256 *a16, __m256 *m16) {
    const __m256 d = _mm256_set1_ps(fp16_at(blk + 80)), dmin = _mm256_set1_ps(fp16_at(blk + 82));
    const __m128i low4 = _mm_set1_epi8(0x0F);
    const __m128i sm = _mm_loadu_si128((const __m128i *)blk);
    const __m128i sc = _mm_and_si128(sm, low4), m = _mm_and_si128(_mm_srli_epi16(sm, 4), low4);
    a16[0] = scaled_u8(sc, d);
    a16[1] = scaled_u8(_mm_srli_si128(sc, 8), d);
    m16[0] = scaled_u8(m, dmin);
    m16[1] = scaled_u8(_mm_srli_si128(m, 8), dmin);
}

/* Q3_K: d * (sc - 32) of the 16 groups, [2]: 6-bit scales, the low 4 bits from bytes 96-103
 * (groups 8-15 the high nibbles), the high 2 from bytes 104-107 (byte g % 4, bits 2 * (g / 4)) */
static inline void q3k_scales(const uint8_t *blk, __m256 *a16) {
    uint64_t low;
    uint32_t high;
    memcpy(&low, blk + 96, 8);
    memcpy(&high, blk + 104, 4);
    const uint64_t m4 = 0x0f0f0f0f0f0f0f0full, m2 = 0x03030303u;
    const uint64_t h0 = (high & m2) | ((high >> 2) & m2) << 32;         /* groups 0-7 */
    const uint64_t h1 = ((high >> 4) & m2) | ((high >> 6) & m2) << 32;  /* 8-15 */
    const __m128i sc = _mm_sub_epi8(  /* the 16 scales - 32, as int8 */
        _mm_set_epi64x((int64_t)(((low >> 4) & m4) | h1 << 4), (int64_t)((low & m4) | h0 << 4)),
        _mm_set1_epi8(32));
    const __m256 d = _mm256_set1_ps(fp16_at(blk + 108));
    a16[0] = scaled_i8(sc, d);
    a16[1] = scaled_i8(_mm_srli_si128(sc, 8), d);
}

/* Q6_K: d * sc of the 16 groups, [2] (int8 scales at 192, d at 208) */
static inline void q6k_scales(const uint8_t *blk, __m256 *a16) {
    const __m256 d = _mm256_set1_ps(fp16_at(blk + 208));
    const __m128i sc = _mm_loadu_si128((const __m128i *)(blk + 192));
    a16[0] = scaled_i8(sc, d);
    a16[1] = scaled_i8(_mm_srli_si128(sc, 8), d);
}

/* IQ4_XS: d * (ls - 32) of the 8 blocks; block b's 6-bit ls is nibble b & 1 of byte 4 + b / 2
 * with bits 2b, 2b + 1 of the u16 at 2 above it */
static inline __m256 iq4xs_scales(const uint8_t *blk) {
    uint16_t sh;
    uint32_t sl;
    memcpy(&sh, blk + 2, 2);
    memcpy(&sl, blk + 4, 4);
    const __m128i nib = _mm_unpacklo_epi8(_mm_cvtsi32_si128((int)(sl & 0x0f0f0f0fu)),
                                          _mm_cvtsi32_si128((int)((sl >> 4) & 0x0f0f0f0fu)));
    const __m256i high = _mm256_and_si256(
        _mm256_srlv_epi32(_mm256_set1_epi32(sh), _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)),
        _mm256_set1_epi32(3));
    const __m256i ls = _mm256_or_si256(_mm256_cvtepu8_epi32(nib), _mm256_slli_epi32(high, 4));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(ls, _mm256_set1_epi32(32))),
                         _mm256_set1_ps(fp16_at(blk)));
}
