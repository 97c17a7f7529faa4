// The router of a window: softmax + top-k per row, grouping of (row, expert) pairs by expert,
// and for float router weights the product + top-k + grouping in one launch.
//
// Legend: R = window rows, H = hidden, E = experts, K = experts per row, P = R * K pairs.
#include "common.cuh"

// ---- router helpers ------------------------------------------------------------------------
#define GROUP_CHUNK 1024  // pairs staged in shared memory at a time while grouping

// One row of the router (a warp): softmax over E logits x, top-K (largest first, ties to the
// lowest id) into ids/weights [K], renormalised when norm != 0. probs: [E] shared floats.
// x is read through L2 (__ldcg): other blocks of the launch may have written it.
__device__ __forceinline__ void topk_row(const float *x, int E, int K, int norm, float *probs,
                                         int *ids, float *weights) {
    const int lane = threadIdx.x & 31;
    float mx = -INFINITY;
    for (int e = lane; e < E; e += WARP) {
        probs[e] = __ldcg(x + e);  // read once; this lane alone uses probs[e] until __syncwarp
        mx = fmaxf(mx, probs[e]);
    }
    mx = warp_max(mx);
    float sum = 0.0f;
    for (int e = lane; e < E; e += WARP) {
        const float p = expf(probs[e] - mx);
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
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
        {  // two warp reductions: the largest key (probabilities >= 0 order as their bits;
           // taken and empty lanes, < 0, as 0), then the lowest id among the lanes holding it
            const unsigned key = best >= 0.0f ? __float_as_uint(best) + 1u : 0u;
            const unsigned top = __reduce_max_sync(0xffffffffu, key);
            best_id = (int)__reduce_min_sync(0xffffffffu,
                                             key == top ? (unsigned)best_id : 0x7fffffffu);
            best = __shfl_sync(0xffffffffu, best, __ffs(__ballot_sync(0xffffffffu,
                                                                      key == top)) - 1);
        }
#else
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ob = __shfl_xor_sync(0xffffffffu, best, o);
            const int oi = __shfl_xor_sync(0xffffffffu, best_id, o);
            if (ob > best || (ob == best && oi < best_id)) { best = ob; best_id = oi; }
        }
#endif
        if (lane == 0) {
            ids[k] = best_id;
            weights[k] = best;
            probs[best_id] = -2.0f;  // taken
        }
        picked_sum += best;
        __syncwarp();
    }
    if (norm && lane == 0) {
        for (int k = 0; k < K; k++) weights[k] = weights[k] / picked_sum;
    }
}

// One warp turns per-expert pair counts [E] (in place) into each expert's first pair index
// (experts ascending) and writes the non-empty experts' groups [G, 3] = (expert, first, count)
// and *num_groups = G, by warp scans over 32 experts at a time.
__device__ __forceinline__ void warp_groups_from_counts(int *counts, int E, int lane,
                                                        int *__restrict__ groups,
                                                        int *__restrict__ num_groups) {
    int carry = 0, gcarry = 0;
    for (int e0 = 0; e0 < E; e0 += WARP) {
        const int e = e0 + lane;
        const int n = e < E ? counts[e] : 0, nz = n > 0;
        int incl = n, gincl = nz;
#pragma unroll
        for (int o = 1; o < WARP; o <<= 1) {
            const int a = __shfl_up_sync(0xffffffffu, incl, o);
            const int b = __shfl_up_sync(0xffffffffu, gincl, o);
            if (lane >= o) {
                incl += a;
                gincl += b;
            }
        }
        const int at = carry + incl - n, gi = gcarry + gincl - nz;
        if (e < E) counts[e] = at;
        if (nz) {
            groups[3 * gi] = e;
            groups[3 * gi + 1] = at;
            groups[3 * gi + 2] = n;
        }
        carry += __shfl_sync(0xffffffffu, incl, WARP - 1);
        gcarry += __shfl_sync(0xffffffffu, gincl, WARP - 1);
    }
    if (lane == 0) *num_groups = gcarry;
}

// The (row, k) pairs grouped by expert (the whole block): experts ascending, pairs in row
// order within one: groups [G, 3] = (expert, first, count), *num_groups = G, act_rows[j] = the
// pair's row, out_rows[j] = the pair's index r*K + k. shm: ints [2E + GROUP_CHUNK]. ids are
// read through L2 (another block of the launch may have written them).
__device__ void group_body(const int *ids, int P, int K, int E, int *__restrict__ groups,
                           int *__restrict__ num_groups, int *__restrict__ act_rows,
                           int *__restrict__ out_rows, int *shm) {
    int *count = shm, *first = shm + E, *chunk = shm + 2 * E;  // [E], [E], [GROUP_CHUNK]
    for (int e = threadIdx.x; e < E; e += blockDim.x) count[e] = 0;
    for (int p0 = 0; p0 < P; p0 += GROUP_CHUNK) {
        const int n = min(GROUP_CHUNK, P - p0);
        __syncthreads();
        for (int j = threadIdx.x; j < n; j += blockDim.x) chunk[j] = __ldcg(ids + p0 + j);
        __syncthreads();
        for (int e = threadIdx.x; e < E; e += blockDim.x) {
            int c = 0;
#pragma unroll 16
            for (int j = 0; j < n; j++) c += chunk[j] == e;  // unrolled: shared loads overlap
            count[e] += c;
        }
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
    for (int p0 = 0; p0 < P; p0 += GROUP_CHUNK) {
        const int n = min(GROUP_CHUNK, P - p0);
        __syncthreads();
        for (int j = threadIdx.x; j < n; j += blockDim.x) chunk[j] = __ldcg(ids + p0 + j);
        __syncthreads();
        for (int e = threadIdx.x; e < E; e += blockDim.x) {
            if (count[e] == 0) continue;
            int at = first[e];
#pragma unroll 16
            for (int j = 0; j < n; j++) {
                if (chunk[j] == e) {
                    act_rows[at] = (p0 + j) / K;
                    out_rows[at] = p0 + j;
                    at++;
                }
            }
            first[e] = at;
        }
    }
}

// ---- router softmax + top-k alone (routers of a quantised type, after their product):
// grid R, block 32, shared E floats -----------------------------------------------------------
extern "C" __global__ void router_topk(const float *__restrict__ logits, int E, int K, int norm,
                                       int *__restrict__ ids, float *__restrict__ weights) {
    kernel_entry();
    extern __shared__ float probs[];  // [E]
    const int r = blockIdx.x;
    topk_row(logits + (long long)r * E, E, K, norm, probs, ids + r * K, weights + r * K);
}

// ---- grouping alone: grid 1, block 256, shared ints [2E + GROUP_CHUNK] ---------------------
extern "C" __global__ void group_pairs(const int *__restrict__ ids, int P, int K, int E,
                                       int *__restrict__ groups, int *__restrict__ num_groups,
                                       int *__restrict__ act_rows, int *__restrict__ out_rows) {
    kernel_entry();
    extern __shared__ int shm_group[];
    group_body(ids, P, K, E, groups, num_groups, act_rows, out_rows, shm_group);
}

// ---- grouping for prompt-sized windows: a stable counting sort by expert, the same output as
// group_pairs. Warp w takes a contiguous span of pairs; pass 1 counts its pairs per expert
// (__match_any_sync: one shared add per distinct expert per 32 pairs), a thread per expert turns
// the per-warp counts into offsets (warps in order), warp 0 scans the experts (groups, firsts),
// pass 2 writes each pair at first[e] + its warp's offset + its rank among the equal lanes. So
// pairs keep their order within an expert. grid 1, block GROUP_WIDE_THREADS, shared ints
// [(GROUP_WIDE_THREADS / 32 + 1) * E].
#define GROUP_WIDE_THREADS 1024
extern "C" __global__ void __launch_bounds__(GROUP_WIDE_THREADS)
group_pairs_wide(const int *__restrict__ ids, int P, int K, int E, int *__restrict__ groups,
                 int *__restrict__ num_groups, int *__restrict__ act_rows,
                 int *__restrict__ out_rows) {
    kernel_entry();
    extern __shared__ int shm_wide[];
    const int num_warps = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int *first = shm_wide;             // [E]: per-expert totals, then first pair index
    int *offset = shm_wide + E;        // [num_warps, E]: counts, then offsets per warp
    int *mine = offset + warp * E;     // [E] this warp's row
    for (int i = threadIdx.x; i < (num_warps + 1) * E; i += blockDim.x) shm_wide[i] = 0;
    // this warp's pairs [p_begin, p_end): spans of a multiple of 32
    const int span = (((P + num_warps - 1) / num_warps) + 31) & ~31;
    const int p_begin = min(P, warp * span), p_end = min(P, p_begin + span);
    const unsigned lower = (1u << lane) - 1u;  // lanes below this one
    __syncthreads();
    for (int p0 = p_begin; p0 < p_end; p0 += 32) {  // pass 1: counts per (warp, expert)
        const int p = p0 + lane;
        const int e = p < p_end ? __ldcg(ids + p) : -1;
        const unsigned same = __match_any_sync(0xffffffffu, e);
        if (e >= 0 && (same & lower) == 0) mine[e] += __popc(same);  // the lowest equal lane
        __syncwarp();
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) {  // offsets of each warp within expert e
        int run = 0;
        for (int w = 0; w < num_warps; w++) {
            const int n = offset[w * E + e];
            offset[w * E + e] = run;
            run += n;
        }
        first[e] = run;
    }
    __syncthreads();
    if (warp == 0)  // experts in order: first pair index and group index by warp scans
        warp_groups_from_counts(first, E, lane, groups, num_groups);
    __syncthreads();
    for (int p0 = p_begin; p0 < p_end; p0 += 32) {  // pass 2: scatter in pair order
        const int p = p0 + lane;
        const int e = p < p_end ? __ldcg(ids + p) : -1;
        const unsigned same = __match_any_sync(0xffffffffu, e);
        if (e >= 0) {
            const int at = first[e] + mine[e] + __popc(same & lower);
            act_rows[at] = p / K;
            out_rows[at] = p;
        }
        __syncwarp();
        if (e >= 0 && (same & lower) == 0) mine[e] += __popc(same);
        __syncwarp();
    }
}

// 4 consecutive weights of a float-type row at column c (c % 4 == 0)
// (read-only loads: weights may be read before kernel_entry's wait)
template <int QT>
__device__ __forceinline__ float4 load_float4_weight(const uint8_t *row, int c) {
    if (QT == ST_F32) return __ldg(reinterpret_cast<const float4 *>(row + 4 * (long long)c));
    const uint2 raw = __ldg(reinterpret_cast<const uint2 *>(row + 2 * (long long)c));
    if (QT == ST_F16) {
        const float2 a = __half22float2(*reinterpret_cast<const __half2 *>(&raw.x));
        const float2 b = __half22float2(*reinterpret_cast<const __half2 *>(&raw.y));
        return make_float4(a.x, a.y, b.x, b.y);
    }
    return make_float4(bf16_to_f32(raw.x & 0xffffu), bf16_to_f32(raw.x >> 16),
                       bf16_to_f32(raw.y & 0xffffu), bf16_to_f32(raw.y >> 16));  // BF16
}

// ---- the router in one launch (float router weights): logits [R, E] = W [E, H] x xf [R, H],
// a warp per expert over ROUTER_RT rows (float4 loads); the last block of a row tile (counter
// counts[1 + tile]) runs softmax + top-k of its rows (ids, weights [R, K]); the last tile to
// finish (counts[0]) groups the pairs by expert (group_warp: decode windows have few pairs),
// and with one tile (R <= ROUTER_RT) its last block does so at once. Counters are zero between
// launches. Each logit is summed in one fixed order, so a row's routing never depends on the
// window. grid (ceil(E / ROUTER_WARPS), ceil(R / ROUTER_RT)), block ROUTER_WARPS * 32, shared
// floats [ROUTER_WARPS * E] + ints [2E + GROUP_CHUNK]. H % 4 == 0.
#define ROUTER_WARPS 4
#define ROUTER_RT 8
#define ROUTER_UNROLL 16  // float4 weight loads in flight per lane: H = 2048 in one round

// group_body's result for the few pairs of a decode window, by one warp: pass 1 counts the pairs
// per expert (__match_any_sync: one shared add per distinct expert per 32 pairs), a warp scan
// over the experts gives the groups and each expert's first pair, pass 2 writes each pair at
// first[e] + its rank among the equal lanes (pairs keep their order within an expert).
// count: [E] shared ints. ids are read through L2 (other blocks of the launch wrote them).
__device__ void group_warp(const int *ids, int P, int K, int E, int *__restrict__ groups,
                           int *__restrict__ num_groups, int *__restrict__ act_rows,
                           int *__restrict__ out_rows, int *count) {
    const int lane = threadIdx.x & 31;
    const unsigned lower = (1u << lane) - 1u;  // lanes below this one
    for (int e = lane; e < E; e += WARP) count[e] = 0;
    __syncwarp();
    for (int p0 = 0; p0 < P; p0 += WARP) {
        const int e = p0 + lane < P ? __ldcg(ids + p0 + lane) : -1;
        const unsigned same = __match_any_sync(0xffffffffu, e);
        if (e >= 0 && (same & lower) == 0) count[e] += __popc(same);  // the lowest equal lane
        __syncwarp();
    }
    // experts in order: count[e] becomes the next free place of expert e
    warp_groups_from_counts(count, E, lane, groups, num_groups);
    __syncwarp();
    for (int p0 = 0; p0 < P; p0 += WARP) {
        const int p = p0 + lane;
        const int e = p < P ? __ldcg(ids + p) : -1;
        const unsigned same = __match_any_sync(0xffffffffu, e);
        if (e >= 0) {
            const int at = count[e] + __popc(same & lower);
            act_rows[at] = p / K;
            out_rows[at] = p;
        }
        __syncwarp();
        if (e >= 0 && (same & lower) == 0) count[e] += __popc(same);
        __syncwarp();
    }
}
template <int QT>
__device__ __forceinline__ void router_body(
    const uint8_t *__restrict__ W, long long row_bytes, int E, int H, const float *__restrict__ xf,
    int R, int K, int norm, float *__restrict__ logits, int *__restrict__ ids,
    float *__restrict__ weights, int *__restrict__ groups, int *__restrict__ num_groups,
    int *__restrict__ act_rows, int *__restrict__ out_rows, int *__restrict__ counts) {
    extern __shared__ float shm_router[];
    __shared__ int s_is_last;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int e = blockIdx.x * ROUTER_WARPS + warp;
    const int r0 = blockIdx.y * ROUTER_RT, nt = min(ROUTER_RT, R - r0);
    const uint8_t *wrow = W + (long long)e * row_bytes;  // [H]
    // ROUTER_UNROLL weight float4s loaded together, then used for every row; the first round's
    // before kernel_entry's wait (the weights are the model's, which no kernel writes), so a
    // programmatic launch overlaps their round trip with the kernel before this one
    // (cc >= 9.0 only: below it nothing overlaps, and holding them longer costs registers)
    float4 w[ROUTER_UNROLL];
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    constexpr bool is_early = true;
#pragma unroll
    for (int u = 0; u < ROUTER_UNROLL; u++) {
        const int c = 4 * lane + 4 * WARP * u;
        w[u] = e < E && c < H ? load_float4_weight<QT>(wrow, c) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#else
    constexpr bool is_early = false;
#endif
    kernel_entry();
    if (e < E) {
        float acc[ROUTER_RT];
#pragma unroll
        for (int t = 0; t < ROUTER_RT; t++) acc[t] = 0.0f;
        for (int c0 = 4 * lane; c0 < H; c0 += 4 * WARP * ROUTER_UNROLL) {
            if (!is_early || c0 != 4 * lane) {
#pragma unroll
                for (int u = 0; u < ROUTER_UNROLL; u++) {
                    const int c = c0 + 4 * WARP * u;
                    w[u] = c < H ? load_float4_weight<QT>(wrow, c)
                                 : make_float4(0.f, 0.f, 0.f, 0.f);
                }
            }
#pragma unroll
            for (int t = 0; t < ROUTER_RT; t++) {
                if (t >= nt) break;
                const float *xr = xf + (long long)(r0 + t) * H;  // [H]
#pragma unroll
                for (int u = 0; u < ROUTER_UNROLL; u++) {
                    const int c = c0 + 4 * WARP * u;
                    if (c < H) {
                        const float4 x = *reinterpret_cast<const float4 *>(xr + c);
                        const float a = fmaf(w[u].z, x.z, fmaf(w[u].w, x.w, acc[t]));
                        acc[t] = fmaf(w[u].x, x.x, fmaf(w[u].y, x.y, a));
                    }
                }
            }
        }
#pragma unroll
        for (int t = 0; t < ROUTER_RT; t++) {
            if (t < nt) {
                const float s = warp_sum(acc[t]);
                if (lane == 0) logits[(long long)(r0 + t) * E + e] = s;
            }
        }
    }
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        s_is_last = atomicAdd(counts + 1 + blockIdx.y, 1) == (int)gridDim.x - 1;
        if (s_is_last) counts[1 + blockIdx.y] = 0;
    }
    __syncthreads();
    if (!s_is_last) return;
    for (int t = warp; t < nt; t += ROUTER_WARPS)
        topk_row(logits + (long long)(r0 + t) * E, E, K, norm, shm_router + warp * E,
                 ids + (r0 + t) * K, weights + (r0 + t) * K);
    if (gridDim.y == 1) {  // one row tile (decode windows): this block has every row's top-k
        __syncthreads();    // the other warps' ids are visible to warp 0
        if (warp == 0)
            group_warp(ids, R * K, K, E, groups, num_groups, act_rows, out_rows,
                       reinterpret_cast<int *>(shm_router + ROUTER_WARPS * E));
        return;
    }
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        s_is_last = atomicAdd(counts, 1) == (int)gridDim.y - 1;
        if (s_is_last) counts[0] = 0;
    }
    __syncthreads();
    if (!s_is_last || warp != 0) return;
    group_warp(ids, R * K, K, E, groups, num_groups, act_rows, out_rows,
               reinterpret_cast<int *>(shm_router + ROUTER_WARPS * E));
}

// (one entry point per type, written out: runtime._kernel_names finds them by name)
#define ROUTER_ARGS                                                                             \
    const uint8_t *W, long long row_bytes, int E, int H, const float *xf, int R, int K,         \
        int norm, float *logits, int *ids, float *weights, int *groups, int *num_groups,        \
        int *act_rows, int *out_rows, int *counts
#define ROUTER_PASS W, row_bytes, E, H, xf, R, K, norm, logits, ids, weights, groups,          \
                    num_groups, act_rows, out_rows, counts
extern "C" __global__ void __launch_bounds__(ROUTER_WARPS * 32) router_f32(ROUTER_ARGS) {
    router_body<ST_F32>(ROUTER_PASS);
}
extern "C" __global__ void __launch_bounds__(ROUTER_WARPS * 32) router_f16(ROUTER_ARGS) {
    router_body<ST_F16>(ROUTER_PASS);
}
extern "C" __global__ void __launch_bounds__(ROUTER_WARPS * 32) router_bf16(ROUTER_ARGS) {
    router_body<ST_BF16>(ROUTER_PASS);
}

// ---- the next layer's experts guessed ahead (a streamed prompt window with a CPU pool;
// docs/offload.md, "Guessed copies"), in two launches; offload.cu's guess_publish hands the
// guess to the host, which has the copy engine copy the guessed rare experts. x [R, H] is the residual after this
// layer's attention: the next layer's input but for this layer's experts, so most of the next
// layer's routing is known a layer early. Both do nothing when *base == 0 (the next layer is
// not streamed in this window).
// predict_logits: logits [R, E] = W [E, H] (the next layer's router, float) x (x * nw) [R, H]
// (nw [H] its FFN norm's weight). The RMS scale of a row is left out: it multiplies the row's
// logits by one positive number, which keeps their order. Grid (ceil(E / PREDICT_WARPS),
// ceil(R / PREDICT_RT)), block PREDICT_WARPS * 32: a warp per expert over the tile's rows.
#define PREDICT_WARPS 8
#define PREDICT_RT 8
template <int QT>
__device__ __forceinline__ void predict_logits_body(const uint8_t *__restrict__ W,
                                                    long long row_bytes, int E, int H,
                                                    const float *__restrict__ x, int R,
                                                    const float *__restrict__ nw,
                                                    const unsigned long long *__restrict__ base,
                                                    float *__restrict__ logits) {
    kernel_entry();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int e = blockIdx.x * PREDICT_WARPS + warp;
    const int r0 = blockIdx.y * PREDICT_RT, nt = min(PREDICT_RT, R - r0);
    if (*base == 0 || e >= E) return;
    const uint8_t *wrow = W + (long long)e * row_bytes;  // [H]
    float acc[PREDICT_RT];
#pragma unroll
    for (int t = 0; t < PREDICT_RT; t++) acc[t] = 0.0f;
    for (int c = 4 * lane; c < H; c += 4 * WARP) {
        float4 w = load_float4_weight<QT>(wrow, c);
        const float4 n = *reinterpret_cast<const float4 *>(nw + c);
        w.x *= n.x;
        w.y *= n.y;
        w.z *= n.z;
        w.w *= n.w;
#pragma unroll
        for (int t = 0; t < PREDICT_RT; t++) {
            if (t < nt) {
                const float4 v =
                    *reinterpret_cast<const float4 *>(x + (long long)(r0 + t) * H + c);
                acc[t] = fmaf(w.x, v.x, fmaf(w.y, v.y, fmaf(w.z, v.z,
                                                            fmaf(w.w, v.w, acc[t]))));
            }
        }
    }
#pragma unroll
    for (int t = 0; t < PREDICT_RT; t++) {
        const float s = warp_sum(acc[t]);
        if (lane == 0 && t < nt) logits[(long long)(r0 + t) * E + e] = s;
    }
}

#define PREDICT_ARGS                                                                            \
    const uint8_t *W, long long row_bytes, int E, int H, const float *x, int R,                \
        const float *nw, const unsigned long long *base, float *logits
#define PREDICT_PASS W, row_bytes, E, H, x, R, nw, base, logits
extern "C" __global__ void __launch_bounds__(PREDICT_WARPS * 32)
predict_logits_f32(PREDICT_ARGS) {
    predict_logits_body<ST_F32>(PREDICT_PASS);
}
extern "C" __global__ void __launch_bounds__(PREDICT_WARPS * 32)
predict_logits_f16(PREDICT_ARGS) {
    predict_logits_body<ST_F16>(PREDICT_PASS);
}
extern "C" __global__ void __launch_bounds__(PREDICT_WARPS * 32)
predict_logits_bf16(PREDICT_ARGS) {
    predict_logits_body<ST_BF16>(PREDICT_PASS);
}

// predict_topk: pred [E] += the rows of logits [R, E] whose top-K names each expert (ties to
// the lower id; NaN never). Grid ceil(R / PREDICT_WARPS), block PREDICT_WARPS * 32: a warp
// per row; E <= 32 * PREDICT_MAX_E_LANE.
#define PREDICT_MAX_E_LANE 16
extern "C" __global__ void __launch_bounds__(PREDICT_WARPS * 32)
predict_topk(const float *__restrict__ logits, int R, int E, int K,
             const unsigned long long *__restrict__ base, int *__restrict__ pred) {
    kernel_entry();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int r = blockIdx.x * PREDICT_WARPS + warp;
    if (*base == 0 || r >= R) return;
    float v[PREDICT_MAX_E_LANE];  // this lane's experts lane, lane + 32, ...; NaN: none or taken
#pragma unroll
    for (int i = 0; i < PREDICT_MAX_E_LANE; i++) {
        const int e = lane + WARP * i;
        v[i] = e < E ? logits[(long long)r * E + e] : __int_as_float(0x7fc00000);
    }
    for (int k = 0; k < K; k++) {
        float bv = 0.0f;
        int best = -1;
#pragma unroll
        for (int i = 0; i < PREDICT_MAX_E_LANE; i++) {
            if (!isnan(v[i]) && (best < 0 || v[i] > bv)) {
                bv = v[i];
                best = lane + WARP * i;
            }
        }
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const int ob = __shfl_xor_sync(0xffffffffu, best, o);
            if (ob >= 0 && (best < 0 || ov > bv || (ov == bv && ob < best))) {
                bv = ov;
                best = ob;
            }
        }
        if (best < 0) break;  // the same on every lane (xor reduction)
        if (lane == 0) atomicAdd(pred + best, 1);
        if ((best & (WARP - 1)) == lane) {
#pragma unroll
            for (int i = 0; i < PREDICT_MAX_E_LANE; i++)
                if (lane + WARP * i == best) v[i] = __int_as_float(0x7fc00000);
        }
    }
}
