/* The routed-expert block of a MoE layer: rows grouped by expert, each distinct expert applied
 * once to all its rows (gate/up, SiLU-gate, down), outputs summed with the router weights. */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>
#include "moe_call.h"
#include "pool_sync.h"
#include "silu.h"

/* Legend: T = tokens, K = experts per token, E = experts, H = hidden, F = expert width,
 * P = routed (token, k) pairs with an expert id >= 0. */

#define ITEM_ROWS 64   /* weight rows per work item */
/* An AMX expert's: amx.c dequantises a block's weights among the last block's tile steps, so
 * the first block of an item is dequantised alone; 128 rows (4 blocks of 2 groups) against
 * 64 made the pool's kernel 3-8% faster at 8-128 rows an expert (2 threads, the CPU machine's
 * AMX, tools/bench_pool_kernel.py --rows-per-expert). */
#define AMX_ITEM_ROWS 128
/* Up to this many pairs (decode windows), the thread that finishes an expert's last gate/up item
 * quantizes its SiLU(gate) * up rows and the down items wait for that expert alone: no barrier
 * between the two products. Bigger calls quantize every row on the team behind a barrier. */
#define FILL_BY_LAST_PAIRS 64

/* Expert e's gate/up rows in this call, which are also its down's columns: all F, or the
 * split expert's first split_cols (the CPU pool's part of an expert it splits with the GPU). */
static inline int expert_cols(const moe_call *c, int e) {
    return e == c->split_expert ? c->split_cols : c->F;
}

/* The weight rows of expert e's items: of gate/up (of_gateup) or of the down */
static inline int item_rows(const moe_call *c, int e, int of_gateup) {
    return c->num_amx && (of_gateup ? c->xp_off[e] : c->hp_off[e]) >= 0 ? AMX_ITEM_ROWS
                                                                         : ITEM_ROWS;
}

/* Items over every expert with pairs: rows F of gate/up (of_gateup: the split expert's
 * split_cols), else H of the down, item_rows at a time. */
static int64_t build_items(const moe_call *c, int of_gateup, moe_item *items) {
    int64_t n = 0;
    for (int e = 0; e < c->E; e++) {
        if (c->count[e] == 0) continue;
        const int rows = of_gateup ? expert_cols(c, e) : c->H, step = item_rows(c, e, of_gateup);
        for (int r0 = 0; r0 < rows; r0 += step) {
            items[n].expert = e;
            items[n].r0 = r0;
            items[n].r1 = r0 + step < rows ? r0 + step : rows;
            n++;
        }
    }
    return n;
}

/* Bump placement of a call's buffers in its one block (64-byte aligned each). */
static size_t place(size_t *at, size_t num_bytes) {
    const size_t here = *at;
    *at += (num_bytes + 63) / 64 * 64;
    return here;
}

/* Below this many rows an expert's products stay on the lane tiles / fused rows, which read
 * its weights once for all rows as the AMX rows do but need no dequantised copy. The pool's
 * kernel on an H100 host's Xeon (session 76, tools/bench_pool_kernel.py --rows-per-expert,
 * 15 threads, Q4_0 experts from RAM), experts/s lane tiles / AMX rows: 4 rows 26.0k / 22.8k,
 * 6 21.0k / 20.7k, 8 15.9k / 20.0k, 12 10.7k / 17.0k, 16 8.8k / 15.6k */
#define AMX_MIN_ROWS 8

int st_moe_amx_rows(void) {
    static int rows = -1;
    int r = __atomic_load_n(&rows, __ATOMIC_RELAXED);
    if (r < 0) {
        const char *env = getenv("STRATA_AMX_ROWS");
        r = env && atoi(env) > 0 ? atoi(env) : AMX_MIN_ROWS;
        __atomic_store_n(&rows, r, __ATOMIC_RELAXED);
    }
    return r;
}

/* Which experts take the AMX rows, and where their packed activations go (one more kept
 * block); none when the CPU has no AMX or that block cannot be had (the lane tiles then). */
static void plan_amx(moe_call *c) {
    c->num_amx = 0;
    if (!c->allow_amx || !st_amx_available()) return;
    const int gu = c->shared_x && st_amx_takes(c->gate_type, c->H)
                   && st_amx_takes(c->up_type, c->H);
    const int dn = st_amx_takes(c->down_type, c->F);
    const int min_rows = st_moe_amx_rows();
    size_t at = 0;
    for (int e = 0; e < c->E; e++) {
        c->xp_off[e] = c->hp_off[e] = -1;
        if (c->count[e] < min_rows || e == c->split_expert || !(gu || dn)) continue;
        if (gu) c->xp_off[e] = (int64_t)place(&at, st_amx_pack_bytes(c->count[e], c->H));
        if (dn) c->hp_off[e] = (int64_t)place(&at, st_amx_pack_bytes(c->count[e], c->F));
        c->amx_list[c->num_amx++] = e;
    }
    if (c->num_amx == 0) return;
    c->amx_block = st_block_take(at, &c->amx_block_bytes);
    if (!c->amx_block) {
        for (int i = 0; i < c->num_amx; i++)
            c->xp_off[c->amx_list[i]] = c->hp_off[c->amx_list[i]] = -1;
        c->num_amx = 0;
        return;
    }
    c->amx_scratch_bytes = st_amx_scratch_bytes(c->H > c->F ? c->H : c->F);
}

static inline uint16_t *packed_at(const moe_call *c, int64_t off) {
    return (uint16_t *)((char *)c->amx_block + off);
}

void st_moe_teardown(moe_call *c) {
    if (c->amx_block) st_block_give(c->amx_block, c->amx_block_bytes);
    st_block_give(c->block, c->block_bytes);
    memset(c, 0, sizeof(*c));
}

int st_moe_setup(moe_call *c, const float *x, int64_t T, int H, int F, int E, int K,
                 const uint8_t *const *gate_ptrs, int gate_type, int64_t gate_row_bytes,
                 const uint8_t *const *up_ptrs, int up_type, int64_t up_row_bytes,
                 const uint8_t *const *down_ptrs, int down_type, int64_t down_row_bytes,
                 const int32_t *experts, const float *weights, float *out,
                 int64_t *routed_rows, int split_expert, int split_cols, int allow_amx) {
    memset(c, 0, sizeof(*c));
    c->allow_amx = allow_amx;
    c->x = x; c->T = T; c->H = H; c->F = F; c->E = E; c->K = K;
    c->split_expert = split_cols > 0 && split_cols < F ? split_expert : -1;
    c->split_cols = c->split_expert >= 0 ? split_cols : F;
    c->gate_ptrs = gate_ptrs; c->up_ptrs = up_ptrs; c->down_ptrs = down_ptrs;
    c->gate_type = gate_type; c->up_type = up_type; c->down_type = down_type;
    c->gate_row_bytes = gate_row_bytes; c->up_row_bytes = up_row_bytes;
    c->down_row_bytes = down_row_bytes;
    c->weights = weights; c->out = out;
    const int gate_quant = st_act_kind(gate_type);
    const int up_quant = st_act_kind(up_type);
    const int down_quant = st_act_kind(down_type);
    c->shared_x = gate_quant == up_quant;

    /* Every buffer in one kept block (st_block_take), sized for all T * K pairs: a decode
     * layer's call allocates nothing (the CPU pool sets one up per layer on its critical path,
     * between the device's ready and the team's start: ~4 us of mallocs and page faults a
     * call, measured, before this). Only the prefix a call uses is touched. */
    const int64_t pairs = T * K > 0 ? T * K : 1;
    const int max_rows = F > H ? F : H;
    const int64_t spread = pairs < E ? pairs : E;       /* distinct experts at most */
    const int64_t max_items = spread * ((max_rows + ITEM_ROWS - 1) / ITEM_ROWS) + 1;
    size_t at = 0;
    const size_t o_count = place(&at, ((size_t)E + 1) * sizeof(int64_t));
    const size_t o_offset = place(&at, ((size_t)E + 1) * sizeof(int64_t));
    const size_t o_fill = place(&at, ((size_t)E + 1) * sizeof(int64_t));
    const size_t o_left = place(&at, ((size_t)E + 1) * sizeof(int32_t));
    const size_t o_ready = place(&at, ((size_t)E + 1) * sizeof(int32_t));
    const size_t zeroed = at;                           /* the five above start at zero */
    const size_t o_pair_of = place(&at, (size_t)pairs * sizeof(int32_t));
    const size_t o_pair_tok = place(&at, (size_t)pairs * sizeof(int32_t));
    const size_t o_pair_ids = place(&at, (size_t)pairs * sizeof(int32_t));
    const size_t o_xp_off = place(&at, ((size_t)E + 1) * sizeof(int64_t));
    const size_t o_hp_off = place(&at, ((size_t)E + 1) * sizeof(int64_t));
    const size_t o_amx_list = place(&at, ((size_t)E + 1) * sizeof(int32_t));
    const size_t o_items = place(&at, (size_t)max_items * sizeof(moe_item));
    const size_t o_items_2 = place(&at, (size_t)max_items * sizeof(moe_item));
    const size_t o_g = place(&at, (size_t)pairs * F * sizeof(float));
    const size_t o_u = place(&at, (size_t)pairs * F * sizeof(float));
    const size_t o_y = place(&at, (size_t)pairs * H * sizeof(float));
    const size_t o_act_gate = place(&at, st_act_bytes(T, H, gate_quant));
    const size_t o_act_up = place(&at, c->shared_x ? 0 : st_act_bytes(T, H, up_quant));
    const size_t o_act_h = place(&at, st_act_bytes(pairs, F, down_quant));
    c->block = st_block_take(at, &c->block_bytes);
    if (!c->block) return -1;
    char *base = c->block;
    memset(base, 0, zeroed);
    c->count = (int64_t *)(base + o_count);
    c->offset = (int64_t *)(base + o_offset);
    int64_t *fill = (int64_t *)(base + o_fill);
    c->left = (int32_t *)(base + o_left);
    c->h_ready = (int32_t *)(base + o_ready);
    c->pair_of = (int32_t *)(base + o_pair_of);
    c->pair_tok = (int32_t *)(base + o_pair_tok);
    c->pair_ids = (int32_t *)(base + o_pair_ids);
    c->xp_off = (int64_t *)(base + o_xp_off);
    c->hp_off = (int64_t *)(base + o_hp_off);
    c->amx_list = (int32_t *)(base + o_amx_list);
    c->items = (moe_item *)(base + o_items);
    c->items_2 = (moe_item *)(base + o_items_2);
    c->G = (float *)(base + o_g);
    c->U = (float *)(base + o_u);
    c->Y = (float *)(base + o_y);
    st_act_place(&c->act_gate, T, H, gate_quant, base + o_act_gate);
    if (!c->shared_x) st_act_place(&c->act_up, T, H, up_quant, base + o_act_up);

    /* ---- group the (token, k) pairs by expert (counting sort keeps token order) ---- */
    for (int64_t i = 0; i < T * K; i++)
        if (experts[i] >= 0) c->count[experts[i]]++;
    for (int e = 0; e < E; e++) c->offset[e + 1] = c->offset[e] + c->count[e];
    const int64_t P = c->P = c->offset[E];
    if (routed_rows)
        for (int e = 0; e < E; e++) routed_rows[e] += c->count[e];
    for (int64_t i = 0; i < T * K; i++) {
        int32_t e = experts[i];
        if (e < 0) { c->pair_of[i] = -1; continue; }
        int64_t p = c->offset[e] + fill[e]++;
        c->pair_of[i] = (int32_t)p;
        c->pair_tok[p] = (int32_t)(i / K);
    }
    for (int64_t p = 0; p < P; p++) c->pair_ids[p] = (int32_t)p;
    if (P == 0) return 0;
    st_act_place(&c->act_h, P, F, down_quant, base + o_act_h);

    size_t scratch_bytes = st_scratch_bytes(gate_type, H);
    size_t sb = st_scratch_bytes(up_type, H);
    if (sb > scratch_bytes) scratch_bytes = sb;
    sb = st_scratch_bytes(down_type, F);
    c->scratch_bytes = sb > scratch_bytes ? sb : scratch_bytes;
    plan_amx(c);   /* before the items: an AMX expert's are bigger */
    c->num_items_1 = build_items(c, 1, c->items);
    c->num_items_2 = build_items(c, 0, c->items_2);
    for (int e = 0; e < E; e++) {
        const int step = item_rows(c, e, 1);
        c->left[e] = c->count[e] > 0 ? (expert_cols(c, e) + step - 1) / step : 0;
    }
    if (c->split_expert >= 0 && c->split_expert < E) {
        /* the split expert's G columns past its part stay zero: its down rows read only the
         * part's columns, but the activation rows are quantized (and some paths dot) whole */
        const int e = c->split_expert, cols = c->split_cols;
        for (int64_t p = c->offset[e]; p < c->offset[e] + c->count[e]; p++)
            memset(c->G + p * F + cols, 0, (size_t)(F - cols) * sizeof(float));
    }
    c->fill_by_last = P <= FILL_BY_LAST_PAIRS;
    /* a few rows are quicker filled here than behind one more barrier of the team */
    c->is_small = T * (int64_t)H <= 16384;
    if (c->is_small) {
        st_act_fill(&c->act_gate, x, H, 0, T);
        if (!c->shared_x) st_act_fill(&c->act_up, x, H, 0, T);
    }
    c->is_parallel = (double)P * 3.0 * F * H >= ST_MIN_PARALLEL_MACS;
    return 0;
}

static inline int has_pair(const moe_call *c, int64_t t) {
    for (int k = 0; k < c->K; k++)
        if (c->pair_of[t * c->K + k] >= 0) return 1;
    return 0;
}

/* SiLU(gate) * up of an expert's pairs, quantized for the down product, and the flag its down
 * items wait on (fill_by_last). */
/* G[p, f] = SiLU(G[p, f]) * U[p, f] for pairs [p0, p0 + n), columns [r0, r1) */
static void silu_mul(moe_call *c, int64_t p0, int64_t n, int r0, int r1) {
    for (int64_t p = p0; p < p0 + n; p++)
        st_silu_times(c->G + p * c->F + r0, c->U + p * c->F + r0, r1 - r0);   /* [r1 - r0] */
}

static void fill_expert_rows(moe_call *c, int e) {
    const int64_t p0 = c->offset[e], n = c->count[e];
    if (c->num_amx && c->hp_off[e] >= 0)
        st_amx_pack(c->G + p0 * c->F, c->F, NULL, n, c->F, packed_at(c, c->hp_off[e]));
    else
        for (int64_t p = p0; p < p0 + n; p++) st_act_fill(&c->act_h, c->G, c->F, p, p + 1);
}

void st_moe_products(moe_call *c) {
    const int64_t T = c->T, P = c->P;
    const int H = c->H, F = c->F;
    const int64_t *offset = c->offset, *count = c->count;
    void *scratch = st_alloc64(c->scratch_bytes);
    if (!scratch) {
        #pragma omp atomic write
        c->failed = 1;
    }
    const st_act *ax_up = c->shared_x ? &c->act_gate : &c->act_up;
    void *amx_scratch = c->num_amx ? st_alloc64(c->amx_scratch_bytes) : NULL;
    if (c->num_amx && !amx_scratch) {
        #pragma omp atomic write
        c->failed = 1;
    }
    if (!c->is_small) {
        /* only rows routed to one of the call's experts (the pool's call masks the others) */
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            if (!has_pair(c, t)) continue;
            st_act_fill(&c->act_gate, c->x, H, t, t + 1);
            if (!c->shared_x) st_act_fill(&c->act_up, c->x, H, t, t + 1);
        }
    }
    if (c->num_amx) {
        /* the AMX experts' gate/up activations, packed once per expert from x */
        #pragma omp for schedule(dynamic, 1)
        for (int i = 0; i < c->num_amx; i++) {
            const int e = c->amx_list[i];
            if (c->xp_off[e] >= 0)
                st_amx_pack(c->x, H, c->pair_tok + offset[e], count[e], H,
                            packed_at(c, c->xp_off[e]));
        }
    }
    /* ---- gate and up: G[p, f], U[p, f] for every expert's pairs ---- */
    const int nth = omp_get_num_threads();
    const int grab_1 = st_grab(c->num_items_1, nth), grab_2 = st_grab(c->num_items_2, nth);
    #pragma omp for schedule(dynamic, grab_1) nowait
    for (int64_t it = 0; it < c->num_items_1; it++) {
        int e = c->items[it].expert;
        int r0 = c->items[it].r0, r1 = c->items[it].r1;
        int64_t p0 = offset[e], n = count[e];
        if (c->num_amx && c->xp_off[e] >= 0) {
            if (amx_scratch) {
                const uint16_t *xp = packed_at(c, c->xp_off[e]);
                st_amx_rows(c->gate_type, c->gate_ptrs[e], c->gate_row_bytes, H, r0, r1, xp, n,
                            c->G + p0 * F + r0, F, amx_scratch);
                st_amx_rows(c->up_type, c->up_ptrs[e], c->up_row_bytes, H, r0, r1, xp, n,
                            c->U + p0 * F + r0, F, amx_scratch);
                silu_mul(c, p0, n, r0, r1);
            }
        } else if (scratch) {
            st_gemm_rows(c->gate_type, c->gate_ptrs[e], c->gate_row_bytes, H, r0, r1,
                         &c->act_gate, c->pair_tok + p0, n, c->G + p0 * F + r0, F, scratch);
            st_gemm_rows(c->up_type, c->up_ptrs[e], c->up_row_bytes, H, r0, r1, ax_up,
                         c->pair_tok + p0, n, c->U + p0 * F + r0, F, scratch);
            silu_mul(c, p0, n, r0, r1);
        }
        /* the last of the expert's items (every thread's G writes before it: acq_rel) */
        if (c->fill_by_last && __atomic_sub_fetch(&c->left[e], 1, __ATOMIC_ACQ_REL) == 0) {
            fill_expert_rows(c, e);
            __atomic_store_n(&c->h_ready[e], 1, __ATOMIC_RELEASE);
        }
    }
    if (!c->fill_by_last) {
        /* ---- the activation rows of the down projection: SiLU(gate) * up ---- */
        #pragma omp barrier
        if (c->num_amx) {   /* by expert: the AMX experts' rows are packed instead */
            #pragma omp for schedule(dynamic, 1)
            for (int e = 0; e < c->E; e++)
                if (count[e] > 0) fill_expert_rows(c, e);
        } else {
            #pragma omp for schedule(static)
            for (int64_t p = 0; p < P; p++) st_act_fill(&c->act_h, c->G, F, p, p + 1);
        }
    }
    /* ---- down: Y[p, h] ---- */
    #pragma omp for schedule(dynamic, grab_2)
    for (int64_t it = 0; it < c->num_items_2; it++) {
        int e = c->items_2[it].expert;
        int r0 = c->items_2[it].r0, r1 = c->items_2[it].r1;
        int64_t p0 = offset[e], n = count[e];
        if (c->fill_by_last)     /* every gate/up item is taken before any down item */
            while (!__atomic_load_n(&c->h_ready[e], __ATOMIC_ACQUIRE)) st_cpu_relax();
        if (c->num_amx && c->hp_off[e] >= 0) {
            if (amx_scratch)
                st_amx_rows(c->down_type, c->down_ptrs[e], c->down_row_bytes, F, r0, r1,
                            packed_at(c, c->hp_off[e]), n, c->Y + p0 * H + r0, H, amx_scratch);
            continue;
        }
        if (!scratch) continue;
        st_gemm_rows(c->down_type, c->down_ptrs[e], c->down_row_bytes, expert_cols(c, e),
                     r0, r1, &c->act_h, c->pair_ids + p0, n, c->Y + p0 * H + r0, H, scratch);
    }
    free(scratch);
    free(amx_scratch);
}

/* out[t] += sum_k weights[t, k] * Y[pair(t, k)], in k order (deterministic), rows [t0, t1);
 * with `set`, out[t] = that sum (0 for a row without pairs). */
void st_moe_sum(const moe_call *c, int64_t t0, int64_t t1, int set) {
    const int H = c->H, K = c->K;
    for (int64_t t = t0; t < t1; t++) {
        float *o = c->out + t * H;                             /* [H] */
        if (set) memset(o, 0, (size_t)H * sizeof(float));
        for (int k = 0; k < K; k++) {
            int32_t p = c->pair_of[t * K + k];
            if (p < 0) continue;
            float wk = c->weights[t * K + k];
            const float *y = c->Y + (int64_t)p * H;
            for (int h = 0; h < H; h++) o[h] += wk * y[h];
        }
    }
}

void st_moe_compute(moe_call *c) {
    st_moe_products(c);
    #pragma omp for schedule(static)
    for (int64_t t = 0; t < c->T; t++) st_moe_sum(c, t, t + 1, 0);
}

/* Each expert's three matrices come through pointer tables [E] (gate and up [F, H] rows, down
 * [H, F] rows): an expert may sit in the GGUF mapping, an expert pack or a cache slot. When
 * routed_rows is not NULL, routed_rows[e] += the rows routed to expert e. allow_amx: experts
 * of many rows may take the AMX rows (not batch-invariant: moe_call.h). */
int st_moe_ffn_ptrs(const float *x, int64_t T, int H, int F, int E, int K,
                    const uint8_t *const *gate_ptrs, int gate_type, int64_t gate_row_bytes,
                    const uint8_t *const *up_ptrs, int up_type, int64_t up_row_bytes,
                    const uint8_t *const *down_ptrs, int down_type, int64_t down_row_bytes,
                    const int32_t *experts, const float *weights, float *out,
                    int64_t *routed_rows, int allow_amx) {
    moe_call c;
    if (st_moe_setup(&c, x, T, H, F, E, K, gate_ptrs, gate_type, gate_row_bytes, up_ptrs, up_type,
                  up_row_bytes, down_ptrs, down_type, down_row_bytes, experts, weights, out,
                  routed_rows, -1, 0, allow_amx) != 0)
        return -1;
    if (c.P > 0) {
        #pragma omp parallel num_threads(st_get_num_threads()) if (c.is_parallel)
        st_moe_compute(&c);
    }
    int rc = c.failed ? -1 : 0;
    st_moe_teardown(&c);
    return rc;
}

/* Every page of [p, p + bytes) written once (its first touch faults it in). */
static void touch_pages(void *p, size_t bytes) {
    for (size_t i = 0; i < bytes; i += 4096) ((volatile char *)p)[i] = 0;
}

/* The call st_moe_setup would make for T rows whose K pairs each go to E experts in turn (every
 * expert T * K / E rows: with AMX, every expert of at least st_moe_amx_rows() rows packed),
 * its blocks touched whole, then handed back: the largest such call's blocks, kept for the
 * real ones. Nothing is computed, so the experts' weights are never read. Measured on the dev
 * machine (2 threads, 512 rows at Qwen3-30B-A3B's expert shape, four calls growing from 200 to
 * 3,000 pairs): ~17,000 minor faults and ~330 ms cold, 54 and ~270 ms after a larger call. */
int64_t st_moe_reserve(int64_t T, int H, int F, int E, int K,
                       const uint8_t *const *gate_ptrs, int gate_type, int64_t gate_row_bytes,
                       const uint8_t *const *up_ptrs, int up_type, int64_t up_row_bytes,
                       const uint8_t *const *down_ptrs, int down_type, int64_t down_row_bytes) {
    if (T <= 0 || H <= 0 || F <= 0 || K <= 0 || K > E) return 0;
    int32_t *experts = malloc((size_t)(T * K) * sizeof(int32_t));             /* [T, K] */
    float *x = calloc((size_t)(T * H), sizeof(float));     /* [T, H]: read by small calls only */
    if (!experts || !x) {
        free(experts);
        free(x);
        return -1;
    }
    for (int64_t i = 0; i < T * K; i++) experts[i] = (int32_t)(i % E);  /* a row's K differ */
    moe_call c;
    int64_t kept = -1;
    if (st_moe_setup(&c, x, T, H, F, E, K, gate_ptrs, gate_type, gate_row_bytes, up_ptrs,
                     up_type, up_row_bytes, down_ptrs, down_type, down_row_bytes, experts, NULL,
                     NULL, NULL, -1, 0, 1) == 0) {
        kept = 0;
        if (c.block_bytes <= ST_KEPT_MAX_BYTES) {
            touch_pages(c.block, c.block_bytes);
            kept += (int64_t)c.block_bytes;
        }
        if (c.amx_block && c.amx_block_bytes <= ST_KEPT_MAX_BYTES) {
            touch_pages(c.amx_block, c.amx_block_bytes);
            kept += (int64_t)c.amx_block_bytes;
        }
        st_moe_teardown(&c);
    }
    free(experts);
    free(x);
    return kept;
}

/* The experts of one layer as stacked tensors [E, rows, row_bytes] (a GGUF's ffn_*_exps). */
int st_moe_ffn(const float *x, int64_t T, int H, int F, int E, int K,
               const uint8_t *gate, int gate_type, int64_t gate_row_bytes,
               const uint8_t *up, int up_type, int64_t up_row_bytes,
               const uint8_t *down, int down_type, int64_t down_row_bytes,
               const int32_t *experts, const float *weights, float *out) {
    const uint8_t **ptrs = malloc((size_t)3 * (E > 0 ? E : 1) * sizeof(*ptrs));   /* [3, E] */
    if (!ptrs) return -1;
    for (int e = 0; e < E; e++) {
        ptrs[e] = gate + (int64_t)e * F * gate_row_bytes;
        ptrs[E + e] = up + (int64_t)e * F * up_row_bytes;
        ptrs[2 * E + e] = down + (int64_t)e * H * down_row_bytes;
    }
    int rc = st_moe_ffn_ptrs(x, T, H, F, E, K, ptrs, gate_type, gate_row_bytes,
                             ptrs + E, up_type, up_row_bytes, ptrs + 2 * E, down_type,
                             down_row_bytes, experts, weights, out, NULL, 0);
    free((void *)ptrs);
    return rc;
}
