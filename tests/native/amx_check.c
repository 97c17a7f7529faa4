/* amx.c's AMX rows with the five tile operations emulated in C (ST_AMX_EMULATE), so that its
 * weight unpacking, activation packing (VNNI layout, groups of 16 tokens, the per-thread cache)
 * and block scaling are checked on any machine: st_amx_rows against a double reference of the
 * same int8 values and scales, and against the lane tiles (st_gemm_rows without allow_amx).
 * Compiled and run by test_amx_emulated.py; exit status 0 = pass. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "quant.h"

static uint64_t g_state = 0x9E3779B97F4A7C15ull;

static uint32_t next_u32(void) {
    g_state ^= g_state << 13;
    g_state ^= g_state >> 7;
    g_state ^= g_state << 17;
    return (uint32_t)(g_state >> 11);
}

static uint16_t to_fp16(float f) {  /* a positive normal float, mantissa truncated */
    union { float f; uint32_t u; } v = {f};
    uint32_t e = ((v.u >> 23) & 0xff) - 112;
    return (uint16_t)((e << 10) | ((v.u >> 13) & 0x3ff));
}

static void random_weight(int qt, uint8_t *w, int rows, int cols) {
    const int ts = st_type_size(qt), nb = rows * (cols / 32);
    for (int b = 0; b < nb; b++) {
        uint8_t *blk = w + (int64_t)b * ts;
        uint16_t h = to_fp16(0.001f + 0.099f * (float)(next_u32() % 1000) / 1000.0f);
        memcpy(blk, &h, 2);
        for (int i = 2; i < ts; i++) blk[i] = (uint8_t)next_u32();
        if (qt == ST_Q8_0)
            for (int i = 2; i < ts; i++) if (blk[i] == 0x80) blk[i] = 0x81;  /* int8 -127..127 */
    }
}

/* one case: rows [rb, rb + nr) of a [rows, cols] matrix against n_tok tokens picked by tok */
static int check(int qt, int rows, int cols, int64_t rb, int nr, int n_act, int n_tok, int scatter) {
    const int ts = st_type_size(qt);
    const int64_t row_bytes = (int64_t)cols / 32 * ts;
    uint8_t *w = malloc((size_t)rows * row_bytes);
    random_weight(qt, w, rows, cols);
    float *x = malloc(sizeof(float) * n_act * cols);
    for (int i = 0; i < n_act * cols; i++) x[i] = (float)((int)(next_u32() % 2001) - 1000) / 700.0f;
    st_act act;
    if (st_act_alloc(&act, n_act, cols, 1) != 0) return 1;
    st_act_fill(&act, x, cols, 0, n_act);
    int32_t *tok = malloc(sizeof(int32_t) * (n_tok + 1));
    for (int j = 0; j < n_tok; j++) tok[j] = scatter ? (int32_t)((j * 7 + 3) % n_act) : j;
    float *deq = malloc(sizeof(float) * cols);
    float *amx = malloc(sizeof(float) * n_tok * nr), *tiles = malloc(sizeof(float) * n_tok * nr);
    act.allow_amx = 1;
    /* another row block of the same token set first: the second call reuses the packed rows */
    if (!st_amx_rows(qt, w, row_bytes, cols, rb > 0 ? 0 : rows - nr, nr, &act,
                     scatter ? tok : NULL, 0, n_tok, amx, nr)
        || !st_amx_rows(qt, w, row_bytes, cols, rb, nr, &act, scatter ? tok : NULL, 0, n_tok,
                        amx, nr)) {
        printf("st_amx_rows did not take a %d-column case\n", cols);
        return 1;
    }
    act.allow_amx = 0;
    void *scratch = aligned_alloc(64, (st_scratch_bytes(qt, cols) + 63) / 64 * 64);
    st_gemm_rows(qt, w, row_bytes, cols, rb, rb + nr, &act, scatter ? tok : NULL, n_tok, tiles,
                 nr, scratch);
    int bad = 0;
    const int ncp = act.cols_pad;
    for (int i = 0; i < nr && !bad; i++) {
        st_dequantize(qt, w + (rb + i) * row_bytes, deq, cols / 32);
        for (int j = 0; j < n_tok && !bad; j++) {
            const int64_t t = tok[j];
            double ref = 0.0, mag = 0.0;
            for (int k = 0; k < cols; k++) {
                const double v = (double)deq[k] * act.q[t * ncp + k] * act.dx[t * (ncp / 4) + k / 4];
                ref += v;
                mag += fabs(v);
            }
            const double tol = 2e-6 * mag + 1e-9;
            const double ea = fabs(amx[j * nr + i] - ref), et = fabs(tiles[j * nr + i] - ref);
            if (ea > tol || et > tol) {
                printf("qtype %d cols %d rb %ld nr %d tokens %d: row %d token %d amx %.9g tiles "
                       "%.9g ref %.9g\n", qt, cols, (long)rb, nr, n_tok, i, j, amx[j * nr + i],
                       tiles[j * nr + i], ref);
                bad = 1;
            }
        }
    }
    st_act_free(&act);
    free(w); free(x); free(tok); free(deq); free(amx); free(tiles); free(scratch);
    return bad;
}

int main(void) {
    printf("amx=%d\n", st_amx_available());
    int failed = 0;
    const int types[2] = {ST_Q4_0, ST_Q8_0};
    for (int q = 0; q < 2; q++) {
        failed |= check(types[q], 64, 2048, 16, 16, 40, 16, 0);
        failed |= check(types[q], 64, 2048, 3, 13, 40, 33, 1);   /* a partial row block */
        failed |= check(types[q], 32, 768, 0, 16, 9, 4, 1);      /* one short group */
        failed |= check(types[q], 40, 64, 24, 16, 70, 70, 0);
        failed |= check(types[q], 20, 96, 4, 5, 17, 17, 1);
        failed |= check(types[q], 16, 160, 0, 16, 6, 5, 0);     /* 5 blocks: a tail of 1 */
    }
    /* the per-thread packed activations: two row blocks of one token set, then another set
     * of the same act, then a new act at the same sizes */
    failed |= check(ST_Q4_0, 64, 512, 0, 16, 30, 20, 1);
    failed |= check(ST_Q4_0, 64, 512, 16, 16, 30, 20, 1);
    failed |= check(ST_Q4_0, 64, 512, 32, 16, 30, 21, 0);
    printf(failed ? "FAILED\n" : "PASSED\n");
    return failed;
}
