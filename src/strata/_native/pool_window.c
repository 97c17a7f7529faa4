/* The CPU pool's window (cpu_pool.pxi's pool_run_window; the protocol is in strata/backends/cuda/
 * exchange.py): layer by layer, wait for the device's ready[l] == seq, compute the routed pairs
 * whose expert the where table gives the CPU, write y and done[l] = seq. One OpenMP team serves
 * the whole window: between layers its threads wait at a barrier while one thread watches
 * ready[l], instead of a team forked and joined per layer.
 * Legend: L = layers, R = rows of the window, K = experts per row, H = hidden, E = experts,
 * F = expert width. */
#include <stdlib.h>
#include <string.h>
#include "moe_call.h"
#include "pool_sync.h"

enum { POOL_OK = 0, POOL_TIMEOUT = 1, POOL_ABORTED = 2, POOL_NO_MEMORY = 3 };
#define WHERE_CPU 2               /* the where table's code for "the CPU pool computes it" */
#define SPIN_NS 2000000LL         /* 2 ms of pause instructions, then short sleeps */
#define SLEEP_NS 20000LL
#define CHECK_EVERY 64            /* spins between looks at the clock and the abort flag */

/* 0 when ready == seq, POOL_TIMEOUT past the deadline, POOL_ABORTED when asked to stop. Spins
 * (pause) for the first SPIN_NS: the GPU's dense part between two layers takes less, and a sleep
 * would add its wake-up latency to every layer; then sleeps in short steps. */
static int wait_ready(const int64_t *ready, int64_t seq, int64_t deadline_ns,
                      const int64_t *abort_flag) {
    int64_t spins = 0, spin_until_ns = st_now_ns() + SPIN_NS;
    int is_spinning = 1;
    while (st_load_acquire_i64(ready) != seq) {
        spins++;
        if (spins % CHECK_EVERY == 0) {
            if (st_load_acquire_i64(abort_flag) != 0) return POOL_ABORTED;
            int64_t now = st_now_ns();
            if (now > deadline_ns) return POOL_TIMEOUT;
            is_spinning = now < spin_until_ns;
        }
        if (is_spinning) st_cpu_relax();
        else st_sleep_ns(SLEEP_NS);
    }
    return POOL_OK;
}

/* x, y [R_max, H]; ids, wts [R_max, K]; where [L, E]; pointers [L, 3, E]; types [L, 3];
 * row_bytes [L, 3]. Returns -1 when its routing buffers cannot be allocated, else 0 with
 * stats = (status, layer, entries, experts, wait_ns, compute_ns): status POOL_OK or the code
 * that stopped it at `layer` (then done[layer] = -seq, so the device stops waiting). */
int st_pool_run_window(const int64_t *ready, int64_t *done, const float *x, const int32_t *ids,
                       const float *wts, float *y, int64_t seq, int64_t num_rows,
                       const uint8_t *where, const uint64_t *pointers, const int32_t *types,
                       const int64_t *row_bytes, int L, int H, int K, int E, int F,
                       int64_t timeout_ns, const int64_t *abort_flag, int64_t *stats) {
    int32_t *masked = malloc((size_t)(num_rows * K + 1) * sizeof(int32_t));    /* [R, K] */
    uint8_t *seen = malloc((size_t)E + 1);
    if (!masked || !seen) {
        free(masked);
        free(seen);
        return -1;
    }
    int status = POOL_OK, failed_layer = -1, active = 0;
    int64_t entries = 0, experts = 0, wait_ns = 0, compute_ns = 0, t1 = 0;
    moe_call call;
    memset(&call, 0, sizeof(call));
    #pragma omp parallel num_threads(st_get_num_threads())
    {
        for (int l = 0; l < L; l++) {
            #pragma omp single
            {
                int64_t t0 = st_now_ns();
                status = wait_ready(&ready[l], seq, t0 + timeout_ns, abort_flag);
                t1 = st_now_ns();
                wait_ns += t1 - t0;
                active = 0;
                if (status != POOL_OK) {
                    failed_layer = l;
                } else {
                    /* ---- the pairs this layer's where table gives the CPU: masked [R, K] ---- */
                    const uint8_t *wl = where + (int64_t)l * E;
                    int64_t n_cpu = 0;
                    memset(seen, 0, (size_t)E);
                    for (int64_t i = 0; i < num_rows * K; i++) {
                        int32_t e = ids[i];
                        if (e >= 0 && e < E && wl[e] == WHERE_CPU) {
                            masked[i] = e;
                            n_cpu++;
                            if (!seen[e]) { seen[e] = 1; experts++; }
                        } else {
                            masked[i] = -1;
                        }
                    }
                    entries += n_cpu;
                    if (num_rows > 0) memset(y, 0, (size_t)(num_rows * H) * sizeof(float));
                    if (n_cpu > 0) {
                        const uint64_t *pl = pointers + (int64_t)l * 3 * E;    /* [3, E] */
                        const int32_t *tl = types + 3 * l;
                        const int64_t *bl = row_bytes + 3 * l;
                        if (st_moe_setup(&call, x, num_rows, H, F, E, K,
                                         (const uint8_t *const *)pl, tl[0], bl[0],
                                         (const uint8_t *const *)(pl + E), tl[1], bl[1],
                                         (const uint8_t *const *)(pl + 2 * E), tl[2], bl[2],
                                         masked, wts, y, NULL) != 0) {
                            status = POOL_NO_MEMORY;
                            failed_layer = l;
                        } else {
                            active = call.P > 0;
                        }
                    }
                }
            }   /* the team waits here: status, active and call are set for all */
            if (status != POOL_OK) break;
            if (active) st_moe_compute(&call);
            #pragma omp single
            {
                if (active) {
                    if (call.failed) {
                        status = POOL_NO_MEMORY;
                        failed_layer = l;
                    }
                    st_moe_teardown(&call);
                }
                compute_ns += st_now_ns() - t1;
                if (status == POOL_OK) st_store_release_i64(&done[l], seq);
            }
            if (status != POOL_OK) break;
        }
    }
    if (status != POOL_OK) st_store_release_i64(&done[failed_layer], -seq);
    free(masked);
    free(seen);
    stats[0] = status; stats[1] = failed_layer; stats[2] = entries; stats[3] = experts;
    stats[4] = wait_ns; stats[5] = compute_ns;
    return 0;
}
