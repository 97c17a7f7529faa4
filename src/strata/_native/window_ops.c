/* The window loop's small steps: RoPE, the router's softmax + top-k, KV cell writes and the
 * element-wise glue between the products. Each row is computed on its own (no cross-row sums),
 * in float32 with the same operation order as the numpy/torch definitions. */
#include <math.h>
#include <string.h>
#include "quant.h"
#include "silu.h"
#include "window.h"

/* Legend: R = rows, E = experts, K = experts per row, D = head dim, KV = KV heads. */

/* ---- RoPE (NEOX) ----------------------------------------------------------------------- */

void st_rope_table(const int64_t *positions, int64_t R, const float *inv_freq, int half,
                   float *cos_out, float *sin_out) {
    for (int64_t r = 0; r < R; r++) {
        const float pos = (float)positions[r];
        for (int i = 0; i < half; i++) {
            float angle = pos * inv_freq[i];
            cos_out[r * half + i] = cosf(angle);
            sin_out[r * half + i] = sinf(angle);
        }
    }
}

void st_rope_neox(float *x, int64_t R, int heads, int D, int n_rot, const float *cos_t,
                  const float *sin_t) {
    const int half = n_rot / 2;
    for (int64_t r = 0; r < R; r++) {
        const float *c = cos_t + r * half, *s = sin_t + r * half;     /* [n_rot/2] */
        for (int j = 0; j < heads; j++) {
            float *x1 = x + (r * heads + j) * D, *x2 = x1 + half;    /* [n_rot/2] each */
            for (int i = 0; i < half; i++) {
                float a = x1[i], b = x2[i];
                x1[i] = a * c[i] - b * s[i];
                x2[i] = b * c[i] + a * s[i];
            }
        }
    }
}

/* ---- router -------------------------------------------------------------------------------- */

void st_router_topk(float *logits, int64_t R, int E, int K, int norm_topk,
                    int32_t *experts, float *weights) {
    for (int64_t r = 0; r < R; r++) {
        float *p = logits + r * E;                                     /* [E], becomes probs */
        int32_t *ids = experts + r * K;                                /* [K] */
        float *w = weights + r * K;                                    /* [K] */
        float mx = p[0];
        for (int e = 1; e < E; e++) mx = p[e] > mx ? p[e] : mx;
        float sum = 0.0f;
        for (int e = 0; e < E; e++) {
            p[e] = expf(p[e] - mx);
            sum += p[e];
        }
        for (int e = 0; e < E; e++) p[e] /= sum;
        /* a strict comparison keeps the lowest id among equal probabilities; a taken expert
         * is marked -1 (probabilities are >= 0) */
        for (int k = 0; k < K; k++) {
            int best = 0;
            for (int e = 1; e < E; e++) best = p[e] > p[best] ? e : best;
            ids[k] = best;
            w[k] = p[best];
            p[best] = -1.0f;
        }
        if (norm_topk) {
            float total = 0.0f;
            for (int k = 0; k < K; k++) total += w[k];
            for (int k = 0; k < K; k++) w[k] /= total;
        }
    }
}

/* ---- KV cells ------------------------------------------------------------------------------ */

uint16_t st_fp32_to_fp16(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    const uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) return (uint16_t)(sign | (ax > 0x7f800000u ? 0x7e00u : 0x7c00u));
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);   /* >= 65520 rounds to inf */
    if (ax < 0x38800000u) {
        /* a subnormal half (or zero): units of 2^-24, rounded to nearest even by lrintf */
        float v;
        memcpy(&v, &ax, sizeof v);
        return (uint16_t)(sign | (uint32_t)lrintf(v * 16777216.0f));
    }
    uint32_t h = (((ax >> 23) - 112u) << 10) | ((ax & 0x7fffffu) >> 13);
    const uint32_t rest = ax & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) h++;   /* a carry lifts the exponent */
    return (uint16_t)(sign | h);
}

void st_kv_write(void *cells, int is_f16, int64_t cap, int64_t start, const float *src,
                 int64_t n, int KV, int D) {
    for (int64_t t = 0; t < n; t++) {
        for (int j = 0; j < KV; j++) {
            const float *row = src + (t * KV + j) * D;                  /* [D] */
            const int64_t cell = ((int64_t)j * cap + start + t) * D;
            if (is_f16) {
                uint16_t *dst = (uint16_t *)cells + cell;
                for (int d = 0; d < D; d++) dst[d] = st_fp32_to_fp16(row[d]);
            } else {
                memcpy((float *)cells + cell, row, (size_t)D * sizeof(float));
            }
        }
    }
}

void st_kv_write_keys(void *cells, int is_f16, int64_t k_tiles, int64_t start, const float *src,
                      int64_t n, int KV, int D) {
    for (int64_t t = 0; t < n; t++) {
        const int64_t pos = start + t;
        for (int j = 0; j < KV; j++) {
            const float *row = src + (t * KV + j) * D;                  /* [D] */
            /* key pos is column pos % TILE of tile pos / TILE: [D, TILE] */
            const int64_t at = ((int64_t)j * k_tiles + pos / ST_KEY_TILE) * D * ST_KEY_TILE
                               + pos % ST_KEY_TILE;
            if (is_f16) {
                uint16_t *dst = (uint16_t *)cells + at;
                for (int d = 0; d < D; d++) dst[(int64_t)d * ST_KEY_TILE] = st_fp32_to_fp16(row[d]);
            } else {
                float *dst = (float *)cells + at;
                for (int d = 0; d < D; d++) dst[(int64_t)d * ST_KEY_TILE] = row[d];
            }
        }
    }
}

/* ---- element-wise ---------------------------------------------------------------------- */

void st_add(float *x, const float *y, int64_t num_values) {
    for (int64_t i = 0; i < num_values; i++) x[i] += y[i];
}

void st_add_bias(float *x, const float *b, int64_t T, int n) {
    for (int64_t t = 0; t < T; t++)
        for (int i = 0; i < n; i++) x[t * n + i] += b[i];
}

void st_silu_mul(float *g, const float *u, int64_t num_values) {
    st_silu_times(g, u, num_values);
}

void st_add_gated(float *out, const float *y, const float *logit, int64_t T, int n) {
    for (int64_t t = 0; t < T; t++) {
        const float gate = 1.0f / (1.0f + expf(-logit[t]));
        for (int i = 0; i < n; i++) out[t * n + i] += gate * y[t * n + i];
    }
}

/* ---- gated attention (qwen3next) ----------------------------------------------------------- */

void st_split_q_gate(float *qg, int64_t R, int heads, int D, float *q, float *gate) {
    for (int64_t r = 0; r < R; r++)
        for (int j = 0; j < heads; j++) {
            const float *src = qg + (r * heads + j) * 2 * D;           /* [2D]: q, then gate */
            memcpy(q + (r * heads + j) * D, src, D * sizeof(float));
            memcpy(gate + (r * heads + j) * D, src + D, D * sizeof(float));
        }
}

void st_mul_sigmoid(float *x, const float *gate, int64_t num_values) {
    for (int64_t i = 0; i < num_values; i++)
        x[i] *= 1.0f / (1.0f + expf(-gate[i]));
}
