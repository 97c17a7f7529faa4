/* The AVX2 k rows of fused_k.c (every x86 build): per 32-column piece maddubs over the weight
 * values and the int8 activations, madd (AVX-VNNI: vpdpwssd) by the pieces' int16 scale factors
 * into 8 int32 lanes; per super-block one conversion (k_finish). Included by fused_k.c only,
 * under __AVX2__ && __FMA__ && __F16C__, after its k_tokens. */
#pragma once
#include "fused_f16.h"
#include "lane_sum.h"
#include "kscales_avx2.h"
#include "kdot_avx2.h"

/* byte-wise bit n of `bits` moved to bit `to` (value: 1 << to in every byte), 0 elsewhere: a
 * k-quant's extra bit (Q3_K's hmask, Q5_K's qh) joining its low bits (n, to constants) */
static inline __m256i bit_to(__m256i bits, int n, int to, __m256i value) {
    return _mm256_and_si256(n <= to ? _mm256_slli_epi16(bits, to - n)
                                    : _mm256_srli_epi16(bits, n - to), value);
}

/* Q4_K / Q5_K: 144- / 176-byte super-blocks, 8 sub-blocks of 32 with a 6-bit scale and min;
 * 32 bytes qs hold sub-block 2j in the low nibbles, 2j + 1 in the high ones; Q5_K's fifth bits
 * are bits 2j / 2j + 1 of qh [32]. u = 0..31, a pair of products <= 2 * 31 * 127. */
ALWAYS_INLINE void row_q45k(const int NC, int is_q5, const uint8_t *row, int64_t ahead, int cols,
                            const k_tokens *t, float *res) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), sixteen = _mm256_set1_epi8(16);
    const int bytes = is_q5 ? 176 : 144;
    __m256 acc[4];
    for (int c = 0; c < NC; c++) acc[c] = _mm256_setzero_ps();
    for (int ib = 0; ib < cols / 256; ib++) {
        const uint8_t *blk = row + (int64_t)ib * bytes;
        st_prefetch(blk + ahead, bytes);
        __m128i sc8, m8;
        q45k_scale_bytes(blk, &sc8, &m8);
        const __m256i scales = in_both_lanes(_mm_cvtepu8_epi16(sc8));     /* [8] sub-blocks */
        const __m256i m16 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m8, m8));  /* [16] groups */
        const uint8_t *qs = blk + (is_q5 ? 48 : 16);
        const __m256i qh = is_q5 ? _mm256_loadu_si256((const __m256i *)(blk + 16))
                                 : _mm256_setzero_si256();
        __m256i isum[4], imin[4];
        for (int c = 0; c < NC; c++) isum[c] = _mm256_setzero_si256();
        for (int j = 0; j < 4; j++) {                   /* columns 64j .. 64j + 63 */
            const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
            __m256i lo = _mm256_and_si256(v, low4);                          /* sub-block 2j */
            __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);    /* 2j + 1 */
            if (is_q5) {
                lo = _mm256_or_si256(lo, bit_to(qh, 2 * j, 4, sixteen));
                hi = _mm256_or_si256(hi, bit_to(qh, 2 * j + 1, 4, sixteen));
            }
            const __m256i f_lo = factors_one(scales, 2 * j);
            const __m256i f_hi = factors_one(scales, 2 * j + 1);
            const int k = ib * 256 + 64 * j;
            for (int c = 0; c < NC; c++) {
                isum[c] = kdot_add(isum[c], lo, q_at(t, c, k), f_lo);
                isum[c] = kdot_add(isum[c], hi, q_at(t, c, k + 32), f_hi);
            }
        }
        for (int c = 0; c < NC; c++) imin[c] = _mm256_madd_epi16(m16, bs_at(t, c, ib));
        k_finish(NC, t, ib, isum, imin, fp16_at(blk), fp16_at(blk + 2), acc);
    }
    for (int c = 0; c < NC; c++) res[c] = hsum8(acc[c]);
}

/* Q6_K: 210-byte super-blocks (ql [128], qh [64], int8 scales [16], d): 16 groups of 16
 * columns, w = d * sc * (u - 32), u 6 bits; half n (128 columns) takes ql[64n ..], qh[32n ..].
 * The products take u (a pair <= 2 * 63 * 127) and the 32 comes back once a super-block as
 * 32 * sum_g sc[g] * bs[g], exactly. */
ALWAYS_INLINE void row_q6k(const int NC, const uint8_t *row, int64_t ahead, int cols,
                           const k_tokens *t, float *res) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), high2 = _mm256_set1_epi8(0x30);
    __m256 acc[4];
    for (int c = 0; c < NC; c++) acc[c] = _mm256_setzero_ps();
    for (int ib = 0; ib < cols / 256; ib++) {
        const uint8_t *blk = row + (int64_t)ib * 210;
        st_prefetch(blk + ahead, 210);
        const __m128i sc8 = _mm_loadu_si128((const __m128i *)(blk + 192));
        const __m256i sc16 = _mm256_cvtepi8_epi16(sc8);                  /* [16] groups */
        const __m256i scales[2] = {in_both_lanes(_mm256_castsi256_si128(sc16)),  /* groups 0-7 */
                                   in_both_lanes(_mm256_extracti128_si256(sc16, 1))};  /* 8-15 */
        __m256i isum[4];
        for (int c = 0; c < NC; c++) {  /* -32 * sum_g sc[g] * bs[g] */
            const __m256i sc_bs = _mm256_madd_epi16(sc16, bs_at(t, c, ib));
            isum[c] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(sc_bs, 5));
        }
        for (int n = 0; n < 2; n++) {
            const __m256i ql0 = _mm256_loadu_si256((const __m256i *)(blk + 64 * n));
            const __m256i ql1 = _mm256_loadu_si256((const __m256i *)(blk + 64 * n + 32));
            const __m256i h = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * n));
            const __m256i v[4] = {
                _mm256_or_si256(_mm256_and_si256(ql0, low4),
                                _mm256_and_si256(_mm256_slli_epi16(h, 4), high2)),
                _mm256_or_si256(_mm256_and_si256(ql1, low4),
                                _mm256_and_si256(_mm256_slli_epi16(h, 2), high2)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low4),
                                _mm256_and_si256(h, high2)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), low4),
                                _mm256_and_si256(_mm256_srli_epi16(h, 2), high2))};
            for (int p = 0; p < 4; p++) {  /* columns 128n + 32p ..: groups 8n + 2p, + 1 */
                const __m256i f = factors_two(scales[n], p);
                const int k = ib * 256 + 128 * n + 32 * p;
                for (int c = 0; c < NC; c++) isum[c] = kdot_add(isum[c], v[p], q_at(t, c, k), f);
            }
        }
        k_finish(NC, t, ib, isum, NULL, fp16_at(blk + 208), 0.0f, acc);
    }
    for (int c = 0; c < NC; c++) res[c] = hsum8(acc[c]);
}

/* byte-wise (v >> n) & 3 of 32 bytes */
static inline __m256i two_bits(__m256i v, int n) {
    return _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(n)), _mm256_set1_epi8(3));
}

/* Q2_K / Q3_K: 64-column chunk c holds 32-column blocks 2c (groups 4c, 4c + 1) and 2c + 1
 * (groups 4c + 2, 4c + 3), the 2-bit values of block 4h + j at (qs[32h + l] >> 2j) & 3.
 * Q2_K: w = d * sc * u - dmin * m per group; Q3_K: u = those 2 bits + 4 where bit b of
 * hmask[l] is set, w = d * sc * (u - 4), the 4 back once a super-block as Q6_K's 32. */
ALWAYS_INLINE void row_q23k(const int NC, int is_q3, const uint8_t *row, int64_t ahead,
                            int cols, const k_tokens *t, float *res) {
    const __m256i four = _mm256_set1_epi8(4);
    const int bytes = is_q3 ? 110 : 84;
    __m256 acc[4];
    for (int c = 0; c < NC; c++) acc[c] = _mm256_setzero_ps();
    for (int ib = 0; ib < cols / 256; ib++) {
        const uint8_t *blk = row + (int64_t)ib * bytes;
        st_prefetch(blk + ahead, bytes);
        __m128i sc8, m8 = _mm_setzero_si128();
        if (is_q3) {
            sc8 = q3k_scale_bytes(blk);
        } else {
            const __m128i sm = _mm_loadu_si128((const __m128i *)blk);
            sc8 = _mm_and_si128(sm, _mm_set1_epi8(0x0F));
            m8 = _mm_and_si128(_mm_srli_epi16(sm, 4), _mm_set1_epi8(0x0F));
        }
        const __m256i sc16 = _mm256_cvtepi8_epi16(sc8);                  /* [16] groups */
        const __m256i scales[2] = {in_both_lanes(_mm256_castsi256_si128(sc16)),
                                   in_both_lanes(_mm256_extracti128_si256(sc16, 1))};
        const __m256i hm = is_q3 ? _mm256_loadu_si256((const __m256i *)blk)
                                 : _mm256_setzero_si256();
        const uint8_t *qs = blk + (is_q3 ? 32 : 16);
        __m256i isum[4], imin[4];
        for (int c = 0; c < NC; c++)  /* Q3_K: -4 * sum_g sc[g] * bs[g] */
            isum[c] = is_q3 ? _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(
                                  _mm256_madd_epi16(sc16, bs_at(t, c, ib)), 2))
                            : _mm256_setzero_si256();
        for (int ch = 0; ch < 4; ch++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * (ch >> 1)));
            __m256i lo = two_bits(v, 4 * (ch & 1)), hi = two_bits(v, 4 * (ch & 1) + 2);
            if (is_q3) {
                lo = _mm256_or_si256(lo, bit_to(hm, 2 * ch, 2, four));
                hi = _mm256_or_si256(hi, bit_to(hm, 2 * ch + 1, 2, four));
            }
            const int g = 4 * ch;  /* groups g .. g + 3, scales[g / 8] from g % 8 */
            const __m256i f_lo = factors_two(scales[g >> 3], (g & 7) / 2);
            const __m256i f_hi = factors_two(scales[g >> 3], (g & 7) / 2 + 1);
            const int k = ib * 256 + 64 * ch;
            for (int c = 0; c < NC; c++) {
                isum[c] = kdot_add(isum[c], lo, q_at(t, c, k), f_lo);
                isum[c] = kdot_add(isum[c], hi, q_at(t, c, k + 32), f_hi);
            }
        }
        if (is_q3) {
            k_finish(NC, t, ib, isum, NULL, fp16_at(blk + 108), 0.0f, acc);
        } else {
            const __m256i m16 = _mm256_cvtepu8_epi16(m8);
            for (int c = 0; c < NC; c++) imin[c] = _mm256_madd_epi16(m16, bs_at(t, c, ib));
            k_finish(NC, t, ib, isum, imin, fp16_at(blk + 80), fp16_at(blk + 82), acc);
        }
    }
    for (int c = 0; c < NC; c++) res[c] = hsum8(acc[c]);
}

/* IQ4_XS: 136-byte super-blocks, 8 blocks of 32 columns, each 16 bytes of indices (low nibbles
 * columns 0-15, high 16-31) into the non-linear table, one scale ls - 32 per block. Signed
 * values: maddubs(|s|, q with the sign of s), a pair <= 2 * 127 * 127. */
ALWAYS_INLINE void row_iq4xs(const int NC, const uint8_t *row, int64_t ahead, int cols,
                             const k_tokens *t, float *res) {
    const __m256i table = _mm256_broadcastsi128_si256(_mm_setr_epi8(
        -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113));
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    __m256 acc[4];
    for (int c = 0; c < NC; c++) acc[c] = _mm256_setzero_ps();
    for (int ib = 0; ib < cols / 256; ib++) {
        const uint8_t *blk = row + (int64_t)ib * 136;
        st_prefetch(blk + ahead, 136);
        const __m256i scales = in_both_lanes(iq4xs_scale_words(blk));    /* [8] blocks */
        __m256i isum[4];
        for (int c = 0; c < NC; c++) isum[c] = _mm256_setzero_si256();
        for (int j = 0; j < 4; j++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 8 + 32 * j));
            const __m256i lo = _mm256_and_si256(v, low4);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
            const __m256i s[2] = {
                _mm256_shuffle_epi8(table, _mm256_permute2x128_si256(lo, hi, 0x20)),
                _mm256_shuffle_epi8(table, _mm256_permute2x128_si256(lo, hi, 0x31))};
            for (int h = 0; h < 2; h++) {  /* block 2j + h */
                const __m256i f = factors_one(scales, 2 * j + h);
                const __m256i u = _mm256_sign_epi8(s[h], s[h]);
                const int k = ib * 256 + 64 * j + 32 * h;
                for (int c = 0; c < NC; c++)
                    isum[c] = kdot_add(isum[c], u, _mm256_sign_epi8(q_at(t, c, k), s[h]), f);
            }
        }
        k_finish(NC, t, ib, isum, NULL, fp16_at(blk), 0.0f, acc);
    }
    for (int c = 0; c < NC; c++) res[c] = hsum8(acc[c]);
}
