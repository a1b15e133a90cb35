/*
 * The native bf16 GEMM paths, for levels with AVX512-BF16 (vdpbf16ps: two bf16 products
 * summed into a float32 lane), included by gemm.c. They take calls whose activations
 * and weights are both bf16; gemm.c's float32 paths take everything else.
 *
 * Why their own layout: at decode batch sizes a linear streams its weight once per step
 * and does little arithmetic; oneDNN's packed GEMM costs ~15 us of fixed overhead per
 * call (33 calls per step in an 8-layer model) and reads the weights at ~25 GB/s, this
 * kernel ~2 us and ~40 GB/s (part of a small model stays in L3). At prefill sizes it
 * reaches the same ~430 GFLOP/s as oneDNN on 2 Zen 4 cores (measured at M = 64 to 2048).
 *
 * Packed layout (pack_bf16_pairs), for W [N, K] with N % 16 == 0 and K even: output
 * columns are cut into panels of 64 (the last one 16, 32 or 48 wide); panel p holds, for
 * each pair of input features k = 2i, 2i+1, its columns' two weights side by side:
 * panel[i][col][2]. One 64-byte load then feeds 16 columns' dot products with the pair
 * (x[2i], x[2i+1]) broadcast to every lane, and one panel is one sequential stream of
 * memory. The packed tensor has W's own element count (N x K), at offset 64 p K. This is
 * also the AMX B-tile layout (oneDNN's AB16b64a2b).
 *
 * A register block computes R rows of x (R <= 6) against one panel (J = 1..4 vectors of
 * 16 columns): R x J float32 accumulators, J weight loads and R broadcasts per pair of
 * k. Work items are (panel, chunk of 48 rows): a thread keeps its panel in L2 while it
 * walks the chunk. Accumulation is float32; the output is rounded to bf16 once (nearest
 * even), after the bias add -- what oneDNN's bf16 GEMM does, up to the order of the
 * float32 sums.
 *
 * gemv_bf16_rows serves a weight that must keep its plain [N, K] layout (an LM head
 * sharing the embedding matrix): each thread streams whole rows, 4 at a time, against
 * groups of up to BF16_GEMV_ROWS rows of x.
 */
#ifndef ENGINE_CPU_GEMM_BF16_H
#define ENGINE_CPU_GEMM_BF16_H

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
#define HAVE_BF16_DOT 1
#else
#define HAVE_BF16_DOT 0
#endif

/* Whether gemm_pack / gemm_packed use the pair layout for these dtypes and k. */
static inline int native_bf16_layout(int64_t k, int wdt, int adt) {
    return HAVE_BF16_DOT && wdt == DTYPE_BF16 && adt == DTYPE_BF16 && k % 2 == 0;
}

#if HAVE_BF16_DOT
#include <immintrin.h>

#define BF16_PANEL 64      /* output columns per packed panel */
#define BF16_ROWS 6    /* rows of x per register block */
#define BF16_CHUNK 48 /* rows of x per parallel work item */
#define BF16_PREFETCH_PAIRS 8 /* how many pairs of k ahead the panel is prefetched */
#define BF16_GEMV_ROWS 4  /* rows of x gemv_bf16_rows takes */
#define BF16_GEMV_W_ROWS 4    /* weight rows per register block */
#define BF16_GEMV_TASK_ROWS 64 /* weight rows per parallel work item */

static inline int64_t bf16_panel_width(int64_t p, int64_t n) {
    const int64_t left = n - p * BF16_PANEL;
    return left < BF16_PANEL ? left : BF16_PANEL;
}

/* W [N, K] row-major -> the panel layout above. 0, or -1 for shapes it does not take. */
static int pack_bf16_pairs(const uint16_t *w, int64_t n, int64_t k, uint16_t *packed)
{
    if (n <= 0 || k <= 0 || n % 16 || k % 2)
        return -1;
    const int64_t panels = (n + BF16_PANEL - 1) / BF16_PANEL, pairs = k / 2;
#pragma omp parallel for
    for (int64_t p = 0; p < panels; p++) {
        const int64_t width = bf16_panel_width(p, n);
        uint16_t *dst = packed + p * BF16_PANEL * k;
        for (int64_t i = 0; i < pairs; i++)
            for (int64_t c = 0; c < width; c++) {
                const uint16_t *src = w + (p * BF16_PANEL + c) * k + 2 * i;
                dst[(i * width + c) * 2] = src[0];
                dst[(i * width + c) * 2 + 1] = src[1];
            }
    }
    return 0;
}



static inline __m512 bias_lanes(const uint16_t *bias, int64_t col)
{
    if (bias == NULL)
        return _mm512_setzero_ps();
    const __m256i b = _mm256_loadu_si256((const __m256i *)(bias + col));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

static inline uint32_t pair_at(const uint16_t *row, int64_t i)
{
    uint32_t pair;
    memcpy(&pair, row + 2 * i, sizeof pair);
    return pair;
}

/* rows [0, R) of x times one panel of J x 16 columns (starting at column col);
 * streamed: the panel is read only this once (see gemm_bf16_pairs) */
static inline __attribute__((always_inline)) void bf16_register_block(
    const int R, const int J, const uint16_t *x, int64_t ldx, const uint16_t *panel,
    int64_t pairs, const uint16_t *bias, int64_t col, uint16_t *out, int64_t ldo,
    int streamed)
{
    __m512 acc[BF16_ROWS][4];
    /* unrolled, so the accumulators start in registers: as loops, GCC turned the zero
     * start of a bias-free block into a memset of a stack copy (1.5-3% of a step) */
#pragma GCC unroll 4
    for (int j = 0; j < J; j++) {
        const __m512 b = bias_lanes(bias, col + 16 * j);
#pragma GCC unroll 6
        for (int r = 0; r < R; r++)
            acc[r][j] = b;
    }
    const int64_t stride = 32 * J; /* elements per pair of k: J x 16 columns x 2 */
    for (int64_t i = 0; i < pairs; i++) {
        const uint16_t *w = panel + i * stride;
        __m512bh wv[4];
        for (int j = 0; j < J; j++) {
            const char *ahead = (const char *)(w + BF16_PREFETCH_PAIRS * stride + 32 * j);
            if (streamed)
                stream_prefetch(ahead);
            else
                _mm_prefetch(ahead, _MM_HINT_T0);
            wv[j] = (__m512bh)_mm512_loadu_si512(w + 32 * j);
        }
        for (int r = 0; r < R; r++) {
            const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)pair_at(x + r * ldx, i));
            for (int j = 0; j < J; j++)
                acc[r][j] = _mm512_dpbf16_ps(acc[r][j], wv[j], xv);
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < J; j++)
            _mm256_storeu_si256((__m256i *)(out + r * ldo + col + 16 * j),
                                (__m256i)_mm512_cvtneps_pbh(acc[r][j]));
}

#define BF16_BLOCK_FOR_WIDTH(R)                                                                \
    switch (width) {                                                                      \
    case 64: bf16_register_block(R, 4, x, ldx, panel, pairs, bias, col, out, ldo, streamed); break; \
    case 48: bf16_register_block(R, 3, x, ldx, panel, pairs, bias, col, out, ldo, streamed); break; \
    case 32: bf16_register_block(R, 2, x, ldx, panel, pairs, bias, col, out, ldo, streamed); break; \
    default: bf16_register_block(R, 1, x, ldx, panel, pairs, bias, col, out, ldo, streamed); break; \
    }

static void bf16_rows_times_panel(int rows, int64_t width, const uint16_t *x, int64_t ldx,
                             const uint16_t *panel, int64_t pairs, const uint16_t *bias,
                             int64_t col, uint16_t *out, int64_t ldo, int streamed)
{
    switch (rows) {
    case 1: BF16_BLOCK_FOR_WIDTH(1); break;
    case 2: BF16_BLOCK_FOR_WIDTH(2); break;
    case 3: BF16_BLOCK_FOR_WIDTH(3); break;
    case 4: BF16_BLOCK_FOR_WIDTH(4); break;
    case 5: BF16_BLOCK_FOR_WIDTH(5); break;
    default: BF16_BLOCK_FOR_WIDTH(6); break;
    }
}

/*
 * out [M, N] (row stride ldo) = x [M, K] (row stride ldx) times the packed W, plus bias
 * [N] when not NULL. 0, or -1 for shapes the packing does not take.
 *
 * With M <= BF16_ROWS one register block covers every row, so each panel is read exactly
 * once: it is prefetched as a once-read stream (stream_prefetch, cpu_math.h: the mode
 * timed fastest on this machine; with the non-temporal hint, a decode step's sweep over
 * weights larger than the caches does not evict what the rest of the step reuses).
 * Larger M re-read each panel from L2 per block of rows and keep it there.
 */
static int gemm_bf16_vector(const uint16_t *x, int64_t ldx, const uint16_t *packed,
                            const uint16_t *bias, uint16_t *out, int64_t ldo, int64_t m,
                            int64_t n, int64_t k)
{
    if (m < 0 || n <= 0 || k <= 0 || n % 16 || k % 2 || ldx < k || ldo < n)
        return -1;
    const int64_t panels = (n + BF16_PANEL - 1) / BF16_PANEL, pairs = k / 2;
    const int64_t chunks = (m + BF16_CHUNK - 1) / BF16_CHUNK;
    const int streamed = m <= BF16_ROWS;
#pragma omp parallel for collapse(2) schedule(static) if (panels * chunks > 1)
    for (int64_t p = 0; p < panels; p++)
        for (int64_t c = 0; c < chunks; c++) {
            const uint16_t *panel = packed + p * BF16_PANEL * k;
            const int64_t width = bf16_panel_width(p, n), col = p * BF16_PANEL;
            const int64_t end = (c + 1) * BF16_CHUNK < m ? (c + 1) * BF16_CHUNK : m;
            for (int64_t row = c * BF16_CHUNK; row < end; row += BF16_ROWS) {
                const int rows = end - row < BF16_ROWS ? (int)(end - row) : BF16_ROWS;
                bf16_rows_times_panel(rows, width, x + row * ldx, ldx, panel, pairs, bias, col,
                                 out + row * ldo, ldo, streamed);
            }
        }
    return 0;
}

/* out[r][n0 + w] = x[r] . W[n0 + w] (+ bias) for R rows of x and W rows n0 .. n0 + 3 */
static inline __attribute__((always_inline)) void bf16_plain_rows_block(
    const int R, const int WR, const uint16_t *x, int64_t ldx, const uint16_t *w, int64_t ldw,
    const uint16_t *bias, uint16_t *out, int64_t ldo, int64_t n0, int64_t k)
{
    __m512 acc[BF16_GEMV_ROWS][BF16_GEMV_W_ROWS];
    for (int r = 0; r < R; r++)
        for (int v = 0; v < WR; v++)
            acc[r][v] = _mm512_setzero_ps();
    /* row after row: the block's rows are adjacent in memory, so this reads one
       sequential stream (interleaving them would make four streams of one short row) */
    for (int v = 0; v < WR; v++) {
        __m512 odd[BF16_GEMV_ROWS]; /* a second chain per row: half the add latency */
        for (int r = 0; r < R; r++)
            odd[r] = _mm512_setzero_ps();
        int64_t i = 0;
        for (; i + 64 <= k; i += 64) {
            const uint16_t *row = w + (n0 + v) * ldw + i;
            if (R == 1) /* streamed once: fetch ahead, past the caches */
                stream_prefetch((const char *)row + 1024);
            const __m512bh w0 = (__m512bh)_mm512_loadu_si512(row);
            const __m512bh w1 = (__m512bh)_mm512_loadu_si512(row + 32);
            for (int r = 0; r < R; r++) {
                const uint16_t *xr = x + r * ldx + i;
                acc[r][v] = _mm512_dpbf16_ps(acc[r][v], w0, (__m512bh)_mm512_loadu_si512(xr));
                odd[r] = _mm512_dpbf16_ps(odd[r], w1, (__m512bh)_mm512_loadu_si512(xr + 32));
            }
        }
        for (; i < k; i += 32) {
            const __mmask32 lanes = k - i >= 32 ? 0xffffffffu : (__mmask32)((1ull << (k - i)) - 1);
            const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(lanes, w + (n0 + v) * ldw + i);
            for (int r = 0; r < R; r++) {
                const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(lanes, x + r * ldx + i);
                acc[r][v] = _mm512_dpbf16_ps(acc[r][v], wv, xv);
            }
        }
        for (int r = 0; r < R; r++)
            acc[r][v] = _mm512_add_ps(acc[r][v], odd[r]);
    }
    for (int r = 0; r < R; r++)
        for (int v = 0; v < WR; v++) {
            float sum = _mm512_reduce_add_ps(acc[r][v]);
            if (bias != NULL)
                sum += bf16_to_f32(bias[n0 + v]);
            out[r * ldo + n0 + v] = f32_to_bf16(sum);
        }
}

#define BF16_PLAIN_FOR_ROWS(WR)                                                                    \
    switch (m) {                                                                              \
    case 1: bf16_plain_rows_block(1, WR, x, ldx, w, ldw, bias, out, ldo, n, k); break;             \
    case 2: bf16_plain_rows_block(2, WR, x, ldx, w, ldw, bias, out, ldo, n, k); break;             \
    case 3: bf16_plain_rows_block(3, WR, x, ldx, w, ldw, bias, out, ldo, n, k); break;             \
    default: bf16_plain_rows_block(4, WR, x, ldx, w, ldw, bias, out, ldo, n, k); break;            \
    }

/*
 * out [M, N] = x [M, K] times a plain row-major W [N, K] (row stride ldw), plus bias
 * [N] when not NULL, for M <= BF16_GEMV_ROWS. 0, or -1 for sizes it does not take.
 */
#if defined(ENGINE_AMX)
#include "gemm_amx.h"
#endif

/* Whether this library's AMX tiles are usable in this process (decided once). */
static inline int amx_usable(void) {
#if defined(ENGINE_AMX)
    return amx_ready();
#else
    return 0;
#endif
}

/* The pair-layout GEMM: AMX tiles where they cover the shape and the process may use
 * them, vdpbf16ps register blocks otherwise. */
static int gemm_bf16_pairs(const uint16_t *x, int64_t ldx, const uint16_t *packed,
                           const uint16_t *bias, uint16_t *out, int64_t ldo, int64_t m,
                           int64_t n, int64_t k)
{
#if defined(ENGINE_AMX)
    if (m >= 0 && n > 0 && n % 16 == 0 && ldx >= k && ldo >= n && amx_covers(m, k) && amx_ready())
        return gemm_amx(x, ldx, packed, bias, out, ldo, m, n, k);
#endif
    return gemm_bf16_vector(x, ldx, packed, bias, out, ldo, m, n, k);
}

/* BF16_GEMV_ROWS (or fewer: m) rows of x against wr (<= BF16_GEMV_W_ROWS) weight rows. */
static void bf16_plain_group(int64_t m, int64_t wr, const uint16_t *x, int64_t ldx,
                             const uint16_t *w, int64_t ldw, const uint16_t *bias,
                             uint16_t *out, int64_t ldo, int64_t n, int64_t k)
{
    switch (wr) {
    case 1: BF16_PLAIN_FOR_ROWS(1); break;
    case 2: BF16_PLAIN_FOR_ROWS(2); break;
    case 3: BF16_PLAIN_FOR_ROWS(3); break;
    default: BF16_PLAIN_FOR_ROWS(4); break;
    }
}

/*
 * out [M, N] = x [M, K] times a plain row-major W [N, K] (row stride ldw), plus bias
 * [N] when not NULL. Work items are BF16_GEMV_TASK_ROWS weight rows; every group of
 * BF16_GEMV_ROWS rows of x passes over them while they stay in L2. 0, or -1 for sizes
 * it does not take.
 */
static int gemv_bf16_rows(const uint16_t *x, int64_t ldx, const uint16_t *w, int64_t ldw,
                          const uint16_t *bias, uint16_t *out, int64_t ldo, int64_t m,
                          int64_t n_total, int64_t k)
{
    if (m < 1 || n_total <= 0 || k <= 0 || ldx < k || ldw < k || ldo < n_total)
        return -1;
    const int64_t tasks = (n_total + BF16_GEMV_TASK_ROWS - 1) / BF16_GEMV_TASK_ROWS;
#pragma omp parallel for schedule(static) if (tasks > 1)
    for (int64_t task = 0; task < tasks; task++) {
        const int64_t start = task * BF16_GEMV_TASK_ROWS;
        const int64_t end = start + BF16_GEMV_TASK_ROWS < n_total ? start + BF16_GEMV_TASK_ROWS
                                                                  : n_total;
        for (int64_t m0 = 0; m0 < m; m0 += BF16_GEMV_ROWS) {
            const int64_t rows = m - m0 < BF16_GEMV_ROWS ? m - m0 : BF16_GEMV_ROWS;
            for (int64_t n = start; n < end; n += BF16_GEMV_W_ROWS)
                bf16_plain_group(rows, end - n < BF16_GEMV_W_ROWS ? end - n : BF16_GEMV_W_ROWS,
                                 x + m0 * ldx, ldx, w, ldw, bias, out + m0 * ldo, ldo, n, k);
        }
    }
    return 0;
}

/* Whether gemm_plain hands these rows to gemv_bf16_rows. */
static inline int native_bf16_plain(int64_t m, int wdt, int adt) {
    (void)m;
    return wdt == DTYPE_BF16 && adt == DTYPE_BF16;
}

#else /* no native bf16 products: gemm.c's float32 paths take every call */

static inline int amx_usable(void) { return 0; }

static inline int native_bf16_plain(int64_t m, int wdt, int adt) {
    (void)m, (void)wdt, (void)adt;
    return 0;
}

static int pack_bf16_pairs(const uint16_t *w, int64_t n, int64_t k, uint16_t *packed) {
    (void)w, (void)n, (void)k, (void)packed;
    return -1;
}

static int gemm_bf16_pairs(const uint16_t *x, int64_t ldx, const uint16_t *packed,
                           const uint16_t *bias, uint16_t *out, int64_t ldo, int64_t m,
                           int64_t n, int64_t k) {
    (void)x, (void)ldx, (void)packed, (void)bias, (void)out, (void)ldo, (void)m, (void)n, (void)k;
    return -1;
}

static int gemv_bf16_rows(const uint16_t *x, int64_t ldx, const uint16_t *w, int64_t ldw,
                          const uint16_t *bias, uint16_t *out, int64_t ldo, int64_t m,
                          int64_t n_total, int64_t k) {
    (void)x, (void)ldx, (void)w, (void)ldw, (void)bias, (void)out, (void)ldo, (void)m,
        (void)n_total, (void)k;
    return -1;
}

#endif /* HAVE_BF16_DOT */
#endif /* ENGINE_CPU_GEMM_BF16_H */
