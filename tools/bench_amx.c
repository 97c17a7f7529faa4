/* Where amx.c's time goes, on a CPU with AMX (a diagnosis, not part of the build): one
 * Qwen3-30B-A3B gate matrix (768 x 2048 Q4_0, 1.2 MB: in L2) or a ring of 64 (from RAM), per
 * call of st_amx_rows with n tokens; the weights' dequantisation alone; the activations'
 * packing; the tiles kept configured between calls or released after each (amx_release_each).
 * The same on T threads at once, each over its own ring (--threads T): GB/s of weights.
 *
 *   gcc -O3 -march=native -fopenmp -Isrc/strata/_native tools/bench_amx.c \
 *       src/strata/_native/{quant_ref,matmul,tiles,unpack_simd,unpack_neon,fused,fused_k,fused_iq}.c \
 *       -lm -o /tmp/bench_amx && /tmp/bench_amx 15
 * Prints us per matrix (medians of 5 runs of ~0.2 s). On a CPU with AVX-512 BF16 and no AMX
 * (the dev machine's EPYC) only the dequantisation and the packing. */
#include "../src/strata/_native/amx.c"
#include <omp.h>
#include <stdio.h>
#include <time.h>
#include "bench_common.h"

#define ROWS 768
#define COLS 2048
#define RING 64


static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

typedef struct { uint8_t *w; int64_t row_bytes; uint16_t *packed; void *scratch; float *out; } ctx;

static void setup(ctx *c, int n_mats) {
    c->row_bytes = COLS / 32 * 18;
    c->w = st_alloc64((size_t)n_mats * ROWS * c->row_bytes);
    uint32_t s = 12345;
    for (size_t i = 0; i < (size_t)n_mats * ROWS * c->row_bytes; i++) {
        s = s * 1664525u + 1013904223u;
        c->w[i] = (uint8_t)(s >> 24);
    }
    for (size_t b = 0; b < (size_t)n_mats * ROWS * (COLS / 32); b++) {   /* scales ~0.01 */
        uint16_t h = 0x2000 + (uint16_t)(b % 512);
        memcpy(c->w + b * 18, &h, 2);
    }
    float *x = malloc(sizeof(float) * 128 * COLS);
    for (int i = 0; i < 128 * COLS; i++) x[i] = (float)((i * 37) % 101 - 50) / 50.0f;
    c->packed = st_alloc64(st_amx_pack_bytes(128, COLS));
    st_amx_pack(x, COLS, NULL, 128, COLS, c->packed);
    free(x);
    c->scratch = st_alloc64(st_amx_scratch_bytes(COLS));
    c->out = st_alloc64(sizeof(float) * 128 * ROWS);
}

/* us per matrix: mode 0 st_amx_rows, 1 dequantisation only, 2 packing n rows */
static double run(ctx *c, int n_mats, int n, int mode) {
    double best[5];
    float *x = mode == 2 ? malloc(sizeof(float) * 128 * COLS) : NULL;
    if (x) for (int i = 0; i < 128 * COLS; i++) x[i] = 0.5f;
    for (int r = 0; r < 5; r++) {
        int calls = 0;
        double t0 = bench_now(), t;
        do {
            const uint8_t *w = c->w + (size_t)(calls % n_mats) * ROWS * c->row_bytes;
            if (mode == 0)
                st_amx_rows(ST_Q4_0, w, c->row_bytes, COLS, 0, ROWS, c->packed, n, c->out, ROWS,
                            c->scratch);
            else if (mode == 1)
                for (int rb = 0; rb < ROWS; rb += GROUP_ROWS) {
                    deq_block d;
                    deq_start(&d, ST_Q4_0, w, c->row_bytes, COLS / STEP_COLS, rb, GROUP_ROWS,
                              c->scratch, 0);
                    deq_finish(&d);
                }
            else
                st_amx_pack(x, COLS, NULL, n, COLS, c->packed);
            calls++;
        } while ((t = bench_now()) - t0 < 0.2);
        best[r] = (t - t0) / calls * 1e6;
    }
    free(x);
    qsort(best, 5, sizeof(double), cmp);
    return best[2];
}

int main(int argc, char **argv) {
    const int threads = argc > 1 ? atoi(argv[1]) : 15;
    const int amx = st_amx_available();
    if (!amx && !__builtin_cpu_supports("avx512bf16")) {
        printf("no AMX and no AVX-512 BF16 here\n");
        return 1;
    }
    ctx one, ring;
    setup(&one, 1);
    setup(&ring, RING);
    const double mb = ROWS * one.row_bytes / 1e6;
    printf("one thread, us per %dx%d Q4_0 matrix (%.2f MB)\n", ROWS, COLS, mb);
    printf("dequantise only: L2 %.1f, RAM %.1f\n", run(&one, 1, 0, 1), run(&ring, RING, 0, 1));
    if (!amx) {   /* the AVX-512 parts alone (a CPU with AVX-512 BF16 and no AMX) */
        for (int n = 16; n <= 128; n *= 2) printf("pack %3d tokens: %.1f\n", n, run(&one, 1, n, 2));
        printf("no AMX here: no rows\n");
        return 0;
    }
    const int ns[5] = {1, 16, 32, 64, 128};
    for (int i = 0; i < 5; i++) {
        amx_release_each = 0;
        double l2 = run(&one, 1, ns[i], 0), ram = run(&ring, RING, ns[i], 0);
        amx_release_each = 1;
        double l2r = run(&one, 1, ns[i], 0);
        amx_release_each = 0;
        printf("n %3d: rows L2 %7.1f RAM %7.1f (released each call: L2 %7.1f); pack %6.1f\n",
               ns[i], l2, ram, l2r, run(&one, 1, ns[i], 2));
    }
    for (int i = 0; i < 5; i++) {
        double us[256];
        #pragma omp parallel num_threads(threads)
        {
            ctx mine;
            setup(&mine, RING);
            #pragma omp barrier
            us[omp_get_thread_num()] = run(&mine, RING, ns[i], 0);
        }
        double sum = 0;
        for (int t = 0; t < threads; t++) sum += us[t];
        const double per = sum / threads;
        printf("%d threads, n %3d: %.1f us per matrix per thread, %.1f GB/s of weights, "
               "%.0f matrices/s\n", threads, ns[i], per, threads * mb / per * 1e3,
               threads / per * 1e6);
    }
    return 0;
}
