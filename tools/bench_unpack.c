/* The tiles' unpacking alone (unpack_simd.c's st_unpack_row_simd, one thread): ns per row of
 * ROWS x COLS random weights of a 32-column type, the rows in L2, best of 15 runs (the k-quants
 * are not unpacked since session 99: fused_k.c's rows take every token count);
 * and a checksum of the unpacked scales, so two builds of unpack_simd.c can be compared for
 * their output as well as their speed (docs/DEVELOPING.md, session 98).
 *
 * Build and run from the project root (an older unpack_simd.c: `git show REV:src/strata/_native/
 * unpack_simd.c > /tmp/unpack_old.c` in its place):
 *   gcc -O3 -march=native -Isrc/strata/_native tools/bench_unpack.c \
 *       src/strata/_native/unpack_simd.c src/strata/_native/quant_ref.c -lm -o /tmp/bench_unpack
 *   /tmp/bench_unpack TYPE [COLS=2048] [ROWS=256]      (TYPE: 2 Q4_0, 8 Q8_0, 6 Q5_0, ...) */
#include <stdio.h>
#include "bench_common.h"

#define RUNS 15
#define PASSES 200

int main(int argc, char **argv) {
    const int qtype = (int)bench_arg(argc, argv, 1, -1);
    const int cols = (int)bench_arg(argc, argv, 2, 2048), rows = (int)bench_arg(argc, argv, 3, 256);
    const int block = st_block_size(qtype), block_bytes = st_type_size(qtype);
    if (block < 32 || cols % block || rows < 1) {
        fprintf(stderr, "usage: %s TYPE [COLS] [ROWS]: a quantised type, COLS a multiple of "
                "its block\n", argv[0]);
        return 2;
    }
    const int64_t row_bytes = (int64_t)cols / block * block_bytes;
    uint8_t *w = malloc((size_t)(rows * row_bytes));             /* [ROWS, row_bytes] */
    uint8_t *s = malloc((size_t)cols);                           /* one unpacked row */
    float *A = malloc((size_t)cols / ST_LANE * sizeof(float));
    float *B = malloc((size_t)cols / ST_GROUP * sizeof(float));
    if (!w || !s || !A || !B) return 1;
    srand(1);
    bench_random_weights(w, qtype, rows, cols);
    double best = 1e30, check = 0.0;
    for (int run = 0; run < RUNS; run++) {
        const double t0 = bench_now();
        for (int pass = 0; pass < PASSES; pass++)
            for (int r = 0; r < rows; r++) {
                if (!st_unpack_row_simd(qtype, w + r * row_bytes, cols, s, A, B)) {
                    fprintf(stderr, "this build has no SIMD unpacking for type %d\n", qtype);
                    return 1;
                }
                if (run == 0 && pass == 0)
                    for (int i = 0; i < cols / ST_LANE; i++) check += A[i] * (1 + s[i * ST_LANE]);
            }
        const double t = bench_now() - t0;
        if (t < best) best = t;
    }
    printf("type %d, %d cols: %.1f ns a row (best of %d; check %.6g)\n", qtype, cols,
           best / ((double)PASSES * rows) * 1e9, RUNS, check);
    return 0;
}
