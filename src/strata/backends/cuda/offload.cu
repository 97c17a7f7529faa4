// Kernels of the offload tiers (docs/offload.md): routing counts per (layer, expert) gathered on
// the device, groups of CPU-assigned experts taken out of the grouped products, and the hand-off
// of a layer's rows to the CPU pool through a mapped host exchange buffer.
//
// Legend: R = rows of the window, K = experts per row, H = hidden, E = experts, G = groups.
// where [E] uint8 per layer: 0 = VRAM slot, 1 = PCIe (mapped host copy), 2 = CPU pool, as the
// host assigned it; win [E] per layer: the window's own (count_groups: the pool takes a
// CPU-assigned expert only within the window's row cap and the layer's budget; 3 = split, the
// layer's one expert whose first columns the pool computes and the rest the GPU, read over
// PCIe). In a window that hands off
// (DeviceTier.pools) every layer does (the pool walks all layers); only rows with a CPU pair
// cross, each way (the pool reads x and sets y for those rows only).
#include "common.cuh"

#define WHERE_PCIE 1
#define WHERE_CPU 2
#define WHERE_SPLIT 3  // win only: the pool computes columns [0, cut) of it, the GPU the rest
#define POOL_TIMEOUT_NS 10000000000ULL  // wait_host gives up after 10 s
#define POOL_ERR_TIMEOUT 1
#define POOL_ERR_FAILED 2

// Does the pool compute (a part of) an expert with this win entry?
__device__ __forceinline__ bool is_pools(uint8_t w) { return w == WHERE_CPU || w == WHERE_SPLIT; }

__device__ __forceinline__ bool has_cpu_experts(const uint8_t *__restrict__ where, int E) {
    for (int e = 0; e < E; e++)
        if (is_pools(where[e])) return true;
    return false;
}

// Does row r route to an expert the pool computes (a part of)? Only such rows cross to the
// pool and back.
__device__ __forceinline__ bool row_has_cpu_pair(const int *__restrict__ ids, int r, int K,
                                                 const uint8_t *__restrict__ where) {
    for (int k = 0; k < K; k++)
        if (is_pools(where[ids[r * K + k]])) return true;
    return false;
}

// After group_pairs: counts [E] int32 = pairs routed to each expert this window (0 for the
// others), and (with where) the groups of the experts the CPU pool takes removed from groups
// [G, 3] in place, keeping the order of the rest, so the grouped products skip them. The pool
// takes a CPU-assigned expert of at most rows_cap rows while its modelled time fits the layer's
// budget (in row units: an expert costs expert_cost + its rows; one that does not fit is
// skipped); any other CPU-assigned expert stays in the groups and is read by the GPU from its
// host copy (its table entry). The budget goes to the experts of fewest rows first, group
// order among equal rows: each one the pool takes spares the GPU an expert's bytes whatever its
// rows, so the budget spares the most bytes spent on the smallest (a streamed prompt window:
// 11.1 experts a layer to the pool where group order gave 8.3; docs/offload.md). With one row
// per expert (one-slot decode) that is group order. win [E] gets the window's own where: CPU
// for the experts taken, PCIe for the other CPU-assigned ones, else where's entry; the
// hand-off kernels read win. A decode window's budget is the share `frac` (>= 0; < 0: the
// budget as given, a streamed prompt window's) of the cost of the layer's routed CPU-assigned
// experts: the host gives the pool every miss and the device splits each layer's by the
// routing it sees (a split fixed before the window gave one side 2 of a token's 8 misses in
// one layer and 6 in the next; the layer waits for the slower side). The whole block calls it:
// one thread per group decides what the pool takes, thread 0 then walks the groups.
// With a read-ahead (staged != nullptr: read_ahead's record of the layer), the experts it
// staged in VRAM before the routing was known are the GPU's, read from there (win VRAM). They
// still count in the layer's total, so the pool takes its share of all the layer's misses and
// the staged ones come off the GPU's PCIe reads: the GPU's side was the one that kept the pool
// waiting (one slot at share 0.3 on the H200: the pool took 5 of a token's 8 misses and the
// GPU read 3; with one staged and left out of the total, the pool 4 and the GPU 3 besides the
// staged one, no faster; counted, the pool 5 and the GPU 2: docs/offload.md). score [E] (the read-ahead's guess for the next window)
// decays and gains the window's rows; stats [3] counts the staged experts, those routed and
// their rows.
// The split expert (split != nullptr, split_step > 0, a decode window's budget): the candidate
// the budget reaches into (the first one it does not hold whole) is split by columns, so the
// two sides finish together where a whole expert is 1/8 of a one-row layer's misses (the
// pool's side was the slower by ~40-60 us a layer on the H200 at 5 of 8, the GPU's at 4 of 8:
// docs/offload.md). The pool takes gate/up rows and down columns [0, cut) of it, cut = the
// budget left over that expert's cost in whole units of split_step columns (the down's quant
// block), the GPU the rest: win[e] = WHERE_SPLIT, split [2] = (e, cut); (-1, 0) when no
// expert is split (always written when split != nullptr: the mv_* products read it).
__device__ __forceinline__ bool is_staged(const int *__restrict__ staged, int S, int e) {
    for (int s = 0; s < S; s++)
        if (staged[s] == e) return true;
    return false;
}

// May the pool take expert e with count rows (count_groups)?
__device__ __forceinline__ bool pool_candidate(const uint8_t *__restrict__ where, int e,
                                               int count, int rows_cap,
                                               const int *__restrict__ staged, int S) {
    return where[e] == WHERE_CPU && count <= rows_cap && !is_staged(staged, S, e);
}

__device__ __forceinline__ void count_groups(int *__restrict__ groups, int *__restrict__ num_groups,
                                             int E, int *__restrict__ counts,
                                             const uint8_t *__restrict__ where,
                                             uint8_t *__restrict__ win, int rows_cap,
                                             int expert_cost, int budget, float frac,
                                             const int *__restrict__ staged = nullptr, int S = 0,
                                             float *__restrict__ score = nullptr,
                                             float decay = 0.0f,
                                             unsigned long long *__restrict__ stats = nullptr,
                                             int *__restrict__ split = nullptr,
                                             int split_step = 0, int F = 0) {
    if (split != nullptr && threadIdx.x == 0) {
        split[0] = -1;
        split[1] = 0;
    }
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        counts[e] = 0;
        if (where != nullptr) win[e] = where[e] == WHERE_CPU ? WHERE_PCIE : where[e];
        if (score != nullptr) score[e] *= decay;
    }
    __syncthreads();
    const int G = *num_groups;
    if (where != nullptr) {
        float exact = -1.0f;  // the budget before rounding (a decode window's)
        if (frac >= 0.0f) {  // a decode window's budget: the share of its candidates' cost
            long long total = 0;
            for (int g = 0; g < G; g++) {
                const int e = groups[3 * g], count = groups[3 * g + 2];
                if (where[e] == WHERE_CPU && count <= rows_cap) total += expert_cost + count;
            }
            exact = frac * (float)total;
            budget = (int)floorf(exact + 0.5f);
        }
        const int units = split_step > 0 && exact >= 0.0f && split != nullptr ? F / split_step
                                                                                : 0;
        // candidate g is taken when the candidates before it in (rows, group) order and itself
        // fit the budget; the costs rise with the rows, so this is the greedy walk in that
        // order. One thread per group, O(G) each.
        for (int g = threadIdx.x; g < G; g += blockDim.x) {
            const int e = groups[3 * g], count = groups[3 * g + 2];
            if (!pool_candidate(where, e, count, rows_cap, staged, S)) continue;
            long long before = 0;
            for (int h = 0; h < G; h++) {
                const int f = groups[3 * h], c = groups[3 * h + 2];
                if ((c < count || (c == count && h < g))
                    && pool_candidate(where, f, c, rows_cap, staged, S))
                    before += expert_cost + c;
            }
            const int cost = expert_cost + count;
            if (before + cost <= budget) {
                win[e] = WHERE_CPU;
            } else if (units > 1 && before <= budget) {  // the one the budget reaches into
                const float part = (exact - (float)before) / (float)cost;
                const int cut = (int)floorf(part * (float)units + 0.5f);
                if (cut >= units) {
                    win[e] = WHERE_CPU;
                } else if (cut > 0) {
                    win[e] = WHERE_SPLIT;
                    split[0] = e;
                    split[1] = cut * split_step;
                }
            }
        }
        __syncthreads();
    }
    if (threadIdx.x != 0) return;
    int kept = 0;
    if (stats != nullptr)
        for (int s = 0; s < S; s++) stats[0] += staged[s] >= 0;
    for (int g = 0; g < G; g++) {
        const int e = groups[3 * g], first = groups[3 * g + 1], count = groups[3 * g + 2];
        counts[e] = count;
        if (score != nullptr) score[e] += (float)count;
        if (is_staged(staged, S, e)) {  // read from its staged copy (the tables point there)
            if (where != nullptr) win[e] = 0;
            if (stats != nullptr) {
                stats[1] += 1;
                stats[2] += count;
            }
        } else if (where != nullptr && win[e] == WHERE_CPU) {  // the pool's (taken above)
            continue;
        }  // a split expert (WHERE_SPLIT) stays: the GPU computes its columns past the cut
        groups[3 * kept] = e;
        groups[3 * kept + 1] = first;
        groups[3 * kept + 2] = count;
        kept++;
    }
    *num_groups = kept;
}

// count_groups as a launch. Grid 1, block 256.
// frac: the window's pool share word (count_groups; < 0 off). num_groups [3]: G, then the
// split expert and its cut (split_step: the down's columns per quant block, 0 none; F the
// expert width).
extern "C" __global__ void tier_groups(int *__restrict__ groups, int *__restrict__ num_groups,
                                       int E, int *__restrict__ counts,
                                       const uint8_t *__restrict__ where, uint8_t *win,
                                       int rows_cap, int expert_cost,
                                       const int *__restrict__ budget,
                                       const float *__restrict__ frac, int split_step, int F) {
    kernel_entry();
    count_groups(groups, num_groups, E, counts, where, win, rows_cap, expert_cost,
                 where != nullptr ? *budget : 0, where != nullptr ? *frac : -1.0f, nullptr, 0,
                 nullptr, 0.0f, nullptr, num_groups + 1, split_step, F);
}

// tier_groups in a decode window with a read-ahead (read_ahead below): staged [S] the layer's
// staged experts (-1 none), score [E] the layer's, stats [3] (count_groups).
extern "C" __global__ void tier_groups_ahead(int *__restrict__ groups,
                                             int *__restrict__ num_groups, int E,
                                             int *__restrict__ counts,
                                             const uint8_t *__restrict__ where, uint8_t *win,
                                             int rows_cap, int expert_cost,
                                             const int *__restrict__ budget,
                                             const float *__restrict__ frac,
                                             const int *__restrict__ staged, int S,
                                             float *__restrict__ score, float decay,
                                             unsigned long long *__restrict__ stats,
                                             int split_step, int F) {
    kernel_entry();
    count_groups(groups, num_groups, E, counts, where, win, rows_cap, expert_cost,
                 where != nullptr ? *budget : 0, where != nullptr ? *frac : -1.0f, staged, S,
                 score, decay, stats, num_groups + 1, split_step, F);
}

// Copy the layer's ids [R, K] (-1 for a pair the pool does not compute: the pool takes
// exactly the pairs win gives the CPU, a split expert's too) and wts [R, K] into the mapped
// exchange buffer, split [2] (count_groups' split expert and cut) to ex_split, and of the
// normed rows hf [R, H] those with a CPU pair (the pool reads no other row of x: a prompt
// window moves a few rows over PCIe, not all R), then (the last block to finish) ready[layer] =
// *seq after a system-wide fence. Grid ceil(R*H / 256), block 256; arrived: one int per layer,
// zero between launches (the last block resets it).
extern "C" __global__ void pool_publish(const float *__restrict__ hf, const int *__restrict__ ids,
                                        const float *__restrict__ wts, int R, int K, int H,
                                        const uint8_t *__restrict__ where, int E, int layer,
                                        const long long *__restrict__ seq, float *ex_x,
                                        int *ex_ids, float *ex_wts, long long *ready,
                                        unsigned int *arrived, const int *__restrict__ split,
                                        int *ex_split) {
    kernel_entry();
    __shared__ bool copy_x, last;
    if (threadIdx.x == 0) copy_x = has_cpu_experts(where, E);
    __syncthreads();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (copy_x && i < (long long)R * H && row_has_cpu_pair(ids, (int)(i / H), K, where))
        ex_x[i] = hf[i];
    if (i < (long long)R * K) {
        ex_ids[i] = is_pools(where[ids[i]]) ? ids[i] : -1;
        ex_wts[i] = wts[i];
    }
    if (i < 2) ex_split[i] = split[i];
    __threadfence_system();  // this thread's stores reach the host before the count below
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(arrived + layer, 1u) == gridDim.x - 1;
    __syncthreads();
    if (threadIdx.x == 0 && last) {
        arrived[layer] = 0;
        __threadfence_system();
        *reinterpret_cast<volatile long long *>(ready + layer) = *seq;
        __threadfence_system();
    }
}

__device__ __forceinline__ unsigned long long global_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// One thread: wait until the pool wrote done[layer] == *seq (its y rows are then in place). After
// 10 s, or when the pool reports failure (done[layer] == -seq), the error report status [4]
// int64 gets (layer + 1, seq, kind 1 = timeout / 2 = pool failure) and every later wait of the
// window returns at once; the host raises after the window. Grid 1, block 1.
extern "C" __global__ void pool_wait(const long long *done, const uint8_t *__restrict__ where,
                                     int E, int layer, const long long *__restrict__ seq,
                                     long long *status) {
    kernel_entry();
    volatile long long *st = status;
    if (st[0] != 0) return;
    const long long want = *seq;
    volatile const long long *d = done + layer;
    const unsigned long long t0 = global_ns();
    long long got;
    while ((got = *d) != want) {
        const bool failed = got == -want;
        if (failed || global_ns() - t0 > POOL_TIMEOUT_NS) {
            st[1] = want;
            st[2] = failed ? POOL_ERR_FAILED : POOL_ERR_TIMEOUT;
            __threadfence_system();
            st[0] = layer + 1;
            __threadfence_system();
            return;
        }
        __nanosleep(200);
    }
    __threadfence_system();  // reads of y after this see the pool's stores
}

// x[r] += sum over the GPU's pairs k of w[r,k] * Y[r*K + k] (+ the shared expert) + ex_y[r]:
// moe_combine with CPU-assigned pairs (whose Y rows were not written) left out and the pool's
// weighted sum added, read over PCIe only for rows with a CPU pair. A pair of the expert the two
// sides split (WHERE_SPLIT) is in both: Y holds the GPU's columns' part, ex_y the pool's.
// Grid ceil(R*H / 256), block 256.
extern "C" __global__ void moe_combine_pool(float *__restrict__ x, const float *__restrict__ Y,
                                            const float *__restrict__ w,
                                            const int *__restrict__ ids, int R, int K, int H,
                                            const float *__restrict__ S,
                                            const float *__restrict__ gate_logit,
                                            const uint8_t *__restrict__ where, int E,
                                            const float *ex_y) {
    kernel_entry();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)R * H) return;
    const int r = (int)(i / H), c = (int)(i % H);
    float acc = 0.0f;
    bool cpu_row = false;
    for (int k = 0; k < K; k++) {
        const uint8_t at = where[ids[r * K + k]];
        if (is_pools(at)) cpu_row = true;
        if (at == WHERE_CPU) continue;
        acc = fmaf(w[r * K + k], Y[((long long)r * K + k) * H + c], acc);
    }
    if (S != nullptr) {
        const float g = 1.0f / (1.0f + expf(-gate_logit[r]));
        acc = fmaf(g, S[(long long)r * H + c], acc);
    }
    if (cpu_row) acc += reinterpret_cast<volatile const float *>(ex_y)[i];
    x[i] += acc;
}

// Free admission (docs/offload.md, "Admission in the window"): experts this layer reads over
// PCIe in this window are kept in cache slots the host offered, at no extra copy: the mv_*
// products write each byte they stage to the slot (atab). pool [C, 3] int32: (slot, victim
// layer, victim expert) per candidate, the victims resident in those slots; state [2] int32:
// (candidates offered, next to take), both set by the host before the window (0 offered: no
// admission, atab only cleared); log [C] int32 per candidate: layer * E + expert admitted into
// its slot, -2 skipped (its victim is routed in this layer), -1 left. For each missed expert
// of the layer (group order, at most cap) the next usable candidate: its victim's table
// entries [3] re-pointed at the victim's host copy (a later layer of the window reads it from
// there; an earlier one has finished), then atab[layer][p][e] = the slot's part p. tables and
// atab [L, 3, E] uint64; part_off [L, 3] uint64 (slot image offsets of gate, up, down).
// One warp calls it.
__device__ __forceinline__ void keep_misses(const int *__restrict__ groups,
                                            const int *__restrict__ num_groups,
                                            const int *__restrict__ counts,
                                            unsigned long long *tables, unsigned long long *atab,
                                            const unsigned long long *__restrict__ part_off,
                                            const int *__restrict__ pool, int *state, int *log,
                                            int layer, int E, int cap,
                                            unsigned long long host_base,
                                            unsigned long long host_end,
                                            unsigned long long slot_base,
                                            unsigned long long slot_bytes) {
    const int lane = threadIdx.x & 31;
    unsigned long long *mine = atab + 3LL * layer * E;  // [3, E]
    for (int i = lane; i < 3 * E; i += WARP) mine[i] = 0ull;
    __syncwarp();  // cleared before lane 0 sets its entries
    const int C = state[0];
    if (C == 0) return;
    const unsigned long long *gate = tables + 3LL * layer * E;  // [E]: slot or host copy
    const int G = *num_groups;
    int next = state[1], taken = 0;  // lane 0's copy is the one written back
    bool left = true;                 // candidates remain (lane 0 decides, all lanes follow)
    for (int g0 = 0; g0 < G && taken < cap && left; g0 += WARP) {
        const int g = g0 + lane;
        int e = -1;
        bool miss = false;
        if (g < G) {
            e = groups[3 * g];
            const unsigned long long p = gate[e];
            miss = p >= host_base && p < host_end;
        }
        unsigned ballot = __ballot_sync(0xffffffffu, miss);
        while (ballot != 0u && taken < cap && left) {
            const int src = __ffs(ballot) - 1;
            ballot &= ballot - 1u;
            const int ex = __shfl_sync(0xffffffffu, e, src);
            int claimed = 0;
            if (lane == 0) {
                while (next < C && !claimed) {
                    const int j = next++;
                    const int slot = pool[3 * j], lv = pool[3 * j + 1], ev = pool[3 * j + 2];
                    if (lv == layer && counts[ev] > 0) {  // read by this layer: keep it
                        log[j] = -2;
                        continue;
                    }
                    unsigned long long *victim = tables + 3LL * lv * E + ev;  // stride E
                    const unsigned long long hb = host_base
                        + ((unsigned long long)lv * E + ev) * slot_bytes;
                    const unsigned long long sb = slot_base + (unsigned long long)slot * slot_bytes;
                    for (int p = 0; p < 3; p++) {
                        victim[(long long)p * E] = hb + part_off[3 * lv + p];
                        mine[(long long)p * E + ex] = sb + part_off[3 * layer + p];
                    }
                    log[j] = layer * E + ex;
                    claimed = 1;
                }
            }
            claimed = __shfl_sync(0xffffffffu, claimed, 0);
            left = claimed != 0;
            taken += claimed;
        }
    }
    if (lane == 0) state[1] = next;
}

// count_groups, then (warp 0) keep_misses: the layer's tier launch in a window that keeps its
// misses (plan.keeps_misses), one launch instead of two. Grid 1, block 256.
extern "C" __global__ void tier_groups_keep(int *__restrict__ groups,
                                            int *__restrict__ num_groups, int E,
                                            int *__restrict__ counts,
                                            const uint8_t *__restrict__ where, uint8_t *win,
                                            int rows_cap, int expert_cost,
                                            const int *__restrict__ budget,
                                            const float *__restrict__ frac,
                                            unsigned long long *tables, unsigned long long *atab,
                                            const unsigned long long *__restrict__ part_off,
                                            const int *__restrict__ pool, int *state, int *log,
                                            int layer, int cap, unsigned long long host_base,
                                            unsigned long long host_end,
                                            unsigned long long slot_base,
                                            unsigned long long slot_bytes) {
    kernel_entry();
    // no split expert here: a kept miss is copied whole as the products stage it
    count_groups(groups, num_groups, E, counts, where, win, rows_cap, expert_cost,
                 where != nullptr ? *budget : 0, where != nullptr ? *frac : -1.0f, nullptr, 0,
                 nullptr, 0.0f, nullptr, num_groups + 1, 0, 0);
    __syncthreads();  // counts and the kept groups are in place
    if (threadIdx.x < WARP)
        keep_misses(groups, num_groups, counts, tables, atab, part_off, pool, state, log, layer,
                    E, cap, host_base, host_end, slot_base, slot_bytes);
}

// Copy one expert's slot image [image_bytes] from src to dst (either side host or device):
// the gridDim.x blocks share its 16-byte words, four loads in flight per thread, and block 0
// copies the bytes past the last whole word.
__device__ __forceinline__ void copy_image(unsigned long long src, unsigned long long dst,
                                           unsigned long long image_bytes) {
    const uint4 *__restrict__ s = reinterpret_cast<const uint4 *>(src);
    uint4 *__restrict__ d = reinterpret_cast<uint4 *>(dst);
    const long long words = (long long)(image_bytes / 16);
    const long long step = (long long)gridDim.x * blockDim.x;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 3 * step < words; i += 4 * step) {
        const uint4 a = s[i], b = s[i + step], c = s[i + 2 * step], f = s[i + 3 * step];
        d[i] = a;
        d[i + step] = b;
        d[i + 2 * step] = c;
        d[i + 3 * step] = f;
    }
    for (; i < words; i += step) d[i] = s[i];
    if (blockIdx.x == 0)
        for (unsigned long long b = words * 16 + threadIdx.x; b < image_bytes; b += blockDim.x)
            reinterpret_cast<uint8_t *>(dst)[b] = reinterpret_cast<const uint8_t *>(src)[b];
}

// After tier_groups in a streamed prompt window: each rare expert (where CPU) the pool did not
// take (win PCIe) with more than min_rows rows is copied from its host copy into its slot of the
// layer's staging set (base [layer], 0: the layer is not streamed, nothing to do), and the
// layer's tables [L, 3, E] point at it there: the grouped products read it once from VRAM
// instead of once per row tile over PCIe. Slot e of the set is free for it: the copy stream's
// runs skip rare experts, and the set's previous reader ran earlier on this stream. The tables
// are put back behind the window (the residency's upload). pulled [L] counts the experts.
// Grid (chunks, E), block 256: blockIdx.y the expert, the chunks share its bytes in 16-byte words.
extern "C" __global__ void pull_rare(const int *__restrict__ counts,
                                     const uint8_t *__restrict__ where,
                                     const uint8_t *__restrict__ win, int E, int layer,
                                     int min_rows, const unsigned long long *__restrict__ base,
                                     unsigned long long host_dev_base,
                                     unsigned long long slot_bytes,
                                     unsigned long long image_bytes,
                                     const unsigned long long *__restrict__ part_off,
                                     unsigned long long *tables, int *pulled) {
    kernel_entry();
    const int e = blockIdx.y;
    const unsigned long long stage = base[layer];
    if (stage == 0 || where[e] != WHERE_CPU || win[e] != WHERE_PCIE || counts[e] <= min_rows)
        return;
    const unsigned long long src = host_dev_base + ((unsigned long long)layer * E + e) * slot_bytes;
    const unsigned long long dst = stage + (unsigned long long)e * slot_bytes;
    copy_image(src, dst, image_bytes);
    if (blockIdx.x == 0) {
        if (threadIdx.x < 3)
            tables[((unsigned long long)layer * 3 + threadIdx.x) * E + e] =
                dst + part_off[layer * 3 + threadIdx.x];
        if (threadIdx.x == 0) atomicAdd(pulled + layer, 1);
    }
}

// Guessed copies (docs/offload.md, "Guessed copies"): in a streamed prompt window with a pool,
// after the attention of layer - 1, router.cu's predict_* count in pred [E] the rows whose
// guessed top-K names each expert of `layer`. guess_publish (compute stream, right behind them)
// lists the rare experts (where CPU) guessed for at least min_rows rows in the mapped host
// memory lists [L, 1 + E] int32 (count, then the experts, in no order), marks them in fetched
// [E], then writes flags [layer] = *seq: the host (cuda_driver.issue_guessed_copies) waits for
// that flag, has the copy engine copy each listed expert's image into its slot of the layer's
// staging set on its own stream, then writes landed [layer] = seq there (cuStreamWriteValue32,
// fenced). pred is zeroed for the next window whatever happens. *seq == 0: the host does not
// take guesses in this window (a plan run without before_run): nothing is listed or flagged.
// Slot e of the set is free: the copy stream's runs skip rare experts, pull_rare skips experts
// no longer where CPU, and the set's previous reader (streamed layer j - 2) finished before
// this launch, so before the host saw the flag. budget (the layer's pool budget; nullptr: none):
// an expert the pool's budget walk takes on the guessed rows (count_groups' walk: the fewest rows
// first, rows_cap, expert_cost) is left to the pool, not listed (stream.py's STRATA_POOL_SURE).
// E <= GUESS_MAX_E. Grid 1, block 256.
#define GUESS_MAX_E 512
extern "C" __global__ void guess_publish(int *__restrict__ pred, const uint8_t *__restrict__ where,
                                         int E, int layer, int min_rows,
                                         const unsigned long long *__restrict__ base,
                                         const long long *__restrict__ seq, int *lists,
                                         long long *flags, uint8_t *__restrict__ fetched,
                                         const int *__restrict__ budget, int rows_cap,
                                         int expert_cost) {
    kernel_entry();
    __shared__ int count;
    __shared__ int guessed[GUESS_MAX_E];  // [E] the guessed rows
    const long long want = *seq;
    const bool active = want != 0 && base[layer] != 0;
    if (threadIdx.x == 0) count = 0;
    for (int e = threadIdx.x; e < E; e += blockDim.x) guessed[e] = pred[e];
    __syncthreads();
    const long long pool_time = budget != nullptr ? (long long)*budget : -1;
    int *list = lists + (long long)layer * (E + 1);
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        const int rows = guessed[e];
        pred[e] = 0;
        bool pooled = false;
        if (pool_time >= 0 && where[e] == WHERE_CPU && rows <= rows_cap) {
            long long before = 0;  // the pool's candidates before e in (rows, expert) order
            for (int f = 0; f < E; f++) {
                const int c = guessed[f];
                if (c > 0 && c <= rows_cap && where[f] == WHERE_CPU
                    && (c < rows || (c == rows && f < e)))
                    before += expert_cost + c;
            }
            pooled = before + expert_cost + rows <= pool_time;
        }
        if (active && where[e] == WHERE_CPU && rows >= min_rows && !pooled) {
            list[1 + atomicAdd(&count, 1)] = e;
            fetched[e] = 1;
        }
    }
    __threadfence_system();  // every thread's list entries before the flag
    __syncthreads();
    if (threadIdx.x == 0 && want != 0) {
        *reinterpret_cast<volatile int *>(list) = count;
        __threadfence_system();
        *reinterpret_cast<volatile long long *>(flags + layer) = want;
        __threadfence_system();
    }
}

// Before the layer's tier_groups (compute stream), without waiting: the layer's guessed experts
// (fetched [E]) become the GPU's for the window, where [E] VRAM, so that tier_groups gives them
// neither to the pool nor to PCIe and pull_rare skips them (the host's where is uploaded again
// behind the window). The copies may still be on their way: the tables keep the host copies
// until guess_point, after pool_publish, has waited for them. So the pool starts on the layer
// without waiting for the guessed copies. Nothing is claimed after a layer timed out
// (status [0] != 0). Grid 1, block 256.
extern "C" __global__ void guess_claim(int E, const long long *__restrict__ seq,
                                       const uint8_t *__restrict__ fetched, uint8_t *where,
                                       const unsigned long long *__restrict__ base, int layer,
                                       const int *status) {
    kernel_entry();
    if (*seq == 0 || base[layer] == 0 || *reinterpret_cast<const volatile int *>(status) != 0)
        return;
    for (int e = threadIdx.x; e < E; e += blockDim.x)
        if (fetched[e]) where[e] = 0;
}

// After the layer's pool_publish, before pull_rare and its products (compute stream): wait
// until the host's copies of the layer's guessed experts landed (landed [layer] == (uint32)
// *seq, device memory the copy stream writes), then point the layer's tables [L, 3, E] at their
// staging slots (the residency's upload behind the window puts them back). fetched [E] is
// cleared; guessed [L] counts the experts. After GUESS_TIMEOUT_NS the tables keep the host
// copies (guess_claim made the experts the GPU's: its products read them over PCIe, as rare
// ones) and status [0] gets layer + 1 (the host logs it); the later layers of the window then
// neither claim nor wait (a worker that failed writes no landed word: one wait of 5 s a window,
// not one a layer). Grid 1, block 256.
#define GUESS_TIMEOUT_NS 5000000000ULL
extern "C" __global__ void guess_point(int E, int layer, const long long *__restrict__ seq,
                                       const unsigned int *landed, uint8_t *__restrict__ fetched,
                                       const unsigned long long *__restrict__ base,
                                       unsigned long long slot_bytes,
                                       const unsigned long long *__restrict__ part_off,
                                       unsigned long long *tables, int *guessed, int *status) {
    kernel_entry();
    __shared__ int ok;
    const long long want = *seq;
    if (want == 0) return;
    if (threadIdx.x == 0) {
        ok = *reinterpret_cast<volatile int *>(status) == 0;  // no layer before timed out
        volatile const unsigned int *l = landed + layer;
        const unsigned long long t0 = global_ns();
        while (ok && *l != (unsigned int)want) {
            if (global_ns() - t0 > GUESS_TIMEOUT_NS) {
                ok = 0;
                atomicCAS(status, 0, layer + 1);
                break;
            }
            __nanosleep(100);
        }
        __threadfence();
    }
    __syncthreads();
    const unsigned long long stage = base[layer];
    int n = 0;
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        if (!fetched[e]) continue;
        fetched[e] = 0;
        if (!ok || stage == 0) continue;
        const unsigned long long dst = stage + (unsigned long long)e * slot_bytes;
        for (int p = 0; p < 3; p++)
            tables[((unsigned long long)layer * 3 + p) * E + e] = dst + part_off[layer * 3 + p];
        n++;
    }
    if (n) atomicAdd(guessed + layer, n);
}

// Read-ahead of a decode window (docs/offload.md, "Reading ahead into VRAM"): while the GPU runs
// a layer's dense part (and the pool the layer before's experts), the link to the pinned host
// copies is idle. On a side stream, behind the previous layer's expert products, read_ahead
// copies the S experts of `layer` with the highest score (decayed routed rows: the experts the
// last tokens chose) into one set of a ring of two, and ahead_point, behind it on the same
// stream, points the layer's tables at them; the layer's tier_groups_ahead (after the join)
// then treats those routed as the GPU's, read from VRAM. Nothing stays in VRAM from one token
// to the next: the experts are read again every window.
// State: turn [1] (the set this launch fills is turn & 1), staged [L, S] (the experts each
// read_ahead picked, -1 none), sets [2, 1 + S] (per set: the layer whose tables point at it, -1
// none, and its experts). Order, on the side stream: ahead_point of the layer before pointed
// the other set's user back at its host copies before this read_ahead overwrites that set, and
// this layer's tables point at its set only once the copy has landed (the next launch).
#define AHEAD_MAX 4

// Grid (chunks, S), block 256: every block picks the same experts (score is not written while
// this runs), blockIdx.y copies the y-th into slot y of set turn & 1.
extern "C" __global__ void read_ahead(const float *__restrict__ score, int E, int layer, int S,
                                      int *staged, const int *__restrict__ turn,
                                      unsigned long long ring,
                                      unsigned long long host_dev_base,
                                      unsigned long long slot_bytes,
                                      unsigned long long image_bytes) {
    kernel_entry();
    __shared__ float best_v[WARP];
    __shared__ int best_e[WARP];
    __shared__ int chosen[AHEAD_MAX];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    for (int s = 0; s < S; s++) {  // the s-th highest score (ties: the lower id), > 0 only
        float v = 0.0f;
        int ev = -1;
        for (int e = threadIdx.x; e < E; e += blockDim.x) {
            bool taken = false;
            for (int t = 0; t < s; t++) taken |= chosen[t] == e;
            const float x = score[e];
            if (!taken && x > v) {
                v = x;
                ev = e;
            }
        }
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_down_sync(0xffffffffu, v, o);
            const int oe = __shfl_down_sync(0xffffffffu, ev, o);
            if (oe >= 0 && (ov > v || (ov == v && (ev < 0 || oe < ev)))) {
                v = ov;
                ev = oe;
            }
        }
        if (lane == 0) {
            best_v[warp] = v;
            best_e[warp] = ev;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            float bv = 0.0f;
            int be = -1;
            for (int w = 0; w < warps; w++)
                if (best_e[w] >= 0 && (best_v[w] > bv || (best_v[w] == bv && best_e[w] < be))) {
                    bv = best_v[w];
                    be = best_e[w];
                }
            chosen[s] = be;
        }
        __syncthreads();
    }
    const int s = blockIdx.y, e = chosen[s];
    if (blockIdx.x == 0 && threadIdx.x == 0) staged[layer * S + s] = e;
    if (e < 0) return;
    const unsigned long long dst = ring + ((unsigned long long)(*turn & 1) * S + s) * slot_bytes;
    copy_image(host_dev_base + ((unsigned long long)layer * E + e) * slot_bytes, dst,
               image_bytes);
}

// After read_ahead on the side stream: the other set's user pointed back at its host copies
// (its layer's products ran before this layer's read_ahead was forked), this layer's staged
// experts at their slots of set turn & 1, the sets' record updated, turn advanced. One thread.
// tables [L, 3, E] uint64, part_off [L, 3] uint64.
extern "C" __global__ void ahead_point(int E, int layer, int S, const int *__restrict__ staged,
                                       int *sets, int *turn, unsigned long long ring,
                                       unsigned long long host_dev_base,
                                       unsigned long long slot_bytes,
                                       const unsigned long long *__restrict__ part_off,
                                       unsigned long long *tables) {
    kernel_entry();
    const int p = *turn & 1;
    int *mine = sets + p * (1 + S), *other = sets + (1 - p) * (1 + S);
    const int prev = other[0];
    if (prev >= 0)
        for (int t = 0; t < S; t++) {
            const int pe = other[1 + t];
            if (pe < 0) continue;
            const unsigned long long hb =
                host_dev_base + ((unsigned long long)prev * E + pe) * slot_bytes;
            for (int q = 0; q < 3; q++)
                tables[((unsigned long long)prev * 3 + q) * E + pe] = hb + part_off[prev * 3 + q];
        }
    other[0] = -1;
    mine[0] = layer;
    for (int t = 0; t < S; t++) {
        const int te = staged[layer * S + t];
        mine[1 + t] = te;
        if (te < 0) continue;
        const unsigned long long sb = ring + ((unsigned long long)p * S + t) * slot_bytes;
        for (int q = 0; q < 3; q++)
            tables[((unsigned long long)layer * 3 + q) * E + te] = sb + part_off[layer * 3 + q];
    }
    *turn += 1;
}
