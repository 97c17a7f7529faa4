/* Qwen3-Next's gated delta net (linear attention) on one sequence: the causal depthwise conv
 * + SiLU over the mixed q/k/v channels, the gated delta rule recurrence, and the gated RMSNorm
 * of its output. Each call takes the consecutive rows of ONE sequence, in order, and carries
 * the sequence's state from state_in to state_out (the same buffer, or a second one that the
 * call fills while state_in stays as it was).
 *
 * Legend: T = rows, C = conv channels, K = conv taps, Hk / Hv = key / value heads,
 * Dk / Dv = key / value head dims. All float32; row strides (ld*) count floats.
 */
#pragma once
#include <stdint.h>

/* y[t, c] = silu(sum_j w[c, j] * xin[t + j, c]), xin = state_in rows then x rows [K-1+T, C];
 * state_out = the last K-1 rows of xin (zeros in state_in for a new sequence).
 * x [T, C] at row stride ldx (a column slice of a wider matrix is fine); w [C, K], tap K-1
 * multiplies the current row (torch's depthwise conv1d weight [C, 1, K]); state_in /
 * state_out [K-1, C], oldest row first, may be the same buffer; y [T, C], apart from x and
 * the state. T may be < K-1 (the state then shifts by T rows). */
void st_conv_silu(const float *x, int64_t ldx, int64_t T, int C, int K, const float *w,
                  const float *state_in, float *state_out, float *y);

/* The gated delta rule, row by row; value head h reads key/query head h / (Hv / Hk).
 * q, k [T, Hk*Dk] and v [T, Hv*Dv] at row stride ld; beta_logit, alpha [T, Hv] at row stride
 * ld_ba; A [Hv] (negative: -exp(A_log)), dt_bias [Hv]; state_in / state_out [Hv, Dk, Dv]
 * (the same buffer, or disjoint ones: state_in is then left unchanged); out [T, Hv*Dv].
 * Per row and value head:
 *   qn = q / sqrt(|q|^2 + eps) / sqrt(Dk),  kn = k / sqrt(|k|^2 + eps)
 *   g = A * softplus(alpha + dt_bias),      beta = sigmoid(beta_logit)
 *   S = S * exp(g);  S += kn (x) ((v - S^T kn) * beta);  out = S^T qn
 * Work is split over value heads and column panels of Dv, so results do not depend on the
 * number of threads. */
void st_gated_delta(int64_t T, int Hk, int Hv, int Dk, int Dv, const float *q, const float *k,
                    const float *v, int64_t ld, const float *beta_logit, const float *alpha,
                    int64_t ld_ba, const float *A, const float *dt_bias, float eps,
                    const float *state_in, float *state_out, float *out);

/* In place on x [T, Hv*Dv]: each head's [Dv] vector becomes
 * w * (x / sqrt(mean(x^2) + eps)) * silu(z), z [T, Hv*Dv] at row stride ldz; w [Dv]. */
void st_gated_rmsnorm(float *x, int64_t T, int Hv, int Dv, const float *z, int64_t ldz,
                      const float *w, float eps);
