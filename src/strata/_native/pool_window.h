/* The CPU pool's window loop (pool_window.c), called by cpu_pool.pxi's pool_run_window. */
#pragma once
#include <stdint.h>

int st_pool_run_window(const int64_t *ready, int64_t *done, const float *x, const int32_t *ids,
                       const float *wts, float *y, int64_t seq, int64_t num_rows,
                       const uint8_t *where, const uint64_t *pointers, const int32_t *types,
                       const int64_t *row_bytes, int L, int H, int K, int E, int F,
                       int64_t timeout_ns, const int64_t *abort_flag, int64_t *stats);
