/*
 * The quantized-weight GEMM (the CPU plugin's QuantizedGemmKernel), included by gemm.c,
 * whose register blocks it shares: out = QDQ(x) dequant(W)^T (+ bias) for weights in
 * int4 / int8 codes with group scales and zero points (GPTQ, AWQ, compressed-tensors
 * pack-quantized and W8A8), fp8 e4m3 with per-tensor / channel / block scales, and
 * nvfp4 (e2m1 codes with fp8 group scales), activations quantize-dequantized as the
 * checkpoint's scheme says (quant_act.h) and multiplied in float32.
 *
 * Packed layout (qgemm_pack): a header (qgemm_header), the act-order permutation of the
 * input features, the per-shard activation scales, then panels of PANEL output columns.
 * Each output shard of a fused layer (q / k / v, gate / up) gets panels of its own,
 * the last one padded with zero-scale columns, so one panel never mixes two shards'
 * activation scales. A panel holds, k after k, its columns' codes (int4 / e2m1: two a
 * byte, int8 / e4m3: one), then its scales per group ([K / group][PANEL] float32),
 * then (int codes) -zero x scale per group. Nibbles are paired per two vectors: byte i
 * of a pair holds column i (low nibble) and column VF + i (high nibble), so one
 * zero-extending load and a mask / shift give two vectors of codes.
 *
 * Decode (M <= GEMM_ROWS): every panel is read once, as the dense kernel reads its
 * panels. Per group, the R rows accumulate x . code in registers (the code decoded to
 * float, no scale), then the group's partial sums are scaled once: int codes add
 * -zero x scale x sum(x of the group), which the call computes once per row. Only
 * nvfp4 scales each weight in the inner loop, since its weights are bf16(e2m1 x scale)
 * (compressed-tensors' definition, which the checkpoints' references compute).
 *
 * Prefill: the dense kernel's schedule, with dequantization in place of widening: a
 * block of GEMM_KC k's of a panel is dequantized into a float32 buffer once per chunk of
 * GEMM_CHUNK rows and every register block of the chunk runs over it.
 *
 * Decoding codes: int codes zero-extend and convert; e4m3 and e2m1 codes become fp16
 * bits by a shift and a mask where the level converts fp16 (F16C, Arm), which leaves
 * them 2^-8 (e4m3) or 2^-14 (e2m1) too small: the packed scales carry that factor.
 * Levels without fp16 conversion build the float32 bits in integer arithmetic.
 */
#ifndef ENGINE_CPU_GEMM_QUANT_H
#define ENGINE_CPU_GEMM_QUANT_H

#include <omp.h>

#include "quant_act.h"

enum { QENC_INT = 0, QENC_FP8 = 1, QENC_NVFP4 = 2 };
/* the code formats the inner loops are specialised for */
enum { QK_INT4 = 0, QK_INT8 = 1, QK_FP8 = 2, QK_NVFP4 = 3 };
/* qgemm_pack's parameter words */
enum { QP_N, QP_K, QP_ENCODING, QP_BITS, QP_GROUP, QP_ACT, QP_ACT_STRATEGY, QP_ACT_DYNAMIC,
       QP_ACT_GROUP, QP_HAS_PERM, QP_HAS_ZEROS, QP_ACT_DTYPE, QP_SHARDS,
       QP_SHARD_N /* one per shard */ };
#define QMAX_SHARDS 8
#define QGEMM_MAGIC 0x314d4d4547514e45LL /* "ENQGEMM1" */
#define QALIGN 64

/* nvfp4 on AVX2 / AVX-512: a weight bf16(e2m1 x s) is a power of two times bf16(s) or
 * bf16(1.5 s) (rounding commutes with powers of two), so the panel keeps those two
 * scales per group and the inner loop looks each code up in two 16-entry tables: the
 * power of two that multiplies A = bf16(s) (codes 0.5, 1, 2, 4) and B = bf16(1.5 s)
 * (1.5, 3, 6). Two permutes and two multiply-adds, exact, instead of a product and a
 * rounding per weight. */
#if defined(__AVX2__)
#define NV_LUT 1
#define NV_ROWS 2 /* rows per decode block: two accumulator sets per row */
#else
#define NV_LUT 0
#endif
#if NV_LUT
static const float NV_TABLE_A[16] = {0, .5f, 1, 0, 2, 0, 4, 0,
                                     -0.f, -.5f, -1, -0.f, -2, -0.f, -4, -0.f};
static const float NV_TABLE_B[16] = {0, 0, 0, 1, 0, 2, 0, 4,
                                     -0.f, -0.f, -0.f, -1, -0.f, -2, -0.f, -4};

/* table[idx] per lane, idx 0 .. 15 (bit 3: the sign, the tables are symmetric) */
static inline vf vf_lut16(vi idx, const float *table) {
#if defined(__AVX512F__)
    return (vf)_mm512_permutexvar_ps((__m512i)idx, _mm512_loadu_ps(table));
#else
    const __m256 mag = _mm256_permutevar8x32_ps(_mm256_loadu_ps(table), (__m256i)idx);
    return (vf)((vi)mag ^ ((idx & 8) << 28));
#endif
}
#endif

#if HAVE_FLOAT16
#define FP8_UNIT 256.0f    /* e4m3 codes decode to value / 256 (fp16 bits) */
#define E2M1_UNIT 16384.0f /* e2m1 codes decode to value / 2^14 */
#else
#define FP8_UNIT 1.0f
#define E2M1_UNIT 1.0f
#endif

typedef struct {
    int64_t magic, n, k, encoding, bits, group, act, act_strategy, act_dynamic, act_group;
    int64_t has_perm, shards, panel, panels, panel_bytes, code_bytes, groups;
    int64_t perm_off, act_scale_off, panels_off;
    int64_t vnni; /* int8 x int8 panels (vnni_panel) instead of the float path's */
    int64_t bf16_int4; /* int4 codes as bf16 (128 + code) pairs for vdpbf16ps */
    int64_t implied_zeros; /* bf16_int4 without zero points: no -(128 + zero) stored */
    int64_t act_dtype; /* what the layer's activations are (bf16_int4 takes only bf16) */
    int64_t shard_n[QMAX_SHARDS], shard_panels[QMAX_SHARDS];
} qgemm_header;

#if defined(__AVX512VNNI__) && VF == 16
#define HAVE_QVNNI 1
#else
#define HAVE_QVNNI 0
#endif

static inline int64_t qalign(int64_t bytes) { return (bytes + QALIGN - 1) / QALIGN * QALIGN; }

static inline int qkind(int64_t encoding, int64_t bits) {
    if (encoding == QENC_INT) return bits == 4 ? QK_INT4 : QK_INT8;
    return encoding == QENC_FP8 ? QK_FP8 : QK_NVFP4;
}

/* bytes of one k's codes in a panel */
static inline int64_t qk_row_bytes(int kind) {
    return kind == QK_INT4 || kind == QK_NVFP4 ? PANEL / 2 : PANEL;
}

/* a panel's second scale set (after `groups` groups of the first): -zero x scale (int
 * codes, float32) or B (nvfp4 tables, bf16) */
static inline const float *q_second_scales(int kind, const float *sc, int64_t groups) {
    if (NV_LUT && kind == QK_NVFP4)
        return (const float *)((const uint16_t *)sc + groups * PANEL);
    return sc + groups * PANEL;
}

static inline vf vf_round_to_bf16(vf v) {
    vu bits;
    memcpy(&bits, &v, sizeof bits);
    bits = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
    vf out;
    memcpy(&out, &bits, sizeof out);
    return out;
}

static inline vf vf_from_vi(vi v) { return __builtin_convertvector(v, vf); }

/* e2m1 codes (uint16 lanes, 0 .. 15) as float values / E2M1_UNIT */
static inline vf vf_e2m1(vh n) {
#if HAVE_FLOAT16
    const vs16 spread = ((vs16)(n << 12)) >> 3; /* s s s s e e m 0..: sign extended */
    return vf_from_f16_bits((vh)spread & (uint16_t)0x8e00);
#else
    const vi c = __builtin_convertvector(n, vi), mag = c & 7;
    vi bits = (((mag >> 1) + 126) << 23) | ((mag & 1) << 22);
    const vi one = mag == 1, zero = mag == 0; /* 0.5 (exponent 0) and 0 */
    bits = (bits & ~one) | (one & 0x3f000000);
    bits &= ~zero;
    bits |= (c & 8) << 28;
    vf out;
    memcpy(&out, &bits, sizeof out);
    return out;
#endif
}

/* VF e4m3 codes as float values / FP8_UNIT */
static inline vf vf_e4m3(const uint8_t *p) {
#if HAVE_FLOAT16
    const vs16 wide = vs16_from_s8(p); /* the sign copied into bit 14 */
    return vf_from_f16_bits(((vh)wide << 7) & (uint16_t)0xbfff);
#else
    const vi c = vi_from_u8(p), mag = c & 0x7f;
    const vi normal = (mag << 20) + (120 << 23);
    const vf sub = vf_from_vi(mag) * (1.0f / 512.0f); /* exponent 0: mantissa x 2^-9 */
    vf nv;
    memcpy(&nv, &normal, sizeof nv);
    vi bits;
    const vf value = vf_select(mag < 8, sub, nv);
    memcpy(&bits, &value, sizeof bits);
    bits |= (c & 0x80) << 24;
    vf out;
    memcpy(&out, &bits, sizeof out);
    return out;
#endif
}

/* one k's codes of a panel as GEMM_VECS vectors of code values */
static inline __attribute__((always_inline)) void q_load_k(const int kind, const uint8_t *row,
                                                          vf w[GEMM_VECS]) {
    if (kind == QK_INT4 || kind == QK_NVFP4) {
#pragma GCC unroll 4
        for (int jp = 0; jp < GEMM_VECS / 2; jp++) {
            if (kind == QK_INT4) {
                const vi v = vi_from_u8(row + jp * VF);
                w[2 * jp] = vf_from_vi(v & 15);
                w[2 * jp + 1] = vf_from_vi(v >> 4);
            } else {
                const vh v = vh_from_u8(row + jp * VF);
                w[2 * jp] = vf_e2m1(v & (uint16_t)15);
                w[2 * jp + 1] = vf_e2m1(v >> 4);
            }
        }
    } else {
#pragma GCC unroll 4
        for (int j = 0; j < GEMM_VECS; j++) {
            if (kind == QK_INT8) {
                w[j] = vf_from_vi(vi_from_u8(row + j * VF));
            } else {
                w[j] = vf_e4m3(row + j * VF);
            }
        }
    }
}

/* -- packing ------------------------------------------------------------------------- */

/* The header of a valid parameter set (0), or -1. */
static int qgemm_plan(const int64_t *p, qgemm_header *h) {
    memset(h, 0, sizeof *h);
    h->magic = QGEMM_MAGIC;
    h->n = p[QP_N], h->k = p[QP_K], h->encoding = p[QP_ENCODING], h->bits = p[QP_BITS];
    h->group = p[QP_GROUP], h->act = p[QP_ACT], h->act_strategy = p[QP_ACT_STRATEGY];
    h->act_dynamic = p[QP_ACT_DYNAMIC], h->act_group = p[QP_ACT_GROUP];
    h->has_perm = p[QP_HAS_PERM], h->shards = p[QP_SHARDS], h->panel = PANEL;
    if (p[QP_HAS_ZEROS] != 0 && p[QP_HAS_ZEROS] != 1)
        return -1;
    if (h->n <= 0 || h->k <= 0 || h->group <= 0 || h->k % h->group || h->k % 2)
        return -1;
    if (h->encoding == QENC_INT ? h->bits != 4 && h->bits != 8
        : h->encoding == QENC_FP8 ? h->bits != 8
        : h->encoding == QENC_NVFP4 ? h->bits != 4 || h->group != 16 : 1)
        return -1;
    if (h->act < QACT_NONE || h->act > QACT_NVFP4 || h->shards < 1 || h->shards > QMAX_SHARDS)
        return -1;
    if (h->act != QACT_NONE && (h->act_strategy < QSTRAT_TOKEN || h->act_strategy > QSTRAT_GROUP))
        return -1;
    if (h->act == QACT_NVFP4 && (!h->act_dynamic || h->act_group != 16))
        return -1;
    if (h->act != QACT_NONE && (h->act_strategy == QSTRAT_GROUP || h->act == QACT_NVFP4) &&
        (h->act_group <= 0 || h->k % h->act_group))
        return -1;
    int64_t total = 0;
    for (int64_t s = 0; s < h->shards; s++) {
        const int64_t n = p[QP_SHARD_N + s];
        if (n <= 0 || n % 16)
            return -1;
        h->shard_n[s] = n;
        h->shard_panels[s] = (n + PANEL - 1) / PANEL;
        h->panels += h->shard_panels[s];
        total += n;
    }
    if (total != h->n)
        return -1;
    const int kind = qkind(h->encoding, h->bits);
    h->groups = h->k / h->group;
    h->code_bytes = h->k * qk_row_bytes(kind);
    /* W8A8: symmetric per-channel int8 weights, int8 per-token / per-tensor activations */
    h->act_dtype = p[QP_ACT_DTYPE];
    if (h->act_dtype < DTYPE_F32 || h->act_dtype > DTYPE_F16)
        return -1;
    h->bf16_int4 = HAVE_BF16_DOT && kind == QK_INT4 && h->act == QACT_NONE &&
                   h->act_dtype == DTYPE_BF16 && h->group % 2 == 0;
    h->vnni = HAVE_QVNNI && kind == QK_INT8 && h->group == h->k && h->k % 4 == 0 &&
              h->act == QACT_INT8 && h->act_strategy != QSTRAT_GROUP && !p[QP_HAS_ZEROS];
    /* scales, and -zero x scale (int; bf16_int4: -(128 + zero), none for symmetric codes)
     * or bf16(1.5 x scale) (nvfp4 tables) */
    h->implied_zeros = h->bf16_int4 && !p[QP_HAS_ZEROS];
    const int64_t scale_bytes = NV_LUT && kind == QK_NVFP4 ? 2 * 2 /* A and B in bf16 */
                                : h->encoding == QENC_INT && !h->implied_zeros ? 2 * 4 : 4;
    h->panel_bytes = qalign(h->code_bytes + scale_bytes * h->groups * PANEL);
    h->perm_off = qalign(sizeof *h);
    h->act_scale_off = h->perm_off + (h->has_perm ? qalign(8 * h->k) : 0);
    h->panels_off = h->act_scale_off + qalign(4 * QMAX_SHARDS);
    return 0;
}

int64_t qgemm_pack_bytes(const int64_t *params) {
    qgemm_header h;
    if (qgemm_plan(params, &h)) return -1;
    return h.panels_off + h.panels * h.panel_bytes;
}

/* panel p's shard, first weight row (= output column) and width */
static inline void qpanel_place(const qgemm_header *h, int64_t p, int64_t *shard,
                                int64_t *col, int64_t *width) {
    int64_t s = 0, col0 = 0;
    while (p >= h->shard_panels[s]) {
        p -= h->shard_panels[s];
        col0 += h->shard_n[s];
        s++;
    }
    const int64_t left = h->shard_n[s] - p * PANEL;
    *shard = s;
    *col = col0 + p * PANEL;
    *width = left < PANEL ? left : PANEL;
}

/* code of (row, k): uint8 codes [N, K] (int, fp8) or [N, K / 2] nibbles (nvfp4) */
static inline unsigned q_code_at(const uint8_t *codes, int kind, int64_t k_total, int64_t row,
                                 int64_t k) {
    if (kind == QK_NVFP4)
        return (codes[row * (k_total / 2) + k / 2] >> (4 * (k & 1))) & 15u;
    return codes[row * k_total + k];
}

/*
 * Fills `packed` (qgemm_pack_bytes(params) bytes) from the canonical weights of
 * engine/core/interfaces/quant.py: codes, float32 scales [N, K / group], zero points
 * [N, K / group] (int codes; NULL: the midpoint 2^(bits - 1)), the act-order
 * permutation (the input feature each column of the already permuted codes reads) and
 * the per-shard activation scales (static scales, nvfp4's global input scales; NULL:
 * none). Returns 0, or -1 for parameters qgemm_pack_bytes refuses.
 */
int qgemm_pack(const int64_t *params, const uint8_t *codes, const float *scales,
               const float *zeros, const int64_t *perm, const float *act_scales, void *packed)
{
    qgemm_header h;
    if (qgemm_plan(params, &h)) return -1;
    if ((h.has_perm && perm == NULL) || (params[QP_HAS_ZEROS] != (zeros != NULL))) return -1;
    char *base = (char *)packed;
    memset(base, 0, (size_t)h.panels_off);
    memcpy(base, &h, sizeof h);
    if (h.has_perm) {
        for (int64_t i = 0; i < h.k; i++)
            if (perm[i] < 0 || perm[i] >= h.k) return -1;
        memcpy(base + h.perm_off, perm, (size_t)(8 * h.k));
    }
    float *act = (float *)(base + h.act_scale_off);
    for (int64_t s = 0; s < h.shards; s++)
        act[s] = act_scales != NULL ? act_scales[s] : 0.0f;
    const int kind = qkind(h.encoding, h.bits);
    const int64_t row_bytes = qk_row_bytes(kind), groups = h.groups;
    const float unit = kind == QK_FP8 ? FP8_UNIT : kind == QK_NVFP4 ? E2M1_UNIT : 1.0f;
    const float midpoint = (float)(1 << (h.bits - 1));
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < h.panels; p++) {
        int64_t shard, col, width;
        qpanel_place(&h, p, &shard, &col, &width);
        uint8_t *dst = (uint8_t *)base + h.panels_off + p * h.panel_bytes;
        memset(dst, 0, (size_t)h.panel_bytes);
        float *sc = (float *)(dst + h.code_bytes), *zs = sc + groups * PANEL;
#if HAVE_BF16_DOT
        if (h.bf16_int4) { /* see the int4 x bf16 kernel: 64 bytes a pair of k */
            for (int64_t c = 0; c < width; c++) {
                const int64_t row = col + c, n = c / 16, at = 4 * (c % 16) + n / 2;
                const int shift = 4 * (int)(n % 2);
                for (int64_t i = 0; i < h.k; i++)
                    dst[(i / 2) * 64 + at + 2 * (i % 2)] |=
                        (uint8_t)((codes[row * h.k + i] & 15u) << shift);
                for (int64_t g = 0; g < groups; g++) {
                    const float sg = scales[row * groups + g];
                    const float z = zeros != NULL ? zeros[row * groups + g] : midpoint;
                    sc[g * PANEL + c] = sg;
                    if (!h.implied_zeros) zs[g * PANEL + c] = -(128.0f + z);
                }
            }
            continue;
        }
#endif
        if (h.vnni) { /* [k / 4][PANEL / 16][16 columns][4 k] signed codes; column sums */
            int32_t *sums = (int32_t *)zs;
            for (int64_t c = 0; c < width; c++) {
                const int64_t row = col + c;
                int32_t total = 0;
                for (int64_t i = 0; i < h.k; i++) {
                    const int code = (int)codes[row * h.k + i] - 128;
                    dst[(i / 4) * 4 * PANEL + (c / 16) * 64 + (c % 16) * 4 + i % 4] =
                        (uint8_t)(int8_t)code;
                    total += code;
                }
                sc[c] = scales[row];
                sums[c] = 128 * total;
            }
            continue;
        }
        for (int64_t c = 0; c < width; c++) {
            const int64_t row = col + c;
            for (int64_t i = 0; i < h.k; i++) {
                const unsigned code = q_code_at(codes, kind, h.k, row, i);
                uint8_t *at = dst + i * row_bytes;
                if (kind == QK_INT4 || kind == QK_NVFP4) {
                    const int64_t pair = c / (2 * VF), lane = c % VF, high = (c / VF) % 2;
                    at[pair * VF + lane] |= (uint8_t)((code & 15u) << (4 * high));
                } else {
                    at[c] = (uint8_t)code;
                }
            }
            for (int64_t g = 0; g < groups; g++) {
                const float s = scales[row * groups + g];
#if NV_LUT
                if (kind == QK_NVFP4) { /* bf16 A = bf16(s), then B = bf16(1.5 s) */
                    uint16_t *a = (uint16_t *)sc, *b = a + groups * PANEL;
                    a[g * PANEL + c] = f32_to_bf16(s);
                    b[g * PANEL + c] = f32_to_bf16(1.5f * s);
                    continue;
                }
#endif
                sc[g * PANEL + c] = s * unit;
                if (h.encoding == QENC_INT) {
                    const float z = zeros != NULL ? zeros[row * groups + g] : midpoint;
                    zs[g * PANEL + c] = -z * s;
                }
            }
        }
    }
    return 0;
}

/* -- the call ------------------------------------------------------------------------ */

/* A thread's scratch for the prepared activations, grown as needed and kept: a prefill
 * call would otherwise map and fault in megabytes every time. */
static _Thread_local float *q_scratch;
static _Thread_local size_t q_scratch_floats;

static float *q_scratch_floats_of(size_t floats) {
    if (floats > q_scratch_floats) {
        float *grown = realloc(q_scratch, floats * sizeof(float));
        if (grown == NULL) return NULL;
        q_scratch = grown;
        q_scratch_floats = floats;
    }
    return q_scratch;
}

/*
 * The decode schedule's panel: R rows of x (the shard's prepared rows, ldx apart)
 * against one panel, into `width` columns of out from col.
 */
static inline __attribute__((always_inline)) void qdecode_panel(
    const int R, const int kind, const float *x, int64_t ldx, const float *xsum,
    const uint8_t *codes, const float *sc, const float *zs, int64_t k, int64_t group,
    const void *bias, int64_t col, int64_t width, void *out, int64_t ldo, const int odt)
{
    enum { J = GEMM_VECS };
    float tile[GEMM_ROWS * PANEL] __attribute__((aligned(64)));
    for (int r = 0; r < R; r++)
        for (int64_t c = 0; c < PANEL; c++)
            tile[r * PANEL + c] = bias != NULL && c < width ? load_at(bias, col + c, odt) : 0.0f;
    const int64_t row_bytes = qk_row_bytes(kind), groups = k / group;
    const int dual = R <= 2;
    for (int64_t g = 0; g < groups; g++) {
        vf scv[J], acc[GEMM_ROWS][J], odd[GEMM_ROWS][J];
#pragma GCC unroll 4
        for (int j = 0; j < J; j++) {
            scv[j] = vf_load(sc + g * PANEL + j * VF);
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) acc[r][j] = odd[r][j] = vf_splat(0.0f);
        }
        const int64_t k1 = (g + 1) * group;
        int64_t i = g * group;
        if (dual)
            for (; i + 2 <= k1; i += 2) {
                const uint8_t *c0 = codes + i * row_bytes;
                for (int64_t off = 0; off < 2 * row_bytes; off += 64)
                    stream_prefetch(c0 + PREFETCH_AHEAD + off);
                vf wa[J], wb[J];
                q_load_k(kind, c0, wa);
                q_load_k(kind, c0 + row_bytes, wb);
                if (kind == QK_NVFP4)
#pragma GCC unroll 4
                    for (int j = 0; j < J; j++) {
                        wa[j] = vf_round_to_bf16(wa[j] * scv[j]);
                        wb[j] = vf_round_to_bf16(wb[j] * scv[j]);
                    }
#pragma GCC unroll 8
                for (int r = 0; r < R; r++) {
                    const float x0 = x[r * ldx + i], x1 = x[r * ldx + i + 1];
#pragma GCC unroll 4
                    for (int j = 0; j < J; j++) {
                        acc[r][j] += x0 * wa[j];
                        odd[r][j] += x1 * wb[j];
                    }
                }
            }
        for (; i < k1; i++) {
            const uint8_t *c0 = codes + i * row_bytes;
            if (!dual)
                for (int64_t off = 0; off < row_bytes; off += 64)
                    stream_prefetch(c0 + PREFETCH_AHEAD + off);
            vf wv[J];
            q_load_k(kind, c0, wv);
            if (kind == QK_NVFP4)
#pragma GCC unroll 4
                for (int j = 0; j < J; j++) wv[j] = vf_round_to_bf16(wv[j] * scv[j]);
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) {
                const float xv = x[r * ldx + i];
#pragma GCC unroll 4
                for (int j = 0; j < J; j++) acc[r][j] += xv * wv[j];
            }
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; r++)
#pragma GCC unroll 4
            for (int j = 0; j < J; j++) {
                float *t = tile + r * PANEL + j * VF;
                const vf sum = dual ? acc[r][j] + odd[r][j] : acc[r][j];
                vf v = vf_load(t);
                if (kind == QK_NVFP4)
                    v += sum;
                else if (kind == QK_FP8)
                    v += sum * scv[j];
                else
                    v += sum * scv[j] + xsum[r * groups + g] * vf_load(zs + g * PANEL + j * VF);
                vf_store(t, v);
            }
    }
    for (int r = 0; r < R; r++)
        for (int64_t c = 0; c < width; c += VF)
            vf_store_as(out, r * ldo + col + c, odt, vf_load(tile + r * PANEL + c));
}

#if NV_LUT
/* qdecode_panel for nvfp4 codes on the tables (NV_LUT): R <= NV_ROWS rows */
static inline __attribute__((always_inline)) void qdecode_nvfp4_panel(
    const int R, const float *x, int64_t ldx, const uint8_t *codes, const uint16_t *sa,
    const uint16_t *sb, int64_t k, const void *bias, int64_t col, int64_t width, void *out,
    int64_t ldo, const int odt, const int streamed)
{
    enum { J = GEMM_VECS };
    float tile[NV_ROWS * PANEL] __attribute__((aligned(64)));
    for (int r = 0; r < R; r++)
        for (int64_t c = 0; c < PANEL; c++)
            tile[r * PANEL + c] = bias != NULL && c < width ? load_at(bias, col + c, odt) : 0.0f;
    const int64_t row_bytes = PANEL / 2, groups = k / 16;
    for (int64_t g = 0; g < groups; g++) {
        vf acc_a[NV_ROWS][J], acc_b[NV_ROWS][J];
#pragma GCC unroll 4
        for (int j = 0; j < J; j++)
#pragma GCC unroll 2
            for (int r = 0; r < R; r++) acc_a[r][j] = acc_b[r][j] = vf_splat(0.0f);
        for (int64_t i = g * 16; i < (g + 1) * 16; i++) {
            const uint8_t *c0 = codes + i * row_bytes;
            if (streamed && i % 2 == 0)
                stream_prefetch(c0 + PREFETCH_AHEAD);
#pragma GCC unroll 4
            for (int jp = 0; jp < J / 2; jp++) {
                const vi v = vi_from_u8(c0 + jp * VF), lo = v & 15, hi = v >> 4;
                const vf a0 = vf_lut16(lo, NV_TABLE_A), b0 = vf_lut16(lo, NV_TABLE_B);
                const vf a1 = vf_lut16(hi, NV_TABLE_A), b1 = vf_lut16(hi, NV_TABLE_B);
#pragma GCC unroll 2
                for (int r = 0; r < R; r++) {
                    const float xv = x[r * ldx + i];
                    acc_a[r][2 * jp] += xv * a0;
                    acc_b[r][2 * jp] += xv * b0;
                    acc_a[r][2 * jp + 1] += xv * a1;
                    acc_b[r][2 * jp + 1] += xv * b1;
                }
            }
        }
#pragma GCC unroll 2
        for (int r = 0; r < R; r++)
#pragma GCC unroll 4
            for (int j = 0; j < J; j++) {
                float *t = tile + r * PANEL + j * VF;
                vf_store(t, vf_load(t) + acc_a[r][j] * vf_load_bf16(sa + g * PANEL + j * VF) +
                                acc_b[r][j] * vf_load_bf16(sb + g * PANEL + j * VF));
            }
    }
    for (int r = 0; r < R; r++)
        for (int64_t c = 0; c < width; c += VF)
            vf_store_as(out, r * ldo + col + c, odt, vf_load(tile + r * PANEL + c));
}

/* every row of a decode call against one nvfp4 panel, NV_ROWS at a time (the panel stays
 * in cache after the first block) */
static void qdecode_nvfp4_rows(int rows, const float *x, int64_t ldx, const uint8_t *codes,
                               const uint16_t *sa, const uint16_t *sb, int64_t k, const void *bias,
                               int64_t col, int64_t width, void *out, int64_t ldo, int odt)
{
    const int streamed = rows <= NV_ROWS;
    for (int r0 = 0; r0 < rows; r0 += NV_ROWS) {
        const float *xr = x + r0 * ldx;
        void *o = (char *)out + r0 * ldo * dtype_size(odt);
        if (rows - r0 >= 2)
            qdecode_nvfp4_panel(2, xr, ldx, codes, sa, sb, k, bias, col, width, o, ldo, odt,
                                streamed);
        else
            qdecode_nvfp4_panel(1, xr, ldx, codes, sa, sb, k, bias, col, width, o, ldo, odt,
                                streamed);
    }
}
#endif

/* A register block for `rows` (1 .. GEMM_ROWS) rows, the count a compile-time constant
 * of the always-inline BLOCK so that each gets its own unrolled accumulators. */
#define Q_ROWS_DISPATCH(rows, BLOCK, ...)                                                  \
    switch (rows) {                                                                        \
    case 1: BLOCK(1, __VA_ARGS__); break;                                                  \
    case 2: BLOCK(2, __VA_ARGS__); break;                                                  \
    case 3: BLOCK(3, __VA_ARGS__); break;                                                  \
    case 4: BLOCK(4, __VA_ARGS__); break;                                                  \
    case 5: BLOCK(5 <= GEMM_ROWS ? 5 : 1, __VA_ARGS__); break;                             \
    default: BLOCK(GEMM_ROWS, __VA_ARGS__); break;                                         \
    }
#define QDECODE_ROWS(KIND) Q_ROWS_DISPATCH(rows, qdecode_panel, KIND, QDECODE_ARGS)
#define QDECODE_ARGS x, ldx, xsum, codes, sc, zs, k, group, bias, col, width, out, ldo, odt

static void qdecode_dispatch(int kind, int rows, const float *x, int64_t ldx, const float *xsum,
                             const uint8_t *codes, const float *sc, const float *zs, int64_t k,
                             int64_t group, const void *bias, int64_t col, int64_t width,
                             void *out, int64_t ldo, int odt)
{
#if NV_LUT
    if (kind == QK_NVFP4) {
        qdecode_nvfp4_rows(rows, x, ldx, codes, (const uint16_t *)sc, (const uint16_t *)zs, k,
                           bias, col, width, out, ldo, odt);
        return;
    }
#endif
    switch (kind) {
    case QK_INT4: QDECODE_ROWS(QK_INT4); break;
    case QK_INT8: QDECODE_ROWS(QK_INT8); break;
    case QK_FP8: QDECODE_ROWS(QK_FP8); break;
    default: QDECODE_ROWS(QK_NVFP4); break;
    }
}

/* k's [k0, k0 + kc) of a panel dequantized to float32, `width` columns a row (group by
 * group: the scales are loaded once per group) */
static inline __attribute__((always_inline)) void qdequant_block(
    const int kind, const uint8_t *codes, const float *sc, const float *zs, int64_t k0,
    int64_t kc, int64_t group, int64_t width, float *dst)
{
    const int64_t row_bytes = qk_row_bytes(kind), vecs = width / VF, k_end = k0 + kc;
    for (int64_t k = k0; k < k_end;) {
        const int64_t g = k / group, g_end = (g + 1) * group < k_end ? (g + 1) * group : k_end;
        vf s[GEMM_VECS], z[GEMM_VECS];
#pragma GCC unroll 4
        for (int j = 0; j < GEMM_VECS; j++) {
#if NV_LUT
            if (kind == QK_NVFP4) { /* bf16 A and B (see NV_LUT) */
                s[j] = vf_load_bf16((const uint16_t *)sc + g * PANEL + j * VF);
                z[j] = vf_load_bf16((const uint16_t *)zs + g * PANEL + j * VF);
                continue;
            }
#endif
            s[j] = vf_load(sc + g * PANEL + j * VF);
            z[j] = kind <= QK_INT8 ? vf_load(zs + g * PANEL + j * VF) : vf_splat(0.0f);
        }
        for (; k < g_end; k++) {
            vf w[GEMM_VECS];
#if NV_LUT
            vi nib[GEMM_VECS]; /* nvfp4: the codes, for the tables */
            if (kind == QK_NVFP4)
#pragma GCC unroll 4
                for (int jp = 0; jp < GEMM_VECS / 2; jp++) {
                    const vi v = vi_from_u8(codes + k * row_bytes + jp * VF);
                    nib[2 * jp] = v & 15;
                    nib[2 * jp + 1] = v >> 4;
                }
            else
#endif
                q_load_k(kind, codes + k * row_bytes, w);
            float *row = dst + (k - k0) * width;
#pragma GCC unroll 4
            for (int j = 0; j < GEMM_VECS; j++) {
                if (j >= vecs) break;
                vf v;
#if NV_LUT
                if (kind == QK_NVFP4)
                    v = vf_lut16(nib[j], NV_TABLE_A) * s[j] + vf_lut16(nib[j], NV_TABLE_B) * z[j];
                else
#endif
                if (kind == QK_NVFP4)
                    v = vf_round_to_bf16(w[j] * s[j]);
                else if (kind == QK_FP8)
                    v = w[j] * s[j];
                else
                    v = w[j] * s[j] + z[j];
                vf_store(row + j * VF, v);
            }
        }
    }
}

static void qdequant_dispatch(int kind, const uint8_t *codes, const float *sc, const float *zs,
                              int64_t k0, int64_t kc, int64_t group, int64_t width, float *dst)
{
    switch (kind) {
    case QK_INT4: qdequant_block(QK_INT4, codes, sc, zs, k0, kc, group, width, dst); break;
    case QK_INT8: qdequant_block(QK_INT8, codes, sc, zs, k0, kc, group, width, dst); break;
    case QK_FP8: qdequant_block(QK_FP8, codes, sc, zs, k0, kc, group, width, dst); break;
    default: qdequant_block(QK_NVFP4, codes, sc, zs, k0, kc, group, width, dst); break;
    }
}

/* The prefill schedule's work item: rows [row0, row_end) against one panel. */
static void qprefill_item(const qgemm_header *h, int kind, const float *x, int64_t ldx,
                          const uint8_t *panel, int64_t col, int64_t width, int64_t row0,
                          int64_t row_end, const void *bias, void *out, int64_t ldo, int odt)
{
    float widened[GEMM_KC * PANEL] __attribute__((aligned(64)));
    float tile[GEMM_CHUNK * PANEL] __attribute__((aligned(64)));
    const float *sc = (const float *)(panel + h->code_bytes);
    const float *zs = q_second_scales(kind, sc, h->groups);
    for (int64_t k0 = 0; k0 < h->k; k0 += GEMM_KC) {
        const int64_t kc = h->k - k0 < GEMM_KC ? h->k - k0 : GEMM_KC;
        qdequant_dispatch(kind, panel, sc, zs, k0, kc, h->group, width, widened);
        const int first = k0 == 0, last = k0 + kc == h->k;
        for (int64_t row = row0; row < row_end; row += GEMM_ROWS) {
            const int rows = row_end - row < GEMM_ROWS ? (int)(row_end - row) : GEMM_ROWS;
            prefill_panel(rows, x + row * ldx + k0, ldx, widened, width, kc,
                          tile + (row - row0) * PANEL, first, last, bias, col,
                          (char *)out + row * ldo * dtype_size(odt), ldo, odt);
        }
    }
}

#if HAVE_QVNNI
/*
 * W8A8 on VNNI: activations quantized to int8 codes (quant_act.h's rounding, so the
 * codes are the ones the reference's QDQ produces), offset by 128 into the unsigned
 * operand of vpdpbusd, multiplied with the signed weight codes 4 k at a time into int32
 * sums (exact), then out = (sum - 128 x the weight column's sum) x activation scale x
 * weight scale. 64 multiply-adds per instruction against the float path's 16.
 */
static void qvnni_quantize_rows(const float *x, int64_t ldx, int64_t m, int64_t k,
                                const qgemm_header *h, float static_scale, uint8_t *u,
                                float *sx)
{
    float tensor_scale = static_scale;
    if (h->act_dynamic && h->act_strategy == QSTRAT_TENSOR) {
        float top = 0.0f;
        for (int64_t r = 0; r < m; r++) {
            const float t = max_abs(x + r * ldx, k);
            top = t > top ? t : top;
        }
        tensor_scale = dynamic_scale(QACT_INT8, top, 0.0f);
    }
#pragma omp parallel for if (m * k >= (1 << 15))
    for (int64_t r = 0; r < m; r++) {
        const float *row = x + r * ldx;
        const float scale = h->act_dynamic && h->act_strategy == QSTRAT_TOKEN
                                ? dynamic_scale(QACT_INT8, max_abs(row, k), 0.0f)
                                : tensor_scale;
        sx[r] = scale;
        const __m512 s = _mm512_set1_ps(scale);
        uint8_t *dst = u + r * k;
        int64_t i = 0;
        for (; i + 16 <= k; i += 16) {
            const vf t = vf_clamp((vf)_mm512_div_ps(_mm512_loadu_ps(row + i), s), -128.0f, 127.0f);
            const vf q = (t + QACT_ROUND_MAGIC) - QACT_ROUND_MAGIC;
            const __m512i codes = _mm512_add_epi32(_mm512_cvttps_epi32((__m512)q),
                                                   _mm512_set1_epi32(128));
            _mm_storeu_si128((__m128i *)(dst + i), _mm512_cvtepi32_epi8(codes));
        }
        for (; i < k; i++) {
            float t = row[i] / scale;
            t = t < -128.0f ? -128.0f : t > 127.0f ? 127.0f : t;
            volatile float shifted = t + QACT_ROUND_MAGIC;
            dst[i] = (uint8_t)((int)(shifted - QACT_ROUND_MAGIC) + 128);
        }
    }
}

static inline __attribute__((always_inline)) void qvnni_block(
    const int R, const uint8_t *u, int64_t k, const float *sx, const uint8_t *panel,
    const float *sw, const int32_t *sums, const void *bias, int64_t col, int64_t width,
    void *out, int64_t ldo, const int odt, const int streamed)
{
    __m512i acc[GEMM_ROWS][4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++)
#pragma GCC unroll 6
        for (int r = 0; r < R; r++) acc[r][j] = _mm512_setzero_si512();
    const int64_t quads = k / 4;
    for (int64_t q = 0; q < quads; q++) {
        const uint8_t *w = panel + q * 4 * PANEL;
        if (streamed)
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) stream_prefetch((const char *)w + 1024 + 64 * j);
        __m512i wv[4];
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) wv[j] = _mm512_loadu_si512(w + 64 * j);
#pragma GCC unroll 6
        for (int r = 0; r < R; r++) {
            int32_t quad;
            memcpy(&quad, u + r * k + 4 * q, sizeof quad);
            const __m512i xv = _mm512_set1_epi32(quad);
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) acc[r][j] = _mm512_dpbusd_epi32(acc[r][j], xv, wv[j]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 4 && j * 16 < width; j++) {
            const __m512i exact = _mm512_sub_epi32(acc[r][j], _mm512_loadu_si512(sums + 16 * j));
            vf v = (vf)_mm512_cvtepi32_ps(exact) * ((vf)_mm512_loadu_ps(sw + 16 * j) * sx[r]);
            if (bias != NULL) v += vf_load_as(bias, col + 16 * j, odt);
            vf_store_as(out, r * ldo + col + 16 * j, odt, v);
        }
}

static void qvnni_rows(int rows, const uint8_t *u, int64_t k, const float *sx,
                       const uint8_t *panel, const float *sw, const int32_t *sums,
                       const void *bias, int64_t col, int64_t width, void *out, int64_t ldo,
                       int odt, int streamed)
{
    Q_ROWS_DISPATCH(rows, qvnni_block, u, k, sx, panel, sw, sums, bias, col, width, out, ldo,
                    odt, streamed)
}

static int qgemm_vnni(const qgemm_header *h, const char *base, const void *x, int64_t ldx,
                      const void *bias, void *out, int64_t ldo, int64_t m, int adt)
{
    const int64_t k = h->k;
    const float *act_scales = (const float *)(base + h->act_scale_off);
    int sets = 1;
    if (!h->act_dynamic)
        for (int64_t s = 1; s < h->shards; s++)
            if (act_scales[s] != act_scales[0]) sets = (int)h->shards;
    const size_t bytes = (size_t)(sets * m * k), floats = (size_t)(m * k) + sets * m;
    float *scratch = q_scratch_floats_of(floats + bytes / 4 + 2);
    if (scratch == NULL) return -3;
    float *rows = scratch, *sx = rows + m * k;
    uint8_t *u = (uint8_t *)(sx + sets * m);
    const float *src = (const float *)x;
    int64_t ld = ldx;
    if (adt != DTYPE_F32) {
#pragma omp parallel for if (m * k >= (1 << 16))
        for (int64_t r = 0; r < m; r++)
            for (int64_t i = 0; i < k; i++) rows[r * k + i] = load_at(x, r * ldx + i, adt);
        src = rows;
        ld = k;
    }
    for (int set = 0; set < sets; set++)
        qvnni_quantize_rows(src, ld, m, k, h, act_scales[set], u + set * m * k, sx + set * m);
    const uint8_t *panels = (const uint8_t *)base + h->panels_off;
    const int streamed = m <= GEMM_ROWS;
    const int64_t chunks = (m + GEMM_CHUNK - 1) / GEMM_CHUNK;
#pragma omp parallel for collapse(2) schedule(static) if (h->panels * chunks > 1)
    for (int64_t p = 0; p < h->panels; p++)
        for (int64_t c = 0; c < chunks; c++) {
            int64_t shard, col, width;
            qpanel_place(h, p, &shard, &col, &width);
            const int set = sets > 1 ? (int)shard : 0;
            const uint8_t *panel = panels + p * h->panel_bytes;
            const float *sw = (const float *)(panel + h->code_bytes);
            const int32_t *sums = (const int32_t *)(sw + PANEL);
            const int64_t end = (c + 1) * GEMM_CHUNK < m ? (c + 1) * GEMM_CHUNK : m;
            for (int64_t row = c * GEMM_CHUNK; row < end; row += GEMM_ROWS) {
                const int n_rows = end - row < GEMM_ROWS ? (int)(end - row) : GEMM_ROWS;
                qvnni_rows(n_rows, u + (set * m + row) * k, k, sx + set * m + row, panel, sw,
                           sums, bias, col, width, (char *)out + row * ldo * dtype_size(adt),
                           ldo, adt, streamed);
            }
        }
    return 0;
}
#endif

/* sums[r][g] of each group's values of rows [m, k] (ld apart) */
static void q_group_sums(const float *rows, int64_t ld, int64_t m, int64_t k, int64_t group,
                         float *sums)
{
    const int64_t groups = k / group;
    for (int64_t r = 0; r < m; r++)
        for (int64_t g = 0; g < groups; g++) {
            const float *v = rows + r * ld + g * group;
            vf acc = vf_splat(0.0f);
            int64_t i = 0;
            for (; i + VF <= group; i += VF) acc += vf_load(v + i);
            float t = vf_sum(acc);
            for (; i < group; i++) t += v[i];
            sums[r * groups + g] = t;
        }
}

#if HAVE_BF16_DOT
/*
 * int4 weights x bf16 activations on vdpbf16ps (bf16_int4 panels): per pair of k, 64
 * bytes hold the panel's 64 columns' two codes, one 16-bit word per (column mod 16, k)
 * with the four columns 16 n + c in its nibbles n. (word >> 4 n) & 0xf | 0x4300 is the
 * bf16 of 128 + code (exact), so a shift and a vpternlogd make each vector of bf16 pairs
 * and one vdpbf16ps multiplies 16 columns by two k of x, with no shuffles. Per group the
 * sums are scaled: out += s (sum - (128 + zero) (sum of x)), the offset's share removed
 * with the group's activation sum. Products are exact, the sums float32 (the 128 offset
 * costs ~4 of their 24 bits, far below bf16 activations' 8). A panel stores per group
 * and column the scale and -(128 + zero), or only the scale for symmetric codes.
 */
/* Decode consumes a panel's bytes ~4x slower than the dense kernel, too slowly for the
 * hardware prefetcher to hide DRAM latency: prefetch ~300 cycles of work ahead. */
#define QINT4_PREFETCH_AHEAD 8192
/* From this many rows a panel is dequantized to bf16 once rather than unpacked per block
 * of rows (7 vector ops per pair of k next to a block's 24 vdpbf16ps): the two cross at
 * ~64 rows on Zen 5 (ci/bench_qgemm.py --act-dtype bfloat16), blocks ahead below. */
#define QINT4_DEQUANTIZE_ROWS 64
/* One pair of k of a bf16_int4 panel (layout above) into R rows' accumulators. */
static inline __attribute__((always_inline)) void qint4_bf16_pair(
    const int R, const uint16_t *x, int64_t ldx, const uint8_t *codes, int64_t i,
    const int streamed, __m512 acc[GEMM_ROWS][4])
{
    const __m512i low = _mm512_set1_epi16(0x000f), exponent = _mm512_set1_epi16(0x4300);
    const uint8_t *c0 = codes + i * 64;
    if (streamed)
        stream_prefetch((const char *)c0 + QINT4_PREFETCH_AHEAD);
    const __m512i b = _mm512_loadu_si512(c0);
    __m512bh w[4]; /* (b >> 4 n) & 0x000f | 0x4300: vpternlogd's (A & B) | C */
    w[0] = (__m512bh)_mm512_ternarylogic_epi32(b, low, exponent, 0xea);
    w[1] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(b, 4), low, exponent, 0xea);
    w[2] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(b, 8), low, exponent, 0xea);
    w[3] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(b, 12), low, exponent, 0xea);
#pragma GCC unroll 6
    for (int r = 0; r < R; r++) {
        uint32_t pair;
        memcpy(&pair, x + r * ldx + 2 * i, sizeof pair);
        const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)pair);
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], w[j], xv);
    }
}

static inline __attribute__((always_inline)) void qint4_bf16_block(
    const int R, const uint16_t *x, int64_t ldx, const float *xsum, int64_t groups,
    const uint8_t *codes, const float *sc, const float *zs, int64_t group, const void *bias,
    int64_t col, int64_t width, void *out, int64_t ldo, const int odt, const int streamed)
{
    float tile[GEMM_ROWS * PANEL] __attribute__((aligned(64)));
    for (int r = 0; r < R; r++)
        for (int64_t c = 0; c < PANEL; c++)
            tile[r * PANEL + c] = bias != NULL && c < width ? load_at(bias, col + c, odt) : 0.0f;
    const int64_t pairs_per_group = group / 2;
    /* one or two rows: two accumulator sets (alternate pairs) hide vdpbf16ps' latency */
    const int S = R <= 2 ? 2 : 1;
    for (int64_t g = 0; g < groups; g++) {
        __m512 acc[2][GEMM_ROWS][4];
#pragma GCC unroll 2
        for (int s = 0; s < S; s++)
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++)
#pragma GCC unroll 6
                for (int r = 0; r < R; r++) acc[s][r][j] = _mm512_setzero_ps();
        const int64_t first = g * pairs_per_group, end = first + pairs_per_group;
        int64_t i = first;
        for (; i + S <= end; i += S)
#pragma GCC unroll 2
            for (int s = 0; s < S; s++)
                qint4_bf16_pair(R, x, ldx, codes, i + s, streamed, acc[s]);
        if (i < end) qint4_bf16_pair(R, x, ldx, codes, i, streamed, acc[0]);
        if (S == 2)
#pragma GCC unroll 6
            for (int r = 0; r < R; r++)
#pragma GCC unroll 4
                for (int j = 0; j < 4; j++) acc[0][r][j] = acc[0][r][j] + acc[S - 1][r][j];
#pragma GCC unroll 6
        for (int r = 0; r < R; r++)
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) {
                float *t = tile + r * PANEL + j * VF;
                const vf s = vf_load(sc + g * PANEL + j * VF), sum = (vf)acc[0][r][j];
                if (zs != NULL) /* s (sum - (128 + zero) xsum) */
                    vf_store(t, vf_load(t) + (sum + xsum[r * groups + g] *
                                                        vf_load(zs + g * PANEL + j * VF)) * s);
                else /* the midpoint's -(128 + zero) x xsum was folded into xsum */
                    vf_store(t, vf_load(t) + (sum + xsum[r * groups + g]) * s);
            }
    }
    for (int r = 0; r < R; r++)
        for (int64_t c = 0; c < width; c += VF)
            vf_store_as(out, r * ldo + col + c, odt, vf_load(tile + r * PANEL + c));
}

static void qint4_bf16_rows(int rows, const uint16_t *x, int64_t ldx, const float *xsum,
                            int64_t groups, const uint8_t *codes, const float *sc,
                            const float *zs, int64_t group, const void *bias, int64_t col,
                            int64_t width, void *out, int64_t ldo, int odt, int streamed)
{
    Q_ROWS_DISPATCH(rows, qint4_bf16_block, x, ldx, xsum, groups, codes, sc, zs, group, bias,
                    col, width, out, ldo, odt, streamed)
}

/*
 * A bf16_int4 panel's weights as bf16((code - zero) x scale), the rounding of a bf16
 * model's dequantized weight (the product is exact in float32), in gemm_bf16.h's pair
 * layout (width columns): per pair of k, a vector of 16 columns' (even k, odd k) pairs.
 * Widened to 32 bits, the pair's words 2 d + w (d < 8) and 16 + 2 d + w hold in nibble n
 * the codes of columns 16 n + d and 16 n + 8 + d at k = 2 pair + w: already in pair
 * order, so 2^23 + code (a mask and an or of float32 bits), less 2^23 + zero, times the
 * scale, convert to the two halves of one vector of pairs.
 */
static void qint4_bf16_dequantize(const uint8_t *codes, const float *sc, const float *zs,
                                  int64_t k, int64_t group, int64_t width, uint16_t *pairs)
{
    const __m512i nibble = _mm512_set1_epi32(0xf), magic = _mm512_set1_epi32(0x4b000000);
    static const int32_t low_twice[16] = {0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7};
    const __m512i twice = _mm512_loadu_si512(low_twice), eight = _mm512_set1_epi32(8);
    const int64_t vectors = width / VF, pairs_per_group = group / 2;
    for (int64_t g = 0; g < k / group; g++) {
        __m512 scale[2][4], offset[2][4]; /* per half: each column's twice, in pair order */
        for (int64_t j = 0; j < vectors; j++) {
            const __m512 s = _mm512_loadu_ps(sc + g * PANEL + j * VF);
            /* 2^23 + zero, zs holding -(128 + zero): exact integers in float32 */
            const __m512 z = zs != NULL ? _mm512_sub_ps(_mm512_set1_ps(8388480.0f),
                                                        _mm512_loadu_ps(zs + g * PANEL + j * VF))
                                        : _mm512_set1_ps(8388616.0f); /* symmetric: 8 */
            for (int h = 0; h < 2; h++) {
                const __m512i at = h ? _mm512_add_epi32(twice, eight) : twice;
                scale[h][j] = _mm512_permutexvar_ps(at, s);
                offset[h][j] = _mm512_permutexvar_ps(at, z);
            }
        }
        for (int64_t i = g * pairs_per_group; i < (g + 1) * pairs_per_group; i++) {
            const __m512i b = _mm512_loadu_si512(codes + i * 64);
            const __m512i half[2] = {_mm512_cvtepu16_epi32(_mm512_castsi512_si256(b)),
                                     _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(b, 1))};
            for (int64_t j = 0; j < vectors; j++) {
                __m512 f[2];
                for (int h = 0; h < 2; h++) {
                    const __m512i v = _mm512_ternarylogic_epi32(
                        _mm512_srli_epi32(half[h], 4 * (unsigned)j), nibble, magic, 0xea);
                    f[h] = _mm512_mul_ps(_mm512_sub_ps(_mm512_castsi512_ps(v), offset[h][j]),
                                         scale[h][j]);
                }
                _mm512_storeu_si512(pairs + (i * width + j * VF) * 2,
                                    (__m512i)_mm512_cvtne2ps_pbh(f[1], f[0]));
            }
        }
    }
}

/* A thread's dequantized panel (qint4_bf16_prefill), kept between calls. */
static _Thread_local uint16_t *qi4_pairs;
static _Thread_local size_t qi4_pairs_values;

/*
 * The prefill schedule (m >= QINT4_DEQUANTIZE_ROWS): a work item dequantizes its panel
 * once and runs the bf16 GEMM's register blocks over all its rows, so the dequantization
 * is paid once per panel (and per row range when the panels alone cannot occupy the
 * threads), not per block of rows.
 */
static int qint4_bf16_prefill(const qgemm_header *h, const uint8_t *panels, const uint16_t *x,
                              int64_t ldx, const uint16_t *bias, uint16_t *out, int64_t ldo,
                              int64_t m)
{
    const int64_t k = h->k, threads = omp_get_max_threads();
    int64_t ranges = (2 * threads + h->panels - 1) / h->panels;
    if (ranges > (m + GEMM_CHUNK - 1) / GEMM_CHUNK) ranges = (m + GEMM_CHUNK - 1) / GEMM_CHUNK;
    const int64_t range_rows = (m + ranges - 1) / ranges;
    int failed = 0;
#pragma omp parallel for collapse(2) schedule(static) reduction(| : failed)
    for (int64_t p = 0; p < h->panels; p++)
        for (int64_t r = 0; r < ranges; r++) {
            const size_t values = (size_t)(k * PANEL);
            if (values > qi4_pairs_values) {
                uint16_t *grown = realloc(qi4_pairs, values * sizeof *grown);
                if (grown == NULL) {
                    failed = 1;
                    continue;
                }
                qi4_pairs = grown;
                qi4_pairs_values = values;
            }
            int64_t shard, col, width;
            qpanel_place(h, p, &shard, &col, &width);
            const uint8_t *panel = panels + p * h->panel_bytes;
            const float *sc = (const float *)(panel + h->code_bytes);
            qint4_bf16_dequantize(panel, sc, h->implied_zeros ? NULL : sc + h->groups * PANEL,
                                  k, h->group, width, qi4_pairs);
            const int64_t end = (r + 1) * range_rows < m ? (r + 1) * range_rows : m;
            for (int64_t row = r * range_rows; row < end; row += BF16_ROWS) {
                const int rows = end - row < BF16_ROWS ? (int)(end - row) : BF16_ROWS;
                bf16_rows_times_panel(rows, width, x + row * ldx, ldx, qi4_pairs, k / 2, bias,
                                      col, out + row * ldo, ldo, 0);
            }
        }
    return failed ? -3 : 0;
}

/* The bf16_int4 schedule: decode sizes stream each panel once; up to
 * QINT4_DEQUANTIZE_ROWS rows run blocks of GEMM_ROWS rows over a panel kept in cache,
 * chunk by chunk; more rows take qint4_bf16_prefill. */
static int qgemm_int4_bf16(const qgemm_header *h, const char *base, const uint16_t *x,
                           int64_t ldx, const void *bias, void *out, int64_t ldo, int64_t m)
{
    const int64_t k = h->k, groups = h->groups;
    const int64_t *perm = h->has_perm ? (const int64_t *)(base + h->perm_off) : NULL;
    const int blocks = m < QINT4_DEQUANTIZE_ROWS; /* which need the groups' sums of x */
    const size_t rows_floats = perm != NULL ? (size_t)(m * k + 1) / 2 + 1 : 0;
    float *scratch = q_scratch_floats_of(rows_floats + (blocks ? (size_t)(m * groups) : 0) + 1);
    if (scratch == NULL) return -3;
    if (perm != NULL) {
        uint16_t *permuted = (uint16_t *)scratch;
#pragma omp parallel for if (m * k >= (1 << 16))
        for (int64_t r = 0; r < m; r++)
            for (int64_t i = 0; i < k; i++) permuted[r * k + i] = x[r * ldx + perm[i]];
        x = permuted;
        ldx = k;
    }
    const uint8_t *panels = (const uint8_t *)base + h->panels_off;
    if (!blocks)
        return qint4_bf16_prefill(h, panels, x, ldx, (const uint16_t *)bias, (uint16_t *)out,
                                  ldo, m);
    float *sums = scratch + rows_floats;
    const float midpoint = 8.0f; /* symmetric int4's zero point */
#pragma omp parallel for if (m * k >= (1 << 16))
    for (int64_t r = 0; r < m; r++)
        for (int64_t g = 0; g < groups; g++) {
            const uint16_t *v = x + r * ldx + g * h->group;
            vf acc = vf_splat(0.0f);
            int64_t i = 0;
            for (; i + VF <= h->group; i += VF) acc += vf_load_bf16(v + i);
            float t = vf_sum(acc);
            for (; i < h->group; i++) t += bf16_to_f32(v[i]);
            sums[r * groups + g] = h->implied_zeros ? -(128.0f + midpoint) * t : t;
        }
    const int streamed = m <= GEMM_ROWS;
    const int64_t chunks = (m + GEMM_CHUNK - 1) / GEMM_CHUNK;
#pragma omp parallel for collapse(2) schedule(static) if (h->panels * chunks > 1)
    for (int64_t p = 0; p < h->panels; p++)
        for (int64_t c = 0; c < chunks; c++) {
            int64_t shard, col, width;
            qpanel_place(h, p, &shard, &col, &width);
            const uint8_t *panel = panels + p * h->panel_bytes;
            const float *sc = (const float *)(panel + h->code_bytes);
            const float *zs = h->implied_zeros ? NULL : sc + groups * PANEL;
            const int64_t end = (c + 1) * GEMM_CHUNK < m ? (c + 1) * GEMM_CHUNK : m;
            for (int64_t row = c * GEMM_CHUNK; row < end; row += GEMM_ROWS) {
                const int n_rows = end - row < GEMM_ROWS ? (int)(end - row) : GEMM_ROWS;
                qint4_bf16_rows(n_rows, x + row * ldx, ldx, sums + row * groups, groups, panel,
                                sc, zs, h->group, bias, col, width,
                                (char *)out + row * ldo * 2, ldo, DTYPE_BF16, streamed);
            }
        }
    return 0;
}
#endif

#if HAVE_BF16_DOT
_Static_assert(PANEL == BF16_PANEL, "a quantized panel is one bf16 pair panel");
/*
 * bf16 activations on a level with vdpbf16ps (weight-only schemes): a chunk's panel is
 * dequantized whole, rounded to bf16, into gemm_bf16.h's pair layout, and its register
 * blocks run over it: the products a bf16 model's GEMM computes, at its speed.
 */
static void qprefill_bf16_item(const qgemm_header *h, int kind, const uint16_t *x, int64_t ldx,
                               const uint8_t *panel, int64_t col, int64_t width, int64_t row0,
                               int64_t row_end, const uint16_t *bias, uint16_t *out,
                               int64_t ldo, uint16_t *pairs_buf, float *block)
{
    const float *sc = (const float *)(panel + h->code_bytes);
    const float *zs = q_second_scales(kind, sc, h->groups);
    const int64_t vecs = width / VF;
    for (int64_t k0 = 0; k0 < h->k; k0 += GEMM_KC) {
        const int64_t kc = h->k - k0 < GEMM_KC ? h->k - k0 : GEMM_KC; /* even: K and KC are */
        qdequant_dispatch(kind, panel, sc, zs, k0, kc, h->group, width, block);
        for (int64_t i = 0; i < kc / 2; i++) {
            uint16_t *dst = pairs_buf + ((k0 / 2 + i) * width) * 2;
            for (int64_t j = 0; j < vecs; j++) {
                const __m512i even = _mm512_cvtepu16_epi32(
                    (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(block + 2 * i * width + j * VF)));
                const __m512i odd = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(
                    _mm512_loadu_ps(block + (2 * i + 1) * width + j * VF)));
                _mm512_storeu_si512(dst + j * 2 * VF,
                                    _mm512_or_si512(even, _mm512_slli_epi32(odd, 16)));
            }
        }
    }
    for (int64_t row = row0; row < row_end; row += BF16_ROWS) {
        const int rows = row_end - row < BF16_ROWS ? (int)(row_end - row) : BF16_ROWS;
        bf16_rows_times_panel(rows, width, x + row * ldx, ldx, pairs_buf, h->k / 2, bias, col,
                              out + row * ldo, ldo, 0);
    }
}

/* The bf16 schedule: x [m, k] bf16 (permuted into act-order first), out bf16; with
 * set_values, one set of rows per shard that many values apart (already permuted). */
static int qgemm_bf16(const qgemm_header *h, int kind, const uint16_t *x, int64_t ldx,
                      int64_t set_values, const uint8_t *panels, const int64_t *perm,
                      const uint16_t *bias, uint16_t *out, int64_t ldo, int64_t m)
{
    const int64_t k = h->k;
    if (perm != NULL) {
        uint16_t *permuted = (uint16_t *)q_scratch_floats_of((size_t)(m * k + 1) / 2 + 1);
        if (permuted == NULL) return -3;
#pragma omp parallel for if (m * k >= (1 << 16))
        for (int64_t r = 0; r < m; r++)
            for (int64_t i = 0; i < k; i++) permuted[r * k + i] = x[r * ldx + perm[i]];
        x = permuted;
        ldx = k;
    }
    const int64_t chunks = (m + GEMM_CHUNK - 1) / GEMM_CHUNK;
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        uint16_t *pairs_buf = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)(k * PANEL));
        float *block = (float *)malloc(sizeof(float) * GEMM_KC * PANEL);
        failed = pairs_buf == NULL || block == NULL;
#pragma omp for collapse(2) schedule(static)
        for (int64_t p = 0; p < h->panels; p++)
            for (int64_t c = 0; c < chunks; c++) {
                if (pairs_buf == NULL || block == NULL) continue;
                int64_t shard, col, width;
                qpanel_place(h, p, &shard, &col, &width);
                const int64_t end = (c + 1) * GEMM_CHUNK < m ? (c + 1) * GEMM_CHUNK : m;
                qprefill_bf16_item(h, kind, x + shard * set_values, ldx,
                                   panels + p * h->panel_bytes, col, width, c * GEMM_CHUNK, end,
                                   bias, out, ldo, pairs_buf, block);
            }
        free(pairs_buf);
        free(block);
    }
    return failed ? -3 : 0;
}
#endif

/*
 * The activations every shard's panels read: x as float32 rows, quantize-dequantized
 * per the scheme (one set per shard where the shards' static / global scales differ),
 * then permuted into act-order; with `with_sums`, each group's sum per row and set.
 * *ld: the rows' stride (sets are m x k floats apart). NULL when memory is short.
 */
static const float *qprepare_rows(const qgemm_header *h, const char *base, const void *x,
                                  int64_t ldx, int64_t m, int adt, int with_sums, int *sets,
                                  int64_t *ld, const float **sums)
{
    const int64_t k = h->k;
    const float *act_scales = (const float *)(base + h->act_scale_off);
    const int64_t *perm = h->has_perm ? (const int64_t *)(base + h->perm_off) : NULL;
    const int act = (int)h->act;
    int n_sets = 1;
    if (act != QACT_NONE && (!h->act_dynamic || act == QACT_NVFP4))
        for (int64_t s = 1; s < h->shards; s++)
            if (act_scales[s] != act_scales[0]) n_sets = (int)h->shards;
    *sets = n_sets;
    const size_t rows = (size_t)(m * k), groups = (size_t)(m * h->groups);
    const int convert = adt != DTYPE_F32, staged = act != QACT_NONE && perm != NULL;
    const int own_sets = act != QACT_NONE || perm != NULL; /* else the source is the set */
    float *scratch = q_scratch_floats_of((convert + staged + (own_sets ? n_sets : 0)) * rows +
                                         (with_sums ? n_sets * groups : 0) + 1);
    if (scratch == NULL) return NULL;
    float *converted = scratch, *staging = converted + (convert ? rows : 0);
    float *prepared = staging + (staged ? rows : 0);
    const float *src = (const float *)x;
    int64_t src_ld = ldx;
    if (convert) {
#pragma omp parallel for if (m * k >= (1 << 16))
        for (int64_t r = 0; r < m; r++)
            for (int64_t i = 0; i < k; i++)
                converted[r * k + i] = load_at(x, r * ldx + i, adt);
        src = converted;
        src_ld = k;
    }
    if (!own_sets) {
        prepared = (float *)src; /* read only */
    } else {
        for (int set = 0; set < n_sets; set++) {
            float *dst = prepared + set * rows;
            const float *cur = src;
            int64_t cur_ld = src_ld;
            if (act != QACT_NONE) {
                float *qdq = perm != NULL ? staging : dst;
                if (quantize_dequantize_rows(cur, cur_ld, m, k, act, (int)h->act_strategy,
                                             (int)h->act_dynamic, h->act_group,
                                             act_scales[set], qdq))
                    return NULL;
                cur = qdq;
                cur_ld = k;
            }
            if (perm != NULL) {
#pragma omp parallel for if (m * k >= (1 << 16))
                for (int64_t r = 0; r < m; r++)
                    for (int64_t i = 0; i < k; i++)
                        dst[r * k + i] = cur[r * cur_ld + perm[i]];
            }
        }
        src_ld = k;
    }
    *ld = src_ld;
    float *sum_base = scratch + (convert + staged + (own_sets ? n_sets : 0)) * rows;
    if (with_sums)
        for (int set = 0; set < n_sets; set++)
            q_group_sums(prepared + set * rows, src_ld, m, k, h->group,
                         sum_base + set * groups);
    *sums = sum_base;
    return prepared;
}

/*
 * out [m, n] = QDQ(x [m, k]) dequant(W)^T (+ bias [n]): x, bias and out in adt (float32,
 * bf16 or fp16), W packed by qgemm_pack of this level's library. Returns 0; -1 for a
 * buffer not packed by this library or bad sizes, -3 when memory is short.
 */
#if HAVE_BF16_DOT
/* A thread's bf16 copy of quantize-dequantized activations (qgemm_qdq_bf16). */
static _Thread_local uint16_t *q_qdq_bf16;
static _Thread_local size_t q_qdq_bf16_values;

/*
 * Activation-quantized schemes of a bf16 model from the prefill sizes: the activations'
 * quantize-dequantize values (float32, exact) rounded to bf16, as a bf16 model's own
 * quantize-dequantize returns them, times the panels dequantized to bf16 on the bf16
 * schedule: vdpbf16ps instead of float32 multiply-adds, at ~2x their rate.
 */
static int qgemm_qdq_bf16(const qgemm_header *h, int kind, const float *rows, int64_t ld,
                          int sets, const uint8_t *panels, const uint16_t *bias,
                          uint16_t *out, int64_t ldo, int64_t m)
{
    const int64_t k = h->k;
    const size_t values = (size_t)(sets * m * k);
    if (values > q_qdq_bf16_values) {
        uint16_t *grown = realloc(q_qdq_bf16, values * sizeof *grown);
        if (grown == NULL) return -3;
        q_qdq_bf16 = grown;
        q_qdq_bf16_values = values;
    }
    uint16_t *x = q_qdq_bf16;
#pragma omp parallel for collapse(2) if (values >= (1 << 16))
    for (int s = 0; s < sets; s++)
        for (int64_t r = 0; r < m; r++) {
            const float *src = rows + s * m * k + r * ld;
            uint16_t *dst = x + (s * m + r) * k;
            int64_t i = 0;
            for (; i + VF <= k; i += VF)
                _mm256_storeu_si256((__m256i *)(dst + i),
                                    (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + i)));
            for (; i < k; i++) dst[i] = f32_to_bf16(src[i]);
        }
    return qgemm_bf16(h, kind, x, k, sets > 1 ? m * k : 0, panels, NULL, bias, out, ldo, m);
}
#endif

int qgemm(const void *x, int64_t ldx, const void *packed, const void *bias, void *out,
          int64_t ldo, int64_t m, int adt)
{
    const qgemm_header *h = (const qgemm_header *)packed;
    if (h->magic != QGEMM_MAGIC || h->panel != PANEL || m < 0 || ldx < h->k || ldo < h->n ||
        adt < DTYPE_F32 || adt > DTYPE_F16)
        return -1;
    if (m == 0) return 0;
    const char *base = (const char *)packed;
    const int kind = qkind(h->encoding, h->bits);
    const int decode = m <= GEMM_ROWS;
#if HAVE_QVNNI
    if (h->vnni)
        return qgemm_vnni(h, base, x, ldx, bias, out, ldo, m, adt);
#endif
#if HAVE_BF16_DOT
    if (h->bf16_int4) {
        if (adt != DTYPE_BF16) return -1; /* packed for bf16 activations */
        return qgemm_int4_bf16(h, base, (const uint16_t *)x, ldx, bias, out, ldo, m);
    }
    if (!decode && adt == DTYPE_BF16 && h->act == QACT_NONE)
        return qgemm_bf16(h, kind, (const uint16_t *)x, ldx, 0,
                          (const uint8_t *)base + h->panels_off,
                          h->has_perm ? (const int64_t *)(base + h->perm_off) : NULL,
                          (const uint16_t *)bias, (uint16_t *)out, ldo, m);
#endif
    int sets;
    int64_t ld;
    const float *sums = NULL;
    const float *rows = qprepare_rows(h, base, x, ldx, m, adt, decode && kind <= QK_INT8,
                                      &sets, &ld, &sums);
    if (rows == NULL) return -3;
    const int64_t set_floats = m * h->k, set_sums = m * h->groups; /* sets > 1: own rows */
    const uint8_t *panels = (const uint8_t *)base + h->panels_off;
    const int odt = adt;
#if HAVE_BF16_DOT
    if (!decode && adt == DTYPE_BF16) /* quantized activations: see qgemm_qdq_bf16 */
        return qgemm_qdq_bf16(h, kind, rows, ld, sets, panels, (const uint16_t *)bias,
                              (uint16_t *)out, ldo, m);
#endif
    if (decode) {
#pragma omp parallel for schedule(static) if (h->panels > 1)
        for (int64_t p = 0; p < h->panels; p++) {
            int64_t shard, col, width;
            qpanel_place(h, p, &shard, &col, &width);
            const int set = sets > 1 ? (int)shard : 0;
            const uint8_t *panel = panels + p * h->panel_bytes;
            const float *sc = (const float *)(panel + h->code_bytes);
            qdecode_dispatch(kind, (int)m, rows + set * set_floats, ld, sums + set * set_sums,
                             panel, sc, q_second_scales(kind, sc, h->groups), h->k, h->group,
                             bias, col,
                             width, out, ldo, odt);
        }
    } else {
        const int64_t chunks = (m + GEMM_CHUNK - 1) / GEMM_CHUNK;
#pragma omp parallel for collapse(2) schedule(static) if (h->panels * chunks > 1)
        for (int64_t p = 0; p < h->panels; p++)
            for (int64_t c = 0; c < chunks; c++) {
                int64_t shard, col, width;
                qpanel_place(h, p, &shard, &col, &width);
                const int set = sets > 1 ? (int)shard : 0;
                const int64_t end = (c + 1) * GEMM_CHUNK < m ? (c + 1) * GEMM_CHUNK : m;
                qprefill_item(h, kind, rows + set * set_floats, ld,
                              panels + p * h->panel_bytes, col, width, c * GEMM_CHUNK, end,
                              bias, out, ldo, odt);
            }
    }
    return 0;
}

/* The schedule a packed layer runs: 1 int8 x int8 (VNNI), 2 int4 x bf16 on vdpbf16ps,
 * 0 float32 multiply-adds (bf16 activations of other weight-only layers take vdpbf16ps
 * from the prefill sizes), -1 not a layer of this library. */
int qgemm_path(const void *packed)
{
    const qgemm_header *h = (const qgemm_header *)packed;
    if (h->magic != QGEMM_MAGIC || h->panel != PANEL) return -1;
    return h->vnni ? 1 : h->bf16_int4 ? 2 : 0;
}

/* out [m, k] float32 = QDQ(x [m, k] in adt): the activations' half of the scheme alone,
 * for tests and for kernels of other platforms to compare with. */
int quantize_activations(const void *x, int64_t ldx, int64_t m, int64_t k, int adt, int act,
                         int strategy, int dynamic, int64_t group, float scale, float *out)
{
    if (m < 0 || k <= 0 || ldx < k || adt < DTYPE_F32 || adt > DTYPE_F16) return -1;
    if (m == 0) return 0;
    float *rows = (float *)malloc(sizeof(float) * (size_t)(m * k));
    if (rows == NULL) return -3;
    for (int64_t r = 0; r < m; r++)
        for (int64_t i = 0; i < k; i++) rows[r * k + i] = load_at(x, r * ldx + i, adt);
    const int status = quantize_dequantize_rows(rows, k, m, k, act, strategy, dynamic, group,
                                                scale, out);
    free(rows);
    return status;
}

#endif /* ENGINE_CPU_GEMM_QUANT_H */
