/*
 * Quantize-dequantize (QDQ) of activations, exactly as compressed-tensors defines it
 * (and engine/quantization/numerics.py, the tests' reference, writes it in torch):
 *
 * - a symmetric scale per token (row), per tensor or per group of g values of a row:
 *   max|x| / 127.5 (int8), / 448 (fp8 e4m3), / 6 (nvfp4 e2m1); a zero scale becomes
 *   float32's epsilon. Static schemes take the checkpoint's scale instead;
 * - q = round(clamp(x / scale)): to nearest even for int8, to the nearest e4m3 value
 *   (nearest even) for fp8, compressed-tensors' e2m1 table for nvfp4; x' = q * scale;
 * - nvfp4: a group's scale times the layer's global input scale is rounded to e4m3
 *   (a zero one becomes 0.125, e4m3's epsilon), then divided by the global scale again.
 *
 * The arithmetic is the reference's, operation for operation (true divisions, no
 * reciprocals), so the results are bit-identical: these roundings sit on decision
 * boundaries, and a GEMM fed different codes would differ by whole quanta.
 */
#ifndef ENGINE_CPU_QUANT_ACT_H
#define ENGINE_CPU_QUANT_ACT_H

#include <float.h>
#include <stdint.h>

#include "simd.h"

enum { QACT_NONE = 0, QACT_INT8 = 1, QACT_FP8 = 2, QACT_NVFP4 = 3 };
enum { QSTRAT_TOKEN = 0, QSTRAT_TENSOR = 1, QSTRAT_GROUP = 2 };

#define QACT_ROUND_MAGIC 12582912.0f /* 1.5 x 2^23: x + M - M rounds to nearest even */
#define E4M3_MAX 448.0f
#define E4M3_MIN_NORMAL_BITS 0x3c800000u /* 2^-6 */

static inline float qact_half_range(int act) {
    return act == QACT_INT8 ? 127.5f : act == QACT_FP8 ? E4M3_MAX : 6.0f;
}

static inline vf vf_select(vi mask, vf yes, vf no) {
    vi a, b;
    memcpy(&a, &yes, sizeof a);
    memcpy(&b, &no, sizeof b);
    const vi r = (a & mask) | (b & ~mask);
    vf out;
    memcpy(&out, &r, sizeof out);
    return out;
}

static inline vf vf_clamp(vf x, float lo, float hi) {
    const vf l = vf_splat(lo), h = vf_splat(hi);
    x = vf_select((vi)(x < l), l, x);
    return vf_select((vi)(x > h), h, x);
}

/* nearest e4m3 value (ties to even) of t, |t| <= 448 */
static inline vf vf_round_e4m3(vf t) {
    vu bits;
    memcpy(&bits, &t, sizeof bits);
    const vu normal = (bits + 0x7ffffu + ((bits >> 20) & 1u)) & 0xfff00000u;
    vf nv;
    memcpy(&nv, &normal, sizeof nv);
    const vf scaled = t * 512.0f; /* subnormals: multiples of 2^-9 */
    const vf sub = ((scaled + QACT_ROUND_MAGIC) - QACT_ROUND_MAGIC) * (1.0f / 512.0f);
    return vf_select((vi)((bits & 0x7fffffffu) < E4M3_MIN_NORMAL_BITS), sub, nv);
}

static inline float round_e4m3(float t) {
    uint32_t bits;
    memcpy(&bits, &t, sizeof bits);
    if ((bits & 0x7fffffffu) < E4M3_MIN_NORMAL_BITS) {
        volatile float scaled = t * 512.0f + QACT_ROUND_MAGIC; /* kept from folding */
        return (scaled - QACT_ROUND_MAGIC) * (1.0f / 512.0f);
    }
    bits = (bits + 0x7ffffu + ((bits >> 20) & 1u)) & 0xfff00000u;
    return bits_to_f32(bits);
}

/* compressed-tensors' e2m1 rounding of t (its comparisons decide the ties) */
static inline vf vf_round_e2m1(vf t) {
    const vf zero = vf_splat(0.0f);
    const vf mag = vf_select((vi)(t < zero), -t, t);
    vf out = zero;
    out = vf_select((vi)(mag > 0.25f), vf_splat(0.5f), out);
    out = vf_select((vi)(mag >= 0.75f), vf_splat(1.0f), out);
    out = vf_select((vi)(mag > 1.25f), vf_splat(1.5f), out);
    out = vf_select((vi)(mag >= 1.75f), vf_splat(2.0f), out);
    out = vf_select((vi)(mag > 2.5f), vf_splat(3.0f), out);
    out = vf_select((vi)(mag >= 3.5f), vf_splat(4.0f), out);
    out = vf_select((vi)(mag > 5.0f), vf_splat(6.0f), out);
    return vf_select((vi)(t < zero), -out, out);
}

/* q(x / scale) * scale for one vector, codes of `act` */
static inline __attribute__((always_inline)) vf vf_qdq(const int act, vf x, vf scale) {
    const vf t = x / scale;
    if (act == QACT_INT8) {
        const vf c = vf_clamp(t, -128.0f, 127.0f);
        return ((c + QACT_ROUND_MAGIC) - QACT_ROUND_MAGIC) * scale;
    }
    if (act == QACT_FP8)
        return vf_round_e4m3(vf_clamp(t, -E4M3_MAX, E4M3_MAX)) * scale;
    return vf_round_e2m1(vf_clamp(t, -6.0f, 6.0f)) * scale;
}

static inline float qdq_scalar(int act, float x, float scale) {
    float r[VF] __attribute__((aligned(64)));
    vf_store(r, vf_qdq(act, vf_splat(x), vf_splat(scale)));
    return r[0];
}

static inline float max_abs(const float *x, int64_t n) {
    vf top = vf_splat(0.0f);
    int64_t i = 0;
    for (; i + VF <= n; i += VF) {
        const vf v = vf_load(x + i);
        const vf a = vf_select((vi)(v < 0.0f), -v, v);
        top = vf_select((vi)(a > top), a, top);
    }
    float best = 0.0f;
    for (int l = 0; l < VF; l++) best = top[l] > best ? top[l] : best;
    for (; i < n; i++) {
        const float a = x[i] < 0.0f ? -x[i] : x[i];
        best = a > best ? a : best;
    }
    return best;
}

/* the scale of a dynamic group / token / tensor whose largest magnitude is top */
static inline float dynamic_scale(int act, float top, float global) {
    float scale = top / qact_half_range(act);
    if (act == QACT_NVFP4) {
        float s = scale * global;
        s = s > E4M3_MAX ? E4M3_MAX : s < -E4M3_MAX ? -E4M3_MAX : s;
        s = round_e4m3(s);
        return (s == 0.0f ? 0.125f : s) / global;
    }
    return scale == 0.0f ? FLT_EPSILON : scale;
}

static inline void qdq_span(int act, const float *x, float *out, int64_t n, float scale) {
    const vf s = vf_splat(scale);
    int64_t i = 0;
    for (; i + VF <= n; i += VF) vf_store(out + i, vf_qdq(act, vf_load(x + i), s));
    for (; i < n; i++) out[i] = qdq_scalar(act, x[i], scale);
}

/*
 * out[m, k] = QDQ(x[m, k]) (float32 rows, ldx / k apart). `scale`: the static scale
 * (static schemes) or nvfp4's global input scale; ignored by dynamic int8 / fp8.
 * Returns 0, or -1 for a combination the format does not define.
 */
static int quantize_dequantize_rows(const float *x, int64_t ldx, int64_t m, int64_t k, int act,
                                    int strategy, int dynamic, int64_t group, float scale,
                                    float *out)
{
    if (act == QACT_NVFP4 && (!dynamic || group != 16))
        return -1;
    if ((strategy == QSTRAT_GROUP || act == QACT_NVFP4) && (group <= 0 || k % group))
        return -1;
    if (act < QACT_INT8 || act > QACT_NVFP4)
        return -1;
    if (act == QACT_NVFP4 && !(scale > 0.0f))
        return -1;
    if (!dynamic && !(scale > 0.0f))
        return -1;
    float tensor_scale = scale;
    if (dynamic && strategy == QSTRAT_TENSOR && act != QACT_NVFP4) {
        float top = 0.0f;
        for (int64_t r = 0; r < m; r++) {
            const float t = max_abs(x + r * ldx, k);
            top = t > top ? t : top;
        }
        tensor_scale = dynamic_scale(act, top, scale);
    }
    const int grouped = strategy == QSTRAT_GROUP || act == QACT_NVFP4;
#pragma omp parallel for if (m * k >= (1 << 15))
    for (int64_t r = 0; r < m; r++) {
        const float *row = x + r * ldx;
        float *dst = out + r * k;
        if (!dynamic || (strategy == QSTRAT_TENSOR && act != QACT_NVFP4)) {
            qdq_span(act, row, dst, k, tensor_scale);
        } else if (grouped) {
            for (int64_t g = 0; g < k; g += group)
                qdq_span(act, row + g, dst + g, group,
                         dynamic_scale(act, max_abs(row + g, group), scale));
        } else {
            qdq_span(act, row, dst, k, dynamic_scale(act, max_abs(row, k), scale));
        }
    }
    return 0;
}

#endif /* ENGINE_CPU_QUANT_ACT_H */
