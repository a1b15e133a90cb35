/*
 * Multi-head latent attention (MLA, DeepSeek-V2/V3) for decode queries on the CPU, and
 * the store of the step's new latent entries. The torch path (mla_attention.py) gathers
 * every decode's context into a padded copy and runs SDPA; this kernel reads the paged
 * cache in place, once per request, and forward graphs can replay it.
 *
 * Cache layout (one layer): kv_cache[block][offset][D], one latent entry of D =
 * kv_lora_rank + rope_dim values per token, shared by every head (multi-query): the keys
 * are whole entries, the values their first L = kv_lora_rank dims.
 *
 * Bandwidth: the H heads of a request are the rows of one multi-query problem, so each
 * key tile (MLA_TILE consecutive keys, across blocks) is loaded once, widened to float32
 * and transposed into per-thread scratch, then serves every head:
 *   scores[h][j] = q[h] . c[j]    HEADS heads x TILE keys per register block, the key
 *                                 tile dims-major so 16 keys' values of one dim are one
 *                                 vector and no horizontal sums are needed;
 *   acc[h][:L] += p[h][j] c[j][:L] HEADS heads x 2 vectors of dims per register block.
 * That is a small GEMM per tile (H x D x TILE, then H x TILE x L), float32 accumulation,
 * an online softmax per tile (paged_decode_attention.c's exponential). With few requests
 * the context is cut into key ranges (flash-decoding splits, decode_key_splits' choice)
 * whose partial softmaxes are merged per request.
 *
 * Built by kernel_build.py once per ISA level (-march of the level, -fopenmp).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_math.h"
#include "kernels.h"
#include "simd.h"

#define MLA_SLICE VF        /* keys per vector */
#define MLA_TILE (2 * VF)   /* keys per tile: two vectors of scores per head */
#define MLA_HEADS 4         /* query heads per register block */
#define MLA_MAX_SPLITS 64
#define MLA_MAX_ENTRY 1024  /* D: DeepSeek's 576 with room */
#define MLA_MAX_HEADS 1024

static inline vf mla_max(vf a, vf b) {
    const vu a_wins = (vu)(a > b);
    vu ua, ub;
    memcpy(&ua, &a, sizeof ua);
    memcpy(&ub, &b, sizeof ub);
    return vf_from_bits((ua & a_wins) | (ub & ~a_wins));
}

/* the first n lanes of a, `fill` after them */
static inline vf mla_keep_first(vf a, int n, float fill) {
    vi ids;
    for (int l = 0; l < VF; l++) ids[l] = l;
    const vu keep = (vu)(ids < n);
    vu ua, uf;
    const vf f = vf_splat(fill);
    memcpy(&ua, &a, sizeof ua);
    memcpy(&uf, &f, sizeof uf);
    return vf_from_bits((ua & keep) | (uf & ~keep));
}

/* exp_nonpositive (cpu_math.h) on every lane; 0 at or below -87 (and for -inf) */
static inline vf mla_exp(vf x) {
    const vf lowest = vf_splat(-87.0f);
    const vu low = (vu)(x > lowest);
    x = mla_max(lowest, x);
    const vf n = EXP_ROUND(x);
    const vf r = EXP_REDUCE(x, n);
    vf p = EXP_POLY(r);
    vu bits;
    memcpy(&bits, &p, sizeof bits);
    bits += (vu)(__builtin_convertvector(n, vi) << 23);
    return vf_from_bits(bits & low);
}

static inline float mla_lanes_max(vf v) {
    float m = v[0];
    for (int l = 1; l < VF; l++) m = v[l] > m ? v[l] : m;
    return m;
}

/* Per-thread scratch of one (request, key range) task. */
typedef struct {
    float *qs;    /* [padded_heads][D] the scaled queries */
    float *rows;  /* [MLA_TILE][D] the tile's entries as float32, token-major (values) */
    float *cols;  /* [D][MLA_TILE] the same dims-major (scores); keys past the tile 0 */
} MlaScratch;

/* Widen keys [start, start + n) into s->rows and s->cols; a tile may span blocks (with
 * 16-token blocks a tile of one block's keys would leave half the score lanes empty). */
static inline __attribute__((always_inline)) void load_tile(
    const void *cache, const int64_t *blocks, int64_t start, int n, int block_size, int entry,
    const int dtype, MlaScratch *s)
{
    for (int j = 0; j < n; j++) {
        const int64_t pos = start + j;
        const int64_t at = (blocks[pos / block_size] * block_size + pos % block_size) * entry;
        float *row = s->rows + (int64_t)j * entry;
        int i = 0;
        for (; i + VF <= entry; i += VF) vf_store(row + i, vf_load_as(cache, at + i, dtype));
        for (; i < entry; i++) row[i] = load_at(cache, at + i, dtype);
    }
    for (int i = 0; i < entry; i++) {
        float *col = s->cols + (int64_t)i * MLA_TILE;
        for (int j = 0; j < n; j++) col[j] = s->rows[(int64_t)j * entry + i];
        for (int j = n; j < MLA_TILE; j++) col[j] = 0.0f;
    }
}

/* scores of MLA_HEADS query heads (from q0, rows entry apart) x MLA_TILE keys */
static inline __attribute__((always_inline)) void score_tile(
    const float *q0, const float *cols, int entry, vf out[MLA_HEADS][2])
{
    vf a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};
    for (int i = 0; i < entry; i++) {
        const vf ka = vf_load(cols + (int64_t)i * MLA_TILE);
        const vf kb = vf_load(cols + (int64_t)i * MLA_TILE + VF);
        const float q_0 = q0[i], q_1 = q0[entry + i], q_2 = q0[2 * entry + i],
                    q_3 = q0[3 * entry + i];
        a0 += q_0 * ka, b0 += q_0 * kb;
        a1 += q_1 * ka, b1 += q_1 * kb;
        a2 += q_2 * ka, b2 += q_2 * kb;
        a3 += q_3 * ka, b3 += q_3 * kb;
    }
    out[0][0] = a0, out[0][1] = b0, out[1][0] = a1, out[1][1] = b1;
    out[2][0] = a2, out[2][1] = b2, out[3][0] = a3, out[3][1] = b3;
}

/* acc[c][:L] = acc[c][:L] * correction[c] + sum_j probs[c][j] rows[j][:L], c < MLA_HEADS */
static inline __attribute__((always_inline)) void accumulate_tile(
    float *acc0, int64_t lora, const float *rows, int entry, int n,
    const float probs[MLA_HEADS][MLA_TILE], const float correction[MLA_HEADS])
{
    int i0 = 0;
    for (; i0 + 2 * VF <= lora; i0 += 2 * VF) {
        float *a = acc0 + i0;
        vf a0 = vf_load(a) * correction[0], b0 = vf_load(a + VF) * correction[0];
        vf a1 = vf_load(a + lora) * correction[1], b1 = vf_load(a + lora + VF) * correction[1];
        vf a2 = vf_load(a + 2 * lora) * correction[2];
        vf b2 = vf_load(a + 2 * lora + VF) * correction[2];
        vf a3 = vf_load(a + 3 * lora) * correction[3];
        vf b3 = vf_load(a + 3 * lora + VF) * correction[3];
        for (int j = 0; j < n; j++) {
            const float *row = rows + (int64_t)j * entry + i0;
            const vf va = vf_load(row), vb = vf_load(row + VF);
            a0 += probs[0][j] * va, b0 += probs[0][j] * vb;
            a1 += probs[1][j] * va, b1 += probs[1][j] * vb;
            a2 += probs[2][j] * va, b2 += probs[2][j] * vb;
            a3 += probs[3][j] * va, b3 += probs[3][j] * vb;
        }
        vf_store(a, a0), vf_store(a + VF, b0);
        vf_store(a + lora, a1), vf_store(a + lora + VF, b1);
        vf_store(a + 2 * lora, a2), vf_store(a + 2 * lora + VF, b2);
        vf_store(a + 3 * lora, a3), vf_store(a + 3 * lora + VF, b3);
    }
    for (; i0 < lora; i0++) /* L not a multiple of 2 * VF (small test shapes) */
        for (int c = 0; c < MLA_HEADS; c++) {
            float v = acc0[c * lora + i0] * correction[c];
            for (int j = 0; j < n; j++) v += probs[c][j] * rows[(int64_t)j * entry + i0];
            acc0[c * lora + i0] = v;
        }
}

/* One task: every head of request r over keys [lo, hi). part: [padded][2 + L] floats as
 * (max[padded], sum[padded], acc[padded][L]). */
static inline __attribute__((always_inline)) void mla_task(
    const void *cache, const int64_t *blocks, int64_t lo, int64_t hi, int padded, int entry,
    int lora, int block_size, const int dtype, MlaScratch *s, float *part)
{
    float *row_max = part, *row_sum = part + padded, *acc = part + 2 * padded;
    for (int h = 0; h < padded; h++) row_max[h] = -INFINITY, row_sum[h] = 0.0f;
    memset(acc, 0, sizeof(float) * padded * lora);
    for (int64_t start = lo; start < hi;) {
        const int64_t end = start + MLA_TILE < hi ? start + MLA_TILE : hi;
        const int n = (int)(end - start);
        load_tile(cache, blocks, start, n, block_size, entry, dtype, s);
        for (int h0 = 0; h0 < padded; h0 += MLA_HEADS) {
            vf sc[MLA_HEADS][2];
            score_tile(s->qs + (int64_t)h0 * entry, s->cols, entry, sc);
            float probs[MLA_HEADS][MLA_TILE], correction[MLA_HEADS];
            for (int c = 0; c < MLA_HEADS; c++) {
                const int h = h0 + c;
                const int n0 = n < VF ? n : VF, n1 = n > VF ? n - VF : 0;
                const vf s0 = mla_keep_first(sc[c][0], n0, -INFINITY);
                const vf s1 = mla_keep_first(sc[c][1], n1, -INFINITY);
                const float top = mla_lanes_max(mla_max(s0, s1));
                const float new_max = top > row_max[h] ? top : row_max[h];
                correction[c] = exp_nonpositive(row_max[h] - new_max);
                row_max[h] = new_max;
                const vf p0 = mla_exp(s0 - new_max), p1 = mla_exp(s1 - new_max);
                row_sum[h] = row_sum[h] * correction[c] + vf_sum(p0 + p1);
                vf_store(probs[c], p0);
                vf_store(probs[c] + VF, p1);
            }
            accumulate_tile(acc + (int64_t)h0 * lora, lora, s->rows, entry, n, probs,
                            correction);
        }
        start = end;
    }
}

/* out[h] = the softmax over the union of the parts' key ranges (see paged decode's merge) */
static void mla_merge(const float *parts, int num_parts, int64_t part_stride, int heads,
                      int padded, int lora, void *out, int64_t out_index, int q_dtype)
{
    for (int h = 0; h < heads; h++) {
        float top = -INFINITY, total = 0.0f, weights[MLA_MAX_SPLITS];
        for (int p = 0; p < num_parts; p++) {
            const float m = parts[p * part_stride + h];
            top = m > top ? m : top;
        }
        for (int p = 0; p < num_parts; p++) {
            const float *part = parts + p * part_stride;
            weights[p] = part[padded + h] > 0.0f ? exp_nonpositive(part[h] - top) : 0.0f;
            total += part[padded + h] * weights[p];
        }
        const float inv = total > 0.0f ? 1.0f / total : 0.0f;
        for (int i = 0; i < lora; i++) {
            float value = 0.0f;
            for (int p = 0; p < num_parts; p++)
                value += parts[p * part_stride + 2 * padded + (int64_t)h * lora + i] * weights[p];
            store_at(out, out_index + (int64_t)h * lora + i, q_dtype, value * inv);
        }
    }
}

/* request r's scaled queries into s->qs (padded heads zero) */
static void load_queries(const void *q, int64_t index, int64_t head_stride, int heads,
                         int padded, int entry, int q_dtype, float scale, float *qs)
{
    for (int h = 0; h < heads; h++)
        for (int i = 0; i < entry; i++)
            qs[(int64_t)h * entry + i] = scale * load_at(q, index + h * head_stride + i, q_dtype);
    memset(qs + (int64_t)heads * entry, 0, sizeof(float) * (padded - heads) * entry);
}

/* every block id a request reads, and its length, inside the cache and its table */
static int check_tables(const int64_t *block_tables, int64_t bt_stride, const int64_t *seq_lens,
                        int num_reqs, int64_t num_blocks, int block_size)
{
    for (int r = 0; r < num_reqs; r++) {
        const int64_t seq_len = seq_lens[r];
        if (seq_len < 1 || seq_len > bt_stride * block_size) return -2;
        for (int64_t b = 0; b < (seq_len + block_size - 1) / block_size; b++) {
            const int64_t block = block_tables[r * bt_stride + b];
            if (block < 0 || block >= num_blocks) return -2;
        }
    }
    return 0;
}

#define DEFINE_MLA(NAME, DTYPE)                                                               \
    static int NAME(const void *q, int64_t q_req_stride, int64_t q_head_stride,               \
                    const void *kv_cache, const int64_t *block_tables, int64_t bt_stride,     \
                    const int64_t *seq_lens, void *out, int num_reqs, int num_heads,          \
                    int entry, int lora, int block_size, float scale, int num_splits,         \
                    int q_dtype) {                                                            \
        const int padded = (num_heads + MLA_HEADS - 1) / MLA_HEADS * MLA_HEADS;               \
        const int64_t part_stride = (int64_t)padded * (2 + lora);                             \
        const int threads = omp_get_max_threads();                                           \
        const int64_t num_parts = num_splits > 1 ? (int64_t)num_reqs * num_splits : threads;  \
        const int64_t scratch_stride =                                                        \
            (int64_t)padded * entry + 2 * (int64_t)MLA_TILE * entry + 16;                     \
        float *parts = malloc(sizeof(float) * part_stride * num_parts);                       \
        float *scratch = malloc(sizeof(float) * scratch_stride * threads);                    \
        if (parts == NULL || scratch == NULL) {                                               \
            free(parts), free(scratch);                                                       \
            return -1;                                                                        \
        }                                                                                     \
        _Pragma("omp parallel for schedule(static)")                                          \
        for (int item = 0; item < num_reqs * num_splits; item++) {                            \
            const int r = item / num_splits, split = item % num_splits;                       \
            const int64_t seq_len = seq_lens[r];                                              \
            const int64_t span = (seq_len + num_splits - 1) / num_splits;                     \
            const int64_t lo = split * span;                                                  \
            const int64_t hi = lo + span < seq_len ? lo + span : seq_len;                     \
            const int thread = omp_get_thread_num();                                          \
            float *base = scratch + thread * scratch_stride;                                  \
            MlaScratch s = {base, base + (int64_t)padded * entry,                             \
                            base + (int64_t)padded * entry + (int64_t)MLA_TILE * entry};      \
            float *part = parts + (num_splits > 1 ? item : thread) * part_stride;             \
            load_queries(q, r * q_req_stride, q_head_stride, num_heads, padded, entry,        \
                         q_dtype, scale, s.qs);                                               \
            mla_task(kv_cache, block_tables + r * bt_stride, lo, hi, padded, entry, lora,     \
                     block_size, DTYPE, &s, part);                                            \
            if (num_splits == 1)                                                              \
                mla_merge(part, 1, part_stride, num_heads, padded, lora, out,                 \
                          (int64_t)r * num_heads * lora, q_dtype);                            \
        }                                                                                     \
        if (num_splits > 1) {                                                                 \
            _Pragma("omp parallel for schedule(static) if (num_reqs > 1)")                    \
            for (int r = 0; r < num_reqs; r++)                                                \
                mla_merge(parts + (int64_t)r * num_splits * part_stride, num_splits,          \
                          part_stride, num_heads, padded, lora, out,                          \
                          (int64_t)r * num_heads * lora, q_dtype);                            \
        }                                                                                     \
        free(parts), free(scratch);                                                           \
        return 0;                                                                             \
    }

DEFINE_MLA(mla_f32, DTYPE_F32)
DEFINE_MLA(mla_bf16, DTYPE_BF16)
DEFINE_MLA(mla_f16, DTYPE_F16)

int mla_decode_attention(const void *q, int64_t q_req_stride, int64_t q_head_stride,
                         const void *kv_cache, const int64_t *block_tables, int64_t bt_stride,
                         const int64_t *seq_lens, void *out, int num_reqs, int num_heads,
                         int entry, int lora, int block_size, int64_t num_blocks, int dtype,
                         float scale, int num_splits, int q_dtype)
{
    if (num_reqs < 0 || num_heads <= 0 || num_heads > MLA_MAX_HEADS || entry <= 0 ||
        entry > MLA_MAX_ENTRY || lora <= 0 || lora > entry || block_size <= 0 ||
        q_dtype < DTYPE_F32 || q_dtype > DTYPE_F16)
        return -1;
    if (num_reqs == 0) return 0;
    if (check_tables(block_tables, bt_stride, seq_lens, num_reqs, num_blocks, block_size))
        return -2;
    if (num_splits == 0) num_splits = decode_key_splits(num_reqs, seq_lens, num_reqs, 0);
    if (num_splits < 1 || num_splits > MLA_MAX_SPLITS) return -1;
#define MLA_ARGS                                                                              \
    q, q_req_stride, q_head_stride, kv_cache, block_tables, bt_stride, seq_lens, out, num_reqs, \
        num_heads, entry, lora, block_size, scale, num_splits, q_dtype
    switch (dtype) {
    case DTYPE_F32: return mla_f32(MLA_ARGS);
    case DTYPE_BF16: return mla_bf16(MLA_ARGS);
    case DTYPE_F16: return mla_f16(MLA_ARGS);
    default: return -1;
    }
#undef MLA_ARGS
}

int mla_write_entries(const void *entries, int64_t row_stride, const int64_t *slots,
                      int64_t num_tokens, void *kv_cache, int64_t num_slots, int entry,
                      int dtype, int src_dtype)
{
    if (entry <= 0 || dtype < DTYPE_F32 || dtype > DTYPE_F16 || src_dtype < DTYPE_F32 ||
        src_dtype > DTYPE_F16)
        return -1;
    for (int64_t t = 0; t < num_tokens; t++) /* nothing is written unless every slot fits */
        if (slots[t] >= num_slots || slots[t] < -1) return -2;
    const int64_t size = dtype_size(dtype);
    for (int64_t t = 0; t < num_tokens; t++) {
        if (slots[t] < 0) continue;
        const int64_t dst = slots[t] * entry, src = t * row_stride;
        if (src_dtype == dtype)
            memcpy((char *)kv_cache + dst * size, (const char *)entries + src * size,
                   (size_t)(entry * size));
        else
            for (int i = 0; i < entry; i++)
                store_at(kv_cache, dst + i, dtype, load_at(entries, src + i, src_dtype));
    }
    return 0;
}
