// Shared pieces of Strata's CUDA kernels: ggml type ids, exact fp16/bf16 reads, warp sums and
// the decode of one 16-column group of a GGUF weight row (the layout of _native/quant.h:
// w[i] = a * s[i] - b, s int8, one (a, b) per group of 16 columns).
#pragma once
#include <stdint.h>
#include <cuda_fp16.h>

// ggml type ids (gguf.GGMLQuantizationType)
#define ST_F32 0
#define ST_F16 1
#define ST_Q4_0 2
#define ST_Q4_1 3
#define ST_Q5_0 6
#define ST_Q5_1 7
#define ST_Q8_0 8
#define ST_Q2_K 10
#define ST_Q3_K 11
#define ST_Q4_K 12
#define ST_Q5_K 13
#define ST_Q6_K 14
#define ST_IQ2_XXS 16
#define ST_IQ2_XS 17
#define ST_IQ3_XXS 18
#define ST_IQ1_S 19
#define ST_IQ4_NL 20
#define ST_IQ3_S 21
#define ST_IQ2_S 22
#define ST_IQ4_XS 23
#define ST_IQ1_M 29
#define ST_BF16 30

#define WARP 32

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__device__ __forceinline__ uint16_t read_u16(const uint8_t *p) {
    return (uint16_t)p[0] | ((uint16_t)p[1] << 8);
}

// p is 2-byte aligned (Q4_0 / Q8_0 blocks are 18 / 34 bytes in rows of even length)
__device__ __forceinline__ uint32_t read_u32_a2(const uint8_t *p) {
    const uint16_t *h = reinterpret_cast<const uint16_t *>(p);
    return (uint32_t)h[0] | ((uint32_t)h[1] << 16);
}

// fp16 -> fp32 is exact (as the CPU's st_fp16_to_fp32)
__device__ __forceinline__ float read_f16(const uint8_t *p) {
    return __half2float(__ushort_as_half(read_u16(p)));
}

__device__ __forceinline__ float bf16_to_f32(uint16_t h) {
    return __uint_as_float((uint32_t)h << 16);
}

// bytes b0..b3 -> one int of 4 packed int8 (little endian, as dp4a reads it)
__device__ __forceinline__ int pack4(int b0, int b1, int b2, int b3) {
    return (b0 & 0xff) | ((b1 & 0xff) << 8) | ((b2 & 0xff) << 16) | ((b3 & 0xff) << 24);
}

// 6-bit scale and min of sub-block j of a Q4_K / Q5_K super-block (ggml get_scale_min_k4)
__device__ __forceinline__ void scale_min_k4(int j, const uint8_t *q, int &sc, int &m) {
    if (j < 4) {
        sc = q[j] & 63;
        m = q[j + 4] & 63;
    } else {
        sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// Programmatic dependent launch (cc >= 9.0; cuda_driver launches decode windows' kernels with it
// there): a kernel's blocks may be scheduled while the kernel before it in the stream still runs,
// so every kernel comes here before it touches global memory: wait until the previous kernel has
// finished and its writes are visible, then let the next kernel's blocks be scheduled. Before it
// a kernel may read only what no kernel writes: the model's weights (read-only loads, cp.async
// into shared memory) and the window's row descriptors (kv, pos, cap: copied before the window's
// first kernel); and it may ask the L2 to prefetch (no data reaches the kernel, so nothing is
// read stale: attention_group.cu's first chunks). On older GPUs, and for a plain launch, this
// is nothing.
// tests/backends/test_cuda_offline.py checks both in the PTX.
__device__ __forceinline__ void kernel_entry() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// The low nibble of each byte of v, minus 8, as 4 signed bytes: each byte is raised to 128 + n
// first so the subtraction never borrows across bytes (3 logic/add ops where __vsubss4 is
// emulated by more). Q4_0's values.
__device__ __forceinline__ int nibbles_minus_8(uint32_t v) {
    return (int)((((v & 0x0F0F0F0Fu) | 0x80808080u) - 0x08080808u) ^ 0x80808080u);
}

// Q2_K (scales[16]: scale | min << 4, qs[64], fp16 d, fp16 dmin) and Q3_K (hmask[32], qs[64],
// 12 bytes of 6-bit scales, fp16 d) super-blocks: 32-column block b = 4h + j holds the 2-bit
// values (qs[32h + l] >> 2j) & 3, l = 0..31; Q3_K subtracts 4 where bit b of hmask[l] is clear.
// Word w (columns 4w .. 4w + 3) of block b as 4 int8 values:
template <int QT>
__device__ __forceinline__ int k23_word(const uint8_t *blk, int b, int w) {
    const uint8_t *qs = blk + (QT == ST_Q2_K ? 16 : 32) + 32 * (b >> 2);
    const uint32_t x = (read_u32_a2(qs + 4 * w) >> (2 * (b & 3))) & 0x03030303u;
    if (QT == ST_Q2_K) return (int)x;
    const uint32_t h = (read_u32_a2(blk + 4 * w) >> b) & 0x01010101u;  // 1: no offset
    return (int)(((x | (h << 2) | 0x80808080u) - 0x04040404u) ^ 0x80808080u);
}

// Scale (and Q2_K's min) of 16-column group g (0..15) of a Q2_K / Q3_K super-block
template <int QT>
__device__ __forceinline__ void k23_scale(const uint8_t *blk, int g, float &a, float &m) {
    if (QT == ST_Q2_K) {
        a = read_f16(blk + 80) * (float)(blk[g] & 15);
        m = read_f16(blk + 82) * (float)(blk[g] >> 4);
    } else {
        const uint8_t *sc = blk + 96;
        const int lo = g < 8 ? sc[g] & 15 : sc[g - 8] >> 4;
        const int hi = (sc[8 + (g & 3)] >> (2 * (g >> 2))) & 3;
        a = read_f16(blk + 108) * (float)((lo | (hi << 4)) - 32);
        m = 0.0f;
    }
}

// IQ4_XS's non-linear values of 4 indices (0..15, one per byte of nib4) as 4 int8: the 16-entry
// table is 4 words; __byte_perm picks from its first or second half by each index's low 3 bits,
// bit 3 chooses the half
__device__ __forceinline__ int iq4_values(uint32_t nib4) {
    // -127, -104, -83, -65 | -49, -35, -22, -10 | 1, 13, 25, 38 | 53, 69, 89, 113
    const uint32_t sel = (nib4 & 7u) | ((nib4 >> 4) & 0x70u) | ((nib4 >> 8) & 0x700u)
                         | ((nib4 >> 12) & 0x7000u);
    const uint32_t lo = __byte_perm(0xBFAD9881u, 0xF6EADDCFu, sel);
    const uint32_t hi = __byte_perm(0x26190D01u, 0x71594535u, sel);
    const uint32_t pick = ((nib4 >> 3) & 0x01010101u) * 0xFFu;
    return (int)((lo & ~pick) | (hi & pick));
}

// IQ4_XS (fp16 d, u16 high scale bits, 4 bytes of low scale nibbles, qs[128]): block b of 32
// has the scale d * (ls - 32) and its 16 bytes at 8 + 16b (low nibbles: columns 0-15)
__device__ __forceinline__ float iq4xs_scale(const uint8_t *blk, int b) {
    const int ls = ((blk[4 + (b >> 1)] >> (4 * (b & 1))) & 15)
                   | (((read_u16(blk + 2) >> (2 * b)) & 3) << 4);
    return read_f16(blk) * (float)(ls - 32);
}

// The 32-column blocks of Q4_1, Q5_0, Q5_1 and IQ4_NL (llama.cpp writes the last three for
// rows whose length is not a multiple of 256 in k-quant files): fp16 d, [fp16 m], [u32 qh],
// qs[16]; value i < 16 in the low nibble of qs[i], value i + 16 in its high nibble, bit i of qh
// the fifth bit of value i. w = a * s - b with a = d and b = -m (Q4_1 / Q5_1: s = q >= 0,
// w = d * q + m), b = 0 else (Q5_0: s = q - 16; IQ4_NL: s = the table's value). Every field is
// 2-byte aligned only (blocks of 18-24 bytes).
template <int QT> struct Block32;
template <> struct Block32<ST_Q4_1> { static constexpr int bytes = 20, qs = 4, qh = 0, min = 1; };
template <> struct Block32<ST_Q5_0> { static constexpr int bytes = 22, qs = 6, qh = 2, min = 0; };
template <> struct Block32<ST_Q5_1> { static constexpr int bytes = 24, qs = 8, qh = 4, min = 1; };
template <> struct Block32<ST_IQ4_NL> { static constexpr int bytes = 18, qs = 2, qh = 0, min = 0; };

__host__ __device__ constexpr bool is_block32_type(int qt) {
    return qt == ST_Q4_1 || qt == ST_Q5_0 || qt == ST_Q5_1 || qt == ST_IQ4_NL;
}

// Word w (0..3) of half h (0: columns 0-15, 1: 16-31) of a Block32 block as 4 int8 values
// (columns 16h + 4w .. +3): qs4 = its qs bytes 4w .. 4w+3 as one word, qh the block's fifth
// bits (Q5_0 / Q5_1). Bits 4w..4w+3 of the half's qh go to bit 4 of bytes 0..3 (x * 0x204081
// puts bit j at bit 8j).
template <int QT>
__device__ __forceinline__ int block32_word(uint32_t qs4, uint32_t qh, int h, int w) {
    uint32_t x = (qs4 >> (4 * h)) & 0x0F0F0F0Fu;
    if constexpr (QT == ST_IQ4_NL) return iq4_values(x);
    if constexpr (QT == ST_Q5_0 || QT == ST_Q5_1)
        x |= ((((qh >> (16 * h + 4 * w)) & 15u) * 0x00204081u) & 0x01010101u) << 4;
    if constexpr (QT == ST_Q5_0)  // byte-wise x - 16 (x is 0..31: no borrow crosses a byte)
        return (int)(((x | 0x80808080u) - 0x10101010u) ^ 0x80808080u);
    return (int)x;
}

// A Block32 block at blk: its scale a = d, its b = -m (0 without mins), the fifth bits
template <int QT>
__device__ __forceinline__ void block32_head(const uint8_t *blk, float &a, float &b,
                                             uint32_t &qh) {
    a = read_f16(blk);
    b = Block32<QT>::min ? -read_f16(blk + 2) : 0.0f;
    qh = Block32<QT>::qh ? read_u32_a2(blk + Block32<QT>::qh) : 0u;
}

// A whole Block32 block: its 32 int8 values to v[8] (4 per int, column order), a and b as above
template <int QT>
__device__ __forceinline__ void unpack_block32(const uint8_t *blk, int (&v)[8], float &a,
                                               float &b) {
    uint32_t qh;
    block32_head<QT>(blk, a, b, qh);
#pragma unroll
    for (int w = 0; w < 4; w++) {
        const uint32_t x = read_u32_a2(blk + Block32<QT>::qs + 4 * w);
        v[w] = block32_word<QT>(x, qh, 0, w);
        v[w + 4] = block32_word<QT>(x, qh, 1, w);
    }
}

// ---- the grid i-quants: IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M --------------------
// 256-column super-blocks (gguf's layouts, its dequantize_blocks) whose values are entries of a
// grid: 8 (IQ3_*: 4) values per index, from iq_tables.cuh, which runtime.module_source writes
// from strata/model/iq_grids.py (gguf's grids). Group g of 16 columns: s = the grid value times
// its sign (IQ2_*: 8, 25, 43; IQ3_XXS: 4 .. 62; IQ3_S: 1 .. 15), a = gguf's float scale
// factored as gguf computes it (IQ2_*: (d * (0.5 + ls)) * 0.25, IQ3_XXS: (d * (0.5 + ls)) * 0.5,
// IQ3_S: d * (1 + 2 ls)), so a * s rounds as gguf's value. IQ1_S / IQ1_M: gguf's dl * (grid +-
// 0.125) is (dl / 8) * (8 grid +- 1): a = dl / 8 (exact), s = 8 grid +- 1 in [-9, 9]. b = 0.
#include "iq_tables.cuh"

// super-block bytes, a scale per 16 columns (else per 32); 0 for the other types
template <int QT> struct IqGrid { static constexpr int bytes = 0, per16 = 0; };
template <> struct IqGrid<ST_IQ2_XXS> { static constexpr int bytes = 66, per16 = 0; };
template <> struct IqGrid<ST_IQ2_XS> { static constexpr int bytes = 74, per16 = 1; };
template <> struct IqGrid<ST_IQ2_S> { static constexpr int bytes = 82, per16 = 1; };
template <> struct IqGrid<ST_IQ3_XXS> { static constexpr int bytes = 98, per16 = 0; };
template <> struct IqGrid<ST_IQ3_S> { static constexpr int bytes = 110, per16 = 0; };
template <> struct IqGrid<ST_IQ1_S> { static constexpr int bytes = 50, per16 = 0; };
template <> struct IqGrid<ST_IQ1_M> { static constexpr int bytes = 56, per16 = 1; };

__host__ __device__ constexpr bool is_iq_grid_type(int qt) {
    return qt == ST_IQ2_XXS || qt == ST_IQ2_XS || qt == ST_IQ2_S || qt == ST_IQ3_XXS
           || qt == ST_IQ3_S || qt == ST_IQ1_S || qt == ST_IQ1_M;
}

// The sign pattern of a 7-bit index (IQ2_XXS / IQ2_XS / IQ3_XXS): its bits, and as bit 7 their
// parity (an even count of negated values); bit j set: value j is negated
__device__ __forceinline__ uint32_t iq_ksign(uint32_t i) {
    return i | ((__popc(i) & 1u) << 7);
}

// 4 positive int8 values (one grid word), byte j negated where bit j of signs is set: x ^ 0xFF
// + 1 per negated byte (values 1..62: no carry leaves a byte; x * 0x204081 puts bit j at 8j)
__device__ __forceinline__ int iq_signed(uint32_t v, uint32_t signs) {
    const uint32_t one = ((signs & 15u) * 0x00204081u) & 0x01010101u;
    return (int)((v ^ (one * 0xFFu)) + one);
}

// 4 bytes of st_iq1_grid (8 * (value + 1): 0, 8, 16) as 8 * value + 1 (negative_delta false)
// or 8 * value - 1: byte-wise minus 7 or 9, raised to 128 + x first so no borrow crosses a byte
__device__ __forceinline__ int iq1_values(uint32_t t, bool negative_delta) {
    const uint32_t k = negative_delta ? 0x09090909u : 0x07070707u;
    return (int)(((t | 0x80808080u) - k) ^ 0x80808080u);
}

// Group gi (0..15, columns 16 gi .. +15) of an i-quant super-block at blk (2-byte aligned):
// its 16 s values to v[4] (4 per int, column order) and its scale a
template <int QT>
__device__ __forceinline__ void iq_group(const uint8_t *blk, int gi, int (&v)[4], float &a) {
    if constexpr (QT == ST_IQ2_XXS) {  // fp16 d, per 32 columns: u32 grid bytes, u32 signs/ls
        const uint8_t *q = blk + 2 + 8 * (gi >> 1);
        const uint32_t aux0 = read_u32_a2(q), aux1 = read_u32_a2(q + 4);
        a = (read_f16(blk) * (0.5f + (float)(aux1 >> 28))) * 0.25f;
#pragma unroll
        for (int k = 0; k < 2; k++) {
            const int l = 2 * (gi & 1) + k;  // 8 columns: grid byte l, signs bits 7l..7l+6
            const unsigned long long gv = st_iq2xxs_grid[(aux0 >> (8 * l)) & 255];
            const uint32_t sb = iq_ksign((aux1 >> (7 * l)) & 127);
            v[2 * k] = iq_signed((uint32_t)gv, sb);
            v[2 * k + 1] = iq_signed((uint32_t)(gv >> 32), sb >> 4);
        }
    } else if constexpr (QT == ST_IQ2_XS) {  // fp16 d, u16 qs[32] (9-bit grid, 7-bit signs),
        const int ls = (blk[66 + (gi >> 1)] >> (4 * (gi & 1))) & 15;  // 4-bit scales[16]
        a = (read_f16(blk) * (0.5f + (float)ls)) * 0.25f;
#pragma unroll
        for (int k = 0; k < 2; k++) {
            const uint32_t qv = read_u16(blk + 2 + 4 * gi + 2 * k);
            const unsigned long long gv = st_iq2xs_grid[qv & 511];
            const uint32_t sb = iq_ksign(qv >> 9);
            v[2 * k] = iq_signed((uint32_t)gv, sb);
            v[2 * k + 1] = iq_signed((uint32_t)(gv >> 32), sb >> 4);
        }
    } else if constexpr (QT == ST_IQ2_S) {  // fp16 d, qs[32], signs[32], qh[8], scales[8]
        const int ls = (blk[74 + (gi >> 1)] >> (4 * (gi & 1))) & 15;
        a = (read_f16(blk) * (0.5f + (float)ls)) * 0.25f;
#pragma unroll
        for (int k = 0; k < 2; k++) {
            const int i = 2 * gi + k;  // 8 columns: grid index qs[i] | 2 bits of qh << 8
            const int idx = blk[2 + i] | (((blk[66 + (i >> 2)] >> (2 * (i & 3))) & 3) << 8);
            const unsigned long long gv = st_iq2s_grid[idx];
            const uint32_t sb = blk[34 + i];
            v[2 * k] = iq_signed((uint32_t)gv, sb);
            v[2 * k + 1] = iq_signed((uint32_t)(gv >> 32), sb >> 4);
        }
    } else if constexpr (QT == ST_IQ3_XXS) {  // fp16 d, qs[64] (4 columns each), u32[8] signs/ls
        const uint32_t aux = read_u32_a2(blk + 66 + 4 * (gi >> 1));
        a = (read_f16(blk) * (0.5f + (float)(aux >> 28))) * 0.5f;
        const uint8_t *q = blk + 2 + 8 * (gi >> 1) + 4 * (gi & 1);
#pragma unroll
        for (int k = 0; k < 2; k++) {
            const uint32_t sb = iq_ksign((aux >> (7 * (2 * (gi & 1) + k))) & 127);
            v[2 * k] = iq_signed(st_iq3xxs_grid[q[2 * k]], sb);
            v[2 * k + 1] = iq_signed(st_iq3xxs_grid[q[2 * k + 1]], sb >> 4);
        }
    } else if constexpr (QT == ST_IQ3_S) {  // fp16 d, qs[64], qh[8], signs[32], scales[4]
        const int ls = (blk[106 + (gi >> 2)] >> (4 * ((gi >> 1) & 1))) & 15;
        a = read_f16(blk) * (float)(1 + 2 * ls);
#pragma unroll
        for (int w = 0; w < 4; w++) {
            const int i = 4 * gi + w;  // 4 columns: grid index qs[i] | bit i of qh << 8
            const int idx = blk[2 + i] | (((blk[66 + (i >> 3)] >> (i & 7)) & 1) << 8);
            v[w] = iq_signed(st_iq3s_grid[idx], blk[74 + (i >> 1)] >> (4 * (i & 1)));
        }
    } else if constexpr (QT == ST_IQ1_S) {  // fp16 d, qs[32], u16 qh[8] (per 32 columns)
        const uint32_t qh = read_u16(blk + 34 + 2 * (gi >> 1));
        a = (read_f16(blk) * (float)(2 * ((qh >> 12) & 7) + 1)) * 0.125f;
        const bool negative = (qh & 0x8000u) != 0;
#pragma unroll
        for (int k = 0; k < 2; k++) {
            const int l = 2 * (gi & 1) + k;  // 8 columns: qs[4 ib + l] | 3 bits of qh << 8
            const int idx = blk[2 + 4 * (gi >> 1) + l] | (((qh >> (3 * l)) & 7) << 8);
            const unsigned long long gv = st_iq1_grid[idx];
            v[2 * k] = iq1_values((uint32_t)gv, negative);
            v[2 * k + 1] = iq1_values((uint32_t)(gv >> 32), negative);
        }
    } else {  // IQ1_M: qs[32], qh[16] (per 8 columns: 3 index bits, the delta's sign), u16
              // scales[4] (3 bits per 16 columns; the top 4 bits of each: fp16 d)
        const uint16_t s0 = read_u16(blk + 48), s1 = read_u16(blk + 50);
        const uint16_t s2 = read_u16(blk + 52), s3 = read_u16(blk + 54);
        const uint16_t dbits = (uint16_t)((s0 >> 12) | ((s1 >> 8) & 0x00F0u)
                                          | ((s2 >> 4) & 0x0F00u) | (s3 & 0xF000u));
        const int ls = (read_u16(blk + 48 + 2 * (gi >> 2)) >> (3 * (gi & 3))) & 7;
        a = (__half2float(__ushort_as_half(dbits)) * (float)(2 * ls + 1)) * 0.125f;
#pragma unroll
        for (int k = 0; k < 2; k++) {
            const int nib = (blk[32 + gi] >> (4 * k)) & 15;  // 8 columns i = 2 gi + k
            const unsigned long long gv = st_iq1_grid[blk[2 * gi + k] | ((nib & 7) << 8)];
            v[2 * k] = iq1_values((uint32_t)gv, (nib & 8) != 0);
            v[2 * k + 1] = iq1_values((uint32_t)(gv >> 32), (nib & 8) != 0);
        }
    }
}

// Group g (columns 16g .. 16g+15) of a quantised row: v[4] holds the 16 int8 s values,
// w = a * s - b. Bit layouts follow ggml-quants.c (and _native/quant_ref.c).
template <int QT>
__device__ __forceinline__ void decode_group(const uint8_t *row, int g, int (&v)[4], float &a,
                                             float &b) {
    if (QT == ST_Q4_0) {
        const uint8_t *blk = row + (g >> 1) * 18;  // fp16 d, 16 bytes of nibbles
        a = __half2float(*reinterpret_cast<const __half *>(blk));
        b = 0.0f;
        const int shift = (g & 1) * 4;  // columns 0-15: low nibbles, 16-31: high nibbles
#pragma unroll
        for (int i = 0; i < 4; i++) {
            // 2-byte aligned: read the 4 bytes as two u16
            v[i] = nibbles_minus_8(read_u32_a2(blk + 2 + 4 * i) >> shift);
        }
    } else if constexpr (is_block32_type(QT)) {
        const uint8_t *blk = row + (g >> 1) * Block32<QT>::bytes;
        uint32_t qh;
        block32_head<QT>(blk, a, b, qh);
#pragma unroll
        for (int i = 0; i < 4; i++)
            v[i] = block32_word<QT>(read_u32_a2(blk + Block32<QT>::qs + 4 * i), qh, g & 1, i);
    } else if constexpr (is_iq_grid_type(QT)) {
        iq_group<QT>(row + (g >> 4) * IqGrid<QT>::bytes, g & 15, v, a);
        b = 0.0f;
    } else if (QT == ST_Q8_0) {
        const uint8_t *blk = row + (g >> 1) * 34;  // fp16 d, 32 int8
        a = read_f16(blk);
        b = 0.0f;
        const uint8_t *q = blk + 2 + (g & 1) * 16;
#pragma unroll
        for (int i = 0; i < 4; i++)
            v[i] = (int)read_u32_a2(q + 4 * i);
    } else if (QT == ST_Q4_K || QT == ST_Q5_K) {
        const int is_q5 = QT == ST_Q5_K;
        const uint8_t *blk = row + (g >> 4) * (is_q5 ? 176 : 144);
        const int gi = g & 15, sub = gi >> 1, half = gi & 1;
        int sc, m;
        scale_min_k4(sub, blk + 4, sc, m);
        a = read_f16(blk) * (float)sc;
        b = read_f16(blk + 2) * (float)m;
        const uint8_t *qh = blk + 16;                            // Q5_K: 32 bytes of 5th bits
        const uint8_t *q = blk + (is_q5 ? 48 : 16) + 32 * (sub >> 1);
        const int shift = (sub & 1) * 4;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            int e[4];
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const int l = 16 * half + 4 * i + j;
                int x = (q[l] >> shift) & 0xF;
                if (is_q5) x |= ((qh[l] >> sub) & 1) << 4;
                e[j] = x;
            }
            v[i] = pack4(e[0], e[1], e[2], e[3]);
        }
    } else if (QT == ST_Q2_K || QT == ST_Q3_K) {
        const uint8_t *blk = row + (g >> 4) * (QT == ST_Q2_K ? 84 : 110);
        const int gi = g & 15;
#pragma unroll
        for (int i = 0; i < 4; i++) v[i] = k23_word<QT>(blk, gi >> 1, 4 * (gi & 1) + i);
        k23_scale<QT>(blk, gi, a, b);
    } else if (QT == ST_IQ4_XS) {
        const uint8_t *blk = row + (g >> 4) * 136;
        const int gi = g & 15, shift = 4 * (gi & 1);
        const uint8_t *q = blk + 8 + 16 * (gi >> 1);
#pragma unroll
        for (int i = 0; i < 4; i++)
            v[i] = iq4_values((read_u32_a2(q + 4 * i) >> shift) & 0x0F0F0F0Fu);
        a = iq4xs_scale(blk, gi >> 1);
        b = 0.0f;
    } else if (QT == ST_Q6_K) {
        const uint8_t *blk = row + (g >> 4) * 210;  // ql[128], qh[64], int8 scales[16], fp16 d
        const int gi = g & 15;
        a = read_f16(blk + 208) * (float)(int8_t)blk[192 + gi];
        b = 0.0f;
        const int i0 = 16 * gi, n = i0 >> 7, quad = (i0 & 127) >> 5, l0 = i0 & 31;
        const uint8_t *ql = blk + 64 * n + ((quad & 1) ? 32 : 0);
        const uint8_t *qh = blk + 128 + 32 * n;
        const int lo_shift = (quad >= 2) ? 4 : 0, hi_shift = 2 * quad;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            int e[4];
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const int l = l0 + 4 * i + j;
                int x = ((ql[l] >> lo_shift) & 0xF) | (((qh[l] >> hi_shift) & 3) << 4);
                e[j] = x - 32;
            }
            v[i] = pack4(e[0], e[1], e[2], e[3]);
        }
    }
}

// Byte-wise x - 32 of 4 bytes holding 0..63 each (no borrow crosses a byte): Q6_K's values
__device__ __forceinline__ int bytes_minus_32(uint32_t v) {
    return (int)(((v | 0x80808080u) - 0x20202020u) ^ 0x80808080u);
}

// 32-column block b (0..7) of a k-quant or i-quant super-block at blk (2-byte aligned; mmq_k.cu
// and matvec.cu read it from shared memory): its 32 int8 values to v[8] (4 per int, column
// order), its scales a[0..1] and mins m[0..1] (per 16 columns: w = a * s - m; equal halves for
// Q4_K / Q5_K, IQ4_XS and the i-quants with a scale per 32 columns, no mins for Q3_K / Q6_K /
// IQ*). The same values and scales as decode_group.
template <int QT>
__device__ __forceinline__ void unpack_k_block(const uint8_t *blk, int b, int (&v)[8],
                                               float (&a)[2], float (&m)[2]) {
    if constexpr (is_iq_grid_type(QT)) {  // a[0] == a[1] where the scale is per 32 columns
        int lo[4], hi[4];
        iq_group<QT>(blk, 2 * b, lo, a[0]);
        iq_group<QT>(blk, 2 * b + 1, hi, a[1]);
#pragma unroll
        for (int w = 0; w < 4; w++) {
            v[w] = lo[w];
            v[w + 4] = hi[w];
        }
        m[0] = m[1] = 0.0f;
    } else if constexpr (QT == ST_IQ4_XS) {
        const uint8_t *q = blk + 8 + 16 * b;
#pragma unroll
        for (int w = 0; w < 4; w++) {
            const uint32_t x = read_u32_a2(q + 4 * w);
            v[w] = iq4_values(x & 0x0F0F0F0Fu);
            v[w + 4] = iq4_values((x >> 4) & 0x0F0F0F0Fu);
        }
        a[0] = a[1] = iq4xs_scale(blk, b);
        m[0] = m[1] = 0.0f;
    } else if constexpr (QT == ST_Q2_K || QT == ST_Q3_K) {
#pragma unroll
        for (int w = 0; w < 8; w++) v[w] = k23_word<QT>(blk, b, w);
        k23_scale<QT>(blk, 2 * b, a[0], m[0]);
        k23_scale<QT>(blk, 2 * b + 1, a[1], m[1]);
    } else if constexpr (QT == ST_Q6_K) {  // ql[128], qh[64], int8 scales[16], fp16 d
        const int n = b >> 2, quad = b & 3;
        const uint8_t *ql = blk + 64 * n + 32 * (quad & 1);
        const uint8_t *qh = blk + 128 + 32 * n;
        const int lo_shift = quad >= 2 ? 4 : 0, hi_shift = 2 * quad;
#pragma unroll
        for (int w = 0; w < 8; w++) {
            const uint32_t lo = (read_u32_a2(ql + 4 * w) >> lo_shift) & 0x0F0F0F0Fu;
            const uint32_t hi = (read_u32_a2(qh + 4 * w) >> hi_shift) & 0x03030303u;
            v[w] = bytes_minus_32(lo | (hi << 4));
        }
        const float d = read_f16(blk + 208);
        a[0] = d * (float)(int8_t)blk[192 + 2 * b];
        a[1] = d * (float)(int8_t)blk[193 + 2 * b];
        m[0] = m[1] = 0.0f;
    } else {  // fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins, (Q5_K: qh[32]), qs[128]
        constexpr bool is_q5 = QT == ST_Q5_K;
        const uint8_t *q = blk + (is_q5 ? 48 : 16) + 32 * (b >> 1);
        const int shift = (b & 1) * 4;  // block 2j: low nibbles of qs[32j..], 2j+1: high ones
#pragma unroll
        for (int w = 0; w < 8; w++) {
            uint32_t x = (read_u32_a2(q + 4 * w) >> shift) & 0x0F0F0F0Fu;
            if (is_q5) x |= ((read_u32_a2(blk + 16 + 4 * w) >> b) & 0x01010101u) << 4;
            v[w] = (int)x;
        }
        int sc, mn;
        scale_min_k4(b, blk + 4, sc, mn);
        a[0] = a[1] = read_f16(blk) * (float)sc;
        m[0] = m[1] = read_f16(blk + 2) * (float)mn;
    }
}

// One weight of a float-type row
template <int QT>
__device__ __forceinline__ float load_float_weight(const uint8_t *row, int c) {
    if (QT == ST_F32) return reinterpret_cast<const float *>(row)[c];
    if (QT == ST_F16) return __half2float(reinterpret_cast<const __half *>(row)[c]);
    return bf16_to_f32(reinterpret_cast<const uint16_t *>(row)[c]);  // BF16
}

__device__ __forceinline__ bool is_float_type(int qt) {
    return qt == ST_F32 || qt == ST_F16 || qt == ST_BF16;
}

// Column c of a row of any supported type, dequantised as gguf does ((a * s) then - b)
template <int QT>
__device__ __forceinline__ float dequant_one(const uint8_t *row, int c) {
    if (QT == ST_F32 || QT == ST_F16 || QT == ST_BF16) return load_float_weight<QT>(row, c);
    int v[4];
    float a, b;
    decode_group<QT>(row, c >> 4, v, a, b);
    const int j = c & 15;
    const int s = (int)(int8_t)((v[j >> 2] >> (8 * (j & 3))) & 0xff);
    return __fsub_rn(__fmul_rn(a, (float)s), b);
}

// 8-bit form of one 32-column block, quantised as quantize_q8 does
__device__ __forceinline__ int8_t q8_of(float v, float id) {
    return (int8_t)__float2int_rn(v * id);
}
