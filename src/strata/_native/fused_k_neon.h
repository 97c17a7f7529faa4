/* The NEON k rows of fused_k.c (aarch64): per 16 columns vdotq_s32 (or vmull_s8 widening
 * without dotprod) into 4 int32 lanes, scaled by the group's integer scale (vmlaq_n_s32); per
 * super-block one conversion (k_finish). Included by fused_k.c only, under __ARM_NEON &&
 * __aarch64__, after its k_tokens. */
#pragma once
#include <string.h>
#include <arm_neon.h>

#define ALWAYS_INLINE static inline __attribute__((always_inline))

static inline float fp16_at(const uint8_t *p) {
    __fp16 h;
    memcpy(&h, p, 2);
    return (float)h;
}

static inline int8x16_t q_at(const k_tokens *t, int c, int k) { return vld1q_s8(t->q[c] + k); }

/* [4] int32 lanes summing the 16 products a * b (a group: the caller scales all alike, so
 * which column lands in which lane does not matter); without dotprod the int16 products
 * (|a * b| <= 128 * 127) widen pairwise before they add */
static inline int32x4_t dot16(int8x16_t a, int8x16_t b) {
#if defined(__ARM_FEATURE_DOTPROD)
    return vdotq_s32(vdupq_n_s32(0), a, b);
#else
    return vpadalq_s16(vpaddlq_s16(vmull_s8(vget_low_s8(a), vget_low_s8(b))),
                       vmull_high_s8(a, b));
#endif
}

/* the same over 32 columns, a0 * b0 + a1 * b1 (a 32-column block under one scale) */
static inline int32x4_t dot32(int8x16_t a0, int8x16_t b0, int8x16_t a1, int8x16_t b1) {
#if defined(__ARM_FEATURE_DOTPROD)
    return vdotq_s32(vdotq_s32(vdupq_n_s32(0), a0, b0), a1, b1);
#else
    int32x4_t s = vpaddlq_s16(vmull_s8(vget_low_s8(a0), vget_low_s8(b0)));
    s = vpadalq_s16(s, vmull_high_s8(a0, b0));
    s = vpadalq_s16(s, vmull_s8(vget_low_s8(a1), vget_low_s8(b1)));
    return vpadalq_s16(s, vmull_high_s8(a1, b1));
#endif
}

/* [4] int32 lanes of sum_g m[g] * bs[g] over 8 pairs of groups (m16: one min per pair of
 * groups, |bs pair| <= 32 * 127) or over 16 groups (m16 lo / hi: one min per group) */
static inline int32x4_t mins8(int16x8_t m16, const int16_t *bs) {
    const int16x8_t pairs = vpaddq_s16(vld1q_s16(bs), vld1q_s16(bs + 8));  /* [8] sub-blocks */
    return vmlal_high_s16(vmull_s16(vget_low_s16(m16), vget_low_s16(pairs)), m16, pairs);
}

static inline int32x4_t mins16(int16x8_t m_lo, int16x8_t m_hi, const int16_t *bs) {
    const int16x8_t b_lo = vld1q_s16(bs), b_hi = vld1q_s16(bs + 8);        /* [16] groups */
    const int32x4_t s = vmlal_high_s16(vmull_s16(vget_low_s16(m_lo), vget_low_s16(b_lo)),
                                       m_lo, b_lo);
    return vmlal_high_s16(vmlal_s16(s, vget_low_s16(m_hi), vget_low_s16(b_hi)), m_hi, b_hi);
}

/* acc[c] += (float)isum[c] * (d * dk) - (float)imin[c] * (dmin * dk), lane-wise: the one
 * conversion of a super-block (imin: the mins' sums, NULL for the types without) */
ALWAYS_INLINE void k_finish(const int NC, const k_tokens *t, int ib, const int32x4_t *isum,
                            const int32x4_t *imin, float d, float dmin, float32x4_t *acc) {
    for (int c = 0; c < NC; c++) {
        const float dk = t->dk[c][ib];
        acc[c] = vfmaq_f32(acc[c], vcvtq_f32_s32(isum[c]), vdupq_n_f32(d * dk));
        if (imin)
            acc[c] = vfmsq_f32(acc[c], vcvtq_f32_s32(imin[c]), vdupq_n_f32(dmin * dk));
    }
}

/* Q4_K / Q5_K: 144- / 176-byte super-blocks, 8 sub-blocks of 32 with a 6-bit scale and min;
 * 32 bytes qs hold sub-block 2j in the low nibbles, 2j + 1 in the high ones; Q5_K's fifth bits
 * are bits 2j / 2j + 1 of qh [32]. v = 0..31: a lane sums 8 products <= 31 * 127, times a
 * scale <= 63, over 8 sub-blocks (< 2^24). */
ALWAYS_INLINE void row_q45k(const int NC, int is_q5, const uint8_t *row, int64_t ahead, int cols,
                            const k_tokens *t, float *res) {
    const uint8x16_t low4 = vdupq_n_u8(0x0F), sixteen = vdupq_n_u8(16);
    const int bytes = is_q5 ? 176 : 144;
    float32x4_t acc[4];
    for (int c = 0; c < NC; c++) acc[c] = vdupq_n_f32(0.0f);
    for (int ib = 0; ib < cols / 256; ib++) {
        const uint8_t *blk = row + (int64_t)ib * bytes;
        st_prefetch(blk + ahead, bytes);
        uint64_t sc, m;                                 /* [8] sub-blocks, a byte each */
        st_q45k_scale_words(blk, &sc, &m);
        const uint8_t *qs = blk + (is_q5 ? 48 : 16);
        uint8x16_t qh[2] = {vdupq_n_u8(0), vdupq_n_u8(0)};  /* [2][16] columns l, l + 16 */
        if (is_q5) {
            qh[0] = vld1q_u8(blk + 16);
            qh[1] = vld1q_u8(blk + 32);
        }
        int32x4_t isum[4], imin[4];
        for (int c = 0; c < NC; c++) isum[c] = vdupq_n_s32(0);
        for (int j = 0; j < 4; j++) {                   /* columns 64j .. 64j + 63 */
            int8x16_t lo[2], hi[2];                     /* sub-blocks 2j, 2j + 1: [2][16] */
            for (int h = 0; h < 2; h++) {
                const uint8x16_t v = vld1q_u8(qs + 32 * j + 16 * h);
                uint8x16_t l = vandq_u8(v, low4), u = vshrq_n_u8(v, 4);
                if (is_q5) {  /* bit 2j of qh to bit 4, then 2j + 1; qh moves on by 2 */
                    l = vorrq_u8(l, vandq_u8(vshlq_n_u8(qh[h], 4), sixteen));
                    u = vorrq_u8(u, vandq_u8(vshlq_n_u8(qh[h], 3), sixteen));
                    qh[h] = vshrq_n_u8(qh[h], 2);
                }
                lo[h] = vreinterpretq_s8_u8(l);
                hi[h] = vreinterpretq_s8_u8(u);
            }
            const int32_t sc_lo = (int32_t)(sc >> (16 * j) & 0xFF);
            const int32_t sc_hi = (int32_t)(sc >> (16 * j + 8) & 0xFF);
            const int k = ib * 256 + 64 * j;
            for (int c = 0; c < NC; c++) {
                isum[c] = vmlaq_n_s32(isum[c], dot32(lo[0], q_at(t, c, k), lo[1],
                                                     q_at(t, c, k + 16)), sc_lo);
                isum[c] = vmlaq_n_s32(isum[c], dot32(hi[0], q_at(t, c, k + 32), hi[1],
                                                     q_at(t, c, k + 48)), sc_hi);
            }
        }
        const int16x8_t m16 = vreinterpretq_s16_u16(vmovl_u8(vcreate_u8(m)));  /* [8] sub-blocks */
        for (int c = 0; c < NC; c++) imin[c] = mins8(m16, t->bs[c] + ib * 16);
        k_finish(NC, t, ib, isum, imin, fp16_at(blk), fp16_at(blk + 2), acc);
    }
    for (int c = 0; c < NC; c++) res[c] = vaddvq_f32(acc[c]);
}

/* Q6_K: 210-byte super-blocks (ql [128], qh [64], int8 scales [16], d): 16 groups of 16
 * columns, v = u - 32 (u 6 bits); half n (128 columns) takes ql[64n ..], qh[32n ..]. A lane
 * sums 4 products <= 32 * 127, times a scale <= 128, over 16 groups (< 2^26). */
ALWAYS_INLINE void row_q6k(const int NC, const uint8_t *row, int64_t ahead, int cols,
                           const k_tokens *t, float *res) {
    const uint8x16_t low4 = vdupq_n_u8(0x0F), high2 = vdupq_n_u8(0x30);
    const int8x16_t thirty_two = vdupq_n_s8(32);
    float32x4_t acc[4];
    for (int c = 0; c < NC; c++) acc[c] = vdupq_n_f32(0.0f);
    for (int ib = 0; ib < cols / 256; ib++) {
        const uint8_t *blk = row + (int64_t)ib * 210;
        st_prefetch(blk + ahead, 210);
        const int8_t *sc = (const int8_t *)(blk + 192);                  /* [16] groups */
        int32x4_t isum[4];
        for (int c = 0; c < NC; c++) isum[c] = vdupq_n_s32(0);
        for (int n = 0; n < 2; n++)
            for (int h = 0; h < 2; h++) {               /* l = 16h .. 16h + 15 of the half */
                const uint8x16_t ql0 = vld1q_u8(blk + 64 * n + 16 * h);
                const uint8x16_t ql1 = vld1q_u8(blk + 64 * n + 32 + 16 * h);
                const uint8x16_t qh = vld1q_u8(blk + 128 + 32 * n + 16 * h);
                const uint8x16_t u[4] = {          /* columns 128n + 32p + l */
                    vorrq_u8(vandq_u8(ql0, low4), vandq_u8(vshlq_n_u8(qh, 4), high2)),
                    vorrq_u8(vandq_u8(ql1, low4), vandq_u8(vshlq_n_u8(qh, 2), high2)),
                    vorrq_u8(vshrq_n_u8(ql0, 4), vandq_u8(qh, high2)),
                    vorrq_u8(vshrq_n_u8(ql1, 4), vandq_u8(vshrq_n_u8(qh, 2), high2))};
                for (int p = 0; p < 4; p++) {           /* group 8n + 2p + h */
                    const int8x16_t v = vsubq_s8(vreinterpretq_s8_u8(u[p]), thirty_two);
                    const int32_t s = sc[8 * n + 2 * p + h];
                    const int k = ib * 256 + 128 * n + 32 * p + 16 * h;
                    for (int c = 0; c < NC; c++)
                        isum[c] = vmlaq_n_s32(isum[c], dot16(v, q_at(t, c, k)), s);
                }
            }
        k_finish(NC, t, ib, isum, NULL, fp16_at(blk + 208), 0.0f, acc);
    }
    for (int c = 0; c < NC; c++) res[c] = vaddvq_f32(acc[c]);
}

/* Q3_K's 16 group scales (6 bits - 32: the low 4 bits in bytes 0-7, low nibbles for groups
 * 0-7, the high 2 bits in bytes 8-11) from the 12 bytes at p, by llama.cpp's word shuffle */
static inline void q3k_scales(const uint8_t *p, int8_t *sc) {
    const uint32_t four = 0x0f0f0f0f, two = 0x03030303;
    uint32_t u[3], out[4];
    memcpy(u, p, 12);
    out[0] = (u[0] & four) | ((u[2] & two) << 4);                     /* groups 0-3 */
    out[1] = (u[1] & four) | (((u[2] >> 2) & two) << 4);              /* 4-7 */
    out[2] = ((u[0] >> 4) & four) | (((u[2] >> 4) & two) << 4);       /* 8-11 */
    out[3] = ((u[1] >> 4) & four) | (((u[2] >> 6) & two) << 4);       /* 12-15 */
    vst1q_s8(sc, vsubq_s8(vreinterpretq_s8_u32(vld1q_u32(out)), vdupq_n_s8(32)));
}

/* Q2_K / Q3_K: 32-column block b = 4h + j holds the 2-bit values (qs[32h + l] >> 2j) & 3,
 * groups 2b (l < 16) and 2b + 1. Q2_K: w = d * sc * v - dmin * m per group (4-bit sc and m);
 * Q3_K: v = those 2 bits + 4 where bit b of hmask[l] is set, - 4, w = d * sc * v. */
ALWAYS_INLINE void row_q23k(const int NC, int is_q3, const uint8_t *row, int64_t ahead,
                            int cols, const k_tokens *t, float *res) {
    const uint8x16_t three = vdupq_n_u8(3), four = vdupq_n_u8(4);
    const int bytes = is_q3 ? 110 : 84;
    float32x4_t acc[4];
    for (int c = 0; c < NC; c++) acc[c] = vdupq_n_f32(0.0f);
    for (int ib = 0; ib < cols / 256; ib++) {
        const uint8_t *blk = row + (int64_t)ib * bytes;
        st_prefetch(blk + ahead, bytes);
        int8_t sc[16];                                                   /* [16] groups */
        uint8x16_t hm[2] = {vdupq_n_u8(0), vdupq_n_u8(0)};  /* [2][16] columns l, l + 16 */
        if (is_q3) {
            q3k_scales(blk + 96, sc);
            hm[0] = vld1q_u8(blk);
            hm[1] = vld1q_u8(blk + 16);
        } else {
            vst1q_s8(sc, vreinterpretq_s8_u8(vandq_u8(vld1q_u8(blk), vdupq_n_u8(0x0F))));
        }
        const uint8_t *qs = blk + (is_q3 ? 32 : 16);
        int32x4_t isum[4], imin[4];
        for (int c = 0; c < NC; c++) isum[c] = vdupq_n_s32(0);
        for (int h = 0; h < 2; h++) {
            uint8x16_t b[2] = {vld1q_u8(qs + 32 * h), vld1q_u8(qs + 32 * h + 16)};
            for (int j = 0; j < 4; j++) {               /* block 4h + j; b moves on by 2 */
                int8x16_t v[2];
                for (int l = 0; l < 2; l++) {
                    uint8x16_t u = vandq_u8(b[l], three);
                    b[l] = vshrq_n_u8(b[l], 2);
                    if (is_q3) {  /* bit 4h + j of hmask to bit 2; hm moves on by 1 */
                        u = vorrq_u8(u, vandq_u8(vshlq_n_u8(hm[l], 2), four));
                        hm[l] = vshrq_n_u8(hm[l], 1);
                        v[l] = vsubq_s8(vreinterpretq_s8_u8(u), vreinterpretq_s8_u8(four));
                    } else {
                        v[l] = vreinterpretq_s8_u8(u);
                    }
                }
                const int g = 2 * (4 * h + j), k = ib * 256 + 16 * g;
                for (int c = 0; c < NC; c++) {
                    isum[c] = vmlaq_n_s32(isum[c], dot16(v[0], q_at(t, c, k)), sc[g]);
                    isum[c] = vmlaq_n_s32(isum[c], dot16(v[1], q_at(t, c, k + 16)), sc[g + 1]);
                }
            }
        }
        if (is_q3) {
            k_finish(NC, t, ib, isum, NULL, fp16_at(blk + 108), 0.0f, acc);
        } else {
            const uint8x16_t m8 = vshrq_n_u8(vld1q_u8(blk), 4);            /* [16] groups */
            const int16x8_t m_lo = vreinterpretq_s16_u16(vmovl_u8(vget_low_u8(m8)));
            const int16x8_t m_hi = vreinterpretq_s16_u16(vmovl_high_u8(m8));
            for (int c = 0; c < NC; c++) imin[c] = mins16(m_lo, m_hi, t->bs[c] + ib * 16);
            k_finish(NC, t, ib, isum, imin, fp16_at(blk + 80), fp16_at(blk + 82), acc);
        }
    }
    for (int c = 0; c < NC; c++) res[c] = vaddvq_f32(acc[c]);
}

/* IQ4_XS: 136-byte super-blocks, 8 blocks of 32 columns, each 16 bytes of indices (low nibbles
 * columns 0-15, high 16-31) into the non-linear table, one scale ls - 32 per block (ls: low 4
 * bits nibble b % 2 of byte 4 + b / 2, high 2 bits 2b of the u16 at 2). A lane sums 8
 * products <= 127 * 127, times a scale <= 32, over 8 blocks (< 2^26). */
ALWAYS_INLINE void row_iq4xs(const int NC, const uint8_t *row, int64_t ahead, int cols,
                             const k_tokens *t, float *res) {
    static const int8_t values[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                      1, 13, 25, 38, 53, 69, 89, 113};
    const int8x16_t table = vld1q_s8(values);
    const uint8x16_t low4 = vdupq_n_u8(0x0F);
    float32x4_t acc[4];
    for (int c = 0; c < NC; c++) acc[c] = vdupq_n_f32(0.0f);
    for (int ib = 0; ib < cols / 256; ib++) {
        const uint8_t *blk = row + (int64_t)ib * 136;
        st_prefetch(blk + ahead, 136);
        const int sh = blk[2] | (blk[3] << 8);
        int32x4_t isum[4];
        for (int c = 0; c < NC; c++) isum[c] = vdupq_n_s32(0);
        for (int b = 0; b < 8; b++) {
            const int s = (((blk[4 + b / 2] >> (4 * (b & 1))) & 15) | (((sh >> (2 * b)) & 3) << 4))
                          - 32;
            const uint8x16_t idx = vld1q_u8(blk + 8 + 16 * b);
            const int8x16_t lo = vqtbl1q_s8(table, vandq_u8(idx, low4));   /* columns 0-15 */
            const int8x16_t hi = vqtbl1q_s8(table, vshrq_n_u8(idx, 4));    /* 16-31 */
            const int k = ib * 256 + 32 * b;
            for (int c = 0; c < NC; c++)
                isum[c] = vmlaq_n_s32(isum[c], dot32(lo, q_at(t, c, k), hi, q_at(t, c, k + 16)), s);
        }
        k_finish(NC, t, ib, isum, NULL, fp16_at(blk), 0.0f, acc);
    }
    for (int c = 0; c < NC; c++) res[c] = vaddvq_f32(acc[c]);
}

/* The grid i-quants (IQ1_S .. IQ3_S): each super-block decoded once for the NC tokens by the
 * portable st_iq_superblock (signed values y [256], integer factors sc [16] and the multiplier
 * m; no NEON decode of their grid lookups yet), then per 16 columns dot16 times the group's
 * factor: a lane sums 4 products <= 62 * 127, times a factor <= 31, over 16 groups (< 2^24). */
ALWAYS_INLINE void row_iq_grid(const int NC, int qtype, const uint8_t *row, int64_t ahead,
                               int cols, const k_tokens *t, float *res) {
    const int bytes = st_type_size(qtype);
    float32x4_t acc[4];
    for (int c = 0; c < NC; c++) acc[c] = vdupq_n_f32(0.0f);
    int8_t y[256];
    int16_t sc[16];
    for (int ib = 0; ib < cols / 256; ib++) {
        const uint8_t *blk = row + (int64_t)ib * bytes;
        st_prefetch(blk + ahead, bytes);
        const float m = st_iq_superblock(qtype, blk, y, sc);
        int32x4_t isum[4];
        for (int c = 0; c < NC; c++) isum[c] = vdupq_n_s32(0);
        for (int g = 0; g < 16; g++) {
            const int8x16_t v = vld1q_s8(y + 16 * g);
            for (int c = 0; c < NC; c++)
                isum[c] = vmlaq_n_s32(isum[c], dot16(v, q_at(t, c, ib * 256 + 16 * g)), sc[g]);
        }
        k_finish(NC, t, ib, isum, NULL, m, 0.0f, acc);
    }
    for (int c = 0; c < NC; c++) res[c] = vaddvq_f32(acc[c]);
}
