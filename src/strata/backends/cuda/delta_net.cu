// Qwen3-Next's recurrent layers and gated attention on the GPU, as the CPU kernels compute them
// (_native/delta_net.c: st_conv_silu, st_gated_delta, st_gated_rmsnorm; _native/window_ops.c:
// st_split_q_gate, st_mul_sigmoid): the causal conv + SiLU, the gated delta rule, the gated
// RMSNorm, and the split / sigmoid gate of gated attention. All float32.
//
// Legend: R = window rows, C = conv channels (q | k | v of every head: 2*Hk*Dk + Hv*Dv),
// K = conv taps, Hk/Hv = key/value heads, Dk/Dv = key/value head dims, Lr = recurrent layers,
// Q = query heads, D = head dim.
// A window's rows come in runs: consecutive rows of one sequence. Per row r (device descriptor):
//   state[4*r + 0..3]: device addresses (float*) of that row's sequence's conv_in, conv_out,
//     ssm_in, ssm_out states for ALL recurrent layers: conv [Lr, K-1, C], ssm [Lr, Hv, Dk, Dv];
//     the kernel adds layer_offset floats to get this layer's ([K-1, C] / [Hv, Dk, Dv]).
//     conv_in != conv_out and ssm_in != ssm_out always (double buffering: *_in is read only).
//   run0[r]: the first row of r's run; run_len[r]: the rows of r's run.
// Every block of every row is launched (the grid depends only on R), so one captured graph
// serves every window of R rows.
#include "common.cuh"

__device__ __forceinline__ float silu(float x) { return x / (1.0f + expf(-x)); }

// torch's F.softplus (threshold 20: past it softplus(x) rounds to x)
__device__ __forceinline__ float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

// ---- causal depthwise conv + SiLU -----------------------------------------------------------
// y[r, c] = silu(sum_{j<K} w[c, j] * xin_r[j, c]) where xin_r rows are the K-1 inputs before r
// in its sequence then x[r]: before row run0 they come from conv_in (rows oldest first, row
// K-2 is the newest). The last row of a run also writes conv_out = the last K-1 rows of
// (conv_in rows, then the run's x rows). grid (ceil(C / 128), R), block 128.

// Row p of a run's conv input (K-1 state rows, then the run's x rows from row r0): [C]
__device__ __forceinline__ const float *conv_input_row(const float *conv_in, const float *x,
                                                       int C, int K, int r0, int p) {
    return p < K - 1 ? conv_in + (long long)p * C : x + (long long)(r0 + p - (K - 1)) * C;
}

extern "C" __global__ void __launch_bounds__(128)
conv_silu_rows(const float *__restrict__ x, int C, int K, const float *__restrict__ w,
               const unsigned long long *__restrict__ state, long long layer_offset,
               const int *__restrict__ run0, const int *__restrict__ run_len,
               float *__restrict__ y) {
    kernel_entry();
    const int r = blockIdx.y, c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    const int r0 = run0[r], t = r - r0;  // t: r's row in its run
    const float *conv_in = reinterpret_cast<const float *>(state[4 * r]) + layer_offset;
    float acc = 0.0f;  // taps in order, as st_conv_silu sums them
    for (int j = 0; j < K; j++)
        acc = fmaf(w[(long long)c * K + j], conv_input_row(conv_in, x, C, K, r0, t + j)[c], acc);
    y[(long long)r * C + c] = silu(acc);
    const int n = run_len[r];
    if (t != n - 1) return;
    float *conv_out = reinterpret_cast<float *>(state[4 * r + 1]) + layer_offset;  // [K-1, C]
    for (int i = 0; i < K - 1; i++)
        conv_out[(long long)i * C + c] = conv_input_row(conv_in, x, C, K, r0, n + i)[c];
}

// ---- the gated delta rule -------------------------------------------------------------------
// Over each run's rows in order (st_gated_delta's math exactly: l2-norm of q and k with eps, q
// also scaled by 1/sqrt(Dk), g = A*softplus(alpha+dt_bias) with torch's softplus threshold 20,
// beta = sigmoid(beta_logit), S *= exp(g); delta = (v - S^T kn) * beta; S += kn (x) delta;
// out = S^T qn). y [R, C] holds q [Hk*Dk] | k [Hk*Dk] | v [Hv*Dv] per row; value head h reads
// key head h / (Hv / Hk). ba [R, 2*Hv]: beta logits then alpha. A, dt_bias [Hv]. State from
// ssm_in (+ layer_offset) at the run's start, written to ssm_out at its end. Only blocks with
// r == run0[r] work; the others return at once. grid (ceil(Dv / 32), Hv, R), block 128.
// Dk <= 128 (the host refuses more).
//
// A block owns value head h and the state panel S[:, j0 .. j0+31] of its run: lane = column
// j0 + lane, warp w holds rows i = w + 4m (m < 32) in registers (zeros past Dk). Every warp
// loads the row's whole q and k (lane: dims lane + 32u, u < 4) and normalises them itself (same
// operands, same order: the same bits in every warp); row i = w + 4m of kn / qn is then dim
// w + 4(m & 7) + 32(m >> 3): register m >> 3 of lane w + 4(m & 7), fetched by a shuffle. The
// column sums S^T kn and S^T qn meet across the 4 warps in shared memory, added in warp order,
// so results never depend on timing. The row loop has no branch between its barriers (rows past
// Dk add exact zeros): with a branch around each shuffle the shuffles ran one at a time, 3.3
// against 0.84 us a row of a long run at the 80B dims on the H200. A row's inputs are loaded a
// row before they are used.
#define GD_WARPS 4
#define GD_COLS 32      // state columns per block (a warp's lanes)
#define GD_ROWS 32      // state rows per thread: Dk <= GD_WARPS * GD_ROWS
#define GD_DIMS 4       // q / k dims per lane: Dk <= 32 * GD_DIMS

// One row's inputs as loaded: dims lane + 32u of the key head's q and k (0 past Dk), v of this
// lane's column (0 past Dv), the head's beta logit and alpha
struct DeltaRowInputs {
    float q[GD_DIMS], k[GD_DIMS], v, beta_logit, alpha;
};

// ... and ready for the rule: qn, kn dims (l2-normalised, qn also by 1/sqrt(Dk)), the gates
struct DeltaRow {
    float qn[GD_DIMS], kn[GD_DIMS], v, decay, beta;
};

__device__ __forceinline__ void load_delta_row(DeltaRowInputs &in, const float *__restrict__ y,
                                               const float *__restrict__ ba, long long r, int C,
                                               int Hk, int Hv, int Dk, int Dv, int hk, int h,
                                               int j, bool has_col, int lane) {
    const float *yr = y + r * C;                      // [C]
    const float *q = yr + (long long)hk * Dk;         // [Dk]
    const float *k = yr + (long long)(Hk + hk) * Dk;  // [Dk]
#pragma unroll
    for (int u = 0; u < GD_DIMS; u++) {
        const int i = lane + 32 * u;
        in.q[u] = i < Dk ? q[i] : 0.0f;
        in.k[u] = i < Dk ? k[i] : 0.0f;
    }
    in.v = has_col ? yr[2LL * Hk * Dk + (long long)h * Dv + j] : 0.0f;
    in.beta_logit = ba[r * 2 * Hv + h];
    in.alpha = ba[r * 2 * Hv + Hv + h];
}

// st_gated_delta's per-row scalars: qn = q / sqrt(|q|^2 + eps) / sqrt(Dk), kn = k /
// sqrt(|k|^2 + eps), decay = exp(A * softplus(alpha + dt_bias)), beta = sigmoid(beta_logit).
// The whole warp calls it.
__device__ __forceinline__ DeltaRow prepare_delta_row(const DeltaRowInputs &in, float a_h,
                                                      float dt_h, float eps, float inv_sqrt_dk) {
    float qq = 0.0f, kk = 0.0f;
#pragma unroll
    for (int u = 0; u < GD_DIMS; u++) {
        qq = fmaf(in.q[u], in.q[u], qq);
        kk = fmaf(in.k[u], in.k[u], kk);
    }
    qq = warp_sum(qq);
    kk = warp_sum(kk);
    const float inv_q = 1.0f / sqrtf(qq + eps), inv_k = 1.0f / sqrtf(kk + eps);
    DeltaRow row;
#pragma unroll
    for (int u = 0; u < GD_DIMS; u++) {
        row.qn[u] = in.q[u] * inv_q * inv_sqrt_dk;
        row.kn[u] = in.k[u] * inv_k;
    }
    row.v = in.v;
    row.decay = expf(a_h * softplus(in.alpha + dt_h));
    row.beta = 1.0f / (1.0f + expf(-in.beta_logit));
    return row;
}

extern "C" __global__ void __launch_bounds__(GD_WARPS * 32)
gated_delta_rows(const float *__restrict__ y, int C, int Hk, int Hv, int Dk, int Dv,
                 const float *__restrict__ ba, const float *__restrict__ A,
                 const float *__restrict__ dt_bias, float eps,
                 const unsigned long long *__restrict__ state, long long layer_offset,
                 const int *__restrict__ run0, const int *__restrict__ run_len,
                 float *__restrict__ out) {
    kernel_entry();
    const int r0 = blockIdx.z;
    if (run0[r0] != r0) return;  // the run's first row's blocks do its rows
    __shared__ float part_k[GD_WARPS][GD_COLS];  // each warp's share of S^T kn
    __shared__ float part_q[GD_WARPS][GD_COLS];  // each warp's share of S^T qn
    const int h = blockIdx.y, hk = h / (Hv / Hk);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int j = blockIdx.x * GD_COLS + lane;
    const bool has_col = j < Dv;
    const int n = run_len[r0];
    const long long head_offset = layer_offset + (long long)h * Dk * Dv;
    const float *S_in = reinterpret_cast<const float *>(state[4 * r0 + 2]) + head_offset;
    float *S_out = reinterpret_cast<float *>(state[4 * r0 + 3]) + head_offset;  // [Dk, Dv]

    float S[GD_ROWS];  // S[m] = state row w + 4m, column j (0 past Dk)
#pragma unroll
    for (int m = 0; m < GD_ROWS; m++) {
        const int i = warp + GD_WARPS * m;
        S[m] = i < Dk && has_col ? S_in[(long long)i * Dv + j] : 0.0f;
    }
    const float a_h = A[h], dt_h = dt_bias[h];
    const float inv_sqrt_dk = 1.0f / sqrtf((float)Dk);
    // in: row t + 1's inputs during row t (the last row's again at the end), loaded a whole row
    // before they are prepared
    DeltaRowInputs in;
    load_delta_row(in, y, ba, r0, C, Hk, Hv, Dk, Dv, hk, h, j, has_col, lane);
    DeltaRow row = prepare_delta_row(in, a_h, dt_h, eps, inv_sqrt_dk);
    load_delta_row(in, y, ba, r0 + min(1, n - 1), C, Hk, Hv, Dk, Dv, hk, h, j, has_col, lane);
    for (int t = 0; t < n; t++) {
        const long long r = r0 + t;
        // S = S * exp(g); this warp's rows of S^T kn
        float kn[GD_ROWS];
        float acc = 0.0f;
#pragma unroll
        for (int m = 0; m < GD_ROWS; m++) {
            kn[m] = __shfl_sync(0xffffffffu, row.kn[m >> 3], warp + GD_WARPS * (m & 7));
            S[m] *= row.decay;
            acc = fmaf(kn[m], S[m], acc);
        }
        part_k[warp][lane] = acc;
        __syncthreads();
        const float sk = ((part_k[0][lane] + part_k[1][lane]) + part_k[2][lane]) + part_k[3][lane];
        const float delta = (row.v - sk) * row.beta;

        // S += kn (x) delta; this warp's rows of S^T qn
        acc = 0.0f;
#pragma unroll
        for (int m = 0; m < GD_ROWS; m++) {
            const float qn = __shfl_sync(0xffffffffu, row.qn[m >> 3], warp + GD_WARPS * (m & 7));
            S[m] = fmaf(kn[m], delta, S[m]);
            acc = fmaf(qn, S[m], acc);
        }
        part_q[warp][lane] = acc;
        row = prepare_delta_row(in, a_h, dt_h, eps, inv_sqrt_dk);  // row t + 1's
        load_delta_row(in, y, ba, r0 + min(t + 2, n - 1), C, Hk, Hv, Dk, Dv, hk, h, j, has_col,
                       lane);
        // part_k is read by all before any thread passes here, and part_q is read (below) before
        // warp 0 reaches the next row's barrier: one barrier each per row suffices
        __syncthreads();
        if (warp == 0 && has_col)
            out[(r * Hv + h) * Dv + j] =
                ((part_q[0][lane] + part_q[1][lane]) + part_q[2][lane]) + part_q[3][lane];
    }
#pragma unroll
    for (int m = 0; m < GD_ROWS; m++) {
        const int i = warp + GD_WARPS * m;
        if (i < Dk && has_col) S_out[(long long)i * Dv + j] = S[m];
    }
}

// ---- gated RMSNorm ---------------------------------------------------------------------------
// out[r, h*Dv + i] = w[i] * (x[r,h,i] * rsqrt(mean_i(x[r,h,:]^2) + eps)) * silu(z[r, h*Dv + i]);
// x, z, out [R, Hv*Dv] (out may not alias x). grid (R, Hv), block 128 (Dv any size).
extern "C" __global__ void __launch_bounds__(128)
gated_rmsnorm_rows(const float *__restrict__ x, const float *__restrict__ z,
                   const float *__restrict__ w, float eps, int Hv, int Dv,
                   float *__restrict__ out) {
    kernel_entry();
    __shared__ float sums[4];  // each warp's sum of squares
    const long long base = ((long long)blockIdx.x * Hv + blockIdx.y) * Dv;
    const float *xh = x + base, *zh = z + base;  // [Dv]
    float ss = 0.0f;
    for (int i = threadIdx.x; i < Dv; i += 128) ss = fmaf(xh[i], xh[i], ss);
    ss = warp_sum(ss);
    if ((threadIdx.x & 31) == 0) sums[threadIdx.x >> 5] = ss;
    __syncthreads();
    ss = ((sums[0] + sums[1]) + sums[2]) + sums[3];
    const float scale = 1.0f / sqrtf(ss / (float)Dv + eps);
    for (int i = threadIdx.x; i < Dv; i += 128)
        out[base + i] = w[i] * (xh[i] * scale) * silu(zh[i]);
}

// ---- gated attention: split and gate ----------------------------------------------------------
// qg [R, Q, 2D] (each head's query then its gate, as llama.cpp's attn_q of qwen3next) ->
// q [R, Q*D], gate [R, Q*D]. grid ceil(R*Q*D / 256), block 256.
extern "C" __global__ void split_q_gate(const float *__restrict__ qg, int R, int Q, int D,
                                        float *__restrict__ q, float *__restrict__ gate) {
    kernel_entry();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)R * Q * D) return;
    const long long head = i / D, d = i % D;  // head = r * Q + h
    q[i] = qg[2 * head * D + d];
    gate[i] = qg[2 * head * D + D + d];
}

// x[i] *= sigmoid(gate[i]) for i < n. grid ceil(n / 256), block 256.
extern "C" __global__ void mul_sigmoid(float *__restrict__ x, const float *__restrict__ gate,
                                       long long n) {
    kernel_entry();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= 1.0f / (1.0f + expf(-gate[i]));
}
