/* The tiles' order of summing the 8 float lanes of an AVX register: every AVX2 product that
 * must equal the tiles bit for bit (tiles.c, fused.c, fused_avx2.h) sums with this one. */
#pragma once
#if defined(__AVX__)
#include <immintrin.h>

static inline float hsum8(__m256 v) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}
#endif
