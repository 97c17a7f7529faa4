/* The integer sums of the ST_ACT_K rows on AVX2 (fused_k_avx2.h's k-quants, fused_iq.c's grid
 * i-quants): a piece's products into int32 lanes by int16 scale factors, the tokens'
 * activations, and a super-block's one conversion. Include only under __AVX2__ && __FMA__. */
#pragma once
#include <immintrin.h>
#include "quant.h"
#include "fused_f16.h"

/* acc + (the [8] int32 lanes: 4 columns each of u * q, each pair of products times its int16
 * factor); u <= 127 unsigned and a pair of products below 32768, so maddubs never saturates */
static inline __m256i kdot_add(__m256i acc, __m256i u, __m256i q, __m256i f) {
#if defined(ST_USE_AVXVNNI)
    return _mm256_dpwssd_avx_epi32(acc, _mm256_maddubs_epi16(u, q), f);
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpwssd_epi32(acc, _mm256_maddubs_epi16(u, q), f);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, q), f));
#endif
}

static inline __m256i q_at(const st_k_tokens *t, int c, int k) {
    return _mm256_loadu_si256((const __m256i *)(t->q[c] + k));
}

static inline __m256i bs_at(const st_k_tokens *t, int c, int ib) {
    return _mm256_loadu_si256((const __m256i *)(t->bs[c] + ib * 16));  /* [16] int16 */
}

/* acc[c] += (float)isum[c] * (d * dk) - (float)imin[c] * (dmin * dk), lane-wise: the one
 * conversion of a super-block (imin: the mins' sums, NULL for the types without) */
ALWAYS_INLINE void k_finish(const int NC, const st_k_tokens *t, int ib, const __m256i *isum,
                            const __m256i *imin, float d, float dmin, __m256 *acc) {
    for (int c = 0; c < NC; c++) {
        const float dk = t->dk[c][ib];
        acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[c]), _mm256_set1_ps(d * dk), acc[c]);
        if (imin)
            acc[c] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(imin[c]), _mm256_set1_ps(dmin * dk),
                                      acc[c]);
    }
}
