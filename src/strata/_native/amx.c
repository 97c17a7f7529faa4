/* Products of Q4_0 / Q8_0 weight rows with many 8-bit activation rows on Intel AMX (AMX-INT8:
 * Sapphire Rapids and later Xeons), for the CPU pool's prompt-window calls: an expert with
 * tens of rows costs the lane tiles (tiles.c) ~300 thread-us a row on the H200 host, which is
 * why the pool takes only rarely routed experts there (docs/offload.md, "AMX rows").
 *
 * Per 16 weight rows (a row block) and 16 tokens (a group), per 32-column block b:
 *   C[16 rows, 16 tokens] int32 = W_b [16, 32] int8 . X_b [32, 16] int8   (one TDPBSSD)
 *   acc[row] (16 tokens) += (float)C[row] * (dx_b[tokens] * dw_b[row])
 * The int32 block dots are exact; the float sums run block after block, so a token's result
 * depends on this path, not on the other tokens of its group (the lane tiles sum per 4
 * columns: the two paths differ in the last bits, which is why only callers that allow it,
 * st_act.allow_amx, take this one; the CPU backend keeps its batch-invariant tiles).
 * Weights go to tile A row-major (unpacked to int8, one row block at a time), activations to
 * tile B in the VNNI layout (B[k / 4][4 * token + k % 4] = x[token][k]), packed once per call
 * and token set and kept per thread for the row blocks that follow.
 *
 * ST_AMX_EMULATE (tools/amx_emulate.c, a test harness for machines without AMX) swaps the five
 * tile operations for C; everything else is this file's code. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif
#include "quant.h"

#if defined(__x86_64__) && defined(__GNUC__) && __GNUC__ >= 11 && !defined(__clang__)
#define ST_AMX_BUILD 1
#endif

#if defined(ST_AMX_BUILD) || defined(ST_AMX_EMULATE)

#define AMX_ROWS 16    /* weight rows per tile (C rows) */
#define AMX_TOKENS 16  /* tokens per tile (C columns) */
#define AMX_BLOCK 32   /* columns per block (one scale each, weights and activations) */

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint8_t v16u8 __attribute__((vector_size(16)));

#ifdef ST_AMX_EMULATE
#define AMX_TARGET
static int32_t emu_c[4][AMX_ROWS][AMX_TOKENS];
static int8_t emu_a[2][AMX_ROWS][AMX_BLOCK];
static int8_t emu_b[2][AMX_BLOCK / 4][4 * AMX_TOKENS];
static void amx_configure(void) {}
#define tile_zero_c(i) memset(emu_c[i], 0, sizeof emu_c[i])
static void emu_load_a(int i, const int8_t *p, int64_t stride) {
    for (int r = 0; r < AMX_ROWS; r++) memcpy(emu_a[i][r], p + r * stride, AMX_BLOCK);
}
#define tile_load_a(i, p, stride) emu_load_a((i) - 4, (p), (stride))
#define tile_load_b(i, p) memcpy(emu_b[(i) - 6], (p), sizeof emu_b[0])
static void emu_dp(int c, int a, int b) {
    for (int r = 0; r < AMX_ROWS; r++)
        for (int t = 0; t < AMX_TOKENS; t++)
            for (int k = 0; k < AMX_BLOCK; k++)
                emu_c[c][r][t] += (int32_t)emu_a[a][r][k] * emu_b[b][k / 4][4 * t + k % 4];
}
#define tile_dp(c, a, b) emu_dp((c), (a) - 4, (b) - 6)
#define tile_store_c(i, p) memcpy((p), emu_c[i], sizeof emu_c[i])
int st_amx_available(void) { return 1; }
#else
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_TARGET __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl")))
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_tilecfg;

/* tiles 0-3: C [16 rows, 16 int32] of four blocks in flight (one C tile made each block wait
 * for the last one's store: ~200 cycles a block on the H200 host); 4, 5: A [16 rows, 32 int8];
 * 6, 7: B [8, 16 x 4 int8]. The configuration is per thread; it stays loaded (nothing else
 * here uses the tiles). */
static __thread int amx_configured;
AMX_TARGET static void amx_configure(void) {
    if (amx_configured) return;
    amx_tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 4; t++) cfg.rows[t] = AMX_ROWS, cfg.colsb[t] = 4 * AMX_TOKENS;
    for (int t = 4; t < 6; t++) cfg.rows[t] = AMX_ROWS, cfg.colsb[t] = AMX_BLOCK;
    for (int t = 6; t < 8; t++) cfg.rows[t] = AMX_BLOCK / 4, cfg.colsb[t] = 4 * AMX_TOKENS;
    _tile_loadconfig(&cfg);
    amx_configured = 1;
}
#define tile_zero_c(i) _tile_zero(i)
#define tile_load_a(i, p, stride) _tile_loadd(i, (p), (stride))
#define tile_load_b(i, p) _tile_loadd(i, (p), 4 * AMX_TOKENS)
#define tile_dp(c, a, b) _tile_dpbssd(c, a, b)
#define tile_store_c(i, p) _tile_stored(i, (p), 4 * AMX_TOKENS)

/* -1 not asked yet, 0 no, 1 yes: the CPU has AMX-INT8 and AVX-512BW, the kernel lets this
 * process use the tile data (Linux >= 5.16, arch_prctl), and STRATA_AMX is not "0". */
static int amx_state = -1;
int st_amx_available(void) {
    int state = __atomic_load_n(&amx_state, __ATOMIC_ACQUIRE);
    if (state >= 0) return state;
    const char *env = getenv("STRATA_AMX");
    unsigned a, b, c, d;
    int ok = !(env && env[0] == '0') && __get_cpuid_count(7, 0, &a, &b, &c, &d)
             && (d & (1u << 24)) && (d & (1u << 25))      /* AMX-TILE, AMX-INT8 */
             && (b & (1u << 16)) && (b & (1u << 30));     /* AVX512F, AVX512BW */
    if (ok) ok = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    __atomic_store_n(&amx_state, ok, __ATOMIC_RELEASE);
    return ok;
}
#endif

/* Per thread: the unpacked row block and the packed activations of the last token set. */
typedef struct {
    int8_t *w;          /* [AMX_ROWS, nb * 32] int8 */
    float *dw;          /* [nb, AMX_ROWS] */
    size_t w_cap;
    int8_t *x;          /* [groups, nb, 8, 64] int8 (VNNI) */
    float *dx;          /* [groups, nb, AMX_TOKENS] */
    size_t x_cap;
    uint64_t act_id;    /* what x holds: (act, tokens) */
    const int32_t *tok;
    int64_t tok0, n_tok;
    int cols;
} amx_buffers;
static __thread amx_buffers amx_buf;

static int grow(void **p, size_t *cap, size_t need, size_t need2, void **p2) {
    if (need <= *cap) return 0;
    free(*p);
    free(*p2);
    *p = aligned_alloc(64, (need + 63) / 64 * 64);
    *p2 = aligned_alloc(64, (need2 + 63) / 64 * 64);
    *cap = *p && *p2 ? need : 0;
    return *cap ? 0 : -1;
}

/* The activation rows of tokens [0, n_tok) in groups of 16 (the last padded with zeros):
 * x[g][b][k4][4 * t + i] = q[token 16g + t][32b + 4k4 + i], dx[g][b][t] its block scale. */
static int pack_tokens(amx_buffers *buf, const st_act *act, const int32_t *tok, int64_t tok0,
                       int64_t n_tok, int nb) {
    if (buf->act_id == act->id && buf->tok == tok && buf->tok0 == tok0 && buf->n_tok == n_tok
        && buf->cols == nb * AMX_BLOCK)
        return 0;
    const int64_t groups = (n_tok + AMX_TOKENS - 1) / AMX_TOKENS;
    const size_t x_bytes = (size_t)groups * nb * AMX_BLOCK * AMX_TOKENS;
    if (grow((void **)&buf->x, &buf->x_cap, x_bytes,
             (size_t)groups * nb * AMX_TOKENS * sizeof(float), (void **)&buf->dx) != 0) {
        buf->act_id = 0;
        return -1;
    }
    const int ncp = act->cols_pad;
    for (int64_t g = 0; g < groups; g++) {
        int32_t *xg = (int32_t *)(buf->x + (size_t)g * nb * AMX_BLOCK * AMX_TOKENS);
        float *dg = buf->dx + (size_t)g * nb * AMX_TOKENS;
        for (int t = 0; t < AMX_TOKENS; t++) {
            const int64_t j = g * AMX_TOKENS + t;
            if (j >= n_tok) {
                for (int b = 0; b < nb; b++) {
                    for (int k4 = 0; k4 < AMX_BLOCK / 4; k4++)
                        xg[((size_t)b * (AMX_BLOCK / 4) + k4) * AMX_TOKENS + t] = 0;
                    dg[b * AMX_TOKENS + t] = 0.0f;
                }
                continue;
            }
            const int64_t row = tok ? (int64_t)tok[j] : tok0 + j;
            const int8_t *q = act->q + row * ncp;
            const float *dx = act->dx + row * (ncp / ST_LANE);
            for (int b = 0; b < nb; b++) {
                for (int k4 = 0; k4 < AMX_BLOCK / 4; k4++) {
                    int32_t word;
                    memcpy(&word, q + b * AMX_BLOCK + 4 * k4, 4);
                    xg[((size_t)b * (AMX_BLOCK / 4) + k4) * AMX_TOKENS + t] = word;
                }
                dg[b * AMX_TOKENS + t] = dx[b * (AMX_BLOCK / ST_LANE)];
            }
        }
    }
    buf->act_id = act->id, buf->tok = tok, buf->tok0 = tok0, buf->n_tok = n_tok;
    buf->cols = nb * AMX_BLOCK;
    return 0;
}

/* Rows [rb, rb + nr) of w as int8 [AMX_ROWS, nb * 32] (rows past nr: zeros) and their block
 * scales dw [nb, AMX_ROWS]. Q4_0: byte i of a block holds value i (low nibble) and i + 16. */
static int unpack_rows(amx_buffers *buf, int qtype, const uint8_t *w, int64_t row_bytes, int nb,
                       int64_t rb, int nr) {
    const int wcols = nb * AMX_BLOCK;
    if (grow((void **)&buf->w, &buf->w_cap, (size_t)AMX_ROWS * wcols,
             (size_t)nb * AMX_ROWS * sizeof(float), (void **)&buf->dw) != 0)
        return -1;
    for (int r = 0; r < AMX_ROWS; r++) {
        int8_t *dst = buf->w + (size_t)r * wcols;
        if (r >= nr) {
            memset(dst, 0, (size_t)wcols);
            for (int b = 0; b < nb; b++) buf->dw[b * AMX_ROWS + r] = 0.0f;
            continue;
        }
        const uint8_t *row = w + (rb + r) * row_bytes;
        if (r + ST_PREFETCH_ROWS < nr) st_prefetch(row + ST_PREFETCH_ROWS * row_bytes, row_bytes);
        const int block_bytes = qtype == ST_Q4_0 ? 18 : 34;
        for (int b = 0; b < nb; b++) {
            const uint8_t *blk = row + (int64_t)b * block_bytes;
            uint16_t h;
            memcpy(&h, blk, 2);
#if defined(__F16C__)
            buf->dw[b * AMX_ROWS + r] = _cvtsh_ss(h);
#else
            buf->dw[b * AMX_ROWS + r] = st_fp16_to_fp32(h);
#endif
            int8_t *v = dst + b * AMX_BLOCK;
            if (qtype == ST_Q4_0) {  /* 16 bytes at a time (SSE from the vector types) */
                v16u8 q, lo, hi;
                memcpy(&q, blk + 2, 16);
                lo = (q & 15) - 8;
                hi = (q >> 4) - 8;
                memcpy(v, &lo, 16);
                memcpy(v + 16, &hi, 16);
            } else {
                memcpy(v, blk + 2, AMX_BLOCK);
            }
        }
    }
    return 0;
}

/* out[j * ld_out + i] = row rb + i of w (Q4_0 / Q8_0, cols columns) . activation row of token j,
 * for i < nr (<= 16) and j < n_tok. 0 when this path does not take the call (no AMX, another
 * type, float activations, or no memory for its buffers): the caller runs the tiles instead. */
/* (the block sums fuse into FMAs: this path has no other path's bits to match) */
AMX_TARGET __attribute__((optimize("fp-contract=fast")))
int st_amx_rows(int qtype, const uint8_t *w, int64_t row_bytes, int cols, int64_t rb,
                           int nr, const st_act *act, const int32_t *tok, int64_t tok0,
                           int64_t n_tok, float *out, int64_t ld_out) {
    if ((qtype != ST_Q4_0 && qtype != ST_Q8_0) || !act->is_quant || cols % AMX_BLOCK
        || nr > AMX_ROWS || n_tok <= 0 || !st_amx_available())
        return 0;
    amx_buffers *buf = &amx_buf;
    const int nb = cols / AMX_BLOCK;
    if (pack_tokens(buf, act, tok, tok0, n_tok, nb) != 0
        || unpack_rows(buf, qtype, w, row_bytes, nb, rb, nr) != 0)
        return 0;
    amx_configure();
    int32_t c[4][AMX_ROWS * AMX_TOKENS] __attribute__((aligned(64)));  /* 4 blocks' C */
    const int64_t wstride = (int64_t)nb * AMX_BLOCK;
    const int64_t groups = (n_tok + AMX_TOKENS - 1) / AMX_TOKENS;
    for (int64_t g = 0; g < groups; g++) {
        const int8_t *xg = buf->x + (size_t)g * nb * AMX_BLOCK * AMX_TOKENS;  /* [nb, 8, 64] */
        const float *dg = buf->dx + (size_t)g * nb * AMX_TOKENS;               /* [nb, 16] */
        /* 16 accumulators in registers (named: an indexed array stays on the stack) */
#define AMX_REP16(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) \
    X(13) X(14) X(15)
#define AMX_ACC_DECL(r) v16f acc##r = {0};
        AMX_REP16(AMX_ACC_DECL)
#define AMX_TILE_BLOCK(ct, at, bt, b)                                                      \
        tile_zero_c(ct);                                                                   \
        tile_load_a(at, buf->w + (b) * AMX_BLOCK, wstride);                                \
        tile_load_b(bt, xg + (size_t)(b) * AMX_BLOCK * AMX_TOKENS);                        \
        tile_dp(ct, at, bt);                                                               \
        tile_store_c(ct, c[ct]);
        for (int b0 = 0; b0 < nb; b0 += 4) {
            const int n = nb - b0 < 4 ? nb - b0 : 4;
            if (n == 4) {  /* four independent products, then their scaling */
                AMX_TILE_BLOCK(0, 4, 6, b0)
                AMX_TILE_BLOCK(1, 5, 7, b0 + 1)
                AMX_TILE_BLOCK(2, 4, 6, b0 + 2)
                AMX_TILE_BLOCK(3, 5, 7, b0 + 3)
            } else {
                AMX_TILE_BLOCK(0, 4, 6, b0)
                if (n > 1) { AMX_TILE_BLOCK(1, 5, 7, b0 + 1) }
                if (n > 2) { AMX_TILE_BLOCK(2, 4, 6, b0 + 2) }
            }
            for (int i = 0; i < n; i++) {
                const int b = b0 + i;
                const int32_t *ci_b = c[i];
                v16f dx;
                memcpy(&dx, dg + b * AMX_TOKENS, sizeof dx);
                const float *dw = buf->dw + b * AMX_ROWS;
#define AMX_ACC_STEP(r)                                                                    \
                {                                                                          \
                    v16i ci;                                                               \
                    memcpy(&ci, ci_b + (r) * AMX_TOKENS, sizeof ci);                       \
                    acc##r += __builtin_convertvector(ci, v16f) * (dx * dw[r]);            \
                }
                AMX_REP16(AMX_ACC_STEP)
            }
        }
        float res[AMX_ROWS * AMX_TOKENS] __attribute__((aligned(64)));   /* [row, token] */
#define AMX_ACC_OUT(r) memcpy(res + (r) * AMX_TOKENS, &acc##r, sizeof acc##r);
        AMX_REP16(AMX_ACC_OUT)
        const int64_t nt = n_tok - g * AMX_TOKENS < AMX_TOKENS ? n_tok - g * AMX_TOKENS
                                                                : AMX_TOKENS;
        for (int r = 0; r < nr; r++)
            for (int64_t t = 0; t < nt; t++)
                out[(g * AMX_TOKENS + t) * ld_out + r] = res[r * AMX_TOKENS + t];
    }
    return 1;
}

#else  /* no AMX in this build (another architecture or compiler) */
int st_amx_available(void) { return 0; }
int st_amx_rows(int qtype, const uint8_t *w, int64_t row_bytes, int cols, int64_t rb, int nr,
                const st_act *act, const int32_t *tok, int64_t tok0, int64_t n_tok, float *out,
                int64_t ld_out) {
    (void)qtype, (void)w, (void)row_bytes, (void)cols, (void)rb, (void)nr, (void)act,
        (void)tok, (void)tok0, (void)n_tok, (void)out, (void)ld_out;
    return 0;
}
#endif
