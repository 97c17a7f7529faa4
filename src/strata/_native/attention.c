/* Causal attention of a window's rows over their own slot's KV cells: key tiles of fixed
 * absolute position, an online softmax, register-tiled products written with GCC/Clang vector
 * types (AVX-512, AVX2, NEON or SSE/scalar, whatever the build targets).
 *
 * Legend: M = query vectors of a work item (rows x G heads), Mp = M padded to MR,
 * TK = keys per tile, D = head dim, VL = floats per vector.
 * A work item is (run, KV head, block of rows); each item runs on one thread, and each query
 * vector's sums run in a fixed order over fixed tiles, so its result does not depend on the
 * rows batched with it nor on the number of threads.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "quant.h"
#include "window.h"
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__F16C__)
#include <immintrin.h>
#elif defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
#endif

#define TK ST_KEY_TILE     /* keys per tile */
#define MAX_QUERIES 128    /* query vectors per work item (rows x G heads) */
#define MR 4               /* query vectors per register tile */

#if defined(__AVX512F__)
#define VL 16
#elif defined(__AVX__)
#define VL 8
#else
#define VL 4
#endif
#define NV 4               /* vectors per register tile row: 4 x MR accumulators */

typedef float vf __attribute__((vector_size(VL * 4)));
typedef int32_t vi __attribute__((vector_size(VL * 4)));

static inline vf vload(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline void vstore(float *p, vf v) { memcpy(p, &v, sizeof v); }
static inline vf vsplat(float f) { vf v = {0}; return v + f; }
static inline vf vselect(vi mask, vf a, vf b) { return (vf)(((vi)a & mask) | ((vi)b & ~mask)); }

static inline float hmax(vf v) {
    float m = v[0];
    for (int i = 1; i < VL; i++) m = v[i] > m ? v[i] : m;
    return m;
}

static inline float hsum(vf v) {
    float s = v[0];
    for (int i = 1; i < VL; i++) s += v[i];
    return s;
}

/* exp(x) for x <= 0 (Cephes' polynomial, relative error ~2e-7); below -87 it gives ~1e-38. */
static inline vf vexp(vf x) {
    const vf lo = vsplat(-87.0f), zero = vsplat(0.0f), magic = vsplat(12582912.0f);
    x = vselect(x < lo, lo, x);
    x = vselect(x > zero, zero, x);
    vf t = x * 1.44269504088896341f + magic;           /* round(x / ln 2) + magic */
    vf n = t - magic;
    vi ni = (vi)t - (vi)magic;
    vf r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    vf p = vsplat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    vf y = p * (r * r) + r + 1.0f;
    return y * (vf)((ni + 127) << 23);
}

/* ---- cells to float32 ------------------------------------------------------------------ */

static void half_to_float(const uint16_t *src, float *dst, int64_t n) {
    int64_t i = 0;
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
#elif defined(__aarch64__) && defined(__ARM_NEON)
    for (; i + 4 <= n; i += 4) vst1q_f32(dst + i, vcvt_f32_f16(vld1_f16((const __fp16 *)(src + i))));
#endif
    for (; i < n; i++) dst[i] = st_fp16_to_fp32(src[i]);
}

/* ---- register tiles -------------------------------------------------------------------- */

/* s[i, c] = q[i] . k_c for MR query rows (qp [MR, D]) and TK keys (kt [D, TK]). */
static void scores_tile(const float *qp, int D, const float *kt, float *s) {
    for (int c0 = 0; c0 < TK; c0 += NV * VL) {
        vf acc[MR][NV];
        for (int i = 0; i < MR; i++)
            for (int j = 0; j < NV; j++) acc[i][j] = vsplat(0.0f);
        for (int d = 0; d < D; d++) {
            const float *kr = kt + (size_t)d * TK + c0;
            vf k[NV];
            for (int j = 0; j < NV; j++) k[j] = vload(kr + j * VL);
            for (int i = 0; i < MR; i++) {
                float qv = qp[(size_t)i * D + d];
                for (int j = 0; j < NV; j++) acc[i][j] += k[j] * qv;
            }
        }
        for (int i = 0; i < MR; i++)
            for (int j = 0; j < NV; j++) vstore(s + (size_t)i * TK + c0 + j * VL, acc[i][j]);
    }
}

/* o[i] = o[i] * alpha[i] + sum_{c < lim[i]} p[i, c] v_c for MR rows (p [MR, TK], v [TK, ldv],
 * o [MR, D]; lim [MR]: the keys of the tile each row sees), dims [d0, d0 + nv * VL). A key a row
 * does not see is left out, not multiplied by its p of 0: a later row's cell may hold a NaN or
 * inf (a corrupt token, an fp16 overflow), and 0 * NaN would carry it into every earlier row of
 * the tile. Keys every row sees, [0, lo), take the vector loop; the few that only some see (the
 * MR rows span at most 4 positions), [lo, hi), a guarded one; past hi, none.
 * One body for every width (nv is a constant once inlined): the products fuse into FMAs
 * (-ffp-contract=fast) however the compiler sees fit, and a body of another shape for the
 * narrow dims fused them differently for a row alone than for a row beside others (GCC 12,
 * -O3 -march=znver3), so a head dim that is not a multiple of NV * VL (16, 20, 24, 48, 80 on
 * AVX2) changed in the last bit with the rows batched beside it (docs/DEVELOPING.md). */
static inline __attribute__((always_inline)) void values_cols(
        const float *p, const float *v, int64_t ldv, int D, const float *alpha, const int *lim,
        int lo, int hi, int d0, int nv, float *o) {
    vf acc[MR][NV];
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < nv; j++) acc[i][j] = vload(o + (size_t)i * D + d0 + j * VL) * alpha[i];
    for (int c = 0; c < hi; c++) {
        const float *vr = v + c * ldv + d0;
        vf vv[NV];
        for (int j = 0; j < nv; j++) vv[j] = vload(vr + j * VL);
        if (c < lo) {
            for (int i = 0; i < MR; i++) {
                float pv = p[(size_t)i * TK + c];
                for (int j = 0; j < nv; j++) acc[i][j] += vv[j] * pv;
            }
        } else {
            for (int i = 0; i < MR; i++) {
                if (c >= lim[i]) continue;
                float pv = p[(size_t)i * TK + c];
                for (int j = 0; j < nv; j++) acc[i][j] += vv[j] * pv;
            }
        }
    }
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < nv; j++) vstore(o + (size_t)i * D + d0 + j * VL, acc[i][j]);
}

static void values_tile(const float *p, const float *v, int64_t ldv, int D, const float *alpha,
                        const int *lim, float *o) {
    int lo = lim[0], hi = lim[0];
    for (int i = 1; i < MR; i++) {
        lo = lim[i] < lo ? lim[i] : lo;
        hi = lim[i] > hi ? lim[i] : hi;
    }
    int d0 = 0;
    for (; d0 + NV * VL <= D; d0 += NV * VL) values_cols(p, v, ldv, D, alpha, lim, lo, hi, d0, NV, o);
    for (; d0 + VL <= D; d0 += VL) values_cols(p, v, ldv, D, alpha, lim, lo, hi, d0, 1, o);
    for (; d0 < D; d0++) {
        for (int i = 0; i < MR; i++) {
            float a = o[(size_t)i * D + d0] * alpha[i];
            for (int c = 0; c < lim[i]; c++) a += v[c * ldv + d0] * p[(size_t)i * TK + c];
            o[(size_t)i * D + d0] = a;
        }
    }
}

/* ---- one work item ----------------------------------------------------------------------- */

static int max_queries(int G) { return G > MAX_QUERIES ? G : MAX_QUERIES; }
static int pad_mr(int m) { return (m + MR - 1) / MR * MR; }

int st_attention_key_tile(void) { return TK; }

size_t st_attention_scratch_bytes(int Q, int KV, int D) {
    size_t mp = (size_t)pad_mr(max_queries(Q / KV));
    /* qp [Mp, D], o [Mp, D], s [Mp, TK], kt [D, TK], vt [TK, D], m/l/alpha [Mp], lim [Mp] */
    size_t floats = 2 * mp * D + mp * TK + 2 * (size_t)D * TK + 4 * mp;
    return (floats * sizeof(float) + 63) / 64 * 64 + 64;
}

typedef struct {
    float *qp, *o, *s, *kt, *vt, *mrow, *lrow, *alpha;
    int *lim;                      /* [Mp] keys of the current tile each query vector sees */
} scratch_t;

static scratch_t carve(void *base, int Q, int KV, int D) {
    size_t mp = (size_t)pad_mr(max_queries(Q / KV));
    float *f = (float *)(((uintptr_t)base + 63) / 64 * 64);
    scratch_t s;
    s.qp = f; f += mp * D;
    s.o = f; f += mp * D;
    s.s = f; f += mp * TK;
    s.kt = f; f += (size_t)D * TK;
    s.vt = f; f += (size_t)TK * D;
    s.mrow = f; f += mp;
    s.lrow = f; f += mp;
    s.alpha = f; f += mp;
    s.lim = (int *)f;
    return s;
}

/* Rows [b0, b1) (run-relative) of one run and KV head h. */
static void attend_item(const float *q, int Q, int KV, int D, float scale, const st_attn_run *run,
                        int h, int64_t b0, int64_t b1, float *out, const scratch_t *sc) {
    const int G = Q / KV;
    const int M = (int)(b1 - b0) * G, Mp = pad_mr(M);
    const int64_t ldq = (int64_t)Q * D;
    const int64_t n_keys = run->pos0 + b1;      /* the last row sees cells [0, pos0 + b1) */
    const size_t k_head = (size_t)run->k_tiles * D * TK, v_head = (size_t)run->cap * D;
    const void *kh = run->is_f16 ? (const void *)((const uint16_t *)run->k + h * k_head)
                                 : (const void *)((const float *)run->k + h * k_head);
    const void *vh = run->is_f16 ? (const void *)((const uint16_t *)run->v + h * v_head)
                                 : (const void *)((const float *)run->v + h * v_head);
    /* query vector m = (row b0 + m / G, head h * G + m % G), scaled once here */
    for (int m = 0; m < Mp; m++) {
        float *dst = sc->qp + (size_t)m * D;
        if (m >= M) { memset(dst, 0, (size_t)D * sizeof(float)); continue; }
        const float *src = q + (run->row0 + b0 + m / G) * ldq + (int64_t)(h * G + m % G) * D;
        for (int d = 0; d < D; d++) dst[d] = src[d] * scale;
    }
    memset(sc->o, 0, (size_t)Mp * D * sizeof(float));
    for (int m = 0; m < Mp; m++) {
        sc->mrow[m] = -INFINITY;
        sc->lrow[m] = 0.0f;
    }
    vi lane;
    for (int i = 0; i < VL; i++) lane[i] = i;

    for (int64_t t0 = 0; t0 < n_keys; t0 += TK) {
        const int nk = n_keys - t0 < TK ? (int)(n_keys - t0) : TK;
        /* ---- K tile [D, TK] as stored (float16 converted); keys past the last are stale
         * cells whose scores the mask drops ---- */
        const float *kt = sc->kt;
        if (run->is_f16)
            half_to_float((const uint16_t *)kh + t0 * D, sc->kt, D * TK);
        else
            kt = (const float *)kh + t0 * D;
        /* ---- V tile: the cells themselves when whole float32, else a zero-padded copy ---- */
        const float *vt = sc->vt;
        int64_t ldv = D;
        if (!run->is_f16 && nk == TK) {
            vt = (const float *)vh + t0 * D;
        } else {
            if (run->is_f16)
                half_to_float((const uint16_t *)vh + t0 * D, sc->vt, nk * D);
            else
                memcpy(sc->vt, (const float *)vh + t0 * D, (size_t)nk * D * sizeof(float));
            memset(sc->vt + (size_t)nk * D, 0, (size_t)(TK - nk) * D * sizeof(float));
        }
        /* ---- scores, then the online softmax per query vector ---- */
        for (int i = 0; i < Mp; i += MR)
            scores_tile(sc->qp + (size_t)i * D, D, kt, sc->s + (size_t)i * TK);
        for (int m = 0; m < Mp; m++) {
            float *sr = sc->s + (size_t)m * TK;                             /* [TK] */
            int64_t lim = m < M ? run->pos0 + b0 + m / G - t0 + 1 : 0;      /* keys it sees */
            if (lim > TK) lim = TK;
            sc->lim[m] = lim > 0 ? (int)lim : 0;
            if (lim <= 0) {     /* a tile wholly in this row's future: no change at all */
                sc->alpha[m] = 1.0f;
                memset(sr, 0, TK * sizeof(float));
                continue;
            }
            const vi limv = (vi){0} + (int32_t)lim;
            vf mx = vsplat(-INFINITY);
            for (int c0 = 0; c0 < TK; c0 += VL) {
                vf x = vselect(lane + c0 < limv, vload(sr + c0), vsplat(-INFINITY));
                mx = vselect(x > mx, x, mx);
            }
            const float m_tile = hmax(mx);
            const float m_new = m_tile > sc->mrow[m] ? m_tile : sc->mrow[m];
            sc->alpha[m] = expf(sc->mrow[m] - m_new);     /* 0 on the first tile, 1 if same */
            sc->mrow[m] = m_new;
            const vf mn = vsplat(m_new);
            vf sum = vsplat(0.0f);
            for (int c0 = 0; c0 < TK; c0 += VL) {
                vf p = vselect(lane + c0 < limv, vexp(vload(sr + c0) - mn), vsplat(0.0f));
                vstore(sr + c0, p);
                sum += p;
            }
            sc->lrow[m] = sc->lrow[m] * sc->alpha[m] + hsum(sum);
        }
        for (int i = 0; i < Mp; i += MR)
            values_tile(sc->s + (size_t)i * TK, vt, ldv, D, sc->alpha + i, sc->lim + i,
                        sc->o + (size_t)i * D);
    }
    for (int m = 0; m < M; m++) {
        float *dst = out + (run->row0 + b0 + m / G) * ldq + (int64_t)(h * G + m % G) * D;
        const float inv = 1.0f / sc->lrow[m];
        for (int d = 0; d < D; d++) dst[d] = sc->o[(size_t)m * D + d] * inv;
    }
}

/* ---- the threaded pass over all runs ---------------------------------------------------- */

void st_attention(const float *q, int Q, int KV, int D, float scale, const st_attn_run *runs,
                  int num_runs, float *out, void *scratch, int num_threads) {
    const int G = Q / KV;
    const int rows_per_item = max_queries(G) / G;
    const size_t scratch_bytes = st_attention_scratch_bytes(Q, KV, D);
    int64_t num_items = 0;
    double macs = 0.0;
    for (int r = 0; r < num_runs; r++) {
        num_items += (runs[r].num_rows + rows_per_item - 1) / rows_per_item * KV;
        macs += 2.0 * Q * D * (double)runs[r].num_rows * (double)(runs[r].pos0 + runs[r].num_rows);
    }
    const int is_parallel = num_threads > 1 && num_items > 1 && macs >= ST_MIN_PARALLEL_MACS;
    #pragma omp parallel num_threads(num_threads) if (is_parallel)
    {
        int tid = 0;
#ifdef _OPENMP
        tid = omp_get_thread_num();
#endif
        const scratch_t sc = carve((char *)scratch + (size_t)tid * scratch_bytes, Q, KV, D);
        /* the last blocks of a run see the most keys: hand them out first */
        #pragma omp for schedule(dynamic, 1)
        for (int64_t it = num_items - 1; it >= 0; it--) {
            int64_t local = it;
            int r = 0;
            for (; r < num_runs; r++) {
                int64_t n = (runs[r].num_rows + rows_per_item - 1) / rows_per_item * KV;
                if (local < n) break;
                local -= n;
            }
            const int h = (int)(local % KV);
            const int64_t b0 = local / KV * rows_per_item;
            const int64_t b1 = b0 + rows_per_item < runs[r].num_rows ? b0 + rows_per_item
                                                                      : runs[r].num_rows;
            attend_item(q, Q, KV, D, scale, &runs[r], h, b0, b1, out, &sc);
        }
    }
}
