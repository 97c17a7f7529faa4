/* Builds of the kernels for other instruction sets (scalar, AVX2, AVX-512 without VNNI, NEON
 * under qemu) checked against a double reference: st_matmul vs st_dequantize'd weights times
 * the same 8-bit activations. Compiled and run by test_arch_builds.py; exit status 0 = pass. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "quant.h"
#include "window.h"

static uint64_t g_state = 88172645463325252ull;

static uint32_t next_u32(void) {
    g_state ^= g_state << 13;
    g_state ^= g_state >> 7;
    g_state ^= g_state << 17;
    return (uint32_t)(g_state >> 11);
}

static float uniform(void) { return (float)(next_u32() % 2000001) / 1000000.0f - 1.0f; }

/* fp16 bits of a positive normal float (truncating the mantissa) */
static uint16_t to_fp16(float f) {
    union { float f; uint32_t u; } v = {f};
    uint32_t e = ((v.u >> 23) & 0xff) - 112;
    return (uint16_t)((e << 10) | ((v.u >> 13) & 0x3ff));
}

static void random_weight(int qt, uint8_t *w, int rows, int cols) {
    int64_t n_blocks = (int64_t)rows * cols / st_block_size(qt);
    int ts = st_type_size(qt);
    for (int64_t i = 0; i < n_blocks * ts; i++) w[i] = (uint8_t)next_u32();
    if (st_is_float_type(qt)) {
        for (int64_t i = 0; i < n_blocks; i++) {
            float f = uniform();
            if (qt == ST_F32) { memcpy(w + 4 * i, &f, 4); continue; }
            union { float f; uint32_t u; } v = {fabsf(f) + 0.01f};
            uint16_t h = qt == ST_F16 ? to_fp16(v.f) : (uint16_t)(v.u >> 16);
            if (f < 0) h |= 0x8000;
            memcpy(w + 2 * i, &h, 2);
        }
        return;
    }
    /* fp16 scale fields: random bytes there would be NaN / Inf */
    int fields[2] = {0, -1};
    if (qt == ST_Q4_K || qt == ST_Q5_K || qt == ST_Q4_1 || qt == ST_Q5_1) fields[1] = 2;
    if (qt == ST_Q6_K) fields[0] = 208;
    if (qt == ST_Q2_K) { fields[0] = 80; fields[1] = 82; }
    if (qt == ST_Q3_K) fields[0] = 108;
    if (qt == ST_IQ1_M) fields[0] = -1;  /* its d is the top nibbles of the u16s at 48 .. 55 */
    for (int64_t b = 0; b < n_blocks; b++) {
        for (int j = 0; j < 2; j++)
            if (fields[j] >= 0) {
                uint16_t h = to_fp16(0.001f + 0.099f * (float)(next_u32() % 1000) / 1000.0f);
                memcpy(w + b * ts + fields[j], &h, 2);
            }
        if (qt == ST_IQ1_M) {
            uint16_t h = to_fp16(0.001f + 0.099f * (float)(next_u32() % 1000) / 1000.0f), sc;
            for (int i = 0; i < 4; i++) {
                memcpy(&sc, w + b * ts + 48 + 2 * i, 2);
                sc = (uint16_t)((sc & 0x0FFF) | (((h >> (4 * i)) & 0xF) << 12));
                memcpy(w + b * ts + 48 + 2 * i, &sc, 2);
            }
        }
    }
}

/* The grid i-quants' tables, which kernels.pyx takes from gguf at import: any values in the
 * grids' ranges exercise the kernels alike (IQ2 magnitudes 8 / 25 / 43, IQ3 4 .. 60, IQ1
 * -1 / 0 / 1); a sign byte is 7 bits and their parity as bit 7. */
static void set_iq_tables(void) {
    const int types[7] = {ST_IQ2_XXS, ST_IQ2_XS, ST_IQ2_S, ST_IQ3_XXS, ST_IQ3_S, ST_IQ1_S,
                          ST_IQ1_M};
    const int entries[7] = {256, 512, 1024, 256, 512, 2048, 2048};
    static int8_t values[2048 * 8];
    for (int t = 0; t < 7; t++) {
        const int width = types[t] == ST_IQ3_XXS || types[t] == ST_IQ3_S ? 4 : 8;
        for (int i = 0; i < entries[t] * width; i++) {
            const uint32_t r = next_u32();
            values[i] = (int8_t)(width == 4 ? 4 + 8 * (int)(r % 8)
                                 : t >= 5 ? (int)(r % 3) - 1 : (const int[3]){8, 25, 43}[r % 3]);
        }
        if (st_set_iq_grid(types[t], values, entries[t], width) != 0)
            printf("the grid of type %d was refused\n", types[t]);
    }
    uint8_t signs[128];
    for (int i = 0; i < 128; i++) signs[i] = (uint8_t)(i | (__builtin_parity(i) << 7));
    st_set_iq_ksigns(signs);
}

/* x as the kernels use it: 8-bit per 32 columns for quantised weights (per 256 for the
 * k-quants, ST_ACT_K), else unchanged */
static void activation(const float *x, double *xr, int cols, int kind) {
    for (int i = 0; i < cols; i++) xr[i] = x[i];
    if (kind == ST_ACT_FLOAT) return;
    const int n = kind == ST_ACT_K ? 256 : 32;
    for (int b = 0; b < cols / n; b++) {
        float amax = 0.0f;
        for (int i = 0; i < n; i++) amax = fmaxf(amax, fabsf(x[b * n + i]));
        float d = amax / 127.0f, inv_d = d > 0.0f ? 1.0f / d : 0.0f;
        for (int i = 0; i < n; i++) xr[b * n + i] = (double)lrintf(x[b * n + i] * inv_d) * d;
    }
}

static int check(int qt, int rows, int cols, int T) {
    const int kind = st_act_kind(qt);
    int64_t row_bytes = (int64_t)cols / st_block_size(qt) * st_type_size(qt);
    uint8_t *w = malloc((size_t)(rows * row_bytes));
    float *wf = malloc(sizeof(float) * rows * cols);
    float *x = malloc(sizeof(float) * T * cols), *out = malloc(sizeof(float) * T * rows);
    double *xr = malloc(sizeof(double) * cols);
    random_weight(qt, w, rows, cols);
    st_dequantize(qt, w, wf, (int64_t)rows * cols / st_block_size(qt));
    for (int i = 0; i < T * cols; i++) x[i] = uniform();
    st_matmul(qt, w, rows, row_bytes, cols, x, T, out);
    double worst = 0.0;
    for (int t = 0; t < T; t++) {
        activation(x + t * cols, xr, cols, kind);
        for (int r = 0; r < rows; r++) {
            double ref = 0.0, mag = 0.0;
            for (int i = 0; i < cols; i++) {
                ref += xr[i] * wf[r * cols + i];
                mag += fabs(xr[i] * wf[r * cols + i]);
            }
            /* float32 accumulation: relative to sum |x w|, (cols / 16 + 16) * 6e-8 bounds it */
            double err = fabs(out[t * rows + r] - ref) / ((cols / 16.0 + 16.0) * 6e-8 * mag);
            if (!(err <= worst)) worst = err;
        }
    }
    int ok = worst <= 1.0;
    uint32_t bits = 2166136261u;  /* FNV-1a of the results' bytes: two builds' bits compared */
    for (size_t i = 0; i < sizeof(float) * T * rows; i++)
        bits = (bits ^ ((const uint8_t *)out)[i]) * 16777619u;
    printf("type=%d rows=%d cols=%d T=%d error/bound=%.3f bits=%08x %s\n", qt, rows, cols, T,
           worst, bits, ok ? "ok" : "FAIL");
    free(w); free(wf); free(x); free(out); free(xr);
    return ok;
}

/* A NaN or inf in an activation row makes that row's results non-finite (NaN for quantised
 * weights, whose quantiser's max skips a NaN) and leaves the other rows finite: one bad element,
 * and a whole row of NaN (a hidden state after rmsnorm), alone and among 5 tokens. */
static int check_nonfinite(int qt) {
    enum { ROWS = 9, T = 5 };
    const int cols = st_block_size(qt) == 256 ? 512 : 128;
    const int64_t row_bytes = (int64_t)cols / st_block_size(qt) * st_type_size(qt);
    const float bad_values[3] = {NAN, INFINITY, -INFINITY};
    uint8_t *w = malloc((size_t)(ROWS * row_bytes));
    float *x = malloc(sizeof(float) * T * cols), out[T * ROWS];
    random_weight(qt, w, ROWS, cols);
    int ok = 1;
    for (int ib = 0; ib < 3; ib++)
        for (int whole = 0; whole < 2; whole++)
            for (int nt = 1; nt <= T; nt += T - 1) {
                const int bad_row = nt / 2;
                for (int i = 0; i < nt * cols; i++) x[i] = uniform();
                if (whole) {
                    for (int i = 0; i < cols; i++) x[bad_row * cols + i] = bad_values[ib];
                } else {
                    x[bad_row * cols + 37] = bad_values[ib];
                }
                st_matmul(qt, w, ROWS, row_bytes, cols, x, nt, out);
                for (int t = 0; t < nt; t++)
                    for (int r = 0; r < ROWS; r++) {
                        const float v = out[t * ROWS + r];
                        const int want_nan = t == bad_row && (ib == 0 || !st_is_float_type(qt));
                        if (t == bad_row ? (want_nan ? !isnan(v) : isfinite(v)) : !isfinite(v))
                            ok = 0;
                    }
            }
    printf("type=%d non-finite activations %s\n", qt, ok ? "ok" : "FAIL");
    free(w); free(x);
    return ok;
}

/* st_attention over cells written by st_kv_write(_keys), against a double reference of the same
 * (rounded) cells: 3 runs (a chunk across key tiles, a fresh prompt, a decode row), GQA. */
static int check_attention(int D, int is_f16) {
    enum { Q = 8, KV = 2, G = Q / KV, S = 3 };
    const int64_t pos0[S] = {100, 0, 200}, rows[S] = {30, 5, 1}, cap = 201;
    const int64_t k_tiles = (cap + ST_KEY_TILE - 1) / ST_KEY_TILE;
    const size_t cell = is_f16 ? 2 : 4;
    int64_t R = 0;
    for (int s = 0; s < S; s++) R += rows[s];
    float *q = malloc(sizeof(float) * R * Q * D), *out = malloc(sizeof(float) * R * Q * D);
    float *src = malloc(sizeof(float) * cap * KV * D);
    void *kc[S], *vc[S];
    st_attn_run runs[S];
    int64_t row0 = 0;
    for (int s = 0; s < S; s++) {
        kc[s] = calloc((size_t)(KV * k_tiles * D * ST_KEY_TILE), cell);
        vc[s] = calloc((size_t)(KV * cap * D), cell);
        int64_t n = pos0[s] + rows[s];
        for (int64_t i = 0; i < n * KV * D; i++) src[i] = uniform();
        st_kv_write_keys(kc[s], is_f16, k_tiles, 0, src, n, KV, D);
        for (int64_t i = 0; i < n * KV * D; i++) src[i] = uniform();
        st_kv_write(vc[s], is_f16, cap, 0, src, n, KV, D);
        runs[s] = (st_attn_run){kc[s], vc[s], cap, k_tiles, row0, rows[s], pos0[s], is_f16};
        row0 += rows[s];
    }
    for (int64_t i = 0; i < R * Q * D; i++) q[i] = 2.0f * uniform();
    const float scale = 1.0f / sqrtf((float)D);
    void *scratch = malloc(st_attention_scratch_bytes(Q, KV, D) * 4);
    st_attention(q, Q, KV, D, scale, runs, S, out, scratch, 4);
#define CELL(ptr, idx) (is_f16 ? (double)st_fp16_to_fp32(((const uint16_t *)(ptr))[idx]) \
                               : (double)((const float *)(ptr))[idx])
    double worst = 0.0, *p = malloc(sizeof(double) * cap);
    for (int s = 0; s < S; s++)
        for (int64_t i = 0; i < rows[s]; i++)
            for (int j = 0; j < Q; j++) {
                const int64_t r = runs[s].row0 + i, n = pos0[s] + i + 1;
                const int h = j / G;
                double mx = -1e300, sum = 0.0;
                for (int64_t c = 0; c < n; c++) {
                    double dot = 0.0;
                    for (int d = 0; d < D; d++)
                        dot += q[(r * Q + j) * D + d] * CELL(kc[s], ((h * k_tiles + c / ST_KEY_TILE)
                               * D + d) * ST_KEY_TILE + c % ST_KEY_TILE);
                    p[c] = dot * scale;
                    mx = p[c] > mx ? p[c] : mx;
                }
                for (int64_t c = 0; c < n; c++) sum += (p[c] = exp(p[c] - mx));
                for (int d = 0; d < D; d++) {
                    double ref = 0.0;
                    for (int64_t c = 0; c < n; c++) ref += p[c] / sum * CELL(vc[s], (h * cap + c) * D + d);
                    double err = fabs(out[(r * Q + j) * D + d] - ref);
                    if (!(err <= worst)) worst = err;
                }
            }
#undef CELL
    int ok = worst <= 2e-5;
    printf("attention D=%d %s error=%.2e %s\n", D, is_f16 ? "f16" : "f32", worst, ok ? "ok" : "FAIL");
    for (int s = 0; s < S; s++) { free(kc[s]); free(vc[s]); }
    free(q); free(out); free(src); free(scratch); free(p);
    return ok;
}

int main(void) {
    const int types[22] = {ST_F32, ST_F16, ST_BF16, ST_Q4_0, ST_Q8_0, ST_Q4_1, ST_Q5_0, ST_Q5_1,
                           ST_IQ4_NL, ST_Q2_K, ST_Q3_K, ST_Q4_K, ST_Q5_K, ST_Q6_K, ST_IQ4_XS,
                           ST_IQ2_XXS, ST_IQ2_XS, ST_IQ2_S, ST_IQ3_XXS, ST_IQ3_S, ST_IQ1_S,
                           ST_IQ1_M};
    const int token_counts[4] = {1, 2, 5, 9};
    int num_failed = 0;
    printf("simd=%s\n", st_simd_level());
    set_iq_tables();
    for (int it = 0; it < 22; it++) {
        int qt = types[it];
        /* widths that are and are not multiples of the 64-column padding */
        int widths[2] = {512, st_block_size(qt) == 256 ? 768 : (st_is_float_type(qt) ? 100 : 96)};
        for (int iw = 0; iw < 2; iw++)
            for (int jt = 0; jt < 4; jt++)
                num_failed += !check(qt, 37, widths[iw], token_counts[jt]);
        /* one block of columns (float types: 16 and 7), 1 and 17 rows (a row block and one),
         * token counts around the fused limit (4 on AVX2, 9 on AVX-512 VNNI) and the tiles */
        const int narrow[2] = {st_is_float_type(qt) ? 16 : st_block_size(qt),
                               st_is_float_type(qt) ? 7 : 2 * st_block_size(qt)};
        const int more_tokens[5] = {3, 4, 8, 10, 13};
        for (int iw = 0; iw < 2; iw++)
            for (int rows = 1; rows <= 17; rows += 16)
                for (int jt = 0; jt < 5; jt++)
                    num_failed += !check(qt, rows, narrow[iw], more_tokens[jt]);
        num_failed += !check_nonfinite(qt);
    }
    const int head_dims[3] = {64, 40, 16};
    for (int id = 0; id < 3; id++)
        for (int is_f16 = 0; is_f16 < 2; is_f16++) num_failed += !check_attention(head_dims[id], is_f16);
    printf("%s\n", num_failed ? "FAILED" : "PASSED");
    return num_failed != 0;
}
