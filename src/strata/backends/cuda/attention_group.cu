// The causal attention of decode rows deep in their context (pos >= the plan's deep_from;
// attention.cu's attention_d* takes the others). Legend and KV layout: attention.cuh.
//
// A row's query heads over cells [0, pos[r]] of its KV, split over S = gridDim.z blocks
// (flash-decoding) and shared by the heads of one GQA group, so each K/V cell is read once per
// group of up to GM heads, not once per head (attention_d* reads it once per head: 8x the bytes
// under Qwen3-30B-A3B's groups of 8, 448 us a layer at 64K cells on the H200). Cells go in
// chunks of 32 at fixed absolute positions: chunk i belongs to warp i % GQA_WARPS of split
// (i / GQA_WARPS) % S, so a row's splits, and every sum below, depend on its own
// position only: the same bits in any window and in any launch below.
// - The SIMT form (attention_group_d*, any D): a chunk's loads are issued together (lane j:
//   the whole K row of cell 32i + j; every lane: its DM dims [DM lane, DM lane + DM) of the
//   chunk's V rows). Lane j scores its cell against the block's GM heads (q in shared memory),
//   the warp's online softmax per head (a warp max per chunk; each lane sums its own cells'
//   weights, the warp adds them at the end), the weights go to shared memory and every lane
//   accumulates its dims of the chunk's V rows. The tensor-core form (attention_group_mma_d*,
//   D = 32, 64, 128; att_block_partial_mma) takes the same chunks with mma.
// - A block merges its warps into a partial per head (m, l, acc[D]). A row whose cells are all
//   split 0's (pos < 32 * GQA_WARPS) is written by that block; otherwise each block of a
//   split with cells stores its partial in part [2 PR, Q, S, 4 + D] (m, l, two unused, acc:
//   16-byte rows) at the row's slot, and attention_group_merge, the next launch, folds them
//   (att_fold: the largest m, then the weights' sums in split order; one partial alone gives
//   its own acc / l exactly). A block per (slot, query head) there, a thread per dim: the
//   fold of a row's 32 splits is 32 independent loads a thread. (It was the last block of
//   each slot's head group, after an atomic count: its 256 threads folded 8 heads x 128 dims
//   one split after another, ~14 us a layer at 32 splits on the H200, more than the cells of
//   a 16K context took to read.)
// - Which rows: those at pos >= deep_from of all R (`singles` 0: a decode window) or of those
//   no neighbour row shares a kv_base with (`singles` 1: beside attention_prompt in a
//   prompt-sized window); the n-th of them goes to block x = n % gridDim.x. The first
//   gridDim.x take slots n in part (rows[n] = the row, -1 for a slot without one: what the
//   merge launch reads); a row past them (a window with more such rows than slots) is
//   computed by block (x, y, 0) alone, split after split, its partials stored in part's slot
//   PR + x and folded there by att_fold: the same bits.
// out [R, Q*D] float; when outq is not NULL (D % 32 == 0) also its 8-bit form for the output
// projection. grid (PR = min(R, GQA_PART_ROWS), KVH * ceil(G / GM), S), G = Q / KVH; S is
// plan.GQA_SPLITS, one value for every launch of a model (the splits set the sums' order);
// block GQA_WARPS * 32; D % 8 == 0, D <= 32 DM. Then attention_group_merge: grid (PR, Q),
// block 32 * ceil(D / 32).
#include "attention.cuh"

#define GQA_WARPS 8
#define GQA_PART_ROWS 32
// a decode row's chunks per warp asked of the L2 before the wait (att_group_prefetch; 2 and 4
// were no faster in the model on the H200, and asking during the loop was slower: docs/cuda.md)
#define GQA_PREFETCH_CHUNKS 1

// Output pairs (head j of the block, 32-dim block b) of a thread: warp w takes pairs
// w, w + GQA_WARPS, ... of gn * ceil(D / 32), lane = dim within the block.
template <int DM, int GM>
struct AttPairs {
    static constexpr int N = (GM * DM + GQA_WARPS - 1) / GQA_WARPS;
};

// MMA: the tensor-core form's (its queries as fp16 fragments, no weights)
template <int DM, int GM, bool MMA>
struct __align__(16) AttShared {
    float sq[MMA ? 1 : GM][32 * DM];          // the block's heads' queries
    uint32_t qf[MMA ? 256 * DM : 4];          // or Q^T's B fragments (MMA_QF; 16-byte rows)
    float sp[GQA_WARPS][MMA ? 1 : GM][32];    // a chunk's weights per warp and head (times V scale)
    float sacc[GQA_WARPS][GM][32 * DM];
    float sm[GQA_WARPS][GM], sl[GQA_WARPS][GM];
    int rows[GQA_WARPS * 32];
    int num_rows;
    int warp_counts[GQA_WARPS];
};

// Dim e (< D) of a head's output from its n split partials hp [n, 4 + D] (m, l, -, -,
// acc[D]; every split has cells, so every m is finite): the largest m, then the weights'
// sums in split order with explicit fmaf, so every caller, whatever its threads, gets the
// same bits; one partial gives its acc / l exactly (expf(0) = 1).
__device__ __forceinline__ float att_fold(const float *hp, int n, int e, int D) {
    float M = -INFINITY;
#pragma unroll 8
    for (int s = 0; s < n; s++) M = fmaxf(M, __ldcg(hp + s * (4 + D)));
    float S = 0.0f, A = 0.0f;
#pragma unroll 8
    for (int s = 0; s < n; s++) {  // the loads do not wait for the sums: all in flight
        const float *p = hp + s * (4 + D);
        const float w = expf(__ldcg(p) - M);
        S = fmaf(__ldcg(p + 1), w, S);
        A = fmaf(__ldcg(p + 4 + e), w, A);
    }
    return A / S;
}

// The block's partial of each of this thread's pairs from its warps' (sm, sl, and sacc
// [GQA_WARPS, GM, 32 DM]): into pm / pl / pa. Called by the whole block once every warp has
// written its own.
template <int DM, int GM, bool MMA>
__device__ __forceinline__ void att_block_merge(AttShared<DM, GM, MMA> &sh, const float *sacc,
                                                int D, int gn,
                                                float (&pm)[AttPairs<DM, GM>::N],
                                                float (&pl)[AttPairs<DM, GM>::N],
                                                float (&pa)[AttPairs<DM, GM>::N]) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
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
            if (e < D) a += sacc[(w * GM + j) * 32 * DM + e] * wf;
        }
        pm[k] = mx;
        pl[k] = total;
        pa[k] = a;
    }
    __syncthreads();  // sq, sm, sl, sacc are rewritten by the next call
}

// The block's partial of split `split` of row r for heads h0 .. h0 + gn - 1: into pm / pl / pa
// of each of this thread's pairs. Called by the whole block.
template <int DM, int GM>
__device__ __forceinline__ void att_block_partial(
    AttShared<DM, GM, false> &sh, const float *__restrict__ q, const KvHead &kh, const KvHead &vh,
    int r, int Q, int D, int h0, int gn, int last, int split, float scale,
    float (&pm)[AttPairs<DM, GM>::N], float (&pl)[AttPairs<DM, GM>::N],
    float (&pa)[AttPairs<DM, GM>::N]) {
    constexpr int VROWS = DM <= 2 ? 32 : DM == 4 ? 16 : 8;  // V rows held at once
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int d0 = DM * lane;
    const int stride = 32 * GQA_WARPS * gridDim.z;  // gridDim.z: the launch's splits
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
    att_block_merge<DM, GM, false>(sh, &sh.sacc[0][0][0], D, gn, pm, pl, pa);
}

// ---- the tensor-core form of att_block_partial (D = 32, 64, 128: plan.attention_group_kernel),
// the same chunks, splits and block merge; a warp's chunk of 32 cells goes as two items of 16
// cells, with the block's (up to) 8 heads as the n = 8 of mma m16n8k16:
//   S^T [16 cells, 8 heads] = K [16 cells, D] . Q^T [D, 8 heads]
//   O^T [D, 8 heads] += V^T [D, 16 cells] . P^T [16 cells, 8 heads]
// Q and P enter as fp16 hi + lo pairs (two mma steps each: float32-like sums; K and V cells are
// fp16, or int8 integers with the K scale on the scores and the V scale on P). Lane (g, c)
// loads dims [32b + 8c, 32b + 8c + 8) of the item's cells g and g + 8 (16 bytes, or 8 of int8)
// for each 32-dim block b, all of an item's loads issued together:
// - the K words are S^T's A fragments once k-step (b, h) maps its k slots 2c + e to dims
//   32b + 8c + 4h + e and 2c + 8 + e to 32b + 8c + 4h + 2 + e (Q^T's B fragments the same);
// - the V words, 8x8 matrices [cells, dims] in fragment layout, become V^T's A fragments by
//   movmatrix.trans, O^T's row g of m-tile (b, p) then holding dim 32b + 8(g >> 1) + 4p +
//   (g & 1) and row g + 8 that + 2;
// - the weights [cells g, g + 8 x heads 2c, 2c + 1] of S^T's fragment, transposed the same
//   way, are P^T's B fragments.
// Each lane keeps heads 2c and 2c + 1's running max and its own cells' sum of weights. Q^T's
// fragments are read from shared memory at each mma and an item's V loads are issued after its
// scores, so a thread needs 128 registers: two blocks a multiprocessor. (Held in registers
// with the V loads beside the K loads: 252 registers, one block, 81.5 us a layer at 64K cells
// against 66.1; H200, one row of Qwen3-30B-A3B's heads.) The item loop is instantiated per
// cell type (an fp16 item: 389 SASS instructions at D = 128, where the loop with both types'
// paths had 1,086), its weights come from exp2_ftz and a warp whose heads all keep their
// maxima skips the rescale: tg64 at 16K / 64K 239-244 / 176-177 tokens/s against 227 / 169
// (session 42, docs/cuda.md).

// The L2 asked for the K and V lines of chunk [c0, c0 + 32) (to last) of a head, a line per
// lane at a time. Called by a whole warp.
__device__ __forceinline__ void att_prefetch_chunk(const KvHead &kh, const KvHead &vh, int c0,
                                                   int last, int D) {
    const long long cell_bytes = (long long)(kh.is_int8 ? 1 : 2) * D;
    const int bytes = (int)((min(last, c0 + 31) - c0 + 1) * cell_bytes);
    for (int off = 128 * (threadIdx.x & 31); off < bytes; off += 32 * 128) {
        asm volatile("prefetch.global.L2 [%0];" ::"l"(kh.cells + c0 * cell_bytes + off));
        asm volatile("prefetch.global.L2 [%0];" ::"l"(vh.cells + c0 * cell_bytes + off));
    }
}

// 8 consecutive dims [d, d + 8) of a cell as 4 fp16 pairs (int8 cells: their integers, exact)
template <int D, bool I8>
__device__ __forceinline__ void mma_load8(const KvHead &kv, int cell, int d, uint32_t (&w)[4]) {
    if constexpr (!I8) {
        const uint4 v =
            __ldg(reinterpret_cast<const uint4 *>(kv.cells) + ((long long)cell * D + d) / 8);
        w[0] = v.x;
        w[1] = v.y;
        w[2] = v.z;
        w[3] = v.w;
        return;
    }
    const uint2 v = __ldg(reinterpret_cast<const uint2 *>(kv.cells + (long long)cell * D + d));
    const int8_t *b = reinterpret_cast<const int8_t *>(&v);
#pragma unroll
    for (int j = 0; j < 4; j++)
        w[j] = half2_bits(__halves2half2(__int2half_rn(b[2 * j]), __int2half_rn(b[2 * j + 1])));
}

// word i of Q^T's B fragments [NB][h][hi, lo][2] of lane (g, c): at [..][g][c] in shared
// memory, so a warp's reads are 32 consecutive words
#define MMA_QF(b, h, hl, wi) ((((((b) * 2 + (h)) * 2 + (hl)) * 2 + (wi)) * 8 + g) * 4 + c)

// I8: the row's cells are int8 (the item loop instantiated per cell type: no choice inside)
template <int D, bool I8>
__device__ __forceinline__ void att_block_partial_mma(
    AttShared<D / 32, 8, true> &sh, const float *__restrict__ q, const KvHead &kh,
    const KvHead &vh, int r, int Q, int h0, int gn, int last, int split, float scale,
    float (&pm)[AttPairs<D / 32, 8>::N], float (&pl)[AttPairs<D / 32, 8>::N],
    float (&pa)[AttPairs<D / 32, 8>::N]) {
    constexpr int NB = D / 32;  // 32-dim blocks
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    // Q^T's B fragments of k-step (b, h): head g's dims 32b + 8c + 4h + 0..3, hi and lo, written
    // by warp 0 for the block
#pragma unroll
    for (int b = 0; b < NB && warp == 0; b++) {
#pragma unroll
        for (int h = 0; h < 2; h++) {
            float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
            if (g < gn)
                x = *reinterpret_cast<const float4 *>(q + ((long long)r * Q + h0 + g) * D +
                                                      32 * b + 8 * c + 4 * h);
            uint32_t hi0, lo0, hi1, lo1;
            split_half2(x.x, x.y, hi0, lo0);
            split_half2(x.z, x.w, hi1, lo1);
            sh.qf[MMA_QF(b, h, 0, 0)] = hi0;
            sh.qf[MMA_QF(b, h, 0, 1)] = hi1;
            sh.qf[MMA_QF(b, h, 1, 0)] = lo0;
            sh.qf[MMA_QF(b, h, 1, 1)] = lo1;
        }
    }
    __syncthreads();
    float acc[NB][2][4];  // O^T m-tile (b, p): rows g (0, 1), g + 8 (2, 3) x heads 2c, 2c + 1
#pragma unroll
    for (int b = 0; b < NB; b++)
#pragma unroll
        for (int p = 0; p < 2; p++) acc[b][p][0] = acc[b][p][1] = acc[b][p][2] = acc[b][p][3] = 0.f;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;  // heads 2c, 2c + 1
    const int stride = 32 * GQA_WARPS * gridDim.z;  // gridDim.z: the launch's splits
    for (int c0 = 32 * (split * GQA_WARPS + warp); c0 <= last; c0 += stride) {
#pragma unroll 1
        for (int half = 0; half < 2; half++) {  // one item's loads live at a time
            const int base = c0 + 16 * half;
            if (base > last) break;  // the same in the whole warp
            const bool ok_a = base + g <= last, ok_b = base + 8 + g <= last;
            const int ca = min(base + g, last), cb = min(base + 8 + g, last);  // past: finite
            // the item's K loads, issued together
            uint32_t ka[NB][4], kb[NB][4], va[NB][4], vb[NB][4];
#pragma unroll
            for (int b = 0; b < NB; b++) {
                mma_load8<D, I8>(kh, ca, 32 * b + 8 * c, ka[b]);
                mma_load8<D, I8>(kh, cb, 32 * b + 8 * c, kb[b]);
            }
            float ks_a = scale, ks_b = scale, vs_a = 1.0f, vs_b = 1.0f;
            if constexpr (I8) {
                ks_a *= __ldg(kh.scales + ca);
                ks_b *= __ldg(kh.scales + cb);
                vs_a = __ldg(vh.scales + ca);
                vs_b = __ldg(vh.scales + cb);
            }
            // S^T: cell g (0, 1) and g + 8 (2, 3) x heads 2c, 2c + 1
            float s[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int b = 0; b < NB; b++) {
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const uint32_t a[4] = {ka[b][2 * h], kb[b][2 * h], ka[b][2 * h + 1],
                                           kb[b][2 * h + 1]};
                    mma_f16(s, a, sh.qf[MMA_QF(b, h, 0, 0)], sh.qf[MMA_QF(b, h, 0, 1)]);
                    mma_f16(s, a, sh.qf[MMA_QF(b, h, 1, 0)], sh.qf[MMA_QF(b, h, 1, 1)]);
                }
            }
            s[0] = ok_a ? s[0] * ks_a : -INFINITY;
            s[1] = ok_a ? s[1] * ks_a : -INFINITY;
            s[2] = ok_b ? s[2] * ks_b : -INFINITY;
            s[3] = ok_b ? s[3] * ks_b : -INFINITY;
            // the V loads, in flight while the weights are computed
#pragma unroll
            for (int b = 0; b < NB; b++) {
                mma_load8<D, I8>(vh, ca, 32 * b + 8 * c, va[b]);
                mma_load8<D, I8>(vh, cb, 32 * b + 8 * c, vb[b]);
            }
            // each head's max over the item's 16 cells: the 8 lanes of equal c
            float mx0 = fmaxf(s[0], s[2]), mx1 = fmaxf(s[1], s[3]);
#pragma unroll
            for (int o = 4; o <= 16; o <<= 1) {
                mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, o));
                mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, o));
            }
            // finite: the item's first cell is visible; the first item's corr is expf(-inf) = 0
            const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
            // the weights by exp2_ftz (a masked cell's: of -inf, 0), the corrections by expf
            const float corr0 = expf(m0 - mn0), corr1 = expf(m1 - mn1);
            float p[4];
            p[0] = exp2_ftz((s[0] - mn0) * LOG2E);
            p[1] = exp2_ftz((s[1] - mn1) * LOG2E);
            p[2] = exp2_ftz((s[2] - mn0) * LOG2E);
            p[3] = exp2_ftz((s[3] - mn1) * LOG2E);
            l0 = l0 * corr0 + (p[0] + p[2]);
            l1 = l1 * corr1 + (p[1] + p[3]);
            m0 = mn0;
            m1 = mn1;
            // P^T's B fragments: the weights (times the V scale), transposed
            uint32_t wh0, wl0, wh1, wl1;
            split_half2(p[0] * vs_a, p[1] * vs_a, wh0, wl0);
            split_half2(p[2] * vs_b, p[3] * vs_b, wh1, wl1);
            const uint32_t bh0 = movmatrix_trans(wh0), bh1 = movmatrix_trans(wh1);
            const uint32_t bl0 = movmatrix_trans(wl0), bl1 = movmatrix_trans(wl1);
            // past the first items a head's maximum seldom grows: a warp whose heads all keep
            // theirs (corr exactly 1) skips the rescale, which would leave the same bits
            if (__any_sync(0xffffffffu, corr0 != 1.0f || corr1 != 1.0f)) {
#pragma unroll
                for (int b = 0; b < NB; b++) {
#pragma unroll
                    for (int pp = 0; pp < 2; pp++) {
                        acc[b][pp][0] *= corr0;
                        acc[b][pp][1] *= corr1;
                        acc[b][pp][2] *= corr0;
                        acc[b][pp][3] *= corr1;
                    }
                }
            }
#pragma unroll
            for (int b = 0; b < NB; b++) {
#pragma unroll
                for (int pp = 0; pp < 2; pp++) {
                    const uint32_t a[4] = {
                        movmatrix_trans(va[b][2 * pp]), movmatrix_trans(va[b][2 * pp + 1]),
                        movmatrix_trans(vb[b][2 * pp]), movmatrix_trans(vb[b][2 * pp + 1])};
                    mma_f16(acc[b][pp], a, bh0, bh1);
                    mma_f16(acc[b][pp], a, bl0, bl1);
                }
            }
        }
    }
    // the warp's partial to shared memory: sums over the lanes of equal c, O^T's rows to dims
#pragma unroll
    for (int o = 4; o <= 16; o <<= 1) {
        l0 += __shfl_xor_sync(0xffffffffu, l0, o);
        l1 += __shfl_xor_sync(0xffffffffu, l1, o);
    }
    if (g == 0) {
        sh.sm[warp][2 * c] = m0;
        sh.sm[warp][2 * c + 1] = m1;
        sh.sl[warp][2 * c] = l0;
        sh.sl[warp][2 * c + 1] = l1;
    }
#pragma unroll
    for (int b = 0; b < NB; b++) {
#pragma unroll
        for (int pp = 0; pp < 2; pp++) {
            const int d = 32 * b + 8 * (g >> 1) + 4 * pp + (g & 1);
            sh.sacc[warp][2 * c][d] = acc[b][pp][0];
            sh.sacc[warp][2 * c + 1][d] = acc[b][pp][1];
            sh.sacc[warp][2 * c][d + 2] = acc[b][pp][2];
            sh.sacc[warp][2 * c + 1][d + 2] = acc[b][pp][3];
        }
    }
    att_block_merge<D / 32, 8, true>(sh, &sh.sacc[0][0][0], D, gn, pm, pl, pa);
}
#undef MMA_QF

// Row r of the launch (heads h0 .. h0 + gn - 1), its partials at `slot` of part, or, for
// slot -1, every split in this block (split must be 0 then). Called by the whole block.
template <int DM, int GM, bool MMA>
__device__ __forceinline__ void attention_row(
    AttShared<DM, GM, MMA> &sh, ATTENTION_ARGS, int r, int slot, int layer, int L,
    int Q, int KVH, int D, int kvh, int h0, int gn, float scale, float *__restrict__ part) {
    constexpr int NP = AttPairs<DM, GM>::N;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int split = blockIdx.z, C = cap[r], last = pos[r];
    const int num_chunks = last / 32 + 1;
    const int splits = gridDim.z;
    const int num_active = min(splits, (num_chunks + GQA_WARPS - 1) / GQA_WARPS);
    if (slot >= 0 && split >= num_active) return;  // no cells: not counted below
    const KvHead kh = kv_head(kv_base[r], L, layer, 0, KVH, kvh, C, D);
    const KvHead vh = kv_head(kv_base[r], L, layer, 1, KVH, kvh, C, D);
    const int num_dim_blocks = (D + 31) >> 5;
    float pm[NP], pl[NP], pa[NP];
    // this block's splits: its own (a row with a slot: folded by the merge launch; or the
    // only one: written here), or every split (a row without a slot: folded here)
    const bool every = slot < 0 && num_active > 1;
    const int at = slot >= 0 ? slot : gridDim.x + blockIdx.x;  // part's slot for the partials
    for (int s = every ? 0 : split; s < (every ? num_active : split + 1); s++) {
        if constexpr (MMA) {
            if (kh.is_int8)
                att_block_partial_mma<32 * DM, true>(sh, q, kh, vh, r, Q, h0, gn, last, s,
                                                     scale, pm, pl, pa);
            else
                att_block_partial_mma<32 * DM, false>(sh, q, kh, vh, r, Q, h0, gn, last, s,
                                                      scale, pm, pl, pa);
        } else
            att_block_partial<DM, GM>(sh, q, kh, vh, r, Q, D, h0, gn, last, s, scale, pm, pl,
                                      pa);
#pragma unroll
        for (int k = 0; k < NP; k++) {
            const int pair = warp + GQA_WARPS * k;
            if (pair >= gn * num_dim_blocks) continue;  // the same in the whole warp
            const int j = pair / num_dim_blocks, e = 32 * (pair % num_dim_blocks) + lane;
            if (num_active == 1) {  // the row's only partial: its output (att_fold's bits)
                attention_store(pa[k] / pl[k], e, D, (long long)r * Q + h0 + j, out, outq,
                                outd);
                continue;
            }
            float *mine = part + (((long long)at * Q + h0 + j) * splits + s) * (4 + D);
            if (e < D) mine[4 + e] = pa[k];
            if (e == 0) {
                mine[0] = pm[k];
                mine[1] = pl[k];
            }
        }
    }
    if (!every) return;
    __threadfence();  // this block's partials in the L2, where att_fold reads them
    __syncthreads();
#pragma unroll
    for (int k = 0; k < NP; k++) {
        const int pair = warp + GQA_WARPS * k;
        if (pair >= gn * num_dim_blocks) continue;  // the same in the whole warp
        const int j = pair / num_dim_blocks, e = 32 * (pair % num_dim_blocks) + lane;
        const float *hp = part + ((long long)at * Q + h0 + j) * splits * (4 + D);
        attention_store(e < D ? att_fold(hp, num_active, e, D) : 0.0f, e, D,
                        (long long)r * Q + h0 + j, out, outq, outd);
    }
}

template <int DM, int GM, bool MMA>
__device__ __forceinline__ void attention_rows(ATTENTION_ARGS, int R, int singles, int layer,
                                               int L, int Q, int KVH, int D, float scale,
                                               float *__restrict__ part,
                                               int *__restrict__ slot_rows, int deep_from) {
    __shared__ AttShared<DM, GM, MMA> sh;
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
    if (!direct && threadIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0)
        slot_rows[x] = -1;  // no row at slot x yet (set below when the scan finds it)
    for (int i0 = 0; i0 < R; i0 += blockDim.x) {
        if (direct) {
            if (threadIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0)
                slot_rows[x] = pos[x] < deep_from ? -1 : x;  // the merge launch's row of slot x
            if (pos[x] < deep_from) return;  // attention_d*'s row (the whole block)
            attention_row<DM, GM, MMA>(sh, ATTENTION_PASS, x, x, layer, L, Q, KVH, D,
                                       kvh, h0, gn, scale, part);
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
            if (n == x && blockIdx.y == 0 && blockIdx.z == 0) slot_rows[x] = r;  // slot x's row
        }
        base += total;
        __syncthreads();
        const int num = sh.num_rows;
        for (int k = 0; k < num; k++) {
            const int code = sh.rows[k];  // r with slot x, or -1 - r with none
            attention_row<DM, GM, MMA>(sh, ATTENTION_PASS,
                                       code >= 0 ? code : -1 - code, code >= 0 ? x : -1, layer,
                                       L, Q, KVH, D, kvh, h0, gn, scale, part);
        }
        __syncthreads();  // rows, num_rows and warp_counts are rewritten by the next scan
    }
}

// Before kernel_entry's wait (launched programmatically, while the kernel before still runs):
// ask the L2 for this warp's first chunk of K and V cells (32 cells) of the block's row, in a
// decode window of at most gridDim.x rows (attention_rows' direct case). It reads the window's
// inputs only (pos, cap, kv_base: copied before the window's first kernel, written by none) and
// prefetches, which reads no data into registers: a cell the kernel before writes (the row's
// own, at pos) is never seen stale, since the L2 is where that write lands. In the model the
// first loads then find their cells in the L2 (the q/k/v products before this launch take a
// few us): tg64 at 16K 257 against 249 tokens/s without it (H200, session 43), though the
// kernel alone (bench_attention.py, after the merge launch of the layer before) is ~1 us
// slower with it.
template <int GM>
__device__ __forceinline__ void att_group_prefetch(ATTENTION_ARGS, int R, int singles, int layer,
                                                   int L, int Q, int KVH, int D,
                                                   int deep_from) {
    if (singles || R > gridDim.x) return;
    const int r = blockIdx.x, last = pos[r];
    const int c0 = 32 * (blockIdx.z * GQA_WARPS + (threadIdx.x >> 5));
    if (last < deep_from || c0 > last) return;
    const int groups = (Q / KVH + GM - 1) / GM;
    const KvHead kh = kv_head(kv_base[r], L, layer, 0, KVH, blockIdx.y / groups, cap[r], D);
    const KvHead vh = kv_head(kv_base[r], L, layer, 1, KVH, blockIdx.y / groups, cap[r], D);
    for (int i = 0; i < GQA_PREFETCH_CHUNKS; i++) {  // the warp's first chunks
        const int ci = c0 + i * 32 * GQA_WARPS * (int)gridDim.z;
        if (ci > last) break;
        att_prefetch_chunk(kh, vh, ci, last, D);
    }
}

// The entry points, one per dims per lane DM and heads per block GM
// (plan.attention_group_launch picks them from D and Q / KVH; each is a kernel of its own, so
// each gets its own registers): attention_group_d<DM>_g<GM> (SIMT, one block a
// multiprocessor) and attention_group_mma_d<D> (tensor cores, 8 heads a block, two blocks a
// multiprocessor), block GQA_WARPS * 32.
#define ATTENTION_GROUP_KERNEL(NAME, DM, GM, MMA)                                               \
    extern "C" __global__ void __launch_bounds__(GQA_WARPS * 32, MMA ? 2 : 1)                   \
        attention_group_##NAME(ATTENTION_ARGS, int R, int singles, int layer, int L, int Q,     \
                               int KVH, int D, float scale, float *__restrict__ part,           \
                               int *__restrict__ slot_rows, int deep_from) {                    \
        att_group_prefetch<GM>(ATTENTION_PASS, R, singles, layer, L, Q, KVH, D, deep_from);    \
        kernel_entry();                                                                         \
        attention_rows<DM, GM, MMA>(ATTENTION_PASS, R, singles, layer, L, Q, KVH, D, scale,     \
                                    part, slot_rows, deep_from);                                \
    }
ATTENTION_GROUP_KERNEL(d1_g1, 1, 1, false)
ATTENTION_GROUP_KERNEL(d1_g2, 1, 2, false)
ATTENTION_GROUP_KERNEL(d1_g4, 1, 4, false)
ATTENTION_GROUP_KERNEL(d1_g8, 1, 8, false)
ATTENTION_GROUP_KERNEL(d2_g1, 2, 1, false)
ATTENTION_GROUP_KERNEL(d2_g2, 2, 2, false)
ATTENTION_GROUP_KERNEL(d2_g4, 2, 4, false)
ATTENTION_GROUP_KERNEL(d2_g8, 2, 8, false)
ATTENTION_GROUP_KERNEL(d4_g1, 4, 1, false)
ATTENTION_GROUP_KERNEL(d4_g2, 4, 2, false)
ATTENTION_GROUP_KERNEL(d4_g4, 4, 4, false)
ATTENTION_GROUP_KERNEL(d4_g8, 4, 8, false)
ATTENTION_GROUP_KERNEL(d8_g1, 8, 1, false)
ATTENTION_GROUP_KERNEL(d8_g2, 8, 2, false)
ATTENTION_GROUP_KERNEL(d8_g4, 8, 4, false)
ATTENTION_GROUP_KERNEL(mma_d32, 1, 8, true)
ATTENTION_GROUP_KERNEL(mma_d64, 2, 8, true)
ATTENTION_GROUP_KERNEL(mma_d128, 4, 8, true)

// The fold of the split partials that the group launch before it stored: block (x, h), a
// thread per dim e, row slot_rows[x] (none: -1) and its query head h; a row whose cells are
// all split 0's was written by the group launch. grid (PR, Q), block 32 * ceil(D / 32);
// `splits`: the group launch's gridDim.z. part [2 PR, Q, splits, 4 + D] as above.
// A slot's partials sit at an address of (x, h) alone, so up to GQA_MERGE_WIDE splits every
// one of them is loaded at once, before the row and its split count are known (the loads of
// splits without cells are dropped by the fold): one trip to the L2 where att_fold's loop
// made ~10 (8 loads a batch, the maxima before the sums, the row's position before both): ~5
// us of each layer's ~25 at 16K cells on the H200 (docs/cuda.md, "Session 43"). The fold is
// att_fold's arithmetic in att_fold's order: the same bits.
#define GQA_MERGE_WIDE 32

// __ldcg that the compiler keeps in program order with the others (asm volatile): the fold's
// loads are issued before the row's, not sunk below its early returns
__device__ __forceinline__ float ldcg_ordered(const float *p) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ int ldcg_ordered(const int *p) {
    int v;
    asm volatile("ld.global.cg.s32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}
extern "C" __global__ void __launch_bounds__(256)
    attention_group_merge(ATTENTION_ARGS, int Q, int D, int splits,
                          const float *__restrict__ part, const int *__restrict__ slot_rows) {
    kernel_entry();
    const int x = blockIdx.x, h = blockIdx.y, e = threadIdx.x;
    const float *hp = part + ((long long)x * Q + h) * splits * (4 + D);
    if (splits > GQA_MERGE_WIDE) {  // a count plan.GQA_SPLITS never sets (bench_attention's)
        const int r = slot_rows[x];
        if (r < 0) return;  // the whole block
        const int num_active = min(splits, (pos[r] / 32 + GQA_WARPS) / GQA_WARPS);
        if (num_active == 1) return;
        attention_store(e < D ? att_fold(hp, num_active, e, D) : 0.0f, e, D,
                        (long long)r * Q + h, out, outq, outd);
        return;
    }
    float pm[GQA_MERGE_WIDE], pl[GQA_MERGE_WIDE], pa[GQA_MERGE_WIDE];
#pragma unroll
    for (int s = 0; s < GQA_MERGE_WIDE; s++) {
        const float *p = hp + s * (4 + D);
        pm[s] = pl[s] = pa[s] = 0.0f;
        if (s < splits) {
            pm[s] = ldcg_ordered(p);
            pl[s] = ldcg_ordered(p + 1);
            if (e < D) pa[s] = ldcg_ordered(p + 4 + e);
        }
    }
    const int r = ldcg_ordered(slot_rows + x);
    if (r < 0) return;  // the whole block
    const int num_active = min(splits, (pos[r] / 32 + GQA_WARPS) / GQA_WARPS);
    if (num_active == 1) return;
    float M = -INFINITY;
#pragma unroll
    for (int s = 0; s < GQA_MERGE_WIDE; s++)
        if (s < num_active) M = fmaxf(M, pm[s]);
    float S = 0.0f, A = 0.0f;
#pragma unroll
    for (int s = 0; s < GQA_MERGE_WIDE; s++) {
        if (s < num_active) {
            const float w = expf(pm[s] - M);
            S = fmaf(pl[s], w, S);
            A = fmaf(pa[s], w, A);
        }
    }
    attention_store(e < D ? A / S : 0.0f, e, D, (long long)r * Q + h, out, outq, outd);
}
