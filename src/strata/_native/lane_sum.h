/* The tiles' order of summing the 8 float lanes of an AVX register: every AVX2 product that
 * must equal the tiles bit for bit (tiles.c, fused.c) sums with this one. And the
 * int32 lane sums of the AVX2 rows. */
#pragma once
#include "quant.h"
#if defined(__AVX__)
#include <immintrin.h>

static inline float hsum8(__m256 v) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}
#endif

#if defined(__AVX2__)
/* [8] int32 lanes: add + the sum of each lane's 4 products u * q (u unsigned, q signed bytes).
 * Every caller keeps a pair of products below 32768, so maddubs never saturates and AVX-VNNI's
 * one vpdpbusd (Intel cores since Alder Lake without AVX-512) gives the same integers as maddubs + madd. */
static inline __m256i lanes_dot_add(__m256i add, __m256i u, __m256i q) {
#if defined(ST_USE_AVXVNNI)
    return _mm256_dpbusd_avx_epi32(add, u, q);
#else
    return _mm256_add_epi32(add, _mm256_madd_epi16(_mm256_maddubs_epi16(u, q),
                                                   _mm256_set1_epi16(1)));
#endif
}

static inline __m256i lanes_dot(__m256i u, __m256i q) {
#if defined(ST_USE_AVXVNNI)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, q);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, q), _mm256_set1_epi16(1));
#endif
}
#endif
