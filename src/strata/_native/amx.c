/* Products of Q4_0 / Q8_0 weight rows with many activation rows on Intel AMX (AMX-BF16:
 * Sapphire Rapids and later Xeons), for the CPU pool's prompt-window calls, where an expert
 * gets tens of rows: the lane tiles (tiles.c) cost ~20 thread-us a row there, so the pool could
 * take only the rarely routed experts and left the others to the PCIe link (docs/offload.md,
 * "AMX-BF16 rows").
 *
 * Weights are dequantised to bf16 once per call (the scale folded in, one rounding), so the
 * tiles accumulate in fp32 across the whole row with no per-block scaling; session 32's
 * AMX-INT8 rows (reverted) spent their time scaling every block's int32 tile instead.
 *
 * Per 16 weight rows (a group g) and 16 tokens (a token tile i), per 32 columns s:
 *   C[g, i] [16 rows, 16 tokens] fp32 += W_g,s [16 rows, 32 bf16] . X_s,i [32, 16 tokens] bf16
 * with 4 C tiles in flight: 4 groups x 1 token tile, 2 x 2, or 1 x up to 4 (st_amx_rows).
 * W_g,s goes to tile A row-major (the groups dequantised first, [S][16][32] bf16 each);
 * the activations to tile B in the VNNI layout, packed once per expert by st_amx_pack:
 *   packed[((tile * S + s) * 16 + r) * 32 + 2 * c + b] = bf16(x[16 * tile + c][32 * s + 2 * r + b])
 * A token's result does not depend on the other tokens (each C column sums its own products),
 * but it differs from the lane tiles' in the last bits (bf16 rounding of weights and
 * activations): only callers that allow it take this path (the CPU pool, not the CPU backend's
 * batch-invariant layers).
 *
 * ST_AMX_EMULATE (tests/native/amx_check.c, for machines without AMX) swaps the tile operations
 * for C; the dequantisation and packing stay this file's AVX-512 code. */
#define _GNU_SOURCE   /* syscall() */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "quant.h"

#if defined(__x86_64__) && defined(__GNUC__) && __GNUC__ >= 12 && !defined(__clang__)
#define ST_AMX_BUILD 1
#endif

#if defined(ST_AMX_BUILD) || defined(ST_AMX_EMULATE)
#include <cpuid.h>
#include <immintrin.h>

#define GROUP_ROWS 16    /* weight rows per tile (C rows) */
#define TILE_TOKENS 16   /* tokens per tile (C columns) */
#define STEP_COLS 32     /* columns per tile step (bf16 pairs: 16 rows of B) */
#define TILE_BYTES 1024  /* every tile here: 16 rows of 64 bytes */
#define MAX_TILES 4      /* token tiles in flight (C tiles 0-3) */
#define MAX_GROUPS 4     /* row groups in flight (C tiles 0-3, with one token tile) */

#define SIMD_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,f16c")))

#ifdef ST_AMX_EMULATE
#define AMX_TARGET SIMD_TARGET
static __thread float emu_c[MAX_TILES][GROUP_ROWS][TILE_TOKENS];
static __thread uint16_t emu_t[8][16][32];   /* tiles 4-7: A [16 rows, 32 bf16] or B (VNNI) */
static float emu_bf16(uint16_t h) {
    union { uint32_t u; float f; } v = {(uint32_t)h << 16};
    return v.f;
}
static void amx_configure(void) {}
static void amx_release(void) {}
#define tile_zero_c(i) memset(emu_c[i], 0, sizeof emu_c[i])
#define tile_load(t, p) memcpy(emu_t[t], (p), sizeof emu_t[t])
static void emu_dp(int c, int a, int b) {   /* C[c] += A[a] . B[b] */
    for (int m = 0; m < GROUP_ROWS; m++)
        for (int t = 0; t < TILE_TOKENS; t++) {
            float acc = emu_c[c][m][t];
            for (int r = 0; r < STEP_COLS / 2; r++)
                acc += emu_bf16(emu_t[a][m][2 * r]) * emu_bf16(emu_t[b][r][2 * t])
                       + emu_bf16(emu_t[a][m][2 * r + 1]) * emu_bf16(emu_t[b][r][2 * t + 1]);
            emu_c[c][m][t] = acc;
        }
}
#define tile_dp(c, a, b) emu_dp(c, a, b)
#define tile_store_c(i, p) memcpy((p), emu_c[i], sizeof emu_c[i])
static int cpu_ready(void) {
    unsigned a, b, c, d;
    return __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a & (1u << 5));   /* AVX512_BF16 */
}
#else
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_TARGET \
    __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16,f16c")))
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_tilecfg;

/* tiles 0-3: C [16 rows, 16 fp32]; 4 and 6: A [16 rows, 32 bf16]; 5 and 7: B [16, 16 x 2
 * bf16]. The
 * configuration stays loaded between calls: each call reads the thread's configuration back
 * (STTILECFG) and loads its own only when another user of the tiles on this thread changed
 * it. Releasing after every call (amx_release_each, tools/bench_amx.c) measured the same on
 * the H100 host (300 against 302 us a 768 x 2048 matrix at 1 token). */
static int amx_release_each = 0;
AMX_TARGET static void amx_configure(void) {
    amx_tilecfg cfg, now;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    if (!amx_release_each) {
        _tile_storeconfig(&now);
        if (memcmp(&now, &cfg, sizeof cfg) == 0) return;
    }
    _tile_loadconfig(&cfg);
}
AMX_TARGET static void amx_release(void) {
    if (amx_release_each) _tile_release();
}
#define tile_zero_c(i) _tile_zero(i)
#define tile_load(t, p) _tile_loadd(t, (p), 64)
#define tile_dp(c, a, b) _tile_dpbf16ps(c, a, b)
#define tile_store_c(i, p) _tile_stored(i, (p), 64)
static int cpu_ready(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    if (!((d & (1u << 22)) && (d & (1u << 24))         /* AMX-BF16, AMX-TILE */
          && (b & (1u << 16)) && (b & (1u << 30))))    /* AVX512F, AVX512BW */
        return 0;
    if (!__get_cpuid_count(7, 1, &a, &b, &c, &d) || !(a & (1u << 5)))   /* AVX512_BF16 */
        return 0;
    /* Linux >= 5.16 hands out the tile data per process on request */
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}
#endif

/* Can this CPU run the tiles: -1 not asked yet, 0 no, 1 yes. STRATA_AMX=0 turns the path off,
 * read at every call (not cached like the CPU's answer), so a test can turn it off in-process. */
static int amx_state = -1;

int st_amx_available(void) {
    const char *env = getenv("STRATA_AMX");
    if (env && env[0] == '0') return 0;
    int state = __atomic_load_n(&amx_state, __ATOMIC_ACQUIRE);
    if (state >= 0) return state;
    state = cpu_ready();
    __atomic_store_n(&amx_state, state, __ATOMIC_RELEASE);
    return state;
}

int st_amx_takes(int qtype, int cols) {
    return (qtype == ST_Q4_0 || qtype == ST_Q8_0) && cols % STEP_COLS == 0;
}

size_t st_amx_pack_bytes(int64_t n, int cols) {
    return (size_t)((n + TILE_TOKENS - 1) / TILE_TOKENS) * (size_t)(cols / STEP_COLS) * TILE_BYTES;
}

size_t st_amx_scratch_bytes(int cols) {   /* 2 x MAX_GROUPS dequantised groups, 4 C tiles */
    return (size_t)2 * MAX_GROUPS * (cols / STEP_COLS) * TILE_BYTES
           + (size_t)MAX_TILES * TILE_BYTES;
}

/* 32 floats -> 32 bf16 (round to nearest even), as one 64-byte vector */
SIMD_TARGET static inline __m512i to_bf16(__m512 lo, __m512 hi) {
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

/* m [16] rows of 16 dwords -> their transpose in place (m[r][c] = old m[c][r]): pairs of rows
 * interleaved by dword, then by qword (each 128-bit lane then holds a 4 x 4 block), then the
 * lanes gathered across the four groups of rows. */
SIMD_TARGET static inline void transpose16(__m512i m[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(m[i], m[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(m[i], m[i + 1]);
    }
    /* u[4 g + k]: rows 4g..4g+3 of columns k, k + 4, k + 8, k + 12 (one per lane) */
    for (int g = 0; g < 16; g += 4) {
        u[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
        u[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
        u[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
        u[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
    }
    for (int k = 0; k < 4; k++) {
        const __m512i lo01 = _mm512_shuffle_i32x4(u[k], u[4 + k], 0x44);   /* lanes 0, 1 */
        const __m512i hi01 = _mm512_shuffle_i32x4(u[k], u[4 + k], 0xEE);   /* lanes 2, 3 */
        const __m512i lo23 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0x44);
        const __m512i hi23 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0xEE);
        m[k] = _mm512_shuffle_i32x4(lo01, lo23, 0x88);        /* column k: lane 0 of each */
        m[k + 4] = _mm512_shuffle_i32x4(lo01, lo23, 0xDD);    /* column k + 4: lane 1 */
        m[k + 8] = _mm512_shuffle_i32x4(hi01, hi23, 0x88);
        m[k + 12] = _mm512_shuffle_i32x4(hi01, hi23, 0xDD);
    }
}

/* Per token tile and 32-column step: the 16 tokens' columns as 16 bf16 pairs each (one vector
 * per token), transposed so that pair r of all 16 tokens is row r of the tile (64 bytes). */
SIMD_TARGET void st_amx_pack(const float *src, int64_t ld, const int32_t *idx, int64_t n,
                             int cols, uint16_t *dst) {
    const int S = cols / STEP_COLS;
    const int64_t tiles = (n + TILE_TOKENS - 1) / TILE_TOKENS;
    for (int64_t tile = 0; tile < tiles; tile++) {
        uint8_t *blk = (uint8_t *)(dst + (size_t)tile * S * (TILE_BYTES / 2));   /* [S][16][64] */
        const float *x[TILE_TOKENS];   /* each token's row; NULL: a padding token (zeros) */
        for (int c = 0; c < TILE_TOKENS; c++) {
            const int64_t j = tile * TILE_TOKENS + c;
            x[c] = j < n ? src + (idx ? (int64_t)idx[j] : j) * ld : NULL;
        }
        for (int s = 0; s < S; s++) {
            __m512i m[16];
            for (int c = 0; c < TILE_TOKENS; c++)
                m[c] = x[c] ? to_bf16(_mm512_loadu_ps(x[c] + s * STEP_COLS),
                                      _mm512_loadu_ps(x[c] + s * STEP_COLS + 16))
                            : _mm512_setzero_si512();
            transpose16(m);
            for (int r = 0; r < 16; r++)
                _mm512_storeu_si512(blk + ((size_t)s * 16 + r) * 64, m[r]);
        }
    }
}

/* A Q4_0 block's 16 values d (i - 8), i = 0..15 (exact in fp32): the table its nibbles index. */
SIMD_TARGET static inline __m512 q4_0_values(const uint8_t *blk) {
    const __m512 iota = _mm512_set_ps(7, 6, 5, 4, 3, 2, 1, 0, -1, -2, -3, -4, -5, -6, -7, -8);
    uint16_t h;
    memcpy(&h, blk, 2);
    return _mm512_mul_ps(iota, _mm512_set1_ps(_cvtsh_ss(h)));
}

/* A Q4_0 block's 32 nibbles as word indices in its order: words 0-15 the 16 quant bytes' low
 * nibbles (w[j]), words 16-31 their high ones (w[j + 16]). */
SIMD_TARGET static inline __m512i q4_0_nibbles(const uint8_t *blk) {
    const __m512i shift = _mm512_set_epi16(4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4,
                                           0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m256i qs = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(blk + 2)));
    return _mm512_and_si512(_mm512_srlv_epi16(_mm512_cvtepu8_epi16(qs), shift),
                            _mm512_set1_epi16(15));
}

/* Two Q4_0 blocks (blk1 NULL: one) -> 32 bf16 each at out0, out1 (w = d (q - 8), rounded
 * once). Both blocks' 16 values d (i - 8) rounded to bf16 make one 32-word table (block 1's in
 * words 16-31) and one vpermw by nibble gives a block's 32 weights: the same bytes as
 * converting each q and multiplying, in fewer uops (one thread on the CPU machine, a 768 x
 * 2,048 matrix in L2: 99.8 us converting, 82.1 with a vpermps of fp32 values per 16 weights,
 * 67.4 this way). */
SIMD_TARGET static inline void dequant_q4_0_pair(const uint8_t *blk0, const uint8_t *blk1,
                                                 uint16_t *out0, uint16_t *out1) {
    const __m512 v1 = blk1 ? q4_0_values(blk1) : _mm512_setzero_ps();
    const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(v1, q4_0_values(blk0));
    _mm512_store_si512(out0, _mm512_permutexvar_epi16(q4_0_nibbles(blk0), table));
    if (blk1)
        _mm512_store_si512(out1, _mm512_permutexvar_epi16(
            _mm512_or_si512(q4_0_nibbles(blk1), _mm512_set1_epi16(16)), table));
}

/* One 32-column block of a Q8_0 row -> 32 bf16 at out (w = d * q, rounded once). */
SIMD_TARGET static inline void dequant_q8_0(const uint8_t *blk, uint16_t *out) {
    uint16_t h;
    memcpy(&h, blk, 2);
    const __m512 d = _mm512_set1_ps(_cvtsh_ss(h));
    const __m512 lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                          _mm_loadu_si128((const __m128i *)(blk + 2)))), d);
    const __m512 hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                          _mm_loadu_si128((const __m128i *)(blk + 18)))), d);
    _mm512_store_si512(out, to_bf16(lo, hi));
}

/* How far ahead of the block it dequantises a row asks for its weights (into L1): rows are
 * contiguous, so ~2.7 rows of 2,048 Q4_0 columns, reaching into the next block at its end. One
 * thread on the CPU machine (EPYC), a 768 x 2,048 matrix from RAM: 119 -> 78 us (1.5 KB ahead
 * 84, 4-8 KB 80); in L2 no change (67.5). */
#define AMX_PREFETCH_BYTES 3072

/* Steps [s, s + 2) (the last: [s, S)) of one weight row (blocks of bs bytes) -> o + s * step,
 * o the row's place in its group ([S][16][32] bf16); row NULL: a padding row (zeros). */
SIMD_TARGET static inline void dequant_two_steps(int qtype, int bs, const uint8_t *row, int S,
                                                 int s, uint16_t *o) {
    const size_t step = (size_t)GROUP_ROWS * STEP_COLS;   /* bf16 from one step to the next */
    const int two = s + 1 < S;
    if (!row) {
        _mm512_store_si512(o + s * step, _mm512_setzero_si512());
        if (two) _mm512_store_si512(o + (s + 1) * step, _mm512_setzero_si512());
        return;
    }
    const uint8_t *blk = row + (size_t)s * bs;
    _mm_prefetch((const char *)blk + AMX_PREFETCH_BYTES, _MM_HINT_T0);
    if (qtype == ST_Q4_0) {
        dequant_q4_0_pair(blk, two ? blk + bs : NULL, o + s * step,
                          two ? o + (s + 1) * step : NULL);
    } else {
        dequant_q8_0(blk, o + s * step);
        if (two) dequant_q8_0(blk + bs, o + (s + 1) * step);
    }
}

/* A block of weight rows (the row groups of one pass, G x 16 rows) dequantised two steps of a
 * row at a time, so that the next block's runs among the current block's tile products, its
 * AVX-512 work beside theirs (one thread on the CPU machine, a 768 x 2,048 Q4_0 matrix from RAM,
 * tools/bench_amx.c: 32 tokens 220 -> 198 us, 64 324 -> 282, 128 503 -> 410). Rows go in
 * order and steps in order within a row, so the weights are read in address order with the
 * prefetch ahead of them: dequantising a step of every row of the block at once, just before
 * its tiles read it, read the rows side by side and made the pool 10-25% slower. */
typedef struct {
    int qtype, bs, S;          /* the weight type, its block bytes, the row's 32-column steps */
    const uint8_t *w;          /* the block's first row */
    int64_t row_bytes;
    int rows, padded;          /* its rows; rounded up to whole groups */
    uint16_t *wb;              /* [padded / 16][S][16][32] bf16 */
    int row, s;                /* the next two steps to do: of this row, from this step */
    const uint8_t *src;        /* the row's weights (NULL: a padding row) */
    uint16_t *dst;             /* its place in wb */
    int64_t per, rem, acc, steps;   /* units a tile step: per, one more when acc passes steps */
} deq_block;

static inline void deq_row(deq_block *d, int row) {
    const size_t group = (size_t)d->S * GROUP_ROWS * STEP_COLS;
    d->row = row, d->s = 0;
    d->src = row < d->rows ? d->w + (int64_t)row * d->row_bytes : NULL;
    d->dst = d->wb + (size_t)(row / GROUP_ROWS) * group + (size_t)(row % GROUP_ROWS) * STEP_COLS;
}

/* The block of rows [rb, rb + rows) of w into wb, spread over `steps` tile steps (0: none) */
static void deq_start(deq_block *d, int qtype, const uint8_t *w, int64_t row_bytes, int S,
                      int64_t rb, int rows, uint16_t *wb, int64_t steps) {
    d->qtype = qtype, d->bs = st_type_size(qtype), d->S = S;
    d->w = w + rb * row_bytes, d->row_bytes = row_bytes, d->wb = wb;
    d->rows = rows > 0 ? rows : 0;
    d->padded = (d->rows + GROUP_ROWS - 1) / GROUP_ROWS * GROUP_ROWS;
    deq_row(d, 0);
    const int64_t units = (int64_t)d->padded * ((S + 1) / 2);   /* two steps of a row each */
    d->steps = steps > 0 ? steps : 1, d->acc = 0;
    d->per = steps > 0 ? units / steps : 0, d->rem = steps > 0 ? units % steps : 0;
}

SIMD_TARGET static inline void deq_unit(deq_block *d) {
    dequant_two_steps(d->qtype, d->bs, d->src, d->S, d->s, d->dst);
    if ((d->s += 2) >= d->S) deq_row(d, d->row + 1);
}

/* One tile step's share of the block's units */
SIMD_TARGET static inline void deq_step(deq_block *d) {
    int64_t n = d->per;
    if ((d->acc += d->rem) >= d->steps) d->acc -= d->steps, n++;
    for (; n > 0 && d->row < d->padded; n--) deq_unit(d);
}

/* What is left of the block, a row at a time */
SIMD_TARGET static void deq_finish(deq_block *d) {
    while (d->row < d->padded) {
        for (int s = d->s; s < d->S; s += 2)
            dequant_two_steps(d->qtype, d->bs, d->src, d->S, s, d->dst);
        deq_row(d, d->row + 1);
    }
}

/* C tile [16 rows, 16 tokens] at c -> out [token j, rows [row0, row0 + nr)] for the tile's
 * tokens j = tok0 .. < n: transposed in registers, a token's rows stored at once (16.8 -> 5.5
 * us per 768 rows x 64 tokens on the CPU machine, scalar copies before). */
SIMD_TARGET static inline void scatter_tile(const float *c, int64_t tok0, int64_t n, float *out,
                                            int64_t ld_out, int64_t row0, int nr) {
    const __mmask16 rows = (__mmask16)((1u << nr) - 1u);
    __m512i ct[GROUP_ROWS];
    for (int r = 0; r < GROUP_ROWS; r++) ct[r] = _mm512_loadu_si512(c + r * TILE_TOKENS);
    transpose16(ct);   /* ct[t]: token t's 16 rows */
    for (int t = 0; t < TILE_TOKENS && tok0 + t < n; t++)
        _mm512_mask_storeu_ps(out + (tok0 + t) * ld_out + row0, rows, _mm512_castsi512_ps(ct[t]));
}

/* Rows [r0, r1) of w against the n packed tokens -> out [n, r1 - r0] (ld_out), a block of G
 * row groups at a time. The 4 C tiles hold G groups x M token tiles a pass: with one token
 * tile (n <= 16) 4 groups, so a step loads its B tile once for 4 products (A, B, A, B...
 * loaded 8 tiles for 4); with more, 2 x 2 (4 loads for 4 products; 1 group x 4 token tiles
 * loaded 5, and took 2-4% longer on the CPU machine's AMX). The next block's weights are
 * dequantised among this block's steps (deq_block) into the other half of the scratch.
 * Each C element sums its steps in the same order whatever the pass: the same bits. Tiles 4 / 6
 * take A in turn, 5 / 7 B, so a load need not wait for the product reading the last one. */
AMX_TARGET int st_amx_rows(int qtype, const uint8_t *w, int64_t row_bytes, int cols,
                           int64_t r0, int64_t r1, const uint16_t *packed, int64_t n,
                           float *out, int64_t ld_out, void *scratch) {
    if (!st_amx_takes(qtype, cols) || n <= 0) return 0;
    const int S = cols / STEP_COLS;
    const size_t step = TILE_BYTES / 2, group = (size_t)S * step;   /* in bf16 */
    const int64_t tiles = (n + TILE_TOKENS - 1) / TILE_TOKENS;
    const int G = tiles == 1 ? MAX_GROUPS : 2;                      /* row groups a pass */
    const int64_t block_rows = (int64_t)G * GROUP_ROWS;
    const int64_t passes = G == MAX_GROUPS ? 1 : (tiles + 1) / 2;   /* a block's */
    uint16_t *sets[2] = {scratch, (uint16_t *)scratch + (size_t)MAX_GROUPS * group};
    float *cbuf = (float *)(sets[1] + (size_t)MAX_GROUPS * group);   /* [4][16][16] fp32 */
    amx_configure();
    deq_block next;
    deq_start(&next, qtype, w, row_bytes, S, r0, (int)(r1 - r0 < block_rows ? r1 - r0
                                                                          : block_rows),
              sets[0], 0);
    deq_finish(&next);                 /* the first block, before any tiles */
    int set = 0;
    for (int64_t rb = r0; rb < r1; rb += block_rows, set ^= 1) {
        const uint16_t *wb = sets[set];                               /* [G][S][16][32] bf16 */
        int nr[MAX_GROUPS], ng = 0;    /* rows of each group of the pass */
        for (; ng < G && rb + ng * GROUP_ROWS < r1; ng++) {
            const int64_t gb = rb + ng * GROUP_ROWS;
            nr[ng] = r1 - gb < GROUP_ROWS ? (int)(r1 - gb) : GROUP_ROWS;
        }
        const int64_t nb = rb + block_rows;   /* the next block, among this one's steps */
        deq_start(&next, qtype, w, row_bytes, S, nb,
                  nb >= r1 ? 0 : (int)(r1 - nb < block_rows ? r1 - nb : block_rows),
                  sets[set ^ 1], G == MAX_GROUPS ? 0 : passes * S);
        for (int64_t t0 = 0; t0 < tiles; t0 += MAX_TILES / G) {
            const int m = G == MAX_GROUPS || tiles - t0 < 2 ? 1 : 2;   /* token tiles */
            const uint16_t *b = packed + (size_t)t0 * group;   /* token tile t0's step 0 */
            tile_zero_c(0); tile_zero_c(1); tile_zero_c(2); tile_zero_c(3);
            if (G == MAX_GROUPS) {         /* m = 1 */
                for (int s = 0; s < S; s++) {
                    const uint16_t *a = wb + s * step;
                    tile_load(5, b + s * step);
                    tile_load(4, a); tile_dp(0, 4, 5);
                    if (ng > 1) { tile_load(6, a + group); tile_dp(1, 6, 5); }
                    if (ng > 2) { tile_load(4, a + 2 * group); tile_dp(2, 4, 5); }
                    if (ng > 3) { tile_load(6, a + 3 * group); tile_dp(3, 6, 5); }
                    deq_step(&next);
                }
            } else if (m == 2) {           /* 2 groups x 2 token tiles */
                for (int s = 0; s < S; s++) {
                    /* token tile t0 + 1's step s sits S tiles after tile t0's */
                    const uint16_t *a = wb + s * step, *bs = b + s * step;
                    tile_load(4, a); tile_load(5, bs); tile_dp(0, 4, 5);
                    tile_load(7, bs + group); tile_dp(1, 4, 7);
                    if (ng > 1) { tile_load(6, a + group); tile_dp(2, 6, 5); tile_dp(3, 6, 7); }
                    deq_step(&next);
                }
            } else {                       /* 2 groups x the last token tile */
                for (int s = 0; s < S; s++) {
                    const uint16_t *a = wb + s * step;
                    tile_load(5, b + s * step);
                    tile_load(4, a); tile_dp(0, 4, 5);
                    if (ng > 1) { tile_load(6, a + group); tile_dp(1, 6, 5); }
                    deq_step(&next);
                }
            }
            const int used = ng * m;   /* C tile g m + i: group g x token tile t0 + i */
            tile_store_c(0, cbuf);
            if (used > 1) tile_store_c(1, cbuf + 256);
            if (used > 2) tile_store_c(2, cbuf + 512);
            if (used > 3) tile_store_c(3, cbuf + 768);
            for (int g = 0; g < ng; g++)
                for (int i = 0; i < m; i++)
                    scatter_tile(cbuf + (g * m + i) * 256, (t0 + i) * TILE_TOKENS, n, out,
                                 ld_out, rb + g * GROUP_ROWS - r0, nr[g]);
        }
        deq_finish(&next);
    }
    amx_release();
    return 1;
}

#else  /* no AMX build: the callers keep the lane tiles */

int st_amx_available(void) { return 0; }
int st_amx_takes(int qtype, int cols) { (void)qtype; (void)cols; return 0; }
size_t st_amx_pack_bytes(int64_t n, int cols) { (void)n; (void)cols; return 0; }
size_t st_amx_scratch_bytes(int cols) { (void)cols; return 0; }
void st_amx_pack(const float *src, int64_t ld, const int32_t *idx, int64_t n, int cols,
                 uint16_t *dst) {
    (void)src; (void)ld; (void)idx; (void)n; (void)cols; (void)dst;
}
int st_amx_rows(int qtype, const uint8_t *w, int64_t row_bytes, int cols, int64_t r0,
                int64_t r1, const uint16_t *packed, int64_t n, float *out, int64_t ld_out,
                void *scratch) {
    (void)qtype; (void)w; (void)row_bytes; (void)cols; (void)r0; (void)r1; (void)packed;
    (void)n; (void)out; (void)ld_out; (void)scratch;
    return 0;
}

#endif
