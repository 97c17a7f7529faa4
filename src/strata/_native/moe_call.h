/* One routed-expert call split in three (moe.c), so that a caller's own OpenMP team can run the
 * products (the CPU pool's window-long team, pool_window.c): st_moe_setup on one thread groups
 * the pairs and sizes the buffers, st_moe_compute on EVERY thread of the team runs the products
 * and the weighted sum (orphaned worksharing; it ends with the team past a barrier),
 * st_moe_teardown on one frees. st_moe_products is st_moe_compute without the sum, which
 * st_moe_sum then does for rows [t0, t1) on any one thread. st_moe_ffn_ptrs is the three around
 * a region of its own. Legend as moe.c. */
#pragma once
#include "quant.h"

/* Work items (expert, row block) over the experts that have rows. */
typedef struct { int32_t expert; int32_t r0, r1; } moe_item;   /* rows [r0, r1) of an expert */

typedef struct {
    const float *x; int64_t T; int H, F, E, K;
    const uint8_t *const *gate_ptrs, *const *up_ptrs, *const *down_ptrs;
    int gate_type, up_type, down_type;
    int64_t gate_row_bytes, up_row_bytes, down_row_bytes;
    const float *weights; float *out;
    int64_t *count, *offset;                       /* [E + 1] */
    int32_t *pair_of, *pair_tok, *pair_ids;        /* [T, K], [P], [P] */
    moe_item *items, *items_2;                     /* gate / up, down */
    int64_t P, num_items_1, num_items_2;
    float *G, *U, *Y;                              /* [P, F], [P, F], [P, H] */
    void *block;                                   /* every buffer above: st_block_take's */
    size_t block_bytes;
    st_act act_gate, act_up, act_h;
    int32_t *left, *h_ready;                       /* [E]: gate/up items to go; act_h rows set */
    int shared_x, is_small, is_parallel, fill_by_last;
    int split_expert, split_cols;                  /* -1, F: none (st_moe_setup) */
    /* Experts of many rows on the AMX rows (amx.c; allow_amx callers only): their activations
     * packed once per expert, gate/up's from x and down's from G, at byte offsets xp_off[e] /
     * hp_off[e] of amx_block (-1: that product takes the lane tiles) */
    int allow_amx, num_amx;
    int32_t *amx_list;                             /* [num_amx] the experts with an offset */
    int64_t *xp_off, *hp_off;                      /* [E] */
    void *amx_block;
    size_t amx_block_bytes, amx_scratch_bytes;
    size_t scratch_bytes;
    int failed;                                    /* a thread ran out of memory */
} moe_call;

/* 0, or -1 on allocation failure (c is then torn down); c->P == 0 leaves nothing to compute.
 * allow_amx: experts of at least st_moe_amx_rows() rows may take the AMX rows where the CPU
 * has them (the CPU pool's calls: not batch-invariant, amx.c).
 * split_expert / split_cols (0 < split_cols < F, a multiple of the down type's block; else
 * none): that expert's gate/up rows and down columns [0, split_cols) only, its part of an
 * expert another device computes the rest of (the CPU pool's split expert). */
int st_moe_setup(moe_call *c, const float *x, int64_t T, int H, int F, int E, int K,
                 const uint8_t *const *gate_ptrs, int gate_type, int64_t gate_row_bytes,
                 const uint8_t *const *up_ptrs, int up_type, int64_t up_row_bytes,
                 const uint8_t *const *down_ptrs, int down_type, int64_t down_row_bytes,
                 const int32_t *experts, const float *weights, float *out,
                 int64_t *routed_rows, int split_expert, int split_cols, int allow_amx);
void st_moe_compute(moe_call *c);
void st_moe_products(moe_call *c);
void st_moe_sum(const moe_call *c, int64_t t0, int64_t t1, int set);
void st_moe_teardown(moe_call *c);
/* Fault in the kept blocks (matmul.c) a pool call of up to T rows takes (its buffers and,
 * where the CPU has AMX, its packed activations), so that the first windows do not fault them
 * in as their calls grow: the bytes kept, 0 when none would be (bigger than ST_KEPT_MAX_BYTES),
 * -1 when they could not be allocated. */
int64_t st_moe_reserve(int64_t T, int H, int F, int E, int K,
                       const uint8_t *const *gate_ptrs, int gate_type, int64_t gate_row_bytes,
                       const uint8_t *const *up_ptrs, int up_type, int64_t up_row_bytes,
                       const uint8_t *const *down_ptrs, int down_type, int64_t down_row_bytes);
/* The fewest rows an expert needs to take the AMX rows (8; STRATA_AMX_ROWS=N sets it). */
int st_moe_amx_rows(void);
