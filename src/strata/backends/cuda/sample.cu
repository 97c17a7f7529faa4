// Sampling candidates on the device, so a window's logits need not cross PCIe: per requested
// logit row, the penalised row's C largest values (C <= CAND_MAX, sorted by value, ties to the
// lowest id, as the host sampler orders them), and when asked the row's softmax mass
// sum_v exp((x_v - x_max) / temperature) in double. The host finishes top-p / min-p and the draw.
//
// Legend: N = logit rows of the window, V = row length, VV = valid ids (< V where the embedding
// is padded: ids >= VV are never candidates), M = requested rows, C = candidates of a request,
// P = penalty entries in all.
#include "common.cuh"

#define CAND_MAX 1024   // candidates per row at most (one per thread of the block)
#define CAND_THREADS 1024
// The radix select stops at the first 8-bit pass after which the keys at or above the C-th's
// bin number at most this many: they are gathered and sorted in shared memory instead.
#define CAND_SUBSET 4096

// Ordered key of a float: larger floats give larger unsigned keys (NaN sorts above +inf);
// -0 and +0 give one key, since the host compares them equal (a tie, broken by the lower id).
__device__ __forceinline__ unsigned float_key(float f) {
    const unsigned b = f == 0.0f ? 0u : __float_as_uint(f);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// req [M, 5] int32: (logit row n, C, first penalty entry, penalty count, flags: 1 = want the
// mass); temps [M] float64 (> 0; 1 for greedy requests; double as the host divides); pen_ids
// [P] int32 (unique per request), pen_rep [P] float32 (the repetition factor for this id, 1
// when none), pen_sub [P] float32 (subtracted after it). scratch [M, V] float32: the penalised
// rows. Outputs: out_ids [M, CAND_MAX] int32, out_x [M, CAND_MAX] float32 (penalised logits,
// best first), out_mass [M] double, out_nan [M] int32 (1 when the row holds a NaN). Grid M,
// block CAND_THREADS.
extern "C" __global__ void __launch_bounds__(CAND_THREADS)
logit_candidates(const float *__restrict__ logits, int V, int VV, const int *__restrict__ req,
                 const double *__restrict__ temps, const int *__restrict__ pen_ids,
                 const float *__restrict__ pen_rep, const float *__restrict__ pen_sub,
                 float *__restrict__ scratch, int *__restrict__ out_ids,
                 float *__restrict__ out_x, double *__restrict__ out_mass,
                 int *__restrict__ out_nan) {
    kernel_entry();
    __shared__ unsigned hist[256];
    __shared__ unsigned long long cand[CAND_SUBSET];  // (key << 32) | (~id): larger = better
    __shared__ unsigned s_prefix, s_mask, s_need, s_count, s_running, s_fits;
    __shared__ unsigned warp_ties[32];
    __shared__ int s_nan;
    __shared__ double red[32];
    const int m = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int n = req[5 * m], C = min(min(req[5 * m + 1], CAND_MAX), VV);
    const int pen_first = req[5 * m + 2], pen_count = req[5 * m + 3];
    const bool want_mass = req[5 * m + 4] & 1;
    const float *row = logits + (long long)n * V;
    float *x = scratch + (long long)m * V;  // [VV] the penalised row

    // 1. the penalised row (the host's order: repetition factor, then the subtraction)
    if (tid == 0) s_nan = 0;
    for (int v = tid; v < VV; v += CAND_THREADS) x[v] = row[v];
    __syncthreads();
    for (int i = tid; i < pen_count; i += CAND_THREADS) {
        const int v = pen_ids[pen_first + i];
        if (v < 0 || v >= VV) continue;
        float y = row[v];
        const float r = pen_rep[pen_first + i];
        if (r != 1.0f) y = y > 0.0f ? y / r : y * r;
        x[v] = y - pen_sub[pen_first + i];
    }
    __syncthreads();

    // 2. C == 1 (greedy rows): the largest (key, lowest id) by a block max, no select
    if (C == 1) {
        unsigned long long best = 0ull;
        int has_nan = 0;
        for (int v = tid; v < VV; v += CAND_THREADS) {
            const float f = x[v];
            has_nan |= isnan(f);
            best = max(best, ((unsigned long long)float_key(f) << 32) | (~(unsigned)v));
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) best = max(best, __shfl_xor_sync(0xffffffffu, best, o));
        if (has_nan) s_nan = 1;
        if (lane == 0) cand[warp] = best;
        __syncthreads();
        if (tid < 32) {
            best = tid < CAND_THREADS / 32 ? cand[tid] : 0ull;
#pragma unroll
            for (int o = 16; o > 0; o >>= 1)
                best = max(best, __shfl_xor_sync(0xffffffffu, best, o));
        }
        __syncthreads();  // every warp's entry read before cand[0] is written
        if (tid == 0) cand[0] = best;
        __syncthreads();
    } else {
        // 2. radix select of the C-th largest key, 8 bits at a time from the top (lanes of a
        // warp adding to one bin once each, by __match_any_sync, was slower on the H200: top-k
        // 40 in 325 against 228 us). It stops once the keys at or above the C-th's bin so far
        // (s_prefix with the lower bits 0) number at most CAND_SUBSET (s_fits).
        if (tid == 0) { s_prefix = 0; s_mask = 0; s_need = C; s_fits = 0; }
        for (int shift = 24; shift >= 0; shift -= 8) {
            if (tid < 256) hist[tid] = 0;
            __syncthreads();
            const unsigned prefix = s_prefix, mask = s_mask;
            int has_nan = 0;
            for (int v = tid; v < VV; v += CAND_THREADS) {
                const float f = x[v];
                if (shift == 24 && isnan(f)) has_nan = 1;
                const unsigned k = float_key(f);
                if ((k & mask) == prefix) atomicAdd(&hist[(k >> shift) & 255u], 1u);
            }
            if (has_nan) s_nan = 1;
            __syncthreads();
            if (tid == 0) {
                unsigned above = 0;
                for (int b = 255; b >= 0; b--) {
                    if (above + hist[b] >= s_need) {
                        s_fits = (C - s_need) + above + hist[b] <= CAND_SUBSET;
                        s_prefix |= (unsigned)b << shift;
                        s_mask |= 255u << shift;
                        s_need -= above;
                        break;
                    }
                    above += hist[b];
                }
            }
            __syncthreads();
            if (s_fits) break;  // uniform: read after the barrier
        }
        if (s_fits) {
            // 3. the keys at or above the C-th's bin (a superset of the C best), sorted below
            const unsigned lower = s_prefix;
            if (tid == 0) s_count = 0;
            __syncthreads();
            for (int v = tid; v < VV; v += CAND_THREADS) {
                const unsigned k = float_key(x[v]);
                if (k >= lower)
                    cand[atomicAdd(&s_count, 1u)] = ((unsigned long long)k << 32) | (~(unsigned)v);
            }
            __syncthreads();
        } else {
            const unsigned kth = s_prefix, need_ties = s_need;  // C - need_ties keys lie above kth

            // 3. gather: every key above kth, then the lowest-id `need_ties` keys equal to it
            if (tid == 0) { s_count = 0; s_running = 0; }
            __syncthreads();
            for (int v = tid; v < VV; v += CAND_THREADS) {
                const unsigned k = float_key(x[v]);
                if (k > kth)
                    cand[atomicAdd(&s_count, 1u)] = ((unsigned long long)k << 32) | (~(unsigned)v);
            }
            __syncthreads();
            const unsigned num_above = s_count;
            for (int base = 0; base < VV; base += CAND_THREADS) {
                if (s_running >= need_ties) break;  // uniform: read after the barrier below
                const int v = base + tid;
                const bool tie = v < VV && float_key(x[v]) == kth;
                const unsigned ballot = __ballot_sync(0xffffffffu, tie);
                if (lane == 0) warp_ties[warp] = __popc(ballot);
                __syncthreads();
                unsigned before = s_running;
                for (int w = 0; w < warp; w++) before += warp_ties[w];
                before += __popc(ballot & ((1u << lane) - 1u));
                if (tie && before < need_ties)
                    cand[num_above + before] = ((unsigned long long)kth << 32) | (~(unsigned)v);
                __syncthreads();
                if (tid == 0) {
                    unsigned total = 0;
                    for (int w = 0; w < CAND_THREADS / 32; w++) total += warp_ties[w];
                    s_running += total;
                }
                __syncthreads();
            }
        }
    }  // C > 1

    // 4. bitonic sort of the candidates (C, or the superset of step 3), best first (padding 0
    // sorts last); the first C are the answer
    const int num_sorted = C > 1 && s_fits ? (int)s_count : C;
    int size = 1;
    while (size < num_sorted) size <<= 1;
    for (int i = num_sorted + tid; i < size; i += CAND_THREADS) cand[i] = 0ull;
    __syncthreads();
    for (int k = 2; k <= size; k <<= 1) {
        for (int j = k >> 1; j > 0; j >>= 1) {
            for (int i = tid; i < size; i += CAND_THREADS) {
                const int p = i ^ j;
                if (p > i) {
                    const unsigned long long a = cand[i], b = cand[p];
                    const bool descending = (i & k) == 0;
                    if ((a < b) == descending) { cand[i] = b; cand[p] = a; }
                }
            }
            __syncthreads();
        }
    }
    if (tid < C) {
        const int v = (int)(~(unsigned)(cand[tid] & 0xffffffffull));
        out_ids[(long long)m * CAND_MAX + tid] = v;
        out_x[(long long)m * CAND_MAX + tid] = x[v];
    }
    if (tid == 0) out_nan[m] = s_nan;

    // 5. the softmax mass over every valid id, in double (the host's float64 arithmetic)
    if (!want_mass) return;
    const double t = temps[m];
    const double zmax = (double)x[(int)(~(unsigned)(cand[0] & 0xffffffffull))] / t;
    double acc = 0.0;
    for (int v = tid; v < VV; v += CAND_THREADS) acc += exp((double)x[v] / t - zmax);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (lane == 0) red[warp] = acc;
    __syncthreads();
    if (tid == 0) {
        double total = 0.0;
        for (int w = 0; w < CAND_THREADS / 32; w++) total += red[w];
        out_mass[m] = total;
    }
}
