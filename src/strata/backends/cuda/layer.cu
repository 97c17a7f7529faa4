// Every step of a window that is not a weight product: embedding rows, RMSNorm (+ 8-bit
// quantisation for the next product), QK-norm + RoPE + KV append, attention over the fp16 KV
// cache, the router's softmax + top-k, grouping of (row, expert) pairs by expert, the combine
// and greedy argmax. Per-row data (tokens, positions, KV bases) comes from a device
// descriptor, so one captured graph serves every window of the same shape.
//
// Legend: R = window rows, H = hidden, Q = query heads, KVH = KV heads, D = head dim,
// C = a KV's capacity (cells), E = experts, K = experts per row, P = R * K pairs, V = vocab.
// KV cache of one sequence: half [L, 2 (K, V), KVH, C, D].
#include "common.cuh"

#define NORM_THREADS 256

// ---- embedding rows: x[r] = dequant(table[tokens[r]]); grid R, block 256 -------------------
template <int QT>
__device__ __forceinline__ void embed_body(const uint8_t *table, long long row_bytes, int H,
                                           const int *tokens, float *x) {
    const int r = blockIdx.x;
    const uint8_t *row = table + (long long)tokens[r] * row_bytes;
    for (int c = threadIdx.x; c < H; c += blockDim.x) x[(long long)r * H + c] = dequant_one<QT>(row, c);
}

#define EMBED_KERNEL(NAME, QT)                                                                \
    extern "C" __global__ void embed_##NAME(const uint8_t *table, long long row_bytes, int H, \
                                            const int *tokens, float *x) {                    \
        embed_body<QT>(table, row_bytes, H, tokens, x);                                       \
    }
EMBED_KERNEL(f32, ST_F32)
EMBED_KERNEL(f16, ST_F16)
EMBED_KERNEL(bf16, ST_BF16)
EMBED_KERNEL(q8_0, ST_Q8_0)
EMBED_KERNEL(q4_0, ST_Q4_0)
EMBED_KERNEL(q4_k, ST_Q4_K)
EMBED_KERNEL(q5_k, ST_Q5_K)
EMBED_KERNEL(q6_k, ST_Q6_K)

__device__ __forceinline__ float block_sum(float v, float *scratch) {
    // scratch: [32] shared floats
    v = warp_sum(v);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    const int num_warps = blockDim.x >> 5;
    float t = 0.0f;
    for (int i = 0; i < num_warps; i++) t += scratch[i];  // same order in every thread
    return t;
}

// ---- RMSNorm of row rows[r] (r when rows is NULL) into out[r] [H], and the 8-bit form for
// the next product when q is not NULL (H % 32 == 0). grid R, block NORM_THREADS ------------
extern "C" __global__ void __launch_bounds__(NORM_THREADS)
rmsnorm_q8(const float *__restrict__ x, const float *__restrict__ w, float eps, int H,
           const int *__restrict__ rows, float *__restrict__ out, int8_t *__restrict__ q,
           float *__restrict__ d) {
    __shared__ float scratch[32];
    const int r = blockIdx.x;
    const float *xr = x + (long long)(rows ? rows[r] : r) * H;  // [H]
    float *o = out + (long long)r * H;                           // [H]
    float ss = 0.0f;
    for (int c = threadIdx.x; c < H; c += blockDim.x) ss = fmaf(xr[c], xr[c], ss);
    ss = block_sum(ss, scratch);
    const float scale = 1.0f / sqrtf(ss / (float)H + eps);
    for (int c = threadIdx.x; c < H; c += blockDim.x) o[c] = (xr[c] * scale) * w[c];
    if (q == nullptr) return;
    __syncthreads();  // o is read back by other threads below
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, num_warps = blockDim.x >> 5;
    for (int b = warp; b < (H >> 5); b += num_warps) {
        const float v = o[32 * b + lane];
        const float amax = warp_max(fabsf(v));
        const float dd = amax / 127.0f;
        const float id = dd > 0.0f ? 1.0f / dd : 0.0f;
        q[(long long)r * H + 32 * b + lane] = (int8_t)__float2int_rn(v * id);
        if (lane == 0) d[(long long)r * (H >> 5) + b] = dd;
    }
}

// ---- QK-norm (when norm weights are given) + NEOX RoPE of q and k, K/V written as fp16 into
// each row's KV at cell pos[r]. q [R, Q*D] is rotated in place. grid (R, Q + 2*KVH), block 32.
extern "C" __global__ void qk_rope_append(
    float *__restrict__ q, const float *__restrict__ k, const float *__restrict__ v,
    const float *__restrict__ q_norm, const float *__restrict__ k_norm,
    const float *__restrict__ inv_freq, float eps, const unsigned long long *__restrict__ kv_base,
    const int *__restrict__ pos, const int *__restrict__ cap, int layer, int Q, int KVH, int D) {
    const int r = blockIdx.x, h = blockIdx.y, lane = threadIdx.x;
    const int half_d = D >> 1;
    const int C = cap[r];
    __half *cache = reinterpret_cast<__half *>(kv_base[r]);
    if (h >= Q + KVH) {  // a V head: copy as fp16
        const int j = h - Q - KVH;
        const float *src = v + ((long long)r * KVH + j) * D;
        __half *dst = cache + (((long long)layer * 2 + 1) * KVH + j) * C * D + (long long)pos[r] * D;
        for (int i = lane; i < D; i += WARP) dst[i] = __float2half_rn(src[i]);
        return;
    }
    const bool is_q = h < Q;
    float *src = is_q ? q + ((long long)r * Q + h) * D
                      : const_cast<float *>(k) + ((long long)r * KVH + (h - Q)) * D;  // [D]
    const float *nw = is_q ? q_norm : k_norm;
    float scale = 1.0f;
    if (nw != nullptr) {
        float ss = 0.0f;
        for (int i = lane; i < D; i += WARP) ss = fmaf(src[i], src[i], ss);
        ss = warp_sum(ss);
        scale = 1.0f / sqrtf(ss / (float)D + eps);
    }
    const float p = (float)pos[r];
    __half *kdst = is_q ? nullptr
                        : cache + (((long long)layer * 2) * KVH + (h - Q)) * C * D + (long long)pos[r] * D;
    for (int i = lane; i < half_d; i += WARP) {
        float x1 = src[i], x2 = src[i + half_d];
        if (nw != nullptr) {
            x1 = (x1 * scale) * nw[i];
            x2 = (x2 * scale) * nw[i + half_d];
        }
        const float f = p * inv_freq[i];
        const float c = cosf(f), s = sinf(f);
        const float o1 = x1 * c - x2 * s, o2 = x2 * c + x1 * s;
        if (is_q) {
            src[i] = o1;
            src[i + half_d] = o2;
        } else {
            kdst[i] = __float2half_rn(o1);
            kdst[i + half_d] = __float2half_rn(o2);
        }
    }
}

// ---- causal attention of row r, query head h, over cells [0, pos[r]] of its KV ------------
// grid (R, Q), block ATT_WARPS * 32. Each warp takes chunks of 32 cells: lane j scores cell
// c0 + j (its whole K row, 16-byte loads), the chunk updates the warp's online softmax, and
// the chunk's V rows are accumulated with each lane holding D / 32 output dims. The warps
// merge at the end. out [R, Q*D] float; when outq is not NULL (D % 32 == 0) also its 8-bit
// form for the output projection. D % 8 == 0, D <= 32 * ATT_DMAX.
#define ATT_WARPS 4
#define ATT_DMAX 8
extern "C" __global__ void __launch_bounds__(ATT_WARPS * 32)
attention(const float *__restrict__ q, float *__restrict__ out, int8_t *__restrict__ outq,
          float *__restrict__ outd, const unsigned long long *__restrict__ kv_base,
          const int *__restrict__ pos, const int *__restrict__ cap, int layer, int Q, int KVH,
          int D, float scale) {
    __shared__ float sq[32 * ATT_DMAX];
    __shared__ float sm[ATT_WARPS], sl[ATT_WARPS];
    __shared__ float sacc[ATT_WARPS][32 * ATT_DMAX];
    const int r = blockIdx.x, h = blockIdx.y;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int kvh = h / (Q / KVH), C = cap[r], last = pos[r];
    const __half *cache = reinterpret_cast<const __half *>(kv_base[r]);
    const __half *keys = cache + (((long long)layer * 2) * KVH + kvh) * C * D;        // [C, D]
    const __half *values = cache + (((long long)layer * 2 + 1) * KVH + kvh) * C * D;  // [C, D]
    for (int i = threadIdx.x; i < D; i += blockDim.x) sq[i] = q[((long long)r * Q + h) * D + i];
    __syncthreads();
    float m = -INFINITY, l = 0.0f, acc[ATT_DMAX];
#pragma unroll
    for (int i = 0; i < ATT_DMAX; i++) acc[i] = 0.0f;
    for (int c0 = warp * 32; c0 <= last; c0 += ATT_WARPS * 32) {
        const int c = c0 + lane;
        float s = -INFINITY;
        if (c <= last) {
            const uint4 *kc = reinterpret_cast<const uint4 *>(keys + (long long)c * D);  // [D/8]
            float dot = 0.0f;
#pragma unroll 4
            for (int i = 0; i < (D >> 3); i++) {
                const uint4 raw = kc[i];
                const __half2 *hp = reinterpret_cast<const __half2 *>(&raw);
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    const float2 f = __half22float2(hp[j]);
                    dot = fmaf(sq[8 * i + 2 * j], f.x, dot);
                    dot = fmaf(sq[8 * i + 2 * j + 1], f.y, dot);
                }
            }
            s = dot * scale;
        }
        const float m_new = fmaxf(m, warp_max(s));
        const float corr = expf(m - m_new);
        const float p = c <= last ? expf(s - m_new) : 0.0f;
        l = l * corr + warp_sum(p);
#pragma unroll
        for (int i = 0; i < ATT_DMAX; i++) acc[i] *= corr;
        const int num_cells = min(32, last - c0 + 1);
#pragma unroll 8
        for (int j = 0; j < num_cells; j++) {
            const float pj = __shfl_sync(0xffffffffu, p, j);
            const __half *vc = values + (long long)(c0 + j) * D;
#pragma unroll
            for (int i = 0; i < ATT_DMAX; i++) {
                const int e = lane + 32 * i;
                if (e < D) acc[i] = fmaf(pj, __half2float(vc[e]), acc[i]);
            }
        }
        m = m_new;
    }
    if (lane == 0) {
        sm[warp] = m;
        sl[warp] = l;
    }
#pragma unroll
    for (int i = 0; i < ATT_DMAX; i++) sacc[warp][lane + 32 * i] = acc[i];
    __syncthreads();
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < ATT_WARPS; w++) mx = fmaxf(mx, sm[w]);
    float total = 0.0f, wf[ATT_WARPS];
#pragma unroll
    for (int w = 0; w < ATT_WARPS; w++) {
        wf[w] = sm[w] == -INFINITY ? 0.0f : expf(sm[w] - mx);
        total += sl[w] * wf[w];
    }
    // warp w writes dims [32b, 32b + 32) for b = w, w + ATT_WARPS, ...
    for (int b = warp; b < ((D + 31) >> 5); b += ATT_WARPS) {
        const int e = 32 * b + lane;
        float o = 0.0f;
#pragma unroll
        for (int w = 0; w < ATT_WARPS; w++) o += (e < D ? sacc[w][e] : 0.0f) * wf[w];
        o = o / total;
        const long long at = ((long long)r * Q + h) * D + e;
        if (e < D) out[at] = o;
        if (outq != nullptr) {  // D % 32 == 0: this warp's 32 dims are one quantisation block
            const float amax = warp_max(fabsf(o));
            const float dd = amax / 127.0f;
            const float id = dd > 0.0f ? 1.0f / dd : 0.0f;
            outq[at] = (int8_t)__float2int_rn(o * id);
            if (lane == 0) outd[at >> 5] = dd;
        }
    }
}

// ---- router: softmax over E logits, top-K (largest first, ties to the lowest id), weights
// renormalised when norm != 0. grid R, block 32, shared E floats --------------------------
extern "C" __global__ void router_topk(const float *__restrict__ logits, int E, int K, int norm,
                                       int *__restrict__ ids, float *__restrict__ weights) {
    extern __shared__ float probs[];  // [E]
    const int r = blockIdx.x, lane = threadIdx.x;
    const float *x = logits + (long long)r * E;
    float mx = -INFINITY;
    for (int e = lane; e < E; e += WARP) mx = fmaxf(mx, x[e]);
    mx = warp_max(mx);
    float sum = 0.0f;
    for (int e = lane; e < E; e += WARP) {
        const float p = expf(x[e] - mx);
        probs[e] = p;
        sum += p;
    }
    sum = warp_sum(sum);
    for (int e = lane; e < E; e += WARP) probs[e] = probs[e] / sum;
    __syncwarp();
    float picked_sum = 0.0f;
    for (int k = 0; k < K; k++) {
        float best = -1.0f;
        int best_id = 0x7fffffff;
        for (int e = lane; e < E; e += WARP) {
            const float p = probs[e];
            if (p > best) { best = p; best_id = e; }  // ascending e: ties keep the lowest
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ob = __shfl_xor_sync(0xffffffffu, best, o);
            const int oi = __shfl_xor_sync(0xffffffffu, best_id, o);
            if (ob > best || (ob == best && oi < best_id)) { best = ob; best_id = oi; }
        }
        if (lane == 0) {
            ids[r * K + k] = best_id;
            weights[r * K + k] = best;
            probs[best_id] = -2.0f;  // taken
        }
        picked_sum += best;
        __syncwarp();
    }
    if (norm && lane == 0) {
        for (int k = 0; k < K; k++) weights[r * K + k] = weights[r * K + k] / picked_sum;
    }
}

// ---- the (row, k) pairs grouped by expert, experts ascending, pairs in row order within one:
// groups [G, 3] = (expert, first, count), *num_groups = G, act_rows[j] = the pair's row,
// out_rows[j] = the pair's index r*K + k. grid 1, block 256, shared 2*E ints -------------
extern "C" __global__ void group_pairs(const int *__restrict__ ids, int P, int K, int E,
                                       int *__restrict__ groups, int *__restrict__ num_groups,
                                       int *__restrict__ act_rows, int *__restrict__ out_rows) {
    extern __shared__ int shm[];
    int *count = shm, *first = shm + E;  // [E] each
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        int n = 0;
        for (int p = 0; p < P; p++) n += __ldg(ids + p) == e;
        count[e] = n;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int g = 0, at = 0;
        for (int e = 0; e < E; e++) {
            first[e] = at;
            if (count[e] > 0) {
                groups[3 * g] = e;
                groups[3 * g + 1] = at;
                groups[3 * g + 2] = count[e];
                g++;
                at += count[e];
            }
        }
        *num_groups = g;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        if (count[e] == 0) continue;
        int j = first[e];
        for (int p = 0; p < P; p++) {
            if (__ldg(ids + p) == e) {
                act_rows[j] = p / K;
                out_rows[j] = p;
                j++;
            }
        }
    }
}

// ---- x[r] += sum_k w[r,k] * Y[r*K + k] (+ sigmoid(gate[r]) * S[r] for a shared expert) -----
// grid ceil(R*H / 256), block 256
extern "C" __global__ void moe_combine(float *__restrict__ x, const float *__restrict__ Y,
                                       const float *__restrict__ w, int R, int K, int H,
                                       const float *__restrict__ S,
                                       const float *__restrict__ gate_logit) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)R * H) return;
    const int r = (int)(i / H), c = (int)(i % H);
    float acc = 0.0f;
    for (int k = 0; k < K; k++) acc = fmaf(w[r * K + k], Y[((long long)r * K + k) * H + c], acc);
    if (S != nullptr) {
        const float g = 1.0f / (1.0f + expf(-gate_logit[r]));
        acc = fmaf(g, S[(long long)r * H + c], acc);
    }
    x[i] += acc;
}

// ---- greedy choice: out[n] = argmax_v logits[n, v] (lowest id on ties); grid N, block 1024 --
extern "C" __global__ void __launch_bounds__(1024)
argmax_rows(const float *__restrict__ logits, int V, int *__restrict__ out) {
    __shared__ float sv[32];
    __shared__ int si[32];
    const float *x = logits + (long long)blockIdx.x * V;
    float best = -INFINITY;
    int best_id = 0x7fffffff;
    for (int v = threadIdx.x; v < V; v += blockDim.x) {
        if (x[v] > best) { best = x[v]; best_id = v; }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ob = __shfl_xor_sync(0xffffffffu, best, o);
        const int oi = __shfl_xor_sync(0xffffffffu, best_id, o);
        if (ob > best || (ob == best && oi < best_id)) { best = ob; best_id = oi; }
    }
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) { sv[warp] = best; si[warp] = best_id; }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int)(blockDim.x >> 5); w++)
            if (sv[w] > best || (sv[w] == best && si[w] < best_id)) { best = sv[w]; best_id = si[w]; }
        out[blockIdx.x] = best_id == 0x7fffffff ? 0 : best_id;
    }
}
