// Attention steps of a window: QK-norm + NEOX RoPE + KV append, and the causal attention of
// rows early in their context (position below the plan's deep_from) over their KV cache (fp16
// or int8 cells) split over cells across blocks (flash-decoding), a block per query head;
// attention_group.cu takes the rows deep in theirs. Legend and KV layout: attention.cuh.
#include "attention.cuh"

// ---- QK-norm (when norm weights are given) + NEOX RoPE of q and k, K/V written into each
// row's KV at cell pos[r] (fp16, or int8 with scale max|v| / 127 per (token, head)). q [R, Q*D]
// is rotated in place. Partial RoPE: the first n_rot dims of a head rotate (pairs (i,
// i + n_rot/2), i < n_rot/2, at inv_freq [n_rot/2]); dims n_rot .. D-1 pass (QK-normed when
// norm weights are given). n_rot even, <= D (n_rot = D: the whole head). grid (R, Q + 2*KVH),
// block 32.
extern "C" __global__ void qk_rope_append(
    float *__restrict__ q, const float *__restrict__ k, const float *__restrict__ v,
    const float *__restrict__ q_norm, const float *__restrict__ k_norm,
    const float *__restrict__ inv_freq, float eps, const unsigned long long *__restrict__ kv_base,
    const int *__restrict__ pos, const int *__restrict__ cap, int layer, int L, int Q, int KVH,
    int D, int n_rot) {
    kernel_entry();
    __shared__ float sk[32 * ATT_DMAX];  // a K head's output [D]
    const int r = blockIdx.x, h = blockIdx.y, lane = threadIdx.x;
    const int half_rot = n_rot >> 1;
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
        float rot[ATT_DMAX];  // rot[j], rot[j + ATT_DMAX/2]: dims i, i + half_rot (i = lane + 32j)
#pragma unroll
        for (int j = 0; j < ATT_DMAX / 2; j++) {
            const int i = lane + 32 * j;
            rot[j] = rot[j + ATT_DMAX / 2] = 0.0f;
            if (i < half_rot) {
                float x1 = src[i], x2 = src[i + half_rot];
                if (nw != nullptr) {
                    x1 = (x1 * scale) * nw[i];
                    x2 = (x2 * scale) * nw[i + half_rot];
                }
                const float f = p * inv_freq[i];
                const float c = cosf(f), s = sinf(f);
                rot[j] = x1 * c - x2 * s;
                rot[j + ATT_DMAX / 2] = x2 * c + x1 * s;
            }
        }
        // the dims past n_rot: only this lane reads and writes its dims, so q may be updated
        // in place here (q passes unchanged without norm weights)
#pragma unroll
        for (int j = 0; j < ATT_DMAX; j++) {
            const int i = lane + 32 * j;
            if (i >= n_rot && i < D) {
                const float x = nw != nullptr ? (src[i] * scale) * nw[i] : src[i];
                if (!is_q) sk[i] = x;
                else if (nw != nullptr) src[i] = x;
            }
        }
        if (is_q) {
#pragma unroll
            for (int j = 0; j < ATT_DMAX / 2; j++) {
                const int i = lane + 32 * j;
                if (i < half_rot) {
                    src[i] = rot[j];
                    src[i + half_rot] = rot[j + ATT_DMAX / 2];
                }
            }
            return;
        }
        // back to the layout o[j] = dim lane + 32 j through shared memory
#pragma unroll
        for (int j = 0; j < ATT_DMAX / 2; j++) {
            const int i = lane + 32 * j;
            if (i < half_rot) {
                sk[i] = rot[j];
                sk[i + half_rot] = rot[j + ATT_DMAX / 2];
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
// chunk i belongs to warp i % ATT_WARPS of block i / ATT_WARPS % ATT_SPLITS. A chunk's loads
// are issued together (lane j: the whole K row of cell 32i + j; every lane: its DM dims
// [DM lane, DM lane + DM) of the chunk's V rows), the first chunk's before q reaches shared
// memory, so a short context costs one memory round trip, not one per load batch. Lane j scores
// its cell, the chunk updates the warp's online softmax and accumulates its V rows. A block
// merges its warps into a partial (m, l, acc[D]) in part [R, Q, ATT_SPLITS, 2 + D]; the last
// block of (r, h) to finish (counter in counts [R*Q], zero between launches) merges the partials
// in split order. When every cell is block 0's (pos[r] < 32 * ATT_WARPS) block 0 writes the
// output itself and the other blocks return at once: the same bits as the merge, whose empty
// splits add exact zeros. So a row's result depends only on its own cells and position, never
// on the window. out [R, Q*D] float; when outq is not NULL (D % 32 == 0) also its 8-bit form
// for the output projection. Rows at pos >= deep_from are attention_group.cu's: their blocks
// return at once (a plan without group launches passes INT_MAX). grid (R, Q, ATT_SPLITS), block
// ATT_WARPS * 32; D % 8 == 0, D <= 256.
#define ATT_WARPS 4
#define ATT_SPLITS 4

template <int DM>  // dims per lane: ceil(D / 32) rounded up to 1, 2, 4 or 8
__device__ __forceinline__ void attention_body(
    const float *__restrict__ q, float *__restrict__ out, int8_t *__restrict__ outq,
    float *__restrict__ outd, const unsigned long long *__restrict__ kv_base,
    const int *__restrict__ pos, const int *__restrict__ cap, int layer, int L, int Q, int KVH,
    int D, float scale, float *__restrict__ part, int *__restrict__ counts, int r) {
    __shared__ float sq[32 * ATT_DMAX];
    __shared__ float sm[ATT_WARPS], sl[ATT_WARPS];
    __shared__ float sacc[ATT_WARPS][32 * ATT_DMAX];
    __shared__ int s_is_last;
    constexpr int VROWS = DM <= 4 ? 32 : 8;  // V rows held at once (registers)
    const int h = blockIdx.y, split = blockIdx.z;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int kvh = h / (Q / KVH), C = cap[r], last = pos[r];
    const bool solo = last < 32 * ATT_WARPS;  // every chunk is block 0's
    if (solo && split > 0) return;            // the whole block: no barrier is left waiting
    const KvHead kh = kv_head(kv_base[r], L, layer, 0, KVH, kvh, C, D);
    const KvHead vh = kv_head(kv_base[r], L, layer, 1, KVH, kvh, C, D);
    const int d0 = DM * lane;  // this lane's dims [d0, d0 + DM) of V and acc (d0 < D: all of them)
    const int stride = 32 * ATT_WARPS * ATT_SPLITS;
    int c0 = 32 * (split * ATT_WARPS + warp);
    AttChunk<DM, VROWS> ch;
    if (c0 <= last)  // in flight ...
        att_load_chunk<DM, VROWS>(ch, kh, vh, c0, 0, last, D, d0, true);
    for (int i = threadIdx.x; i < D; i += blockDim.x) sq[i] = q[((long long)r * Q + h) * D + i];
    __syncthreads();  // ... while q lands in shared memory
    float m = -INFINITY, l = 0.0f, acc[DM];
#pragma unroll
    for (int i = 0; i < DM; i++) acc[i] = 0.0f;
    while (c0 <= last) {
        const int c = c0 + lane;
        float dot = 0.0f, s;
        if (!kh.is_int8) {
#pragma unroll
            for (int i = 0; i < 4 * DM; i++) {
                if (i < (D >> 3)) {
                    const __half2 *hp = reinterpret_cast<const __half2 *>(&ch.k[i]);
#pragma unroll
                    for (int j = 0; j < 4; j++) {
                        const float2 f = __half22float2(hp[j]);
                        dot = fmaf(sq[8 * i + 2 * j], f.x, dot);
                        dot = fmaf(sq[8 * i + 2 * j + 1], f.y, dot);
                    }
                }
            }
            s = dot * scale;
        } else {
#pragma unroll
            for (int i = 0; i < 4 * DM; i++) {
                if (i < (D >> 3)) {
                    const uint32_t words[2] = {ch.k[i].x, ch.k[i].y};
#pragma unroll
                    for (int j = 0; j < 8; j++)
                        dot = fmaf(sq[8 * i + j], (float)(int8_t)(words[j >> 2] >> (8 * (j & 3))),
                                   dot);
                }
            }
            s = (dot * ch.kscale) * scale;
        }
        if (c > last) s = -INFINITY;
        const float m_new = fmaxf(m, warp_max(s));
        const float corr = expf(m - m_new);
        const float p = c <= last ? expf(s - m_new) : 0.0f;
        l = l * corr + warp_sum(p);
#pragma unroll
        for (int i = 0; i < DM; i++) acc[i] *= corr;
        // the cell's probability (times its V scale for int8); a row past last adds 0 x finite
        const float pv = kh.is_int8 ? p * ch.vscale : p;
#pragma unroll
        for (int j0 = 0; j0 < 32; j0 += VROWS) {
            if (j0 > 0) {  // DM == 8: the chunk's second half of V rows
                if (c0 + j0 > last) break;  // the same in every lane
                att_load_chunk<DM, VROWS>(ch, kh, vh, c0, j0, last, D, d0, false);
            }
#pragma unroll
            for (int jj = 0; jj < VROWS; jj++) {
                const float pj = __shfl_sync(0xffffffffu, pv, j0 + jj);
#pragma unroll
                for (int i = 0; i < DM; i++)
                    acc[i] = fmaf(pj, att_v_value<DM>(ch.v[jj], i, vh.is_int8), acc[i]);
            }
        }
        m = m_new;
        c0 += stride;
        if (c0 <= last) att_load_chunk<DM, VROWS>(ch, kh, vh, c0, 0, last, D, d0, true);
    }
    // this block's partial: its warps merged
    if (lane == 0) {
        sm[warp] = m;
        sl[warp] = l;
    }
    if (d0 < D) {
#pragma unroll
        for (int i = 0; i < DM; i++) sacc[warp][d0 + i] = acc[i];
    }
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
    // warp w takes dims [32b, 32b + 32) for b = w, w + ATT_WARPS, ... (one quantisation block)
    const int num_dim_blocks = (D + 31) >> 5;
    if (solo) {  // block 0 holds every cell: its partial is the result
        for (int b = warp; b < num_dim_blocks; b += ATT_WARPS) {
            const int e = 32 * b + lane;
            float a = 0.0f;
            if (e < D) {
#pragma unroll
                for (int w = 0; w < ATT_WARPS; w++) a += sacc[w][e] * wf[w];
            }
            attention_store(a / total, e, D, rh, out, outq, outd);
        }
        return;
    }
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
    for (int b = warp; b < num_dim_blocks; b += ATT_WARPS) {
        const int e = 32 * b + lane;
        float o = 0.0f;
        if (e < D) {
#pragma unroll
            for (int s = 0; s < ATT_SPLITS; s++) o += __ldcg(parts + s * (2 + D) + 2 + e) * pf[s];
        }
        attention_store(o / gtotal, e, D, rh, out, outq, outd);
    }
}


// ---- beside attention_prompt (attention_prompt.cu) in prompt-sized windows: the rows that no
// neighbour row shares a kv_base with (decode rows), each as `attention_d*` computes it, so a
// decode row gives the same bits in any window. Block x takes rows x, x + gridDim.x, ...: its
// threads test blockDim.x of them at once (a prompt chunk has none to take, so the scan must not
// walk its rows one by one), then the block computes the singles found, one after another.
// Singles at pos >= deep_from are attention_group.cu's. grid (min(R, ATT_SINGLE_BLOCKS), Q,
// ATT_SPLITS), block ATT_WARPS * 32.
#define ATT_SINGLE_BLOCKS 16
template <int DM>
__device__ __forceinline__ void attention_singles_body(ATTENTION_ARGS, int R, int layer, int L,
                                                       int Q, int KVH, int D, float scale,
                                                       float *__restrict__ part,
                                                       int *__restrict__ counts, int deep_from) {
    __shared__ int s_rows[ATT_WARPS * 32];
    __shared__ int s_count;
    const int step = gridDim.x;
    for (int i0 = 0; blockIdx.x + step * i0 < R; i0 += blockDim.x) {
        if (threadIdx.x == 0) s_count = 0;
        __syncthreads();
        const int r = blockIdx.x + step * (i0 + threadIdx.x);
        if (r < R && pos[r] < deep_from) {
            const unsigned long long b = kv_base[r];
            if (!((r > 0 && kv_base[r - 1] == b) || (r + 1 < R && kv_base[r + 1] == b)))
                s_rows[atomicAdd(&s_count, 1)] = r;  // rows are independent: any order
        }
        __syncthreads();
        const int n = s_count;
        for (int j = 0; j < n; j++)
            attention_body<DM>(ATTENTION_PASS, layer, L, Q, KVH, D, scale, part, counts,
                               s_rows[j]);
        __syncthreads();  // s_rows and s_count are rewritten by the next scan
    }
}

// The entry points of one dims-per-lane DM (plan.attention_kernels picks it from D; each is a
// kernel of its own, so each gets its own registers): attention_d<DM>, grid (R, Q, ATT_SPLITS),
// and attention_singles_d<DM>, both block ATT_WARPS * 32.
#define ATTENTION_KERNELS(DM)                                                                   \
    extern "C" __global__ void __launch_bounds__(ATT_WARPS * 32) attention_d##DM(              \
        ATTENTION_ARGS, int layer, int L, int Q, int KVH, int D, float scale,                   \
        float *__restrict__ part, int *__restrict__ counts, int deep_from) {                    \
        kernel_entry();                                                                         \
        if (pos[blockIdx.x] >= deep_from) return; /* attention_group.cu's row */                \
        attention_body<DM>(ATTENTION_PASS, layer, L, Q, KVH, D, scale, part, counts,           \
                           blockIdx.x);                                                         \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(ATT_WARPS * 32) attention_singles_d##DM(      \
        ATTENTION_ARGS, int R, int layer, int L, int Q, int KVH, int D, float scale,            \
        float *__restrict__ part, int *__restrict__ counts, int deep_from) {                    \
        kernel_entry();                                                                         \
        attention_singles_body<DM>(ATTENTION_PASS, R, layer, L, Q, KVH, D, scale, part,         \
                                   counts, deep_from);                                          \
    }
ATTENTION_KERNELS(1)
ATTENTION_KERNELS(2)
ATTENTION_KERNELS(4)
ATTENTION_KERNELS(8)
