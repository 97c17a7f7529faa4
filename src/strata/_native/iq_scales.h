/* The grid i-quants' (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S) scales as integers:
 * w = m * sc[g] * y[i], g = i / 16, y the signed values of st_unpack_iq (grid value times its
 * sign; 8 g +- 1 for IQ1's grid g and delta) and m the super-block's one float multiplier.
 * The ST_ACT_K rows (fused_iq.c, fused_k.c) sum a super-block's products in int32 with these
 * factors and convert once; quant_ref.c's st_iq_scales is m * sc[g]. Inline: each row has its
 * type a constant, so the switch folds away. */
#pragma once
#include <string.h>
#include "quant.h"

static inline uint32_t st_iq_u32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

static inline uint16_t st_iq_u16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

/* an fp16 as float, inline where the build has an instruction for it: the rows call this once
 * per super-block, and quant_ref.c's st_fp16_to_fp32 out of line cost them a call (spilling
 * every vector register) each time */
#if defined(__F16C__)
#include <immintrin.h>
static inline float st_iq_half(uint16_t h) { return _cvtsh_ss(h); }
#elif defined(__ARM_NEON) && defined(__aarch64__)
static inline float st_iq_half(uint16_t h) {
    __fp16 f;
    memcpy(&f, &h, 2);
    return (float)f;
}
#else
static inline float st_iq_half(uint16_t h) { return st_fp16_to_fp32(h); }
#endif

/* sc[16] (1 .. 31) per 16 columns of super-block blk; returns m */
static inline float st_iq_int_scales(const int qtype, const uint8_t *blk, int16_t *sc) {
    switch (qtype) {
    case ST_IQ2_XXS:  /* per 32: the top 4 bits of its second u32; (ls + 1/2) / 4 = (2 ls + 1) / 8 */
    case ST_IQ3_XXS:  /* (ls + 1/2) / 2 = (2 ls + 1) / 4 */
        for (int ib = 0; ib < 8; ib++) {
            const uint32_t aux = st_iq_u32(blk + (qtype == ST_IQ2_XXS ? 6 + 8 * ib : 66 + 4 * ib));
            sc[2 * ib] = sc[2 * ib + 1] = (int16_t)(2 * (aux >> 28) + 1);
        }
        return st_iq_half(st_iq_u16(blk)) * (qtype == ST_IQ2_XXS ? 0.125f : 0.25f);
    case ST_IQ2_XS:  /* 4 bits per 16 columns: (2 ls + 1) / 8 */
    case ST_IQ2_S:
        for (int g = 0; g < 16; g++)
            sc[g] = (int16_t)(2 * ((blk[(qtype == ST_IQ2_XS ? 66 : 74) + g / 2] >> (4 * (g & 1)))
                                   & 15) + 1);
        return st_iq_half(st_iq_u16(blk)) * 0.125f;
    case ST_IQ3_S:  /* 4 bits per 32: 1 + 2 ls */
        for (int ib = 0; ib < 8; ib++)
            sc[2 * ib] = sc[2 * ib + 1] = (int16_t)(1 + 2 * ((blk[106 + ib / 2] >> (4 * (ib & 1)))
                                                              & 15));
        return st_iq_half(st_iq_u16(blk));
    case ST_IQ1_S:  /* per 32: bits 12-14 of its u16 qh; values 8 g +- 1, so (2 ls + 1) / 8 */
        for (int ib = 0; ib < 8; ib++)
            sc[2 * ib] = sc[2 * ib + 1] =
                (int16_t)(2 * ((st_iq_u16(blk + 34 + 2 * ib) >> 12) & 7) + 1);
        return st_iq_half(st_iq_u16(blk)) * 0.125f;
    default: {  /* ST_IQ1_M: 3 bits per 16 in 4 u16, whose top nibbles hold the fp16 d */
        uint16_t w[4];
        for (int i = 0; i < 4; i++) w[i] = st_iq_u16(blk + 48 + 2 * i);
        for (int g = 0; g < 16; g++) sc[g] = (int16_t)(2 * ((w[g / 4] >> (3 * (g & 3))) & 7) + 1);
        const uint16_t d = (uint16_t)((w[0] >> 12) | ((w[1] >> 8) & 0xF0) | ((w[2] >> 4) & 0xF00)
                                      | (w[3] & 0xF000));
        return st_iq_half(d) * 0.125f;
    }
    }
}
