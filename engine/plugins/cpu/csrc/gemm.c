/*
 * Dense GEMM for the CPU platform's unquantized linears: out = x W^T (+ bias), on every
 * ISA level, for weights stored in float32, bf16 or fp16.
 *
 * Arithmetic: float32 multiply-adds. bf16 / fp16 weights stay in their storage dtype in
 * memory (half the bytes that a decode step streams) and are widened inside the kernel;
 * activations in bf16 / fp16 are widened once per call; the output is rounded to the
 * activation dtype once, after the bias add. Where the level multiplies bf16 natively
 * (AVX512-BF16: vdpbf16ps; AMX tiles) and both operands are bf16, gemm_bf16.h takes the
 * call instead, on its own packed layout.
 *
 * Packed layout (gemm_pack), for W [N, K] with N % 16 == 0: output columns are cut into
 * panels of PANEL (= GEMM_VECS vectors; the last panel may be narrower, a multiple of
 * 16 wide); panel p holds its columns' weights k after k: panel[k][col], in the weight
 * dtype, at offset PANEL p K. One k's weights are then one or a few vector loads, and a
 * panel is one sequential stream. The packed tensor has W's own element count.
 *
 * Register block: R <= GEMM_ROWS rows of x against the J <= GEMM_VECS vectors of one
 * panel, R x J float32 accumulators; per k, J weight loads and R broadcasts of x.
 *
 * Two schedules:
 * - M <= GEMM_ROWS (decode): one register block covers every row, so each panel is
 *   read exactly once, widened on the fly and prefetched as a once-read stream
 *   (stream_prefetch, in the mode timed fastest on the machine). Work items are panels.
 *   With one or two rows a second set of accumulators takes the odd k, so enough
 *   multiply-adds are in flight to stream at memory speed.
 * - larger M (prefill): work items are (panel, chunk of GEMM_CHUNK rows). K is cut into
 *   blocks of GEMM_KC; a block of the panel is widened to float32 once into a buffer
 *   that stays in L1 while every register block of the chunk's rows runs over it, and
 *   the partial sums wait in a float32 tile of the chunk between K blocks.
 *
 * gemm_plain serves a weight that must keep its plain [N, K] layout (an LM head shared
 * with the embedding): dot products of x rows with weight rows, a task of GEMM_TASK_ROWS
 * weight rows at a time, so those rows stay in cache while every row of x passes; from
 * PLAIN_PACK_ROWS rows of x, where the dot products' lane reductions would dominate, each
 * task transposes its rows into a panel and runs the prefill schedule instead.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_math.h"
#include "kernels.h"
#include "simd.h"

#if VREGS >= 32
#define GEMM_ROWS 6
#define GEMM_VECS 4 /* 24 accumulators, 4 weight vectors, 1 broadcast */
#elif VF >= 8
#define GEMM_ROWS 6
#define GEMM_VECS 2 /* 12 + 2 + 1 of 16 registers */
#else
#define GEMM_ROWS 4
#define GEMM_VECS 2 /* 8 + 2 + 1 of 16 */
#endif
#define PANEL (GEMM_VECS * VF)
#define GEMM_CHUNK 96 /* rows of x per prefill work item */
#define GEMM_KC (4096 / PANEL) /* k per widened block: 16 KB of float32 weights */
#define PREFETCH_AHEAD 1024 /* bytes ahead of the streamed panel */
#define GEMM_TASK_ROWS 64 /* weight rows per gemm_plain work item */
#define PLAIN_XR 6 /* rows of x per gemm_plain register block: verification rows of up to
                     * 5 drafts read a tied LM head once (6 x PLAIN_WR sums fit) */
#define PLAIN_WR (VREGS >= 32 ? 4 : 2) /* weight rows per gemm_plain register block */
#define PLAIN_PACK_ROWS 24 /* rows of x from which gemm_plain packs panels on the fly */

#include "gemm_bf16.h" /* the native bf16 paths (uses PANEL-independent layouts) */

/* 1 when this library multiplies bf16 on AMX tiles in this process (runtime.c reports
 * it; the tiles' permission and self-check run once, here). */
int gemm_amx_ready(void) { return amx_usable(); }

/* From how many rows of x the bf16 GEMM takes the AMX tiles (below: vdpbf16ps): the
 * crossover kernel_tuning.py measures on the machine. Returns the previous count, or -1
 * (nothing changed) for a count below 1 or a library without tiles. */
int gemm_set_amx_min_rows(int rows)
{
#if defined(ENGINE_AMX)
    if (rows < 1)
        return -1;
    const int previous = amx_min_rows;
    amx_min_rows = rows;
    return previous;
#else
    (void)rows;
    return -1;
#endif
}

static inline int64_t panel_width(int64_t p, int64_t n) {
    const int64_t left = n - p * PANEL;
    return left < PANEL ? left : PANEL;
}

/* acc[r][2p], acc[r][2p + 1] (columns 0 .. 2VF of a pair of vectors) <-> the same sums
 * with the pair's even columns in the first vector, its odd columns in the second */
static inline __attribute__((always_inline)) void split_columns(vf *first, vf *second)
{
    float a[2 * VF], e[VF], o[VF];
    vf_store(a, *first);
    vf_store(a + VF, *second);
    for (int i = 0; i < VF; i++) {
        e[i] = a[2 * i];
        o[i] = a[2 * i + 1];
    }
    *first = vf_load(e);
    *second = vf_load(o);
}

static inline __attribute__((always_inline)) void merge_columns(vf *even, vf *odd)
{
    float a[2 * VF], e[VF], o[VF];
    vf_store(e, *even);
    vf_store(o, *odd);
    for (int i = 0; i < VF; i++) {
        a[2 * i] = e[i];
        a[2 * i + 1] = o[i];
    }
    *even = vf_load(a);
    *odd = vf_load(a + VF);
}

/* SSE2 has no broadcast from memory (each value took a movss and a shufps): with one row
 * and four chains, x[k .. k + 3] is one load and a pshufd each */
#if defined(__SSE2__) && !defined(__AVX__) && VF == 4
#define BROADCAST_BY_SHUFFLE 1
#else
#define BROADCAST_BY_SHUFFLE 0
#endif

/* One k of a bf16 panel (row: its weights) into sums, each pair of vectors in even / odd
 * column order: x[r * ldx] for row r of x, or *x1 (already in every lane) for one row. */
static inline __attribute__((always_inline)) void bf16_split_k(
    const int R, const int J, const float *x, int64_t ldx, const vf *x1, const uint16_t *row,
    vf sum[][GEMM_VECS])
{
    const vu high = (vu){0} + 0xffff0000u;
#pragma GCC unroll 2
    for (int j = 0; j < J; j += 2) {
        vu u;
        memcpy(&u, row + j * VF, sizeof u);
        const vf even = vf_from_bits(u << 16), odd = vf_from_bits(u & high);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            if (x1 != NULL) {
                sum[r][j] += *x1 * even;
                sum[r][j + 1] += *x1 * odd;
            } else { /* a scalar times a vector: a broadcast from memory on AVX */
                const float xv = x[r * ldx];
                sum[r][j] += xv * even;
                sum[r][j + 1] += xv * odd;
            }
        }
    }
}

/*
 * The chains of bf16_split_panel: CH chains over k (k mod CH), each pair of vectors of
 * columns in even / odd order. acc is chain 0; the others start at zero and are added to
 * it at the end.
 */
static inline __attribute__((always_inline)) void bf16_split_chains(
    const int R, const int J, const int CH, const float *x, int64_t ldx, const uint16_t *w,
    int64_t wk, int64_t kc, vf acc[][GEMM_VECS])
{
    vf extra[3][GEMM_ROWS][GEMM_VECS]; /* chains 1 .. CH - 1 */
#pragma GCC unroll 3
    for (int c = 0; c < CH - 1; c++)
#pragma GCC unroll 8
        for (int r = 0; r < R; r++)
#pragma GCC unroll 4
            for (int j = 0; j < J; j++)
                extra[c][r][j] = vf_splat(0.0f);
    int64_t k = 0;
    for (; k + CH <= kc; k += CH) {
        const uint16_t *wk0 = w + k * wk;
        if (CH * wk >= 32 || ((k * wk) & 31) == 0) /* once per 64-byte line */
#pragma GCC unroll 4
            for (int64_t off = 0; off < CH * wk * 2; off += 64)
                stream_prefetch((const char *)wk0 + PREFETCH_AHEAD + off);
#if BROADCAST_BY_SHUFFLE
        vf xs[4];
        if (R == 1 && CH == 4) {
            const __m128i four = _mm_castps_si128(_mm_loadu_ps(x + k));
            xs[0] = (vf)_mm_shuffle_epi32(four, 0x00);
            xs[1] = (vf)_mm_shuffle_epi32(four, 0x55);
            xs[2] = (vf)_mm_shuffle_epi32(four, 0xaa);
            xs[3] = (vf)_mm_shuffle_epi32(four, 0xff);
        }
#endif
#pragma GCC unroll 4
        for (int c = 0; c < CH; c++) {
            vf(*sum)[GEMM_VECS] = c == 0 ? acc : extra[c > 0 ? c - 1 : 0];
#if BROADCAST_BY_SHUFFLE
            if (R == 1 && CH == 4) {
                bf16_split_k(1, J, NULL, 0, &xs[c], wk0 + c * wk, sum);
                continue;
            }
#endif
            bf16_split_k(R, J, x + k + c, ldx, NULL, wk0 + c * wk, sum);
        }
    }
    for (; k < kc; k++) /* what the chains leave, on the first */
        bf16_split_k(R, J, x + k, ldx, NULL, w + k * wk, acc);
    /* chain 0 + chain 1 as the generic dual loop adds its two; with four, (0 + 2) + (1 + 3) */
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int j = 0; j < J; j++) {
            if (CH == 4)
                acc[r][j] = (acc[r][j] + extra[1][r][j]) + (extra[0][r][j] + extra[2][r][j]);
            else if (CH == 2)
                acc[r][j] += extra[0][r][j];
        }
}

/*
 * The decode loop of a bf16 panel whose width is a whole number of vector pairs. One
 * load takes 2VF weights of a k as VF 32-bit lanes; shifted up 16 bits they are the
 * even columns as float32, masked to their top half the odd columns: a shift and an
 * AND, where widening each vector took a zero-extending load (a shuffle-port op on x86;
 * on SSE2 an interleave and a register copy) and a shift. The accumulators hold each
 * pair's columns in that even / odd order: permuted in and back out once per block.
 * Chains over k: 4 with one row, 2 with two (`dual`), else 1 -- latency, not the
 * ports, bounds fewer; the batch-invariant mode (no `dual`) adds each column in the
 * generic loop's order, so its bits do not change.
 */
static inline __attribute__((always_inline)) void bf16_split_panel(
    const int R, const int J, const float *x, int64_t ldx, const uint16_t *w, int64_t wk,
    int64_t kc, const int dual, vf acc[][GEMM_VECS])
{
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int j = 0; j < J; j += 2)
            split_columns(&acc[r][j], &acc[r][j + 1]);
    if (!dual)
        bf16_split_chains(R, J, 1, x, ldx, w, wk, kc, acc);
    else
        bf16_split_chains(R, J, R == 1 ? 4 : 2, x, ldx, w, wk, kc, acc);
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int j = 0; j < J; j += 2)
            merge_columns(&acc[r][j], &acc[r][j + 1]);
}

/*
 * One register block: acc = (first ? bias : tile) + x[0..R) . w over kc values of k;
 * then (last ? out rounded to odt : tile). w: the panel from its first k, wk elements
 * (the panel's width) between consecutive k. x: float32 rows, ldx apart.
 */
static inline __attribute__((always_inline)) void gemm_block(
    const int R, const int J, const float *x, int64_t ldx, const void *w, int64_t wk,
    const int wdt, int64_t kc, const int streamed, float *tile, int64_t ldt, int first,
    int last, const void *bias, int64_t col, void *out, int64_t ldo, const int odt)
{
    vf acc[GEMM_ROWS][GEMM_VECS], odd[GEMM_ROWS][GEMM_VECS];
    /* latency, not bandwidth, would bound one chain (one order for any rows when invariant) */
    const int dual = streamed && R <= 2 && !batch_invariant_mode;
#pragma GCC unroll 4
    for (int j = 0; j < J; j++) {
        const vf b = first && bias != NULL ? vf_load_as(bias, col + j * VF, odt) : vf_splat(0.0f);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            acc[r][j] = first ? b : vf_load(tile + r * ldt + j * VF);
            odd[r][j] = vf_splat(0.0f);
        }
    }
    const char *wbytes = (const char *)w;
    const int64_t wsize = dtype_size(wdt), row_bytes = wk * wsize;
    int64_t k = 0;
    if (streamed && wdt == DTYPE_BF16 && J % 2 == 0) {
        bf16_split_panel(R, J, x, ldx, (const uint16_t *)w, wk, kc, dual, acc);
        k = kc;
    }
    if (dual) {
        for (; k + 2 <= kc; k += 2) {
            const char *w0 = wbytes + k * row_bytes;
#pragma GCC unroll 4
            for (int64_t off = 0; off < 2 * J * VF * wsize; off += 64)
                stream_prefetch(w0 + PREFETCH_AHEAD + off);
            vf wa[GEMM_VECS], wb[GEMM_VECS];
#pragma GCC unroll 4
            for (int j = 0; j < J; j++) {
                wa[j] = vf_load_as(w, k * wk + j * VF, wdt);
                wb[j] = vf_load_as(w, (k + 1) * wk + j * VF, wdt);
            }
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) {
                const float x0 = x[r * ldx + k], x1 = x[r * ldx + k + 1];
#pragma GCC unroll 4
                for (int j = 0; j < J; j++) {
                    acc[r][j] += x0 * wa[j];
                    odd[r][j] += x1 * wb[j];
                }
            }
        }
    }
    for (; k < kc; k++) {
        if (streamed) {
            const char *w0 = wbytes + k * row_bytes;
#pragma GCC unroll 4
            for (int64_t off = 0; off < J * VF * wsize; off += 64)
                stream_prefetch(w0 + PREFETCH_AHEAD + off);
        }
        vf wv[GEMM_VECS];
#pragma GCC unroll 4
        for (int j = 0; j < J; j++)
            wv[j] = vf_load_as(w, k * wk + j * VF, wdt);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const float xv = x[r * ldx + k];
#pragma GCC unroll 4
            for (int j = 0; j < J; j++)
                acc[r][j] += xv * wv[j];
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int j = 0; j < J; j++) {
            const vf sum = dual ? acc[r][j] + odd[r][j] : acc[r][j];
            if (last)
                vf_store_as(out, r * ldo + col + j * VF, odt, sum);
            else
                vf_store(tile + r * ldt + j * VF, sum);
        }
}

/* gemm_block with R, J and the dtype as constants: one specialised copy per triple. J is
 * GEMM_VECS (a full panel) or 1 (a narrower last panel, one vector column at a time). */
#define BLOCK_FOR_ROWS(J, WDT, STREAMED)                                                   \
    switch (rows) {                                                                        \
    case 1: gemm_block(1, J, BLOCK_ARGS(WDT, STREAMED)); break;                            \
    case 2: gemm_block(2, J, BLOCK_ARGS(WDT, STREAMED)); break;                            \
    case 3: gemm_block(3, J, BLOCK_ARGS(WDT, STREAMED)); break;                            \
    case 4: gemm_block(4, J, BLOCK_ARGS(WDT, STREAMED)); break;                            \
    case 5: gemm_block(5 <= GEMM_ROWS ? 5 : 1, J, BLOCK_ARGS(WDT, STREAMED)); break;       \
    default: gemm_block(GEMM_ROWS, J, BLOCK_ARGS(WDT, STREAMED)); break;                   \
    }
#define BLOCK_ARGS(WDT, STREAMED) \
    x, ldx, w, wk, WDT, kc, STREAMED, tile, ldt, first, last, bias, col, out, ldo, odt

/* One panel (width = wk columns from column col) against `rows` rows of x: a full panel
 * in one register block, a narrower one vector column after vector column. */
#define PANEL_BLOCKS(WDT, STREAMED)                                                        \
    do {                                                                                   \
        if (width == PANEL) {                                                              \
            BLOCK_FOR_ROWS(GEMM_VECS, WDT, STREAMED);                                      \
        } else {                                                                           \
            const void *panel = w;                                                         \
            for (int64_t c = 0; c < width; c += VF) {                                      \
                const void *w = (const char *)panel + c * dtype_size(WDT);                 \
                const int64_t col = col0 + c;                                              \
                float *tile = tile0 == NULL ? NULL : tile0 + c;                            \
                BLOCK_FOR_ROWS(1, WDT, STREAMED);                                          \
            }                                                                              \
        }                                                                                  \
    } while (0)

/* The decode schedule's block for one weight dtype: every row of x against one panel
 * streamed from memory. One function per dtype: inlined into a single function, GCC's
 * register allocation kept an accumulator of the SSE2 build's bf16 loop on the stack (a
 * store-forwarding chain per k: a third of the loop's possible speed). */
#define STREAMED_PANEL_FOR(NAME, WDT)                                                      \
    static __attribute__((noinline)) void NAME(int rows, const float *x, int64_t ldx,      \
                                               const void *w, int64_t width, int64_t kc,   \
                                               const void *bias, int64_t col0, void *out,  \
                                               int64_t ldo, int odt)                       \
    {                                                                                      \
        const int64_t wk = width;                                                          \
        float *const tile0 = NULL, *const tile = NULL;                                     \
        const int64_t ldt = 0;                                                             \
        const int first = 1, last = 1;                                                     \
        const int64_t col = col0;                                                          \
        PANEL_BLOCKS(WDT, 1);                                                              \
    }
STREAMED_PANEL_FOR(streamed_panel_bf16, DTYPE_BF16)
STREAMED_PANEL_FOR(streamed_panel_f16, DTYPE_F16)
STREAMED_PANEL_FOR(streamed_panel_f32, DTYPE_F32)

/* The decode schedule's block: every row of x against one panel streamed from memory,
 * in its storage dtype. */
static void streamed_panel(int rows, const float *x, int64_t ldx, const void *w, int64_t width,
                           int wdt, int64_t kc, const void *bias, int64_t col0, void *out,
                           int64_t ldo, int odt)
{
    switch (wdt) {
    case DTYPE_BF16: streamed_panel_bf16(rows, x, ldx, w, width, kc, bias, col0, out, ldo, odt); break;
    case DTYPE_F16: streamed_panel_f16(rows, x, ldx, w, width, kc, bias, col0, out, ldo, odt); break;
    default: streamed_panel_f32(rows, x, ldx, w, width, kc, bias, col0, out, ldo, odt); break;
    }
}

/* The prefill schedule's block: `rows` rows of x against a float32 block of kc k's of one
 * panel, partial sums in tile0 (PANEL floats per row) between K blocks. */
static void prefill_panel(int rows, const float *x, int64_t ldx, const float *w,
                          int64_t width, int64_t kc, float *tile0, int first, int last,
                          const void *bias, int64_t col0, void *out, int64_t ldo, int odt)
{
    const int64_t wk = width, ldt = PANEL, col = col0;
    float *tile = tile0;
    PANEL_BLOCKS(DTYPE_F32, 0);
}

/* x [m, k] of dtype adt as float32 rows (k apart), or x itself when already float32;
 * *owned is the buffer to free. NULL when memory is short. */
static const float *float_rows(const void *x, int64_t ldx, int64_t m, int64_t k, int adt,
                               int64_t *ld, float **owned)
{
    *owned = NULL;
    if (adt == DTYPE_F32) {
        *ld = ldx;
        return (const float *)x;
    }
    float *rows = malloc(sizeof(float) * (size_t)(m * k > 0 ? m * k : 1));
    if (rows == NULL) return NULL;
#pragma omp parallel for if (m * k >= (1 << 16))
    for (int64_t r = 0; r < m; r++)
        for (int64_t i = 0; i < k; i++)
            rows[r * k + i] = load_at(x, r * ldx + i, adt);
    *owned = rows;
    *ld = k;
    return rows;
}

static int valid_dtypes(int adt, int wdt) {
    const int a = adt == DTYPE_F32 || adt == DTYPE_BF16 || adt == DTYPE_F16;
    const int w = wdt == DTYPE_F32 || wdt == DTYPE_BF16 || wdt == DTYPE_F16;
    return a && w;
}

int gemm_pack(const void *w, int64_t n, int64_t k, int wdt, int adt, void *packed)
{
    if (n <= 0 || k <= 0 || n % 16 || !valid_dtypes(adt, wdt))
        return -1;
    if (native_bf16_layout(k, wdt, adt))
        return pack_bf16_pairs((const uint16_t *)w, n, k, (uint16_t *)packed);
    const int64_t size = dtype_size(wdt), panels = (n + PANEL - 1) / PANEL;
#pragma omp parallel for
    for (int64_t p = 0; p < panels; p++) {
        const int64_t width = panel_width(p, n);
        char *dst = (char *)packed + p * PANEL * k * size;
        for (int64_t i = 0; i < k; i++)
            for (int64_t c = 0; c < width; c++)
                memcpy(dst + (i * width + c) * size,
                       (const char *)w + ((p * PANEL + c) * k + i) * size, (size_t)size);
    }
    return 0;
}

/* The prefill schedule's work item: chunk rows [row0, row_end) against panel p. */
static void prefill_item(const float *x, int64_t ldx, const char *panel, int64_t width,
                         int64_t col, int wdt, int64_t k, int64_t row0, int64_t row_end,
                         const void *bias, void *out, int64_t ldo, int odt)
{
    float widened[GEMM_KC * PANEL] __attribute__((aligned(64)));
    float tile[GEMM_CHUNK * PANEL] __attribute__((aligned(64)));
    const int64_t size = dtype_size(wdt);
    for (int64_t k0 = 0; k0 < k; k0 += GEMM_KC) {
        const int64_t kc = k - k0 < GEMM_KC ? k - k0 : GEMM_KC;
        const void *block = panel + k0 * width * size;
        if (wdt != DTYPE_F32) { /* widened once, read by every register block of the chunk */
            for (int64_t i = 0; i < kc * width; i += VF)
                vf_store(widened + i, vf_load_as(block, i, wdt));
            block = widened;
        }
        const int first = k0 == 0, last = k0 + kc == k;
        for (int64_t row = row0; row < row_end; row += GEMM_ROWS) {
            const int rows = row_end - row < GEMM_ROWS ? (int)(row_end - row) : GEMM_ROWS;
            prefill_panel(rows, x + row * ldx + k0, ldx, (const float *)block, width, kc,
                          tile + (row - row0) * PANEL, first, last, bias, col,
                          (char *)out + row * ldo * dtype_size(odt), ldo, odt);
        }
    }
}

int gemm_packed(const void *x, int64_t ldx, const void *packed, const void *bias, void *out,
                int64_t ldo, int64_t m, int64_t n, int64_t k, int adt, int wdt)
{
    if (m < 0 || n <= 0 || k <= 0 || n % 16 || ldx < k || ldo < n || !valid_dtypes(adt, wdt))
        return -1;
    if (m == 0)
        return 0;
    if (native_bf16_layout(k, wdt, adt))
        return gemm_bf16_pairs((const uint16_t *)x, ldx, (const uint16_t *)packed,
                               (const uint16_t *)bias, (uint16_t *)out, ldo, m, n, k);
    int64_t ld;
    float *owned;
    const float *rows = float_rows(x, ldx, m, k, adt, &ld, &owned);
    if (rows == NULL)
        return -3;
    const int64_t panels = (n + PANEL - 1) / PANEL, size = dtype_size(wdt);
    const int odt = adt;
    if (m <= GEMM_ROWS) {
#pragma omp parallel for schedule(static) if (panels > 1)
        for (int64_t p = 0; p < panels; p++) {
            streamed_panel((int)m, rows, ld, (const char *)packed + p * PANEL * k * size,
                           panel_width(p, n), wdt, k, bias, p * PANEL, out, ldo, odt);
        }
    } else {
        const int64_t chunks = (m + GEMM_CHUNK - 1) / GEMM_CHUNK;
#pragma omp parallel for collapse(2) schedule(static) if (panels * chunks > 1)
        for (int64_t p = 0; p < panels; p++)
            for (int64_t c = 0; c < chunks; c++) {
                const int64_t end = (c + 1) * GEMM_CHUNK < m ? (c + 1) * GEMM_CHUNK : m;
                prefill_item(rows, ld, (const char *)packed + p * PANEL * k * size,
                             panel_width(p, n), p * PANEL, wdt, k, c * GEMM_CHUNK, end, bias,
                             out, ldo, odt);
            }
    }
    free(owned);
    return 0;
}

/* out[r][n0 + v] = x[r] . W[n0 + v] (+ bias) for R rows of float32 x and WR weight rows */
static inline __attribute__((always_inline)) void plain_block(
    const int R, const int WR, const float *x, int64_t ldx, const void *w, int64_t ldw,
    const int wdt, const void *bias, void *out, int64_t ldo, const int odt, int64_t n0,
    int64_t k)
{
    vf acc[PLAIN_XR][PLAIN_WR], odd[PLAIN_WR];
    /* one x row: a second chain per weight row halves the latency */
    const int dual = R == 1 && !batch_invariant_mode;
    for (int v = 0; v < WR; v++) {
        odd[v] = vf_splat(0.0f);
        for (int r = 0; r < R; r++)
            acc[r][v] = vf_splat(0.0f);
    }
    int64_t i = 0;
    if (dual) /* one row of x: the weight rows stream from memory, prefetched ahead */
        for (; i + 2 * VF <= k; i += 2 * VF) {
            const vf x0 = vf_load(x + i), x1 = vf_load(x + i + VF);
            for (int v = 0; v < WR; v++) {
                const int64_t at = (n0 + v) * ldw + i;
                stream_prefetch((const char *)w + at * dtype_size(wdt) + PREFETCH_AHEAD);
                acc[0][v] += x0 * vf_load_as(w, at, wdt);
                odd[v] += x1 * vf_load_as(w, at + VF, wdt);
            }
        }
    for (; i + VF <= k; i += VF) {
        vf wv[PLAIN_WR];
        for (int v = 0; v < WR; v++) {
            const int64_t at = (n0 + v) * ldw + i;
            /* several rows of x (verification rows, a tied LM head): the rows of the
             * block four blocks on are fetched at this block's pace; short rows never
             * let the hardware prefetchers ramp up (M = 4 on a 384-wide bf16 table ran
             * at half the packed kernel's speed without it); once per cache line */
            if (R > 1 && ((i * dtype_size(wdt)) & 63) == 0)
                stream_prefetch((const char *)w + (at + 4 * WR * ldw) * dtype_size(wdt));
            wv[v] = vf_load_as(w, at, wdt);
        }
        for (int r = 0; r < R; r++) {
            const vf xv = vf_load(x + r * ldx + i);
            for (int v = 0; v < WR; v++)
                acc[r][v] += xv * wv[v];
        }
    }
    for (int r = 0; r < R; r++)
        for (int v = 0; v < WR; v++) {
            float sum = vf_sum(r == 0 ? acc[0][v] + odd[v] : acc[r][v]);
            for (int64_t t = i; t < k; t++)
                sum += x[r * ldx + t] * load_at(w, (n0 + v) * ldw + t, wdt);
            if (bias != NULL)
                sum += load_at(bias, n0 + v, odt);
            store_at(out, r * ldo + n0 + v, odt, sum);
        }
}

#define PLAIN_FOR_XROWS(WR, WDT)                                                           \
    switch (xrows) {                                                                       \
    case 1: plain_block(1, WR, xr, ld, w, ldw, WDT, bias, o, ldo, odt, n, k); break;       \
    case 2: plain_block(2, WR, xr, ld, w, ldw, WDT, bias, o, ldo, odt, n, k); break;       \
    case 3: plain_block(3, WR, xr, ld, w, ldw, WDT, bias, o, ldo, odt, n, k); break;       \
    case 4: plain_block(4, WR, xr, ld, w, ldw, WDT, bias, o, ldo, odt, n, k); break;       \
    case 5: plain_block(5, WR, xr, ld, w, ldw, WDT, bias, o, ldo, odt, n, k); break;       \
    default: plain_block(PLAIN_XR, WR, xr, ld, w, ldw, WDT, bias, o, ldo, odt, n, k); break; \
    }

/* PLAIN_WR weight rows per block; the task's last few one at a time, and every row one at
 * a time against a single row of x: one weight row is then one sequential stream, which
 * the prefetchers follow at memory speed (two interleaved rows streamed at ~2/3 of it) */
#define PLAIN_FOR_WROWS(WDT)                                                               \
    do {                                                                                   \
        if (wrows == PLAIN_WR && xrows > 1) {                                              \
            PLAIN_FOR_XROWS(PLAIN_WR, WDT);                                                \
        } else {                                                                           \
            for (int64_t n = n0; n < n0 + wrows; n++) PLAIN_FOR_XROWS(1, WDT);             \
        }                                                                                  \
    } while (0)

/*
 * gemm_plain for many rows of x: each work item transposes PANEL rows of the plain
 * weight into the packed panel layout (a per-thread buffer in the weight dtype) and runs
 * the prefill schedule over every row of x, so the transposition is paid once per M rows
 * instead of dot products reducing lanes for every (x row, weight row) pair.
 */
static int plain_by_panels(const float *x, int64_t ldx, const void *w, int64_t ldw, int wdt,
                           const void *bias, void *out, int64_t ldo, int odt, int64_t m,
                           int64_t n, int64_t k)
{
    const int64_t panels = (n + PANEL - 1) / PANEL, size = dtype_size(wdt);
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        char *panel = malloc((size_t)(size * PANEL * k));
        failed = panel == NULL;
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            if (panel == NULL)
                continue;
            const int64_t width = panel_width(p, n), col = p * PANEL;
            if (size == 2) /* k outer: each destination row is written in order */
                for (int64_t i = 0; i < k; i++)
                    for (int64_t c = 0; c < width; c++)
                        ((uint16_t *)panel)[i * width + c] =
                            ((const uint16_t *)w)[(col + c) * ldw + i];
            else
                for (int64_t i = 0; i < k; i++)
                    for (int64_t c = 0; c < width; c++)
                        ((float *)panel)[i * width + c] = ((const float *)w)[(col + c) * ldw + i];
            for (int64_t row = 0; row < m; row += GEMM_CHUNK) {
                const int64_t end = row + GEMM_CHUNK < m ? row + GEMM_CHUNK : m;
                prefill_item(x, ldx, panel, width, col, wdt, k, row, end, bias, out, ldo, odt);
            }
        }
        free(panel);
    }
    return failed ? -3 : 0;
}

int gemm_plain(const void *x, int64_t ldx, const void *w, int64_t ldw, const void *bias,
               void *out, int64_t ldo, int64_t m, int64_t n_total, int64_t k, int adt, int wdt)
{
    if (m < 0 || n_total <= 0 || k <= 0 || ldx < k || ldw < k || ldo < n_total ||
        !valid_dtypes(adt, wdt))
        return -1;
    if (m == 0)
        return 0;
    if (native_bf16_plain(m, wdt, adt))
        return gemv_bf16_rows((const uint16_t *)x, ldx, (const uint16_t *)w, ldw,
                              (const uint16_t *)bias, (uint16_t *)out, ldo, m, n_total, k);
    const int many_rows = m >= PLAIN_PACK_ROWS && n_total % 16 == 0 && !batch_invariant_mode;
    int64_t ld;
    float *owned;
    const float *rows = float_rows(x, ldx, m, k, adt, &ld, &owned);
    if (rows == NULL)
        return -3;
    const int odt = adt;
    if (many_rows) {
        const int status = plain_by_panels(rows, ld, w, ldw, wdt, bias, out, ldo, odt, m,
                                           n_total, k);
        free(owned);
        return status;
    }
    const int64_t osize = dtype_size(odt);
    const int64_t tasks = (n_total + GEMM_TASK_ROWS - 1) / GEMM_TASK_ROWS;
#pragma omp parallel for schedule(static) if (tasks > 1)
    for (int64_t task = 0; task < tasks; task++) {
        const int64_t start = task * GEMM_TASK_ROWS;
        const int64_t end = start + GEMM_TASK_ROWS < n_total ? start + GEMM_TASK_ROWS : n_total;
        for (int64_t r0 = 0; r0 < m; r0 += PLAIN_XR) {
            const int xrows = m - r0 < PLAIN_XR ? (int)(m - r0) : PLAIN_XR;
            const float *xr = rows + r0 * ld;
            void *o = (char *)out + r0 * ldo * osize;
            for (int64_t n0 = start; n0 < end; n0 += PLAIN_WR) {
                const int wrows = end - n0 < PLAIN_WR ? (int)(end - n0) : PLAIN_WR;
                const int64_t n = n0;
                switch (wdt) {
                case DTYPE_BF16: PLAIN_FOR_WROWS(DTYPE_BF16); break;
                case DTYPE_F16: PLAIN_FOR_WROWS(DTYPE_F16); break;
                default: PLAIN_FOR_WROWS(DTYPE_F32); break;
                }
            }
        }
    }
    free(owned);
    return 0;
}

#include "gemm_quant.h" /* quantized weights, on the register blocks above */
