// What every product family (matmul.cu's dp4a warps, matvec.cu's staged decode warps, mmq.cu's
// tensor-core tiles) shares: the output modes, SiLU, and one kernel argument list, so plan.py
// launches any family with the same arguments.
#pragma once
#include "common.cuh"

#define MODE_STORE 0    // Y = dot (+ bias[n])
#define MODE_ADD 1      // Y += dot (the residual stream)
#define MODE_GATEUP 2   // Y = silu(dot(W, x)) * dot(W2, x)

__device__ __forceinline__ float silu(float v) { return v / (1.0f + expf(-v)); }

// W / W2 [N, row_bytes] (gate/up: W2 the up matrix), wtab / wtab2 [E] device pointers of the
// grouped experts' matrices (NULL: dense, read W), xf [T, K] float rows or xq [T, K] int8 with
// xd [T, K/32] scales, groups [G, 3] with *num_groups in use, act_rows / out_rows [P] (NULL:
// the pair index itself), bias [N] or NULL, Y [., ldy], atab / atab2 [E] where an expert read
// is also written (0: nowhere; free admission, offload.cu's keep_misses: only the mv_*
// kernels honour them, and plan.py passes them only to those).
#define MM_ARGS                                                                                     \
    const uint8_t *W, const uint8_t *W2, const unsigned long long *wtab,                            \
        const unsigned long long *wtab2, long long row_bytes, int N, int K, const float *xf,        \
        const int8_t *xq, const float *xd, const int *groups, const int *num_groups,                \
        const int *act_rows, const int *out_rows, const float *bias, float *Y, int ldy,             \
        const unsigned long long *atab, const unsigned long long *atab2
// Parameters of the bodies that read 8-bit activations (matvec.cu's mv_body, mmq.cu's mmq_body,
// mmq_k.cu's mmqk_body): MM_ARGS less the float rows, as restrict pointers, and the block's
// output tile along x.
#define MM_BODY_PARAMS                                                                             \
    const uint8_t *__restrict__ W, const uint8_t *__restrict__ W2,                                 \
        const unsigned long long *__restrict__ wtab, const unsigned long long *__restrict__ wtab2, \
        long long row_bytes, int N, int K, const int8_t *__restrict__ xq,                           \
        const float *__restrict__ xd, const int *__restrict__ groups,                               \
        const int *__restrict__ num_groups, const int *__restrict__ act_rows,                       \
        const int *__restrict__ out_rows, const float *__restrict__ bias, float *__restrict__ Y,    \
        int ldy, int block_x

// q, k and v projections of the same rows in one launch: blocks [0, nbq) make q, the next
// nbkv k, the last nbkv v (one weight type, rows of K columns each).
#define QKV_ARGS                                                                                    \
    const uint8_t *Wq, const uint8_t *Wk, const uint8_t *Wv, long long row_bytes, int Nq,           \
        int Nkv, int K, const float *xf, const int8_t *xq, const float *xd, const int *groups,      \
        const int *num_groups, const float *bq, const float *bk, const float *bv, float *Yq,        \
        float *Yk, float *Yv
