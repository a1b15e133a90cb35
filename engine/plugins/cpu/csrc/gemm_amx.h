/*
 * AMX tiles for the bf16 x bf16 GEMM at prefill sizes (the amx level: Sapphire Rapids
 * and later), included by gemm_bf16.h. The packed weight is gemm_bf16.h's pair layout,
 * which is already AMX's B-tile layout: for 16 output columns, row i of a B tile is the
 * 16 columns' weight pairs (k = 2i, 2i + 1), 64 bytes, and consecutive pairs of a panel
 * are width * 4 bytes apart. A tiles are 16 rows x 32 k of x, read in place.
 *
 * A work item is 32 rows of x against 32 columns of one panel: four float32 C tiles
 * (2 row blocks x 2 column blocks), two A and two B tiles, four tdpbf16ps per 32 k.
 * A row block shorter than 32 is copied into a zero-padded buffer first; a panel whose
 * width is an odd number of 16-column blocks runs its last block alone. The C tiles are
 * stored to float32 scratch, the bias added, and each value rounded to bf16 once (as
 * the vdpbf16ps kernel does). Shapes the tiles do not cover (K % 32, fewer rows than
 * the crossover amx_min_rows) stay on vdpbf16ps.
 *
 * Linux hands AMX state to a process only on request (arch_prctl ARCH_REQ_XCOMP_PERM);
 * amx_ready() asks once, then checks the tile path against the vdpbf16ps one on a small
 * GEMM, and the library falls back to vdpbf16ps for good (kernel_features() then reports
 * no AMX) if either fails, so a refusing kernel or a miscompiled path never computes.
 *
 * ENGINE_AMX_EMULATE (tests only) replaces the tile instructions with plain C of the
 * same semantics, so the blocking and tail handling are checked on CPUs without AMX.
 */
#ifndef ENGINE_CPU_GEMM_AMX_H
#define ENGINE_CPU_GEMM_AMX_H

#include <stdlib.h>

#define AMX_MIN_ROWS 32 /* rows of x from which the tiles take a GEMM, until measured */
/* The crossover in force: AMX_MIN_ROWS, or what native.py measured on this machine
 * (kernel_tuning.py) and set through gemm_set_amx_min_rows (gemm.c). */
static int amx_min_rows = AMX_MIN_ROWS;
#define AMX_ROWS 32     /* rows of x per work item: two A tiles */
#define AMX_COLS 32     /* columns per work item: two B tiles */
#define AMX_K 32        /* k per tile step: 16 pairs, 64 bytes of a row */

typedef struct {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_tile_config;

#if defined(ENGINE_AMX_EMULATE)
/* The tile registers of this thread and the semantics of the instructions used here. */
static __thread struct {
    amx_tile_config config;
    uint8_t tiles[8][16][64];
} amx_state;

static inline void amx_load_config(const amx_tile_config *config) { amx_state.config = *config; }
static inline void amx_release(void) { memset(&amx_state, 0, sizeof amx_state); }
static inline void amx_load(int t, const void *base, int64_t stride) {
    for (int r = 0; r < amx_state.config.rows[t]; r++)
        memcpy(amx_state.tiles[t][r], (const char *)base + r * stride, amx_state.config.colsb[t]);
}
static inline void amx_store(int t, void *base, int64_t stride) {
    for (int r = 0; r < amx_state.config.rows[t]; r++)
        memcpy((char *)base + r * stride, amx_state.tiles[t][r], amx_state.config.colsb[t]);
}
static inline void amx_zero(int t) { memset(amx_state.tiles[t], 0, sizeof amx_state.tiles[t]); }
/* C[m][n] += sum_i A[m][2i] B[i][2n] + A[m][2i + 1] B[i][2n + 1] */
static inline void amx_dpbf16ps(int c, int a, int b) {
    const int rows = amx_state.config.rows[c], cols = amx_state.config.colsb[c] / 4;
    const int pairs = amx_state.config.colsb[a] / 4;
    for (int m = 0; m < rows; m++)
        for (int n = 0; n < cols; n++) {
            float acc;
            memcpy(&acc, &amx_state.tiles[c][m][4 * n], 4);
            for (int i = 0; i < pairs; i++) {
                uint16_t a0, a1, b0, b1;
                memcpy(&a0, &amx_state.tiles[a][m][4 * i], 2);
                memcpy(&a1, &amx_state.tiles[a][m][4 * i + 2], 2);
                memcpy(&b0, &amx_state.tiles[b][i][4 * n], 2);
                memcpy(&b1, &amx_state.tiles[b][i][4 * n + 2], 2);
                acc += bf16_to_f32(a0) * bf16_to_f32(b0) + bf16_to_f32(a1) * bf16_to_f32(b1);
            }
            memcpy(&amx_state.tiles[c][m][4 * n], &acc, 4);
        }
}
#define AMX_LOAD(t, base, stride) amx_load(t, base, stride)
#define AMX_STORE(t, base, stride) amx_store(t, base, stride)
#define AMX_ZERO(t) amx_zero(t)
#define AMX_DP(c, a, b) amx_dpbf16ps(c, a, b)
static int amx_request_permission(void) { return 1; }
#else
#include <sys/syscall.h>
#include <unistd.h>
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
static inline void amx_load_config(const amx_tile_config *config) { _tile_loadconfig(config); }
static inline void amx_release(void) { _tile_release(); }
#define AMX_LOAD(t, base, stride) _tile_loadd(t, base, stride)
#define AMX_STORE(t, base, stride) _tile_stored(t, base, stride)
#define AMX_ZERO(t) _tile_zero(t)
#define AMX_DP(c, a, b) _tile_dpbf16ps(c, a, b)
/* Linux gives a process the tile state only when it asks (kernel 5.16+). */
static int amx_request_permission(void) {
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}
#endif

/* tiles 0-3: C (row block r, column block j at 2 r + j); 4, 5: A; 6, 7: B */
static void amx_configure(void) {
    amx_tile_config config;
    memset(&config, 0, sizeof config);
    config.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        config.rows[t] = 16;
        config.colsb[t] = 64;
    }
    amx_load_config(&config);
}

/* One work item: rows [0, rows) of x (row stride ldx) against columns [col, col + cols)
 * of the panel (cols 16 or 32), every k; out rows are ldo apart. */
static void amx_item(const uint16_t *x, int64_t ldx, int rows, const uint16_t *panel,
                     int64_t width, int64_t k, int64_t col_in_panel, int cols,
                     const uint16_t *bias, int64_t col, uint16_t *out, int64_t ldo,
                     uint16_t *padded)
{
    if (rows < AMX_ROWS) { /* a short row block: zero-padded to two full A tiles */
        for (int r = 0; r < AMX_ROWS; r++) {
            if (r < rows)
                memcpy(padded + r * k, x + r * ldx, sizeof(uint16_t) * (size_t)k);
            else
                memset(padded + r * k, 0, sizeof(uint16_t) * (size_t)k);
        }
        x = padded;
        ldx = k;
    }
    const int two_cols = cols == 32;
    AMX_ZERO(0); /* tile numbers are immediates of the instructions: no loop */
    AMX_ZERO(1);
    AMX_ZERO(2);
    AMX_ZERO(3);
    const int64_t a_stride = ldx * 2, b_stride = width * 4;
    for (int64_t k0 = 0; k0 < k; k0 += AMX_K) {
        const uint16_t *b = panel + (k0 / 2 * width + col_in_panel) * 2;
        AMX_LOAD(4, x + k0, a_stride);
        AMX_LOAD(5, x + 16 * ldx + k0, a_stride);
        AMX_LOAD(6, b, b_stride);
        AMX_DP(0, 4, 6);
        AMX_DP(2, 5, 6);
        if (two_cols) {
            AMX_LOAD(7, b + 32, b_stride); /* the next 16 columns: 16 x 2 values on */
            AMX_DP(1, 4, 7);
            AMX_DP(3, 5, 7);
        }
    }
    float c[AMX_ROWS][AMX_COLS];
    AMX_STORE(0, &c[0][0], sizeof c[0]);
    AMX_STORE(2, &c[16][0], sizeof c[0]);
    if (two_cols) {
        AMX_STORE(1, &c[0][16], sizeof c[0]);
        AMX_STORE(3, &c[16][16], sizeof c[0]);
    }
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < cols; j++) {
            const float b = bias != NULL ? bf16_to_f32(bias[col + j]) : 0.0f;
            out[r * ldo + col + j] = f32_to_bf16(c[r][j] + b);
        }
}

static int amx_covers(int64_t m, int64_t k) {
    return m >= amx_min_rows && k % AMX_K == 0 && !batch_invariant_mode;
}

/* out [m, n] = x W^T (+ bias) on the pair layout, through AMX tiles; 0, or -3 when the
 * padding buffers cannot be had. */
static int gemm_amx(const uint16_t *x, int64_t ldx, const uint16_t *packed,
                    const uint16_t *bias, uint16_t *out, int64_t ldo, int64_t m, int64_t n,
                    int64_t k)
{
    const int64_t panels = (n + BF16_PANEL - 1) / BF16_PANEL;
    const int64_t col_items = BF16_PANEL / AMX_COLS, row_items = (m + AMX_ROWS - 1) / AMX_ROWS;
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        uint16_t *padded = malloc(sizeof(uint16_t) * AMX_ROWS * (size_t)k);
        failed = padded == NULL;
        if (padded != NULL)
            amx_configure(); /* tile configuration is per thread */
#pragma omp for collapse(3) schedule(static)
        for (int64_t p = 0; p < panels; p++)
            for (int64_t c = 0; c < col_items; c++)
                for (int64_t rb = 0; rb < row_items; rb++) {
                    const int64_t width = bf16_panel_width(p, n), first = c * AMX_COLS;
                    if (padded == NULL || first >= width)
                        continue;
                    const int cols = width - first >= AMX_COLS ? AMX_COLS : (int)(width - first);
                    const int64_t row0 = rb * AMX_ROWS;
                    const int rows = m - row0 < AMX_ROWS ? (int)(m - row0) : AMX_ROWS;
                    amx_item(x + row0 * ldx, ldx, rows, packed + p * BF16_PANEL * k, width, k,
                             first, cols, bias, p * BF16_PANEL + first, out + row0 * ldo, ldo,
                             padded);
                }
        if (padded != NULL)
            amx_release();
        free(padded);
    }
    return failed ? -3 : 0;
}

/*
 * Whether this process may use the tiles: permission from the kernel, then a 48 x 96 x
 * 64 GEMM (a short row block, an odd column block, two k steps) through the tiles equal
 * to the vdpbf16ps kernel's up to float32 rounding. Decided once.
 */
static int amx_ready(void)
{
    static int state = -1; /* -1: not decided yet */
    int decided;
#pragma omp atomic read
    decided = state;
    if (decided >= 0)
        return decided;
    int ok = amx_request_permission();
    if (ok) {
        enum { M = 48, N = 96, K = 64 };
        static uint16_t w[N * K], x[M * K], packed[N * K], tiles[M * N], vector[M * N];
        for (int i = 0; i < N * K; i++) w[i] = f32_to_bf16((float)((i * 37) % 17 - 8) / 8.0f);
        for (int i = 0; i < M * K; i++) x[i] = f32_to_bf16((float)((i * 11) % 13 - 6) / 4.0f);
        ok = pack_bf16_pairs(w, N, K, packed) == 0 &&
             gemm_amx(x, K, packed, NULL, tiles, N, M, N, K) == 0 &&
             gemm_bf16_vector(x, K, packed, NULL, vector, N, M, N, K) == 0;
        for (int i = 0; ok && i < M * N; i++) /* small integers x 1/32: exact in both */
            ok = tiles[i] == vector[i];
    }
#pragma omp atomic write
    state = ok;
    return ok;
}

#endif /* ENGINE_CPU_GEMM_AMX_H */
