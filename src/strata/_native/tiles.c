/* Register-tile dot products: up to 4 unpacked weight rows x 4 activation rows per call.
 * One body per instruction set (AVX-512 VNNI, AVX2 / AVX-VNNI, NEON, scalar) on quant.h's layout. */
#include "tiles.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#include "lane_sum.h"
#endif
#if defined(__ARM_NEON)
#include <arm_neon.h>
#endif

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* ---- quantised tiles ------------------------------------------------------------------ */

ALWAYS_INLINE void qtile_impl(const int NR, const int NC, const st_qtile *t, float *res) {
    const int ncp = t->cols_pad;
#if defined(ST_USE_VNNI512)
    __m512 acc[4][4];
    for (int r = 0; r < NR; r++)
        for (int c = 0; c < NC; c++) acc[r][c] = _mm512_setzero_ps();
    for (int k = 0; k < ncp; k += 64) {
        const int lane = k / ST_LANE;
        __m512i q[4], xc[4];
        __m512 dx[4];
        for (int c = 0; c < NC; c++) {
            q[c] = _mm512_loadu_si512((const void *)(t->q[c] + k));       /* [64] int8 */
            xc[c] = _mm512_loadu_si512((const void *)(t->xc[c] + lane));  /* [16] int32 */
            dx[c] = _mm512_loadu_ps(t->dx[c] + lane);                     /* [16] */
        }
        for (int r = 0; r < NR; r++) {
            __m512i s = _mm512_loadu_si512((const void *)(t->s[r] + k));  /* [64] uint8 */
            __m512 a = _mm512_loadu_ps(t->A[r] + lane);                   /* [16] */
            for (int c = 0; c < NC; c++) {
                /* xc holds -128 * sum(q) per lane, undoing the +128 bias of s exactly */
                acc[r][c] = st_vnni_lane_acc(acc[r][c], xc[c], s, q[c], a, dx[c]);
            }
        }
    }
    for (int r = 0; r < NR; r++)
        for (int c = 0; c < NC; c++) res[r * 4 + c] = _mm512_reduce_add_ps(acc[r][c]);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 acc[4][4];
    for (int r = 0; r < NR; r++)
        for (int c = 0; c < NC; c++) acc[r][c] = _mm256_setzero_ps();
    for (int k = 0; k < ncp; k += 32) {
        const int lane = k / ST_LANE;
        __m256i q[4];
        __m256 dx[4];
        for (int c = 0; c < NC; c++) {
            q[c] = _mm256_loadu_si256((const __m256i *)(t->q[c] + k));    /* [32] int8 */
            dx[c] = _mm256_loadu_ps(t->dx[c] + lane);                     /* [8] */
        }
#if defined(ST_USE_AVXVNNI)
        __m256i xc[4];
        for (int c = 0; c < NC; c++)
            xc[c] = _mm256_loadu_si256((const __m256i *)(t->xc[c] + lane));   /* [8] int32 */
#endif
        for (int r = 0; r < NR; r++) {
            __m256i s = _mm256_loadu_si256((const __m256i *)(t->s[r] + k));
            __m256 a = _mm256_loadu_ps(t->A[r] + lane);
#if defined(ST_USE_AVXVNNI)
            for (int c = 0; c < NC; c++) {
                /* s is stored + 128 (unsigned); xc = -128 * sum(q) undoes it exactly */
                __m256i p32 = _mm256_dpbusd_avx_epi32(xc[c], s, q[c]);
                acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p32), _mm256_mul_ps(a, dx[c]),
                                            acc[r][c]);
            }
#else
            __m256i s_abs = _mm256_sign_epi8(s, s);
            for (int c = 0; c < NC; c++) {
                /* maddubs wants unsigned x signed: |s| * (q with the sign of s); pairs of
                 * products stay below 2 * 128 * 127 < 32768, so no saturation */
                __m256i p32 = lanes_dot(s_abs, _mm256_sign_epi8(q[c], s));  /* [8] lane sums */
                acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p32), _mm256_mul_ps(a, dx[c]),
                                            acc[r][c]);
            }
#endif
        }
    }
    for (int r = 0; r < NR; r++)
        for (int c = 0; c < NC; c++) res[r * 4 + c] = hsum8(acc[r][c]);
#elif defined(__ARM_NEON) && defined(__aarch64__)
    float32x4_t acc[4][4];
    for (int r = 0; r < NR; r++)
        for (int c = 0; c < NC; c++) acc[r][c] = vdupq_n_f32(0.0f);
    for (int k = 0; k < ncp; k += 16) {
        const int lane = k / ST_LANE;
        int8x16_t q[4];
        float32x4_t dx[4];
        for (int c = 0; c < NC; c++) {
            q[c] = vld1q_s8(t->q[c] + k);
            dx[c] = vld1q_f32(t->dx[c] + lane);
        }
        for (int r = 0; r < NR; r++) {
            int8x16_t s = vld1q_s8((const int8_t *)(t->s[r] + k));
            float32x4_t a = vld1q_f32(t->A[r] + lane);
            for (int c = 0; c < NC; c++) {
#if defined(__ARM_FEATURE_DOTPROD)
                int32x4_t isum = vdotq_s32(vdupq_n_s32(0), s, q[c]);      /* [4] lane sums */
#else
                int16x8_t lo = vmull_s8(vget_low_s8(s), vget_low_s8(q[c]));
                int16x8_t hi = vmull_high_s8(s, q[c]);
                int32x4_t isum = vpaddq_s32(vpaddlq_s16(lo), vpaddlq_s16(hi));
#endif
                acc[r][c] = vfmaq_f32(acc[r][c], vcvtq_f32_s32(isum), vmulq_f32(a, dx[c]));
            }
        }
    }
    for (int r = 0; r < NR; r++)
        for (int c = 0; c < NC; c++) res[r * 4 + c] = vaddvq_f32(acc[r][c]);
#else
    float acc[4][4] = {{0.0f}};
    for (int lane = 0; lane < ncp / ST_LANE; lane++) {
        for (int r = 0; r < NR; r++) {
            const uint8_t *s = t->s[r] + lane * ST_LANE;
            for (int c = 0; c < NC; c++) {
                const int8_t *q = t->q[c] + lane * ST_LANE;
#if ST_WEIGHT_BIAS
                int32_t isum = t->xc[c][lane];  /* undoes the bias of s */
                for (int i = 0; i < ST_LANE; i++) isum += (int32_t)s[i] * q[i];
#else
                int32_t isum = 0;
                for (int i = 0; i < ST_LANE; i++) isum += (int32_t)(int8_t)s[i] * q[i];
#endif
                acc[r][c] += (float)isum * (t->A[r][lane] * t->dx[c][lane]);
            }
        }
    }
    for (int r = 0; r < NR; r++)
        for (int c = 0; c < NC; c++) res[r * 4 + c] = acc[r][c];
#endif
    if (t->has_min) {
        for (int r = 0; r < NR; r++)
            for (int c = 0; c < NC; c++)
                res[r * 4 + c] -= st_min_term(t->B[r], t->xs[c], ncp / ST_GROUP);
    }
}

void st_qtile_4x4(const st_qtile *t, float *res) { qtile_impl(4, 4, t, res); }
void st_qtile_4x1(const st_qtile *t, float *res) { qtile_impl(4, 1, t, res); }
void st_qtile_1x4(const st_qtile *t, float *res) { qtile_impl(1, 4, t, res); }
void st_qtile_1x1(const st_qtile *t, float *res) { qtile_impl(1, 1, t, res); }

/* ---- float tiles (F32 / F16 / BF16 weights, float32 math) ----------------------------- */

ALWAYS_INLINE void ftile_impl(const int NR, const int NC, const st_ftile *t, float *res) {
    const int ncp = t->cols_pad;
#if defined(__AVX512F__)
    __m512 acc[4][4];
    for (int r = 0; r < NR; r++)
        for (int c = 0; c < NC; c++) acc[r][c] = _mm512_setzero_ps();
    for (int k = 0; k < ncp; k += 16) {
        __m512 x[4];
        for (int c = 0; c < NC; c++) x[c] = _mm512_loadu_ps(t->x[c] + k);
        for (int r = 0; r < NR; r++) {
            __m512 w = _mm512_loadu_ps(t->w[r] + k);
            for (int c = 0; c < NC; c++) acc[r][c] = _mm512_fmadd_ps(w, x[c], acc[r][c]);
        }
    }
    for (int r = 0; r < NR; r++)
        for (int c = 0; c < NC; c++) res[r * 4 + c] = _mm512_reduce_add_ps(acc[r][c]);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 acc[4][4];
    for (int r = 0; r < NR; r++)
        for (int c = 0; c < NC; c++) acc[r][c] = _mm256_setzero_ps();
    for (int k = 0; k < ncp; k += 8) {
        __m256 x[4];
        for (int c = 0; c < NC; c++) x[c] = _mm256_loadu_ps(t->x[c] + k);
        for (int r = 0; r < NR; r++) {
            __m256 w = _mm256_loadu_ps(t->w[r] + k);
            for (int c = 0; c < NC; c++) acc[r][c] = _mm256_fmadd_ps(w, x[c], acc[r][c]);
        }
    }
    for (int r = 0; r < NR; r++)
        for (int c = 0; c < NC; c++) res[r * 4 + c] = hsum8(acc[r][c]);
#elif defined(__ARM_NEON) && defined(__aarch64__)
    float32x4_t acc[4][4];
    for (int r = 0; r < NR; r++)
        for (int c = 0; c < NC; c++) acc[r][c] = vdupq_n_f32(0.0f);
    for (int k = 0; k < ncp; k += 4) {
        float32x4_t x[4];
        for (int c = 0; c < NC; c++) x[c] = vld1q_f32(t->x[c] + k);
        for (int r = 0; r < NR; r++) {
            float32x4_t w = vld1q_f32(t->w[r] + k);
            for (int c = 0; c < NC; c++) acc[r][c] = vfmaq_f32(acc[r][c], w, x[c]);
        }
    }
    for (int r = 0; r < NR; r++)
        for (int c = 0; c < NC; c++) res[r * 4 + c] = vaddvq_f32(acc[r][c]);
#else
    /* 8 partial sums per pair, like an 8-wide vector: keeps the error near the SIMD paths' */
    float acc[4][4][8] = {{{0.0f}}};
    for (int k = 0; k < ncp; k += 8)
        for (int r = 0; r < NR; r++)
            for (int c = 0; c < NC; c++)
                for (int i = 0; i < 8; i++) acc[r][c][i] += t->w[r][k + i] * t->x[c][k + i];
    for (int r = 0; r < NR; r++)
        for (int c = 0; c < NC; c++) {
            float sum = 0.0f;
            for (int i = 0; i < 8; i++) sum += acc[r][c][i];
            res[r * 4 + c] = sum;
        }
#endif
}

void st_ftile_4x4(const st_ftile *t, float *res) { ftile_impl(4, 4, t, res); }
void st_ftile_4x1(const st_ftile *t, float *res) { ftile_impl(4, 1, t, res); }
void st_ftile_1x4(const st_ftile *t, float *res) { ftile_impl(1, 4, t, res); }
void st_ftile_1x1(const st_ftile *t, float *res) { ftile_impl(1, 1, t, res); }
