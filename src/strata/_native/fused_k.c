/* The k-quants' products (Q2_K .. Q6_K, IQ4_XS; the grid i-quants' too, whose SIMD rows are
 * fused_iq.c's) at every token count: one weight row x 1-4
 * activation rows of ST_ACT_K (one scale dk per 256 columns, the group sums bs; quant.h),
 * straight from the super-blocks. Per super-block and token the products sum in int32 with the
 * weights' integer scales (and the mins against bs), then convert once:
 *   acc += d * dk * sum_i sc[g] * v[i] * q[i]  -  dmin * dk * sum_g m[g] * bs[g]
 * (llama.cpp's Q8_K dot), where a scale per 32 columns on both sides cost a convert, a scale
 * product and an FMA every 32 columns. Each token's arithmetic is its own, so a token's result
 * never depends on the tokens beside it; matmul.c takes these rows for 1 token and for 512
 * alike (4 at a time: the row's decoding is shared, the row block stays in L1).
 * One body per instruction set: AVX2 (every x86 build; AVX-VNNI's vpdpwssd sums a factor's
 * products where the build has it; with AVX-512 BW + VNNI, Q4_K / Q5_K / Q6_K take 64 columns
 * a step in 512-bit registers, fused_k_avx512.h, to the same bits: on a 2-core AVX-512 EPYC
 * a Q4_K_M synth's decode +5-7% and pp512 +23%), NEON (aarch64; vdotq_s32 where the build
 * has dotprod) and
 * a portable one on st_k_superblock / st_iq_superblock (others). The grid i-quants' AVX2 rows
 * are fused_iq.c's; NEON's decode them with st_iq_superblock (fused_k_neon.h). */
#include "quant.h"

typedef st_k_tokens k_tokens;  /* quant.h: q, dk, bs of up to 4 tokens */

/* Portable rows on the super-blocks as integers (st_k_superblock, st_iq_superblock): the
 * builds without AVX2 or NEON */
__attribute__((unused)) static void sb_row(int qtype, const uint8_t *row, int64_t ahead,
                                           int cols, const k_tokens *t, int n_tok, float *res) {
    const int bytes = st_type_size(qtype), has_min = st_has_min(qtype);
    const int is_iq = st_is_grid_iq(qtype);
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    int8_t v[256];
    int16_t sc[16], m[16];
    for (int ib = 0; ib < cols / 256; ib++) {
        const uint8_t *blk = row + (int64_t)ib * bytes;
        st_prefetch(blk + ahead, bytes);
        float d, dmin = 0.0f;
        if (is_iq) d = st_iq_superblock(qtype, blk, v, sc);
        else st_k_superblock(qtype, blk, v, sc, m, &d, &dmin);
        for (int c = 0; c < n_tok; c++) {
            const int8_t *q = t->q[c] + ib * 256;
            const int16_t *bs = t->bs[c] + ib * 16;
            int32_t isum = 0, imin = 0;
            for (int g = 0; g < 16; g++) {
                int32_t gsum = 0;
                for (int i = 0; i < 16; i++) gsum += (int32_t)v[16 * g + i] * q[16 * g + i];
                isum += sc[g] * gsum;
                if (has_min) imin += m[g] * bs[g];
            }
            const float dk = t->dk[c][ib];
            acc[c] += (float)isum * (d * dk);
            if (has_min) acc[c] -= (float)imin * (dmin * dk);
        }
    }
    for (int c = 0; c < n_tok; c++) res[c] = acc[c];
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "fused_k_avx2.h"
#if defined(__AVX512BW__) && defined(__AVX512VNNI__) && !defined(ST_NO_K512)
#include "fused_k_avx512.h"
#define row_q45k row_q45k_512  /* 64 columns a step, the same bits (ST_NO_K512: the AVX2 rows, */
#define row_q6k row_q6k_512    /* for an A/B build) */
#endif
#elif defined(__ARM_NEON) && defined(__aarch64__)
#include "fused_k_neon.h"
#endif

#if (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)) || \
    (defined(__ARM_NEON) && defined(__aarch64__))  /* the SIMD rows, by type and token count */
/* each row with its token count and flag constants (a flag read at run time cost the rows a
 * compare and branch per piece, session 34) */
#define K_BY_TOKENS(CALL)                                                                    \
    do {                                                                                     \
        if (n_tok == 1) CALL(1); else if (n_tok == 2) CALL(2); else if (n_tok == 3) CALL(3); \
        else CALL(4);                                                                        \
    } while (0)

static void k_row(int qtype, const uint8_t *row, int64_t ahead, int cols, const k_tokens *t,
                  int n_tok, float *res) {
#define Q4K(NC) row_q45k(NC, 0, row, ahead, cols, t, res)
#define Q5K(NC) row_q45k(NC, 1, row, ahead, cols, t, res)
#define Q2K(NC) row_q23k(NC, 0, row, ahead, cols, t, res)
#define Q3K(NC) row_q23k(NC, 1, row, ahead, cols, t, res)
#define Q6K(NC) row_q6k(NC, row, ahead, cols, t, res)
#define IQ4XS(NC) row_iq4xs(NC, row, ahead, cols, t, res)
    switch (qtype) {
    case ST_Q4_K: K_BY_TOKENS(Q4K); break;
    case ST_Q5_K: K_BY_TOKENS(Q5K); break;
    case ST_Q2_K: K_BY_TOKENS(Q2K); break;
    case ST_Q3_K: K_BY_TOKENS(Q3K); break;
    case ST_Q6_K: K_BY_TOKENS(Q6K); break;
    case ST_IQ4_XS: K_BY_TOKENS(IQ4XS); break;
#if defined(__ARM_NEON) && defined(__aarch64__)
#define IQG(NC) row_iq_grid(NC, qtype, row, ahead, cols, t, res)
    default: K_BY_TOKENS(IQG);  /* the grid i-quants (AVX2: st_iq_rows, a block at a time) */
#undef IQG
#endif
    }
#undef Q4K
#undef Q5K
#undef Q2K
#undef Q3K
#undef Q6K
#undef IQ4XS
}

#else  /* portable */

#define k_row sb_row

#endif

void st_k_tokens_at(const st_act *act, const int32_t *tok, int64_t tok0, int n_tok,
                    st_k_tokens *t) {
    const int ncp = act->cols_pad;
    for (int c = 0; c < n_tok; c++) {
        const int64_t tr = tok ? (int64_t)tok[c] : tok0 + c;
        t->q[c] = act->q + tr * ncp;
        t->dk[c] = act->dk + tr * ((ncp + 255) / 256);
        t->bs[c] = act->bs + tr * (ncp / ST_GROUP);
    }
}

void st_fused_k_rows(int qtype, const uint8_t *w, int64_t row_bytes, int cols, int64_t rb,
                     int nr, const st_act *act, const int32_t *tok, int64_t tok0, int n_tok,
                     float *out, int64_t ld_out) {
    k_tokens t;
    st_k_tokens_at(act, tok, tok0, n_tok, &t);
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    if (st_is_grid_iq(qtype)) {  /* fused_iq.c's rows */
        st_iq_rows(qtype, w, row_bytes, cols, rb, nr, &t, n_tok, out, ld_out);
        return;
    }
#endif
    const int64_t ahead = ST_PREFETCH_ROWS * row_bytes;
    float res[4];
    for (int i = 0; i < nr; i++) {
        k_row(qtype, w + (rb + i) * row_bytes, ahead, cols, &t, n_tok, res);
        for (int c = 0; c < n_tok; c++) out[c * ld_out + i] = res[c];
    }
}
