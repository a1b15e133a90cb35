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
 * Register blocking, written so the compiler keeps the accumulators in vector
 * registers (fixed trip counts): query heads go 4 at a time; a slice's keys are
 * widened to float32 and transposed so the 4 x 16 scores come from independent
 * 16-wide FMAs; the output accumulates 4 heads x 16 dims per pass over the slice's
 * values. Exponentials are a vectorizable polynomial. Scores, softmax and sums are
 * float32 whatever the storage dtype. head_size must be a multiple of 16.
 *
 * Cache layout (one layer): cache[block][kv_head][offset][head_size], K and V apart.
 * Built by engine/plugins/cpu/native.py with -O3 -march=native -fopenmp; torch's own
 * libgomp (same soname, already loaded) runs the parallel loop.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define SLICE 16        /* keys per slice (and the vector width the loops assume) */
#define HEADS 4         /* query heads per register block */
#define MAX_HEAD_SIZE 512
#define MAX_GROUP 64
#define MAX_GROUP_ELEMS 8192 /* padded group * head_size: per-thread scratch */

enum { DTYPE_F32 = 0, DTYPE_BF16 = 1, DTYPE_F16 = 2 };

static inline float bf16_to_f32(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u); /* NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(bits >> 16);
}

/* exp(x) for x <= 0 (softmax arguments): 2^n * p(r), |r| <= ln2 / 2, within ~2 ulp;
 * branch-free so loops over it vectorize. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    /* round to nearest through the float adder (1.5 * 2^23): no libm call, so the
       loops calling this still vectorize */
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    const float r = x - n * 0.693145751953125f - n * 1.42860682030941723212e-6f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits;
    memcpy(&bits, &p, sizeof bits);
    bits += (int32_t)n << 23;
    memcpy(&p, &bits, sizeof p);
    return x <= -87.0f ? 0.0f : p;
}

/* `n` contiguous values as float32. */
static inline void load_rows(const void *base, int64_t index, int dtype, int n, float *dst) {
    if (dtype == DTYPE_BF16) {
        const uint16_t *src = (const uint16_t *)base + index;
#pragma omp simd
        for (int i = 0; i < n; i++) dst[i] = bf16_to_f32(src[i]);
    } else if (dtype == DTYPE_F16) {
        const _Float16 *src = (const _Float16 *)base + index;
#pragma omp simd
        for (int i = 0; i < n; i++) dst[i] = (float)src[i];
    } else {
        memcpy(dst, (const float *)base + index, (size_t)n * sizeof(float));
    }
}

static inline void store_row(void *base, int64_t index, int dtype, int d, const float *src) {
    if (dtype == DTYPE_BF16) {
        uint16_t *dst = (uint16_t *)base + index;
        for (int i = 0; i < d; i++) dst[i] = f32_to_bf16(src[i]);
    } else if (dtype == DTYPE_F16) {
        _Float16 *dst = (_Float16 *)base + index;
        for (int i = 0; i < d; i++) dst[i] = (_Float16)src[i];
    } else {
        memcpy((float *)base + index, src, (size_t)d * sizeof(float));
    }
}

/* scores[c][j] = q_c . k_j for HEADS query rows (padded with zeros) and SLICE keys. */
static inline void slice_scores(const float *restrict q, const float *restrict kt,
                                int head_size, float scores[HEADS][SLICE]) {
    float s[HEADS][SLICE] = {{0}};
    for (int i = 0; i < head_size; i++) {
        const float *restrict k = kt + i * SLICE;
        for (int c = 0; c < HEADS; c++) {
            const float qi = q[c * head_size + i];
#pragma omp simd
            for (int j = 0; j < SLICE; j++) s[c][j] += qi * k[j];
        }
    }
    memcpy(scores, s, sizeof s);
}

/* acc[c][:] = acc[c][:] * correction[c] + sum_j p[c][j] v_j, 16 dims at a time. */
static inline void slice_values(float *restrict acc, const float *restrict vrows,
                                const float p[HEADS][SLICE], const float correction[HEADS],
                                int n, int head_size) {
    for (int i0 = 0; i0 < head_size; i0 += SLICE) {
        float a[HEADS][SLICE];
        for (int c = 0; c < HEADS; c++)
#pragma omp simd
            for (int l = 0; l < SLICE; l++)
                a[c][l] = acc[c * head_size + i0 + l] * correction[c];
        for (int j = 0; j < n; j++) {
            const float *restrict v = vrows + j * head_size + i0;
            for (int c = 0; c < HEADS; c++) {
                const float pj = p[c][j];
#pragma omp simd
                for (int l = 0; l < SLICE; l++) a[c][l] += pj * v[l];
            }
        }
        for (int c = 0; c < HEADS; c++)
#pragma omp simd
            for (int l = 0; l < SLICE; l++) acc[c * head_size + i0 + l] = a[c][l];
    }
}

/*
 * out[r, h, :] = softmax(scale * q[r, h] . K[r, kv(h), keys]) V[r, kv(h), keys]
 * over keys [first, seq_lens[r]), first = seq_len - window when window > 0, else 0.
 *
 * q: [num_reqs, num_heads, head_size] with strides (q_req_stride, q_head_stride, 1);
 * out: contiguous [num_reqs, num_heads, head_size]; block_tables: int64 rows of
 * bt_stride entries; soft_cap > 0 applies cap * tanh(score / cap). Returns 0, or -1
 * when a size is out of range (nothing is written then).
 */
int paged_decode_attention(
    const void *q, int64_t q_req_stride, int64_t q_head_stride,
    const void *k_cache, const void *v_cache,
    const int64_t *block_tables, int64_t bt_stride, const int64_t *seq_lens,
    void *out, int num_reqs, int num_heads, int num_kv_heads, int head_size,
    int block_size, int dtype, float scale, int window, float soft_cap)
{
    if (head_size <= 0 || head_size > MAX_HEAD_SIZE || head_size % SLICE != 0 ||
        num_kv_heads <= 0 || num_heads % num_kv_heads != 0 ||
        num_heads / num_kv_heads > MAX_GROUP || block_size <= 0)
        return -1;
    const int group = num_heads / num_kv_heads;
    const int padded_group = (group + HEADS - 1) / HEADS * HEADS;
    if (padded_group * head_size > MAX_GROUP_ELEMS) return -1;
    const int64_t block_stride = (int64_t)num_kv_heads * block_size * head_size;
    const int num_tasks = num_reqs * num_kv_heads;

#pragma omp parallel for schedule(static)
    for (int task = 0; task < num_tasks; task++) {
        const int r = task / num_kv_heads, kvh = task % num_kv_heads;
        float qs[MAX_GROUP_ELEMS], acc[MAX_GROUP_ELEMS];
        float krows[SLICE * MAX_HEAD_SIZE], kt[MAX_HEAD_SIZE * SLICE];
        float row_max[MAX_GROUP], row_sum[MAX_GROUP];
        const int chunk_elems = padded_group * head_size;
        memset(qs, 0, sizeof(float) * chunk_elems);
        memset(acc, 0, sizeof(float) * chunk_elems);
        for (int g = 0; g < group; g++) {
            const int h = kvh * group + g;
            float *qg = qs + g * head_size;
            load_rows(q, r * q_req_stride + h * q_head_stride, dtype, head_size, qg);
            for (int i = 0; i < head_size; i++) qg[i] *= scale;
        }
        for (int g = 0; g < padded_group; g++) {
            row_max[g] = -INFINITY;
            row_sum[g] = 0.0f;
        }
        const int64_t seq_len = seq_lens[r];
        const int64_t first = (window > 0 && seq_len > window) ? seq_len - window : 0;
        const int64_t *blocks = block_tables + r * bt_stride;
        for (int64_t start = first; start < seq_len;) {
            /* keys [start, end): inside one cache block, at most SLICE */
            const int64_t block_end = (start / block_size + 1) * block_size;
            int64_t end = start + SLICE < block_end ? start + SLICE : block_end;
            end = end < seq_len ? end : seq_len;
            const int n = (int)(end - start);
            const int64_t base = blocks[start / block_size] * block_stride +
                ((int64_t)kvh * block_size + start % block_size) * head_size;
            /* the slice's keys are n contiguous rows: widen, then transpose (padding
               keys beyond n with zeros; their probabilities are set to 0 below) */
            load_rows(k_cache, base, dtype, n * head_size, krows);
            for (int j = 0; j < SLICE; j++)
                for (int i = 0; i < head_size; i++)
                    kt[i * SLICE + j] = j < n ? krows[j * head_size + i] : 0.0f;
            load_rows(v_cache, base, dtype, n * head_size, krows); /* values, row-major */
            for (int g0 = 0; g0 < padded_group; g0 += HEADS) {
                float s[HEADS][SLICE], correction[HEADS];
                slice_scores(qs + g0 * head_size, kt, head_size, s);
                for (int c = 0; c < HEADS; c++) {
                    const int g = g0 + c;
                    float block_max = -INFINITY;
                    for (int j = 0; j < n; j++) {
                        if (soft_cap > 0.0f) s[c][j] = soft_cap * tanhf(s[c][j] / soft_cap);
                        block_max = s[c][j] > block_max ? s[c][j] : block_max;
                    }
                    const float new_max = block_max > row_max[g] ? block_max : row_max[g];
                    correction[c] = exp_nonpositive(row_max[g] - new_max);
                    row_max[g] = new_max;
                    float total = 0.0f;
#pragma omp simd reduction(+ : total)
                    for (int j = 0; j < SLICE; j++) {
                        s[c][j] = j < n ? exp_nonpositive(s[c][j] - new_max) : 0.0f;
                        total += s[c][j];
                    }
                    row_sum[g] = row_sum[g] * correction[c] + total;
                }
                slice_values(acc + g0 * head_size, krows, (const float(*)[SLICE])s, correction,
                             n, head_size);
            }
            start = end;
        }
        for (int g = 0; g < group; g++) {
            float *ag = acc + g * head_size;
            const float inv = row_sum[g] > 0.0f ? 1.0f / row_sum[g] : 0.0f;
            for (int i = 0; i < head_size; i++) ag[i] *= inv;
            store_row(out, ((int64_t)r * num_heads + kvh * group + g) * head_size, dtype,
                      head_size, ag);
        }
    }
    return 0;
}
