/* Qwen3-Next's gated delta net on one sequence: causal conv + SiLU, the gated delta rule and the
 * gated RMSNorm (transformers' Qwen3NextGatedDeltaNet, its torch fallbacks, in float32).
 * The work splits into pieces that own their outputs and state outright (channel blocks, value
 * head x Dv panels, rows), so results do not depend on the number of threads. */
#include <math.h>
#include <string.h>
#include "delta_net.h"
#include "quant.h"
#include "silu.h"

/* Legend: T = rows, C = conv channels, K = conv taps, Hk / Hv = key / value heads,
 * Dk / Dv = key / value head dims. */

#define CONV_CHANNEL_BLOCK 256  /* channels one conv work item takes */
#define DV_PANEL 64             /* state columns per delta-rule work item: a [Dk, 64] panel */
#define PARALLEL_MIN_OPS 32768  /* below this a call stays on one thread */

/* torch's F.softplus (threshold 20: past it softplus(x) rounds to x) */
static inline float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

/* ---- causal conv + SiLU ------------------------------------------------------------------ */

/* Row i of xin = state_in rows (i < K-1), then x rows. */
static inline const float *conv_input_row(const float *x, int64_t ldx, int C, int K,
                                          const float *state_in, int64_t i) {
    return i < K - 1 ? state_in + i * C : x + (i - (K - 1)) * ldx;
}

void st_conv_silu(const float *x, int64_t ldx, int64_t T, int C, int K, const float *w,
                  const float *state_in, float *state_out, float *y) {
    const int64_t num_blocks = (C + CONV_CHANNEL_BLOCK - 1) / CONV_CHANNEL_BLOCK;
    /* Each block reads and writes only its own channels, so a shared state_in / state_out is
     * safe across blocks; within a block y is done before the state moves. */
    #pragma omp parallel for num_threads(st_get_num_threads()) schedule(static) \
        if (num_blocks > 1 && T * C * K >= PARALLEL_MIN_OPS)
    for (int64_t b = 0; b < num_blocks; b++) {
        const int c0 = (int)(b * CONV_CHANNEL_BLOCK);
        const int c1 = C - c0 < CONV_CHANNEL_BLOCK ? C : c0 + CONV_CHANNEL_BLOCK;
        for (int64_t t = 0; t < T; t++) {
            float *restrict yr = y + t * C;                                  /* [C] */
            for (int c = c0; c < c1; c++) yr[c] = 0.0f;
            for (int j = 0; j < K; j++) {
                const float *restrict xr = conv_input_row(x, ldx, C, K, state_in, t + j);
                for (int c = c0; c < c1; c++) yr[c] += w[(int64_t)c * K + j] * xr[c];
            }
            for (int c = c0; c < c1; c++) yr[c] = st_silu(yr[c]);
        }
        /* state_out row r = xin row T + r; going up, a row is read before any write reaches
         * it (T + r >= r), so state_out may be state_in. */
        for (int r = 0; r < K - 1; r++) {
            const float *src = conv_input_row(x, ldx, C, K, state_in, T + r);   /* [C] */
            float *dst = state_out + (int64_t)r * C;
            if (src != dst) memmove(dst + c0, src + c0, (size_t)(c1 - c0) * sizeof(float));
        }
    }
}

/* ---- gated delta rule -------------------------------------------------------------------- */

void st_gated_delta(int64_t T, int Hk, int Hv, int Dk, int Dv, const float *q, const float *k,
                    const float *v, int64_t ld, const float *beta_logit, const float *alpha,
                    int64_t ld_ba, const float *A, const float *dt_bias, float eps,
                    const float *state_in, float *state_out, float *out) {
    const int group = Hv / Hk;                          /* value heads per key head */
    const int num_panels = (Dv + DV_PANEL - 1) / DV_PANEL;
    const int64_t num_items = (int64_t)Hv * num_panels;
    const int64_t head_values = (int64_t)Dk * Dv;       /* one head's state [Dk, Dv] */
    const float inv_sqrt_dk = 1.0f / sqrtf((float)Dk);

    #pragma omp parallel for num_threads(st_get_num_threads()) schedule(static) \
        if (num_items > 1 && (T > 0 ? T : 1) * Hv * head_values >= PARALLEL_MIN_OPS)
    for (int64_t item = 0; item < num_items; item++) {
        const int h = (int)(item / num_panels), hk = h / group;
        const int j0 = (int)(item % num_panels) * DV_PANEL;
        const int nj = Dv - j0 < DV_PANEL ? Dv - j0 : DV_PANEL;
        float *S = state_out + h * head_values + j0;     /* [Dk, nj] panel at row stride Dv */
        if (state_out != state_in) {
            const float *S0 = state_in + h * head_values + j0;
            for (int i = 0; i < Dk; i++)
                memcpy(S + (int64_t)i * Dv, S0 + (int64_t)i * Dv, (size_t)nj * sizeof(float));
        }
        float delta[DV_PANEL];                           /* S^T kn, then the update [nj] */
        for (int64_t t = 0; t < T; t++) {
            const float *qh = q + t * ld + (int64_t)hk * Dk;                 /* [Dk] */
            const float *kh = k + t * ld + (int64_t)hk * Dk;                 /* [Dk] */
            const float *vh = v + t * ld + (int64_t)h * Dv + j0;             /* [nj] */
            float *restrict oh = out + (t * Hv + h) * (int64_t)Dv + j0;      /* [nj] */
            double qq = 0.0, kk = 0.0;
            for (int i = 0; i < Dk; i++) {
                qq += (double)qh[i] * qh[i];
                kk += (double)kh[i] * kh[i];
            }
            const float inv_q = 1.0f / sqrtf((float)qq + eps);
            const float inv_k = 1.0f / sqrtf((float)kk + eps);
            const float decay = expf(A[h] * softplus(alpha[t * ld_ba + h] + dt_bias[h]));
            const float beta = 1.0f / (1.0f + expf(-beta_logit[t * ld_ba + h]));

            /* S = S * exp(g); delta = S^T kn */
            for (int j = 0; j < nj; j++) delta[j] = 0.0f;
            for (int i = 0; i < Dk; i++) {
                const float kn = kh[i] * inv_k;
                float *restrict Si = S + (int64_t)i * Dv;                    /* [nj] */
                for (int j = 0; j < nj; j++) {
                    Si[j] *= decay;
                    delta[j] += kn * Si[j];
                }
            }
            for (int j = 0; j < nj; j++) delta[j] = (vh[j] - delta[j]) * beta;

            /* S += kn (x) delta; out = S^T qn */
            for (int j = 0; j < nj; j++) oh[j] = 0.0f;
            for (int i = 0; i < Dk; i++) {
                const float kn = kh[i] * inv_k;
                const float qn = qh[i] * inv_q * inv_sqrt_dk;
                float *restrict Si = S + (int64_t)i * Dv;                    /* [nj] */
                for (int j = 0; j < nj; j++) {
                    Si[j] += kn * delta[j];
                    oh[j] += qn * Si[j];
                }
            }
        }
    }
}

/* ---- gated RMSNorm ----------------------------------------------------------------------- */

void st_gated_rmsnorm(float *x, int64_t T, int Hv, int Dv, const float *z, int64_t ldz,
                      const float *w, float eps) {
    #pragma omp parallel for num_threads(st_get_num_threads()) schedule(static) \
        if (T > 1 && T * Hv * Dv >= PARALLEL_MIN_OPS)
    for (int64_t t = 0; t < T; t++) {
        for (int h = 0; h < Hv; h++) {
            float *restrict xh = x + (t * Hv + h) * (int64_t)Dv;             /* [Dv] */
            const float *zh = z + t * ldz + (int64_t)h * Dv;                 /* [Dv] */
            double sum_sq = 0.0;
            for (int i = 0; i < Dv; i++) sum_sq += (double)xh[i] * xh[i];
            /* like transformers: norm before gate, x * rsqrt(mean(x^2) + eps) * w * silu(z) */
            const float scale = 1.0f / sqrtf((float)(sum_sq / Dv) + eps);
            for (int i = 0; i < Dv; i++) xh[i] = w[i] * (xh[i] * scale) * st_silu(zh[i]);
        }
    }
}
