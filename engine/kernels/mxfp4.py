"""MXFP4 dequantization in Triton: e2m1 fp4 codes with e8m0 block exponents -> dense.

The format (engine/quantization/mxfp4.py): ``blocks [..., G, 16]`` uint8, two fp4 codes
per byte (element ``2j`` in the low nibble), ``scales [..., G]`` uint8, one exponent per
32 values, ``value = FP4[code] * 2 ** (scale - 127)``. The kernel decodes codes and
exponents with integer arithmetic and bit casts (no lookup table, no ``exp2``), so its
output is exact and identical on every GPU and in the interpreter: an fp4 code is
``(-1)^s * (e == 0 ? m / 2 : (1 + m / 2) * 2^(e - 1))`` and the e8m0 exponent is the
float32 ``2^(scale - 127)`` built from its bits (the subnormal ``2^-127`` for scale 0).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.triton_utils import check_device, interpreting

_INTERPRETED = interpreting()
_ROWS = 64  # 32-value blocks per program


@triton.jit
def _fp4_values(codes):
    """uint8/int32 e2m1 codes (0..15) as float32 values."""
    c = codes.to(tl.int32)
    exp = (c >> 1) & 3
    man = (c & 1).to(tl.float32)
    # e == 0: subnormal m * 0.5; else (1 + m / 2) * 2^(e - 1), 2^(e - 1) from its bits.
    pow2 = ((exp + 126) << 23).to(tl.float32, bitcast=True)
    mag = tl.where(exp == 0, man * 0.5, (1.0 + man * 0.5) * pow2)
    return tl.where((c & 8) != 0, -mag, mag)


@triton.jit
def _mxfp4_dequant_kernel(blocks_ptr, scales_ptr, out_ptr, num_rows,
                          ROWS: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, 16)
    live = rows < num_rows
    mask = live[:, None] & (cols[None, :] < 16)
    packed = tl.load(blocks_ptr + rows[:, None].to(tl.int64) * 16 + cols[None, :],
                     mask=mask, other=0).to(tl.int32)
    e = tl.load(scales_ptr + rows, mask=live, other=127).to(tl.int32)
    scale = tl.where(e == 0, (1 << 22), e << 23).to(tl.float32, bitcast=True)
    lo = _fp4_values(packed & 0x0F) * scale[:, None]
    hi = _fp4_values(packed >> 4) * scale[:, None]
    base = out_ptr + rows[:, None].to(tl.int64) * 32 + 2 * cols[None, :]
    tl.store(base, lo.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(base + 1, hi.to(out_ptr.dtype.element_ty), mask=mask)


def mxfp4_dequantize(blocks: torch.Tensor, scales: torch.Tensor,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``blocks [..., G, 16]`` uint8 + ``scales [..., G]`` uint8 -> ``[..., G * 32]``
    ``dtype`` (float32, bfloat16 or float16), on the tensors' device."""
    from engine.quantization.mxfp4 import E8M0_NAN, check_mxfp4_shapes

    check_mxfp4_shapes(blocks, scales)
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"mxfp4 dequantizes to float32, bfloat16 or float16, not {dtype}")
    if bool((scales == E8M0_NAN).any()):
        raise ValueError("mxfp4 scales hold the e8m0 NaN code 255 (a corrupt checkpoint?)")
    check_device(_INTERPRETED, blocks, scales)
    lead = tuple(scales.shape)
    flat_blocks = blocks.reshape(-1, 16).contiguous()
    flat_scales = scales.reshape(-1).contiguous()
    num_rows = flat_scales.numel()
    out = torch.empty(num_rows, 32, dtype=dtype, device=blocks.device)
    if num_rows:
        grid = (triton.cdiv(num_rows, _ROWS),)
        _mxfp4_dequant_kernel[grid](flat_blocks, flat_scales, out, num_rows, ROWS=_ROWS)
    return out.reshape(*lead[:-1], lead[-1] * 32)
