/* Threaded matmul on quantised weights: activation quantisation, row-block unpacking, the
 * tile loop (4 weight rows x 4 tokens per register tile) and the OpenMP work split. The
 * k-quants skip the unpacking and the tiles: their rows (fused_k.c) take every token count. */
#include <float.h>
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include "pool_sync.h"
#include "quant.h"
#include "tiles.h"
#ifdef _OPENMP
#include <omp.h>
#endif

#define ROW_BLOCK 16        /* weight rows unpacked together (they stay in L1 across tokens) */
/* Fewer tokens than this take the fused kernels in groups of 3 (fused_groups) instead of
 * unpacking the row block into tiles (the 32-column block types and the grid i-quants). With
 * AVX-512 VNNI the fused rows keep 4 rows x 3 tokens in registers and win up to 8 tokens
 * (H200 host). AVX2's fused rows (16 registers) take 3
 * tokens one or two rows at a time, so there the 4 x 4 tiles won from 4 tokens:
 * bench_pool_kernel.py --rows-per-expert at 2 threads on an AVX2 EPYC, experts/s, medians of 3
 * alternating, 9 -> 4: Q4_0 4 / 8 rows 1,665 -> 1,844 / 904 -> 1,193, Q8_0 1,630 -> 1,827 /
 * 946 -> 1,183, Q4_K 1,715 -> 1,586 / 854 -> 1,018 (4 rows within the machine's spread).
 * FUSED_ONE_PASS tokens are one call, not groups: AVX2's Q4_0 / Q8_0 rows take 4 tokens a row
 * in one pass (for the other types st_fused_rows refuses 4, so they keep the tiles; the
 * k-quants' rows took 4 that way too until session 99 gave them every count). Session 97, the
 * same EPYC: the pool's kernel at 4 rows an expert Q4_0 1,100-1,160 -> 1,424-1,430 experts/s
 * on 1 thread, 2,025-2,048 -> 2,504-2,700 on 2, Q8_0 917-1,037 ->
 * 1,399-1,440 and 1,555-1,916 -> 2,479-2,611; medians of 3 rounds Q4_K 827 -> 1,060 and
 * 1,374 -> 2,166, Q5_K 760 -> 945 and 1,222 -> 1,734, Q6_K 869 -> 940 and 1,478 -> 1,818.
 * `strata bench --device cpu -t 2 -np 4` (the dense products of 4 slots) on 8-layer
 * qwen3-30b-a3b synths, tg32 x4: Q4_0 45.5 -> 50.0 tokens/s (medians of 7 alternating pairs),
 * Q4_K 28.8 -> 36.5 (3 pairs). */
#if defined(ST_USE_VNNI512)
#define FUSED_MAX_TOKENS 9
#define FUSED_ONE_PASS 0
#else
#define FUSED_MAX_TOKENS 5
#define FUSED_ONE_PASS 4
#endif
#define TOKEN_CHUNK 128     /* activation rows per work item when T is large */

static int g_num_threads = 0;   /* 0: OpenMP's default */

void st_set_num_threads(int n) { g_num_threads = n > 0 ? n : 0; }

int st_get_num_threads(void) {
#ifdef _OPENMP
    return g_num_threads > 0 ? g_num_threads : omp_get_max_threads();
#else
    return 1;
#endif
}

const char *st_simd_level(void) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    return "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
    return "avx2";
#elif defined(__ARM_NEON) && defined(__aarch64__)
    return "neon";
#else
    return "scalar";
#endif
}

void *st_alloc64(size_t num_bytes) {
    size_t rounded = (num_bytes + 63) / 64 * 64;
    return aligned_alloc(64, rounded > 0 ? rounded : 64);
}

/* ---- kept blocks: a window's biggest buffers, reused by the next window ---------------- */
/* The MoE block's G, U and Y (tens of MB for a 512-token prompt chunk) come from here: a
 * block handed back is kept (at most ST_KEPT_BLOCKS of them, each at most ST_KEPT_MAX_BYTES)
 * for the next call that fits in it, on any thread, instead of going back to the C library.
 * glibc returns blocks this big to the kernel (unmapped above its mmap threshold, a trimmed heap
 * top below it, a thread arena's extra heap unmapped once empty), so every window's pages came
 * back zeroed and faulted in again: `perf` put the kernel's `clear_page_erms` at 6% of a CPU
 * prompt, ~14,000-21,000 minor faults a 512-row call at Qwen3-30B-A3B's expert shape, ~800 now
 * (the activations' smaller buffers). Two blocks: the CPU pool keeps two layers' calls alive. */
#define ST_KEPT_BLOCKS 2
static struct { void *p; size_t bytes; } g_kept[ST_KEPT_BLOCKS];
static atomic_flag g_kept_lock = ATOMIC_FLAG_INIT;

static void kept_lock(void) {
    while (atomic_flag_test_and_set_explicit(&g_kept_lock, memory_order_acquire)) st_cpu_relax();
}

static void kept_unlock(void) { atomic_flag_clear_explicit(&g_kept_lock, memory_order_release); }

void *st_block_take(size_t bytes, size_t *capacity) {
    void *p = NULL;
    size_t got = 0;
    kept_lock();
    int best = -1;     /* the smallest kept block that fits */
    for (int i = 0; i < ST_KEPT_BLOCKS; i++)
        if (g_kept[i].p && g_kept[i].bytes >= bytes
                && (best < 0 || g_kept[i].bytes < g_kept[best].bytes))
            best = i;
    if (best >= 0) {
        p = g_kept[best].p;
        got = g_kept[best].bytes;
        g_kept[best].p = NULL;
        g_kept[best].bytes = 0;
    }
    kept_unlock();
    if (!p) {
        p = st_alloc64(bytes);
        got = p ? bytes : 0;
    }
    *capacity = got;
    return p;
}

void st_block_give(void *p, size_t capacity) {
    if (!p) return;
    if (capacity > ST_KEPT_MAX_BYTES) {
        free(p);
        return;
    }
    void *dropped = p;  /* freed after the lock: this block, or the smallest kept one */
    kept_lock();
    int slot = -1;
    for (int i = 0; i < ST_KEPT_BLOCKS && slot < 0; i++)
        if (!g_kept[i].p) slot = i;
    if (slot < 0) {
        slot = 0;
        for (int i = 1; i < ST_KEPT_BLOCKS; i++)
            if (g_kept[i].bytes < g_kept[slot].bytes) slot = i;
        if (g_kept[slot].bytes >= capacity) slot = -1;
    }
    if (slot >= 0) {
        dropped = g_kept[slot].p;
        g_kept[slot].p = p;
        g_kept[slot].bytes = capacity;
    }
    kept_unlock();
    free(dropped);
}

/* ---- activations -------------------------------------------------------------------- */

static void act_shape(st_act *a, int64_t num_rows, int cols, int kind) {
    memset(a, 0, sizeof(*a));
    a->is_quant = kind;
    a->cols = cols;
    a->cols_pad = kind ? (cols + ST_PAD - 1) / ST_PAD * ST_PAD : (cols + 15) / 16 * 16;
    a->num_rows = num_rows;
}

/* The parts of an act, 64-byte aligned each: Q8 q, dx, xc, xs; K q, dk, bs; float xf */
static void act_parts(const st_act *a, size_t bytes[4]) {
    const size_t n = (size_t)a->num_rows * (size_t)a->cols_pad;
    bytes[1] = bytes[2] = bytes[3] = 0;
    if (a->is_quant == ST_ACT_Q8) {
        bytes[0] = n;
        bytes[1] = n / ST_LANE * sizeof(float);
        bytes[2] = n / ST_LANE * sizeof(int32_t);
        bytes[3] = n / ST_GROUP * sizeof(float);
    } else if (a->is_quant == ST_ACT_K) {
        bytes[0] = n;
        bytes[1] = (n + 255) / 256 * sizeof(float);
        bytes[2] = n / ST_GROUP * sizeof(int16_t);
    } else {
        bytes[0] = n * sizeof(float);
    }
    for (int i = 0; i < 4; i++) bytes[i] = (bytes[i] + 63) / 64 * 64;
}

/* the parts' pointers at p, p + bytes[0], ... (p: one range, or NULL to allocate each) */
static int act_set(st_act *a, const size_t bytes[4], char *p) {
    void *part[4];
    size_t at = 0;
    for (int i = 0; i < 4; i++) {
        part[i] = !bytes[i] ? NULL : p ? (void *)(p + at) : st_alloc64(bytes[i]);
        at += bytes[i];
        if (bytes[i] && !part[i]) {
            for (int j = 0; j < i; j++) free(part[j]);
            return -1;
        }
    }
    if (a->is_quant == ST_ACT_Q8) {
        a->q = part[0]; a->dx = part[1]; a->xc = part[2]; a->xs = part[3];
    } else if (a->is_quant == ST_ACT_K) {
        a->q = part[0]; a->dk = part[1]; a->bs = part[2];
    } else {
        a->xf = part[0];
    }
    return 0;
}

size_t st_act_bytes(int64_t num_rows, int cols, int kind) {
    st_act a;
    size_t bytes[4];
    act_shape(&a, num_rows, cols, kind);
    act_parts(&a, bytes);
    return bytes[0] + bytes[1] + bytes[2] + bytes[3];
}

void st_act_place(st_act *a, int64_t num_rows, int cols, int kind, void *mem) {
    size_t bytes[4];
    act_shape(a, num_rows, cols, kind);
    act_parts(a, bytes);
    act_set(a, bytes, mem);
}

int st_act_alloc(st_act *a, int64_t num_rows, int cols, int kind) {
    size_t bytes[4];
    act_shape(a, num_rows, cols, kind);
    act_parts(a, bytes);
    return act_set(a, bytes, NULL);
}

void st_act_free(st_act *a) {
    free(a->q); free(a->dx); free(a->xc); free(a->xs); free(a->dk); free(a->bs); free(a->xf);
    a->q = NULL; a->dx = NULL; a->xc = NULL; a->xs = NULL; a->dk = NULL; a->bs = NULL;
    a->xf = NULL;
}

#if defined(__AVX2__)
#include <immintrin.h>
/* One 32-column block of quantize_row in AVX2, bit for bit the scalar loop's: the same max,
 * scale and products, cvtps rounding half to even as lrintf does; a block with a NaN or inf
 * gets d = NaN and q = 0 as there. Writes the block's 32 q and returns d; lane_sum [8] = the
 * sums of q per 4 columns. */
static inline float quantize_block_avx2(const float *xb, int8_t *qb, int32_t *lane_sum) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256 v0 = _mm256_loadu_ps(xb), v1 = _mm256_loadu_ps(xb + 8);
    const __m256 v2 = _mm256_loadu_ps(xb + 16), v3 = _mm256_loadu_ps(xb + 24);
    const __m256 a0 = _mm256_andnot_ps(sign, v0), a1 = _mm256_andnot_ps(sign, v1);
    const __m256 a2 = _mm256_andnot_ps(sign, v2), a3 = _mm256_andnot_ps(sign, v3);
    /* max_ps drops a NaN operand: find NaN and inf (not <= FLT_MAX, unordered) apart */
    const __m256 big = _mm256_set1_ps(FLT_MAX);
    const __m256 bad = _mm256_or_ps(
        _mm256_or_ps(_mm256_cmp_ps(a0, big, _CMP_NLE_UQ), _mm256_cmp_ps(a1, big, _CMP_NLE_UQ)),
        _mm256_or_ps(_mm256_cmp_ps(a2, big, _CMP_NLE_UQ), _mm256_cmp_ps(a3, big, _CMP_NLE_UQ)));
    if (_mm256_movemask_ps(bad)) {
        memset(qb, 0, ST_XBLOCK);
        memset(lane_sum, 0, 8 * sizeof(int32_t));
        return NAN;
    }
    __m256 a = _mm256_max_ps(_mm256_max_ps(a0, a1), _mm256_max_ps(a2, a3));
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    const float d = _mm_cvtss_f32(m) / 127.0f;
    const __m256 id = _mm256_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
    const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, id));
    const __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, id));
    const __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, id));
    const __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, id));
    /* packs work per 128-bit half: bytes come out in the 4-byte order 0 2 4 6 1 3 5 7 */
    const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
    const __m256i q = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)qb, q);
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i pa = _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm256_castsi256_si128(q)), ones);
    const __m256i pb = _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm256_extracti128_si256(q, 1)),
                                         ones);                        /* [8] pair sums each */
    const __m256i h = _mm256_hadd_epi32(pa, pb);                        /* lanes 0 1 4 5 2 3 6 7 */
    _mm256_storeu_si256((__m256i *)lane_sum,
                        _mm256_permutevar8x32_epi32(h, _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7)));
    return d;
}
#endif

/* Quantise one row like llama.cpp's Q8_0: per 32 columns, dx = max|x| / 127, q = round(x / dx).
 * A block holding a NaN or inf gets dx = NaN (and q = 0): every product with it is NaN, so a
 * non-finite activation reaches its row's results (and the sampler's check) on every path,
 * where the max (which skips NaN) made a finite dx and the NaN a stray -128 or 0. */
static void quantize_row(const float *x, int cols, int cols_pad, int8_t *q, float *dx,
                         int32_t *xc, float *xs) {
    for (int b = 0; b < cols / ST_XBLOCK; b++) {
        const float *xb = x + b * ST_XBLOCK;
#if defined(__AVX2__) && ST_XBLOCK == 32 && ST_LANE == 4 && ST_GROUP == 16
        {
            int32_t lane_sum[8];
            const float d = quantize_block_avx2(xb, q + b * ST_XBLOCK, lane_sum);
            const __m256i sums = _mm256_loadu_si256((const __m256i *)lane_sum);
            _mm256_storeu_ps(dx + b * 8, _mm256_set1_ps(d));
            _mm256_storeu_si256((__m256i *)(xc + b * 8),
                                _mm256_mullo_epi32(sums, _mm256_set1_epi32(-ST_XC_BIAS)));
            xs[b * 2] = d * (float)(lane_sum[0] + lane_sum[1] + lane_sum[2] + lane_sum[3]);
            xs[b * 2 + 1] = d * (float)(lane_sum[4] + lane_sum[5] + lane_sum[6] + lane_sum[7]);
            continue;
        }
#endif
        float amax = 0.0f;
        int is_finite = 1;
        /* a plain compare (not fmaxf, a libm call without -ffinite-math-only) vectorises */
        for (int i = 0; i < ST_XBLOCK; i++) {
            float v = fabsf(xb[i]);
            amax = v > amax ? v : amax;
            is_finite &= v <= FLT_MAX;     /* false for NaN and inf */
        }
        float d = is_finite ? amax / 127.0f : NAN;
        float id = d > 0.0f ? 1.0f / d : 0.0f;
        int8_t *qb = q + b * ST_XBLOCK;
        for (int i = 0; i < ST_XBLOCK; i++) qb[i] = is_finite ? (int8_t)lrintf(xb[i] * id) : 0;
        for (int l = 0; l < ST_XBLOCK / ST_LANE; l++) {
            int lane = b * (ST_XBLOCK / ST_LANE) + l;
            const int8_t *ql = qb + l * ST_LANE;
            dx[lane] = d;
            xc[lane] = -ST_XC_BIAS * ((int32_t)ql[0] + ql[1] + ql[2] + ql[3]);
        }
        for (int g = 0; g < ST_XBLOCK / ST_GROUP; g++) {
            int32_t sum = 0;
            for (int i = 0; i < ST_GROUP; i++) sum += qb[g * ST_GROUP + i];
            xs[b * (ST_XBLOCK / ST_GROUP) + g] = d * (float)sum;
        }
    }
    memset(q + cols, 0, (size_t)(cols_pad - cols));
    for (int l = cols / ST_LANE; l < cols_pad / ST_LANE; l++) { dx[l] = 0.0f; xc[l] = 0; }
    for (int g = cols / ST_GROUP; g < cols_pad / ST_GROUP; g++) xs[g] = 0.0f;
}

/* Quantise one row like llama.cpp's Q8_K: per 256 columns (a k-quant super-block), dk = max|x|
 * / 127, q = round(x / dk); bs = the sum of q per 16 columns. A super-block holding a NaN or inf
 * gets dk = NaN and q = 0, as quantize_row's blocks. */
static void quantize_row_k(const float *x, int cols, int cols_pad, int8_t *q, float *dk,
                           int16_t *bs) {
    for (int b = 0; b * 256 < cols_pad; b++) {
        const int n = cols - b * 256 < 256 ? (cols - b * 256 > 0 ? cols - b * 256 : 0) : 256;
        const float *xb = x + b * 256;
        int8_t *qb = q + b * 256;
        float amax = 0.0f;
        int is_finite = 1;
        for (int i = 0; i < n; i++) {
            float v = fabsf(xb[i]);
            amax = v > amax ? v : amax;
            is_finite &= v <= FLT_MAX;
        }
        const float d = is_finite ? amax / 127.0f : NAN;
        const float id = d > 0.0f ? 1.0f / d : 0.0f;
        for (int i = 0; i < n; i++) qb[i] = is_finite ? (int8_t)lrintf(xb[i] * id) : 0;
        const int width = cols_pad - b * 256 < 256 ? cols_pad - b * 256 : 256;
        for (int i = n; i < width; i++) qb[i] = 0;
        dk[b] = d;
        for (int g = 0; g < width / ST_GROUP; g++) {
            int32_t sum = 0;
            for (int i = 0; i < ST_GROUP; i++) sum += qb[g * ST_GROUP + i];
            bs[b * (256 / ST_GROUP) + g] = (int16_t)sum;
        }
    }
}

void st_act_fill(st_act *a, const float *x, int64_t ld_x, int64_t r0, int64_t r1) {
    const int ncp = a->cols_pad;
    for (int64_t r = r0; r < r1; r++) {
        if (a->is_quant == ST_ACT_K) {
            quantize_row_k(x + r * ld_x, a->cols, ncp, a->q + r * ncp,
                           a->dk + r * ((ncp + 255) / 256), a->bs + r * (ncp / ST_GROUP));
        } else if (a->is_quant) {
            quantize_row(x + r * ld_x, a->cols, ncp, a->q + r * ncp, a->dx + r * (ncp / ST_LANE),
                         a->xc + r * (ncp / ST_LANE), a->xs + r * (ncp / ST_GROUP));
        } else {
            float *dst = a->xf + r * ncp;
            memcpy(dst, x + r * ld_x, (size_t)a->cols * sizeof(float));
            for (int i = a->cols; i < ncp; i++) dst[i] = 0.0f;
        }
    }
}

/* ---- one row block x a token range ------------------------------------------------- */

size_t st_scratch_bytes(int qtype, int cols) {
    int ncp = st_cols_pad(qtype, cols);
    if (st_is_float_type(qtype)) return (size_t)ROW_BLOCK * ncp * sizeof(float);
    /* s (1 byte) + A (4 bytes per 4 columns) + B (4 bytes per 16 columns) per column */
    return (size_t)ROW_BLOCK * ((size_t)ncp * 2 + (size_t)ncp / ST_GROUP * sizeof(float));
}

static inline int64_t tok_row(const int32_t *tok, int64_t tok0, int64_t j) {
    return tok ? (int64_t)tok[j] : tok0 + j;
}

/* Tokens [0, n_tok) through the fused kernels (1-3 tokens a call, straight from the blocks), in
 * groups of 3 (FUSED_ONE_PASS tokens in one call): the first group reads the row block from RAM,
 * the others from L1. 0 when this
 * type or build has no fused path (known from the first call: the same type every call). The
 * lane arithmetic is the tiles' (quant.h), so the grouping does not change a token's result. */
static int fused_groups(int qtype, const uint8_t *w, int64_t row_bytes, int cols, int64_t rb,
                        int nr, const st_act *act, const int32_t *tok, int64_t tok0,
                        int64_t n_tok, float *out, int64_t ld_out) {
    for (int64_t j = 0, g; j < n_tok; j += g) {
        g = n_tok == FUSED_ONE_PASS ? n_tok : n_tok - j < 3 ? n_tok - j : 3;
        if (!st_fused_rows(qtype, w, row_bytes, cols, rb, nr, act, tok ? tok + j : NULL,
                           tok0 + j, g, out + j * ld_out, ld_out))
            return 0;
    }
    return 1;
}

/* Rows [rb, rb + nr) (nr <= ROW_BLOCK) against tokens j in [0, n_tok):
 * out[j * ld_out + i] for row rb + i. */
static void gemm_block(int qtype, const uint8_t *w, int64_t row_bytes, int cols, int64_t rb,
                       int nr, const st_act *act, const int32_t *tok, int64_t tok0,
                       int64_t n_tok, float *out, int64_t ld_out, void *scratch) {
    const int ncp = act->cols_pad;
    float res[16];
    if (act->is_quant == ST_ACT_K) {
        /* the k-quants: their rows 4 tokens at a time at every count (fused_k.c), each row's
         * decoding shared by the 4, the row block in L1 from the second group on; 1.6x the
         * unpacked tiles at 64 tokens (Q4_K, one thread, AVX2 EPYC) */
        /* the grid i-quants' rows decoded once for 8 tokens and more (their grid lookups
         * cost a pass more than its products; the same bits as the rows: fused_iq.c) */
        const int unpacked = n_tok >= 8
            && st_iq_unpack_rows(qtype, w, row_bytes, cols, rb, nr, scratch);
        for (int64_t j = 0; j < n_tok; j += 4) {
            const int g = n_tok - j < 4 ? (int)(n_tok - j) : 4;
            if (unpacked)
                st_iq_unpacked_rows(scratch, cols, nr, act, tok ? tok + j : NULL, tok0 + j, g,
                                    out + j * ld_out, ld_out);
            else
                st_fused_k_rows(qtype, w, row_bytes, cols, rb, nr, act, tok ? tok + j : NULL,
                                tok0 + j, g, out + j * ld_out, ld_out);
        }
        return;
    }
    if (!act->is_quant) {
        if (n_tok < 4 && st_fused_float_rows(qtype, w, row_bytes, cols, rb, nr, act, tok, tok0,
                                             n_tok, out, ld_out))
            return;
        float *wf = scratch;                                     /* [ROW_BLOCK, ncp] */
        for (int i = 0; i < nr; i++)
            st_unpack_row_float(qtype, w + (rb + i) * row_bytes, cols, ncp, wf + (size_t)i * ncp);
        st_ftile t;
        t.cols_pad = ncp;
        int64_t j = 0;
        for (; j < n_tok; j += 4) {
            int nc = n_tok - j >= 4 ? 4 : 1;
            if (nc == 1) {
                /* fewer than 4 tokens left: one at a time */
                for (; j < n_tok; j++) {
                    t.x[0] = act->xf + tok_row(tok, tok0, j) * ncp;
                    int r = 0;
                    for (; r + 4 <= nr; r += 4) {
                        for (int i = 0; i < 4; i++) t.w[i] = wf + (size_t)(r + i) * ncp;
                        st_ftile_4x1(&t, res);
                        for (int i = 0; i < 4; i++) out[j * ld_out + r + i] = res[i * 4];
                    }
                    for (; r < nr; r++) {
                        t.w[0] = wf + (size_t)r * ncp;
                        st_ftile_1x1(&t, res);
                        out[j * ld_out + r] = res[0];
                    }
                }
                break;
            }
            for (int c = 0; c < 4; c++) t.x[c] = act->xf + tok_row(tok, tok0, j + c) * ncp;
            int r = 0;
            for (; r + 4 <= nr; r += 4) {
                for (int i = 0; i < 4; i++) t.w[i] = wf + (size_t)(r + i) * ncp;
                st_ftile_4x4(&t, res);
                for (int i = 0; i < 4; i++)
                    for (int c = 0; c < 4; c++) out[(j + c) * ld_out + r + i] = res[i * 4 + c];
            }
            for (; r < nr; r++) {
                t.w[0] = wf + (size_t)r * ncp;
                st_ftile_1x4(&t, res);
                for (int c = 0; c < 4; c++) out[(j + c) * ld_out + r] = res[c];
            }
        }
        return;
    }

    if (n_tok < FUSED_MAX_TOKENS && fused_groups(qtype, w, row_bytes, cols, rb, nr, act, tok,
                                                 tok0, n_tok, out, ld_out))
        return;
    uint8_t *s = scratch;                                        /* [ROW_BLOCK, ncp] */
    float *A = (float *)(s + (size_t)ROW_BLOCK * ncp);           /* [ROW_BLOCK, ncp / 4] */
    float *B = A + (size_t)ROW_BLOCK * ncp / ST_LANE;            /* [ROW_BLOCK, ncp / 16] */
    for (int i = 0; i < nr; i++) {
        /* decode on a path with no fused kernel (the scalar and NEON builds' 32-column types)
         * reads from RAM as the fused kernels do: ask for the row ST_PREFETCH_ROWS ahead */
        st_prefetch(w + (rb + i + ST_PREFETCH_ROWS) * row_bytes, row_bytes);
        st_unpack_row(qtype, w + (rb + i) * row_bytes, cols, ncp, s + (size_t)i * ncp,
                      A + (size_t)i * ncp / ST_LANE, B + (size_t)i * ncp / ST_GROUP);
    }
    st_qtile t;
    t.cols_pad = ncp;
    t.has_min = st_has_min(qtype);
#define SET_ROW(slot, row) do { \
        t.s[slot] = s + (size_t)(row) * ncp; \
        t.A[slot] = A + (size_t)(row) * ncp / ST_LANE; \
        t.B[slot] = B + (size_t)(row) * ncp / ST_GROUP; } while (0)
#define SET_TOK(slot, tr) do { \
        int64_t tr_ = (tr); \
        t.q[slot] = act->q + tr_ * ncp; \
        t.dx[slot] = act->dx + tr_ * (ncp / ST_LANE); \
        t.xc[slot] = act->xc + tr_ * (ncp / ST_LANE); \
        t.xs[slot] = act->xs + tr_ * (ncp / ST_GROUP); } while (0)
    int64_t j = 0;
    for (; j + 4 <= n_tok; j += 4) {
        for (int c = 0; c < 4; c++) SET_TOK(c, tok_row(tok, tok0, j + c));
        int r = 0;
        for (; r + 4 <= nr; r += 4) {
            for (int i = 0; i < 4; i++) SET_ROW(i, r + i);
            st_qtile_4x4(&t, res);
            for (int i = 0; i < 4; i++)
                for (int c = 0; c < 4; c++) out[(j + c) * ld_out + r + i] = res[i * 4 + c];
        }
        for (; r < nr; r++) {
            SET_ROW(0, r);
            st_qtile_1x4(&t, res);
            for (int c = 0; c < 4; c++) out[(j + c) * ld_out + r] = res[c];
        }
    }
    for (; j < n_tok; j++) {
        SET_TOK(0, tok_row(tok, tok0, j));
        int r = 0;
        for (; r + 4 <= nr; r += 4) {
            for (int i = 0; i < 4; i++) SET_ROW(i, r + i);
            st_qtile_4x1(&t, res);
            for (int i = 0; i < 4; i++) out[j * ld_out + r + i] = res[i * 4];
        }
        for (; r < nr; r++) {
            SET_ROW(0, r);
            st_qtile_1x1(&t, res);
            out[j * ld_out + r] = res[0];
        }
    }
#undef SET_ROW
#undef SET_TOK
}

void st_gemm_rows(int qtype, const uint8_t *w, int64_t row_bytes, int cols,
                  int64_t r0, int64_t r1, const st_act *act, const int32_t *tok, int64_t n_tok,
                  float *out, int64_t ld_out, void *scratch) {
    for (int64_t rb = r0; rb < r1; rb += ROW_BLOCK) {
        int nr = r1 - rb < ROW_BLOCK ? (int)(r1 - rb) : ROW_BLOCK;
        gemm_block(qtype, w, row_bytes, cols, rb, nr, act, tok, 0, n_tok, out + (rb - r0),
                   ld_out, scratch);
    }
}

/* ---- the threaded matmul ------------------------------------------------------------- */

int st_matmul(int qtype, const uint8_t *w, int64_t rows, int64_t row_bytes, int cols,
              const float *x, int64_t T, float *out) {
    st_act act;
    if (st_act_alloc(&act, T, cols, st_act_kind(qtype)) != 0) return -1;
    const int64_t num_row_blocks = (rows + ROW_BLOCK - 1) / ROW_BLOCK;
    const int64_t num_tok_chunks = (T + TOKEN_CHUNK - 1) / TOKEN_CHUNK;
    const int64_t num_items = num_row_blocks * num_tok_chunks;
    const size_t scratch_bytes = st_scratch_bytes(qtype, cols);
    int failed = 0;
    /* a few rows are quicker filled here than behind one more barrier of the team */
    const int is_small = T * (int64_t)cols <= 16384;
    if (is_small) st_act_fill(&act, x, cols, 0, T);
    /* waking the team costs microseconds (much more on a busy machine): small products
     * run on the calling thread */
    const int is_parallel = num_items > 1 && (double)rows * cols * T >= ST_MIN_PARALLEL_MACS;
    const int nth = st_get_num_threads(), grab = st_grab(num_items, nth);
    #pragma omp parallel num_threads(nth) reduction(|:failed) if (is_parallel)
    {
        if (!is_small) {
            #pragma omp for schedule(static)
            for (int64_t r = 0; r < T; r++) st_act_fill(&act, x, cols, r, r + 1);
        }
        void *scratch = st_alloc64(scratch_bytes);
        if (!scratch) failed = 1;
        /* an item is (token chunk, row block); consecutive items share a token chunk */
        #pragma omp for schedule(dynamic, grab)
        for (int64_t item = 0; item < num_items; item++) {
            if (!scratch) continue;
            int64_t tc = item / num_row_blocks;
            int64_t rb = (item % num_row_blocks) * ROW_BLOCK;
            int64_t t0 = tc * TOKEN_CHUNK;
            int64_t nt = T - t0 < TOKEN_CHUNK ? T - t0 : TOKEN_CHUNK;
            int nr = rows - rb < ROW_BLOCK ? (int)(rows - rb) : ROW_BLOCK;
            gemm_block(qtype, w, row_bytes, cols, rb, nr, &act, NULL, t0, nt,
                       out + t0 * rows + rb, rows, scratch);
        }
        free(scratch);
    }
    st_act_free(&act);
    return failed ? -1 : 0;
}

/* ---- rmsnorm ------------------------------------------------------------------------ */

void st_rmsnorm(const float *x, const float *w, float eps, int64_t T, int H, float *out) {
    #pragma omp parallel for num_threads(st_get_num_threads()) schedule(static) if (T > 4)
    for (int64_t t = 0; t < T; t++) {
        const float *xr = x + t * H;                               /* [H] */
        float *yr = out + t * H;
        double sum_sq = 0.0;
        for (int i = 0; i < H; i++) sum_sq += (double)xr[i] * xr[i];
        /* like transformers: x * rsqrt(mean(x^2) + eps), then times the weight */
        float scale = 1.0f / sqrtf((float)(sum_sq / H) + eps);
        for (int i = 0; i < H; i++) yr[i] = w[i] * (xr[i] * scale);
    }
}
