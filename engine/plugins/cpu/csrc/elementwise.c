/*
 * Fused elementwise kernels of the decoder layers, for the CPU platform.
 *
 * Why C: at decode batch sizes each of these is a handful of torch ops on a few
 * kilobytes, and the ops' dispatch costs more than their arithmetic (RMSNorm with its
 * residual add: ~25 us as torch ops, ~3 us here, 17 times per step in an 8-layer
 * model). Each kernel rounds to the storage dtype exactly where the torch op chain it
 * replaces returns a tensor (HF's arithmetic order), so results match to the float32
 * rounding of a sum; contraction into FMAs is off in this file for the same reason.
 *
 * Rows may be strided (slices of a fused projection's output); the last dimension is
 * contiguous. Built together with paged_decode_attention.c by native.py.
 */
#pragma GCC optimize("fp-contract=off")

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_math.h"
#include "kernels.h"

/* Below this many values a kernel runs on one thread (a decode step's few rows). Above
 * it the pool is still spinning from the GEMM that just ran, so a parallel region costs
 * ~2 us: a 64-row RMSNorm of 512 went from 29 to 18 us, +4-7% tokens/s at 64 requests. */
#define PARALLEL_MIN_VALUES (1 << 14)

/*
 * RMSNorm with an optional residual add, HF's order:
 *   residual[t] = round(x[t] + residual[t])            (only when residual != NULL)
 *   h = residual[t] or x[t];  out[t] = round(w * round(h / sqrt(mean(h^2) + eps)))
 * The residual is updated in place; out is contiguous [rows, hidden].
 */
static inline __attribute__((always_inline)) void rms_norm_row(
    const void *x, int64_t x_stride, int64_t heads, void *residual, int64_t res_stride,
    const void *weight, void *out, int64_t t, int64_t hidden, float eps, const int dtype)
{
    {
        const int64_t x_row = (t / heads) * x_stride + (t % heads) * hidden;
        float sum_sq = 0.0f;
        if (residual != NULL) {
#pragma omp simd reduction(+ : sum_sq)
            for (int64_t i = 0; i < hidden; i++) {
                const float h = round_to(dtype, load_at(x, x_row + i, dtype) +
                                                    load_at(residual, t * res_stride + i, dtype));
                store_at(residual, t * res_stride + i, dtype, h);
                sum_sq += h * h;
            }
        } else {
#pragma omp simd reduction(+ : sum_sq)
            for (int64_t i = 0; i < hidden; i++) {
                const float h = load_at(x, x_row + i, dtype);
                sum_sq += h * h;
            }
        }
        const void *src = residual != NULL ? residual : x;
        const int64_t src_row = residual != NULL ? t * res_stride : x_row;
        const float inv = 1.0f / sqrtf(sum_sq / (float)hidden + eps);
#pragma omp simd
        for (int64_t i = 0; i < hidden; i++) {
            const float normed = round_to(dtype, load_at(src, src_row + i, dtype) * inv);
            store_at(out, t * hidden + i, dtype, load_at(weight, i, dtype) * normed);
        }
    }
}

/* out[t, i] = round(round(silu(x[t, i])) * x[t, inter + i]): gate then up halves. */
static inline __attribute__((always_inline)) void silu_and_mul_row(
    const void *x, int64_t x_stride, void *out, int64_t t, int64_t inter, const int dtype)
{
    {
#pragma omp simd
        for (int64_t i = 0; i < inter; i++) {
            const float gate = load_at(x, t * x_stride + i, dtype);
            const float up = load_at(x, t * x_stride + inter + i, dtype);
            /* sigmoid from exp(-|gate|) <= 1: no overflow, and the exponential vectorizes */
            const float e = exp_nonpositive(gate > 0.0f ? -gate : gate);
            const float r = 1.0f / (1.0f + e); /* one division for both signs */
            const float sigmoid = gate > 0.0f ? r : e * r;
            store_at(out, t * inter + i, dtype, round_to(dtype, gate * sigmoid) * up);
        }
    }
}

/*
 * Rotary embedding, rotate-half ("neox") style, in place on `heads` heads per row:
 *   x1, x2 = halves of each head;  x1' = round(x1 c) - round(x2 s);  x2' = round(x2 c) + round(x1 s)
 * with c, s = cos_sin[positions[t]] (cos half then sin half, in the storage dtype).
 */
static inline __attribute__((always_inline)) void rotary_row(
    void *x, int64_t x_stride, const int64_t *positions, const void *cos_sin, int64_t t,
    int64_t heads, int64_t head_size, const int dtype)
{
    const int64_t half = head_size / 2;
    {
        const int64_t cs = positions[t] * head_size;
        for (int64_t h = 0; h < heads; h++) {
            const int64_t base = t * x_stride + h * head_size;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float c = load_at(cos_sin, cs + i, dtype);
                const float s = load_at(cos_sin, cs + half + i, dtype);
                const float x1 = load_at(x, base + i, dtype);
                const float x2 = load_at(x, base + half + i, dtype);
                store_at(x, base + i, dtype, round_to(dtype, x1 * c) - round_to(dtype, x2 * s));
                store_at(x, base + half + i, dtype,
                         round_to(dtype, x2 * c) + round_to(dtype, x1 * s));
            }
        }
    }
}

/* residual[t] = round(x[t] + residual[t]): a residual add where no norm follows (an
 * EAGLE head's fc halves, its output), the rounding rms_norm_row's add has. */
static inline __attribute__((always_inline)) void residual_add_row(
    const void *x, int64_t x_stride, void *residual, int64_t res_stride, int64_t t,
    int64_t hidden, const int dtype)
{
#pragma omp simd
    for (int64_t i = 0; i < hidden; i++) {
        const float h = load_at(x, t * x_stride + i, dtype) +
                        load_at(residual, t * res_stride + i, dtype);
        store_at(residual, t * res_stride + i, dtype, round_to(dtype, h));
    }
}

/* The parallel row loop, one copy per dtype: the dtype must be a literal inside the
 * OpenMP region (regions are outlined before inlining) for the row loops to vectorize. */
#define DISPATCH(ROW_CALL)                                                                   \
    switch (dtype) {                                                                         \
    case DTYPE_F32:                                                                          \
        _Pragma("omp parallel for if (rows * cols >= PARALLEL_MIN_VALUES)")                          \
        for (int64_t t = 0; t < rows; t++) ROW_CALL(DTYPE_F32);                              \
        return 0;                                                                            \
    case DTYPE_BF16:                                                                         \
        _Pragma("omp parallel for if (rows * cols >= PARALLEL_MIN_VALUES)")                          \
        for (int64_t t = 0; t < rows; t++) ROW_CALL(DTYPE_BF16);                             \
        return 0;                                                                            \
    case DTYPE_F16:                                                                          \
        _Pragma("omp parallel for if (rows * cols >= PARALLEL_MIN_VALUES)")                          \
        for (int64_t t = 0; t < rows; t++) ROW_CALL(DTYPE_F16);                              \
        return 0;                                                                            \
    default:                                                                                 \
        return -1;                                                                           \
    }

/* heads > 1: x holds rows of `heads` contiguous runs of `hidden` values (the heads of a
 * token, tokens x_stride apart): row t is head t % heads of token t / heads (per-head
 * q/k norms on a slice of a fused projection). Only without a residual. */
int rms_norm(const void *x, int64_t x_stride, int64_t heads, void *residual,
             int64_t res_stride, const void *weight, void *out, int64_t rows, int64_t hidden,
             float eps, int dtype)
{
    if (heads < 1 || (heads > 1 && residual != NULL)) return -1;
    const int64_t cols = hidden;
#define ROW(D) \
    rms_norm_row(x, x_stride, heads, residual, res_stride, weight, out, t, hidden, eps, D)
    DISPATCH(ROW)
#undef ROW
}

int residual_add(const void *x, int64_t x_stride, void *residual, int64_t res_stride,
                 int64_t rows, int64_t hidden, int dtype)
{
    const int64_t cols = hidden;
#define ROW(D) residual_add_row(x, x_stride, residual, res_stride, t, hidden, D)
    DISPATCH(ROW)
#undef ROW
}

int silu_and_mul(const void *x, int64_t x_stride, void *out, int64_t rows, int64_t inter,
                 int dtype)
{
    const int64_t cols = 8 * inter; /* the exponential makes each value ~8 times the work */
#define ROW(D) silu_and_mul_row(x, x_stride, out, t, inter, D)
    DISPATCH(ROW)
#undef ROW
}

/* Positions outside [0, max_positions) (the table's rows) refuse the call: -2. */
int rotary_neox(void *x, int64_t x_stride, const int64_t *positions, const void *cos_sin,
                int64_t rows, int64_t heads, int64_t head_size, int64_t max_positions,
                int dtype)
{
    if (head_size % 2 != 0) return -1;
    for (int64_t t = 0; t < rows; t++)
        if (positions[t] < 0 || positions[t] >= max_positions) return -2;
    const int64_t cols = heads * head_size;
#define ROW(D) rotary_row(x, x_stride, positions, cos_sin, t, heads, head_size, D)
    DISPATCH(ROW)
#undef ROW
}

/*
 * out[t] = index of the first maximum of row t (the first NaN when the row has one),
 * as torch.argmax. Two passes over a row already in cache: the maximum with plain
 * vector compares, then the first index holding it.
 */
int argmax_rows(const float *x, int64_t x_stride, int64_t rows, int64_t cols, int64_t *out)
{
    if (cols <= 0) return -1;
#pragma omp parallel for if (rows >= 8)
    for (int64_t t = 0; t < rows; t++) {
        const float *row = x + t * x_stride;
        float best = row[0];
        int has_nan = 0;
#pragma omp simd reduction(max : best) reduction(| : has_nan)
        for (int64_t i = 0; i < cols; i++) {
            best = row[i] > best ? row[i] : best;
            has_nan |= row[i] != row[i];
        }
        int64_t index = 0;
        for (int64_t i = 0; i < cols; i++) {
            if (has_nan ? row[i] != row[i] : row[i] == best) {
                index = i;
                break;
            }
        }
        out[t] = index;
    }
    return 0;
}

/*
 * out[t] = the index drawn from row t of probs (non-negative, any scale) by inverse CDF with
 * the uniform u[t] in [0, 1): the first index whose running sum exceeds u[t] x (the row's
 * sum). The sampler's random draw: one uniform per row instead of torch's exponential race,
 * whose per-entry random numbers cost ~22 ns each on the CPU. One pass sums the row in
 * blocks of CAT_BLOCK entries (float64, vectorised), the block holding the target is found
 * in the blocks' running sums and the entry within it by a running sum from that block's
 * start. An entry of probability 0 is never drawn (a running sum that does not grow cannot
 * be the first to pass the target); if the two sums round apart so that the target lies
 * beyond the block's running sum, the block's last entry of positive probability is drawn.
 * A row with no positive entry draws 0. Blocks past CAT_MAX_BLOCKS: -1.
 */
#define CAT_BLOCK 256
#define CAT_MAX_BLOCKS 8192 /* vocabularies up to 2M entries */
int categorical_rows(const float *probs, int64_t stride, int64_t rows, int64_t cols,
                     const double *u, int64_t *out)
{
    if (cols <= 0) return -1;
    const int64_t blocks = (cols + CAT_BLOCK - 1) / CAT_BLOCK;
    if (blocks > CAT_MAX_BLOCKS) return -1;
#pragma omp parallel for if (rows >= 8)
    for (int64_t t = 0; t < rows; t++) {
        const float *row = probs + t * stride;
        double sums[CAT_MAX_BLOCKS];
        double total = 0.0;
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t end = b == blocks - 1 ? cols : (b + 1) * CAT_BLOCK;
            double sum = 0.0;
#pragma omp simd reduction(+ : sum)
            for (int64_t i = b * CAT_BLOCK; i < end; i++) sum += (double)row[i];
            sums[b] = sum;
            total += sum;
        }
        int64_t index = 0;
        if (total > 0.0) {
            double target = u[t] * total;
            if (target >= total) target = nextafter(total, 0.0);
            double before = 0.0;
            int64_t b = 0;
            while (b < blocks - 1 && before + sums[b] <= target) before += sums[b++];
            const int64_t start = b * CAT_BLOCK;
            const int64_t end = b == blocks - 1 ? cols : start + CAT_BLOCK;
            double running = before;
            int64_t last_positive = -1;
            index = -1;
            for (int64_t i = start; i < end; i++) {
                if (row[i] > 0.0f) last_positive = i;
                running += (double)row[i];
                if (running > target && row[i] > 0.0f) {
                    index = i;
                    break;
                }
            }
            if (index < 0) {
                if (last_positive < 0) /* rounding put the target past a block of zeros */
                    for (int64_t i = cols - 1; i >= 0 && last_positive < 0; i--)
                        if (row[i] > 0.0f) last_positive = i;
                index = last_positive;
            }
        }
        out[t] = index;
    }
    return 0;
}

/*
 * out[t] = table[ids[t]] for rows of `hidden` values (the embedding lookup), widened or
 * rounded from the table's dtype to out_dtype (a plain copy when they match). An id
 * outside [0, vocab) refuses the call (-2) before anything is copied.
 */
/* Rows of a vocabulary shard (tensor parallelism): out[t] = table[ids[t] - row_start] for
 * the ids this rank holds (row_start <= id < row_start + table_rows), zeros for the other
 * ids of the vocabulary (another rank's rows: the all-reduce after it adds them). An id
 * outside [0, vocab) is an error (-2), on every rank alike. */
int embedding_shard_rows(const int64_t *ids, int64_t num_ids, const void *table,
                         int64_t row_start, int64_t table_rows, int64_t vocab, int64_t hidden,
                         int table_dtype, void *out, int out_dtype)
{
    if (hidden <= 0 || row_start < 0 || table_rows < 0 || table_dtype < DTYPE_F32
        || table_dtype > DTYPE_F16 || out_dtype < DTYPE_F32 || out_dtype > DTYPE_F16)
        return -1;
    for (int64_t t = 0; t < num_ids; t++)
        if (ids[t] < 0 || ids[t] >= vocab) return -2;
    const int64_t in_row = hidden * dtype_size(table_dtype);
    const int64_t out_row = hidden * dtype_size(out_dtype);
#pragma omp parallel for if (num_ids * out_row >= (1 << 20))
    for (int64_t t = 0; t < num_ids; t++) {
        const int64_t row = ids[t] - row_start;
        char *dst = (char *)out + t * out_row;
        if (row < 0 || row >= table_rows) {
            memset(dst, 0, (size_t)out_row);
        } else if (table_dtype == out_dtype) {
            memcpy(dst, (const char *)table + row * in_row, (size_t)out_row);
        } else {
            for (int64_t i = 0; i < hidden; i++)
                store_at(out, t * hidden + i, out_dtype,
                         load_at(table, row * hidden + i, table_dtype));
        }
    }
    return 0;
}

int embedding_rows(const int64_t *ids, int64_t num_ids, const void *table, int64_t vocab,
                   int64_t hidden, int table_dtype, void *out, int out_dtype)
{
    return embedding_shard_rows(ids, num_ids, table, 0, vocab, vocab, hidden, table_dtype, out,
                                out_dtype);
}
