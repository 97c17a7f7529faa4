/* The window loop's own kernels: causal attention over KV cells, NEOX RoPE, the router's
 * softmax + top-k, KV cell writes and the small element-wise steps between the products.
 *
 * Legend: R = rows of a window, H = hidden, Q / KV = query / KV heads, G = Q / KV,
 * D = head dim, E = experts, K = experts per row, C = KV cells (capacity).
 */
#pragma once
#include <stddef.h>
#include <stdint.h>

/* Keys per attention tile. K cells are stored tile-transposed, [KV, NT, D, ST_KEY_TILE] (NT =
 * capacity / ST_KEY_TILE rounded up): a tile is the [D, keys] panel the score product reads,
 * with no packing. V cells are [KV, cap, D]. */
#define ST_KEY_TILE 64

/* One run of a window (one slot's contiguous rows) as attention reads it. */
typedef struct {
    const void *k;        /* this layer's K cells [KV, NT, D, ST_KEY_TILE], float32 or float16 */
    const void *v;        /* this layer's V cells [KV, cap, D] */
    int64_t cap;          /* V cells per head (the stride between heads) */
    int64_t k_tiles;      /* NT: K tiles per head */
    int64_t row0;         /* first window row of the run */
    int64_t num_rows;
    int64_t pos0;         /* cells before the run's first row (its first position) */
    int is_f16;
} st_attn_run;

int st_attention_key_tile(void);    /* ST_KEY_TILE of this build */
/* Bytes of attention scratch one thread needs (st_attention takes num_threads of them). */
size_t st_attention_scratch_bytes(int Q, int KV, int D);

/* out[r, j*D:(j+1)*D] = softmax(scale * q_j . K[:pos(r)+1]) V over the run's cells, query head
 * j reading KV head j / G; q and out are [R, Q*D]. The new rows' K/V must be in the cells.
 * Keys are taken in tiles of fixed absolute position with an online softmax, so a row's
 * result depends on its own query and cells alone (not on the rows or threads beside it).
 * scratch: num_threads x st_attention_scratch_bytes. */
void st_attention(const float *q, int Q, int KV, int D, float scale, const st_attn_run *runs,
                  int num_runs, float *out, void *scratch, int num_threads);

/* cos/sin [R, D/2] of positions x inv_freq (float32 products, as torch computes them). */
void st_rope_table(const int64_t *positions, int64_t R, const float *inv_freq, int half,
                   float *cos_out, float *sin_out);
/* NEOX rotation in place: x [R, heads, D]; the first n_rot dims of each head rotate, their
 * halves together (cos/sin [R, n_rot/2]); the others pass (partial RoPE). */
void st_rope_neox(float *x, int64_t R, int heads, int D, int n_rot, const float *cos_t,
                  const float *sin_t);

/* Softmax over E router logits per row (in place: logits [R, E] become scratch), the K largest
 * probabilities (largest first, ties to the lowest id), normalised to sum 1 when norm_topk:
 * experts [R, K], weights [R, K]. */
void st_router_topk(float *logits, int64_t R, int E, int K, int norm_topk,
                    int32_t *experts, float *weights);

/* Write n rows of src [n, KV*D] into V cells [KV, cap, D] / K cells [KV, NT, D, ST_KEY_TILE]
 * (float32 or float16, rounded to nearest even like numpy's astype) at positions
 * start..start+n of each head. */
void st_kv_write(void *cells, int is_f16, int64_t cap, int64_t start, const float *src,
                 int64_t n, int KV, int D);
void st_kv_write_keys(void *cells, int is_f16, int64_t k_tiles, int64_t start, const float *src,
                      int64_t n, int KV, int D);
uint16_t st_fp32_to_fp16(float f);

/* Element-wise steps: x[T, n] += y; x[T, n] += b (per column); g = silu(g) * u;
 * out[t] += sigmoid(logit[t]) * y[t] (y [T, n]). */
void st_add(float *x, const float *y, int64_t num_values);
void st_add_bias(float *x, const float *b, int64_t T, int n);
void st_silu_mul(float *g, const float *u, int64_t num_values);
void st_add_gated(float *out, const float *y, const float *logit, int64_t T, int n);

/* Gated attention (qwen3next): qg [R, heads, 2D] holds each head's query then its gate; split
 * into q and gate [R, heads*D]. x *= sigmoid(gate), element-wise. */
void st_split_q_gate(float *qg, int64_t R, int heads, int D, float *q, float *gate);
void st_mul_sigmoid(float *x, const float *gate, int64_t num_values);
