/* What every SIMD fused decode row reads its scales with (fused.c, and fused_k.c / fused_iq.c
 * through kdot_avx2.h / fused_k_avx2.h): an fp16 at any address, by F16C, and the attribute
 * of their always-inlined helpers. Include only under __F16C__. */
#pragma once
#include <stdint.h>
#include <string.h>
#include <immintrin.h>

#define ALWAYS_INLINE static inline __attribute__((always_inline))

static inline float fp16_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}
