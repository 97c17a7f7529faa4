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
