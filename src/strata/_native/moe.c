/* The routed-expert block of a MoE layer: rows grouped by expert, each distinct expert applied
 * once to all its rows (gate/up, SiLU-gate, down), outputs summed with the router weights. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "quant.h"

/* Legend: T = tokens, K = experts per token, E = experts, H = hidden, F = expert width,
 * P = routed (token, k) pairs with an expert id >= 0. */

#define ITEM_ROWS 64   /* weight rows per work item */

static void *alloc64(size_t num_bytes) {
    size_t rounded = (num_bytes + 63) / 64 * 64;
    return aligned_alloc(64, rounded > 0 ? rounded : 64);
}

static inline float silu(float v) { return v / (1.0f + expf(-v)); }

/* Work items (expert, row block) over the experts that have rows. */
typedef struct { int32_t expert; int32_t r0; } moe_item;

static int64_t build_items(const int64_t *count, int E, int rows, moe_item *items) {
    int64_t n = 0;
    for (int e = 0; e < E; e++) {
        if (count[e] == 0) continue;
        for (int r0 = 0; r0 < rows; r0 += ITEM_ROWS) {
            items[n].expert = e;
            items[n].r0 = r0;
            n++;
        }
    }
    return n;
}

/* Each expert's three matrices come through pointer tables [E] (gate and up [F, H] rows, down
 * [H, F] rows): an expert may sit in the GGUF mapping, an expert pack or a cache slot. When
 * routed_rows is not NULL, routed_rows[e] += the rows routed to expert e. */
int st_moe_ffn_ptrs(const float *x, int64_t T, int H, int F, int E, int K,
                    const uint8_t *const *gate_ptrs, int gate_type, int64_t gate_row_bytes,
                    const uint8_t *const *up_ptrs, int up_type, int64_t up_row_bytes,
                    const uint8_t *const *down_ptrs, int down_type, int64_t down_row_bytes,
                    const int32_t *experts, const float *weights, float *out,
                    int64_t *routed_rows) {
    int rc = -1;
    int64_t *count = calloc((size_t)E + 1, sizeof(int64_t));
    int64_t *offset = calloc((size_t)E + 1, sizeof(int64_t));
    int32_t *pair_of = malloc((size_t)(T * K > 0 ? T * K : 1) * sizeof(int32_t));   /* [T, K] */
    int32_t *pair_tok = malloc((size_t)(T * K > 0 ? T * K : 1) * sizeof(int32_t));  /* [P] */
    int32_t *pair_ids = malloc((size_t)(T * K > 0 ? T * K : 1) * sizeof(int32_t));  /* [P] */
    const int max_rows = F > H ? F : H;
    const int64_t max_items = (int64_t)E * ((max_rows + ITEM_ROWS - 1) / ITEM_ROWS) + 1;
    moe_item *items = malloc((size_t)max_items * sizeof(moe_item));      /* gate / up */
    moe_item *items_2 = malloc((size_t)max_items * sizeof(moe_item));    /* down */
    float *G = NULL, *U = NULL, *Y = NULL;
    st_act act_gate, act_up, act_h;
    memset(&act_gate, 0, sizeof(act_gate));
    memset(&act_up, 0, sizeof(act_up));
    memset(&act_h, 0, sizeof(act_h));
    if (!count || !offset || !pair_of || !pair_tok || !pair_ids || !items || !items_2) goto done;

    /* ---- group the (token, k) pairs by expert (counting sort keeps token order) ---- */
    for (int64_t i = 0; i < T * K; i++)
        if (experts[i] >= 0) count[experts[i]]++;
    for (int e = 0; e < E; e++) offset[e + 1] = offset[e] + count[e];
    const int64_t P = offset[E];
    if (routed_rows)
        for (int e = 0; e < E; e++) routed_rows[e] += count[e];
    {
        int64_t *fill = calloc((size_t)E + 1, sizeof(int64_t));
        if (!fill) goto done;
        for (int64_t i = 0; i < T * K; i++) {
            int32_t e = experts[i];
            if (e < 0) { pair_of[i] = -1; continue; }
            int64_t p = offset[e] + fill[e]++;
            pair_of[i] = (int32_t)p;
            pair_tok[p] = (int32_t)(i / K);
        }
        free(fill);
    }
    for (int64_t p = 0; p < P; p++) pair_ids[p] = (int32_t)p;
    if (P == 0) { rc = 0; goto done; }

    G = alloc64((size_t)P * F * sizeof(float));    /* [P, F] gate, then SiLU(gate) * up */
    U = alloc64((size_t)P * F * sizeof(float));    /* [P, F] */
    Y = alloc64((size_t)P * H * sizeof(float));    /* [P, H] */
    if (!G || !U || !Y) goto done;
    const int gate_quant = !st_is_float_type(gate_type);
    const int up_quant = !st_is_float_type(up_type);
    const int shared_x = gate_quant == up_quant;
    if (st_act_alloc(&act_gate, T, H, gate_quant) != 0) goto done;
    if (!shared_x && st_act_alloc(&act_up, T, H, up_quant) != 0) goto done;
    if (st_act_alloc(&act_h, P, F, !st_is_float_type(down_type)) != 0) goto done;
    const st_act *ax_up = shared_x ? &act_gate : &act_up;

    size_t scratch_bytes = st_scratch_bytes(gate_type, H);
    size_t sb = st_scratch_bytes(up_type, H);
    if (sb > scratch_bytes) scratch_bytes = sb;
    sb = st_scratch_bytes(down_type, F);
    if (sb > scratch_bytes) scratch_bytes = sb;
    const int64_t num_items_1 = build_items(count, E, F, items);
    const int64_t num_items_2 = build_items(count, E, H, items_2);
    int failed = 0;

    /* a few rows are quicker filled here than behind one more barrier of the team */
    const int is_small = T * (int64_t)H <= 16384;
    if (is_small) {
        st_act_fill(&act_gate, x, H, 0, T);
        if (!shared_x) st_act_fill(&act_up, x, H, 0, T);
    }
    const int is_parallel = (double)P * 3.0 * F * H >= ST_MIN_PARALLEL_MACS;
    #pragma omp parallel num_threads(st_get_num_threads()) reduction(|:failed) if (is_parallel)
    {
        void *scratch = alloc64(scratch_bytes);
        if (!scratch) failed = 1;
        if (!is_small) {
            #pragma omp for schedule(static)
            for (int64_t t = 0; t < T; t++) {
                st_act_fill(&act_gate, x, H, t, t + 1);
                if (!shared_x) st_act_fill(&act_up, x, H, t, t + 1);
            }
        }
        /* ---- gate and up: G[p, f], U[p, f] for every expert's pairs ---- */
        #pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < num_items_1; it++) {
            if (!scratch) continue;
            int e = items[it].expert;
            int r0 = items[it].r0;
            int r1 = r0 + ITEM_ROWS < F ? r0 + ITEM_ROWS : F;
            int64_t p0 = offset[e], n = count[e];
            st_gemm_rows(gate_type, gate_ptrs[e], gate_row_bytes, H,
                         r0, r1, &act_gate, pair_tok + p0, n, G + p0 * F + r0, F, scratch);
            st_gemm_rows(up_type, up_ptrs[e], up_row_bytes, H,
                         r0, r1, ax_up, pair_tok + p0, n, U + p0 * F + r0, F, scratch);
            for (int64_t p = p0; p < p0 + n; p++) {
                float *g = G + p * F;                              /* [F] */
                const float *u = U + p * F;
                for (int f = r0; f < r1; f++) g[f] = silu(g[f]) * u[f];
            }
        }
        /* ---- the activation rows of the down projection: SiLU(gate) * up ---- */
        #pragma omp for schedule(static)
        for (int64_t p = 0; p < P; p++) st_act_fill(&act_h, G, F, p, p + 1);
        /* ---- down: Y[p, h] ---- */
        #pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < num_items_2; it++) {
            if (!scratch) continue;
            int e = items_2[it].expert;
            int r0 = items_2[it].r0;
            int r1 = r0 + ITEM_ROWS < H ? r0 + ITEM_ROWS : H;
            int64_t p0 = offset[e], n = count[e];
            st_gemm_rows(down_type, down_ptrs[e], down_row_bytes, F,
                         r0, r1, &act_h, pair_ids + p0, n, Y + p0 * H + r0, H, scratch);
        }
        /* ---- out[t] += sum_k weights[t, k] * Y[pair(t, k)], in k order (deterministic) ---- */
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            float *o = out + t * H;                                /* [H] */
            for (int k = 0; k < K; k++) {
                int32_t p = pair_of[t * K + k];
                if (p < 0) continue;
                float wk = weights[t * K + k];
                const float *y = Y + (int64_t)p * H;
                for (int h = 0; h < H; h++) o[h] += wk * y[h];
            }
        }
        free(scratch);
    }
    rc = failed ? -1 : 0;

done:
    st_act_free(&act_gate);
    st_act_free(&act_up);
    st_act_free(&act_h);
    free(G); free(U); free(Y);
    free(count); free(offset); free(pair_of); free(pair_tok); free(pair_ids); free(items);
    free(items_2);
    return rc;
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
                             down_row_bytes, experts, weights, out, NULL);
    free((void *)ptrs);
    return rc;
}
