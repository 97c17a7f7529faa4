// The causal attention of decode rows deep in their context (pos >= the plan's deep_from;
// attention.cu's attention_d* takes the others). Legend and KV layout: attention.cuh.
//
// A row's query heads over cells [0, pos[r]] of its KV, split over GQA_SPLITS blocks
// (flash-decoding) and shared by the heads of one GQA group, so each K/V cell is read once per
// group of up to GM heads, not once per head (attention_d* reads it once per head: 8x the bytes
// under Qwen3-30B-A3B's groups of 8, 448 us a layer at 64K cells on the H200). Cells go in
// chunks of 32 at fixed absolute positions: chunk i belongs to warp i % GQA_WARPS of split
// (i / GQA_WARPS) % GQA_SPLITS, so a row's splits, and every sum below, depend on its own
// position only: the same bits in any window and in any launch below.
// - A chunk's loads are issued together (lane j: the whole K row of cell 32i + j; every lane:
//   its DM dims [DM lane, DM lane + DM) of the chunk's V rows). Lane j scores its cell against
//   the block's GM heads (q in shared memory), the warp's online softmax per head (a warp max
//   per chunk; each lane sums its own cells' weights, the warp adds them at the end), the
//   weights go to shared memory and every lane accumulates its dims of the chunk's V rows.
// - A block merges its warps into a partial per head (m, l, acc[D]). A row whose cells are all
//   split 0's (pos < 32 * GQA_WARPS) is written by that block; otherwise each block of a
//   split with cells stores its partial in part [PR, Q, GQA_SPLITS, 2 + D] at the row's slot
//   and the last block of the (slot, head group) to finish (counter in counts, zero between
//   launches) merges the partials in split order (merge_step, an online merge: one partial
//   alone gives its own acc / l exactly).
// - Which rows: those at pos >= deep_from of all R (`singles` 0: a decode window) or of those
//   no neighbour row shares a kv_base with (`singles` 1: beside attention_prompt in a
//   prompt-sized window); the n-th of them goes to block x = n % gridDim.x. The first
//   gridDim.x take slots n in part; a row past them (a window with more such rows than part
//   holds) is computed by block (x, y, 0) alone, split after split, merged by the same
//   merge_step in the same order: the same bits.
// out [R, Q*D] float; when outq is not NULL (D % 32 == 0) also its 8-bit form for the output
// projection. grid (PR = min(R, GQA_PART_ROWS), KVH * ceil(G / GM), GQA_SPLITS), G = Q / KVH;
// block GQA_WARPS * 32; D % 8 == 0, D <= 32 DM.
#include "attention.cuh"

#define GQA_WARPS 8
#define GQA_SPLITS 32
#define GQA_PART_ROWS 32

// Output pairs (head j of the block, 32-dim block b) of a thread: warp w takes pairs
// w, w + GQA_WARPS, ... of gn * ceil(D / 32), lane = dim within the block.
template <int DM, int GM>
struct AttPairs {
    static constexpr int N = (GM * DM + GQA_WARPS - 1) / GQA_WARPS;
};

template <int DM, int GM>
struct __align__(16) AttShared {
    float sq[GM][32 * DM];          // the block's heads' queries
    float sp[GQA_WARPS][GM][32];    // a chunk's weights per warp and head (times V scale)
    float sacc[GQA_WARPS][GM][32 * DM];
    float sm[GQA_WARPS][GM], sl[GQA_WARPS][GM];
    int rows[GQA_WARPS * 32];
    int num_rows;
    int warp_counts[GQA_WARPS];
    int is_last;
};

// (M, S, A) <- the online merge of a partial (m, l, a) into it; (-inf, 0, 0) merged with one
// partial gives (m, l, a) exactly (expf(0) = 1, expf(-inf) = 0).
__device__ __forceinline__ void merge_step(float &M, float &S, float &A, float m, float l,
                                           float a) {
    const float mn = fmaxf(M, m);
    const float c1 = M == -INFINITY ? 0.0f : expf(M - mn);
    const float c2 = expf(m - mn);
    S = S * c1 + l * c2;
    A = A * c1 + a * c2;
    M = mn;
}

// The block's partial of split `split` of row r for heads h0 .. h0 + gn - 1: into pm / pl / pa
// of each of this thread's pairs. Called by the whole block.
template <int DM, int GM>
__device__ __forceinline__ void att_block_partial(
    AttShared<DM, GM> &sh, const float *__restrict__ q, const KvHead &kh, const KvHead &vh,
    int r, int Q, int D, int h0, int gn, int last, int split, float scale,
    float (&pm)[AttPairs<DM, GM>::N], float (&pl)[AttPairs<DM, GM>::N],
    float (&pa)[AttPairs<DM, GM>::N]) {
    constexpr int VROWS = DM <= 2 ? 32 : DM == 4 ? 16 : 8;  // V rows held at once
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int d0 = DM * lane;
    const int stride = 32 * GQA_WARPS * GQA_SPLITS;
    int c0 = 32 * (split * GQA_WARPS + warp);
    AttChunk<DM, VROWS> ch;
    if (c0 <= last)  // in flight ...
        att_load_chunk<DM, VROWS>(ch, kh, vh, c0, 0, last, D, d0, true);
    for (int i = threadIdx.x; i < GM * 32 * DM; i += blockDim.x) {
        const int j = i / (32 * DM), d = i % (32 * DM);
        sh.sq[j][d] = j < gn && d < D ? q[((long long)r * Q + h0 + j) * D + d] : 0.0f;
    }
    __syncthreads();  // ... while q lands in shared memory
    float m[GM], l[GM], acc[GM][DM];
#pragma unroll
    for (int j = 0; j < GM; j++) {
        m[j] = -INFINITY;
        l[j] = 0.0f;
#pragma unroll
        for (int i = 0; i < DM; i++) acc[j][i] = 0.0f;
    }
    while (c0 <= last) {
        const int c = c0 + lane;
        // scores of this lane's cell against every head [GM]
        float dot[GM];
#pragma unroll
        for (int j = 0; j < GM; j++) dot[j] = 0.0f;
#pragma unroll
        for (int i = 0; i < 4 * DM; i++) {
            if (i < (D >> 3)) {
                float kf[8];
                if (!kh.is_int8) {
                    const __half2 *hp = reinterpret_cast<const __half2 *>(&ch.k[i]);
#pragma unroll
                    for (int t = 0; t < 4; t++) {
                        const float2 f = __half22float2(hp[t]);
                        kf[2 * t] = f.x;
                        kf[2 * t + 1] = f.y;
                    }
                } else {
                    const uint32_t words[2] = {ch.k[i].x, ch.k[i].y};
#pragma unroll
                    for (int t = 0; t < 8; t++)
                        kf[t] = (float)(int8_t)(words[t >> 2] >> (8 * (t & 3)));
                }
#pragma unroll
                for (int j = 0; j < GM; j++) {
                    const float4 qa = *reinterpret_cast<const float4 *>(&sh.sq[j][8 * i]);
                    const float4 qb = *reinterpret_cast<const float4 *>(&sh.sq[j][8 * i + 4]);
                    float d = dot[j];
                    d = fmaf(qa.x, kf[0], d);
                    d = fmaf(qa.y, kf[1], d);
                    d = fmaf(qa.z, kf[2], d);
                    d = fmaf(qa.w, kf[3], d);
                    d = fmaf(qb.x, kf[4], d);
                    d = fmaf(qb.y, kf[5], d);
                    d = fmaf(qb.z, kf[6], d);
                    d = fmaf(qb.w, kf[7], d);
                    dot[j] = d;
                }
            }
        }
        // the warp's online softmax per head; the weights to shared memory
#pragma unroll
        for (int j = 0; j < GM; j++) {
            float s = kh.is_int8 ? (dot[j] * ch.kscale) * scale : dot[j] * scale;
            if (c > last) s = -INFINITY;
            const float m_new = fmaxf(m[j], warp_max(s));
            const float corr = expf(m[j] - m_new);
            const float p = c <= last ? expf(s - m_new) : 0.0f;
            l[j] = l[j] * corr + p;  // this lane's cells; the warp sums them at the end
#pragma unroll
            for (int i = 0; i < DM; i++) acc[j][i] *= corr;
            m[j] = m_new;
            // a row past last adds 0 x finite
            sh.sp[warp][j][lane] = kh.is_int8 ? p * ch.vscale : p;
        }
        __syncwarp();
#pragma unroll
        for (int j0 = 0; j0 < 32; j0 += VROWS) {
            if (j0 > 0) {  // DM >= 4: the chunk's further V rows
                if (c0 + j0 > last) break;  // the same in every lane
                att_load_chunk<DM, VROWS>(ch, kh, vh, c0, j0, last, D, d0, false);
            }
#pragma unroll
            for (int jj = 0; jj < VROWS; jj += 4) {  // 4 cells: their V dims, then each head
                float v[4][DM];
#pragma unroll
                for (int t = 0; t < 4; t++) {
#pragma unroll
                    for (int i = 0; i < DM; i++)
                        v[t][i] = att_v_value<DM>(ch.v[jj + t], i, vh.is_int8);
                }
#pragma unroll
                for (int j = 0; j < GM; j++) {
                    const float4 pw = *reinterpret_cast<const float4 *>(&sh.sp[warp][j][j0 + jj]);
#pragma unroll
                    for (int i = 0; i < DM; i++) {
                        float a = acc[j][i];
                        a = fmaf(pw.x, v[0][i], a);
                        a = fmaf(pw.y, v[1][i], a);
                        a = fmaf(pw.z, v[2][i], a);
                        a = fmaf(pw.w, v[3][i], a);
                        acc[j][i] = a;
                    }
                }
            }
        }
        __syncwarp();  // sp is rewritten by the next chunk
        c0 += stride;
        if (c0 <= last) att_load_chunk<DM, VROWS>(ch, kh, vh, c0, 0, last, D, d0, true);
    }
    // the warps' partials to shared memory, then each pair's block partial
#pragma unroll
    for (int j = 0; j < GM; j++) {
        const float lw = warp_sum(l[j]);
        if (lane == 0) {
            sh.sm[warp][j] = m[j];
            sh.sl[warp][j] = lw;
        }
        if (d0 < D) {
#pragma unroll
            for (int i = 0; i < DM; i++) sh.sacc[warp][j][d0 + i] = acc[j][i];
        }
    }
    __syncthreads();
    const int num_dim_blocks = (D + 31) >> 5;
#pragma unroll
    for (int k = 0; k < AttPairs<DM, GM>::N; k++) {
        const int pair = warp + GQA_WARPS * k;
        pm[k] = -INFINITY;
        pl[k] = pa[k] = 0.0f;
        if (pair >= gn * num_dim_blocks) continue;
        const int j = pair / num_dim_blocks, e = 32 * (pair % num_dim_blocks) + lane;
        float mx = -INFINITY;
#pragma unroll
        for (int w = 0; w < GQA_WARPS; w++) mx = fmaxf(mx, sh.sm[w][j]);
        float total = 0.0f, a = 0.0f;
#pragma unroll
        for (int w = 0; w < GQA_WARPS; w++) {
            const float wf = sh.sm[w][j] == -INFINITY ? 0.0f : expf(sh.sm[w][j] - mx);
            total += sh.sl[w][j] * wf;
            if (e < D) a += sh.sacc[w][j][e] * wf;
        }
        pm[k] = mx;
        pl[k] = total;
        pa[k] = a;
    }
    __syncthreads();  // sq, sm, sl, sacc are rewritten by the next call
}

// Row r of the launch (heads h0 .. h0 + gn - 1), its partials at `slot` of part, or, for
// slot -1, every split in this block (split must be 0 then). Called by the whole block.
template <int DM, int GM>
__device__ __forceinline__ void attention_row(
    AttShared<DM, GM> &sh, ATTENTION_ARGS, int r, int slot, int layer, int L, int Q, int KVH,
    int D, int kvh, int h0, int gn, float scale, float *__restrict__ part,
    int *__restrict__ counts) {
    constexpr int NP = AttPairs<DM, GM>::N;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int split = blockIdx.z, C = cap[r], last = pos[r];
    const int num_chunks = last / 32 + 1;
    const int num_active = min(GQA_SPLITS, (num_chunks + GQA_WARPS - 1) / GQA_WARPS);
    if (slot >= 0 && split >= num_active) return;  // no cells: not counted below
    const KvHead kh = kv_head(kv_base[r], L, layer, 0, KVH, kvh, C, D);
    const KvHead vh = kv_head(kv_base[r], L, layer, 1, KVH, kvh, C, D);
    const int num_dim_blocks = (D + 31) >> 5;
    float M[NP], S[NP], A[NP], pm[NP], pl[NP], pa[NP];
#pragma unroll
    for (int k = 0; k < NP; k++) {
        M[k] = -INFINITY;
        S[k] = A[k] = 0.0f;
    }
    // this block's splits: every split (a row without a slot, or one whose cells are all
    // split 0's), merged here, or its own split, merged by the last block below
    const bool alone = slot < 0 || num_active == 1;
    const int s_end = alone ? num_active : split + 1;
    for (int s = alone ? 0 : split; s < s_end; s++) {
        att_block_partial<DM, GM>(sh, q, kh, vh, r, Q, D, h0, gn, last, s, scale, pm, pl, pa);
        if (alone) {
#pragma unroll
            for (int k = 0; k < NP; k++) merge_step(M[k], S[k], A[k], pm[k], pl[k], pa[k]);
        }
    }
    if (!alone) {
        // this split's partial of each pair; the last block of (slot, head group) merges
#pragma unroll
        for (int k = 0; k < NP; k++) {
            const int pair = warp + GQA_WARPS * k;
            if (pair >= gn * num_dim_blocks) continue;
            const int j = pair / num_dim_blocks, e = 32 * (pair % num_dim_blocks) + lane;
            float *mine = part + (((long long)slot * Q + h0 + j) * GQA_SPLITS + split) * (2 + D);
            if (e < D) mine[2 + e] = pa[k];
            if (e == 0) {
                mine[0] = pm[k];
                mine[1] = pl[k];
            }
        }
        __threadfence();
        __syncthreads();
        const int counter = slot * gridDim.y + blockIdx.y;
        if (threadIdx.x == 0) {
            sh.is_last = atomicAdd(counts + counter, 1) == num_active - 1;
            if (sh.is_last) counts[counter] = 0;  // ready for the next launch
        }
        __syncthreads();
        if (!sh.is_last) return;
#pragma unroll
        for (int k = 0; k < NP; k++) {
            const int pair = warp + GQA_WARPS * k;
            if (pair >= gn * num_dim_blocks) continue;
            const int j = pair / num_dim_blocks, e = 32 * (pair % num_dim_blocks) + lane;
            const float *parts = part + ((long long)slot * Q + h0 + j) * GQA_SPLITS * (2 + D);
            for (int s = 0; s < num_active; s++) {
                const float *ps = parts + s * (2 + D);
                merge_step(M[k], S[k], A[k], __ldcg(ps), __ldcg(ps + 1),
                           e < D ? __ldcg(ps + 2 + e) : 0.0f);
            }
        }
    }
#pragma unroll
    for (int k = 0; k < NP; k++) {
        const int pair = warp + GQA_WARPS * k;
        if (pair >= gn * num_dim_blocks) continue;  // the same in the whole warp
        const int j = pair / num_dim_blocks, e = 32 * (pair % num_dim_blocks) + lane;
        attention_store(A[k] / S[k], e, D, (long long)r * Q + h0 + j, out, outq, outd);
    }
}

template <int DM, int GM>
__device__ __forceinline__ void attention_rows(ATTENTION_ARGS, int R, int singles, int layer,
                                               int L, int Q, int KVH, int D, float scale,
                                               float *__restrict__ part,
                                               int *__restrict__ counts, int deep_from) {
    __shared__ AttShared<DM, GM> sh;
    const int G = Q / KVH, groups = (G + GM - 1) / GM;
    const int kvh = blockIdx.y / groups, hb = blockIdx.y % groups;
    const int h0 = kvh * G + hb * GM, gn = min(GM, G - hb * GM);
    const int x = blockIdx.x, step = gridDim.x;
    // the rows taken (those at pos >= deep_from of all, or of those no neighbour shares a
    // kv_base with), numbered in row order; this block takes the n-th for n % step == x. Rows
    // are scanned blockDim.x at a time (a prompt chunk has none to take, so the scan must not
    // walk its rows one by one).
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    // a decode window of at most `step` rows: row x (when deep), no scan
    const bool direct = !singles && R <= step;
    int base = 0;  // rows taken before i0 (the same in every thread)
    for (int i0 = 0; i0 < R; i0 += blockDim.x) {
        if (direct) {
            if (pos[x] < deep_from) return;  // attention_d*'s row (the whole block)
            attention_row<DM, GM>(sh, ATTENTION_PASS, x, x, layer, L, Q, KVH, D, kvh, h0, gn,
                                  scale, part, counts);
            return;
        }
        if (threadIdx.x == 0) sh.num_rows = 0;
        const int r = i0 + threadIdx.x;
        bool taken = r < R && pos[r] >= deep_from;
        if (taken && singles) {
            const unsigned long long b = kv_base[r];
            taken = !((r > 0 && kv_base[r - 1] == b) || (r + 1 < R && kv_base[r + 1] == b));
        }
        const unsigned ballot = __ballot_sync(0xffffffffu, taken);
        if (lane == 0) sh.warp_counts[warp] = __popc(ballot);
        __syncthreads();
        int before = 0, total = 0;  // rows taken by this scan in warps before this one, in all
        for (int w = 0; w < GQA_WARPS; w++) {
            before += w < warp ? sh.warp_counts[w] : 0;
            total += sh.warp_counts[w];
        }
        if (taken) {
            const int n = base + before + __popc(ballot & ((1u << lane) - 1u));
            // slot x for the first `step` rows; later ones by block (x, y, 0) alone
            if (n % step == x && (n < step || blockIdx.z == 0))
                sh.rows[atomicAdd(&sh.num_rows, 1)] = n < step ? r : -1 - r;
        }
        base += total;
        __syncthreads();
        const int num = sh.num_rows;
        for (int k = 0; k < num; k++) {
            const int code = sh.rows[k];  // r with slot x, or -1 - r with none
            attention_row<DM, GM>(sh, ATTENTION_PASS, code >= 0 ? code : -1 - code,
                                  code >= 0 ? x : -1, layer, L, Q, KVH, D, kvh, h0, gn, scale,
                                  part, counts);
        }
        __syncthreads();  // rows, num_rows and warp_counts are rewritten by the next scan
    }
}

// The entry points, one per dims per lane DM and heads per block GM
// (plan.attention_group_launch picks them from D and Q / KVH; each is a kernel of its own, so
// each gets its own registers): attention_group_d<DM>_g<GM>, block GQA_WARPS * 32.
#define ATTENTION_GROUP_KERNEL(NAME, DM, GM)                                                    \
    extern "C" __global__ void __launch_bounds__(GQA_WARPS * 32) attention_group_##NAME(       \
        ATTENTION_ARGS, int R, int singles, int layer, int L, int Q, int KVH, int D,            \
        float scale, float *__restrict__ part, int *__restrict__ counts, int deep_from) {       \
        kernel_entry();                                                                         \
        attention_rows<DM, GM>(ATTENTION_PASS, R, singles, layer, L, Q, KVH, D, scale, part,    \
                               counts, deep_from);                                              \
    }
ATTENTION_GROUP_KERNEL(d1_g1, 1, 1)
ATTENTION_GROUP_KERNEL(d1_g2, 1, 2)
ATTENTION_GROUP_KERNEL(d1_g4, 1, 4)
ATTENTION_GROUP_KERNEL(d1_g8, 1, 8)
ATTENTION_GROUP_KERNEL(d2_g1, 2, 1)
ATTENTION_GROUP_KERNEL(d2_g2, 2, 2)
ATTENTION_GROUP_KERNEL(d2_g4, 2, 4)
ATTENTION_GROUP_KERNEL(d2_g8, 2, 8)
ATTENTION_GROUP_KERNEL(d4_g1, 4, 1)
ATTENTION_GROUP_KERNEL(d4_g2, 4, 2)
ATTENTION_GROUP_KERNEL(d4_g4, 4, 4)
ATTENTION_GROUP_KERNEL(d4_g8, 4, 8)
ATTENTION_GROUP_KERNEL(d8_g1, 8, 1)
ATTENTION_GROUP_KERNEL(d8_g2, 8, 2)
ATTENTION_GROUP_KERNEL(d8_g4, 8, 4)
