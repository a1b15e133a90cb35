/*
 * Paged attention for decode queries (one new token per request) on the CPU.
 *
 * Why C: with torch ops, a decode step gathers every request's KV history into a
 * padded copy and runs SDPA over it; SDPA's per-(request, head) setup then costs more
 * than the arithmetic (64 requests x 2 KV heads x 140 keys: ~5 us per task). This
 * kernel reads the cache blocks in place, once, and serves every query head of a GQA
 * group from the same pass over its KV head (flash-decoding's online softmax over
 * slices of up to 16 keys of one cache block).
 *
 * Cache layout (one layer), each (block, kv_head) one row of block_size * head_size:
 *   K: k_cache[block][kv_head][head_size][block_size]   (transposed: dims major)
 *      bf16 on CPUs with AVX512-BF16: k_cache[block][kv_head][head_size/2][block_size][2]
 *      (dim pairs: vdpbf16ps scores 16 keys on two dims per instruction)
 *   V: v_cache[block][kv_head][block_size][head_size]
 * With K transposed, 16 consecutive keys' values of one dimension are contiguous, so
 * the scores of 4 query heads x 16 keys come out of independent 16-wide FMAs with no
 * horizontal sums; the output accumulates 4 heads x 16 dims per pass over the slice's
 * value rows. Loops have fixed trip counts so the compiler keeps accumulators in
 * vector registers; the exponential is a vectorizable polynomial. Scores, softmax and
 * sums are float32 whatever the storage dtype. head_size must be a multiple of 16.
 *
 * fp8 caches (e4m3fn / e5m2 codes of value / scale, one byte each, the dims-major K
 * layout): codes are widened to float32 exactly as they are loaded (simd.h's
 * vf_load_fp8); k_scale multiplies the query's scale and v_scale the normalized output,
 * so the result is attention over the dequantized values at no cost per key.
 *
 * Chunked local attention and sinks (paged_decode_attention_ext): a request's keys start
 * at the later of its window's and its chunk's start (the blocks before are never read,
 * nor their block-table entries); a head's sink logit joins the denominator once, when a
 * row is normalized (merge_and_store, after the key splits are merged).
 *
 * Built by engine/plugins/cpu/native.py with -O3 -march=native -fopenmp; torch's own
 * libgomp (same soname, already loaded) runs the parallel loop.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_math.h"
#include "kernels.h"
#include "simd.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define BF16_KEY_PAIRS 1 /* bf16 keys stored in dim pairs, scored with vdpbf16ps */
#else
#define BF16_KEY_PAIRS 0
#endif

#define SLICE VF /* keys per slice: one native vector (16 with AVX-512, 8 with AVX2, 4 else) */
#define HEADS 4  /* query heads per register block */
#define PREFETCH_BLOCKS 4 /* how many blocks ahead K/V rows are prefetched */
#define CHUNK_SLICES 4 /* slices per online-softmax update (64 keys with AVX-512) */
#define MAX_HEAD_SIZE 512
#define MAX_GROUP 64
#define MAX_SPLITS 64 /* key ranges per task (flash-decoding) */
#define MIN_KEYS_PER_SPLIT 256 /* shorter ranges cost more to merge than they save */
#define MAX_GROUP_ELEMS 8192 /* padded group * head_size: per-thread scratch */

/* Native-width vectors (GCC/Clang vector extensions over simd.h's VF lanes), so the
 * accumulators live in registers without target intrinsics. A vector wider than the
 * target's registers would not: the compiler keeps such values in memory. */
typedef float vfloat __attribute__((vector_size(SLICE * sizeof(float))));
typedef int32_t vlane __attribute__((vector_size(SLICE * sizeof(int32_t))));
typedef uint32_t vu32 __attribute__((vector_size(SLICE * sizeof(uint32_t))));
typedef uint16_t vu16 __attribute__((vector_size(SLICE * sizeof(uint16_t))));
#if HAVE_FLOAT16
typedef _Float16 vhalf __attribute__((vector_size(SLICE * sizeof(_Float16))));
#endif

static inline vfloat load_floats(const float *src) {
    vfloat v;
    memcpy(&v, src, sizeof v);
    return v;
}

static inline void store_floats(float *dst, vfloat v) { memcpy(dst, &v, sizeof v); }

/* SLICE consecutive values of a `dtype` array as float32 */
static inline __attribute__((always_inline)) vfloat load_values(const void *base, int64_t index,
                                                                const int dtype) {
    if (dtype == DTYPE_BF16) return vf_load_bf16((const uint16_t *)base + index);
    if (is_fp8(dtype)) return vf_load_fp8((const uint8_t *)base + index, dtype);
    if (dtype == DTYPE_F16) {
#if HAVE_FLOAT16
        vhalf h;
        memcpy(&h, (const _Float16 *)base + index, sizeof h);
        return __builtin_convertvector(h, vfloat);
#else
        float part[SLICE];
        for (int l = 0; l < SLICE; l++) part[l] = f16_to_f32(((const uint16_t *)base)[index + l]);
        return load_floats(part);
#endif
    }
    return load_floats((const float *)base + index);
}

/* the first n (<= SLICE) values, zeros after: never reads past the slice */
static inline __attribute__((always_inline)) vfloat load_keys(const void *base, int64_t index,
                                                              int n, const int dtype) {
    if (n == SLICE) return load_values(base, index, dtype);
    float part[SLICE] = {0};
    for (int l = 0; l < n; l++) part[l] = load_at(base, index + l, dtype);
    return load_floats(part);
}

/* lanes of `a` where `mask` is set, `b` elsewhere */
static inline vfloat select_mask(vlane mask, vfloat a, float b) {
    const vfloat fill = a * 0.0f + b;
    vu32 ua, ub;
    memcpy(&ua, &a, sizeof ua);
    memcpy(&ub, &fill, sizeof ub);
    const vu32 m = (vu32)mask;
    const vu32 r = (ua & m) | (ub & ~m);
    vfloat out;
    memcpy(&out, &r, sizeof out);
    return out;
}

static inline vlane lane_ids(void) {
#if SLICE == 16
    const vlane ids = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
#elif SLICE == 8
    const vlane ids = {0, 1, 2, 3, 4, 5, 6, 7};
#else
    const vlane ids = {0, 1, 2, 3};
#endif
    return ids;
}

/* the first n lanes of a, `fill` after them */
static inline vfloat keep_first(vfloat a, int n, float fill) {
    return select_mask(lane_ids() < n, a, fill);
}

/* p where x > bound, 0 elsewhere */
static inline vfloat where_above(vfloat x, float bound, vfloat p) {
    return select_mask(x > bound, p, 0.0f);
}

/* lane-wise maximum */
static inline vfloat max_lanes(vfloat a, vfloat b) {
    vu32 ua, ub;
    memcpy(&ua, &a, sizeof ua);
    memcpy(&ub, &b, sizeof ub);
    const vu32 a_wins = (vu32)(a > b);
    const vu32 r = (ua & a_wins) | (ub & ~a_wins);
    vfloat out;
    memcpy(&out, &r, sizeof out);
    return out;
}

/* v with its lanes permuted (constant indices): a tree of these reduces the lanes in
 * log2(SLICE) steps instead of SLICE - 1 lane extractions */
#if defined(__clang__)
#define PERMUTE(v, ...) __builtin_shufflevector(v, v, __VA_ARGS__)
#else
#define PERMUTE(v, ...) __builtin_shuffle(v, (vlane){__VA_ARGS__})
#endif
#if SLICE == 16
#define REDUCE_LANES(v, combine)                                                           \
    do {                                                                                   \
        v = combine(v, PERMUTE(v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));  \
        v = combine(v, PERMUTE(v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));  \
        v = combine(v, PERMUTE(v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));  \
        v = combine(v, PERMUTE(v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));  \
    } while (0)
#elif SLICE == 8
#define REDUCE_LANES(v, combine)                                                           \
    do {                                                                                   \
        v = combine(v, PERMUTE(v, 4, 5, 6, 7, 0, 1, 2, 3));                                \
        v = combine(v, PERMUTE(v, 2, 3, 0, 1, 6, 7, 4, 5));                                \
        v = combine(v, PERMUTE(v, 1, 0, 3, 2, 5, 4, 7, 6));                                \
    } while (0)
#else
#define REDUCE_LANES(v, combine)                                                           \
    do {                                                                                   \
        v = combine(v, PERMUTE(v, 2, 3, 0, 1));                                            \
        v = combine(v, PERMUTE(v, 1, 0, 3, 2));                                            \
    } while (0)
#endif
#define ADD_LANES(a, b) ((a) + (b))

static inline float lanes_max(vfloat v) {
    REDUCE_LANES(v, max_lanes);
    return v[0];
}

static inline float lanes_sum(vfloat v) {
    REDUCE_LANES(v, ADD_LANES);
    return v[0];
}

/* exp_nonpositive on every lane */
static inline vfloat vexp_nonpositive(vfloat x) {
    const vfloat lowest = (vfloat){0} - 87.0f;
    x = max_lanes(lowest, x); /* a NaN stays NaN */
    const vfloat n = EXP_ROUND(x);
    const vfloat r = EXP_REDUCE(x, n);
    vfloat p = EXP_POLY(r);
    vu32 bits;
    memcpy(&bits, &p, sizeof bits);
    bits += (vu32)(__builtin_convertvector(n, vlane) << 23);
    memcpy(&p, &bits, sizeof p);
    return where_above(x, -87.0f, p);
}

/* Ask for one (block, kv head) row of K and of V, 64 bytes at a time. */
static inline __attribute__((always_inline)) void prefetch_row(
    const void *k_cache, const void *v_cache, int64_t index, int64_t count, const int dtype)
{
    const int64_t size = dtype_size(dtype);
    const char *k = (const char *)k_cache + index * size, *v = (const char *)v_cache + index * size;
    for (int64_t offset = 0; offset < count * size; offset += 64) {
        __builtin_prefetch(k + offset, 0, 2); /* into L2: 4 blocks of rows would crowd L1 */
        __builtin_prefetch(v + offset, 0, 2);
    }
}

/* scores[c] = q[c] . k for HEADS query heads (q pre-scaled, float32) and the n <= SLICE
 * keys from column j0 of a dims-major K row */
static inline __attribute__((always_inline)) void score_keys(
    const float *q0, const void *k_cache, int64_t row, int j0, int n, int head_size,
    int block_size, const int dtype, vfloat scores[HEADS])
{
    vfloat s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
    for (int i = 0; i < head_size; i++) {
        const vfloat k = load_keys(k_cache, row + (int64_t)i * block_size + j0, n, dtype);
        s0 += q0[i] * k;
        s1 += q0[head_size + i] * k;
        s2 += q0[2 * head_size + i] * k;
        s3 += q0[3 * head_size + i] * k;
    }
    scores[0] = s0, scores[1] = s1, scores[2] = s2, scores[3] = s3;
}

/* score_keys for two slices at once: each query value is broadcast once for both, so a
 * dim costs 4 broadcasts, 2 key loads and 8 FMAs instead of 5 loads per 4 FMAs (the
 * loads, not the FMAs, bounded the one-slice loop) */
static inline __attribute__((always_inline)) void score_two_slices(
    const float *q0, const void *k_cache, const int64_t *rows, const int *j0s,
    const int *counts, int head_size, int block_size, const int dtype,
    vfloat scores[][HEADS])
{
    vfloat a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};
    for (int i = 0; i < head_size; i++) {
        const int64_t dim = (int64_t)i * block_size;
        const vfloat ka = load_keys(k_cache, rows[0] + dim + j0s[0], counts[0], dtype);
        const vfloat kb = load_keys(k_cache, rows[1] + dim + j0s[1], counts[1], dtype);
        const float q_0 = q0[i], q_1 = q0[head_size + i];
        const float q_2 = q0[2 * head_size + i], q_3 = q0[3 * head_size + i];
        a0 += q_0 * ka, b0 += q_0 * kb;
        a1 += q_1 * ka, b1 += q_1 * kb;
        a2 += q_2 * ka, b2 += q_2 * kb;
        a3 += q_3 * ka, b3 += q_3 * kb;
    }
    scores[0][0] = a0, scores[0][1] = a1, scores[0][2] = a2, scores[0][3] = a3;
    scores[1][0] = b0, scores[1][1] = b1, scores[1][2] = b2, scores[1][3] = b3;
}

#if BF16_KEY_PAIRS
/* score_keys for bf16 keys in dim pairs, over the T slices of a chunk at once (each
 * query pair is broadcast once for all of them): one load holds a slice's n keys x 2
 * dims, and each vdpbf16ps adds both dims' exact products in float32. q0 holds the raw
 * bf16 query pairs (one per float's bits); the scale multiplies the sums. */
static inline __attribute__((always_inline)) void score_chunk_pairs(
    const int T, const float *q0, const void *k_cache, const int64_t *rows, const int *j0s,
    const int *counts, int head_size, int block_size, float scale,
    vfloat scores[][HEADS])
{
    const int half = head_size / 2;
    const uint32_t *qp = (const uint32_t *)q0;
    const uint16_t *k[CHUNK_SLICES];
    __mmask32 lanes[CHUNK_SLICES];
    __m512 acc[CHUNK_SLICES][HEADS];
    for (int t = 0; t < T; t++) {
        k[t] = (const uint16_t *)k_cache + rows[t] + 2 * (int64_t)j0s[t];
        lanes[t] = counts[t] == SLICE ? 0xffffffffu : (__mmask32)((1ull << (2 * counts[t])) - 1);
        for (int c = 0; c < HEADS; c++)
            acc[t][c] = _mm512_setzero_ps();
    }
    for (int i = 0; i < half; i++) {
        __m512bh q[HEADS];
        for (int c = 0; c < HEADS; c++)
            q[c] = (__m512bh)_mm512_set1_epi32((int)qp[c * half + i]);
        for (int t = 0; t < T; t++) {
            const __m512bh kv = (__m512bh)_mm512_maskz_loadu_epi16(
                lanes[t], k[t] + 2 * (int64_t)i * block_size);
            for (int c = 0; c < HEADS; c++)
                acc[t][c] = _mm512_dpbf16_ps(acc[t][c], kv, q[c]);
        }
    }
    for (int t = 0; t < T; t++)
        for (int c = 0; c < HEADS; c++)
            scores[t][c] = (vfloat)acc[t][c] * scale;
}

static void score_key_pairs(int num_slices, const float *q0, const void *k_cache,
                            const int64_t *rows, const int *j0s, const int *counts,
                            int head_size, int block_size, float scale,
                            vfloat scores[][HEADS])
{
    switch (num_slices) {
    case 4: score_chunk_pairs(4, q0, k_cache, rows, j0s, counts, head_size, block_size, scale, scores); break;
    case 3: score_chunk_pairs(3, q0, k_cache, rows, j0s, counts, head_size, block_size, scale, scores); break;
    case 2: score_chunk_pairs(2, q0, k_cache, rows, j0s, counts, head_size, block_size, scale, scores); break;
    default: score_chunk_pairs(1, q0, k_cache, rows, j0s, counts, head_size, block_size, scale, scores);
    }
}
#else
static inline void score_key_pairs(int num_slices, const float *q0, const void *k_cache,
                                   const int64_t *rows, const int *j0s, const int *counts,
                                   int head_size, int block_size, float scale,
                                   vfloat scores[][HEADS])
{
    (void)num_slices, (void)q0, (void)k_cache, (void)rows, (void)j0s, (void)counts,
        (void)head_size, (void)block_size, (void)scale,
        (void)scores; /* never called: key_pairs is 0 without AVX512-BF16 */
}
#endif

/* One (request, kv head) task over keys [first, seq_len): per query head of the group,
 * the running maximum, the sum of exponentials and the unnormalized weighted values
 * (out_acc: group x head_size), so partial results over key ranges can be merged. */
static inline __attribute__((always_inline)) void attend_task(
    const void *q, int64_t q_index, int64_t q_head_stride,
    const void *k_cache, const void *v_cache, const int64_t *blocks,
    int64_t first, int64_t seq_len, int64_t head_row, int64_t block_stride,
    float *out_max, float *out_sum, float *out_acc, int group, int head_size, int block_size,
    const int dtype, float scale, float soft_cap, int q_dtype)
{
    const int padded_group = (group + HEADS - 1) / HEADS * HEADS;
    const int key_pairs = BF16_KEY_PAIRS && dtype == DTYPE_BF16;
    float qs[MAX_GROUP_ELEMS], acc[MAX_GROUP_ELEMS];
    float row_max[MAX_GROUP], row_sum[MAX_GROUP];
    memset(qs, 0, sizeof(float) * padded_group * head_size);
    memset(acc, 0, sizeof(float) * padded_group * head_size);
    if (key_pairs) { /* the bf16 query, two dims per float's bits; scaled after */
        for (int g = 0; g < group; g++) {
            uint16_t *pairs = (uint16_t *)(qs + g * head_size / 2);
            const int64_t row = q_index + g * q_head_stride;
            if (q_dtype == DTYPE_BF16)
                memcpy(pairs, (const uint16_t *)q + row, sizeof(uint16_t) * head_size);
            else /* a wider query is rounded to the keys' bf16 for vdpbf16ps */
                for (int i = 0; i < head_size; i++)
                    pairs[i] = f32_to_bf16(load_at(q, row + i, q_dtype));
        }
    } else {
        for (int g = 0; g < group; g++)
            for (int i = 0; i < head_size; i++)
                qs[g * head_size + i] = scale * load_at(q, q_index + g * q_head_stride + i, q_dtype);
    }
    for (int g = 0; g < padded_group; g++) {
        row_max[g] = -INFINITY;
        row_sum[g] = 0.0f;
    }
    for (int64_t start = first; start < seq_len;) {
        /* a chunk of up to CHUNK_SLICES slices, each keys [start, end) inside one cache
           block and at most SLICE long: one softmax update per chunk, not per slice */
        int64_t rows[CHUNK_SLICES];
        int j0s[CHUNK_SLICES], counts[CHUNK_SLICES], num_slices = 0;
        for (; num_slices < CHUNK_SLICES && start < seq_len; num_slices++) {
            const int64_t block_end = (start / block_size + 1) * block_size;
            int64_t end = start + SLICE < block_end ? start + SLICE : block_end;
            end = end < seq_len ? end : seq_len;
            const int j0 = (int)(start % block_size);
            if (start == first || j0 == 0) {
                /* the coming blocks' rows are elsewhere in memory: start fetching them
                   PREFETCH_BLOCKS ahead, so no block's first touch waits on a miss */
                const int64_t block = start / block_size;
                for (int64_t ahead = start == first ? 1 : PREFETCH_BLOCKS;
                     ahead <= PREFETCH_BLOCKS && (block + ahead) * block_size < seq_len; ahead++)
                    prefetch_row(k_cache, v_cache, blocks[block + ahead] * block_stride + head_row,
                                 (int64_t)block_size * head_size, dtype);
            }
            rows[num_slices] = blocks[start / block_size] * block_stride + head_row;
            j0s[num_slices] = j0;
            counts[num_slices] = (int)(end - start);
            start = end;
        }
        for (int g0 = 0; g0 < padded_group; g0 += HEADS) {
            /* scores of HEADS query heads x SLICE keys per slice: one vector per head */
            vfloat scores[CHUNK_SLICES][HEADS];
            if (key_pairs)
                score_key_pairs(num_slices, qs + g0 * head_size / 2, k_cache, rows, j0s, counts,
                                head_size, block_size, scale, scores);
            else {
                int t = 0;
                for (; t + 2 <= num_slices; t += 2)
                    score_two_slices(qs + g0 * head_size, k_cache, rows + t, j0s + t,
                                     counts + t, head_size, block_size, dtype, scores + t);
                for (; t < num_slices; t++)
                    score_keys(qs + g0 * head_size, k_cache, rows[t], j0s[t], counts[t],
                               head_size, block_size, dtype, scores[t]);
            }
            float probs[HEADS][CHUNK_SLICES * SLICE], correction[HEADS];
            for (int c = 0; c < HEADS; c++) {
                const int g = g0 + c;
                vfloat top = (vfloat){0} - INFINITY;
                for (int t = 0; t < num_slices; t++) {
                    vfloat sc = scores[t][c];
                    if (soft_cap > 0.0f)
                        for (int l = 0; l < counts[t]; l++)
                            sc[l] = soft_cap * tanhf(sc[l] / soft_cap);
                    sc = keep_first(sc, counts[t], -INFINITY);
                    scores[t][c] = sc;
                    top = max_lanes(top, sc);
                }
                const float chunk_max = lanes_max(top);
                const float new_max = chunk_max > row_max[g] ? chunk_max : row_max[g];
                correction[c] = exp_nonpositive(row_max[g] - new_max);
                row_max[g] = new_max;
                vfloat total = {0};
                for (int t = 0; t < num_slices; t++) {
                    const vfloat p = keep_first(vexp_nonpositive(scores[t][c] - new_max),
                                                counts[t], 0.0f);
                    total += p;
                    memcpy(probs[c] + t * SLICE, &p, sizeof p);
                }
                row_sum[g] = row_sum[g] * correction[c] + lanes_sum(total);
            }
            /* acc[c] = acc[c] * correction[c] + sum_j probs[c][j] v_j, two vectors of dims
               at a time (each probability broadcast once for both), then a last one */
            int i0 = 0;
            for (; i0 + 2 * SLICE <= head_size; i0 += 2 * SLICE) {
                float *a_out = acc + g0 * head_size + i0;
                vfloat a0 = load_floats(a_out) * correction[0];
                vfloat a1 = load_floats(a_out + head_size) * correction[1];
                vfloat a2 = load_floats(a_out + 2 * head_size) * correction[2];
                vfloat a3 = load_floats(a_out + 3 * head_size) * correction[3];
                vfloat b0 = load_floats(a_out + SLICE) * correction[0];
                vfloat b1 = load_floats(a_out + head_size + SLICE) * correction[1];
                vfloat b2 = load_floats(a_out + 2 * head_size + SLICE) * correction[2];
                vfloat b3 = load_floats(a_out + 3 * head_size + SLICE) * correction[3];
                for (int t = 0; t < num_slices; t++) {
                    const int64_t v_index = rows[t] + (int64_t)j0s[t] * head_size + i0;
                    const float *p0 = probs[0] + t * SLICE, *p1 = probs[1] + t * SLICE;
                    const float *p2 = probs[2] + t * SLICE, *p3 = probs[3] + t * SLICE;
                    for (int j = 0; j < counts[t]; j++) {
                        const int64_t at = v_index + (int64_t)j * head_size;
                        const vfloat va = load_values(v_cache, at, dtype);
                        const vfloat vb = load_values(v_cache, at + SLICE, dtype);
                        a0 += p0[j] * va, b0 += p0[j] * vb;
                        a1 += p1[j] * va, b1 += p1[j] * vb;
                        a2 += p2[j] * va, b2 += p2[j] * vb;
                        a3 += p3[j] * va, b3 += p3[j] * vb;
                    }
                }
                store_floats(a_out, a0);
                store_floats(a_out + head_size, a1);
                store_floats(a_out + 2 * head_size, a2);
                store_floats(a_out + 3 * head_size, a3);
                store_floats(a_out + SLICE, b0);
                store_floats(a_out + head_size + SLICE, b1);
                store_floats(a_out + 2 * head_size + SLICE, b2);
                store_floats(a_out + 3 * head_size + SLICE, b3);
            }
            for (; i0 < head_size; i0 += SLICE) {
                float *a_out = acc + g0 * head_size + i0;
                vfloat a0 = load_floats(a_out) * correction[0];
                vfloat a1 = load_floats(a_out + head_size) * correction[1];
                vfloat a2 = load_floats(a_out + 2 * head_size) * correction[2];
                vfloat a3 = load_floats(a_out + 3 * head_size) * correction[3];
                for (int t = 0; t < num_slices; t++) {
                    const int64_t v_index = rows[t] + (int64_t)j0s[t] * head_size + i0;
                    const float *p0 = probs[0] + t * SLICE, *p1 = probs[1] + t * SLICE;
                    const float *p2 = probs[2] + t * SLICE, *p3 = probs[3] + t * SLICE;
                    for (int j = 0; j < counts[t]; j++) {
                        const vfloat v = load_values(v_cache, v_index + (int64_t)j * head_size,
                                                     dtype);
                        a0 += p0[j] * v;
                        a1 += p1[j] * v;
                        a2 += p2[j] * v;
                        a3 += p3[j] * v;
                    }
                }
                store_floats(a_out, a0);
                store_floats(a_out + head_size, a1);
                store_floats(a_out + 2 * head_size, a2);
                store_floats(a_out + 3 * head_size, a3);
            }
        }
    }
    memcpy(out_max, row_max, sizeof(float) * group);
    memcpy(out_sum, row_sum, sizeof(float) * group);
    memcpy(out_acc, acc, sizeof(float) * group * head_size);
}

/* out[g] = (sum_s acc_s[g] e^(max_s[g] - M)) / (sum_s sum_s[g] e^(max_s[g] - M)), M the
 * largest max_s[g]: the softmax over the union of the splits' key ranges; times
 * out_scale (an fp8 cache's v_scale, else 1). sinks (NULL: none): the group's learned
 * sink logits, one more term e^(sinks[g] - M) of the denominator with no value (M then
 * also covers the sink), added here once whatever the number of splits. */
static inline __attribute__((always_inline)) void merge_and_store(
    const float *parts, int num_parts, int64_t part_stride, int group, int head_size,
    void *out, int64_t out_index, const int dtype, float out_scale, const float *sinks)
{
    for (int g = 0; g < group; g++) {
        float top = -INFINITY;
        for (int p = 0; p < num_parts; p++) {
            const float m = parts[p * part_stride + g];
            top = m > top ? m : top;
        }
        float total = 0.0f, weights[MAX_SPLITS];
        if (sinks != NULL) { /* the sink's logit: in the denominator only, once per row */
            const float sink = sinks[g];
            if (sink > top) top = sink;
            if (sink > -INFINITY) total = exp_nonpositive(sink - top);
        }
        for (int p = 0; p < num_parts; p++) {
            const float *part = parts + p * part_stride;
            weights[p] = part[group + g] > 0.0f ? exp_nonpositive(part[g] - top) : 0.0f;
            total += part[group + g] * weights[p];
        }
        const float inv = total > 0.0f ? out_scale / total : 0.0f;
        for (int i = 0; i < head_size; i++) {
            float value = 0.0f;
            for (int p = 0; p < num_parts; p++)
                value += parts[p * part_stride + 2 * group + g * head_size + i] * weights[p];
            store_at(out, out_index + (int64_t)g * head_size + i, dtype, value * inv);
        }
    }
}

/*
 * One copy per dtype (the dtype a literal inside the OpenMP regions, so the slice loops
 * vectorize for it). Work items are (request, kv head, key split): with num_splits > 1
 * each task's keys are cut into that many ranges (flash-decoding), so a batch with fewer
 * tasks than threads still keeps every thread busy; the partial softmaxes are then
 * merged per task. Returns 0, or -1 when the scratch memory cannot be had.
 */
#define DEFINE_DECODE(NAME, DTYPE)                                                           \
    static int NAME(const void *q, int64_t q_req_stride, int64_t q_head_stride,              \
                    const void *k_cache, const void *v_cache, const int64_t *block_tables,  \
                    int64_t bt_stride, const int64_t *seq_lens, void *out, int num_reqs,    \
                    int num_heads, int num_kv_heads, int head_size, int block_size,         \
                    float scale, int window, float soft_cap, int num_splits, int q_dtype,   \
                    float k_scale, float v_scale, int chunk, const float *sinks) {           \
        const int group = num_heads / num_kv_heads;                                          \
        /* fp8: scores of codes times k_scale, outputs times v_scale */                     \
        const float qk_scale = is_fp8(DTYPE) ? scale * k_scale : scale;                      \
        const float out_scale = is_fp8(DTYPE) ? v_scale : 1.0f;                              \
        const int64_t row_len = (int64_t)block_size * head_size;                             \
        const int num_tasks = num_reqs * num_kv_heads;                                       \
        const int64_t part_stride = (int64_t)group * (head_size + 2);                        \
        /* unsplit tasks are normalized at once: one scratch part per thread suffices */    \
        const int64_t num_parts =                                                            \
            num_splits > 1 ? (int64_t)num_tasks * num_splits : omp_get_max_threads();        \
        float *parts = malloc(sizeof(float) * part_stride * num_parts);                      \
        if (parts == NULL) return -1;                                                        \
        _Pragma("omp parallel for schedule(static)")                                         \
        for (int item = 0; item < num_tasks * num_splits; item++) {                          \
            const int task = item / num_splits, split = item % num_splits;                   \
            const int r = task / num_kv_heads, kvh = task % num_kv_heads;                    \
            const int64_t seq_len = seq_lens[r];                                             \
            int64_t first = (window > 0 && seq_len > window) ? seq_len - window : 0;        \
            if (chunk > 0 && (seq_len - 1) / chunk * chunk > first) /* the query's chunk */ \
                first = (seq_len - 1) / chunk * chunk;                                       \
            const int64_t span = (seq_len - first + num_splits - 1) / num_splits;            \
            const int64_t lo = first + split * span;                                         \
            const int64_t hi = lo + span < seq_len ? lo + span : seq_len;                    \
            float *part = parts + (num_splits > 1 ? item : omp_get_thread_num()) * part_stride; \
            if (lo >= hi) { /* an empty range: contributes nothing to the merge */           \
                for (int g = 0; g < group; g++) part[g] = -INFINITY, part[group + g] = 0.0f; \
                memset(part + 2 * group, 0, sizeof(float) * group * head_size);              \
            } else {                                                                         \
                attend_task(q, r * q_req_stride + (int64_t)kvh * group * q_head_stride,      \
                            q_head_stride, k_cache, v_cache, block_tables + r * bt_stride,   \
                            lo, hi, kvh * row_len, num_kv_heads * row_len, part,             \
                            part + group, part + 2 * group, group, head_size, block_size,    \
                            DTYPE, qk_scale, soft_cap, q_dtype);                             \
            }                                                                                \
            if (num_splits == 1) /* the whole task: normalize now, no second pass */        \
                merge_and_store(part, 1, part_stride, group, head_size, out,                 \
                                ((int64_t)r * num_heads + (int64_t)kvh * group) * head_size, \
                                q_dtype, out_scale,                                          \
                                sinks != NULL ? sinks + (int64_t)kvh * group : NULL);        \
        }                                                                                    \
        if (num_splits > 1) { /* merge each task's partial softmaxes */                     \
            _Pragma("omp parallel for schedule(static) if (num_tasks > 1)")                  \
            for (int task = 0; task < num_tasks; task++) {                                   \
                const int r = task / num_kv_heads, kvh = task % num_kv_heads;                \
                merge_and_store(parts + (int64_t)task * num_splits * part_stride,            \
                                num_splits, part_stride, group, head_size, out,              \
                                ((int64_t)r * num_heads + (int64_t)kvh * group) * head_size, \
                                q_dtype, out_scale,                                          \
                                sinks != NULL ? sinks + (int64_t)kvh * group : NULL);        \
            }                                                                                \
        }                                                                                    \
        free(parts);                                                                         \
        return 0;                                                                            \
    }

DEFINE_DECODE(decode_f32, DTYPE_F32)
DEFINE_DECODE(decode_bf16, DTYPE_BF16)
DEFINE_DECODE(decode_f16, DTYPE_F16)
DEFINE_DECODE(decode_fp8_e4m3, DTYPE_FP8_E4M3)
DEFINE_DECODE(decode_fp8_e5m2, DTYPE_FP8_E5M2)

/*
 * out[r, h, :] = softmax(scale * q[r, h] . K[r, kv(h), keys]) V[r, kv(h), keys]
 * over keys [first, seq_lens[r]), first = seq_len - window when window > 0, else 0.
 *
 * q: [num_reqs, num_heads, head_size] with strides (q_req_stride, q_head_stride, 1);
 * out: contiguous [num_reqs, num_heads, head_size]; block_tables: int64 rows of
 * bt_stride entries; soft_cap > 0 applies cap * tanh(score / cap); num_splits key
 * ranges per task, 0 to let decode_key_splits choose; k_scale / v_scale: an fp8
 * cache's (K = k_scale * code), ignored for other dtypes. Returns 0, or -1
 * when a size or the dtype is out of range (nothing is written then).
 */
/*
 * Key ranges per (request, KV head) task when the caller passes num_splits = 0: none
 * while the tasks alone fill the threads; otherwise about two work items per thread,
 * each of at least MIN_KEYS_PER_SPLIT keys of the longest (windowed) context.
 */
static int split_threads = 0; /* set_split_threads: 0 = the pool's current count */

/*
 * The thread count decode_key_splits plans for, fixed by the worker at its plan's count:
 * the thread governor (cpu/threads.py) changes the pool's count while the engine runs,
 * and the key splits, which decide the order a softmax is summed in, must not follow it,
 * or a request's tokens would depend on the machine's load. n <= 0: follow the pool.
 */
void set_split_threads(int n) { split_threads = n > 0 ? n : 0; }

int decode_key_splits(int num_tasks, const int64_t *seq_lens, int num_reqs, int window)
{
    if (batch_invariant_mode) /* a split's merge would round a row by its batch */
        return 1;
    const int threads = split_threads > 0 ? split_threads : omp_get_max_threads();
    if (num_tasks >= threads || num_tasks <= 0) return 1;
    int64_t longest = 0;
    for (int r = 0; r < num_reqs; r++) {
        const int64_t keys = window > 0 && seq_lens[r] > window ? window : seq_lens[r];
        longest = keys > longest ? keys : longest;
    }
    int64_t splits = (2 * threads + num_tasks - 1) / num_tasks;
    if (splits > longest / MIN_KEYS_PER_SPLIT) splits = longest / MIN_KEYS_PER_SPLIT;
    if (splits > MAX_SPLITS) splits = MAX_SPLITS;
    return splits < 1 ? 1 : (int)splits;
}

int paged_decode_attention(
    const void *q, int64_t q_req_stride, int64_t q_head_stride,
    const void *k_cache, const void *v_cache,
    const int64_t *block_tables, int64_t bt_stride, const int64_t *seq_lens,
    void *out, int num_reqs, int num_heads, int num_kv_heads, int head_size,
    int block_size, int dtype, float scale, int window, float soft_cap, int num_splits,
    int q_dtype, float k_scale, float v_scale)
{
    return paged_decode_attention_ext(q, q_req_stride, q_head_stride, k_cache, v_cache,
                                      block_tables, bt_stride, seq_lens, out, num_reqs,
                                      num_heads, num_kv_heads, head_size, block_size, dtype,
                                      scale, window, soft_cap, num_splits, q_dtype, k_scale,
                                      v_scale, 0, NULL);
}

/*
 * paged_decode_attention with Llama 4's chunked local attention and GPT-OSS's sinks:
 * chunk > 0 starts request r's keys at chunk * ((seq_lens[r] - 1) / chunk) (the query,
 * at position seq_lens[r] - 1, sees only its own chunk; with a window too, the later of
 * the two starts); sinks (NULL: none) holds num_heads float32 logits, one per query
 * head, each joining its head's softmax denominator (not soft-capped, no value). Blocks
 * before a request's first key are never read, not even their block-table entries.
 */
int paged_decode_attention_ext(
    const void *q, int64_t q_req_stride, int64_t q_head_stride,
    const void *k_cache, const void *v_cache,
    const int64_t *block_tables, int64_t bt_stride, const int64_t *seq_lens,
    void *out, int num_reqs, int num_heads, int num_kv_heads, int head_size,
    int block_size, int dtype, float scale, int window, float soft_cap, int num_splits,
    int q_dtype, float k_scale, float v_scale, int chunk, const float *sinks)
{
    if (chunk < 0) return -1;
    if (head_size <= 0 || head_size > MAX_HEAD_SIZE || head_size % 16 != 0 || /* every level */
        num_kv_heads <= 0 || num_heads % num_kv_heads != 0 ||
        num_heads / num_kv_heads > MAX_GROUP || block_size <= 0)
        return -1;
    const int group = num_heads / num_kv_heads;
    if ((group + HEADS - 1) / HEADS * HEADS * head_size > MAX_GROUP_ELEMS) return -1;
    if (num_splits == 0)
        num_splits = decode_key_splits(num_reqs * num_kv_heads, seq_lens, num_reqs,
                                       window > 0 && (chunk <= 0 || window < chunk) ? window
                                                                                   : chunk);
    if (num_splits < 1 || num_splits > MAX_SPLITS) return -1;
    if (q_dtype < DTYPE_F32 || q_dtype > DTYPE_F16) return -1;
    if (is_fp8(dtype) && !(k_scale > 0.0f && v_scale > 0.0f)) return -1;
#define DECODE_ARGS                                                                          \
    q, q_req_stride, q_head_stride, k_cache, v_cache, block_tables, bt_stride, seq_lens, out, \
        num_reqs, num_heads, num_kv_heads, head_size, block_size, scale, window, soft_cap,   \
        num_splits, q_dtype, k_scale, v_scale, chunk, sinks
    switch (dtype) {
    case DTYPE_F32: return decode_f32(DECODE_ARGS);
    case DTYPE_BF16: return decode_bf16(DECODE_ARGS);
    case DTYPE_F16: return decode_f16(DECODE_ARGS);
    case DTYPE_FP8_E4M3: return decode_fp8_e4m3(DECODE_ARGS);
    case DTYPE_FP8_E5M2: return decode_fp8_e5m2(DECODE_ARGS);
    default:
        return -1;
    }
#undef DECODE_ARGS
}

/*
 * Write the step's new keys and values into the paged cache: token t goes to slot
 * slots[t] (block slots[t] / block_size, offset slots[t] % block_size); a slot of -1
 * is skipped (any slot outside the cache: nothing is written, -1 is returned). K rows
 * are stored transposed ([head_size][block_size]: the token is one column; bf16 with
 * BF16_KEY_PAIRS: [head_size / 2][block_size][2], the token one column of pairs), V rows
 * token-major. key / value: [num_tokens, num_kv_heads, head_size] with
 * the given token and head strides (slices of a fused projection), in src_dtype (a
 * float dtype), rounded into the cache's; an fp8 cache stores the codes of key / k_scale
 * and value / v_scale (f32_to_fp8: nearest even, saturated), the scales ignored else.
 */
/* 1 when bf16 keys are stored in dim pairs (see the layout above), else 0 */
int bf16_key_pairs(void) { return BF16_KEY_PAIRS; }

int write_kv(const void *key, int64_t k_tok_stride, int64_t k_head_stride,
             const void *value, int64_t v_tok_stride, int64_t v_head_stride,
             const int64_t *slots, int64_t num_tokens, void *k_cache, void *v_cache,
             int64_t num_blocks, int num_kv_heads, int head_size, int block_size, int dtype,
             int src_dtype, float k_scale, float v_scale)
{
    if (head_size <= 0 || num_kv_heads <= 0 || block_size <= 0) return -1;
    if (((dtype < DTYPE_F32 || dtype > DTYPE_F16) && !is_fp8(dtype)) || src_dtype < DTYPE_F32 ||
        src_dtype > DTYPE_F16)
        return -1;
    if (is_fp8(dtype) && !(k_scale > 0.0f && v_scale > 0.0f)) return -1;
    for (int64_t t = 0; t < num_tokens; t++) /* nothing is written unless every slot fits */
        if (slots[t] >= num_blocks * block_size || slots[t] < -1) return -1;
    const int64_t size = dtype_size(dtype), src_size = dtype_size(src_dtype);
    const int64_t row_len = (int64_t)block_size * head_size;
    const int pairs = BF16_KEY_PAIRS && dtype == DTYPE_BF16;
#pragma omp parallel for if (num_tokens >= 256)
    for (int64_t t = 0; t < num_tokens; t++) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        const int64_t block = slot / block_size, offset = slot % block_size;
        for (int h = 0; h < num_kv_heads; h++) {
            const int64_t row = (block * num_kv_heads + h) * row_len;
            const char *k = (const char *)key + (t * k_tok_stride + h * k_head_stride) * src_size;
            const char *v = (const char *)value + (t * v_tok_stride + h * v_head_stride) * src_size;
            /* dim pairs: dims d, d + 1 side by side in column `offset`; dims major: one
               value per dim, block_size apart */
            const int64_t first = pairs ? row + 2 * offset : row + offset;
            const int64_t dim_stride = pairs ? 2 * (int64_t)block_size : block_size;
            const int64_t v_first = row + offset * head_size;
            if (src_dtype == dtype) {
                char *k_dst = (char *)k_cache + first * size;
                if (pairs)
                    for (int d = 0; d < head_size; d += 2)
                        memcpy(k_dst + (int64_t)d * block_size * size, k + d * size,
                               2 * (size_t)size);
                else
                    for (int d = 0; d < head_size; d++)
                        memcpy(k_dst + (int64_t)d * block_size * size, k + d * size, (size_t)size);
                memcpy((char *)v_cache + v_first * size, v, (size_t)(head_size * size));
            } else if (is_fp8(dtype)) { /* codes of value / scale, dims major */
                uint8_t *k_dst = (uint8_t *)k_cache + first, *v_dst = (uint8_t *)v_cache + v_first;
                for (int d = 0; d < head_size; d++) {
                    k_dst[(int64_t)d * dim_stride] = f32_to_fp8(load_at(k, d, src_dtype) / k_scale,
                                                                dtype);
                    v_dst[d] = f32_to_fp8(load_at(v, d, src_dtype) / v_scale, dtype);
                }
            } else { /* rounded from the activations' dtype into the cache's */
                for (int d = 0; d < head_size; d++) {
                    const int64_t at = pairs ? first + (d / 2) * dim_stride + d % 2
                                             : first + d * dim_stride;
                    store_at(k_cache, at, dtype, load_at(k, d, src_dtype));
                    store_at(v_cache, v_first + d, dtype, load_at(v, d, src_dtype));
                }
            }
        }
    }
    return 0;
}
