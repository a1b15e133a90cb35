"""fp8 KV cache codes in Triton: quantize on store, dequantize on load.

An fp8 cache (``--kv-cache-dtype fp8 | fp8_e5m2``; the contract is in
engine/core/interfaces/attention.py) is passed to the kernels as its ``uint8`` view, and
the codes are converted with integer arithmetic and bit casts rather than Triton's fp8
types: the same code runs on every GPU (fp8 conversions in hardware need sm_89+ or
gfx950, and ROCm's native e4m3 is the fnuz variant) and in the interpreter, whose fp8
casts do not round to nearest. Both directions are exact as the contract defines them:
:func:`fp8_to_float` gives a code's value (NaN codes NaN, e5m2's infinities infinite),
:func:`float_to_fp8` the nearest code, ties to even, saturated to the largest finite
value (NaN stays NaN), bit for bit what ``quantize_kv`` stores.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

NO_FP8, E4M3, E5M2 = 0, 1, 2  # the kernels' KV_FP8 constexpr
_FORMATS = {torch.float8_e4m3fn: E4M3, torch.float8_e5m2: E5M2}


def cache_format(kv_cache: torch.Tensor) -> tuple[int, torch.Tensor]:
    """(KV_FP8 code, the tensor the kernels address): an fp8 cache's uint8 view, or the
    cache itself."""
    fmt = _FORMATS.get(kv_cache.dtype, NO_FP8)
    return fmt, kv_cache.view(torch.uint8) if fmt else kv_cache


@triton.jit
def fp8_to_float(codes, FMT: tl.constexpr):
    """uint8 fp8 codes (FMT: E4M3 or E5M2) as float32 values, exactly; no float32
    subnormal is formed, so flush-to-zero cannot change them."""
    b = codes.to(tl.int32)
    sign = (b & 0x80) << 24
    mag = b & 0x7F
    if FMT == 1:  # e4m3fn: bias 7, no infinities, 0x7f NaN
        normal = (mag << 20) + (120 << 23)
        sub = (mag.to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True)  # m x 2^-9
        bits = tl.where(mag < 8, sub, normal)
        bits = tl.where(mag == 0x7F, 0x7FC00000, bits)
    else:  # e5m2: bias 15, 0x7c infinity, above NaN
        normal = (mag << 21) + (112 << 23)
        sub = (mag.to(tl.float32) * 1.52587890625e-05).to(tl.int32, bitcast=True)  # m x 2^-16
        bits = tl.where(mag < 4, sub, normal)
        bits = tl.where(mag >= 0x7C, 0x7F800000 | ((mag & 3) << 21), bits)
    return (bits | sign).to(tl.float32, bitcast=True)


@triton.jit
def float_to_fp8(x, FMT: tl.constexpr):
    """float32 ``x`` as uint8 fp8 codes: nearest, ties to even, saturated."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    finite = tl.minimum(mag, 0x7F800000)  # no wrap-around in the rounding sums below
    if FMT == 1:
        small = mag < 0x3C800000  # below 2^-6: a count of 2^-9 steps
        tiny = tl.minimum(mag, 0x3C800000).to(tl.float32, bitcast=True)
        steps = tl.where(small, tiny * 512.0, 0.0)
        sub = ((steps + 8388608.0) - 8388608.0).to(tl.int32)  # rounded by the adder
        normal = ((finite + 0x7FFFF + ((finite >> 20) & 1)) >> 20) - 960
        code = tl.where(small, sub, normal)
        code = tl.where(mag >= 0x43E00000, 0x7E, code)  # 448 and beyond
    else:
        small = mag < 0x38800000  # below 2^-14: a count of 2^-16 steps
        tiny = tl.minimum(mag, 0x38800000).to(tl.float32, bitcast=True)
        steps = tl.where(small, tiny * 65536.0, 0.0)
        sub = ((steps + 8388608.0) - 8388608.0).to(tl.int32)
        normal = ((finite + 0xFFFFF + ((finite >> 21) & 1)) >> 21) - 448
        code = tl.where(small, sub, normal)
        code = tl.where(mag >= 0x47600000, 0x7B, code)  # 57344 and beyond
    code = tl.where(mag > 0x7F800000, 0x7F, code)  # NaN
    return (code | sign).to(tl.uint8)
