/* Strata CPU kernels: ggml type table, the unpacked-weight and quantised-activation layouts.
 *
 * Legend: T = tokens (activation rows), N = weight rows, K = columns (dot length).
 * Every quantised weight row is unpacked to one layout before its dot products:
 *   w[i] = A[g] * s[i] - B[g]        s: int8, g = i / 16 (a "group" of 16 columns)
 * A and B are per group; A is stored per 4-column "lane" (repeated 4 times) so SIMD code
 * can multiply a vector of int32 lane sums by it directly. Activations are quantised like
 * llama.cpp's Q8_0: q[i] = round(x[i] / dx[b]), b = i / 32, dx = max|x| / 127.
 * The k-quants (Q2_K .. Q6_K, IQ4_XS) and the grid i-quants (IQ1_S .. IQ3_S) are never
 * unpacked for a product: their rows (fused_k.c, fused_iq.c) read the super-blocks as integers
 * (st_k_superblock, st_iq_superblock) against activations quantised like llama.cpp's Q8_K, one
 * scale per 256 columns (ST_ACT_K below).
 */
#pragma once
#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* ggml type ids (gguf.GGMLQuantizationType) */
enum {
    ST_F32 = 0, ST_F16 = 1, ST_Q4_0 = 2, ST_Q4_1 = 3, ST_Q5_0 = 6, ST_Q5_1 = 7, ST_Q8_0 = 8,
    ST_Q2_K = 10, ST_Q3_K = 11, ST_Q4_K = 12, ST_Q5_K = 13, ST_Q6_K = 14, ST_IQ2_XXS = 16,
    ST_IQ2_XS = 17, ST_IQ3_XXS = 18, ST_IQ1_S = 19, ST_IQ4_NL = 20, ST_IQ3_S = 21, ST_IQ2_S = 22,
    ST_IQ4_XS = 23, ST_IQ1_M = 29, ST_BF16 = 30,
};

/* Bias added to unpacked weights: VNNI's vpdpbusd multiplies unsigned by signed bytes, so
 * there s is stored as s + 128 and the activation side carries -128 * sum(q) per lane. */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define ST_USE_VNNI512 1
#define ST_WEIGHT_BIAS 128
#elif defined(__AVXVNNI__) && defined(__AVX2__) && defined(__FMA__)
#define ST_USE_AVXVNNI 1   /* 256-bit VNNI without AVX-512 (Alder Lake and later) */
#define ST_WEIGHT_BIAS 128
#else
#define ST_WEIGHT_BIAS 0
#endif

/* The activation side's correction per lane, xc = -ST_XC_BIAS * sum(q), on every build: the
 * VNNI products' biased weights (ST_WEIGHT_BIAS) need it as it is, the fused rows of an offset
 * type shift it down (Q4_0's unsigned nibbles are s + 8: xc >> 4). */
#define ST_XC_BIAS 128
#if ST_WEIGHT_BIAS && ST_WEIGHT_BIAS != ST_XC_BIAS
#error "the VNNI products undo ST_WEIGHT_BIAS with xc as it is"
#endif

#define ST_PAD 64          /* unpacked rows are padded to this many columns (zeros) */
#define ST_GROUP 16        /* columns per weight scale group */
#define ST_LANE 4          /* columns per int32 lane */
#define ST_XBLOCK 32       /* columns per activation scale */
#define ST_MIN_PARALLEL_MACS (1 << 18)   /* smaller products run on the calling thread */

/* Decode-shaped products read each weight byte once, from RAM when the weights do not fit the
 * caches (the CPU pool's experts): the fused kernels ask for the bytes ST_PREFETCH_ROWS rows
 * ahead (`ahead`) as they read each block, so the loads overlap the arithmetic (1.5-1.9x from
 * RAM on the dev machine). A prefetch never faults: rows past a matrix's end are harmless. */
#define ST_PREFETCH_ROWS 4
static inline void st_prefetch(const uint8_t *p, int64_t num_bytes) {
    for (int64_t o = 0; o < num_bytes; o += 64) __builtin_prefetch(p + o, 0, 3);
}

/* Type table. The grid i-quants (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S) are
 * supported once their tables are set (kernels.pyx does it at import, from gguf's tables through
 * strata/model/iq_grids.py): st_set_iq_grid copies values [n, width] (width 8, or 4 for the
 * IQ3 types) for qtype; st_set_iq_ksigns the 128 sign patterns (gguf's: the 7 index bits and
 * their parity as bit 7, which the rules that compute them rely on). Returns 0, -1 on a bad
 * shape or pattern. */
int st_set_iq_grid(int qtype, const int8_t *values, int n, int width);
int st_set_iq_ksigns(const uint8_t *signs);
int st_is_supported(int qtype);
int st_block_size(int qtype);          /* elements per block; 0 for unknown types */
int st_type_size(int qtype);           /* bytes per block */
int st_is_float_type(int qtype);       /* F32 / F16 / BF16 */
int st_has_min(int qtype);             /* unpacked rows have a nonzero B (w = A s - B) */
const char *st_simd_level(void);

/* Scalar conversions shared by all paths (exact, like numpy's astype). */
float st_fp16_to_fp32(uint16_t h);
static inline float st_bf16_to_fp32(uint16_t h) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)h << 16;
    return v.f;
}

/* Q4_K / Q5_K's 6-bit scales and mins of the 8 sub-blocks (ggml's scale_min_k4) as the bytes of
 * *sc and *m, by 32-bit words (each its own load: a memcpy of the 12 bytes into an array went
 * through the stack); the AVX2 and NEON k rows' scales */
static inline void st_q45k_scale_words(const uint8_t *blk, uint64_t *sc, uint64_t *m) {
    uint32_t w0, w1, w2;
    memcpy(&w0, blk + 4, 4);
    memcpy(&w1, blk + 8, 4);
    memcpy(&w2, blk + 12, 4);
    const uint64_t sc_hi = (w2 & 0x0f0f0f0fu) | (((w0 >> 6) & 0x03030303u) << 4);
    const uint64_t m_hi = ((w2 >> 4) & 0x0f0f0f0fu) | (((w1 >> 6) & 0x03030303u) << 4);
    *sc = (w0 & 0x3f3f3f3fu) | sc_hi << 32;
    *m = (w1 & 0x3f3f3f3fu) | m_hi << 32;
}

/* One k-quant super-block (Q2_K .. Q6_K, IQ4_XS; 256 columns) as integers: w = d * sc[g] *
 * v[i] - dmin * m[g], g = i / 16 (m and dmin zero for the types without mins). */
void st_k_superblock(int qtype, const uint8_t *blk, int8_t *v, int16_t *sc, int16_t *m,
                     float *d, float *dmin);

/* Dequantise n_blocks whole blocks to float32, exactly as gguf.quants.dequantize. */
void st_dequantize(int qtype, const uint8_t *src, float *dst, int64_t n_blocks);

/* Unpack one quantised weight row of cols columns (cols_pad >= cols, multiple of ST_PAD):
 * s[cols_pad] (biased by ST_WEIGHT_BIAS), A[cols_pad / 4] per lane, B[cols_pad / 16]. */
void st_unpack_row(int qtype, const uint8_t *row, int cols, int cols_pad,
                   uint8_t *s, float *A, float *B);
/* The same with SIMD where the build has it; returns 0 (nothing written) when it does not
 * handle qtype. Writes columns [0, cols) only. */
int st_unpack_row_simd(int qtype, const uint8_t *row, int cols, uint8_t *s, float *A, float *B);
/* Unpack one float-type weight row to float32, zero padded to cols_pad (multiple of 16). */
void st_unpack_row_float(int qtype, const uint8_t *row, int cols, int cols_pad, float *w);
int st_unpack_row_float_simd(int qtype, const uint8_t *row, int cols, float *w);

/* Activations of T rows, in the form the weight type's dot product needs (st_act_kind):
 * ST_ACT_FLOAT: xf; ST_ACT_Q8: q / dx / xc / xs, one scale per 32 columns (llama.cpp's Q8_0),
 * for the 32-column block types; ST_ACT_K: q / dk / bs, one scale per 256 columns (llama.cpp's
 * Q8_K), for the k-quants and the grid i-quants, whose rows sum a super-block's products in
 * int32 with the weights' integer scales and convert once per 256 columns (fused_k.c,
 * fused_iq.c). */
enum { ST_ACT_FLOAT = 0, ST_ACT_Q8 = 1, ST_ACT_K = 2 };
typedef struct {
    int is_quant;      /* the kind: ST_ACT_FLOAT, ST_ACT_Q8 or ST_ACT_K */
    int cols;
    int cols_pad;
    int64_t num_rows;
    int8_t *q;         /* [T, cols_pad] (Q8 and K) */
    float *dx;         /* [T, cols_pad / 4]  activation scale per lane (Q8) */
    int32_t *xc;       /* [T, cols_pad / 4]  -ST_XC_BIAS * sum of the lane's 4 q (Q8) */
    float *xs;         /* [T, cols_pad / 16] dx * sum(q) over the group (Q8) */
    float *dk;         /* [T, cols_pad / 256] activation scale per super-block (K) */
    int16_t *bs;       /* [T, cols_pad / 16] sum(q) over the group (K): the mins' products */
    float *xf;         /* [T, cols_pad]      float rows, zero padded */
} st_act;

/* the activation kind a weight type's products take */
int st_act_kind(int qtype);
int st_is_k_type(int qtype);           /* Q2_K .. Q6_K, IQ4_XS */
int st_is_grid_iq(int qtype);          /* IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S */

void *st_alloc64(size_t num_bytes);   /* 64-byte aligned, free() it (matmul.c) */
/* a block of at least `bytes` (64-byte aligned; *capacity: its size), a kept one when one
 * fits; hand it back with st_block_give(p, capacity), on any thread (matmul.c) */
void *st_block_take(size_t bytes, size_t *capacity);
void st_block_give(void *p, size_t capacity);
#define ST_KEPT_MAX_BYTES ((size_t)256 << 20)   /* a bigger block handed back is freed */
int st_act_alloc(st_act *a, int64_t num_rows, int cols, int kind);
void st_act_free(st_act *a);
/* st_act_alloc's buffers in one caller-owned range of st_act_bytes bytes (64-byte aligned;
 * the caller owns that memory: never st_act_free such an act) */
size_t st_act_bytes(int64_t num_rows, int cols, int kind);
void st_act_place(st_act *a, int64_t num_rows, int cols, int kind, void *mem);
/* Fill rows [r0, r1) of a from x (row stride ld_x floats). */
void st_act_fill(st_act *a, const float *x, int64_t ld_x, int64_t r0, int64_t r1);

/* Padded column count for a weight type and column count. */
int st_cols_pad(int qtype, int cols);

/* out[j * ld_out + (r - r0)] = dot(row r of w, activation row tok[j]) for r in [r0, r1),
 * j in [0, n_tok); tok == NULL means j itself. scratch: st_scratch_bytes(qtype, cols). */
void st_gemm_rows(int qtype, const uint8_t *w, int64_t row_bytes, int cols,
                  int64_t r0, int64_t r1, const st_act *act, const int32_t *tok, int64_t n_tok,
                  float *out, int64_t ld_out, void *scratch);
size_t st_scratch_bytes(int qtype, int cols);
/* Rows [rb, rb + nr) x 1-3 tokens (4 for AVX2's Q4_0 / Q8_0, and for the k-quants with an
 * ST_ACT_K act on every build: st_fused_k_rows) straight from the quantised blocks / float
 * rows (fused.c); return 0 when this build or type has no fused path
 * for them (the caller unpacks instead). */
int st_fused_rows(int qtype, const uint8_t *w, int64_t row_bytes, int cols, int64_t rb, int nr,
                  const st_act *act, const int32_t *tok, int64_t tok0, int64_t n_tok,
                  float *out, int64_t ld_out);
int st_fused_float_rows(int qtype, const uint8_t *w, int64_t row_bytes, int cols, int64_t rb,
                        int nr, const st_act *act, const int32_t *tok, int64_t tok0,
                        int64_t n_tok, float *out, int64_t ld_out);
/* Rows [rb, rb + nr) of a matrix of an ST_ACT_K type (the k-quants Q2_K .. Q6_K, IQ4_XS and
 * the grid i-quants) x n_tok (1-4) ST_ACT_K activation rows (tok[j], or tok0 + j where tok is
 * NULL): out[j * ld_out + i] for row rb + i (fused_k.c; every build, every token count:
 * matmul.c takes them 4 tokens at a time). */
void st_fused_k_rows(int qtype, const uint8_t *w, int64_t row_bytes, int cols, int64_t rb,
                     int nr, const st_act *act, const int32_t *tok, int64_t tok0, int n_tok,
                     float *out, int64_t ld_out);
/* The activations of up to 4 tokens of an ST_ACT_K act, as the rows read them: q [cols_pad],
 * dk [cols_pad / 256], bs [cols_pad / 16] */
typedef struct {
    const int8_t *q[4];
    const float *dk[4];
    const int16_t *bs[4];
} st_k_tokens;
/* t for tokens tok[0 .. n_tok) of act (tok0 + c where tok is NULL; fused_k.c) */
void st_k_tokens_at(const st_act *act, const int32_t *tok, int64_t tok0, int n_tok,
                    st_k_tokens *t);
/* Rows [rb, rb + nr) of a grid i-quant matrix x n_tok (1-4) tokens: out[c * ld_out + i]
 * (fused_iq.c's SIMD rows; AVX2 builds only, st_fused_k_rows calls it) */
void st_iq_rows(int qtype, const uint8_t *w, int64_t row_bytes, int cols, int64_t rb, int nr,
                const st_k_tokens *t, int n_tok, float *out, int64_t ld_out);
/* The same products for many tokens: rows [rb, rb + nr) (nr <= 16) decoded once into scratch
 * (st_scratch_bytes(qtype, cols) bytes; returns 0, nothing written, where the build has no
 * such path or qtype is no grid i-quant), then each group of 1-4 tokens against them:
 * out[c * ld_out + i], bit for bit st_iq_rows' results (fused_iq.c). */
int st_iq_unpack_rows(int qtype, const uint8_t *w, int64_t row_bytes, int cols, int64_t rb,
                      int nr, void *scratch);
void st_iq_unpacked_rows(const void *scratch, int cols, int nr, const st_act *act,
                         const int32_t *tok, int64_t tok0, int n_tok, float *out, int64_t ld_out);
/* One grid i-quant super-block (256 columns) to signed values y[256] and a[16] scales per 16
 * columns (w = a * y; quant_ref.c); st_iq_scales: the scales alone. The tables st_set_iq_grid
 * and st_set_iq_ksigns filled: the grid (8 values per entry, 4 for IQ3_*), the 128 sign
 * patterns, IQ1's values [2 (delta negative)][2048] as 8 bytes each. */
void st_unpack_iq(int qtype, const uint8_t *blk, int8_t *y, float *a);
void st_iq_scales(int qtype, const uint8_t *blk, float *a);
/* The same super-block as integers: y[256] and sc[16] (iq_scales.h); returns the multiplier m,
 * w = m * sc[g] * y[i] */
float st_iq_superblock(int qtype, const uint8_t *blk, int8_t *y, int16_t *sc);
const int8_t *st_iq_grid_table(int qtype);
const uint64_t *st_iq_ksigns_pm1_table(void);  /* [128] the sign patterns as 8 bytes of +-1 */
const uint64_t *st_iq1_values_table(void);

/* out[T, rows] = x[T, cols] @ dequant(w).T, threaded. Returns 0, or -1 on allocation failure. */
int st_matmul(int qtype, const uint8_t *w, int64_t rows, int64_t row_bytes, int cols,
              const float *x, int64_t T, float *out);

/* Routed-expert block; see moe.c. Returns 0, or -1 on allocation failure. */
int st_moe_ffn(const float *x, int64_t T, int H, int F, int E, int K,
               const uint8_t *gate, int gate_type, int64_t gate_row_bytes,
               const uint8_t *up, int up_type, int64_t up_row_bytes,
               const uint8_t *down, int down_type, int64_t down_row_bytes,
               const int32_t *experts, const float *weights, float *out);
int st_moe_ffn_ptrs(const float *x, int64_t T, int H, int F, int E, int K,
                    const uint8_t *const *gate_ptrs, int gate_type, int64_t gate_row_bytes,
                    const uint8_t *const *up_ptrs, int up_type, int64_t up_row_bytes,
                    const uint8_t *const *down_ptrs, int down_type, int64_t down_row_bytes,
                    const int32_t *experts, const float *weights, float *out,
                    int64_t *routed_rows, int allow_amx);

/* AMX-BF16 rows (amx.c) for products of many activation rows with Q4_0 / Q8_0 weights.
 * st_amx_available: 1 when this CPU and kernel let the process use them (STRATA_AMX=0: never);
 * st_amx_takes: whether the rows handle this type and column count. st_amx_pack puts n float
 * rows (row j at src + (idx ? idx[j] : j) * ld) in the tiles' bf16 layout (st_amx_pack_bytes);
 * st_amx_rows then sets out[j * ld_out + (r - r0)] = dot(row r of w, row j) for r in [r0, r1),
 * j < n, with st_amx_scratch_bytes(cols) of 64-byte aligned scratch; 0 when it did not. Not
 * bit-equal to st_gemm_rows (bf16 roundings): for callers that need no batch invariance. */
int st_amx_available(void);
int st_amx_takes(int qtype, int cols);
size_t st_amx_pack_bytes(int64_t n, int cols);
size_t st_amx_scratch_bytes(int cols);
void st_amx_pack(const float *src, int64_t ld, const int32_t *idx, int64_t n, int cols,
                 uint16_t *dst);
int st_amx_rows(int qtype, const uint8_t *w, int64_t row_bytes, int cols, int64_t r0,
                int64_t r1, const uint16_t *packed, int64_t n, float *out, int64_t ld_out,
                void *scratch);

void st_rmsnorm(const float *x, const float *w, float eps, int64_t T, int H, float *out);

void st_set_num_threads(int n);
int st_get_num_threads(void);

/* How many consecutive work items a thread takes at once in a dynamic loop of `items` over
 * `threads` (st_matmul's row blocks, the MoE block's expert items): runs of about 1/8 of a
 * thread's share, 1 where there are few. Taken one by one, the threads' row blocks alternate,
 * so none reads a long stretch of the weights and each prefetches, past its block, rows that
 * another thread reads: a one-token product of 151936 x 2048 Q4_K rows on 2 threads took
 * 1.24-1.36x the time (IQ3_XXS 1.02-1.11x), decode on the 8-layer synths 1.13-1.33x (AVX2
 * EPYC, session 102; docs/DEVELOPING.md). */
static inline int st_grab(int64_t items, int threads) {
    const int64_t runs = (int64_t)(threads > 0 ? threads : 1) * 8;
    return items >= 2 * runs ? (int)(items / runs) : 1;
}

/* Sum over groups of B[g] * xs[g]: the min term of the st_has_min types (zero for others), in
 * one order for the tiles and the fused rows. 8 independent partial sums: num_groups is a
 * multiple of 4 (columns padded to 64) and the compiler may vectorise them, where one running
 * sum would be a latency chain (the build turns FMA contraction off: the same bits everywhere). */
static inline float st_min_term(const float *B, const float *xs, int num_groups) {
    float acc[8] = {0.0f};
    int g = 0;
    for (; g + 8 <= num_groups; g += 8)
        for (int i = 0; i < 8; i++) acc[i] += B[g + i] * xs[g + i];
    for (; g < num_groups; g++) acc[g & 7] += B[g] * xs[g];
    return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

#if defined(__AVX2__)
#include <immintrin.h>
#include <string.h>
/* The 32 signed values of a Q4_1 / Q5_0 / Q5_1 / IQ4_NL block (quant_ref.c's unpack_block32):
 * 16 nibble bytes at the block's end (columns 0-15 low, 16-31 high), Q5_*'s fifth bits from
 * the u32 qh (byte l takes byte l / 8 of qh, tested against bit l % 8), Q5_0's -16, IQ4_NL's
 * table. Used by unpack_simd.c and fused.c's AVX2 rows. */
static inline __m256i st_block32_values(int qtype, const uint8_t *blk, int block_bytes) {
    const __m128i low4 = _mm_set1_epi8(0x0F);
    const __m128i qs = _mm_loadu_si128((const __m128i *)(blk + block_bytes - 16));
    __m128i lo = _mm_and_si128(qs, low4), hi = _mm_and_si128(_mm_srli_epi16(qs, 4), low4);
    if (qtype == ST_IQ4_NL) {
        const __m128i table = _mm_setr_epi8(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25,
                                            38, 53, 69, 89, 113);
        lo = _mm_shuffle_epi8(table, lo);
        hi = _mm_shuffle_epi8(table, hi);
    }
    __m256i v = _mm256_set_m128i(hi, lo);
    if (qtype == ST_Q5_0 || qtype == ST_Q5_1) {
        uint32_t qh;
        memcpy(&qh, blk + (qtype == ST_Q5_1 ? 4 : 2), 4);
        const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                                2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
        const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
        __m256i h = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh), spread);
        h = _mm256_cmpeq_epi8(_mm256_and_si256(h, bit), bit);
        v = _mm256_or_si256(v, _mm256_and_si256(h, _mm256_set1_epi8(16)));
        if (qtype == ST_Q5_0) v = _mm256_sub_epi8(v, _mm256_set1_epi8(16));
    }
    return v;
}
#endif

#if defined(ST_USE_VNNI512)
#include <immintrin.h>
/* The lane arithmetic of every AVX-512 VNNI dot product here (tiles.c, fused.c), in
 * one place: a token's result must not depend on which of them computed it (test_matmul: alone
 * = batched, bit for bit). 16 int32 lanes of 4 columns each:
 * acc += float(corr + sum(u * q)) * (scale * dx), u unsigned weight bytes, q int8 activations. */
static inline __attribute__((always_inline)) __m512 st_vnni_lane_acc(
        __m512 acc, __m512i corr, __m512i u, __m512i q, __m512 scale, __m512 dx) {
    __m512i isum = _mm512_dpbusd_epi32(corr, u, q);
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(scale, dx), acc);
}
#endif
