/*
 * Native-width float vectors for the ISA level this translation unit is compiled for.
 *
 * The kernels are written once, over GCC / clang vector types of VF lanes (the width of
 * one register of the level: 16 with AVX-512, 8 with AVX2, 4 with NEON and SSE2), and
 * the compiler turns the arithmetic into that level's instructions: FMAs where
 * -ffp-contract=fast meets a multiply-add, vpmovzxwd + shift for bf16, vcvtph2ps (F16C)
 * or fcvtl (Arm) for fp16. Only where one instruction pays for a kernel of its own
 * (vdpbf16ps, AMX tiles) do the kernels use intrinsics, behind the level's macros.
 *
 * ENGINE_ISA_LEVEL names the level (kernel_build.py passes it with the level's -march);
 * a build without it is a plain C one.
 */
#ifndef ENGINE_CPU_SIMD_H
#define ENGINE_CPU_SIMD_H

#include <stdint.h>
#include <string.h>

#include "cpu_math.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#elif defined(__SSE2__)
#include <emmintrin.h>
#endif

#ifndef ENGINE_ISA_LEVEL
#define ENGINE_ISA_LEVEL "generic"
#endif

#if defined(__AVX512F__)
#define VF 16
#elif defined(__AVX__)
#define VF 8
#else /* NEON, SSE2, or no SIMD at all (the compiler then lowers the vectors to scalars) */
#define VF 4
#endif

/* Registers of the level: how many vectors the GEMM's register block may keep live. */
#if defined(__AVX512F__) || defined(__aarch64__)
#define VREGS 32
#else
#define VREGS 16
#endif

typedef float vf __attribute__((vector_size(VF * sizeof(float))));
typedef uint32_t vu __attribute__((vector_size(VF * sizeof(uint32_t))));
typedef int32_t vi __attribute__((vector_size(VF * sizeof(int32_t))));
typedef uint16_t vh __attribute__((vector_size(VF * sizeof(uint16_t))));
#if HAVE_FLOAT16
typedef _Float16 vhf __attribute__((vector_size(VF * sizeof(_Float16))));
#endif

static inline vf vf_splat(float x) { return (vf){0} + x; }

static inline vf vf_load(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void vf_store(float *p, vf v) { memcpy(p, &v, sizeof v); }

static inline vf vf_from_bits(vu bits) {
    vf v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

/* VF bf16 values widened to float32: zero-extend each to 32 bits, shift into the top.
 * With AVX2 / AVX-512 that is one vpmovzxwd from memory and a shift; GCC lowers the
 * generic conversion to two half-width extends and an insert, which doubled the
 * widening cost of the attention kernel's value loop; with SSE2 it is one interleave. */
static inline vf vf_load_bf16(const uint16_t *p) {
#if defined(__AVX512F__)
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return (vf)_mm512_slli_epi32(wide, 16);
#elif defined(__AVX2__)
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return (vf)_mm256_slli_epi32(wide, 16);
#elif defined(__SSE2__)
    /* interleaved below zeros, each bf16 lands in the top half of its lane: one
     * punpcklwd (GCC's generic lowering took seven instructions for four values) */
    return (vf)_mm_unpacklo_epi16(_mm_setzero_si128(),
                                  _mm_loadl_epi64((const __m128i *)p));
#else
    vh h;
    memcpy(&h, p, sizeof h);
    return vf_from_bits(__builtin_convertvector(h, vu) << 16);
#endif
}

/* VF fp16 bit patterns as float32: one vcvtph2ps with F16C (GCC lowers the generic
 * _Float16 vector conversion lane by lane there), fcvtl on Arm. */
static inline vf vf_from_f16_bits(vh bits) {
#if defined(__AVX512F__)
    __m256i h;
    memcpy(&h, &bits, sizeof h);
    return (vf)_mm512_cvtph_ps(h);
#elif defined(__AVX2__)
    __m128i h;
    memcpy(&h, &bits, sizeof h);
    return (vf)_mm256_cvtph_ps(h);
#elif HAVE_FLOAT16
    vhf h;
    memcpy(&h, &bits, sizeof h);
    return __builtin_convertvector(h, vf);
#else
    float tmp[VF];
    for (int i = 0; i < VF; i++) tmp[i] = f16_to_f32(bits[i]);
    return vf_load(tmp);
#endif
}

static inline vf vf_load_f16(const uint16_t *p) {
    vh h;
    memcpy(&h, p, sizeof h);
    return vf_from_f16_bits(h);
}

/* VF bytes widened to 32-bit lanes (zero-extended) / 16-bit lanes (zero- or
 * sign-extended): one vpmovzx / vpmovsx from memory on x86. */
typedef uint8_t vb __attribute__((vector_size(VF)));
typedef int8_t vsb __attribute__((vector_size(VF)));
typedef int16_t vs16 __attribute__((vector_size(VF * sizeof(int16_t))));

static inline vi vi_from_u8(const uint8_t *p) {
#if defined(__AVX512F__)
    return (vi)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
#elif defined(__AVX2__)
    return (vi)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
#else
    vb b;
    memcpy(&b, p, sizeof b);
    return __builtin_convertvector(b, vi);
#endif
}

static inline vh vh_from_u8(const uint8_t *p) {
#if defined(__AVX512F__)
    return (vh)_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
#elif defined(__AVX2__)
    return (vh)_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p));
#else
    vb b;
    memcpy(&b, p, sizeof b);
    return __builtin_convertvector(b, vh);
#endif
}

static inline vs16 vs16_from_s8(const uint8_t *p) {
#if defined(__AVX512F__)
    return (vs16)_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
#elif defined(__AVX2__)
    return (vs16)_mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)p));
#else
    vsb b;
    memcpy(&b, p, sizeof b);
    return __builtin_convertvector(b, vs16);
#endif
}

/* VF fp8 codes (DTYPE_FP8_E4M3 / DTYPE_FP8_E5M2) from p as float32, exactly as
 * fp8_to_f32 converts each. Where fp16 converts in hardware (F16C, Arm), through fp16: an
 * e5m2 code is the high byte of the fp16 of its value; an e4m3 code's exponent and
 * mantissa bits, moved into fp16's, are 2^-8 of its value (subnormals included). Else in
 * integer arithmetic, without float32 subnormals (so DAZ cannot flush them). */
#if defined(__F16C__) || (defined(__aarch64__) && HAVE_FLOAT16)
#define FP8_VIA_F16 1
#else
#define FP8_VIA_F16 0
#endif

static inline __attribute__((always_inline)) vf vf_load_fp8(const uint8_t *p, const int dtype) {
#if FP8_VIA_F16
    if (dtype == DTYPE_FP8_E5M2) return vf_from_f16_bits(vh_from_u8(p) << 8);
    /* sign-extended, shifted by 7: bits 15 and 14 the sign, 13..7 the code's rest */
    vh h = ((vh)vs16_from_s8(p) << 7) & 0xbf80u;
    const vh nan = (vh)((h & 0x3f80u) == 0x3f80u); /* 0x7f / 0xff: an fp16 NaN */
    h = (h & ~nan) | (0x7e00u & nan);
    return vf_from_f16_bits(h) * 256.0f;
#else
    vb b8;
    memcpy(&b8, p, sizeof b8);
    const vu b = __builtin_convertvector(b8, vu);
    const vu sign = (b & 0x80u) << 24, mag = b & 0x7fu;
    vu bits, small, special, special_bits;
    vf sub;
    if (dtype == DTYPE_FP8_E4M3) {
        bits = (mag << 20) + (120u << 23);
        sub = __builtin_convertvector((vi)mag, vf) * 0x1p-9f;
        small = (vu)(mag < 8u);
        special = (vu)(mag == 0x7fu);
        special_bits = (vu){0} + 0x7fc00000u;
    } else {
        bits = (mag << 21) + (112u << 23);
        sub = __builtin_convertvector((vi)mag, vf) * 0x1p-16f;
        small = (vu)(mag < 4u);
        special = (vu)(mag >= 0x7cu);
        special_bits = ((mag & 3u) << 21) | 0x7f800000u;
    }
    vu sub_bits;
    memcpy(&sub_bits, &sub, sizeof sub_bits);
    bits = (bits & ~small) | (sub_bits & small);
    bits = (bits & ~special) | (special_bits & special);
    return vf_from_bits(bits | sign);
#endif
}

/* VF values of a `dtype` array from element `index`, as float32 (dtype a constant after
 * inlining, so each caller gets one straight-line load). */
static inline __attribute__((always_inline)) vf vf_load_as(const void *base, int64_t index,
                                                          const int dtype) {
    if (dtype == DTYPE_BF16) return vf_load_bf16((const uint16_t *)base + index);
    if (dtype == DTYPE_F16) return vf_load_f16((const uint16_t *)base + index);
    if (is_fp8(dtype)) return vf_load_fp8((const uint8_t *)base + index, dtype);
    return vf_load((const float *)base + index);
}

/* round to nearest even, NaNs kept quiet: f32_to_bf16 on every lane */
static inline vh vf_to_bf16(vf v) {
    vu bits;
    memcpy(&bits, &v, sizeof bits);
    const vu rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    const vu nan = (vu)((bits & 0x7fffffffu) > 0x7f800000u);
    const vu quiet = (bits >> 16) | 0x40u;
    return __builtin_convertvector((quiet & nan) | (rounded & ~nan), vh);
}

static inline __attribute__((always_inline)) void vf_store_as(void *base, int64_t index,
                                                             const int dtype, vf v) {
    if (dtype == DTYPE_BF16) {
        const vh h = vf_to_bf16(v);
        memcpy((uint16_t *)base + index, &h, sizeof h);
    } else if (dtype == DTYPE_F16) {
#if HAVE_FLOAT16
        const vhf h = __builtin_convertvector(v, vhf);
        memcpy((uint16_t *)base + index, &h, sizeof h);
#else
        for (int i = 0; i < VF; i++) ((uint16_t *)base)[index + i] = f32_to_f16(v[i]);
#endif
    } else {
        vf_store((float *)base + index, v);
    }
}

static inline float vf_sum(vf v) {
    float total = 0.0f;
    for (int i = 0; i < VF; i++) total += v[i];
    return total;
}

#endif /* ENGINE_CPU_SIMD_H */
