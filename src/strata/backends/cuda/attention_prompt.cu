// Causal attention of prompt chunks on fp16 tensor cores (flash attention over the KV cache):
// a block per (16 window rows, KV head, group of up to 8 query heads), so the query heads of a
// GQA group share each K/V tile, loaded once into shared memory.
//
// Legend: R = window rows, Q = query heads, KVH = KV heads, G = Q / KVH heads per KV head,
// D = head dim, C = a KV's capacity (cells), L = layers, T = PA_CELLS cells of one KV tile.
// KV cells as in attention.cuh: half [L, 2 (K, V), KVH, C, D], or int8 [L, 2, KVH, C, D]
// followed by float scales [L, 2, KVH, C]; a row's kv_base has bit 0 set for int8 cells.
#include "attention.cuh"

#define PA_ROWS 16   // window rows per block: the M of one mma tile per warp
#define PA_CELLS 64  // cells per KV tile; tiles start at absolute positions 0, 64, 128, ...
#define PA_WARPS 8   // warps per block at most: one query head each

// ---- prompt attention. Rows handled: those in a run (a neighbour row of the window has the same
// kv_base: the rows of one prompt chunk or of one slot's drafts); the other rows are left to
// attention_singles. Within the block's 16 rows each run of equal kv_base is a segment: its KV
// tiles 0 .. max pos / T are loaded in order (cells past the segment's last position as zeros)
// and every row of the segment updates its own online softmax (cells past its own position, and
// whole tiles past it, masked: exact no-ops). So a row's sums run over its own cells in a fixed
// order of absolute-position tiles whatever its window, tile position or neighbours. Warp w
// holds the rows of query head kvh * G + z * W + w (W = blockDim / 32), mma m16n8k16 fp16 for
// Q.K^T and P.V with Q and P split into fp16 hi + lo parts (two mma steps each), so scores and
// sums are as exact as float32 ones (K/V cells are fp16; int8 cells become fp16 after scaling).
// Two buffers of K/V tiles in dynamic shared memory: tile i + 1 lands by cp.async while the
// warps multiply tile i (fp16 cells into the other buffer; int8 cells and scales as they are
// into buffer 1, scaled to fp16 into buffer 0 once they have landed).
// Two kernels, one per cell type (I8): attention_prompt takes the fp16 segments and rows,
// attention_prompt_i8 the int8 ones; each skips the other's, and a plan launches the ones its
// window's KVs need (plan.prompt_kernels). One kernel with a run-time choice of tile path cost
// fp16 cells 2-6% at depth (its registers and code are both paths'), session 41.
// The kernel is bound by the instructions of its tile loop (the hi + lo mma steps and the
// softmax beside them), so the loop does no more than it must: Q carries scale * log2(e), the
// weights come from exp2_ftz, a warp whose rows all keep their maxima skips the rescale, and a
// tile its rows all see whole skips the mask (H200, Qwen3-30B-A3B's heads, 512 rows at 16K /
// 64K: 0.872 / 3.358 ms a layer -> 0.752 / 2.876 over fp16 cells, 1.488 / 5.788 -> 1.023 /
// 3.937 over int8; tools/bench_prompt_attention.py, docs/cuda.md "Prompt attention").
// out [R, Q*D] float; outq / outd (when not NULL; D % 32 == 0) its 8-bit form per 32 dims.
// grid (ceil(R / 16), KVH, ceil(G / W)), block W * 32 (W = min(G, PA_WARPS)), dynamic shared
// memory 2 buffers x (K, V) x T x (D + 8) halves (plan.attention_prompt_shared_bytes); D in
// 16..128.

template <int D, bool I8>
__device__ __forceinline__ void prompt_body(
    const float *__restrict__ q, float *__restrict__ out, int8_t *__restrict__ outq,
    float *__restrict__ outd, const unsigned long long *__restrict__ kv_base,
    const int *__restrict__ pos, const int *__restrict__ cap, int R, int layer, int L, int Q,
    int KVH, float scale, __half *tiles) {
    constexpr int KS = D / 16;       // k-steps of Q.K^T
    constexpr int NT = D / 8;        // n-tiles of P.V
    constexpr int LDS = D + 8;       // shared row stride (halves): conflict-free fragments
    constexpr int CH = D / 8;        // 16-byte chunks per cell row
    constexpr int TILE = 2 * PA_CELLS * LDS;  // a buffer: K then V [T, D] (rows padded to LDS)
    __shared__ unsigned long long s_base[PA_ROWS];
    __shared__ int s_pos[PA_ROWS], s_cap[PA_ROWS], s_run[PA_ROWS];
    const int G = Q / KVH, W = blockDim.x >> 5;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const int t0 = blockIdx.x * PA_ROWS, kvh = blockIdx.y;
    const int hh = blockIdx.z * W + warp;  // this warp's head within the group
    const bool has_head = hh < G;
    const int h = kvh * G + (has_head ? hh : 0);
    if (threadIdx.x < PA_ROWS) {
        const int r = t0 + threadIdx.x;
        unsigned long long b = 0;
        int p = -1, cp = 0, run = 0;
        if (r < R) {
            b = kv_base[r];
            p = pos[r];
            cp = cap[r];
            run = (r > 0 && kv_base[r - 1] == b) || (r + 1 < R && kv_base[r + 1] == b);
        }
        s_base[threadIdx.x] = b;
        s_pos[threadIdx.x] = p;
        s_cap[threadIdx.x] = cp;
        s_run[threadIdx.x] = run;
    }
    // this thread's two rows: a = t0 + g, b = t0 + g + 8; Q as A fragments [KS][4], hi and lo,
    // scaled by scale * log2(e) first: the scores come out in the log2 domain (exp2f)
    const float sl2 = scale * LOG2E;
    const int ra = t0 + g, rb = t0 + g + 8;
    uint32_t qh[KS][4], ql[KS][4];
#pragma unroll
    for (int kk = 0; kk < KS; kk++) {
        float2 x[4];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int r = (i & 1) ? rb : ra, d = 16 * kk + 2 * c + ((i & 2) ? 8 : 0);
            x[i] = r < R ? *reinterpret_cast<const float2 *>(q + ((long long)r * Q + h) * D + d)
                         : make_float2(0.f, 0.f);
            split_half2(x[i].x * sl2, x[i].y * sl2, qh[kk][i], ql[kk][i]);
        }
    }
    float oacc[NT][4];                // [16 rows, D] of P.V: rows g (0, 1), g + 8 (2, 3)
#pragma unroll
    for (int n = 0; n < NT; n++) oacc[n][0] = oacc[n][1] = oacc[n][2] = oacc[n][3] = 0.0f;
    float m_a = -INFINITY, m_b = -INFINITY, l_a = 0.0f, l_b = 0.0f;  // l: this lane's columns
    __syncthreads();
    for (int seg = 0; seg < PA_ROWS;) {
        if (!s_run[seg]) {  // a single row (or past R): attention_singles has it
            seg++;
            continue;
        }
        const unsigned long long base = s_base[seg];
        int end = seg + 1, last = s_pos[seg];
        while (end < PA_ROWS && s_run[end] && s_base[end] == base) last = max(last, s_pos[end++]);
        const int lim_a = (g >= seg && g < end) ? s_pos[g] : -1;  // last visible cell per row
        const int lim_b = (g + 8 >= seg && g + 8 < end) ? s_pos[g + 8] : -1;
        if (((base & 1ull) != 0) != I8) {  // the other cell type's kernel has this segment
            seg = end;
            continue;
        }
        const KvHead kh = kv_head(base, L, layer, 0, KVH, kvh, s_cap[seg], D);
        const KvHead vh = kv_head(base, L, layer, 1, KVH, kvh, s_cap[seg], D);
        // tile kv0's cells by cp.async (cells past last as the copy's zero fill: finite), waited
        // for before the tile is read: fp16 cells into buffer `buf`; int8 cells and their
        // scales as they are into buffer 1 (raw: K [T, D] bytes, V [T, D], K scales [T], V
        // scales [T]), scaled to fp16 into buffer 0 by to_half once they have landed
        unsigned char *raw = reinterpret_cast<unsigned char *>(tiles + TILE);
        float *raw_scales = reinterpret_cast<float *>(raw + 2 * PA_CELLS * D);
        auto load_tile = [&](int kv0, int buf) {
            __half *tk = tiles + buf * TILE, *tv = tk + PA_CELLS * LDS;
            for (int i = threadIdx.x; i < PA_CELLS * CH; i += blockDim.x) {
                const int cl = i / CH, ch = i % CH, cell = kv0 + cl;
                const long long at = (long long)min(cell, last) * D + 8 * ch;
                const int bytes = cell <= last ? (I8 ? 8 : 16) : 0;  // 0: zeros
                if constexpr (I8) {  // 8 cells' bytes a copy: D / 8 copies a row
                    const unsigned dk =
                        (unsigned)__cvta_generic_to_shared(raw + cl * D + 8 * ch);
                    const unsigned dv = dk + PA_CELLS * D;
                    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(dk),
                                 "l"(kh.cells + at), "r"(bytes));
                    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(dv),
                                 "l"(vh.cells + at), "r"(bytes));
                    continue;
                }
                const unsigned dk = (unsigned)__cvta_generic_to_shared(tk + cl * LDS + 8 * ch);
                const unsigned dv = (unsigned)__cvta_generic_to_shared(tv + cl * LDS + 8 * ch);
                asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dk),
                             "l"(kh.cells + 2 * at), "r"(bytes));
                asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dv),
                             "l"(vh.cells + 2 * at), "r"(bytes));
            }
            for (int i = threadIdx.x; I8 && i < 2 * PA_CELLS; i += blockDim.x) {
                const int cl = i % PA_CELLS, cell = kv0 + cl;  // the scales, 4 bytes a copy
                const float *src = (i < PA_CELLS ? kh.scales : vh.scales) + min(cell, last);
                const unsigned d = (unsigned)__cvta_generic_to_shared(raw_scales + i);
                asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(d),
                             "l"(src), "r"(cell <= last ? 4 : 0));
            }
            asm volatile("cp.async.commit_group;\n" ::);
        };
        // an int8 tile landed in buffer 1 -> fp16 in buffer 0, as plain loads scaled it before
        auto to_half = [&]() {
            __half *tk = tiles, *tv = tk + PA_CELLS * LDS;
            for (int i = threadIdx.x; i < PA_CELLS * CH; i += blockDim.x) {
                const int cl = i / CH, ch = i % CH;
                const unsigned char *k8 = raw + cl * D + 8 * ch, *v8 = k8 + PA_CELLS * D;
                *reinterpret_cast<uint4 *>(tk + cl * LDS + 8 * ch) =
                    int8x8_to_half(*reinterpret_cast<const uint2 *>(k8), raw_scales[cl]);
                *reinterpret_cast<uint4 *>(tv + cl * LDS + 8 * ch) =
                    int8x8_to_half(*reinterpret_cast<const uint2 *>(v8),
                                   raw_scales[PA_CELLS + cl]);
            }
        };
        __syncthreads();  // the previous segment's last tile is read: its buffers are free
        load_tile(0, 0);
        for (int kv0 = 0, buf = 0; kv0 <= last; kv0 += PA_CELLS, buf ^= 1) {
            asm volatile("cp.async.wait_group 0;\n" ::);
            __syncthreads();  // tile kv0 has landed; every warp is done with the tile before it
            if constexpr (I8) {
                to_half();
                __syncthreads();  // buffer 0 holds the tile; buffer 1 may be written again
            }
            const int use = I8 ? 0 : buf;
            if (kv0 + PA_CELLS <= last) load_tile(kv0 + PA_CELLS, use ^ 1);  // in flight ...
            if (!has_head) continue;
            const __half *sk = tiles + use * TILE, *sv = sk + PA_CELLS * LDS;  // ... meanwhile
            // S [16, T] = Q . K^T: n-tile j holds cells 8j .. 8j + 7
            float s[PA_CELLS / 8][4];
#pragma unroll
            for (int j = 0; j < PA_CELLS / 8; j++) {
                s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
                const __half *kr = sk + (8 * j + g) * LDS + 2 * c;
#pragma unroll
                for (int kk = 0; kk < KS; kk++) {
                    const uint32_t b0 = *reinterpret_cast<const uint32_t *>(kr + 16 * kk);
                    const uint32_t b1 = *reinterpret_cast<const uint32_t *>(kr + 16 * kk + 8);
                    mma_f16(s[j], qh[kk], b0, b1);
                    mma_f16(s[j], ql[kk], b0, b1);
                }
            }
            // mask (not needed where the warp's rows all see the whole tile: deep in a
            // context, every tile but the last few), row maxima (a quad's 4 lanes share a row)
            if (!__all_sync(0xffffffffu, kv0 + PA_CELLS - 1 <= min(lim_a, lim_b))) {
#pragma unroll
                for (int j = 0; j < PA_CELLS / 8; j++) {
#pragma unroll
                    for (int e = 0; e < 2; e++) {
                        const int cell = kv0 + 8 * j + 2 * c + e;
                        s[j][e] = cell <= lim_a ? s[j][e] : -INFINITY;
                        s[j][2 + e] = cell <= lim_b ? s[j][2 + e] : -INFINITY;
                    }
                }
            }
            float mx_a = -INFINITY, mx_b = -INFINITY;
#pragma unroll
            for (int j = 0; j < PA_CELLS / 8; j++) {
                mx_a = fmaxf(mx_a, fmaxf(s[j][0], s[j][1]));
                mx_b = fmaxf(mx_b, fmaxf(s[j][2], s[j][3]));
            }
#pragma unroll
            for (int o = 1; o <= 2; o <<= 1) {
                mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, o));
                mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, o));
            }
            const float mn_a = fmaxf(m_a, mx_a), mn_b = fmaxf(m_b, mx_b);
            // a row with nothing visible yet keeps corr 1 and p 0: the tile is an exact no-op
            const float corr_a = mn_a == -INFINITY ? 1.0f : exp2f(m_a - mn_a);
            const float corr_b = mn_b == -INFINITY ? 1.0f : exp2f(m_b - mn_b);
            m_a = mn_a;
            m_b = mn_b;
            // P as fp16 hi + lo pairs: p?[j][0] row g, p?[j][1] row g + 8 (cells 8j + 2c, + 1);
            // a masked cell's weight is exp2_ftz(-inf) = 0 (a row with none visible: all masked,
            // taken against 0 rather than its -inf maximum)
            const float base_a = mn_a == -INFINITY ? 0.0f : mn_a;
            const float base_b = mn_b == -INFINITY ? 0.0f : mn_b;
            uint32_t ph[PA_CELLS / 8][2], pl[PA_CELLS / 8][2];
            float sum_a = 0.0f, sum_b = 0.0f;
#pragma unroll
            for (int j = 0; j < PA_CELLS / 8; j++) {
                float p[4];
#pragma unroll
                for (int e = 0; e < 4; e++) p[e] = exp2_ftz(s[j][e] - (e < 2 ? base_a : base_b));
                sum_a += p[0] + p[1];
                sum_b += p[2] + p[3];
                split_half2(p[0], p[1], ph[j][0], pl[j][0]);
                split_half2(p[2], p[3], ph[j][1], pl[j][1]);
            }
            l_a = l_a * corr_a + sum_a;
            l_b = l_b * corr_b + sum_b;
            // deep in a context a row's maximum seldom grows: a warp whose rows all keep theirs
            // (corr exactly 1) skips the rescale, which would leave the same bits
            if (__any_sync(0xffffffffu, corr_a != 1.0f || corr_b != 1.0f)) {
#pragma unroll
                for (int n = 0; n < NT; n++) {
                    oacc[n][0] *= corr_a;
                    oacc[n][1] *= corr_a;
                    oacc[n][2] *= corr_b;
                    oacc[n][3] *= corr_b;
                }
            }
            // O [16, D] += P [16, T] . V [T, D]: k-step kk = cells 16kk .. 16kk + 15
#pragma unroll
            for (int kk = 0; kk < PA_CELLS / 16; kk++) {
                const uint32_t a_hi[4] = {ph[2 * kk][0], ph[2 * kk][1], ph[2 * kk + 1][0],
                                          ph[2 * kk + 1][1]};
                const uint32_t a_lo[4] = {pl[2 * kk][0], pl[2 * kk][1], pl[2 * kk + 1][0],
                                          pl[2 * kk + 1][1]};
                const __half *vr =
                    sv + (16 * kk + (lane & 7) + ((lane >> 3) & 1) * 8) * LDS + (lane >> 4) * 8;
#pragma unroll
                for (int nn = 0; nn < NT / 2; nn++) {
                    uint32_t b[4];
                    ldmatrix_x4_trans(b, vr + 16 * nn);
                    mma_f16(oacc[2 * nn], a_hi, b[0], b[1]);
                    mma_f16(oacc[2 * nn], a_lo, b[0], b[1]);
                    mma_f16(oacc[2 * nn + 1], a_hi, b[2], b[3]);
                    mma_f16(oacc[2 * nn + 1], a_lo, b[2], b[3]);
                }
            }
        }
        seg = end;
    }
    if (!has_head) return;
    // row sums over the quad's columns, then out = O / l (+ 8-bit form per 32 dims)
#pragma unroll
    for (int o = 1; o <= 2; o <<= 1) {
        l_a += __shfl_xor_sync(0xffffffffu, l_a, o);
        l_b += __shfl_xor_sync(0xffffffffu, l_b, o);
    }
    // rows of this kernel's cell type only (the other kernel writes the others)
    const bool write_a = s_run[g] != 0 && ((s_base[g] & 1ull) != 0) == I8;
    const bool write_b = s_run[g + 8] != 0 && ((s_base[g + 8] & 1ull) != 0) == I8;
    const float inv_a = write_a ? 1.0f / l_a : 0.0f, inv_b = write_b ? 1.0f / l_b : 0.0f;
    const long long at_a = ((long long)ra * Q + h) * D, at_b = ((long long)rb * Q + h) * D;
#pragma unroll
    for (int n0 = 0; n0 < NT; n0 += 4) {  // 4 n-tiles = 32 dims = one quantisation block
        float oa[4][2], ob[4][2], amax_a = 0.0f, amax_b = 0.0f;
#pragma unroll
        for (int n = 0; n < 4 && n0 + n < NT; n++) {
            oa[n][0] = oacc[n0 + n][0] * inv_a;
            oa[n][1] = oacc[n0 + n][1] * inv_a;
            ob[n][0] = oacc[n0 + n][2] * inv_b;
            ob[n][1] = oacc[n0 + n][3] * inv_b;
            amax_a = fmaxf(amax_a, fmaxf(fabsf(oa[n][0]), fabsf(oa[n][1])));
            amax_b = fmaxf(amax_b, fmaxf(fabsf(ob[n][0]), fabsf(ob[n][1])));
            const int d = 8 * (n0 + n) + 2 * c;
            if (write_a)
                *reinterpret_cast<float2 *>(out + at_a + d) = make_float2(oa[n][0], oa[n][1]);
            if (write_b)
                *reinterpret_cast<float2 *>(out + at_b + d) = make_float2(ob[n][0], ob[n][1]);
        }
        if (outq == nullptr || NT % 4 != 0) continue;
#pragma unroll
        for (int o = 1; o <= 2; o <<= 1) {
            amax_a = fmaxf(amax_a, __shfl_xor_sync(0xffffffffu, amax_a, o));
            amax_b = fmaxf(amax_b, __shfl_xor_sync(0xffffffffu, amax_b, o));
        }
        const float dd_a = amax_a / 127.0f, dd_b = amax_b / 127.0f;
        const float id_a = dd_a > 0.0f ? 1.0f / dd_a : 0.0f;
        const float id_b = dd_b > 0.0f ? 1.0f / dd_b : 0.0f;
#pragma unroll
        for (int n = 0; n < 4; n++) {
            const int d = 8 * (n0 + n) + 2 * c;
            if (write_a) {
                outq[at_a + d] = q8_of(oa[n][0], id_a);
                outq[at_a + d + 1] = q8_of(oa[n][1], id_a);
            }
            if (write_b) {
                outq[at_b + d] = q8_of(ob[n][0], id_b);
                outq[at_b + d + 1] = q8_of(ob[n][1], id_b);
            }
        }
        if (c == 0 && write_a) outd[(at_a + 8 * n0) >> 5] = dd_a;
        if (c == 0 && write_b) outd[(at_b + 8 * n0) >> 5] = dd_b;
    }
}

template <bool I8>
__device__ __forceinline__ void prompt_kernel(
    const float *__restrict__ q, float *__restrict__ out, int8_t *__restrict__ outq,
    float *__restrict__ outd, const unsigned long long *__restrict__ kv_base,
    const int *__restrict__ pos, const int *__restrict__ cap, int R, int layer, int L, int Q,
    int KVH, int D, float scale) {
    kernel_entry();
    extern __shared__ __align__(16) __half kv_tiles[];  // 2 buffers of a K and a V tile
    if (D == 128)
        prompt_body<128, I8>(q, out, outq, outd, kv_base, pos, cap, R, layer, L, Q, KVH, scale,
                             kv_tiles);
    else if (D == 64)
        prompt_body<64, I8>(q, out, outq, outd, kv_base, pos, cap, R, layer, L, Q, KVH, scale,
                            kv_tiles);
    else if (D == 32)
        prompt_body<32, I8>(q, out, outq, outd, kv_base, pos, cap, R, layer, L, Q, KVH, scale,
                            kv_tiles);
    else if (D == 16)
        prompt_body<16, I8>(q, out, outq, outd, kv_base, pos, cap, R, layer, L, Q, KVH, scale,
                            kv_tiles);
}

// fp16 cells' segments and rows (int8 ones are skipped)
extern "C" __global__ void __launch_bounds__(PA_WARPS * 32)
attention_prompt(const float *__restrict__ q, float *__restrict__ out, int8_t *__restrict__ outq,
                 float *__restrict__ outd, const unsigned long long *__restrict__ kv_base,
                 const int *__restrict__ pos, const int *__restrict__ cap, int R, int layer,
                 int L, int Q, int KVH, int D, float scale) {
    prompt_kernel<false>(q, out, outq, outd, kv_base, pos, cap, R, layer, L, Q, KVH, D, scale);
}

// int8 cells' segments and rows (fp16 ones are skipped); the same arguments
extern "C" __global__ void __launch_bounds__(PA_WARPS * 32)
attention_prompt_i8(const float *__restrict__ q, float *__restrict__ out,
                    int8_t *__restrict__ outq, float *__restrict__ outd,
                    const unsigned long long *__restrict__ kv_base, const int *__restrict__ pos,
                    const int *__restrict__ cap, int R, int layer, int L, int Q, int KVH, int D,
                    float scale) {
    prompt_kernel<true>(q, out, outq, outd, kv_base, pos, cap, R, layer, L, Q, KVH, D, scale);
}
