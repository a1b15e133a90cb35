/*
 * Batched multi-LoRA (Punica's shrink and expand) for the CPU platform, on every ISA
 * level: engine/core/interfaces/lora.py defines both; plugins/cpu/lora.py binds them.
 *
 *   shrink:  out[t, k] = A[slot[t], k, :] . x[t, :]              (out float32, written)
 *   expand:  y[t, n]  += sum_r s[t, j(n) R + r] B[slot[t], r, n]   (j(n): n's shard)
 *
 * A is [S, K, in] (K = shards x R, `in` contiguous); B is R-major, [S, R, N] (N
 * contiguous), so expand is R contiguous AXPYs over a token's output columns.
 *
 * Tokens are first grouped by slot (a stable counting sort of their indices: O(T + S),
 * the slots read at run time, so a replayed forward graph follows each step's slots), so
 * one slot's adapter rows are reused by all of its tokens: a prefill's long run of one
 * request is one group, a decode step's tokens of one adapter another.
 *
 * shrink: work items are (group, tile of LORA_TT tokens, block of SK_ROWS rows of A);
 * a register block holds SK_TOK tokens x SK_ROWS rows of vector accumulators running
 * along `in` (x and A both contiguous there), reduced across lanes at the end.
 * expand: work items are (group, tile of EX_COLS output columns inside one shard), group
 * by group (a thread walks one slot's R rows of B along N, sequential streams); the
 * tile's B rows (R x EX_COLS, contiguous per r) are read in place, widened as loaded,
 * and a register block of EX_TOK tokens of the group adds sum_r s[t, r] B[r][:] (R
 * broadcasts) to its y columns, so each B row load serves EX_TOK tokens. A group of many
 * tokens (a prefill's) or a shard's last, narrower tile widens the tile once into float32
 * scratch (zero padded) and runs from there. At decode the adapters come from memory (8
 * slots of a layer outgrow the caches next to the base weights), so both kernels
 * prefetch their next item's rows of A / B.
 *
 * Calls below LORA_PAR_MIN multiply-adds run on the calling thread (a fork / join costs
 * more than they save; a decode step of 8 tokens over the demo model's layers still
 * gains from two threads).
 *
 * Arithmetic is float32 (bf16 / fp16 widened as read; a bf16 shrink on levels with
 * AVX512-BF16 multiplies pairs with vdpbf16ps into float32 sums); y is rounded to its
 * dtype once, after the add (bf16 on those levels by vcvtneps2bf16, round to nearest
 * even like the generic code, denormals flushed like the level's bf16 GEMM output).
 * The reduction order of one token's value never depends on the other tokens (nor on
 * how many share its slot): shrink sums its (t, k) in one vector chain over
 * `in` with the same tail and lane reduction for any block; expand's sum over r is one
 * chain per column in r order whatever the token block, the tile split depends on N
 * only. So the kernels are batch invariant as they are (batch_invariant_mode changes
 * nothing here).
 *
 * Status: 0; -1 bad shapes / dtype / bounds; -2 a slot outside [-1, S) (nothing written);
 * -3 out of memory.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_math.h"
#include "kernels.h"
#include "simd.h"

#if VREGS >= 32
#define SK_TOK 4 /* tokens per shrink register block */
#else
#define SK_TOK 2
#endif
#define SK_ROWS 4 /* rows of A per shrink register block (and work item) */
#define LORA_TT 32 /* tokens per shrink work item */
#define EX_COLS 64 /* output columns per expand work item */
#define EX_VECS (EX_COLS / VF)
/* tokens per expand register block: half the registers hold accumulators */
#define EX_TOK ((VREGS / 2) / EX_VECS > 1 ? (VREGS / 2) / EX_VECS : 1)
#ifndef LORA_PREFETCH
#define LORA_PREFETCH 2 /* expand: tiles ahead whose B rows are prefetched (0: none) */
#endif
#ifndef EX_WIDEN_MIN
#define EX_WIDEN_MIN 16 /* tokens of a group from which expand widens its B tile once */
#endif
#define LORA_MAX_RANK 512 /* R bound (expand's padded tail tile) */
#define LORA_PAR_MIN (1 << 15) /* multiply-adds from which a call goes parallel */

/* Tokens grouped by slot: perm holds token indices slot by slot (slot order, stable),
 * group g = tokens perm[start[g] .. start[g + 1]) of slot slot_of[g]. */
typedef struct {
    int32_t *perm;
    int64_t *start; /* num_groups + 1 */
    int32_t *slot_of;
    int64_t num_groups;
    void *mem;
} lora_groups;

/* Returns 0, -2 for a slot outside [-1, num_slots), -3 without memory. */
static int group_tokens(const int32_t *slots, int64_t t_count, int64_t num_slots,
                        lora_groups *g)
{
    memset(g, 0, sizeof *g);
    for (int64_t t = 0; t < t_count; t++)
        if (slots[t] < -1 || slots[t] >= num_slots) return -2;
    const size_t bytes = sizeof(int64_t) * (size_t)(num_slots + 1) * 2 +
                         sizeof(int32_t) * (size_t)(t_count + num_slots + 1);
    char *mem = malloc(bytes);
    if (mem == NULL) return -3;
    int64_t *count = (int64_t *)mem; /* [num_slots + 1], then the group starts */
    int64_t *start = count + num_slots + 1;
    int32_t *perm = (int32_t *)(start + num_slots + 1);
    int32_t *slot_of = perm + t_count;
    memset(count, 0, sizeof(int64_t) * (size_t)(num_slots + 1));
    for (int64_t t = 0; t < t_count; t++)
        if (slots[t] >= 0) count[slots[t]]++;
    int64_t groups = 0, at = 0;
    for (int64_t s = 0; s < num_slots; s++) {
        if (!count[s]) continue;
        start[groups] = at;
        slot_of[groups] = (int32_t)s;
        const int64_t c = count[s];
        count[s] = at; /* now: the next place of slot s */
        at += c;
        groups++;
    }
    start[groups] = at;
    for (int64_t t = 0; t < t_count; t++)
        if (slots[t] >= 0) perm[count[slots[t]]++] = (int32_t)t;
    g->perm = perm;
    g->start = start;
    g->slot_of = slot_of;
    g->num_groups = groups;
    g->mem = mem;
    return 0;
}

/* ---------------------------------------------------------------------------- shrink */

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
#define LORA_BF16_DOT 1
#include <immintrin.h>

/* shrink_block for bf16 x and A where the level has vdpbf16ps: 32 values of `in` per
 * instruction (pairs summed into float32 lanes), then the lane sum and a scalar tail. */
static inline __attribute__((always_inline)) void shrink_block_dpbf16(
    const int TOK, const int ROWS, const void *const *xr, const void *const *ar, int64_t n,
    float *const *orow, int64_t k0)
{
    __m512 acc[SK_TOK][SK_ROWS];
#pragma GCC unroll 4
    for (int i = 0; i < TOK; i++)
#pragma GCC unroll 4
        for (int r = 0; r < ROWS; r++) acc[i][r] = _mm512_setzero_ps();
    int64_t c = 0;
    for (; c + 32 <= n; c += 32) {
        __m512bh av[SK_ROWS];
#pragma GCC unroll 4
        for (int r = 0; r < ROWS; r++)
            av[r] = (__m512bh)_mm512_loadu_si512((const uint16_t *)ar[r] + c);
#pragma GCC unroll 4
        for (int i = 0; i < TOK; i++) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512((const uint16_t *)xr[i] + c);
#pragma GCC unroll 4
            for (int r = 0; r < ROWS; r++) acc[i][r] = _mm512_dpbf16_ps(acc[i][r], xv, av[r]);
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < TOK; i++)
#pragma GCC unroll 4
        for (int r = 0; r < ROWS; r++) {
            float sum = vf_sum((vf)acc[i][r]);
            for (int64_t e = c; e < n; e++)
                sum += load_at(xr[i], e, DTYPE_BF16) * load_at(ar[r], e, DTYPE_BF16);
            orow[i][k0 + r] = sum;
        }
}
#else
#define LORA_BF16_DOT 0
#endif

/* TOK tokens (rows xr[0..TOK)) x ROWS rows of A (ar[0..ROWS)) over n values: the dots
 * into out[tok][row]. One vector chain per (token, row), then its lane sum, then the
 * scalar tail: the same sequence for a (token, row) whatever block it sits in. */
static inline __attribute__((always_inline)) void shrink_block(
    const int TOK, const int ROWS, const void *const *xr, const void *const *ar, int64_t n,
    const int dtype, float *const *orow, int64_t k0)
{
#if LORA_BF16_DOT
    if (dtype == DTYPE_BF16) {
        shrink_block_dpbf16(TOK, ROWS, xr, ar, n, orow, k0);
        return;
    }
#endif
    vf acc[SK_TOK][SK_ROWS];
#pragma GCC unroll 4
    for (int i = 0; i < TOK; i++)
#pragma GCC unroll 4
        for (int r = 0; r < ROWS; r++) acc[i][r] = vf_splat(0.0f);
    int64_t c = 0;
    for (; c + VF <= n; c += VF) {
        vf av[SK_ROWS];
#pragma GCC unroll 4
        for (int r = 0; r < ROWS; r++) av[r] = vf_load_as(ar[r], c, dtype);
#pragma GCC unroll 4
        for (int i = 0; i < TOK; i++) {
            const vf xv = vf_load_as(xr[i], c, dtype);
#pragma GCC unroll 4
            for (int r = 0; r < ROWS; r++) acc[i][r] += xv * av[r];
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < TOK; i++)
#pragma GCC unroll 4
        for (int r = 0; r < ROWS; r++) {
            float sum = vf_sum(acc[i][r]);
            for (int64_t e = c; e < n; e++) sum += load_at(xr[i], e, dtype) * load_at(ar[r], e, dtype);
            orow[i][k0 + r] = sum;
        }
}

/* One work item: tokens perm[0..count) of one slot against rows [k0, k0 + rows) of a. */
static inline __attribute__((always_inline)) void shrink_item(
    const void *x, int64_t ldx, const void *a, const int32_t *perm, int64_t count, int64_t k0,
    int rows, int64_t in, float *out, int64_t ldo, const int dtype)
{
    const int64_t es = dtype_size(dtype);
    const void *ar[SK_ROWS];
    for (int r = 0; r < SK_ROWS; r++)
        ar[r] = (const char *)a + (k0 + (r < rows ? r : 0)) * in * es;
#if LORA_PREFETCH
    /* the next item's rows of A (the following SK_ROWS rows; at the end of a slot past
     * them, harmless): fetched while these are multiplied */
    for (int64_t off = 0; off < SK_ROWS * in * es; off += 64)
        __builtin_prefetch((const char *)a + (k0 + SK_ROWS) * in * es + off);
#endif
    for (int64_t i0 = 0; i0 < count; i0 += SK_TOK) {
        const int tok = count - i0 < SK_TOK ? (int)(count - i0) : SK_TOK;
        const void *xr[SK_TOK];
        float *orow[SK_TOK];
        for (int i = 0; i < SK_TOK; i++) {
            const int64_t t = perm[i0 + (i < tok ? i : 0)];
            xr[i] = (const char *)x + t * ldx * es;
            orow[i] = out + t * ldo;
        }
        if (tok == SK_TOK && rows == SK_ROWS)
            shrink_block(SK_TOK, SK_ROWS, xr, ar, in, dtype, orow, k0);
        else
            for (int i = 0; i < tok; i++)
                for (int r = 0; r < rows; r++)
                    shrink_block(1, 1, xr + i, ar + r, in, dtype, orow + i, k0 + r);
    }
}

int lora_shrink(const void *x, int64_t ldx, const void *a, const int32_t *slots, float *out,
                int64_t ldo, int64_t t_count, int64_t k, int64_t in, int64_t num_slots,
                int dtype)
{
    if (t_count < 0 || k <= 0 || in <= 0 || num_slots <= 0 || ldx < in || ldo < k ||
        (dtype != DTYPE_F32 && dtype != DTYPE_BF16 && dtype != DTYPE_F16))
        return -1;
    if (t_count == 0) return 0;
    lora_groups g;
    const int status = group_tokens(slots, t_count, num_slots, &g);
    if (status) return status;
    for (int64_t t = 0; t < t_count; t++) /* tokens without an adapter: zero rows */
        if (slots[t] < 0) memset(out + t * ldo, 0, sizeof(float) * (size_t)k);
    /* tiles: (group, token tile); items: tiles x row blocks */
    int64_t tiles = 0;
    for (int64_t gi = 0; gi < g.num_groups; gi++)
        tiles += (g.start[gi + 1] - g.start[gi] + LORA_TT - 1) / LORA_TT;
    int64_t *tile_at = malloc(sizeof(int64_t) * (size_t)(2 * tiles + 1));
    if (tile_at == NULL) {
        free(g.mem);
        return -3;
    }
    int64_t *tile_group = tile_at + tiles;
    for (int64_t gi = 0, i = 0; gi < g.num_groups; gi++)
        for (int64_t p = g.start[gi]; p < g.start[gi + 1]; p += LORA_TT, i++) {
            tile_at[i] = p;
            tile_group[i] = gi;
        }
    const int64_t kblocks = (k + SK_ROWS - 1) / SK_ROWS, items = tiles * kblocks;
    const int64_t es = dtype_size(dtype);
    const int par = (int64_t)t_count * k * in >= LORA_PAR_MIN && items > 1;
#pragma omp parallel for schedule(static) if (par)
    for (int64_t item = 0; item < items; item++) {
        const int64_t tile = item / kblocks, k0 = (item % kblocks) * SK_ROWS;
        const int64_t gi = tile_group[tile], p = tile_at[tile];
        const int64_t end = g.start[gi + 1];
        const int64_t count = end - p < LORA_TT ? end - p : LORA_TT;
        const int rows = k - k0 < SK_ROWS ? (int)(k - k0) : SK_ROWS;
        const void *as = (const char *)a + (int64_t)g.slot_of[gi] * k * in * es;
        switch (dtype) {
        case DTYPE_BF16:
            shrink_item(x, ldx, as, g.perm + p, count, k0, rows, in, out, ldo, DTYPE_BF16);
            break;
        case DTYPE_F16:
            shrink_item(x, ldx, as, g.perm + p, count, k0, rows, in, out, ldo, DTYPE_F16);
            break;
        default:
            shrink_item(x, ldx, as, g.perm + p, count, k0, rows, in, out, ldo, DTYPE_F32);
        }
    }
    free(tile_at);
    free(g.mem);
    return 0;
}

/* ---------------------------------------------------------------------------- expand */

/* TOK tokens (s rows sr[0..TOK), their y offsets yoff[0..TOK)) x one EX_COLS tile:
 * acc[i][v] = sum_r s[i][r] B[r][v] (one chain per column, r in order, whatever TOK),
 * then y += acc, rounded once. `bt` (element `bi`, row stride `ldb` elements, of dtype
 * `bdt`): the tile's B rows, R-major. width < EX_COLS only with a float32 `bt` padded
 * with zeros (its y columns then written one by one). */
static inline __attribute__((always_inline)) void expand_block(
    const int TOK, const float *const *sr, const int64_t *yoff, const void *bt, int64_t bi,
    int64_t ldb, const int bdt, int64_t rank, void *y, int width, const int dtype)
{
    vf acc[EX_TOK][EX_VECS];
#pragma GCC unroll 16
    for (int i = 0; i < TOK; i++)
#pragma GCC unroll 16
        for (int v = 0; v < EX_VECS; v++) acc[i][v] = vf_splat(0.0f);
    for (int64_t r = 0; r < rank; r++) {
        vf bv[EX_VECS];
#pragma GCC unroll 16
        for (int v = 0; v < EX_VECS; v++) bv[v] = vf_load_as(bt, bi + r * ldb + v * VF, bdt);
#pragma GCC unroll 16
        for (int i = 0; i < TOK; i++) {
            const vf sv = vf_splat(sr[i][r]);
#pragma GCC unroll 16
            for (int v = 0; v < EX_VECS; v++) acc[i][v] += sv * bv[v];
        }
    }
#pragma GCC unroll 16
    for (int i = 0; i < TOK; i++) {
        if (width == EX_COLS) {
#pragma GCC unroll 16
            for (int v = 0; v < EX_VECS; v++) {
                const vf sum = vf_load_as(y, yoff[i] + v * VF, dtype) + acc[i][v];
#if LORA_BF16_DOT
                if (dtype == DTYPE_BF16) { /* vcvtneps2bf16, as the level's bf16 GEMM stores */
                    _mm256_storeu_si256((__m256i *)((uint16_t *)y + yoff[i] + v * VF),
                                        (__m256i)_mm512_cvtneps_pbh((__m512)sum));
                    continue;
                }
#endif
                vf_store_as(y, yoff[i] + v * VF, dtype, sum);
            }
        } else {
            float tmp[EX_COLS];
            for (int v = 0; v < EX_VECS; v++) vf_store(tmp + v * VF, acc[i][v]);
            for (int c = 0; c < width; c++)
                store_at(y, yoff[i] + c, dtype, load_at(y, yoff[i] + c, dtype) + tmp[c]);
        }
    }
}

/* One work item: the tokens of group gi, columns [c0, c0 + width) of shard j (its s
 * columns from j * r). B is R-major ([S, R, N]): a full tile's rows are read in place,
 * widened as loaded, for a group of few tokens (a decode step's); for a group of at
 * least EX_WIDEN_MIN tokens of a bf16 / fp16 B (a prefill's) and for a narrower tile (a
 * shard's last) they are widened once into `pad` (rank x EX_COLS float32, zeros past
 * width) and every token block reads them from there. Widening is exact, so both ways
 * run the same chains on the same values. */
static inline __attribute__((always_inline)) void expand_item(
    const float *s, int64_t lds, const void *b, const lora_groups *g, int64_t gi, int64_t c0,
    int width, int64_t scol, int64_t n, int64_t rank, void *y, int64_t ldy, float *pad,
    const int dtype)
{
    const int64_t es = dtype_size(dtype);
    const char *bs = (const char *)b + (int64_t)g->slot_of[gi] * rank * n * es;
    const int64_t begin = g->start[gi], end = g->start[gi + 1];
#if LORA_PREFETCH
    /* the next tiles' B rows (the thread's next item is mostly this slot's next tile;
     * past the end of B a prefetch is harmless) */
    for (int64_t r = 0; r < rank; r++)
        for (int64_t off = 0; off < EX_COLS * es; off += 64)
            __builtin_prefetch(bs + (r * n + c0 + LORA_PREFETCH * EX_COLS) * es + off);
#endif
    const int widen = width < EX_COLS || (dtype != DTYPE_F32 && end - begin >= EX_WIDEN_MIN);
    if (widen) {
        if (width == EX_COLS) {
            for (int64_t r = 0; r < rank; r++)
#pragma GCC unroll 16
                for (int v = 0; v < EX_VECS; v++)
                    vf_store(pad + r * EX_COLS + v * VF,
                             vf_load_as(bs, r * n + c0 + v * VF, dtype));
        } else {
            memset(pad, 0, sizeof(float) * (size_t)(rank * EX_COLS));
            for (int64_t r = 0; r < rank; r++)
                for (int c = 0; c < width; c++)
                    pad[r * EX_COLS + c] = load_at(bs, r * n + c0 + c, dtype);
        }
    }
    for (int64_t p = begin; p < end; p += EX_TOK) {
        const int tok = end - p < EX_TOK ? (int)(end - p) : EX_TOK;
        const float *sr[EX_TOK];
        int64_t yoff[EX_TOK];
        for (int i = 0; i < tok; i++) {
            const int64_t t = g->perm[p + i];
            sr[i] = s + t * lds + scol;
            yoff[i] = t * ldy + c0;
        }
        if (widen) {
            if (tok == EX_TOK)
                expand_block(EX_TOK, sr, yoff, pad, 0, EX_COLS, DTYPE_F32, rank, y, width,
                             dtype);
            else
                for (int i = 0; i < tok; i++)
                    expand_block(1, sr + i, yoff + i, pad, 0, EX_COLS, DTYPE_F32, rank, y,
                                 width, dtype);
        } else if (tok == EX_TOK) {
            expand_block(EX_TOK, sr, yoff, bs, c0, n, dtype, rank, y, EX_COLS, dtype);
        } else {
            for (int i = 0; i < tok; i++)
                expand_block(1, sr + i, yoff + i, bs, c0, n, dtype, rank, y, EX_COLS, dtype);
        }
    }
}

int lora_expand(const float *s, int64_t lds, const void *b, const int32_t *slots,
                const int64_t *bounds, int64_t num_shards, void *y, int64_t ldy,
                int64_t t_count, int64_t n, int64_t rank, int64_t num_slots, int dtype)
{
    if (t_count < 0 || n <= 0 || rank <= 0 || rank > LORA_MAX_RANK || num_shards <= 0 ||
        num_slots <= 0 || lds < num_shards * rank || ldy < n ||
        (dtype != DTYPE_F32 && dtype != DTYPE_BF16 && dtype != DTYPE_F16))
        return -1;
    if (bounds[0] != 0 || bounds[num_shards] != n) return -1;
    for (int64_t j = 0; j < num_shards; j++)
        if (bounds[j + 1] < bounds[j]) return -1;
    if (t_count == 0) return 0;
    lora_groups g;
    const int status = group_tokens(slots, t_count, num_slots, &g);
    if (status) return status;
    if (g.num_groups == 0) {
        free(g.mem);
        return 0;
    }
    /* items: (group, EX_COLS-wide column tile of a shard), group-major: a thread walks
     * one slot's B rows along N (R sequential streams the prefetcher follows) rather than
     * hopping between slots for every tile */
    int64_t tiles = 0;
    for (int64_t j = 0; j < num_shards; j++)
        tiles += (bounds[j + 1] - bounds[j] + EX_COLS - 1) / EX_COLS;
    const int64_t items = g.num_groups * tiles;
    const int par = t_count * n * rank >= LORA_PAR_MIN && items > 1;
    int failed = 0;
#pragma omp parallel if (par) reduction(| : failed)
    {
        float *bt = aligned_alloc(64, sizeof(float) * (size_t)(rank * EX_COLS)); /* pad */
        failed = bt == NULL;
#pragma omp for schedule(static)
        for (int64_t item = 0; item < items; item++) {
            if (bt == NULL) continue;
            const int64_t gi = item / tiles, tile = item % tiles;
            int64_t j = 0, first = 0; /* the tile's shard, found by a scan */
            for (;; j++) {
                const int64_t tiles_j = (bounds[j + 1] - bounds[j] + EX_COLS - 1) / EX_COLS;
                if (tile < first + tiles_j) break;
                first += tiles_j;
            }
            const int64_t c0 = bounds[j] + (tile - first) * EX_COLS;
            const int width = bounds[j + 1] - c0 < EX_COLS ? (int)(bounds[j + 1] - c0) : EX_COLS;
            switch (dtype) {
            case DTYPE_BF16:
                expand_item(s, lds, b, &g, gi, c0, width, j * rank, n, rank, y, ldy, bt,
                            DTYPE_BF16);
                break;
            case DTYPE_F16:
                expand_item(s, lds, b, &g, gi, c0, width, j * rank, n, rank, y, ldy, bt,
                            DTYPE_F16);
                break;
            default:
                expand_item(s, lds, b, &g, gi, c0, width, j * rank, n, rank, y, ldy, bt,
                            DTYPE_F32);
            }
        }
        free(bt);
    }
    free(g.mem);
    return failed ? -3 : 0;
}
