/* The k-quants' super-block scales as integers in registers, for the AVX2 k rows (fused_k.c):
 * each super-block's products sum in int32 with these as madd factors, and convert to float
 * once per 256 columns (llama.cpp's Q8_K way; the activations have one scale per 256 columns,
 * quant.h's ST_ACT_K). Values as quant_ref.c's st_k_superblock. Include only under __AVX2__. */
#pragma once
#include <stdint.h>
#include <string.h>
#include <immintrin.h>
#include "quant.h"

/* 8 int16 values w in both 128-bit lanes: a piece's madd factors come from it by one in-lane
 * byte shuffle (`factors`) */
static inline __m256i in_both_lanes(__m128i w) { return _mm256_broadcastsi128_si256(w); }

/* byte shuffles of in_both_lanes' 8 int16 values: value g into every int16 of a lane (one
 * index vector for both lanes), and values 2p, 2p + 1 into the low / high lane. Loaded, where
 * indices built from a loop's g cost a piece four instructions. */
static const uint8_t k_value_index[8][16] __attribute__((aligned(16))) = {
    {0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1},
    {2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3},
    {4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5},
    {6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7},
    {8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9},
    {10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11},
    {12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13},
    {14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15}};
static const uint8_t k_pair_index[4][32] __attribute__((aligned(32))) = {
    {0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1,
     2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3},
    {4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5,
     6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7},
    {8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9,
     10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11},
    {12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13,
     14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15}};

/* the [16] int16 factors of a 32-column piece of one scale: value g */
static inline __m256i factors_one(__m256i scales, int g) {
    return _mm256_shuffle_epi8(
        scales, _mm256_broadcastsi128_si256(_mm_load_si128((const __m128i *)k_value_index[g])));
}

/* of two 16-column groups: int16 0-7 (columns 0-15) value 2p, 8-15 value 2p + 1 */
static inline __m256i factors_two(__m256i scales, int p) {
    return _mm256_shuffle_epi8(scales, _mm256_load_si256((const __m256i *)k_pair_index[p]));
}

/* Q4_K / Q5_K: the 8 6-bit scales and the 8 mins of the sub-blocks as bytes 0-7 of *sc, *m */
static inline void q45k_scale_bytes(const uint8_t *blk, __m128i *sc, __m128i *m) {
    uint64_t sc8, m8;
    st_q45k_scale_words(blk, &sc8, &m8);
    *sc = _mm_cvtsi64_si128((int64_t)sc8);
    *m = _mm_cvtsi64_si128((int64_t)m8);
}

/* Q3_K: the 16 group scales - 32 as int8: 6 bits, the low 4 from bytes 96-103 (groups 8-15 the
 * high nibbles), the high 2 from bytes 104-107 (byte g % 4, bits 2 * (g / 4)) */
static inline __m128i q3k_scale_bytes(const uint8_t *blk) {
    uint64_t low;
    uint32_t high;
    memcpy(&low, blk + 96, 8);
    memcpy(&high, blk + 104, 4);
    const uint64_t m4 = 0x0f0f0f0f0f0f0f0full, m2 = 0x03030303u;
    const uint64_t h0 = (high & m2) | ((high >> 2) & m2) << 32;         /* groups 0-7 */
    const uint64_t h1 = ((high >> 4) & m2) | ((high >> 6) & m2) << 32;  /* 8-15 */
    return _mm_sub_epi8(
        _mm_set_epi64x((int64_t)(((low >> 4) & m4) | h1 << 4), (int64_t)((low & m4) | h0 << 4)),
        _mm_set1_epi8(32));
}

/* IQ4_XS: the 8 blocks' ls - 32 as int16; block b's 6-bit ls is nibble b & 1 of byte 4 + b / 2
 * with bits 2b, 2b + 1 of the u16 at 2 above it */
static inline __m128i iq4xs_scale_words(const uint8_t *blk) {
    uint16_t sh;
    uint32_t sl;
    memcpy(&sh, blk + 2, 2);
    memcpy(&sl, blk + 4, 4);
    const __m128i nib = _mm_unpacklo_epi8(_mm_cvtsi32_si128((int)(sl & 0x0f0f0f0fu)),
                                          _mm_cvtsi32_si128((int)((sl >> 4) & 0x0f0f0f0fu)));
    const __m128i high = _mm_and_si128(
        _mm_srlv_epi32(_mm_set1_epi32(sh), _mm_setr_epi32(0, 2, 4, 6)), _mm_set1_epi32(3));
    const __m128i high_hi = _mm_and_si128(
        _mm_srlv_epi32(_mm_set1_epi32(sh), _mm_setr_epi32(8, 10, 12, 14)), _mm_set1_epi32(3));
    const __m128i h16 = _mm_packs_epi32(high, high_hi);                   /* [8] int16 */
    return _mm_sub_epi16(_mm_or_si128(_mm_cvtepu8_epi16(nib), _mm_slli_epi16(h16, 4)),
                         _mm_set1_epi16(32));
}
