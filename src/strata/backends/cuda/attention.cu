// Attention steps of a window: QK-norm + NEOX RoPE + KV append, and causal attention over
// the KV cache (fp16 or int8 cells) split over cells across blocks (flash-decoding).
//
// Legend: R = window rows, H = hidden, Q = query heads, KVH = KV heads, D = head dim,
// C = a KV's capacity (cells), E = experts, K = experts per row, P = R * K pairs, V = vocab,
// L = layers. KV cache of one sequence: half [L, 2 (K, V), KVH, C, D], or int8 cells
// [L, 2, KVH, C, D] followed by float scales [L, 2, KVH, C] (one per token and head). A row's
// kv_base is the cells' device address with bit 0 set for int8 cells (allocations are
// 256-byte aligned, so the bit is free and a window may mix both kinds of KV).
#include "common.cuh"

#define ATT_DMAX 8  // D <= 32 * ATT_DMAX

// The cells of (layer, kind 0 = K / 1 = V, kv head) of a row's KV, and the int8 scales
struct KvHead {
    const uint8_t *cells;  // [C, D] half or int8
    const float *scales;   // [C] (int8 cells only)
    bool is_int8;
};

__device__ __forceinline__ KvHead kv_head(unsigned long long tagged_base, int L, int layer,
                                          int kind, int KVH, int kvh, int C, int D) {
    KvHead k;
    k.is_int8 = (tagged_base & 1ull) != 0;
    const uint8_t *base = reinterpret_cast<const uint8_t *>(tagged_base & ~1ull);
    const long long head = ((long long)layer * 2 + kind) * KVH + kvh;
    const long long cell_bytes = k.is_int8 ? 1 : 2;
    k.cells = base + head * C * D * cell_bytes;
    k.scales = reinterpret_cast<const float *>(base + (long long)L * 2 * KVH * C * D) + head * C;
    return k;
}

// ---- QK-norm (when norm weights are given) + NEOX RoPE of q and k, K/V written into each
// row's KV at cell pos[r] (fp16, or int8 with scale max|v| / 127 per (token, head)). q [R, Q*D]
// is rotated in place. grid (R, Q + 2*KVH), block 32.
extern "C" __global__ void qk_rope_append(
    float *__restrict__ q, const float *__restrict__ k, const float *__restrict__ v,
    const float *__restrict__ q_norm, const float *__restrict__ k_norm,
    const float *__restrict__ inv_freq, float eps, const unsigned long long *__restrict__ kv_base,
    const int *__restrict__ pos, const int *__restrict__ cap, int layer, int L, int Q, int KVH,
    int D) {
    kernel_entry();
    const int r = blockIdx.x, h = blockIdx.y, lane = threadIdx.x;
    const int half_d = D >> 1;
    const int C = cap[r], cell = pos[r];
    // o[j]: dim lane + 32 j of the head's output (rotated k, or v), for int8 quantisation
    float o[ATT_DMAX];
#pragma unroll
    for (int j = 0; j < ATT_DMAX; j++) o[j] = 0.0f;
    int kind = 1, kvh = 0;
    if (h >= Q + KVH) {  // a V head
        kvh = h - Q - KVH;
        const float *src = v + ((long long)r * KVH + kvh) * D;
#pragma unroll
        for (int j = 0; j < ATT_DMAX; j++)
            if (lane + 32 * j < D) o[j] = src[lane + 32 * j];
    } else {
        const bool is_q = h < Q;
        kind = 0;
        kvh = h - Q;
        float *src = is_q ? q + ((long long)r * Q + h) * D
                          : const_cast<float *>(k) + ((long long)r * KVH + kvh) * D;  // [D]
        const float *nw = is_q ? q_norm : k_norm;
        float scale = 1.0f;
        if (nw != nullptr) {
            float ss = 0.0f;
            for (int i = lane; i < D; i += WARP) ss = fmaf(src[i], src[i], ss);
            ss = warp_sum(ss);
            scale = 1.0f / sqrtf(ss / (float)D + eps);
        }
        const float p = (float)cell;
        float rot[ATT_DMAX];  // rot[j], rot[j + ATT_DMAX/2]: dims i, i + half_d (i = lane + 32j)
#pragma unroll
        for (int j = 0; j < ATT_DMAX / 2; j++) {
            const int i = lane + 32 * j;
            rot[j] = rot[j + ATT_DMAX / 2] = 0.0f;
            if (i < half_d) {
                float x1 = src[i], x2 = src[i + half_d];
                if (nw != nullptr) {
                    x1 = (x1 * scale) * nw[i];
                    x2 = (x2 * scale) * nw[i + half_d];
                }
                const float f = p * inv_freq[i];
                const float c = cosf(f), s = sinf(f);
                rot[j] = x1 * c - x2 * s;
                rot[j + ATT_DMAX / 2] = x2 * c + x1 * s;
            }
        }
        if (is_q) {
#pragma unroll
            for (int j = 0; j < ATT_DMAX / 2; j++) {
                const int i = lane + 32 * j;
                if (i < half_d) {
                    src[i] = rot[j];
                    src[i + half_d] = rot[j + ATT_DMAX / 2];
                }
            }
            return;
        }
        // back to the layout o[j] = dim lane + 32 j through shared memory
        __shared__ float sk[32 * ATT_DMAX];
#pragma unroll
        for (int j = 0; j < ATT_DMAX / 2; j++) {
            const int i = lane + 32 * j;
            if (i < half_d) {
                sk[i] = rot[j];
                sk[i + half_d] = rot[j + ATT_DMAX / 2];
            }
        }
        __syncwarp();
#pragma unroll
        for (int j = 0; j < ATT_DMAX; j++)
            if (lane + 32 * j < D) o[j] = sk[lane + 32 * j];
    }
    const KvHead dst = kv_head(kv_base[r], L, layer, kind, KVH, kvh, C, D);
    if (!dst.is_int8) {
        __half *cells =
            reinterpret_cast<__half *>(const_cast<uint8_t *>(dst.cells)) + (long long)cell * D;
#pragma unroll
        for (int j = 0; j < ATT_DMAX; j++)
            if (lane + 32 * j < D) cells[lane + 32 * j] = __float2half_rn(o[j]);
        return;
    }
    float amax = 0.0f;
#pragma unroll
    for (int j = 0; j < ATT_DMAX; j++) amax = fmaxf(amax, fabsf(o[j]));
    amax = warp_max(amax);
    const float dd = amax / 127.0f;
    const float id = dd > 0.0f ? 1.0f / dd : 0.0f;
    int8_t *cells =
        reinterpret_cast<int8_t *>(const_cast<uint8_t *>(dst.cells)) + (long long)cell * D;
#pragma unroll
    for (int j = 0; j < ATT_DMAX; j++)
        if (lane + 32 * j < D) cells[lane + 32 * j] = (int8_t)__float2int_rn(o[j] * id);
    if (lane == 0) const_cast<float *>(dst.scales)[cell] = dd;
}

// ---- causal attention of row r, query head h, over cells [0, pos[r]] of its KV, split over
// ATT_SPLITS blocks (flash-decoding). Cells go in chunks of 32 at fixed absolute positions:
// chunk i belongs to warp i % ATT_WARPS of block i / ATT_WARPS % ATT_SPLITS. In a chunk lane j
// scores cell 32i + j (its whole K row), the chunk updates the warp's online softmax, and the
// chunk's V rows are accumulated with each lane holding dims lane + 32 j. A block merges its
// warps into a partial (m, l, acc[D]) in part [R, Q, ATT_SPLITS, 2 + D]; the last block of
// (r, h) to finish (counter in counts [R*Q], zero between launches) merges the partials in
// split order. So a row's result depends only on its own cells and position, never on the
// window. out [R, Q*D] float; when outq is not NULL (D % 32 == 0) also its 8-bit form for the
// output projection. grid (R, Q, ATT_SPLITS), block ATT_WARPS * 32; D % 8 == 0, D <= 256.
#define ATT_WARPS 4
#define ATT_SPLITS 4
#define ATT_VBATCH 8  // V rows loaded together before their FMAs (latency, not bandwidth)
template <int DM>     // dims per lane: ceil(D / 32)
__device__ __forceinline__ void attention_body(
    const float *__restrict__ q, float *__restrict__ out, int8_t *__restrict__ outq,
    float *__restrict__ outd, const unsigned long long *__restrict__ kv_base,
    const int *__restrict__ pos, const int *__restrict__ cap, int layer, int L, int Q, int KVH,
    int D, float scale, float *__restrict__ part, int *__restrict__ counts, int r) {
    __shared__ float sq[32 * ATT_DMAX];
    __shared__ float sm[ATT_WARPS], sl[ATT_WARPS];
    __shared__ float sacc[ATT_WARPS][32 * ATT_DMAX];
    __shared__ int s_is_last;
    const int h = blockIdx.y, split = blockIdx.z;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int kvh = h / (Q / KVH), C = cap[r], last = pos[r];
    const KvHead kh = kv_head(kv_base[r], L, layer, 0, KVH, kvh, C, D);
    const KvHead vh = kv_head(kv_base[r], L, layer, 1, KVH, kvh, C, D);
    for (int i = threadIdx.x; i < D; i += blockDim.x) sq[i] = q[((long long)r * Q + h) * D + i];
    __syncthreads();
    int dim[DM];  // this lane's dims lane + 32 i, clamped to D - 1 (the extra ones are unused)
#pragma unroll
    for (int i = 0; i < DM; i++) dim[i] = min(lane + 32 * i, D - 1);
    float m = -INFINITY, l = 0.0f, acc[DM];
#pragma unroll
    for (int i = 0; i < DM; i++) acc[i] = 0.0f;
    for (int c0 = 32 * (split * ATT_WARPS + warp); c0 <= last; c0 += 32 * ATT_WARPS * ATT_SPLITS) {
        const int c = c0 + lane;
        const int cell = min(c, last);  // loads stay unconditional; cells past last score -inf
        float s, vscale = 1.0f;
        float dot = 0.0f;
        if (!kh.is_int8) {
            const uint4 *kc = reinterpret_cast<const uint4 *>(kh.cells + (long long)cell * D * 2);
#pragma unroll 8
            for (int i = 0; i < (D >> 3); i++) {
                const uint4 raw = __ldg(kc + i);
                const __half2 *hp = reinterpret_cast<const __half2 *>(&raw);
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    const float2 f = __half22float2(hp[j]);
                    dot = fmaf(sq[8 * i + 2 * j], f.x, dot);
                    dot = fmaf(sq[8 * i + 2 * j + 1], f.y, dot);
                }
            }
            s = dot * scale;
        } else {
            const uint2 *kc = reinterpret_cast<const uint2 *>(kh.cells + (long long)cell * D);
#pragma unroll 8
            for (int i = 0; i < (D >> 3); i++) {
                const uint2 raw = __ldg(kc + i);
                const int8_t *b = reinterpret_cast<const int8_t *>(&raw);
#pragma unroll
                for (int j = 0; j < 8; j++) dot = fmaf(sq[8 * i + j], (float)b[j], dot);
            }
            s = (dot * __ldg(kh.scales + cell)) * scale;
            vscale = __ldg(vh.scales + cell);
        }
        if (c > last) s = -INFINITY;
        const float m_new = fmaxf(m, warp_max(s));
        const float corr = expf(m - m_new);
        const float p = c <= last ? expf(s - m_new) : 0.0f;
        l = l * corr + warp_sum(p);
#pragma unroll
        for (int i = 0; i < DM; i++) acc[i] *= corr;
        // V rows in batches of ATT_VBATCH cells, loads first; a cell past last has p = 0 and
        // reads cell `last` instead (finite), so it adds exactly nothing
        const float pv = p * vscale;  // the cell's probability (times its V scale for int8)
#pragma unroll
        for (int j0 = 0; j0 < 32; j0 += ATT_VBATCH) {
            if (c0 + j0 > last) break;  // the same in every lane
            float vv[ATT_VBATCH][DM];
            if (!vh.is_int8) {  // one straight run of loads per cell type
                const __half *values = reinterpret_cast<const __half *>(vh.cells);
#pragma unroll
                for (int jj = 0; jj < ATT_VBATCH; jj++) {
                    const long long row = (long long)min(c0 + j0 + jj, last) * D;
#pragma unroll
                    for (int i = 0; i < DM; i++)
                        vv[jj][i] = __half2float(__ldg(values + row + dim[i]));
                }
            } else {
                const signed char *values = reinterpret_cast<const signed char *>(vh.cells);
#pragma unroll
                for (int jj = 0; jj < ATT_VBATCH; jj++) {
                    const long long row = (long long)min(c0 + j0 + jj, last) * D;
#pragma unroll
                    for (int i = 0; i < DM; i++) vv[jj][i] = (float)__ldg(values + row + dim[i]);
                }
            }
#pragma unroll
            for (int jj = 0; jj < ATT_VBATCH; jj++) {
                const float pj = __shfl_sync(0xffffffffu, pv, j0 + jj);
#pragma unroll
                for (int i = 0; i < DM; i++) acc[i] = fmaf(pj, vv[jj][i], acc[i]);
            }
        }
        m = m_new;
    }
    // this block's partial: its warps merged
    if (lane == 0) {
        sm[warp] = m;
        sl[warp] = l;
    }
#pragma unroll
    for (int i = 0; i < DM; i++) sacc[warp][lane + 32 * i] = acc[i];
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
    const long long rh = (long long)r * Q + h;
    float *mine = part + (rh * ATT_SPLITS + split) * (2 + D);  // [2 + D]
    for (int e = threadIdx.x; e < D; e += blockDim.x) {
        float a = 0.0f;
#pragma unroll
        for (int w = 0; w < ATT_WARPS; w++) a += sacc[w][e] * wf[w];
        mine[2 + e] = a;
    }
    if (threadIdx.x == 0) {
        mine[0] = mx;
        mine[1] = total;
    }
    // the last block of (r, h) merges the ATT_SPLITS partials
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        s_is_last = atomicAdd(counts + rh, 1) == ATT_SPLITS - 1;
        if (s_is_last) counts[rh] = 0;  // ready for the next launch
    }
    __syncthreads();
    if (!s_is_last) return;
    const float *parts = part + rh * ATT_SPLITS * (2 + D);  // [ATT_SPLITS, 2 + D]
    float pm[ATT_SPLITS], pf[ATT_SPLITS];
    float gmx = -INFINITY, gtotal = 0.0f;
#pragma unroll
    for (int s = 0; s < ATT_SPLITS; s++) {
        pm[s] = __ldcg(parts + s * (2 + D));
        gmx = fmaxf(gmx, pm[s]);
    }
#pragma unroll
    for (int s = 0; s < ATT_SPLITS; s++) {
        pf[s] = pm[s] == -INFINITY ? 0.0f : expf(pm[s] - gmx);
        gtotal += __ldcg(parts + s * (2 + D) + 1) * pf[s];
    }
    // warp w writes dims [32b, 32b + 32) for b = w, w + ATT_WARPS, ...
    for (int b = warp; b < ((D + 31) >> 5); b += ATT_WARPS) {
        const int e = 32 * b + lane;
        float o = 0.0f;
        if (e < D) {
#pragma unroll
            for (int s = 0; s < ATT_SPLITS; s++) o += __ldcg(parts + s * (2 + D) + 2 + e) * pf[s];
        }
        o = o / gtotal;
        const long long at = rh * D + e;
        if (e < D) out[at] = o;
        if (outq != nullptr) {  // D % 32 == 0: this warp's 32 dims are one quantisation block
            const float amax = warp_max(fabsf(o));
            const float dd = amax / 127.0f;
            const float id = dd > 0.0f ? 1.0f / dd : 0.0f;
            outq[at] = q8_of(o, id);
            if (lane == 0) outd[at >> 5] = dd;
        }
    }
}

// attention_body for row r, dispatched on the dims per lane
__device__ __forceinline__ void attention_row(
    const float *__restrict__ q, float *__restrict__ out, int8_t *__restrict__ outq,
    float *__restrict__ outd, const unsigned long long *__restrict__ kv_base,
    const int *__restrict__ pos, const int *__restrict__ cap, int layer, int L, int Q, int KVH,
    int D, float scale, float *__restrict__ part, int *__restrict__ counts, int r) {
    const int dims_per_lane = (D + 31) >> 5;
    if (dims_per_lane == 1)
        attention_body<1>(q, out, outq, outd, kv_base, pos, cap, layer, L, Q, KVH, D, scale,
                          part, counts, r);
    else if (dims_per_lane == 2)
        attention_body<2>(q, out, outq, outd, kv_base, pos, cap, layer, L, Q, KVH, D, scale,
                          part, counts, r);
    else if (dims_per_lane <= 4)
        attention_body<4>(q, out, outq, outd, kv_base, pos, cap, layer, L, Q, KVH, D, scale,
                          part, counts, r);
    else
        attention_body<8>(q, out, outq, outd, kv_base, pos, cap, layer, L, Q, KVH, D, scale,
                          part, counts, r);
}

extern "C" __global__ void __launch_bounds__(ATT_WARPS * 32)
attention(const float *__restrict__ q, float *__restrict__ out, int8_t *__restrict__ outq,
          float *__restrict__ outd, const unsigned long long *__restrict__ kv_base,
          const int *__restrict__ pos, const int *__restrict__ cap, int layer, int L, int Q,
          int KVH, int D, float scale, float *__restrict__ part, int *__restrict__ counts) {
    kernel_entry();
    attention_row(q, out, outq, outd, kv_base, pos, cap, layer, L, Q, KVH, D, scale, part,
                  counts, blockIdx.x);
}

// ---- beside attention_prompt (attention_prompt.cu) in prompt-sized windows: the rows that no
// neighbour row shares a kv_base with (decode rows), each as `attention` computes it, so a
// decode row gives the same bits in any window. Block x takes rows x, x + gridDim.x, ...: its
// threads test blockDim.x of them at once (a prompt chunk has none to take, so the scan must not
// walk its rows one by one), then the block computes the singles found, one after another.
// grid (min(R, ATT_SINGLE_BLOCKS), Q, ATT_SPLITS), block ATT_WARPS * 32.
#define ATT_SINGLE_BLOCKS 16
extern "C" __global__ void __launch_bounds__(ATT_WARPS * 32)
attention_singles(const float *__restrict__ q, float *__restrict__ out, int8_t *__restrict__ outq,
                  float *__restrict__ outd, const unsigned long long *__restrict__ kv_base,
                  const int *__restrict__ pos, const int *__restrict__ cap, int R, int layer,
                  int L, int Q, int KVH, int D, float scale, float *__restrict__ part,
                  int *__restrict__ counts) {
    kernel_entry();
    __shared__ int s_rows[ATT_WARPS * 32];
    __shared__ int s_count;
    const int step = gridDim.x;
    for (int i0 = 0; blockIdx.x + step * i0 < R; i0 += blockDim.x) {
        if (threadIdx.x == 0) s_count = 0;
        __syncthreads();
        const int r = blockIdx.x + step * (i0 + threadIdx.x);
        if (r < R) {
            const unsigned long long b = kv_base[r];
            if (!((r > 0 && kv_base[r - 1] == b) || (r + 1 < R && kv_base[r + 1] == b)))
                s_rows[atomicAdd(&s_count, 1)] = r;  // rows are independent: any order
        }
        __syncthreads();
        const int n = s_count;
        for (int j = 0; j < n; j++)
            attention_row(q, out, outq, outd, kv_base, pos, cap, layer, L, Q, KVH, D, scale, part,
                          counts, s_rows[j]);
        __syncthreads();  // s_rows and s_count are rewritten by the next scan
    }
}
