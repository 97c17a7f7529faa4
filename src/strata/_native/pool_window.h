/* The CPU pool's serve loop (pool_window.c), driven by cpu_pool.pxi through its control words. */
#pragma once
#include <stdint.h>

enum { POOL_OK = 0, POOL_TIMEOUT = 1, POOL_ABORTED = 2, POOL_NO_MEMORY = 3 };

/* ctl [POOL_CTL_WORDS] int64. The engine writes ROWS and POSTED_NS, then SEQ (release); STOP
 * (nonzero) ends the loop. The pool writes the window's stats, then SERVED = its seq (release);
 * START_NS / END_NS: when it saw the window and when it finished it (CLOCK_MONOTONIC). EXITED:
 * set by the serve loop's caller once st_pool_serve has returned. */
enum {
    POOL_CTL_SEQ, POOL_CTL_ROWS, POOL_CTL_POSTED_NS, POOL_CTL_STOP, POOL_CTL_SERVED,
    POOL_CTL_STATUS, POOL_CTL_LAYER, POOL_CTL_ENTRIES, POOL_CTL_EXPERTS, POOL_CTL_WAIT_NS,
    POOL_CTL_COMPUTE_NS, POOL_CTL_START_NS, POOL_CTL_END_NS, POOL_CTL_EXITED, POOL_CTL_WORDS
};

int st_pool_serve(int64_t *ctl, const int64_t *ready, int64_t *done, const float *x,
                  const int32_t *ids, const float *wts, float *y, const int32_t *split,
                  int64_t max_rows, const uint8_t *where, const uint64_t *pointers,
                  const int32_t *types, const int64_t *row_bytes, int L, int H, int K, int E,
                  int F, int64_t timeout_ns);

/* The engine's side: post window seq of num_rows rows (no lock, no GIL); wait until the pool has
 * served it: POOL_OK, POOL_TIMEOUT, or POOL_ABORTED when the serve loop has exited. */
void st_pool_post(int64_t *ctl, int64_t seq, int64_t num_rows);
int st_pool_wait_served(const int64_t *ctl, int64_t seq, int64_t timeout_ns);
