/* What the C benchmarks in tools/ share: a monotonic clock, and random weights of a quantised
 * type whose fp16 scales are finite (random bytes anywhere else make valid blocks). */
#pragma once
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "quant.h"

/* argument i as a number, or `fallback` when there are fewer */
static inline long long bench_arg(int argc, char **argv, int i, long long fallback) {
    return argc > i ? atoll(argv[i]) : fallback;
}

static inline double bench_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* w [rows, cols / block * block_bytes] of type qtype from rand(): each block's fp16 scales
 * (d, and dmin where the type has one) in [2^-7, 2^-6) */
static inline void bench_random_weights(uint8_t *w, int qtype, int64_t rows, int cols) {
    const int block = st_block_size(qtype), block_bytes = st_type_size(qtype);
    const int fp16_at[2] = {
        qtype == ST_Q6_K ? 208 : qtype == ST_Q2_K ? 80 : qtype == ST_Q3_K ? 108 : 0,
        qtype == ST_Q4_K || qtype == ST_Q5_K ? 2 : qtype == ST_Q2_K ? 82 : -1};
    const int64_t num_blocks = rows * (cols / block);
    for (int64_t i = 0; i < num_blocks * block_bytes; i++) w[i] = (uint8_t)rand();
    for (int64_t b = 0; b < num_blocks; b++)
        for (int f = 0; f < 2 && fp16_at[f] >= 0; f++) {
            const uint16_t h = (uint16_t)(0x2000 + (rand() & 0x3ff));
            memcpy(w + b * block_bytes + fp16_at[f], &h, 2);
        }
}

/* The grid i-quants' tables (kernels.pyx hands gguf's to C at import): random entries of the
 * right shape and range for a timing, and gguf's sign patterns (7 bits and their parity); a
 * no-op for the other types */
static inline void bench_iq_tables(int qtype) {
    int n = 0, width = 8, lo = 1, hi = 43;
    switch (qtype) {
    case ST_IQ2_XXS: n = 256; break;
    case ST_IQ2_XS: n = 512; break;
    case ST_IQ2_S: n = 1024; break;
    case ST_IQ3_XXS: n = 256; width = 4; hi = 62; break;
    case ST_IQ3_S: n = 512; width = 4; hi = 15; break;
    case ST_IQ1_S: case ST_IQ1_M: n = 2048; lo = -1; hi = 1; break;
    default: return;
    }
    int8_t *values = malloc((size_t)n * (size_t)width);
    uint8_t signs[128];
    for (int i = 0; i < n * width; i++) values[i] = (int8_t)(lo + rand() % (hi - lo + 1));
    for (int i = 0; i < 128; i++) signs[i] = (uint8_t)(i | (__builtin_parity((unsigned)i) << 7));
    st_set_iq_grid(qtype, values, n, width);
    st_set_iq_ksigns(signs);
    free(values);
}
