/* One decode row kernel against llama.cpp's in the same process: Strata's st_fused_rows (one
 * token, one thread, rows from L2) and ggml's CPU vec_dot for the same type, on the same
 * random weights, alternating 400 times; ns per row, the best of each. This VM's timings swing
 * +-25% between processes, so two separate benchmarks cannot resolve 10-20%; in one process the
 * ratio holds to a few percent (a type neither side changed, e.g. 12 (Q4_K), is the control).
 *
 * Needs llama.cpp's static CPU libraries: `tools/build_llama_bench.sh --cpu` leaves them in
 * $LLAMA_WORK (default /tmp/llama-bench-build). From the project root:
 *   L=/tmp/llama-bench-build; G=$L/llama_cpp_python-0.3.36/vendor/llama.cpp/ggml
 *   gcc -O3 -march=native -fopenmp -fno-math-errno -fno-trapping-math -ffp-contract=off \
 *       -Isrc/strata/_native -I$G/include tools/bench_rows_llama.c src/strata/_native/{fused,\
 *       fused_k,fused_iq,quant_ref,matmul,tiles,unpack_simd}.c $L/build-cpu/ggml/src/libggml-cpu.a \
 *       $L/build-cpu/ggml/src/libggml-base.a -lstdc++ -lm -o /tmp/bench_rows_llama
 *   /tmp/bench_rows_llama TYPE [COLS=2048]      TYPE the ggml type id: 16 IQ2_XXS, 12 Q4_K ...
 * The grid i-quants' tables here are random (bench_iq_tables), ggml's its own: the two sides'
 * results differ for those types, their work does not. Session 101 (docs/DEVELOPING.md). */
#include <stdio.h>
#include "ggml.h"
#include "ggml-cpu.h"
#include "bench_common.h"

#define ROWS 256
#define ROUNDS 400

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s TYPE [COLS]\n", argv[0]);
        return 2;
    }
    const int qtype = atoi(argv[1]), cols = (int)bench_arg(argc, argv, 2, 2048);
    bench_iq_tables(qtype);
    if (!st_is_supported(qtype)) {
        fprintf(stderr, "type %d is not one Strata reads\n", qtype);
        return 2;
    }
    ggml_cpu_init();
    const int block = st_block_size(qtype);
    if (cols % block) {
        fprintf(stderr, "COLS must be a multiple of the type's block (%d)\n", block);
        return 2;
    }
    const int64_t row_bytes = (int64_t)cols / block * st_type_size(qtype);
    uint8_t *w = malloc((size_t)(row_bytes * ROWS));
    float *x = malloc(sizeof(float) * (size_t)cols), out[ROWS];
    bench_random_weights(w, qtype, ROWS, cols);
    for (int i = 0; i < cols; i++) x[i] = (float)rand() / (float)RAND_MAX - 0.5f;
    st_act act;
    if (st_act_alloc(&act, 1, cols, st_act_kind(qtype)) != 0) return 1;
    st_act_fill(&act, x, cols, 0, 1);
    const struct ggml_type_traits_cpu *tt = ggml_get_type_traits_cpu((enum ggml_type)qtype);
    const enum ggml_type vt = tt->vec_dot_type;
    uint8_t *a = malloc(ggml_row_size(vt, cols));
    ggml_get_type_traits_cpu(vt)->from_float(x, a, cols);
    double best[2] = {1e30, 1e30};
    float check[2] = {0, 0};
    for (int round = 0; round < ROUNDS; round++) {
        double t0 = bench_now();
        if (!st_fused_rows(qtype, w, row_bytes, cols, 0, ROWS, &act, NULL, 0, 1, out, ROWS)) {
            fprintf(stderr, "st_fused_rows has no rows for type %d\n", qtype);
            return 1;
        }
        double dt = bench_now() - t0;
        best[0] = dt < best[0] ? dt : best[0];
        check[0] += out[7];
        t0 = bench_now();
        for (int r = 0; r < ROWS; r++)
            tt->vec_dot(cols, &out[r], 0, w + r * row_bytes, 0, a, 0, 1);
        dt = bench_now() - t0;
        best[1] = dt < best[1] ? dt : best[1];
        check[1] += out[7];
    }
    printf("type %d, %d cols: strata %.1f ns/row, llama.cpp %.1f (strata / llama.cpp %.3f; "
           "check %g %g)\n", qtype, cols, best[0] / ROWS * 1e9, best[1] / ROWS * 1e9,
           best[0] / best[1], check[0], check[1]);
    return 0;
}
