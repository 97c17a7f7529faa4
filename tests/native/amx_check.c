/* amx.c's AMX-BF16 rows with the tile operations emulated in C (ST_AMX_EMULATE), so that the
 * weights' dequantisation, the activations' packing (VNNI layout, tiles of 16 tokens, padding)
 * and the row / token bookkeeping are checked on a machine without AMX (its AVX-512 BF16 code
 * still runs): st_amx_rows against a double reference of the same bf16-rounded values, and
 * against the unrounded dot within the bf16 bound. Compiled and run by test_amx.py; exit
 * status 0 and a last line PASSED = pass. */
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

static float round_bf16(float f) {  /* to nearest even, as VCVTNEPS2BF16 (finite values) */
    union { float f; uint32_t u; } v = {f};
    v.u = (v.u + 0x7fff + ((v.u >> 16) & 1)) & 0xffff0000u;
    return v.f;
}

static void random_weight(int qt, uint8_t *w, int rows, int cols) {
    const int ts = st_type_size(qt), nb = rows * (cols / 32);
    for (int b = 0; b < nb; b++) {
        uint8_t *blk = w + (int64_t)b * ts;
        uint16_t h = to_fp16(0.001f + 0.099f * (float)(next_u32() % 1000) / 1000.0f);
        memcpy(blk, &h, 2);
        for (int i = 2; i < ts; i++) blk[i] = (uint8_t)next_u32();
    }
}

/* rows [r0, r1) of a [rows, cols] matrix against n tokens of n_act picked by idx (scatter) */
static int check(int qt, int rows, int cols, int64_t r0, int64_t r1, int n_act, int n,
                 int scatter) {
    const int ts = st_type_size(qt);
    const int64_t row_bytes = (int64_t)cols / 32 * ts;
    const int ld = cols + 8;   /* a row stride other than cols */
    uint8_t *w = malloc((size_t)rows * row_bytes);
    random_weight(qt, w, rows, cols);
    float *x = malloc(sizeof(float) * (size_t)n_act * ld);
    for (int i = 0; i < n_act * ld; i++)
        x[i] = (float)((int)(next_u32() % 2001) - 1000) / 700.0f;
    int32_t *idx = malloc(sizeof(int32_t) * (n + 1));
    for (int j = 0; j < n; j++) idx[j] = scatter ? (int32_t)((j * 7 + 3) % n_act) : j;
    uint16_t *packed = st_alloc64(st_amx_pack_bytes(n, cols));
    void *scratch = st_alloc64(st_amx_scratch_bytes(cols));
    const int64_t nr = r1 - r0, ld_out = nr + 3;
    float *out = malloc(sizeof(float) * (size_t)n * ld_out);
    float *deq = malloc(sizeof(float) * cols);
    for (int64_t i = 0; i < n * ld_out; i++) out[i] = NAN;
    st_amx_pack(x, ld, scatter ? idx : NULL, n, cols, packed);
    if (!st_amx_rows(qt, w, row_bytes, cols, r0, r1, packed, n, out, ld_out, scratch)) {
        printf("st_amx_rows did not take type %d, %d columns\n", qt, cols);
        return 1;
    }
    int bad = 0;
    for (int64_t r = r0; r < r1 && !bad; r++) {
        st_dequantize(qt, w + r * row_bytes, deq, cols / 32);
        for (int j = 0; j < n && !bad; j++) {
            const float *xj = x + (int64_t)idx[j] * ld;
            double exact = 0, rounded = 0, mag = 0;
            for (int k = 0; k < cols; k++) {
                exact += (double)deq[k] * xj[k];
                rounded += (double)round_bf16(deq[k]) * round_bf16(xj[k]);
                mag += fabs((double)deq[k] * xj[k]);
            }
            const double got = out[j * ld_out + (r - r0)];
            /* fp32 sums of cols products; bf16 rounds each factor by at most 2^-8 relative */
            const double sum_bound = cols * 0x1p-24 * mag * 1.02 + 1e-30;
            const double bf16_bound = (0x1p-7 + 0x1p-16) * mag + sum_bound;
            if (!(fabs(got - rounded) <= sum_bound) || !(fabs(got - exact) <= bf16_bound)) {
                printf("type %d cols %d rows [%lld, %lld) n %d scatter %d: row %lld token %d "
                       "got %.8g, bf16-rounded %.8g, exact %.8g (bounds %.3g, %.3g)\n", qt, cols,
                       (long long)r0, (long long)r1, n, scatter, (long long)r, j, got, rounded,
                       exact, sum_bound, bf16_bound);
                bad = 1;
            }
        }
    }
    /* nothing written outside [token, row) */
    for (int j = 0; j < n && !bad; j++)
        for (int64_t i = nr; i < ld_out; i++)
            if (!isnan(out[j * ld_out + i])) { printf("wrote past the rows\n"); bad = 1; break; }
    free(w); free(x); free(idx); free(packed); free(scratch); free(out); free(deq);
    return bad;
}

/* The routed-expert call (moe.c) with allow_amx against the same call on the lane tiles: T
 * tokens, each routed to K of E experts (token t to experts (t + k * step) % E), so that some
 * experts get AMX rows and some not, through both ways of filling the down's rows (P <= 64:
 * by the expert's last item; more: behind a barrier). Relative difference of the whole output,
 * which a misplaced row or token makes ~1 and the two paths' roundings keep near 1%. */
static int check_moe(int qt, int T, int E, int K, int step, int threads, int H, int F) {
    const int ts = st_type_size(qt);
    const int64_t gb = (int64_t)H / 32 * ts, db = (int64_t)F / 32 * ts;
    uint8_t *gate = malloc((size_t)E * F * gb), *up = malloc((size_t)E * F * gb);
    uint8_t *down = malloc((size_t)E * H * db);
    random_weight(qt, gate, E * F, H);
    random_weight(qt, up, E * F, H);
    random_weight(qt, down, E * H, F);
    const uint8_t **ptrs = malloc(sizeof(*ptrs) * 3 * E);
    for (int e = 0; e < E; e++) {
        ptrs[e] = gate + (int64_t)e * F * gb;
        ptrs[E + e] = up + (int64_t)e * F * gb;
        ptrs[2 * E + e] = down + (int64_t)e * H * db;
    }
    float *x = malloc(sizeof(float) * T * H), *wts = malloc(sizeof(float) * T * K);
    int32_t *ex = malloc(sizeof(int32_t) * T * K);
    for (int i = 0; i < T * H; i++) x[i] = (float)((int)(next_u32() % 2001) - 1000) / 700.0f;
    for (int t = 0; t < T; t++)
        for (int k = 0; k < K; k++) {
            ex[t * K + k] = (t % 3 == 0 && k == K - 1) ? -1 : (t + k * step) % E;
            wts[t * K + k] = 0.1f + 0.2f * k;
        }
    float *a = calloc((size_t)T * H, sizeof(float)), *b = calloc((size_t)T * H, sizeof(float));
    st_set_num_threads(threads);
    int rc = st_moe_ffn_ptrs(x, T, H, F, E, K, ptrs, qt, gb, ptrs + E, qt, gb, ptrs + 2 * E, qt,
                             db, ex, wts, a, NULL, 1);
    rc |= st_moe_ffn_ptrs(x, T, H, F, E, K, ptrs, qt, gb, ptrs + E, qt, gb, ptrs + 2 * E, qt, db,
                          ex, wts, b, NULL, 0);
    double diff = 0, norm = 0;
    int same = 1;
    for (int i = 0; i < T * H; i++) {
        diff += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
        norm += (double)b[i] * b[i];
        if (a[i] != b[i]) same = 0;
    }
    const double rel = sqrt(diff / norm);
    const int bad = rc != 0 || !(rel < 0.03) || same;
    if (bad)
        printf("moe type %d T %d E %d K %d threads %d H %d F %d: rc %d, relative difference "
               "%.3g%s\n", qt, T, E, K, threads, H, F, rc, rel,
               same ? " (bit-equal: the AMX rows did not run)" : "");
    free(gate); free(up); free(down); free(ptrs); free(x); free(wts); free(ex); free(a); free(b);
    return bad;
}

int main(void) {
    int fails = 0;
    const int types[2] = {ST_Q4_0, ST_Q8_0};
    for (int t = 0; t < 2; t++) {
        const int qt = types[t];
        fails += check(qt, 64, 256, 0, 64, 40, 16, 0);       /* one token tile */
        fails += check(qt, 64, 256, 16, 48, 40, 37, 1);      /* padding tokens, scattered */
        fails += check(qt, 70, 512, 5, 70, 100, 64, 1);      /* a partial row group at each end */
        fails += check(qt, 48, 2048, 0, 48, 200, 97, 1);     /* more than 4 token tiles */
        fails += check(qt, 33, 768, 1, 2, 20, 20, 0);        /* one row */
        /* a pass of 4 row groups (one token tile) and of 2 (two), each with a short last pass */
        fails += check(qt, 80, 256, 3, 80, 30, 11, 1);       /* 77 rows: 4 groups, then 1 */
        fails += check(qt, 64, 512, 0, 40, 50, 29, 1);       /* 40 rows: 2 groups, then 1 */
        fails += check(qt, 64, 256, 8, 64, 50, 32, 0);       /* 56 rows, 2 full token tiles */
        /* the next block dequantised among a pass's steps: an odd number of steps (3), blocks
         * of 2 groups over 3 token tiles (passes of 2 and 1), the last block a partial group */
        fails += check(qt, 100, 96, 0, 100, 60, 40, 1);
        fails += check(qt, 90, 2080, 2, 90, 120, 81, 1);     /* 65 steps, 6 token tiles */
        fails += check(qt, 32, 64, 0, 32, 93, 40, 1);        /* the tiny shape's gate / up */
        fails += check(qt, 64, 32, 0, 64, 93, 40, 1);        /* and its down: one step */
    }
    for (int t = 0; t < 2; t++) {
        fails += check_moe(types[t], 18, 3, 3, 1, 2, 256, 192);  /* P <= 64: by the last item */
        fails += check_moe(types[t], 60, 8, 4, 2, 2, 256, 192);  /* 30 rows an expert, barrier */
        fails += check_moe(types[t], 50, 8, 3, 5, 1, 256, 192);  /* some experts under 16 rows */
        fails += check_moe(types[t], 200, 6, 2, 1, 2, 256, 192); /* over 64 rows an expert */
        /* the tiny synth shape of the GPU pool's tests: one column step for the down (F 32) */
        fails += check_moe(types[t], 93, 8, 2, 3, 2, 64, 32);
        fails += check_moe(types[t], 40, 8, 2, 1, 1, 64, 32);
    }
    if (st_amx_takes(ST_Q4_K, 256) || st_amx_takes(ST_Q4_0, 48)) {
        printf("st_amx_takes took a type or width it has no rows for\n");
        fails++;
    }
    printf("%s\n", fails ? "FAILED" : "PASSED");
    return fails != 0;
}
