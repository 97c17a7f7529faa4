/* The CPU pool's serve loop (cpu_pool.pxi's pool_serve; the exchange protocol is in strata/
 * backends/cuda/exchange.py): one OpenMP team for the pool's life. Per window (posted in the
 * control words by the engine thread, no GIL on either side): layer by layer, wait for the
 * device's ready[l] == seq, compute the routed pairs whose expert the where table gives the CPU,
 * write y and done[l] = seq; then the window's stats and served = seq.
 * Barriers per layer: the end of the down items and one `single` (finish layer l, then wait for
 * and set up layer l + 1), one more past SERIAL_SUM_ROWS rows (the team's weighted sum); gate/up
 * and down share no barrier in decode windows (moe.c).
 * Legend: L = layers, R = rows of the window, K = experts per row, H = hidden, E = experts,
 * F = expert width. */
#include <stdlib.h>
#include <string.h>
#include "moe_call.h"
#include "pool_sync.h"
#include "pool_window.h"

#define WHERE_CPU 2               /* the where table's code for "the CPU pool computes it" */
#define SPIN_NS 2000000LL         /* 2 ms of pause instructions, then short sleeps */
#define SLEEP_NS 20000LL
#define IDLE_NS 50000000LL        /* after 50 ms without a window, longer sleeps */
#define IDLE_SLEEP_NS 200000LL
#define ASLEEP_NS 1000000000LL    /* after 1 s, 1 ms ones: an idle server wakes 1000 times a s */
#define ASLEEP_SLEEP_NS 1000000LL
#define CHECK_EVERY 64            /* spins between looks at the clock and the stop word */
#define SERIAL_SUM_ROWS 4         /* up to this many rows, the weighted sum runs in the single */

/* Spins (pause) for the first SPIN_NS: the GPU's dense part between two layers and the engine's
 * host work between two windows take less, and a sleep would add its wake-up latency; then
 * sleeps in short steps (longer ones once idle: a window after a long pause starts up to 1 ms
 * late, and an idle server's pool costs next to nothing). 0 when *word reaches `want` (>= want
 * when at_least), POOL_TIMEOUT past the deadline (<= 0: none), POOL_ABORTED when asked to stop. */
static int wait_word(const int64_t *word, int64_t want, int at_least, int64_t deadline_ns,
                     const int64_t *stop) {
    int64_t spins = 0, start = st_now_ns();
    int64_t sleep_ns = 0;
    for (;;) {
        int64_t v = st_load_acquire_i64(word);
        if (at_least ? v >= want : v == want) return POOL_OK;
        if (sleep_ns || ++spins % CHECK_EVERY == 0) {   /* asleep: look after every nap */
            if (st_load_acquire_i64(stop) != 0) return POOL_ABORTED;
            int64_t now = st_now_ns();
            if (deadline_ns > 0 && now > deadline_ns) return POOL_TIMEOUT;
            int64_t waited = now - start;
            sleep_ns = waited < SPIN_NS ? 0 : waited < IDLE_NS ? SLEEP_NS
                     : waited < ASLEEP_NS ? IDLE_SLEEP_NS : ASLEEP_SLEEP_NS;
        }
        if (sleep_ns) st_sleep_ns(sleep_ns);
        else st_cpu_relax();
    }
}

typedef struct {
    /* fixed for the pool's life */
    int64_t *ctl;
    const int64_t *ready; int64_t *done;
    const float *x; const int32_t *ids; const float *wts; float *y;
    const int32_t *split;           /* [2]: the layer's split expert and the pool's columns */
    const uint8_t *where; const uint64_t *pointers; const int32_t *types;
    const int64_t *row_bytes;
    int L, H, K, E, F;
    int64_t timeout_ns;
    int32_t *masked;                /* [R_max, K] this layer's ids, -1 where not the CPU's */
    uint8_t *seen;                  /* [E] */
    int64_t y_dirty;                /* rows [0, y_dirty) of y may hold non-zero values */
    /* the window */
    int64_t seq, rows, entries, experts, wait_ns, compute_ns, t_layer, t_start;
    int status, failed_layer;
    /* by layer parity: layer l's call is set up in the single before it and read by every
     * thread after that single's barrier; the next write to the same entry comes two singles
     * later, after every thread has passed the one between */
    moe_call calls[2];
    int active[2], go[2];
} pool_state;

/* (single) Wait for ready[l], mask its ids to the CPU's experts, set up its call, and zero
 * the rows of y [rows, H] that the team's weighted sum will not set and that may be non-zero
 * (the device adds every row, so a layer without CPU pairs must leave zeros): this one thread
 * no longer clears all of y for every layer (4 MB per layer in a 512-row prompt window, where
 * the pool has no experts but still walks the layers). */
static void layer_begin(pool_state *s, int l) {
    const int p = l & 1;
    int64_t t0 = st_now_ns();
    s->status = wait_word(&s->ready[l], s->seq, 0, t0 + s->timeout_ns, &s->ctl[POOL_CTL_STOP]);
    s->t_layer = st_now_ns();
    s->wait_ns += s->t_layer - t0;
    s->active[p] = 0;
    if (s->status != POOL_OK) {
        s->failed_layer = l;
        s->go[p] = 0;
        return;
    }
    const int E = s->E, K = s->K;
    const uint8_t *wl = s->where + (int64_t)l * E;
    int64_t n_cpu = 0;
    memset(s->seen, 0, (size_t)E);
    for (int64_t i = 0; i < s->rows * K; i++) {
        int32_t e = s->ids[i];
        if (e >= 0 && e < E && wl[e] == WHERE_CPU) {
            s->masked[i] = e;
            n_cpu++;
            if (!s->seen[e]) { s->seen[e] = 1; s->experts++; }
        } else {
            s->masked[i] = -1;
        }
    }
    s->entries += n_cpu;
    if (n_cpu > 0) {
        const uint64_t *pl = s->pointers + (int64_t)l * 3 * E;    /* [3, E] */
        const int32_t *tl = s->types + 3 * l;
        const int64_t *bl = s->row_bytes + 3 * l;
        moe_call *c = &s->calls[p];
        /* the layer's split expert: its first `cols` columns are the pool's (published with
         * the ids, read after ready[l]); only whole blocks of the down's type */
        int split_e = s->split[0], split_cols = s->split[1];
        const int block = st_block_size(tl[2]);
        if (split_e < 0 || split_e >= E || block <= 0 || split_cols % block != 0)
            split_e = -1;
        if (st_moe_setup(c, s->x, s->rows, s->H, s->F, E, K,
                         (const uint8_t *const *)pl, tl[0], bl[0],
                         (const uint8_t *const *)(pl + E), tl[1], bl[1],
                         (const uint8_t *const *)(pl + 2 * E), tl[2], bl[2],
                         s->masked, s->wts, s->y, NULL, split_e, split_cols,
                         /* a prompt window's experts of many rows may take the AMX rows
                          * (the CPU backend's own layers stay batch-invariant) */
                         1) != 0) {
            s->status = POOL_NO_MEMORY;
            s->failed_layer = l;
            s->go[p] = 0;
            return;
        }
        s->active[p] = c->P > 0;
        if (!s->active[p]) st_moe_teardown(c);
    }
    const int64_t n = s->rows;
    if (!(s->active[p] && n > SERIAL_SUM_ROWS)) {   /* else the team's sum sets every row */
        const int64_t zero = n < s->y_dirty ? n : s->y_dirty;
        if (zero > 0) memset(s->y, 0, (size_t)(zero * s->H) * sizeof(float));
        if (!s->active[p] && s->y_dirty <= n) s->y_dirty = 0;
    }
    if (s->active[p] && s->y_dirty < n) s->y_dirty = n;
    s->go[p] = 1;
}

/* (single) The weighted sum of a few rows, done[l] = seq, then free the call (the device goes
 * on with the layer while this thread frees). */
static void layer_end(pool_state *s, int l) {
    const int p = l & 1;
    moe_call *c = &s->calls[p];
    if (s->active[p]) {
        if (c->T <= SERIAL_SUM_ROWS) st_moe_sum(c, 0, c->T, 0);   /* y zeroed in layer_begin */
        if (c->failed) {
            s->status = POOL_NO_MEMORY;
            s->failed_layer = l;
        }
    }
    s->compute_ns += st_now_ns() - s->t_layer;
    if (s->status == POOL_OK) st_store_release_i64(&s->done[l], s->seq);
    if (s->active[p]) st_moe_teardown(c);
}

/* (single) The window's stats, then served = seq (release: the stats are read after it). */
static void window_end(pool_state *s) {
    int64_t *ctl = s->ctl;
    if (s->status != POOL_OK) st_store_release_i64(&s->done[s->failed_layer], -s->seq);
    ctl[POOL_CTL_STATUS] = s->status;
    ctl[POOL_CTL_LAYER] = s->failed_layer;
    ctl[POOL_CTL_ENTRIES] = s->entries;
    ctl[POOL_CTL_EXPERTS] = s->experts;
    ctl[POOL_CTL_WAIT_NS] = s->wait_ns;
    ctl[POOL_CTL_COMPUTE_NS] = s->compute_ns;
    ctl[POOL_CTL_START_NS] = s->t_start;
    ctl[POOL_CTL_END_NS] = st_now_ns();
    st_store_release_i64(&ctl[POOL_CTL_SERVED], s->seq);
}

/* (single) Wait for a window newer than the last served one; 1 when asked to stop. */
static int window_begin(pool_state *s) {
    int64_t *ctl = s->ctl;
    int64_t next = st_load_acquire_i64(&ctl[POOL_CTL_SERVED]) + 1;
    if (wait_word(&ctl[POOL_CTL_SEQ], next, 1, 0, &ctl[POOL_CTL_STOP]) != POOL_OK) return 1;
    s->t_start = st_now_ns();
    s->seq = st_load_acquire_i64(&ctl[POOL_CTL_SEQ]);
    s->rows = ctl[POOL_CTL_ROWS];
    s->entries = s->experts = s->wait_ns = s->compute_ns = 0;
    s->status = POOL_OK;
    s->failed_layer = -1;
    s->go[0] = s->go[1] = 0;
    layer_begin(s, 0);
    return 0;
}

/* Serve windows until ctl[POOL_CTL_STOP] != 0 (a window waiting for the device then ends with
 * POOL_ABORTED and done[layer] = -seq). x, y [R_max, H]; ids, wts [R_max, K]; split [2] (the
 * layer's expert split with the device and the pool's columns of it, 0: none); where [L, E] (read
 * during each window: change it only between windows); pointers [L, 3, E]; types [L, 3];
 * row_bytes [L, 3]. -1 when its buffers cannot be allocated, else 0 once stopped; either way
 * ctl[POOL_CTL_EXITED] = 1 last. */
int st_pool_serve(int64_t *ctl, const int64_t *ready, int64_t *done, const float *x,
                  const int32_t *ids, const float *wts, float *y, const int32_t *split,
                  int64_t max_rows, const uint8_t *where, const uint64_t *pointers,
                  const int32_t *types, const int64_t *row_bytes, int L, int H, int K, int E,
                  int F, int64_t timeout_ns) {
    pool_state s;
    memset(&s, 0, sizeof(s));
    s.ctl = ctl; s.ready = ready; s.done = done; s.x = x; s.ids = ids; s.wts = wts; s.y = y;
    s.split = split;
    s.where = where; s.pointers = pointers; s.types = types; s.row_bytes = row_bytes;
    s.L = L; s.H = H; s.K = K; s.E = E; s.F = F; s.timeout_ns = timeout_ns;
    s.y_dirty = max_rows;   /* the exchange's y starts as whatever the allocation held */
    s.masked = malloc((size_t)(max_rows * K + 1) * sizeof(int32_t));
    s.seen = malloc((size_t)E + 1);
    if (!s.masked || !s.seen) {
        free(s.masked);
        free(s.seen);
        st_store_release_i64(&ctl[POOL_CTL_EXITED], 1);
        return -1;
    }
    int quit = 0;
    #pragma omp parallel num_threads(st_get_num_threads())
    {
        for (;;) {
            #pragma omp single
            quit = window_begin(&s);
            if (quit) break;   /* read after the single's barrier; written again only after
                                  this window's last single */
            for (int l = 0; l < L; l++) {
                const int p = l & 1;
                if (!s.go[p]) break;
                if (s.active[p]) {
                    st_moe_products(&s.calls[p]);   /* ends past a barrier */
                    if (s.calls[p].T > SERIAL_SUM_ROWS) {
                        const moe_call *c = &s.calls[p];
                        #pragma omp for schedule(static)
                        for (int64_t t = 0; t < c->T; t++) st_moe_sum(c, t, t + 1, 1);
                    }
                }
                #pragma omp single
                {
                    layer_end(&s, l);
                    if (s.status == POOL_OK && l + 1 < L) layer_begin(&s, l + 1);
                    else s.go[(l + 1) & 1] = 0;
                }
            }
            #pragma omp single
            window_end(&s);
        }
    }
    free(s.masked);
    free(s.seen);
    st_store_release_i64(&ctl[POOL_CTL_EXITED], 1);
    return 0;
}

void st_pool_post(int64_t *ctl, int64_t seq, int64_t num_rows) {
    ctl[POOL_CTL_ROWS] = num_rows;
    ctl[POOL_CTL_POSTED_NS] = st_now_ns();
    st_store_release_i64(&ctl[POOL_CTL_SEQ], seq);
}

int st_pool_wait_served(const int64_t *ctl, int64_t seq, int64_t timeout_ns) {
    return wait_word(&ctl[POOL_CTL_SERVED], seq, 1, st_now_ns() + timeout_ns,
                     &ctl[POOL_CTL_EXITED]);
}
