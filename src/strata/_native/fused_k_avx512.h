/* Q4_K / Q5_K rows on 512-bit registers (AVX-512 BW + VNNI builds): 64 columns a step, where
 * the AVX2 rows (fused_k_avx2.h) take two 32-column pieces. The 32 bytes of qs that hold
 * sub-blocks 2j (low nibbles) and 2j + 1 (high) are broadcast to both 256-bit halves and
 * shifted by 0 / 4 there, so one vector holds the 64 columns in order against 64 contiguous
 * activation bytes; one vpermw gives both sub-blocks' scale factors. The int32 lanes fold to
 * the AVX2 rows' 8 (lane l: columns 4l .. 4l + 3 of each 32-column piece, the same integers),
 * so k_finish converts the same sums: bit for bit the AVX2 rows' results. Included by
 * fused_k.c after fused_k_avx2.h, under __AVX512BW__ && __AVX512VNNI__. */
#pragma once
#include <immintrin.h>

/* int16 lanes 0-15: value 2j of `scales` (8 int16 in the low 128 bits), lanes 16-31: 2j + 1 */
static inline __m512i factors_pair512(__m512i scales, int j) {
    const __m512i idx = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16(
                                               (short)(2 * j))),
                                           _mm256_set1_epi16((short)(2 * j + 1)), 1);
    return _mm512_permutexvar_epi16(idx, scales);
}

ALWAYS_INLINE void row_q45k_512(const int NC, int is_q5, const uint8_t *row, int64_t ahead,
                                int cols, const k_tokens *t, float *res) {
    const __m512i low4 = _mm512_set1_epi8(0x0F), sixteen = _mm512_set1_epi8(16);
    /* per int16 lane: shift 0 in the low half (low nibbles), 4 in the high half */
    const __m512i shifts = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
    const __m512i half_one = _mm512_srli_epi16(shifts, 2);  /* 0 low, 1 high: qh's bit pair */
    const int bytes = is_q5 ? 176 : 144;
    __m256 acc[4];
    for (int c = 0; c < NC; c++) acc[c] = _mm256_setzero_ps();
    for (int ib = 0; ib < cols / 256; ib++) {
        const uint8_t *blk = row + (int64_t)ib * bytes;
        st_prefetch(blk + ahead, bytes);
        __m128i sc8, m8;
        q45k_scale_bytes(blk, &sc8, &m8);
        const __m512i scales = _mm512_castsi128_si512(_mm_cvtepu8_epi16(sc8));  /* [8] */
        const __m256i m16 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m8, m8));  /* [16] groups */
        const uint8_t *qs = blk + (is_q5 ? 48 : 16);
        /* Q5_K: bit 2j of qh[l] is column 64j + l's fifth bit, 2j + 1 column 64j + 32 + l's */
        const __m512i qh = is_q5 ? _mm512_broadcast_i64x4(
                                       _mm256_loadu_si256((const __m256i *)(blk + 16)))
                                 : _mm512_setzero_si512();
        __m512i isum[4];
        for (int c = 0; c < NC; c++) isum[c] = _mm512_setzero_si512();
        for (int j = 0; j < 4; j++) {                   /* columns 64j .. 64j + 63 */
            const __m512i x = _mm512_broadcast_i64x4(
                _mm256_loadu_si256((const __m256i *)(qs + 32 * j)));
            __m512i u = _mm512_and_si512(_mm512_srlv_epi16(x, shifts), low4);
            if (is_q5) {  /* the fifth bit, bit 2j (low half) or 2j + 1 (high half), to bit 4 */
                const __m512i b = _mm512_srlv_epi16(qh, _mm512_add_epi16(
                    half_one, _mm512_set1_epi16((short)(2 * j))));
                u = _mm512_or_si512(u, _mm512_and_si512(_mm512_slli_epi16(b, 4), sixteen));
            }
            const __m512i f = factors_pair512(scales, j);
            const int k = ib * 256 + 64 * j;
            for (int c = 0; c < NC; c++)
                isum[c] = _mm512_dpwssd_epi32(
                    isum[c],
                    _mm512_maddubs_epi16(u, _mm512_loadu_si512((const void *)(t->q[c] + k))),
                    f);
        }
        __m256i isum8[4], imin[4];
        for (int c = 0; c < NC; c++) {
            isum8[c] = _mm256_add_epi32(_mm512_castsi512_si256(isum[c]),
                                        _mm512_extracti64x4_epi64(isum[c], 1));
            imin[c] = _mm256_madd_epi16(m16, bs_at(t, c, ib));
        }
        k_finish(NC, t, ib, isum8, imin, fp16_at(blk), fp16_at(blk + 2), acc);
    }
    for (int c = 0; c < NC; c++) res[c] = hsum8(acc[c]);
}

/* int16 lanes 8i .. 8i + 7: value g0 + i of `scales` (16 int16 in the low 256 bits), i < 4 */
static inline __m512i factors_four512(__m512i scales, int g0) {
    const __m512i idx = _mm512_add_epi16(
        _mm512_set1_epi16((short)g0),
        _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set_m128i(_mm_set1_epi16(1),
                                                                   _mm_setzero_si128())),
                           _mm256_set_m128i(_mm_set1_epi16(3), _mm_set1_epi16(2)), 1));
    return _mm512_permutexvar_epi16(idx, scales);
}

/* Q6_K on 512-bit registers: half n's ql [64] is one load whose low nibbles are columns
 * 128n .. 128n + 63 in order, high nibbles the next 64; qh [32] broadcast gives each half its
 * two bits by a per-half shift. Lanes fold to the AVX2 rows' (row_q6k): the same bits. */
ALWAYS_INLINE void row_q6k_512(const int NC, const uint8_t *row, int64_t ahead, int cols,
                               const k_tokens *t, float *res) {
    const __m512i low4 = _mm512_set1_epi8(0x0F), high2 = _mm512_set1_epi8(0x30);
    /* per int16 lane: qh's shift left for the low 64 columns (4 | 2), right for the high (0 | 2) */
    const __m512i lshift = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
    const __m512i rshift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
    __m256 acc[4];
    for (int c = 0; c < NC; c++) acc[c] = _mm256_setzero_ps();
    for (int ib = 0; ib < cols / 256; ib++) {
        const uint8_t *blk = row + (int64_t)ib * 210;
        st_prefetch(blk + ahead, 210);
        const __m256i sc16 = _mm256_cvtepi8_epi16(
            _mm_loadu_si128((const __m128i *)(blk + 192)));             /* [16] groups */
        const __m512i scales = _mm512_castsi256_si512(sc16);
        __m512i isum[4];
        for (int c = 0; c < NC; c++) isum[c] = _mm512_setzero_si512();
        for (int n = 0; n < 2; n++) {
            const __m512i ql = _mm512_loadu_si512((const void *)(blk + 64 * n));
            const __m512i h = _mm512_broadcast_i64x4(
                _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * n)));
            const __m512i v[2] = {
                _mm512_or_si512(_mm512_and_si512(ql, low4),
                                _mm512_and_si512(_mm512_sllv_epi16(h, lshift), high2)),
                _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low4),
                                _mm512_and_si512(_mm512_srlv_epi16(h, rshift), high2))};
            for (int p = 0; p < 2; p++) {  /* columns 128n + 64p ..: groups 8n + 4p .. + 3 */
                const __m512i f = factors_four512(scales, 8 * n + 4 * p);
                const int k = ib * 256 + 128 * n + 64 * p;
                for (int c = 0; c < NC; c++)
                    isum[c] = _mm512_dpwssd_epi32(
                        isum[c],
                        _mm512_maddubs_epi16(v[p],
                                             _mm512_loadu_si512((const void *)(t->q[c] + k))),
                        f);
            }
        }
        __m256i isum8[4];
        for (int c = 0; c < NC; c++) {  /* - 32 * sum_g sc[g] * bs[g], as row_q6k */
            const __m256i sc_bs = _mm256_madd_epi16(sc16, bs_at(t, c, ib));
            isum8[c] = _mm256_sub_epi32(
                _mm256_add_epi32(_mm512_castsi512_si256(isum[c]),
                                 _mm512_extracti64x4_epi64(isum[c], 1)),
                _mm256_slli_epi32(sc_bs, 5));
        }
        k_finish(NC, t, ib, isum8, NULL, fp16_at(blk + 208), 0.0f, acc);
    }
    for (int c = 0; c < NC; c++) res[c] = hsum8(acc[c]);
}
