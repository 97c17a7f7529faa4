/* The decode rows kernel alone (fused.c's st_fused_rows, one token, one thread): GB/s of weight
 * bytes read, from the caches or from RAM, in chunks the size of the CPU pool's work items taken
 * in order or shuffled (each chunk then starts cold: the rows ST_PREFETCH_ROWS ahead that the
 * kernel asks for are the next chunk's only when chunks follow each other). Several processes at
 * once stand for the pool's threads without its calls, barriers and items around the kernel.
 *
 * Build and run from the project root (any C file that st_fused_rows reaches, no Python):
 *   gcc -O3 -march=native -fopenmp -fno-math-errno -fno-trapping-math -ffp-contract=off \
 *       -Isrc/strata/_native tools/bench_fused_rows.c src/strata/_native/{fused,fused_k,fused_iq,\
 *       quant_ref,matmul,tiles,unpack_simd}.c -lm -o /tmp/bench_fused_rows
 *   /tmp/bench_fused_rows ROWS [COLS=2048] [CHUNK=64] [shuffle] [TYPE=2 (Q4_0); 12 Q4_K ...]
 * ROWS x COLS weights: 256 x 2048 Q4_0 (295 KB) sit in L2, 200000 x 2048 (230 MB) come from RAM.
 * Prints the best and the median of 15 runs of >= 200 MB each.
 * Session 45 (docs/DEVELOPING.md, docs/offload.md): ~13 GB/s from L2 and 7-8 from RAM on the
 * AVX2 EPYC, shuffled 64-row chunks of 768 columns (the down rows) 20-25% slower than in order;
 * on the H200 machine's Xeon 15 processes at once read 6-11 GB/s each from RAM. */
#include <stdio.h>
#include "bench_common.h"

#define RUNS 15
#define MIN_RUN_BYTES 200000000LL

static int by_value(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s ROWS [COLS] [CHUNK] [shuffle] [TYPE]\n", argv[0]);
        return 2;
    }
    const int64_t rows = bench_arg(argc, argv, 1, 0), chunk = bench_arg(argc, argv, 3, 64);
    const int cols = (int)bench_arg(argc, argv, 2, 2048);
    const int shuffle = argc > 4 && strcmp(argv[4], "shuffle") == 0;
    const int qtype = (int)bench_arg(argc, argv, 5, ST_Q4_0);
    bench_iq_tables(qtype);
    const int block = st_block_size(qtype);
    if (rows < 1 || chunk < 1 || rows % chunk || block < 32 || cols % block) {
        fprintf(stderr, "ROWS must be a multiple of CHUNK, COLS of the type's block\n");
        return 2;
    }
    const int block_bytes = st_type_size(qtype);
    const int64_t row_bytes = cols / block * block_bytes;
    uint8_t *w = st_alloc64((size_t)(rows * row_bytes));                  /* [ROWS, row_bytes] */
    float *x = malloc((size_t)cols * sizeof(float));                         /* [COLS] */
    float *out = malloc((size_t)rows * sizeof(float));                       /* [ROWS] */
    int64_t *order = malloc((size_t)(rows / chunk) * sizeof(int64_t));      /* chunk order */
    if (!w || !x || !out || !order) return 1;
    srand(1);
    bench_random_weights(w, qtype, rows, cols);
    for (int i = 0; i < cols; i++) x[i] = (float)(rand() % 2000 - 1000) / 1000.0f;
    st_act act;
    if (st_act_alloc(&act, 1, cols, st_act_kind(qtype)) != 0) return 1;
    st_act_fill(&act, x, cols, 0, 1);
    const int64_t num_chunks = rows / chunk;
    for (int64_t i = 0; i < num_chunks; i++) order[i] = i;
    for (int64_t i = num_chunks - 1; shuffle && i > 0; i--) {
        int64_t j = rand() % (i + 1), t = order[i];
        order[i] = order[j];
        order[j] = t;
    }
    double gbs[RUNS];
    for (int run = 0; run < RUNS; run++) {
        const double t0 = bench_now();
        int64_t read = 0;
        while (read < MIN_RUN_BYTES) {
            for (int64_t c = 0; c < num_chunks; c++) {
                const int64_t r0 = order[c] * chunk;
                if (!st_fused_rows(qtype, w, row_bytes, cols, r0, (int)chunk, &act, NULL, 0, 1,
                                   out + r0, rows)) {
                    fprintf(stderr, "this build has no fused rows for type %d\n", qtype);
                    return 1;
                }
            }
            read += rows * row_bytes;
        }
        gbs[run] = read / (bench_now() - t0) / 1e9;
    }
    qsort(gbs, RUNS, sizeof(double), by_value);
    printf("rows %lld cols %d chunk %lld%s: %.2f GB/s best, %.2f median (check %.6f)\n",
           (long long)rows, cols, (long long)chunk, shuffle ? " shuffled" : "", gbs[RUNS - 1],
           gbs[RUNS / 2], out[0] + out[rows / 2]);
    return 0;
}
