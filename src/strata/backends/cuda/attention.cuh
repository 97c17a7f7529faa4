// The attention kernels' common parts (attention.cu: a block per query head, for decode rows
// early in their context; attention_group.cu: a block per GQA group, for rows deep in it;
// attention_prompt.cu: prompt chunks): a KV head's cells, the loads of a chunk of 32 cells, the
// output store, the tensor-core helpers.
//
// Legend: R = window rows, H = hidden, Q = query heads, KVH = KV heads, D = head dim,
// C = a KV's capacity (cells), E = experts, K = experts per row, P = R * K pairs, V = vocab,
// L = layers. KV cache of one sequence: half [L, 2 (K, V), KVH, C, D], or int8 cells
// [L, 2, KVH, C, D] followed by float scales [L, 2, KVH, C] (one per token and head). A row's
// kv_base is the cells' device address with bit 0 set for int8 cells (allocations are
// 256-byte aligned, so the bit is free and a window may mix both kinds of KV).
#pragma once

#include "common.cuh"

#define ATT_DMAX 8  // D <= 32 * ATT_DMAX
#define LOG2E 1.4426950408889634f

// 2^x on the MUFU unit, results under 2^-126 flushed to zero (exp2f and expf add a fix-up for
// that range to every call): a softmax weight that small is zero in fp16 P and far below the
// last bit of a row's sum (attention_prompt.cu, attention_group.cu's tensor-core form)
__device__ __forceinline__ float exp2_ftz(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

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

// Dim e (< D, or a lane past it) of output row rh (= r * Q + h) of attention: the float value
// and, when outq is not NULL (D % 32 == 0: a warp's 32 dims are one block), its 8-bit form.
// Called by a whole warp.
__device__ __forceinline__ void attention_store(float o, int e, int D, long long rh,
                                                float *__restrict__ out, int8_t *__restrict__ outq,
                                                float *__restrict__ outd) {
    const long long at = rh * D + e;
    if (e < D) out[at] = o;
    if (outq != nullptr) {
        const float amax = warp_max(fabsf(o));
        const float dd = amax / 127.0f;
        const float id = dd > 0.0f ? 1.0f / dd : 0.0f;
        outq[at] = q8_of(o, id);
        if ((threadIdx.x & 31) == 0) outd[at >> 5] = dd;
    }
}

// One chunk's loads in a lane's registers. DM: dims per lane (1, 2, 4, 8), so D <= 32 DM;
// NV: V rows held at once (registers; 32 / NV loads per chunk).
template <int DM, int NV>
struct AttChunk {
    static constexpr int VROWS = NV;
    uint4 k[4 * DM];             // this lane's cell's K row: D / 8 words (int8: .x, .y of each)
    uint32_t v[VROWS][(DM + 1) / 2];  // this lane's dims of V rows: fp16 pairs or int8 quads
    float kscale, vscale;        // int8 cells: this lane's cell's K and V scales
};

// V row `row` (cell * D + d0) of this lane: DM fp16 or int8 values into words w
template <int DM>
__device__ __forceinline__ void att_load_v(const KvHead &vh, long long row, uint32_t *w) {
    if (!vh.is_int8) {
        const __half *p = reinterpret_cast<const __half *>(vh.cells) + row;
        if (DM == 1) w[0] = __ldg(reinterpret_cast<const unsigned short *>(p));
        if (DM == 2) w[0] = __ldg(reinterpret_cast<const unsigned int *>(p));
        if (DM == 4) {
            const uint2 r = __ldg(reinterpret_cast<const uint2 *>(p));
            w[0] = r.x;
            w[1] = r.y;
        }
        if (DM == 8) {
            const uint4 r = __ldg(reinterpret_cast<const uint4 *>(p));
            w[0] = r.x;
            w[1] = r.y;
            w[2] = r.z;
            w[3] = r.w;
        }
        return;
    }
    const uint8_t *p = vh.cells + row;
    if (DM == 1) w[0] = __ldg(p);
    if (DM == 2) w[0] = __ldg(reinterpret_cast<const unsigned short *>(p));
    if (DM == 4) w[0] = __ldg(reinterpret_cast<const unsigned int *>(p));
    if (DM == 8) {
        const uint2 r = __ldg(reinterpret_cast<const uint2 *>(p));
        w[0] = r.x;
        w[1] = r.y;
    }
}

// value i of a lane's V words (fp16 pairs or int8 quads)
template <int DM>
__device__ __forceinline__ float att_v_value(const uint32_t *w, int i, bool is_int8) {
    if (!is_int8)
        return __half2float(__ushort_as_half((unsigned short)(w[i >> 1] >> (16 * (i & 1)))));
    return (float)(int8_t)(w[i >> 2] >> (8 * (i & 3)));
}

// Issue the loads of the chunk at c0: lane's K row (cell min(c0 + lane, last)), V rows
// [c0 + j0, c0 + j0 + VROWS) (past last: row last, weighted 0 later) when the lane has dims.
template <int DM, int NV>
__device__ __forceinline__ void att_load_chunk(AttChunk<DM, NV> &ch, const KvHead &kh,
                                               const KvHead &vh, int c0, int j0, int last,
                                               int D, int d0, bool with_k) {
    const int lane = threadIdx.x & 31;
    if (with_k) {
        const int cell = min(c0 + lane, last);
        if (!kh.is_int8) {
            const uint4 *kc = reinterpret_cast<const uint4 *>(kh.cells + (long long)cell * D * 2);
#pragma unroll
            for (int i = 0; i < 4 * DM; i++)
                if (i < (D >> 3)) ch.k[i] = __ldg(kc + i);
        } else {
            const uint2 *kc = reinterpret_cast<const uint2 *>(kh.cells + (long long)cell * D);
#pragma unroll
            for (int i = 0; i < 4 * DM; i++) {
                if (i < (D >> 3)) {
                    const uint2 raw = __ldg(kc + i);
                    ch.k[i].x = raw.x;
                    ch.k[i].y = raw.y;
                }
            }
            ch.kscale = __ldg(kh.scales + cell);
            ch.vscale = __ldg(vh.scales + cell);
        }
    }
    if (d0 < D) {
#pragma unroll
        for (int j = 0; j < NV; j++)
            att_load_v<DM>(vh, (long long)min(c0 + j0 + j, last) * D + d0, ch.v[j]);
    }
}

// ---- tensor-core helpers (attention_prompt.cu, attention_group.cu)

// d[16x8] += a[16x16] . b[16x8], fp16 inputs, f32 accumulate (a row-major, b column-major)
__device__ __forceinline__ void mma_f16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                        uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two B fragments (n-tiles n0 and n0 + 8 of a [16 k x 16 n] piece) from a row-major [k][n]
// half tile: the 4 8x8 matrices transposed (ldmatrix .trans); addr is this lane's row start.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const __half *addr) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(addr);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
}

__device__ __forceinline__ uint32_t half2_bits(__half2 h) {
    return *reinterpret_cast<uint32_t *>(&h);
}

// (x, y) as two fp16 pairs hi + lo: hi = fp16(x), lo = fp16(x - hi), together ~22 bits of
// mantissa, so two fp16 mma steps (hi, then lo) give products as exact as float32 ones
__device__ __forceinline__ void split_half2(float x, float y, uint32_t &hi, uint32_t &lo) {
    const __half2 h = __floats2half2_rn(x, y);
    const float2 hf = __half22float2(h);
    hi = half2_bits(h);
    lo = half2_bits(__floats2half2_rn(x - hf.x, y - hf.y));
}

// 8 int8 cells times their scale -> 8 halves
__device__ __forceinline__ uint4 int8x8_to_half(uint2 raw, float scale) {
    const int8_t *b = reinterpret_cast<const int8_t *>(&raw);
    uint4 o;
    uint32_t *w = reinterpret_cast<uint32_t *>(&o);
#pragma unroll
    for (int j = 0; j < 4; j++)
        w[j] = half2_bits(__floats2half2_rn((float)b[2 * j] * scale, (float)b[2 * j + 1] * scale));
    return o;
}

// an 8x8 matrix of halves in mma fragment layout (lane 4i + j: row i, columns 2j and 2j + 1),
// transposed across the warp
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t a) {
    uint32_t d;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(d) : "r"(a));
    return d;
}

#define ATTENTION_ARGS                                                                          \
    const float *__restrict__ q, float *__restrict__ out, int8_t *__restrict__ outq,            \
        float *__restrict__ outd, const unsigned long long *__restrict__ kv_base,               \
        const int *__restrict__ pos, const int *__restrict__ cap
#define ATTENTION_PASS q, out, outq, outd, kv_base, pos, cap
