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
