// The steps of a window around the products that are neither attention (attention.cu) nor the
// router (router.cu): embedding rows, RMSNorm (+ 8-bit quantisation for the next product; fused
// with the MoE combine), the combine and greedy argmax. Per-row data (tokens, positions, KV
// bases) comes from a device descriptor, so one captured graph serves every window of a shape.
//
// Legend: R = window rows, H = hidden, Q = query heads, KVH = KV heads, D = head dim,
// C = a KV's capacity (cells), E = experts, K = experts per row, P = R * K pairs, V = vocab,
// L = layers. KV cache of one sequence: half [L, 2 (K, V), KVH, C, D], or int8 cells
// [L, 2, KVH, C, D] followed by float scales [L, 2, KVH, C] (one per token and head). A row's
// kv_base is the cells' device address with bit 0 set for int8 cells (allocations are
// 256-byte aligned, so the bit is free and a window may mix both kinds of KV).
#include "common.cuh"

#define NORM_THREADS 256
#define NORM_VEC 8  // float4 per thread kept in registers: one-pass norms for H <= 8192

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
        kernel_entry();                                                                       \
        embed_body<QT>(table, row_bytes, H, tokens, x);                                       \
    }
EMBED_KERNEL(f32, ST_F32)
EMBED_KERNEL(f16, ST_F16)
EMBED_KERNEL(bf16, ST_BF16)
EMBED_KERNEL(q8_0, ST_Q8_0)
EMBED_KERNEL(q4_0, ST_Q4_0)
EMBED_KERNEL(q4_1, ST_Q4_1)
EMBED_KERNEL(q5_0, ST_Q5_0)
EMBED_KERNEL(q5_1, ST_Q5_1)
EMBED_KERNEL(iq4_nl, ST_IQ4_NL)
EMBED_KERNEL(q2_k, ST_Q2_K)
EMBED_KERNEL(q3_k, ST_Q3_K)
EMBED_KERNEL(q4_k, ST_Q4_K)
EMBED_KERNEL(q5_k, ST_Q5_K)
EMBED_KERNEL(q6_k, ST_Q6_K)
EMBED_KERNEL(iq4_xs, ST_IQ4_XS)
EMBED_KERNEL(iq2_xxs, ST_IQ2_XXS)
EMBED_KERNEL(iq2_xs, ST_IQ2_XS)
EMBED_KERNEL(iq2_s, ST_IQ2_S)
EMBED_KERNEL(iq3_xxs, ST_IQ3_XXS)
EMBED_KERNEL(iq3_s, ST_IQ3_S)
EMBED_KERNEL(iq1_s, ST_IQ1_S)
EMBED_KERNEL(iq1_m, ST_IQ1_M)

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

__device__ __forceinline__ bool is_one_pass_norm(int H) {
    return (H & 3) == 0 && H <= 4 * NORM_THREADS * NORM_VEC;
}

// RMSNorm of one row held in registers (float4 i of this thread = columns 4 * (tid +
// NORM_THREADS * i), zero past H) with sum of squares ss: o [H] = x * scale * w, and when q is
// not NULL its 8-bit form (8 lanes hold one 32-column block: amax by shuffles). The whole
// block calls it (shuffles); H % 32 == 0 when q is given.
__device__ __forceinline__ void norm_store(const float4 (&v)[NORM_VEC], float ss, int H,
                                           const float *__restrict__ w, float eps,
                                           float *__restrict__ o, int8_t *__restrict__ q,
                                           float *__restrict__ d) {
    const float scale = 1.0f / sqrtf(ss / (float)H + eps);
#pragma unroll
    for (int i = 0; i < NORM_VEC; i++) {
        const int c = 4 * (threadIdx.x + NORM_THREADS * i);
        if (4 * NORM_THREADS * i >= H) break;  // uniform: no thread has columns past here
        float4 y = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (c < H) {
            const float4 w4 = *reinterpret_cast<const float4 *>(w + c);
            y = make_float4((v[i].x * scale) * w4.x, (v[i].y * scale) * w4.y,
                            (v[i].z * scale) * w4.z, (v[i].w * scale) * w4.w);
            *reinterpret_cast<float4 *>(o + c) = y;
        }
        if (q != nullptr) {
            float amax = fmaxf(fmaxf(fabsf(y.x), fabsf(y.y)), fmaxf(fabsf(y.z), fabsf(y.w)));
#pragma unroll
            for (int s = 1; s < 8; s <<= 1)
                amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, s));
            const float dd = amax / 127.0f;
            const float id = dd > 0.0f ? 1.0f / dd : 0.0f;
            if (c < H) {
                const int packed = pack4(q8_of(y.x, id), q8_of(y.y, id), q8_of(y.z, id),
                                         q8_of(y.w, id));
                *reinterpret_cast<int *>(q + c) = packed;
                if ((c & 31) == 0) d[c >> 5] = dd;
            }
        }
    }
}

// ---- RMSNorm of row rows[r] (r when rows is NULL) into out[r] [H], and the 8-bit form for
// the next product when q is not NULL (H % 32 == 0). One pass from registers when
// is_one_pass_norm(H). grid R, block NORM_THREADS ---------------------------------------------
extern "C" __global__ void __launch_bounds__(NORM_THREADS)
rmsnorm_q8(const float *__restrict__ x, const float *__restrict__ w, float eps, int H,
           const int *__restrict__ rows, float *__restrict__ out, int8_t *__restrict__ q,
           float *__restrict__ d) {
    kernel_entry();
    __shared__ float scratch[32];
    const int r = blockIdx.x;
    const float *xr = x + (long long)(rows ? rows[r] : r) * H;  // [H]
    float *o = out + (long long)r * H;                           // [H]
    if (is_one_pass_norm(H)) {
        float4 v[NORM_VEC];
        float ss = 0.0f;
#pragma unroll
        for (int i = 0; i < NORM_VEC; i++) {
            const int c = 4 * (threadIdx.x + NORM_THREADS * i);
            v[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (c < H) {
                v[i] = *reinterpret_cast<const float4 *>(xr + c);
                ss = fmaf(v[i].x, v[i].x, fmaf(v[i].y, v[i].y, fmaf(v[i].z, v[i].z,
                                                                    fmaf(v[i].w, v[i].w, ss))));
            }
        }
        ss = block_sum(ss, scratch);
        norm_store(v, ss, H, w, eps, o, q ? q + (long long)r * H : nullptr,
                   q ? d + (long long)r * (H >> 5) : nullptr);
        return;
    }
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
        q[(long long)r * H + 32 * b + lane] = q8_of(v, id);
        if (lane == 0) d[(long long)r * (H >> 5) + b] = dd;
    }
}

// ---- the MoE combine of row r fused with the next RMSNorm: x[r] += sum_k wts[r,k] *
// Y[r*K + k] (+ sigmoid(gate[r]) * S[r] with a shared expert), then out[r] (+ q, d) = the
// RMSNorm of the new x[r] with weight nw (the next layer's attention norm). Sums in the order
// of moe_combine. is_one_pass_norm(H) only. grid R, block NORM_THREADS ----------------------
extern "C" __global__ void __launch_bounds__(NORM_THREADS)
combine_norm(float *__restrict__ x, const float *__restrict__ Y, const float *__restrict__ wts,
             int K, int H, const float *__restrict__ S, const float *__restrict__ gate_logit,
             const float *__restrict__ nw, float eps, float *__restrict__ out,
             int8_t *__restrict__ q, float *__restrict__ d) {
    kernel_entry();
    __shared__ float scratch[32];
    const int r = blockIdx.x;
    float *xr = x + (long long)r * H;  // [H]
    const float g = S != nullptr ? 1.0f / (1.0f + expf(-gate_logit[r])) : 0.0f;
    float4 v[NORM_VEC];
    float ss = 0.0f;
#pragma unroll
    for (int i = 0; i < NORM_VEC; i++) {
        const int c = 4 * (threadIdx.x + NORM_THREADS * i);
        v[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (c < H) {
            float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            for (int k = 0; k < K; k++) {
                const float wk = wts[r * K + k];
                const float4 y =
                    *reinterpret_cast<const float4 *>(Y + ((long long)r * K + k) * H + c);
                acc = make_float4(fmaf(wk, y.x, acc.x), fmaf(wk, y.y, acc.y),
                                  fmaf(wk, y.z, acc.z), fmaf(wk, y.w, acc.w));
            }
            if (S != nullptr) {
                const float4 s = *reinterpret_cast<const float4 *>(S + (long long)r * H + c);
                acc = make_float4(fmaf(g, s.x, acc.x), fmaf(g, s.y, acc.y), fmaf(g, s.z, acc.z),
                                  fmaf(g, s.w, acc.w));
            }
            const float4 x4 = *reinterpret_cast<const float4 *>(xr + c);
            v[i] = make_float4(x4.x + acc.x, x4.y + acc.y, x4.z + acc.z, x4.w + acc.w);
            *reinterpret_cast<float4 *>(xr + c) = v[i];
            ss = fmaf(v[i].x, v[i].x, fmaf(v[i].y, v[i].y, fmaf(v[i].z, v[i].z,
                                                                fmaf(v[i].w, v[i].w, ss))));
        }
    }
    if (nw == nullptr) return;
    ss = block_sum(ss, scratch);
    norm_store(v, ss, H, nw, eps, out + (long long)r * H, q ? q + (long long)r * H : nullptr,
               q ? d + (long long)r * (H >> 5) : nullptr);
}

// ---- x[r] += sum_k w[r,k] * Y[r*K + k] (+ sigmoid(gate[r]) * S[r] for a shared expert) -----
// grid ceil(R*H / 256), block 256
extern "C" __global__ void moe_combine(float *__restrict__ x, const float *__restrict__ Y,
                                       const float *__restrict__ w, int R, int K, int H,
                                       const float *__restrict__ S,
                                       const float *__restrict__ gate_logit) {
    kernel_entry();
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

// ---- the shared expert's gate logit: out[r] = dot(x[r], w), x [R, H], w [H] (float32). One
// warp per row, so a row's sum is the same in every window. grid ceil(R / 4), block 128 ------
extern "C" __global__ void __launch_bounds__(128)
gate_logit_rows(const float *__restrict__ x, const float *__restrict__ w, int R, int H,
                float *__restrict__ out) {
    kernel_entry();
    const int r = blockIdx.x * 4 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (r >= R) return;
    const float *xr = x + (long long)r * H;  // [H]
    float acc = 0.0f;
    if ((H & 3) == 0) {
        for (int c = 4 * lane; c < H; c += 128) {
            const float4 a = *reinterpret_cast<const float4 *>(xr + c);
            const float4 b = *reinterpret_cast<const float4 *>(w + c);
            acc = fmaf(a.x, b.x, fmaf(a.y, b.y, fmaf(a.z, b.z, fmaf(a.w, b.w, acc))));
        }
    } else {
        for (int c = lane; c < H; c += 32) acc = fmaf(xr[c], w[c], acc);
    }
    acc = warp_sum(acc);
    if (lane == 0) out[r] = acc;
}

// ---- greedy choice: out[n] = argmax_v logits[n, v] (lowest id on ties), -1 when the row holds
// a NaN; grid N, block 1024 --
extern "C" __global__ void __launch_bounds__(1024)
argmax_rows(const float *__restrict__ logits, int V, int *__restrict__ out) {
    kernel_entry();
    __shared__ float sv[32];
    __shared__ int si[32];
    const float *x = logits + (long long)blockIdx.x * V;
    float best = -INFINITY;
    int best_id = 0x7fffffff, has_nan = 0;
    for (int v = threadIdx.x; v < V; v += blockDim.x) {
        const float f = x[v];
        has_nan |= isnan(f);
        if (f > best) { best = f; best_id = v; }
    }
    has_nan = __syncthreads_or(has_nan);
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
        out[blockIdx.x] = has_nan ? -1 : best_id == 0x7fffffff ? 0 : best_id;
    }
}
