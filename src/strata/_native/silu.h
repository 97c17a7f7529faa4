/* SiLU, v / (1 + e^-v), in plain float operations that the compiler vectorises (AVX-512, AVX2,
 * NEON: whatever the build targets), for the expert products' SiLU(gate) * up and the other
 * SiLUs. expf is a libm call per value: on the CPU pool's prompt-shaped calls (128 rows an expert,
 * AMX rows) it was ~20% of the pool's time (perf, 2 threads on the CPU machine).
 *
 * e^x = 2^n e^r, n = round(x / ln 2), r = x - n ln 2 (ln 2 in two parts, so r is exact enough),
 * e^r from its degree-6 Taylor polynomial on |r| <= ln 2 / 2 (relative error < 2e-7, about an
 * ulp), 2^n put into the exponent bits. Every value takes the same operations in the same order
 * (the build keeps -ffp-contract=off: no fused multiply-adds the scalar tail would not have),
 * so a value's result does not depend on where it sits in a row or on the row's length.
 * Past the float range e^x is +inf (x > 88.72) or 0 (x < -87.33), as expf gives them, so a
 * non-finite gate ends as it did with expf (-inf: -inf / inf = NaN; NaN stays NaN). */
#ifndef ST_SILU_H
#define ST_SILU_H

#include <stdint.h>
#include <string.h>

static inline float st_exp(float x) {
    const float hi = 88.72283f, lo = -87.33654f;   /* e^hi, e^lo: the float range's ends */
    const float c = x > hi ? hi : x < lo ? lo : x;  /* NaN goes through as NaN */
    const float shift = 12582912.0f;               /* 1.5 * 2^23: adding it rounds to an integer */
    const float n = (c * 1.44269504f + shift) - shift;
    const float r = (c - n * 0.693145752f) - n * 1.42860677e-06f;   /* ln 2 = hi + lo part */
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    /* 2^n as two factors, so n = 128 (x near hi) and n = -126 still have normal exponents */
    const int32_t half = (int32_t)n >> 1;
    const int32_t b1 = (half + 127) << 23, b2 = ((int32_t)n - half + 127) << 23;
    float s1, s2;
    memcpy(&s1, &b1, sizeof s1);
    memcpy(&s2, &b2, sizeof s2);
    const float e = p * s1 * s2;
    return x > hi ? __builtin_inff() : x < lo ? 0.0f : e;
}

static inline float st_silu(float v) { return v / (1.0f + st_exp(-v)); }

/* g[i] = SiLU(g[i]) * u[i], i < n (g and u do not overlap) */
static inline void st_silu_times(float *restrict g, const float *restrict u, int64_t n) {
    for (int64_t i = 0; i < n; i++) g[i] = st_silu(g[i]) * u[i];
}

#endif
