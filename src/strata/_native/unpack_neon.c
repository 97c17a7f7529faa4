/* NEON unpacking of quantised rows to the (s, A, B) layout of quant.h (aarch64); mirrors the
 * AVX2 code in unpack_simd.c. The scalar unpacker in quant_ref.c defines the result. */
#include <string.h>
#include "quant.h"

#if defined(__ARM_NEON) && defined(__aarch64__)
#include <arm_neon.h>

static inline float fp16_at(const uint8_t *p) {
    __fp16 h;
    memcpy(&h, p, 2);
    return (float)h;
}

static inline void store_lanes(float *A, float a, int num_floats) {
    float32x4_t v = vdupq_n_f32(a);
    for (int i = 0; i < num_floats; i += 4) vst1q_f32(A + i, v);
}

/* 6-bit scale and min of sub-block j (ggml get_scale_min_k4) */
static inline void scale_min(int j, const uint8_t *q, int *sc, int *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

int st_unpack_row_simd(int qtype, const uint8_t *row, int cols, uint8_t *s, float *A, float *B) {
    /* no VNNI on ARM: ST_WEIGHT_BIAS is 0, s is stored signed */
    const uint8x16_t low4 = vdupq_n_u8(0x0F);
    switch (qtype) {
    case ST_Q4_0: {
        const int8x16_t eight = vdupq_n_s8(8);
        for (int ib = 0; ib < cols / 32; ib++) {
            const uint8_t *blk = row + ib * 18;
            uint8x16_t qs = vld1q_u8(blk + 2);                                 /* [16] */
            vst1q_s8((int8_t *)s + ib * 32, vsubq_s8(vreinterpretq_s8_u8(vandq_u8(qs, low4)), eight));
            vst1q_s8((int8_t *)s + ib * 32 + 16, vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8(qs, 4)), eight));
            store_lanes(A + ib * 8, fp16_at(blk), 8);
            B[ib * 2] = B[ib * 2 + 1] = 0.0f;
        }
        return 1;
    }
    case ST_Q8_0:
        for (int ib = 0; ib < cols / 32; ib++) {
            const uint8_t *blk = row + ib * 34;
            memcpy(s + ib * 32, blk + 2, 32);
            store_lanes(A + ib * 8, fp16_at(blk), 8);
            B[ib * 2] = B[ib * 2 + 1] = 0.0f;
        }
        return 1;
    case ST_Q4_K:
    case ST_Q5_K: {
        const int is_q5 = qtype == ST_Q5_K;
        const uint8x16_t sixteen = vdupq_n_u8(16);
        for (int ib = 0; ib < cols / 256; ib++) {
            const uint8_t *blk = row + ib * (is_q5 ? 176 : 144);
            float d = fp16_at(blk), dmin = fp16_at(blk + 2);
            const uint8_t *qs = blk + (is_q5 ? 48 : 16);
            uint8_t *y = s + ib * 256;
            for (int j = 0; j < 4; j++) {
                for (int half = 0; half < 2; half++) {            /* columns l = 16 * half .. */
                    uint8x16_t q = vld1q_u8(qs + 32 * j + 16 * half);
                    uint8x16_t lo = vandq_u8(q, low4);                          /* sub-block 2j */
                    uint8x16_t hi = vshrq_n_u8(q, 4);                           /* 2j + 1 */
                    if (is_q5) {
                        uint8x16_t qh = vld1q_u8(blk + 16 + 16 * half);
                        lo = vorrq_u8(lo, vandq_u8(vtstq_u8(qh, vdupq_n_u8((uint8_t)(1 << (2 * j)))), sixteen));
                        hi = vorrq_u8(hi, vandq_u8(vtstq_u8(qh, vdupq_n_u8((uint8_t)(1 << (2 * j + 1)))), sixteen));
                    }
                    vst1q_u8(y + 64 * j + 16 * half, lo);
                    vst1q_u8(y + 64 * j + 32 + 16 * half, hi);
                }
            }
            for (int sub = 0; sub < 8; sub++) {
                int sc, m;
                scale_min(sub, blk + 4, &sc, &m);
                store_lanes(A + ib * 64 + sub * 8, d * (float)sc, 8);
                B[ib * 16 + 2 * sub] = B[ib * 16 + 2 * sub + 1] = dmin * (float)m;
            }
        }
        return 1;
    }
    case ST_Q6_K: {
        const uint8x16_t high2 = vdupq_n_u8(0x30);
        const int8x16_t thirty_two = vdupq_n_s8(32);
        for (int ib = 0; ib < cols / 256; ib++) {
            const uint8_t *blk = row + ib * 210;
            const int8_t *scales = (const int8_t *)(blk + 192);
            float d = fp16_at(blk + 208);
            int8_t *y = (int8_t *)s + ib * 256;
            for (int n = 0; n < 2; n++) {
                for (int half = 0; half < 2; half++) {            /* l = 16 * half .. + 15 */
                    uint8x16_t ql0 = vld1q_u8(blk + 64 * n + 16 * half);
                    uint8x16_t ql1 = vld1q_u8(blk + 64 * n + 32 + 16 * half);
                    uint8x16_t h = vld1q_u8(blk + 128 + 32 * n + 16 * half);
                    uint8x16_t v0 = vorrq_u8(vandq_u8(ql0, low4), vandq_u8(vshlq_n_u8(h, 4), high2));
                    uint8x16_t v1 = vorrq_u8(vandq_u8(ql1, low4), vandq_u8(vshlq_n_u8(h, 2), high2));
                    uint8x16_t v2 = vorrq_u8(vshrq_n_u8(ql0, 4), vandq_u8(h, high2));
                    uint8x16_t v3 = vorrq_u8(vshrq_n_u8(ql1, 4), vandq_u8(vshrq_n_u8(h, 2), high2));
                    int8_t *yy = y + 128 * n + 16 * half;
                    vst1q_s8(yy, vsubq_s8(vreinterpretq_s8_u8(v0), thirty_two));
                    vst1q_s8(yy + 32, vsubq_s8(vreinterpretq_s8_u8(v1), thirty_two));
                    vst1q_s8(yy + 64, vsubq_s8(vreinterpretq_s8_u8(v2), thirty_two));
                    vst1q_s8(yy + 96, vsubq_s8(vreinterpretq_s8_u8(v3), thirty_two));
                }
            }
            for (int g = 0; g < 16; g++) {
                store_lanes(A + ib * 64 + g * 4, d * (float)scales[g], 4);
                B[ib * 16 + g] = 0.0f;
            }
        }
        return 1;
    }
    default:
        return 0;
    }
}

int st_unpack_row_float_simd(int qtype, const uint8_t *row, int cols, float *w) {
    int i = 0;
    if (qtype == ST_F16) {
        for (; i + 4 <= cols; i += 4) {
            float16x4_t h;
            memcpy(&h, row + 2 * i, 8);
            vst1q_f32(w + i, vcvt_f32_f16(h));
        }
    } else if (qtype == ST_BF16) {
        for (; i + 4 <= cols; i += 4) {
            uint16x4_t h;
            memcpy(&h, row + 2 * i, 8);
            vst1q_f32(w + i, vreinterpretq_f32_u32(vshll_n_u16(h, 16)));
        }
    } else {
        return 0;
    }
    if (i < cols) st_dequantize(qtype, row + 2 * i, w + i, cols - i);
    return 1;
}

#endif
