/* AVX-512 VNNI pieces of the grid i-quants' fused decode rows (fused_iq.c): the tiles' VNNI
 * lane arithmetic (quant.h's st_vnni_lane_acc), so a fused row's result is the tiles' bit for
 * bit. Include only under ST_USE_VNNI512 && __F16C__. */
#pragma once
#include "quant.h"
#include <string.h>
#include <immintrin.h>
#include "fused_f16.h"


typedef struct {
    const int8_t *q[3];
    const int32_t *xc[3];
    const float *dx[3];
    const float *xs[3];
} act_rows;

/* acc[c] += sum over 64 columns at k of (u - offset) * q * scale, u unsigned bytes; the
 * offset correction comes from xc = -128 * sum(q) per lane, shifted by log2(128 / offset). */
ALWAYS_INLINE void chunk(const int NC, __m512i u, __m512 scale, int k, int corr_shift,
                         const act_rows *a, __m512 *acc) {
    const int lane = k / ST_LANE;
    for (int c = 0; c < NC; c++) {
        __m512i init = _mm512_setzero_si512();
        if (corr_shift >= 0)
            init = _mm512_srai_epi32(_mm512_loadu_si512((const void *)(a->xc[c] + lane)),
                                     corr_shift);
        acc[c] = st_vnni_lane_acc(acc[c], init, u, _mm512_loadu_si512((const void *)(a->q[c] + k)),
                                  scale, _mm512_loadu_ps(a->dx[c] + lane));
    }
}
