/*
 * Scalar helpers shared by the CPU plugin's C kernels: storage dtypes, bf16 / fp16
 * conversions, a vectorizable exponential. Everything is static inline (one copy per
 * kernel file).
 */
#ifndef ENGINE_CPU_MATH_H
#define ENGINE_CPU_MATH_H

#include <stdint.h>
#include <string.h>

/* Storage dtypes. The fp8 ones (OCP e4m3fn: no infinities, 0x7f / 0xff NaN; e5m2) are
 * KV cache formats only: codes of value / scale, which the attention kernels store and
 * read (5 and 6: the self-test driver's file format gives 3 and 4 to int64 / uint8). */
enum { DTYPE_F32 = 0, DTYPE_BF16 = 1, DTYPE_F16 = 2, DTYPE_FP8_E4M3 = 5, DTYPE_FP8_E5M2 = 6 };

static inline int is_fp8(int dtype) { return dtype == DTYPE_FP8_E4M3 || dtype == DTYPE_FP8_E5M2; }

/* _Float16 where the compiler has it (x86-64 with GCC >= 12, aarch64, clang); the
 * conversions below are then single instructions with F16C / on Arm. Elsewhere they are
 * written out in integer arithmetic (the "plain C" build of other architectures). */
#ifndef HAVE_FLOAT16 /* a build may set 0 to use (and test) the integer conversions */
#if defined(__FLT16_MAX__)
#define HAVE_FLOAT16 1
#else
#define HAVE_FLOAT16 0
#endif
#endif

/*
 * How the kernels prefetch what one call reads exactly once (a decode step's weights,
 * streamed from memory): STREAM_PREFETCH_NTA (the non-temporal hint: the sweep does not
 * evict the step's other data), _T0 (the ordinary hint) or _NONE (the hardware
 * prefetchers alone). Which streams fastest is the machine's business: on Zen cores the
 * NTA hint streams at memory speed, while a core whose NTA fills bypass its L2 (and so
 * its L2 streamer) holds one line fill buffer per line in flight and reads at a fraction
 * of it. native.py times the three on the machine at hand once (cached) and sets the
 * winner with set_stream_prefetch (runtime.c); NTA until then.
 */
enum { STREAM_PREFETCH_NTA = 0, STREAM_PREFETCH_T0 = 1, STREAM_PREFETCH_NONE = 2 };
extern int stream_prefetch_mode;
/* Batch-invariant mode (runtime.c's set_batch_invariant): every kernel reduces a row in
 * the order it uses at any row count -- no second accumulator chain for one or two rows,
 * no AMX from some row count on, no key splits sized to the batch. */
extern int batch_invariant_mode;

/* Prefetch p, an address ahead of a once-read stream, as stream_prefetch_mode says. */
static inline __attribute__((always_inline)) void stream_prefetch(const void *p) {
    if (stream_prefetch_mode == STREAM_PREFETCH_NTA)
        __builtin_prefetch(p, 0, 0);
    else if (stream_prefetch_mode == STREAM_PREFETCH_T0)
        __builtin_prefetch(p, 0, 3);
}

static inline int64_t dtype_size(int dtype) {
    return dtype == DTYPE_F32 ? 4 : is_fp8(dtype) ? 1 : 2;
}

static inline float bits_to_f32(uint32_t bits) {
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline float bf16_to_f32(uint16_t x) { return bits_to_f32((uint32_t)x << 16); }

static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16; /* nearest even */
    const uint32_t quiet_nan = (bits >> 16) | 0x40u;
    /* a select, not a branch: loops storing bf16 still vectorize */
    return (uint16_t)((bits & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

static inline float f16_to_f32(uint16_t h) {
#if HAVE_FLOAT16
    _Float16 v;
    memcpy(&v, &h, sizeof v);
    return (float)v;
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
    if (exponent == 0x1fu) /* inf / NaN */
        return bits_to_f32(sign | 0x7f800000u | (mantissa << 13));
    if (exponent == 0) { /* zero / subnormal: mantissa x 2^-24, exact in float32 */
        const float magnitude = (float)mantissa * 5.9604644775390625e-8f;
        return sign ? -magnitude : magnitude;
    }
    return bits_to_f32(sign | ((exponent + 112u) << 23) | (mantissa << 13));
#endif
}

static inline uint16_t f32_to_f16(float f) {
#if HAVE_FLOAT16
    const _Float16 v = (_Float16)f;
    uint16_t h;
    memcpy(&h, &v, sizeof h);
    return h;
#else
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    const uint32_t sign = (bits >> 16) & 0x8000u, magnitude = bits & 0x7fffffffu;
    if (magnitude > 0x7f800000u) /* NaN stays a quiet NaN */
        return (uint16_t)(sign | 0x7e00u | ((magnitude >> 13) & 0x3ffu));
    if (magnitude >= 0x477ff000u) /* rounds to or beyond 65520: inf */
        return (uint16_t)(sign | 0x7c00u);
    if (magnitude < 0x38800000u) { /* below 2^-14: a subnormal half, nearest even */
        const float scaled = bits_to_f32(magnitude) * 16777216.0f; /* units of 2^-24 */
        uint32_t units = (uint32_t)scaled;
        const float rest = scaled - (float)units;
        units += rest > 0.5f || (rest == 0.5f && (units & 1u));
        return (uint16_t)(sign | units);
    }
    const uint32_t rounded = magnitude + 0xfffu + ((magnitude >> 13) & 1u) - 0x38000000u;
    return (uint16_t)(sign | (rounded >> 13));
#endif
}

/* An fp8 code as float32, exactly (NaN codes NaN, e5m2's infinities infinite); no
 * float32 subnormal is formed on the way, so a flush-to-zero mode cannot change it. */
static inline float fp8_to_f32(uint8_t code, int dtype) {
    const uint32_t sign = (uint32_t)(code & 0x80u) << 24, mag = code & 0x7fu;
    uint32_t bits;
    if (dtype == DTYPE_FP8_E4M3) {
        if (mag < 8u) { /* zero / subnormal: mantissa x 2^-9 */
            const float magnitude = (float)mag * 0x1p-9f;
            return sign ? -magnitude : magnitude;
        }
        bits = mag == 0x7fu ? 0x7fc00000u : (mag << 20) + (120u << 23);
    } else {
        if (mag < 4u) { /* zero / subnormal: mantissa x 2^-16 */
            const float magnitude = (float)mag * 0x1p-16f;
            return sign ? -magnitude : magnitude;
        }
        bits = mag >= 0x7cu ? 0x7f800000u | ((mag & 3u) << 21) : (mag << 21) + (112u << 23);
    }
    return bits_to_f32(sign | bits);
}

/* The fp8 code nearest to f (ties to even), saturated to the format's largest finite
 * value (448 e4m3, 57344 e5m2: infinities too, as vLLM's SATFINITE stores); NaN stays
 * NaN. Branch-free selects, so loops over it vectorize. */
static inline uint8_t f32_to_fp8(float f, int dtype) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    const uint32_t sign = (bits >> 24) & 0x80u, mag = bits & 0x7fffffffu;
    /* Below the smallest normal: a count of subnormal steps, rounded to nearest even by
     * the float adder (the value kept small so the conversion to an integer is defined). */
    uint32_t code;
    if (dtype == DTYPE_FP8_E4M3) {
        const int subnormal = mag < 0x3c800000u; /* 2^-6 */
        const float steps = subnormal ? bits_to_f32(mag) * 512.0f : 0.0f;
        const uint32_t sub = (uint32_t)((steps + 8388608.0f) - 8388608.0f);
        const uint32_t normal = ((mag + 0x7ffffu + ((mag >> 20) & 1u)) >> 20) - (120u << 3);
        code = subnormal ? sub : normal;
        code = mag >= 0x43e00000u ? 0x7eu : code; /* 448 and beyond */
    } else {
        const int subnormal = mag < 0x38800000u; /* 2^-14 */
        const float steps = subnormal ? bits_to_f32(mag) * 65536.0f : 0.0f;
        const uint32_t sub = (uint32_t)((steps + 8388608.0f) - 8388608.0f);
        const uint32_t normal = ((mag + 0xfffffu + ((mag >> 21) & 1u)) >> 21) - (112u << 2);
        code = subnormal ? sub : normal;
        code = mag >= 0x47600000u ? 0x7bu : code; /* 57344 and beyond */
    }
    code = mag > 0x7f800000u ? 0x7fu : code;
    return (uint8_t)(sign | code);
}

/* The exponential's arithmetic, shared by the scalar exp_nonpositive and the 16-lane
 * vexp_nonpositive (GCC vector types take the same operators): n = round(x / ln2),
 * rounded to nearest through the float adder (1.5 * 2^23, no libm call); r = x - n ln2
 * in two parts; exp(r) by its degree-7 polynomial. */
#define EXP_ROUND(x) (((x) * 1.44269504088896341f + 12582912.0f) - 12582912.0f)
#define EXP_REDUCE(x, n) ((x) - (n) * 0.693145751953125f - (n) * 1.42860682030941723212e-6f)
#define EXP_POLY(r)                                                                         \
    ((((((1.9875691500e-4f * (r) + 1.3981999507e-3f) * (r) + 8.3334519073e-3f) * (r) +     \
        4.1665795894e-2f) * (r) + 1.6666665459e-1f) * (r) + 5.0000001201e-1f) * (r) * (r) + \
     (r) + 1.0f)

/* exp(x) for x <= 0 (softmax arguments): 2^n * p(r), |r| <= ln2 / 2, within ~2 ulp;
 * branch-free so loops over it vectorize. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = EXP_ROUND(x);
    const float r = EXP_REDUCE(x, n);
    float p = EXP_POLY(r);
    int32_t bits;
    memcpy(&bits, &p, sizeof bits);
    bits += (int32_t)n << 23;
    memcpy(&p, &bits, sizeof p);
    return x <= -87.0f ? 0.0f : p;
}

/* element `index` of a `dtype` array, as float32 (dtype is a constant after inlining) */
static inline __attribute__((always_inline)) float load_at(const void *base, int64_t index,
                                                          const int dtype) {
    if (dtype == DTYPE_BF16) return bf16_to_f32(((const uint16_t *)base)[index]);
    if (dtype == DTYPE_F16) return f16_to_f32(((const uint16_t *)base)[index]);
    if (is_fp8(dtype)) return fp8_to_f32(((const uint8_t *)base)[index], dtype);
    return ((const float *)base)[index];
}

static inline __attribute__((always_inline)) void store_at(void *base, int64_t index,
                                                           const int dtype, float value) {
    if (dtype == DTYPE_BF16) ((uint16_t *)base)[index] = f32_to_bf16(value);
    else if (dtype == DTYPE_F16) ((uint16_t *)base)[index] = f32_to_f16(value);
    else if (is_fp8(dtype)) ((uint8_t *)base)[index] = f32_to_fp8(value, dtype);
    else ((float *)base)[index] = value;
}

/* `value` rounded to the storage dtype and widened back: mirrors a torch op that
 * returns a tensor of that dtype, so a fused kernel rounds where the op chain did. */
static inline __attribute__((always_inline)) float round_to(const int dtype, float value) {
    if (dtype == DTYPE_BF16) return bf16_to_f32(f32_to_bf16(value));
    if (dtype == DTYPE_F16) return f16_to_f32(f32_to_f16(value));
    return value;
}

#endif /* ENGINE_CPU_MATH_H */
