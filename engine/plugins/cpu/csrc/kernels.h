/*
 * The CPU plugin's C entry points, as native.py binds them and forward_graph.c replays
 * them. Every kernel returns 0, or a nonzero status when it refused its arguments
 * (nothing is written then, unless a kernel says otherwise). Dtype arguments take the
 * DTYPE_* codes of cpu_math.h. Every ISA level's library exports the same entry points.
 */
#ifndef ENGINE_CPU_KERNELS_H
#define ENGINE_CPU_KERNELS_H

#include <stdint.h>

/* q and out in q_dtype, the caches in dtype (a wider query reads a narrower cache; an
 * fp8 cache holds codes of K / k_scale and V / v_scale, the scales ignored otherwise). */
int paged_decode_attention(
    const void *q, int64_t q_req_stride, int64_t q_head_stride,
    const void *k_cache, const void *v_cache,
    const int64_t *block_tables, int64_t bt_stride, const int64_t *seq_lens,
    void *out, int num_reqs, int num_heads, int num_kv_heads, int head_size,
    int block_size, int dtype, float scale, int window, float soft_cap, int num_splits,
    int q_dtype, float k_scale, float v_scale);
/* The same with chunked local attention (chunk > 0: keys from chunk * ((seq_len - 1) /
 * chunk)) and per-head sink logits (sinks: float32 [num_heads], NULL: none). */
int paged_decode_attention_ext(
    const void *q, int64_t q_req_stride, int64_t q_head_stride,
    const void *k_cache, const void *v_cache,
    const int64_t *block_tables, int64_t bt_stride, const int64_t *seq_lens,
    void *out, int num_reqs, int num_heads, int num_kv_heads, int head_size,
    int block_size, int dtype, float scale, int window, float soft_cap, int num_splits,
    int q_dtype, float k_scale, float v_scale, int chunk, const float *sinks);
/* The key ranges per (request, KV head) task paged_decode_attention picks for num_splits 0. */
int decode_key_splits(int num_tasks, const int64_t *seq_lens, int num_reqs, int window);
/* Fix the thread count decode_key_splits plans for (n <= 0: the pool's current count). */
void set_split_threads(int n);
/* key / value in src_dtype, rounded into caches of dtype (fp8: quantized by the scales). */
int write_kv(const void *key, int64_t k_tok_stride, int64_t k_head_stride,
             const void *value, int64_t v_tok_stride, int64_t v_head_stride,
             const int64_t *slots, int64_t num_tokens, void *k_cache, void *v_cache,
             int64_t num_blocks, int num_kv_heads, int head_size, int block_size, int dtype,
             int src_dtype, float k_scale, float v_scale);
/* MLA decode (mla_decode.c): q [R, H, D] in q_dtype (strided rows), kv_cache [num_blocks,
 * block_size, D] latent entries in dtype (f32 / bf16 / f16), out contiguous [R, H, L] in
 * q_dtype; -2 when a request's length or block id is outside its table or the cache. */
int mla_decode_attention(const void *q, int64_t q_req_stride, int64_t q_head_stride,
                         const void *kv_cache, const int64_t *block_tables, int64_t bt_stride,
                         const int64_t *seq_lens, void *out, int num_reqs, int num_heads,
                         int entry, int lora, int block_size, int64_t num_blocks, int dtype,
                         float scale, int num_splits, int q_dtype);
/* Store latent entries [T, D] (row stride given) at their slots (-1: skipped; -2 returned,
 * nothing written, when a slot is outside the num_slots of the cache). */
int mla_write_entries(const void *entries, int64_t row_stride, const int64_t *slots,
                      int64_t num_tokens, void *kv_cache, int64_t num_slots, int entry,
                      int dtype, int src_dtype);
int rms_norm(const void *x, int64_t x_stride, int64_t heads, void *residual,
             int64_t res_stride, const void *weight, void *out, int64_t rows, int64_t hidden,
             float eps, int dtype);
/* residual += x, rounded to dtype (rows strided, the last dimension contiguous). */
int residual_add(const void *x, int64_t x_stride, void *residual, int64_t res_stride,
                 int64_t rows, int64_t hidden, int dtype);
int silu_and_mul(const void *x, int64_t x_stride, void *out, int64_t rows, int64_t inter,
                 int dtype);
int rotary_neox(void *x, int64_t x_stride, const int64_t *positions, const void *cos_sin,
                int64_t rows, int64_t heads, int64_t head_size, int64_t max_positions,
                int dtype);
int embedding_rows(const int64_t *ids, int64_t num_ids, const void *table, int64_t vocab,
                   int64_t hidden, int table_dtype, void *out, int out_dtype);
/* The same for one rank's shard of the vocabulary (rows row_start ..
 * row_start + table_rows of vocab); other ids of the vocabulary give zero rows. */
int embedding_shard_rows(const int64_t *ids, int64_t num_ids, const void *table,
                         int64_t row_start, int64_t table_rows, int64_t vocab, int64_t hidden,
                         int table_dtype, void *out, int out_dtype);
/* csrc/shm_comm.c: the shared-memory all-reduce (a forward graph records it). */
int shm_comm_all_reduce(void *handle, void *data, int64_t count, int dtype);
/* out = x W^T (+ bias): x, bias and out in adt, W in wdt, packed by gemm_pack for the
 * same (adt, wdt) pair; gemm_plain reads W as a plain row-major [n, k] (row stride ldw). */
int gemm_pack(const void *w, int64_t n, int64_t k, int wdt, int adt, void *packed);
int gemm_packed(const void *x, int64_t ldx, const void *packed, const void *bias, void *out,
                int64_t ldo, int64_t m, int64_t n, int64_t k, int adt, int wdt);
int gemm_plain(const void *x, int64_t ldx, const void *w, int64_t ldw, const void *bias,
               void *out, int64_t ldo, int64_t m, int64_t n, int64_t k, int adt, int wdt);
/* Quantized weights (gemm_quant.h): params as its QP_* words; qgemm_pack fills
 * qgemm_pack_bytes(params) bytes from the canonical codes / scales / zero points. */
int64_t qgemm_pack_bytes(const int64_t *params);
int qgemm_pack(const int64_t *params, const uint8_t *codes, const float *scales,
               const float *zeros, const int64_t *perm, const float *act_scales, void *packed);
int qgemm(const void *x, int64_t ldx, const void *packed, const void *bias, void *out,
          int64_t ldo, int64_t m, int adt);
int qgemm_path(const void *packed);
int quantize_activations(const void *x, int64_t ldx, int64_t m, int64_t k, int adt, int act,
                         int strategy, int dynamic, int64_t group, float scale, float *out);

/* Batched multi-LoRA (lora.c; engine/core/interfaces/lora.py): slots int32 [t_count] in
 * [-1, num_slots), read at run time. shrink: out[t] = a[slot] [k, in] . x[t] (float32,
 * written; 0 for slot -1); expand: y[t, bounds[j]:bounds[j+1]] += s[t, j*rank:(j+1)*rank]
 * . b[slot] [rank, n] (rank-major), shard j's columns (y rounded once; slot -1 untouched). */
int lora_shrink(const void *x, int64_t ldx, const void *a, const int32_t *slots, float *out,
                int64_t ldo, int64_t t_count, int64_t k, int64_t in, int64_t num_slots,
                int dtype);
int lora_expand(const float *s, int64_t lds, const void *b, const int32_t *slots,
                const int64_t *bounds, int64_t num_shards, void *y, int64_t ldy,
                int64_t t_count, int64_t n, int64_t rank, int64_t num_slots, int dtype);

#endif
