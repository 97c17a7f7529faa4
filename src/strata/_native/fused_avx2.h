/* AVX2 pieces of the grid i-quants' fused decode rows (fused_iq.c): tiles.c's AVX2 lane
 * arithmetic, so a fused row's result is the tiles' bit for bit. Include only under __AVX2__ &&
 * __FMA__ && __F16C__. */
#pragma once
#include <string.h>
#include "quant.h"
#include <immintrin.h>
#include "fused_f16.h"
#include "lane_sum.h"

/* acc[c] += (sum over the 8 lanes of 32 columns at k of g * q) * dx * scale (scale [8] per
 * lane), for weight magnitudes g (0 .. 127) negated where sgn < 0 (zero where sgn is 0):
 * maddubs(g, q with the sign of sgn), a pair below 2 * 127 * 127 < 32768 */
ALWAYS_INLINE void piece_sign_mask(const int NC, __m256i g, __m256i sgn, __m256 scale, int k,
                                   const int8_t *const *q, const float *const *dx,
                                   __m256 *acc) {
    for (int c = 0; c < NC; c++) {
        const __m256i qc = _mm256_loadu_si256((const __m256i *)(q[c] + k));
        const __m256i p = lanes_dot(g, _mm256_sign_epi8(qc, sgn));
        acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p),
                                 _mm256_mul_ps(scale, _mm256_loadu_ps(dx[c] + k / ST_LANE)),
                                 acc[c]);
    }
}

/* signed weight values s (|s| <= 127): maddubs(|s|, q with the sign of s), as the tiles */
ALWAYS_INLINE void piece_signed(const int NC, __m256i s, __m256 scale, int k,
                                const int8_t *const *q, const float *const *dx, __m256 *acc) {
    piece_sign_mask(NC, _mm256_sign_epi8(s, s), s, scale, k, q, dx, acc);
}

/* [8] lane scales of 32 columns: lanes 0-3 group g, 4-7 group g + 1 */
static inline __m256 two_groups(const float *a16, int g) {
    return _mm256_set_m128(_mm_set1_ps(a16[g + 1]), _mm_set1_ps(a16[g]));
}

