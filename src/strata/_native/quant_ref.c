/* Portable block formats: type table, exact dequantisation, and unpacking of quantised rows to
 * the common (s, A, B) layout of quant.h. Bit layouts follow ggml-quants.c. */
#include <string.h>
#include "quant.h"
#include "iq_scales.h"

#define QK_K 256

/* The i-quants' tables (st_set_iq_grid / st_set_iq_ksigns): grid values, 8 per entry (4 for
 * IQ3_*); IQ1_M reads IQ1_S's grid, which is the same */
static int8_t grid_iq2xxs[256 * 8], grid_iq2xs[512 * 8], grid_iq2s[1024 * 8];
static int8_t grid_iq3xxs[256 * 4], grid_iq3s[512 * 4], grid_iq1s[2048 * 8];
static uint8_t ksigns_iq2[128];
static uint64_t ksigns_pm1[128];  /* the same patterns as 8 bytes, -1 (bit set) or +1 */
static int iq_set_mask, ksigns_set;  /* bit (qtype & 31) per grid set */
/* Unpacking 8 values at a time (SWAR in a u64): sign_mask[b] has byte j 0xFF where bit j of b
 * is set; IQ1's values 8 g + 1 and 8 g - 1 per grid entry */
static uint64_t sign_mask[256], iq1_values[2][2048];  /* [delta negative][grid index] */

static int8_t *iq_grid(int qtype, int *n, int *width) {
    *width = 8;
    switch (qtype) {
    case ST_IQ2_XXS: *n = 256; return grid_iq2xxs;
    case ST_IQ2_XS: *n = 512; return grid_iq2xs;
    case ST_IQ2_S: *n = 1024; return grid_iq2s;
    case ST_IQ3_XXS: *n = 256; *width = 4; return grid_iq3xxs;
    case ST_IQ3_S: *n = 512; *width = 4; return grid_iq3s;
    case ST_IQ1_S: case ST_IQ1_M: *n = 2048; return grid_iq1s;
    default: *n = 0; return NULL;
    }
}

static int iq_ready(int qtype) {
    const int needs_signs = qtype == ST_IQ2_XXS || qtype == ST_IQ2_XS || qtype == ST_IQ3_XXS;
    return ((iq_set_mask >> (qtype & 31)) & 1) && (!needs_signs || ksigns_set);
}

int st_set_iq_grid(int qtype, const int8_t *values, int n, int width) {
    int want_n, want_width;
    int8_t *dst = iq_grid(qtype, &want_n, &want_width);
    if (!dst || n != want_n || width != want_width) return -1;
    memcpy(dst, values, (size_t)n * (size_t)width);
    if (qtype == ST_IQ1_S || qtype == ST_IQ1_M) {
        for (int i = 0; i < n; i++) {
            int8_t p[8], m[8];
            for (int j = 0; j < 8; j++) {
                p[j] = (int8_t)(8 * values[8 * i + j] + 1);
                m[j] = (int8_t)(8 * values[8 * i + j] - 1);
            }
            memcpy(&iq1_values[0][i], p, 8);
            memcpy(&iq1_values[1][i], m, 8);
        }
    }
    for (int b = 0; b < 256; b++) {
        uint64_t m = 0;
        for (int j = 0; j < 8; j++)
            if ((b >> j) & 1) m |= (uint64_t)0xFF << (8 * j);
        sign_mask[b] = m;
    }
    iq_set_mask |= 1 << (qtype & 31);
    return 0;
}

int st_set_iq_ksigns(const uint8_t *signs) {
    for (int i = 0; i < 128; i++)  /* fused_iq.c's IQ2_XS rows compute them from this rule */
        if (signs[i] != (uint8_t)(i | (__builtin_parity((unsigned)i) << 7))) return -1;
    memcpy(ksigns_iq2, signs, 128);
    for (int i = 0; i < 128; i++) {
        uint64_t v = 0;
        for (int j = 0; j < 8; j++) v |= (uint64_t)((signs[i] >> j) & 1 ? 0xFF : 0x01) << (8 * j);
        ksigns_pm1[i] = v;
    }
    ksigns_set = 1;
    return 0;
}

int st_block_size(int qtype) {
    switch (qtype) {
    case ST_F32: case ST_F16: case ST_BF16: return 1;
    case ST_Q4_0: case ST_Q4_1: case ST_Q5_0: case ST_Q5_1: case ST_Q8_0: case ST_IQ4_NL:
        return 32;
    case ST_Q2_K: case ST_Q3_K: case ST_Q4_K: case ST_Q5_K: case ST_Q6_K: case ST_IQ4_XS:
        return QK_K;
    case ST_IQ2_XXS: case ST_IQ2_XS: case ST_IQ2_S: case ST_IQ3_XXS: case ST_IQ3_S:
    case ST_IQ1_S: case ST_IQ1_M:
        return iq_ready(qtype) ? QK_K : 0;
    default: return 0;
    }
}

int st_type_size(int qtype) {
    switch (qtype) {
    case ST_F32: return 4;
    case ST_F16: case ST_BF16: return 2;
    case ST_Q4_0: return 18;           /* fp16 d, 16 bytes of nibbles */
    case ST_Q4_1: return 20;           /* fp16 d, fp16 m, 16 bytes of nibbles */
    case ST_Q5_0: return 22;           /* fp16 d, u32 of fifth bits, 16 bytes of nibbles */
    case ST_Q5_1: return 24;           /* fp16 d, fp16 m, u32 of fifth bits, 16 nibble bytes */
    case ST_Q8_0: return 34;           /* fp16 d, 32 int8 */
    case ST_IQ4_NL: return 18;         /* fp16 d, 16 bytes of 4-bit indices into kvalues */
    case ST_Q2_K: return 84;           /* 16 scale|min bytes, 64 bytes of 2-bit values, d, dmin */
    case ST_Q3_K: return 110;          /* 32 bytes of high bits, 64 of 2-bit values, 12 scale
                                          bytes, fp16 d */
    case ST_Q4_K: return 144;          /* fp16 d, fp16 dmin, 12 scale bytes, 128 nibble bytes */
    case ST_Q5_K: return 176;          /* as Q4_K plus 32 bytes of high bits */
    case ST_Q6_K: return 210;          /* 128 low nibbles, 64 high 2-bit, 16 int8 scales, fp16 d */
    case ST_IQ4_XS: return 136;        /* fp16 d, u16 high scale bits, 4 bytes of low scale
                                          nibbles, 128 bytes of 4-bit indices */
    case ST_IQ2_XXS: return 66;        /* fp16 d, 8 x (4 grid bytes, u32 signs | scale) */
    case ST_IQ2_XS: return 74;         /* fp16 d, 32 u16 (9-bit grid | 7-bit signs), 8 scales */
    case ST_IQ2_S: return 82;          /* fp16 d, 32 grid bytes, 32 sign bytes, 8 qh, 8 scales */
    case ST_IQ3_XXS: return 98;        /* fp16 d, 64 grid bytes, 8 u32 signs | scale */
    case ST_IQ3_S: return 110;         /* fp16 d, 64 grid bytes, 8 qh, 32 sign bytes, 4 scales */
    case ST_IQ1_S: return 50;          /* fp16 d, 32 grid bytes, 8 u16 qh (high bits, scale,
                                          delta sign) */
    case ST_IQ1_M: return 56;          /* 32 grid bytes, 16 qh bytes, 4 u16 scales (with d) */
    default: return 0;
    }
}

int st_is_supported(int qtype) { return st_block_size(qtype) > 0; }

int st_has_min(int qtype) {
    return qtype == ST_Q4_1 || qtype == ST_Q5_1 || qtype == ST_Q2_K || qtype == ST_Q4_K
           || qtype == ST_Q5_K;
}

int st_is_float_type(int qtype) {
    return qtype == ST_F32 || qtype == ST_F16 || qtype == ST_BF16;
}

int st_is_k_type(int qtype) {
    return qtype == ST_Q2_K || qtype == ST_Q3_K || qtype == ST_Q4_K || qtype == ST_Q5_K
           || qtype == ST_Q6_K || qtype == ST_IQ4_XS;
}

int st_is_grid_iq(int qtype) {
    return qtype == ST_IQ2_XXS || qtype == ST_IQ2_XS || qtype == ST_IQ2_S || qtype == ST_IQ3_XXS
           || qtype == ST_IQ3_S || qtype == ST_IQ1_S || qtype == ST_IQ1_M;
}

int st_act_kind(int qtype) {
    return st_is_float_type(qtype) ? ST_ACT_FLOAT
           : st_is_k_type(qtype) || st_is_grid_iq(qtype) ? ST_ACT_K : ST_ACT_Q8;
}

float st_fp16_to_fp32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exponent = (h >> 10) & 0x1fu;
    uint32_t mantissa = h & 0x3ffu;
    union { uint32_t u; float f; } v;
    if (exponent == 0) {
        /* zero or subnormal: mantissa * 2^-24 is exact in float32 */
        v.f = (float)mantissa * 5.9604644775390625e-8f;
        v.u |= sign;
    } else if (exponent == 31) {
        v.u = sign | 0x7f800000u | (mantissa << 13);
    } else {
        v.u = sign | ((exponent + 112u) << 23) | (mantissa << 13);
    }
    return v.f;
}

static inline uint16_t read_u16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

static inline float read_fp16(const uint8_t *p) { return st_fp16_to_fp32(read_u16(p)); }

/* 6-bit scale and min of sub-block j of a Q4_K / Q5_K super-block (ggml get_scale_min_k4). */
static inline void scale_min_k4(int j, const uint8_t *q, uint8_t *sc, uint8_t *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* IQ4_NL's and IQ4_XS's non-linear values */
static const int8_t kvalues_iq4[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                       1, 13, 25, 38, 53, 69, 89, 113};

/* The 32-column blocks with nibbles (Q4_1, Q5_0, Q5_1, IQ4_NL): value l < 16 in the low nibble
 * of qs[l], value l + 16 in the high one; Q5_*'s fifth bit of value l is bit l of the u32 qh;
 * Q5_0 subtracts 16, IQ4_NL looks the nibble up in kvalues_iq4. w = d * value (+ m: Q4_1, Q5_1,
 * whose b is -m, so a * s - b rounds as gguf's (d * q) + m). */
static void unpack_block32(int qtype, const uint8_t *blk, int8_t *y, float *a, float *b) {
    const int has_min = st_has_min(qtype);
    const int has_qh = qtype == ST_Q5_0 || qtype == ST_Q5_1;
    const float d = read_fp16(blk), m = has_min ? read_fp16(blk + 2) : 0.0f;
    uint32_t qh = 0;
    if (has_qh) memcpy(&qh, blk + (has_min ? 4 : 2), 4);
    const uint8_t *qs = blk + st_type_size(qtype) - 16;
    for (int l = 0; l < 32; l++) {
        int v = l < 16 ? qs[l] & 0xF : qs[l - 16] >> 4;
        if (has_qh) v |= (int)((qh >> l) & 1) << 4;
        y[l] = (int8_t)(qtype == ST_IQ4_NL ? kvalues_iq4[v] : qtype == ST_Q5_0 ? v - 16 : v);
    }
    a[0] = a[1] = d;
    b[0] = b[1] = has_min ? -m : 0.0f;  /* +0: p - 0 keeps gguf's -0.0 where d < 0, s = 0 */
}

static inline uint32_t read_u32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* 8 values of grid entry g with the sign bits `signs` (bit j: value j negated), 8 bytes at a
 * time: (v ^ m) + 1 per negated byte is -v, never carrying, since grid values are >= 1 */
static inline void put_signed8(int8_t *y, const int8_t *g, int signs) {
    uint64_t v;
    memcpy(&v, g, 8);
    const uint64_t m = sign_mask[signs & 255];
    v = (v ^ m) + (m & 0x0101010101010101ULL);
    memcpy(y, &v, 8);
}

/* 8 IQ1 values 8 * grid + (delta > 0 ? 1 : -1) of entry idx: with a = dl / 8, a * s rounds as
 * gguf's dl * (grid + delta), delta = +-0.125 (the same exact product, rounded once) */
static inline void put_iq1(int8_t *y, int idx, int delta_negative) {
    memcpy(y, &iq1_values[delta_negative & 1][idx], 8);  /* no branch on the random sign */
}

const int8_t *st_iq_grid_table(int qtype) {
    int n, width;
    return iq_grid(qtype, &n, &width);
}

const uint64_t *st_iq_ksigns_pm1_table(void) { return ksigns_pm1; }

const uint64_t *st_iq1_values_table(void) { return &iq1_values[0][0]; }

/* a[16], one scale per 16 columns, of an i-quant super-block (w = a * s): m * sc[g] of
 * iq_scales.h. Each equals gguf's dequantize_blocks' scale, rounded once, as its float ops do
 * (the factors 1/8, 1/4 are powers of two); IQ1's dl * (g +- 1/8) is (dl / 8) * (8 g +- 1). */
void st_iq_scales(int qtype, const uint8_t *blk, float *a) {
    int16_t sc[16];
    const float m = st_iq_int_scales(qtype, blk, sc);
    for (int g = 0; g < 16; g++) a[g] = m * (float)sc[g];
}

/* One i-quant super-block's y[256] signed values */
static void iq_values(int qtype, const uint8_t *blk, int8_t *y) {
    switch (qtype) {
    case ST_IQ2_XXS:  /* per 32: u32 of 4 grid bytes, u32 of 4 x 7 sign bits | scale << 28 */
        for (int ib = 0; ib < 8; ib++) {
            const uint8_t *q = blk + 2 + 8 * ib;
            const uint32_t aux = read_u32(q + 4);
            for (int l = 0; l < 4; l++)
                put_signed8(y + 32 * ib + 8 * l, grid_iq2xxs + 8 * q[l],
                            ksigns_iq2[(aux >> (7 * l)) & 127]);
        }
        break;
    case ST_IQ2_XS:  /* 32 u16: grid index (9 bits) | sign index << 9 */
        for (int k = 0; k < 32; k++) {
            const uint16_t q = read_u16(blk + 2 + 2 * k);
            put_signed8(y + 8 * k, grid_iq2xs + 8 * (q & 511), ksigns_iq2[q >> 9]);
        }
        break;
    case ST_IQ2_S:  /* grid index: byte k | 2 bits of qh[k / 4] << 8; sign byte k */
        for (int k = 0; k < 32; k++) {
            const int idx = blk[2 + k] | (((blk[66 + k / 4] >> (2 * (k & 3))) & 3) << 8);
            put_signed8(y + 8 * k, grid_iq2s + 8 * idx, blk[34 + k]);
        }
        break;
    case ST_IQ3_XXS:  /* 64 grid bytes (4 values each); per 32: u32 of 4 x 7 sign bits | scale */
        for (int ib = 0; ib < 8; ib++) {
            const uint32_t aux = read_u32(blk + 66 + 4 * ib);
            for (int l = 0; l < 4; l++) {
                const int signs = ksigns_iq2[(aux >> (7 * l)) & 127];
                int8_t g8[8];
                memcpy(g8, grid_iq3xxs + 4 * blk[2 + 8 * ib + 2 * l], 4);
                memcpy(g8 + 4, grid_iq3xxs + 4 * blk[2 + 8 * ib + 2 * l + 1], 4);
                put_signed8(y + 32 * ib + 8 * l, g8, signs);
            }
        }
        break;
    case ST_IQ3_S:  /* grid index: byte k | bit k of qh << 8 (4 values); sign bytes */
        for (int k = 0; k < 64; k += 2) {
            int8_t g8[8];
            for (int h = 0; h < 2; h++) {
                const int idx = blk[2 + k + h] | (((blk[66 + (k + h) / 8] >> ((k + h) & 7)) & 1) << 8);
                memcpy(g8 + 4 * h, grid_iq3s + 4 * idx, 4);
            }
            put_signed8(y + 4 * k, g8, blk[74 + k / 2]);
        }
        break;
    case ST_IQ1_S:  /* per 32: u16 qh = 4 x 3 high index bits | scale << 12 | delta sign << 15 */
        for (int ib = 0; ib < 8; ib++) {
            const uint16_t qh = read_u16(blk + 34 + 2 * ib);
            for (int l = 0; l < 4; l++) {
                const int idx = blk[2 + 4 * ib + l] | (((qh >> (3 * l)) & 7) << 8);
                put_iq1(y + 32 * ib + 8 * l, idx, qh >> 15);
            }
        }
        break;
    case ST_IQ1_M:  /* per 8 values: 3 high index bits and a delta sign in a qh nibble */
        for (int k = 0; k < 32; k++) {
            const int nib = (blk[32 + k / 2] >> (4 * (k & 1))) & 15;
            put_iq1(y + 8 * k, blk[k] | ((nib & 7) << 8), (nib >> 3) & 1);
        }
        break;
    default:
        break;
    }
}

void st_unpack_iq(int qtype, const uint8_t *blk, int8_t *y, float *a) {
    st_iq_scales(qtype, blk, a);
    iq_values(qtype, blk, y);
}

float st_iq_superblock(int qtype, const uint8_t *blk, int8_t *v, int16_t *sc) {
    iq_values(qtype, blk, v);
    return st_iq_int_scales(qtype, blk, sc);
}

void st_k_superblock(int qtype, const uint8_t *blk, int8_t *v, int16_t *sc, int16_t *m,
                     float *d, float *dmin) {
    *dmin = 0.0f;
    for (int g = 0; g < 16; g++) m[g] = 0;
    switch (qtype) {
    case ST_Q4_K:
    case ST_Q5_K: {
        /* 8 sub-blocks of 32: 6-bit scale and min each (scale_min_k4); sub-block 2j in the low
         * nibbles of qs[32j ..], 2j + 1 in the high ones; Q5_K's fifth bits: bit sub of qh[l] */
        const int is_q5 = qtype == ST_Q5_K;
        const uint8_t *qh = blk + 16, *qs = blk + (is_q5 ? 48 : 16);
        *d = read_fp16(blk);
        *dmin = read_fp16(blk + 2);
        for (int sub = 0; sub < 8; sub++) {
            uint8_t s8, m8;
            scale_min_k4(sub, blk + 4, &s8, &m8);
            const uint8_t *q = qs + 32 * (sub / 2);
            const int shift = (sub & 1) * 4;
            for (int l = 0; l < 32; l++) {
                int u = (q[l] >> shift) & 0xF;
                if (is_q5) u |= ((qh[l] >> sub) & 1) << 4;
                v[32 * sub + l] = (int8_t)u;
            }
            sc[2 * sub] = sc[2 * sub + 1] = s8;
            m[2 * sub] = m[2 * sub + 1] = m8;
        }
        break;
    }
    case ST_Q2_K: {
        /* 32-column block b = 4h + j: values (qs[32h + l] >> 2j) & 3; group g of 16 columns:
         * scale scales[g] & 15, min scales[g] >> 4 */
        const uint8_t *qs = blk + 16;
        *d = read_fp16(blk + 80);
        *dmin = read_fp16(blk + 82);
        for (int bk = 0; bk < 8; bk++)
            for (int l = 0; l < 32; l++)
                v[32 * bk + l] = (int8_t)((qs[32 * (bk >> 2) + l] >> (2 * (bk & 3))) & 3);
        for (int g = 0; g < 16; g++) {
            sc[g] = blk[g] & 15;
            m[g] = blk[g] >> 4;
        }
        break;
    }
    case ST_Q3_K: {
        /* block b = 4h + j: value ((qs[32h + l] >> 2j) & 3) - 4 unless bit b of hmask[l];
         * group g: 6-bit scale - 32, the low 4 bits in bytes 0-7 (low nibbles for g < 8),
         * the high 2 bits in bytes 8-11 */
        const uint8_t *hmask = blk, *qs = blk + 32, *s8 = blk + 96;
        *d = read_fp16(blk + 108);
        for (int bk = 0; bk < 8; bk++)
            for (int l = 0; l < 32; l++) {
                const int u = (qs[32 * (bk >> 2) + l] >> (2 * (bk & 3))) & 3;
                v[32 * bk + l] = (int8_t)(u - (((hmask[l] >> bk) & 1) ? 0 : 4));
            }
        for (int g = 0; g < 16; g++) {
            const int lo = g < 8 ? s8[g] & 15 : s8[g - 8] >> 4;
            const int hi = (s8[8 + (g & 3)] >> (2 * (g >> 2))) & 3;
            sc[g] = (int16_t)((lo | (hi << 4)) - 32);
        }
        break;
    }
    case ST_Q6_K: {
        /* ql [128], qh [64], int8 scales [16], d: half n (128 columns) takes ql[64n ..],
         * qh[32n ..]; value = 6 bits - 32 */
        const uint8_t *ql = blk, *qh = blk + 128;
        *d = read_fp16(blk + 208);
        for (int n = 0; n < 2; n++) {
            const uint8_t *l_ = ql + 64 * n, *h_ = qh + 32 * n;
            int8_t *y = v + 128 * n;
            for (int l = 0; l < 32; l++) {
                y[l] = (int8_t)(((l_[l] & 0xF) | ((h_[l] & 3) << 4)) - 32);
                y[l + 32] = (int8_t)(((l_[l + 32] & 0xF) | (((h_[l] >> 2) & 3) << 4)) - 32);
                y[l + 64] = (int8_t)(((l_[l] >> 4) | (((h_[l] >> 4) & 3) << 4)) - 32);
                y[l + 96] = (int8_t)(((l_[l + 32] >> 4) | (((h_[l] >> 6) & 3) << 4)) - 32);
            }
        }
        for (int g = 0; g < 16; g++) sc[g] = (int8_t)blk[192 + g];
        break;
    }
    case ST_IQ4_XS: {
        /* block b of 32: 6-bit scale ls (low 4 bits: nibble b % 2 of byte 4 + b / 2, high 2:
         * bits 2b of the u16 at 2), w = d * (ls - 32) * kvalues[index]; its 16 bytes at
         * 8 + 16b: low nibbles columns 0-15, high nibbles 16-31 */
        const uint16_t sh = read_u16(blk + 2);
        *d = read_fp16(blk);
        for (int bk = 0; bk < 8; bk++) {
            const uint8_t *q = blk + 8 + 16 * bk;
            for (int l = 0; l < 16; l++) {
                v[32 * bk + l] = kvalues_iq4[q[l] & 15];
                v[32 * bk + l + 16] = kvalues_iq4[q[l] >> 4];
            }
            const int ls = ((blk[4 + bk / 2] >> (4 * (bk & 1))) & 15)
                           | (((sh >> (2 * bk)) & 3) << 4);
            sc[2 * bk] = sc[2 * bk + 1] = (int16_t)(ls - 32);
        }
        break;
    }
    default:
        *d = 0.0f;
        memset(v, 0, QK_K);
        for (int g = 0; g < 16; g++) sc[g] = 0;
    }
}

/* Unpack n_blocks blocks: s[n] signed values, a/b one per group of 16 (w = a * s - b). */
static void unpack_blocks(int qtype, const uint8_t *src, int64_t n_blocks,
                          int8_t *s, float *a, float *b) {
    for (int64_t ib = 0; ib < n_blocks; ib++) {
        switch (qtype) {
        case ST_Q4_0: {
            const uint8_t *blk = src + ib * 18;
            float d = read_fp16(blk);
            const uint8_t *qs = blk + 2;
            int8_t *y = s + ib * 32;
            for (int j = 0; j < 16; j++) {
                y[j] = (int8_t)((qs[j] & 0xF) - 8);
                y[j + 16] = (int8_t)((qs[j] >> 4) - 8);
            }
            a[ib * 2] = a[ib * 2 + 1] = d;
            b[ib * 2] = b[ib * 2 + 1] = 0.0f;
            break;
        }
        case ST_Q4_1: case ST_Q5_0: case ST_Q5_1: case ST_IQ4_NL:
            unpack_block32(qtype, src + ib * st_type_size(qtype), s + ib * 32, a + ib * 2,
                           b + ib * 2);
            break;
        case ST_Q8_0: {
            const uint8_t *blk = src + ib * 34;
            float d = read_fp16(blk);
            memcpy(s + ib * 32, blk + 2, 32);
            a[ib * 2] = a[ib * 2 + 1] = d;
            b[ib * 2] = b[ib * 2 + 1] = 0.0f;
            break;
        }
        case ST_Q2_K: case ST_Q3_K: case ST_Q4_K: case ST_Q5_K: case ST_Q6_K: case ST_IQ4_XS: {
            int16_t sc[16], m[16];
            float d, dmin;
            st_k_superblock(qtype, src + ib * st_type_size(qtype), s + ib * QK_K, sc, m, &d,
                            &dmin);
            for (int g = 0; g < 16; g++) {
                a[ib * 16 + g] = d * (float)sc[g];
                b[ib * 16 + g] = st_has_min(qtype) ? dmin * (float)m[g] : 0.0f;
            }
            break;
        }
        case ST_IQ2_XXS: case ST_IQ2_XS: case ST_IQ2_S: case ST_IQ3_XXS: case ST_IQ3_S:
        case ST_IQ1_S: case ST_IQ1_M:
            st_unpack_iq(qtype, src + ib * st_type_size(qtype), s + ib * QK_K, a + ib * 16);
            for (int g = 0; g < 16; g++) b[ib * 16 + g] = 0.0f;
            break;
        default:
            break;
        }
    }
}

void st_dequantize(int qtype, const uint8_t *src, float *dst, int64_t n_blocks) {
    if (qtype == ST_F32) {
        memcpy(dst, src, (size_t)n_blocks * 4);
        return;
    }
    if (qtype == ST_F16 || qtype == ST_BF16) {
        for (int64_t i = 0; i < n_blocks; i++) {
            uint16_t h = read_u16(src + 2 * i);
            dst[i] = qtype == ST_F16 ? st_fp16_to_fp32(h) : st_bf16_to_fp32(h);
        }
        return;
    }
    int bs = st_block_size(qtype);
    int ts = st_type_size(qtype);
    int8_t s[QK_K];
    float a[QK_K / ST_GROUP], b[QK_K / ST_GROUP];
    for (int64_t ib = 0; ib < n_blocks; ib++) {
        unpack_blocks(qtype, src + ib * ts, 1, s, a, b);
        float *y = dst + ib * bs;
        for (int i = 0; i < bs; i++) {
            /* two roundings, like gguf: (a * s) then - b */
            float p = a[i / ST_GROUP] * (float)s[i];
            y[i] = p - b[i / ST_GROUP];
        }
    }
}

int st_cols_pad(int qtype, int cols) {
    int pad = st_is_float_type(qtype) ? 16 : ST_PAD;
    return (cols + pad - 1) / pad * pad;
}

void st_unpack_row(int qtype, const uint8_t *row, int cols, int cols_pad,
                   uint8_t *s, float *A, float *B) {
    int bs = st_block_size(qtype);
    int ts = st_type_size(qtype);
    int num_groups = cols / ST_GROUP;
    int num_blocks = cols / bs;
    if (st_unpack_row_simd(qtype, row, cols, s, A, B)) goto pad;
    /* the group scales go to the tail of A first, then spread to lanes from the front */
    float *a_groups = A + (cols_pad / ST_LANE) - num_groups;
    const int chunk_blocks = bs == 32 ? 8 : 1;
    for (int ib = 0; ib < num_blocks; ib += chunk_blocks) {
        int nb = num_blocks - ib < chunk_blocks ? num_blocks - ib : chunk_blocks;
        unpack_blocks(qtype, row + (int64_t)ib * ts, nb, (int8_t *)s + ib * bs,
                      a_groups + ib * bs / ST_GROUP, B + ib * bs / ST_GROUP);
    }
    for (int g = 0; g < num_groups; g++) {
        float ag = a_groups[g];
        A[4 * g] = A[4 * g + 1] = A[4 * g + 2] = A[4 * g + 3] = ag;
    }
#if ST_WEIGHT_BIAS
    for (int i = 0; i < cols; i++) s[i] = (uint8_t)(s[i] ^ 0x80);
#endif
pad:
    for (int i = cols; i < cols_pad; i++) s[i] = (uint8_t)ST_WEIGHT_BIAS;
    for (int l = cols / ST_LANE; l < cols_pad / ST_LANE; l++) A[l] = 0.0f;
    for (int g = num_groups; g < cols_pad / ST_GROUP; g++) B[g] = 0.0f;
}

void st_unpack_row_float(int qtype, const uint8_t *row, int cols, int cols_pad, float *w) {
    if (!st_unpack_row_float_simd(qtype, row, cols, w)) st_dequantize(qtype, row, w, cols);
    for (int i = cols; i < cols_pad; i++) w[i] = 0.0f;
}
