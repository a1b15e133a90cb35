/*
 * bf16 GEMM for the CPU platform's unquantized linears: y = x W^T (+ b), on CPUs with
 * AVX512-BF16 (vdpbf16ps: two bf16 products summed into a float32 lane).
 *
 * Why C: at decode batch sizes a linear streams its weight once per step and does
 * little arithmetic; oneDNN's packed GEMM costs ~15 us of fixed overhead per call (33
 * calls per step in an 8-layer model) and reads the weights at ~25 GB/s, this kernel
 * ~2 us and ~40 GB/s (part of a small model stays in L3). At prefill sizes it reaches
 * the same ~430 GFLOP/s as oneDNN on 2 Zen 4 cores (measured at M = 64 to 2048).
 *
 * Packed weight layout (pack_bf16_vnni), for W [N, K] with N % 16 == 0 and K even:
 * output columns are cut into panels of 64 (the last one 16, 32 or 48 wide); panel p
 * holds, for each pair of input features k = 2i, 2i+1, its columns' two weights side by
 * side: panel[i][col][2]. One 64-byte load then feeds 16 columns' dot products with the
 * pair (x[2i], x[2i+1]) broadcast to every lane, and one panel is one sequential stream
 * of memory. The packed tensor has W's own element count (N x K), at offset 64 p K.
 *
 * A register block computes R rows of x (R <= 6) against one panel (J = 1..4 vectors
 * of 16 columns): R x J float32 accumulators, J weight loads and R broadcasts per pair
 * of k. Work items are (panel, chunk of 48 rows): a thread keeps its panel in L2 while
 * it walks the chunk. Accumulation is float32; the output is rounded to bf16 once
 * (nearest even), after the bias add -- what oneDNN's bf16 GEMM does, up to the order
 * of the float32 sums.
 *
 * Built by engine/plugins/cpu/native.py with -march=native; on CPUs without
 * AVX512-BF16 the entry points report themselves unavailable (gemm_bf16_available).
 */
#include <stdint.h>
#include <string.h>

#define PANEL 64      /* output columns per packed panel */
#define ROWS_MAX 6    /* rows of x per register block */
#define ROWS_CHUNK 48 /* rows of x per parallel work item */
#define PREFETCH_PAIRS 8 /* how many pairs of k ahead the panel is prefetched */

static inline int64_t panel_width(int64_t p, int64_t n) {
    const int64_t left = n - p * PANEL;
    return left < PANEL ? left : PANEL;
}

/* W [N, K] row-major -> the panel layout above. 0, or -1 for shapes it does not take. */
int pack_bf16_vnni(const uint16_t *w, int64_t n, int64_t k, uint16_t *packed)
{
    if (n <= 0 || k <= 0 || n % 16 || k % 2)
        return -1;
    const int64_t panels = (n + PANEL - 1) / PANEL, pairs = k / 2;
#pragma omp parallel for
    for (int64_t p = 0; p < panels; p++) {
        const int64_t width = panel_width(p, n);
        uint16_t *dst = packed + p * PANEL * k;
        for (int64_t i = 0; i < pairs; i++)
            for (int64_t c = 0; c < width; c++) {
                const uint16_t *src = w + (p * PANEL + c) * k + 2 * i;
                dst[(i * width + c) * 2] = src[0];
                dst[(i * width + c) * 2 + 1] = src[1];
            }
    }
    return 0;
}

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>

int gemm_bf16_available(void) { return 1; }

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

/* rows [0, R) of x times one panel of J x 16 columns (starting at column col) */
static inline __attribute__((always_inline)) void register_block(
    const int R, const int J, const uint16_t *x, int64_t ldx, const uint16_t *panel,
    int64_t pairs, const uint16_t *bias, int64_t col, uint16_t *out, int64_t ldo)
{
    __m512 acc[ROWS_MAX][4];
    for (int j = 0; j < J; j++) {
        const __m512 b = bias_lanes(bias, col + 16 * j);
        for (int r = 0; r < R; r++)
            acc[r][j] = b;
    }
    const int64_t stride = 32 * J; /* elements per pair of k: J x 16 columns x 2 */
    for (int64_t i = 0; i < pairs; i++) {
        const uint16_t *w = panel + i * stride;
        __m512bh wv[4];
        for (int j = 0; j < J; j++) {
            _mm_prefetch((const char *)(w + PREFETCH_PAIRS * stride + 32 * j), _MM_HINT_T0);
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

#define BLOCK_FOR_WIDTH(R)                                                                \
    switch (width) {                                                                      \
    case 64: register_block(R, 4, x, ldx, panel, pairs, bias, col, out, ldo); break;      \
    case 48: register_block(R, 3, x, ldx, panel, pairs, bias, col, out, ldo); break;      \
    case 32: register_block(R, 2, x, ldx, panel, pairs, bias, col, out, ldo); break;      \
    default: register_block(R, 1, x, ldx, panel, pairs, bias, col, out, ldo); break;      \
    }

static void rows_times_panel(int rows, int64_t width, const uint16_t *x, int64_t ldx,
                             const uint16_t *panel, int64_t pairs, const uint16_t *bias,
                             int64_t col, uint16_t *out, int64_t ldo)
{
    switch (rows) {
    case 1: BLOCK_FOR_WIDTH(1); break;
    case 2: BLOCK_FOR_WIDTH(2); break;
    case 3: BLOCK_FOR_WIDTH(3); break;
    case 4: BLOCK_FOR_WIDTH(4); break;
    case 5: BLOCK_FOR_WIDTH(5); break;
    default: BLOCK_FOR_WIDTH(6); break;
    }
}

/*
 * out [M, N] (row stride ldo) = x [M, K] (row stride ldx) times the packed W, plus bias
 * [N] when not NULL. 0, or -1 for shapes the packing does not take.
 */
int gemm_bf16_vnni(const uint16_t *x, int64_t ldx, const uint16_t *packed,
                   const uint16_t *bias, uint16_t *out, int64_t ldo, int64_t m, int64_t n,
                   int64_t k)
{
    if (m < 0 || n <= 0 || k <= 0 || n % 16 || k % 2 || ldx < k || ldo < n)
        return -1;
    const int64_t panels = (n + PANEL - 1) / PANEL, pairs = k / 2;
    const int64_t chunks = (m + ROWS_CHUNK - 1) / ROWS_CHUNK;
#pragma omp parallel for collapse(2) schedule(static) if (panels * chunks > 1)
    for (int64_t p = 0; p < panels; p++)
        for (int64_t c = 0; c < chunks; c++) {
            const uint16_t *panel = packed + p * PANEL * k;
            const int64_t width = panel_width(p, n), col = p * PANEL;
            const int64_t end = (c + 1) * ROWS_CHUNK < m ? (c + 1) * ROWS_CHUNK : m;
            for (int64_t row = c * ROWS_CHUNK; row < end; row += ROWS_MAX) {
                const int rows = end - row < ROWS_MAX ? (int)(end - row) : ROWS_MAX;
                rows_times_panel(rows, width, x + row * ldx, ldx, panel, pairs, bias, col,
                                 out + row * ldo, ldo);
            }
        }
    return 0;
}

#else /* no AVX512-BF16 on the build machine: the platform keeps oneDNN */

int gemm_bf16_available(void) { return 0; }

int gemm_bf16_vnni(const uint16_t *x, int64_t ldx, const uint16_t *packed,
                   const uint16_t *bias, uint16_t *out, int64_t ldo, int64_t m, int64_t n,
                   int64_t k)
{
    (void)x, (void)ldx, (void)packed, (void)bias, (void)out, (void)ldo, (void)m, (void)n,
        (void)k;
    return -1;
}

#endif
