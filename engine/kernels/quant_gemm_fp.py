"""W8A8 / FP8 / NVFP4 quantized GEMMs in portable Triton (the GPU plugins' kernels).

Contract (engine/core/interfaces/quant.py): ``y = QDQ(x) @ dequant(W).T (+ bias)`` for
the canonical encodings, in x's dtype, the same numbers as the CPU plugin's kernels (and
the torch reference) up to float32 accumulation order:

- :class:`TritonFp8Gemm` (``triton_fp8_gemm``): ``fp8`` weights (e4m3 codes, scales per
  tensor / channel / 128 x 128 block) with fp8 activations (dynamic per token / tensor /
  group of 128, or a static per-tensor scale per fused shard) or none (weight-only);
- :class:`TritonInt8Gemm` (``triton_int8_gemm``): symmetric 8-bit ``int`` weights with
  int8 activations (W8A8: per token / tensor, dynamic or static) or none (W8A16);
- :class:`TritonNvfp4Gemm` (``triton_nvfp4_gemm``): ``nvfp4`` weights (e2m1 codes, group
  scales of 16 already divided by the global scale) with dynamic NVFP4 activations
  (groups of 16, the shard's global input scale) or none (NVFP4A16).

Activations. One Triton kernel (:func:`quantize_activation`) quantizes a row per program
with the formats' arithmetic operation for operation (``engine.quantization.numerics``:
true divisions ``tl.math.div_rn``, not Triton's approximate ``/``; round-to-nearest-even
by floor arithmetic; e4m3 rounding on the float32 bits as csrc/quant_act.h does; the e2m1
table's comparisons), so its codes times its scales equal the torch QDQ bit for bit
(tests/kernels/test_quant_gemm_fp.py checks it). Int8 / fp8 schemes get codes (int8, or
e4m3fn bytes) and one float32 scale per row (per group of ``g`` for group schemes: [M,
K / g]); dynamic per-tensor scales take a row-max pass first (no host synchronisation
anywhere: a layer is capturable in a device graph). NVFP4 activations are
quantize-dequantized into x's dtype (bf16 rounded to nearest even) and the GEMM runs in
that dtype: their per-16 scales cannot leave a tensor-core dot. That rounding (2^-9
relative, per activation) is the one place these kernels differ from the CPU's float32
arithmetic by more than accumulation order; float32 activations stay exact. (fp16
activations take the bf16 weights in fp16, exact within fp16's normal range.)

Where the scales go (:func:`_qgemm_kernel`, tiles ``BLOCK_M x BLOCK_N`` over K):

- per-tensor / per-channel weights with per-token / per-tensor activations: the dot of
  the raw codes accumulates (int32 for int8 x int8, float32 otherwise) and the epilogue
  multiplies ``acc[m, n] * a_scale[m] * w_scale[n]`` (a per-tensor scale is repeated);
- group / block scales (fp8 128 x 128 blocks with per-(row, 128) activations; any weight
  or activation group a power-of-two ``BLOCK_K`` divides): every K block's partial dot is
  scaled by ``a_scale[m, kb] * w_scale[n, kb]`` before it is added (a 128 x 128 weight
  block's scale is stored once per row, so the n-block's rows read their own copies);
- NVFP4: no epilogue scale; each weight is ``bf16(e2m1 * scale)`` in the K loop.

Fused shards with their own static scales (static int8 / fp8, NVFP4's global input
scale) run one quantization and one GEMM launch per run of shards with equal scales,
each writing its columns of the output.

Devices (a kernel class is bound to a :class:`DeviceCapability` by ``for_capability``):

- ``fp8_mma``: the e4m3 codes are bitcast to the device's fp8 type and multiplied by
  ``tl.dot`` in fp8. ``e4m3fnuz`` (MI300): the same byte read as fnuz is half the fn
  value (the exponent bias is 8, not 7), so prepare keeps the bytes (mapping 0x80, fn's
  -0 and fnuz's NaN, to 0) and doubles the weight scales, and the activation quantizer
  writes fn bytes (-0 never produced) with doubled scales: exact, no re-rounding;
- no fp8 MMA (Ampere, the interpreter unbound): the bytes are decoded to float in
  integer arithmetic and the dot runs in bf16 (every e4m3 value is a bf16 value);
- int8: ``tl.dot`` int8 x int8 -> int32 where ``int8_mma`` (and in the interpreter),
  else the codes (exact in bf16) are multiplied in bf16 with float32 accumulation;
- NVFP4 is always dequantized in the kernel (nibbles decoded arithmetically, the 16
  e2m1 values, times the group scale, rounded to bf16). ``fp4_mma`` is not used: Triton's
  portable scaled dot (``tl.dot_scaled``) takes only MX formats (e8m0 scales, groups of
  32), not NVFP4's e4m3 scales per 16, and the canonical weight is bf16-rounded anyway.

Under ``TRITON_INTERPRET=1`` 16-bit operands are multiplied as float32 (the
interpreter's bf16 / fp16 ``tl.dot`` is wrong; the values are exact in float32), fp8 and
int8 dots run as on a device.

Everything is computed for any M, N and K (masked tiles, int64 row offsets); the K of
grouped scales must be whole groups. Tile sizes are heuristics (decode: 16-row tiles
and narrow N tiles to spread the weight stream over the device; prefill: 128 x 128),
not tuned on hardware; there is no split-K.

Importing this module needs no triton (``can_implement`` then says why not); running a
kernel does.
"""

from __future__ import annotations

import functools
import math
from abc import abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import torch

from engine.core.interfaces.platform import DeviceCapability
from engine.core.interfaces.quant import (
    ActivationQuant,
    QuantizedGemmKernel,
    QuantizedLayerSpec,
    QuantizedWeights,
)
from engine.kernels.triton_utils import (
    SUPPORTED_DTYPES,
    TRITON_MISSING_MESSAGE,
    check_device,
    compute_units,
    interpreting,
    next_power_of_2,
    optional_jit,
)

try:
    import triton
    import triton.language as tl
except ImportError:  # importable without triton; the kernels below are then never launched
    triton = None
    tl = None

if TYPE_CHECKING:
    from torch import nn

_INTERPRETED = interpreting()  # triton.jit below decides the same way, at import time
GPU_DEVICE_TYPES = ("cuda", "xpu")

FP8_MAX = 448.0
F32_EPS = 1.1920928955078125e-07  # a zero int8 / fp8 scale becomes float32's epsilon
NVFP4_GROUP = 16

# constexpr codes shared by the Python side and the kernels
ENC_INT8, ENC_FP8, ENC_NVFP4 = 0, 1, 2
_ENC = {"int8": ENC_INT8, "fp8": ENC_FP8, "nvfp4": ENC_NVFP4}
MODE_STATIC, MODE_TOKEN, MODE_TENSOR, MODE_GROUP = 0, 1, 2, 3
KIND_FLOAT, KIND_INT8, KIND_FP8, KIND_NVFP4 = 0, 1, 2, 3
DOT_INT8, DOT_FP8, DOT_BF16, DOT_FP16, DOT_FP32 = 0, 1, 2, 3, 4
_DOT_OF_DTYPE = {torch.bfloat16: DOT_BF16, torch.float16: DOT_FP16, torch.float32: DOT_FP32}



# --------------------------------------------------------------------------- numerics


@optional_jit
def _rne_int(v):
    """v rounded to an integer, ties to even (exact for |v| < 2^22; no magic-number
    addition a compiler could fold)."""
    f = tl.floor(v)
    d = v - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) == 1.0
    return tl.where((d > 0.5) | ((d == 0.5) & odd), f + 1.0, f)


@optional_jit
def _round_e4m3(t):
    """The nearest e4m3 value of float32 ``t`` (|t| <= 448), ties to even: the float32
    mantissa rounded to 3 bits, or (below 2^-6) to a multiple of 2^-9."""
    bits = t.to(tl.uint32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
    sub = _rne_int(t * 512.0) * 0.001953125
    return tl.where((bits & 0x7FFFFFFF) < 0x3C800000, sub, normal)


@optional_jit
def _round_e2m1(t):
    """compressed-tensors' e2m1 rounding (its comparisons decide the ties)."""
    mag = tl.abs(t)
    out = tl.where(mag > 0.25, 0.5, 0.0)
    out = tl.where(mag >= 0.75, 1.0, out)
    out = tl.where(mag > 1.25, 1.5, out)
    out = tl.where(mag >= 1.75, 2.0, out)
    out = tl.where(mag > 2.5, 3.0, out)
    out = tl.where(mag >= 3.5, 4.0, out)
    out = tl.where(mag > 5.0, 6.0, out)
    return tl.where(t < 0.0, -out, out)


@optional_jit
def _e4m3_bits(r):
    """The e4m3fn byte (in a uint32) of ``r``, an exact e4m3 value; zero is never -0."""
    bits = r.to(tl.uint32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    normal = (((mag >> 23) - 120) << 3) | ((mag >> 20) & 7)
    sub = (tl.abs(r) * 512.0).to(tl.uint32)
    code = tl.where(mag < 0x3C800000, sub, normal)
    return tl.where(code == 0, code, code | ((bits >> 24) & 0x80))


@optional_jit
def _e4m3_value(code):
    """float32 value of e4m3fn bytes (no NaN codes expected), in integer arithmetic."""
    c = code.to(tl.uint32)
    e = (c >> 3) & 15
    m = c & 7
    sign = (c & 0x80) << 24
    normal = (sign | ((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    sub = m.to(tl.float32) * 0.001953125
    sub = tl.where(sign != 0, -sub, sub)
    return tl.where(e == 0, sub, normal)


@optional_jit
def _e2m1_value(nibble):
    """float32 value of e2m1 codes 0..15 (bit 3 the sign): 0, 0.5, 1, 1.5, 2, 3, 4, 6."""
    e = (nibble >> 1) & 3
    m = nibble & 1
    sign = (nibble & 8) << 28
    normal = (sign | ((e + 126) << 23) | (m << 22)).to(tl.float32, bitcast=True)
    sub = m.to(tl.float32) * 0.5
    sub = tl.where(sign != 0, -sub, sub)
    return tl.where(e == 0, sub, normal)


@optional_jit
def _bf16_rne(x):
    """float32 -> bf16 rounded to nearest even in integer arithmetic (the GPUs' cvt does
    the same; Triton's interpreter truncates, so it must not decide)."""
    bits = x.to(tl.uint32, bitcast=True)
    r = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return r.to(tl.float32, bitcast=True).to(tl.bfloat16)


@optional_jit
def _quant_value(t, ENC: tl.constexpr):
    if ENC == 0:
        return _rne_int(tl.minimum(tl.maximum(t, -128.0), 127.0))
    elif ENC == 1:
        return _round_e4m3(tl.minimum(tl.maximum(t, -448.0), 448.0))
    else:
        return _round_e2m1(tl.minimum(tl.maximum(t, -6.0), 6.0))


@optional_jit
def _dynamic_scale(top, gs, ENC: tl.constexpr, HALF_RANGE: tl.constexpr, EPS: tl.constexpr):
    """max|x| / half range; nvfp4: times the global scale, rounded to e4m3 (0 -> 0.125),
    divided by it again; int8 / fp8: 0 -> float32 epsilon."""
    scale = tl.math.div_rn(top, tl.full(top.shape, HALF_RANGE, tl.float32))
    if ENC == 2:
        s = _round_e4m3(tl.minimum(tl.maximum(scale * gs, -448.0), 448.0))
        s = tl.where(s == 0.0, 0.125, s)
        scale = tl.math.div_rn(s, gs + tl.zeros(s.shape, tl.float32))
    else:
        scale = tl.where(scale == 0.0, EPS, scale)
    return scale


@optional_jit
def _store_quantized(ptrs, q, scale, mask, ENC: tl.constexpr, QDQ: tl.constexpr,
                     OUT_BF16: tl.constexpr):
    if QDQ:
        value = q * scale
        if OUT_BF16:
            tl.store(ptrs, _bf16_rne(value), mask=mask)
        else:
            tl.store(ptrs, value.to(ptrs.dtype.element_ty), mask=mask)
    elif ENC == 0:
        tl.store(ptrs, q.to(tl.int8), mask=mask)
    else:
        tl.store(ptrs, _e4m3_bits(q).to(tl.uint8), mask=mask)


@optional_jit
def _row_absmax_kernel(x_ptr, out_ptr, K, stride_xm, BLOCK_K: tl.constexpr):
    row = tl.program_id(0)
    x_row = x_ptr + row.to(tl.int64) * stride_xm
    top = tl.zeros([BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
        top = tl.maximum(top, tl.abs(x))
    tl.store(out_ptr + row, tl.max(top, axis=0))


@optional_jit
def _act_quant_kernel(
    x_ptr, q_ptr, s_ptr, scale_ptr, rowmax_ptr,
    M, K, stride_xm, stride_qm, stride_sm,
    ENC: tl.constexpr, MODE: tl.constexpr, QDQ: tl.constexpr, OUT_BF16: tl.constexpr,
    HALF_RANGE: tl.constexpr, EPS: tl.constexpr, SCALE_MUL: tl.constexpr,
    GROUP: tl.constexpr, GROUP_P2: tl.constexpr, GROUPS: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """Quantize (codes + scales) or quantize-dequantize one row of ``x [M, K]`` per
    program. MODE 0: static scale ``scale_ptr[0]``; 1: dynamic per row; 2: dynamic per
    tensor (max of ``rowmax_ptr[:M]``); 3: dynamic per group of GROUP (nvfp4: the global
    scale at ``scale_ptr[0]``)."""
    row = tl.program_id(0)
    x_row = x_ptr + row.to(tl.int64) * stride_xm
    q_row = q_ptr + row.to(tl.int64) * stride_qm
    s_row = s_ptr + row.to(tl.int64) * stride_sm
    if MODE == 3:
        if ENC == 2:
            gs = tl.load(scale_ptr).to(tl.float32)
        else:
            gs = 1.0
        n_groups = K // GROUP
        gi = tl.arange(0, GROUPS)
        j = tl.arange(0, GROUP_P2)
        for g0 in range(0, n_groups, GROUPS):
            grp = g0 + gi
            offs = grp[:, None] * GROUP + j[None, :]
            mask = (grp[:, None] < n_groups) & (j[None, :] < GROUP)
            x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
            scale = _dynamic_scale(tl.max(tl.abs(x), axis=1), gs, ENC, HALF_RANGE, EPS)
            q = _quant_value(tl.math.div_rn(x, scale[:, None] + tl.zeros(x.shape, tl.float32)),
                             ENC)
            _store_quantized(q_row + offs, q, scale[:, None], mask, ENC, QDQ, OUT_BF16)
            if not QDQ:
                tl.store(s_row + grp, scale * SCALE_MUL, mask=grp < n_groups)
    else:
        if MODE == 0:
            scale = tl.load(scale_ptr).to(tl.float32)
            scale = tl.where(scale == 0.0, EPS, scale)
        elif MODE == 1:
            top = tl.zeros([BLOCK_K], tl.float32)
            for k0 in range(0, K, BLOCK_K):
                offs = k0 + tl.arange(0, BLOCK_K)
                x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
                top = tl.maximum(top, tl.abs(x))
            scale = _dynamic_scale(tl.max(top, axis=0), 1.0, ENC, HALF_RANGE, EPS)
        else:
            top = tl.zeros([BLOCK_R], tl.float32)
            for r0 in range(0, M, BLOCK_R):
                offs = r0 + tl.arange(0, BLOCK_R)
                top = tl.maximum(top, tl.load(rowmax_ptr + offs, mask=offs < M, other=0.0))
            scale = _dynamic_scale(tl.max(top, axis=0), 1.0, ENC, HALF_RANGE, EPS)
        for k0 in range(0, K, BLOCK_K):
            offs = k0 + tl.arange(0, BLOCK_K)
            mask = offs < K
            x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
            q = _quant_value(tl.math.div_rn(x, scale + tl.zeros(x.shape, tl.float32)), ENC)
            _store_quantized(q_row + offs, q, scale, mask, ENC, QDQ, OUT_BF16)
        if not QDQ:
            tl.store(s_row, scale * SCALE_MUL)


# --------------------------------------------------------------------------- the GEMM


@optional_jit
def _as_dot_dtype(v, DOT: tl.constexpr):
    if DOT == 2:
        return v.to(tl.bfloat16)
    elif DOT == 3:
        return v.to(tl.float16)
    else:
        return v.to(tl.float32)


@optional_jit
def _operand(v, KIND: tl.constexpr, DOT: tl.constexpr, FP8_NATIVE: tl.constexpr,
             FP8_TYPE: tl.constexpr):
    """A loaded tile as the dot's operand type."""
    if KIND == 0:
        return _as_dot_dtype(v, DOT)
    elif KIND == 1:
        if DOT == 0:
            return v
        else:
            return _as_dot_dtype(v.to(tl.float32), DOT)
    else:
        if FP8_NATIVE:
            f = v.to(FP8_TYPE, bitcast=True)
            if DOT == 1:
                return f
            else:
                return _as_dot_dtype(f.to(tl.float32), DOT)
        else:
            return _as_dot_dtype(_e4m3_value(v), DOT)


@optional_jit
def _dot(a, b, DOT: tl.constexpr):
    if DOT == 0:
        return tl.dot(a, b, out_dtype=tl.int32)
    elif DOT == 4:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@optional_jit
def _nvfp4_weights(packed, gscale, DOT: tl.constexpr):
    """bf16(e2m1 * scale) of packed nibbles, as the dot's operand type."""
    w = _bf16_rne(_e2m1_value(packed) * gscale)
    if DOT == 2:
        return w
    else:
        return _as_dot_dtype(w.to(tl.float32), DOT)


@optional_jit
def _qgemm_kernel(
    a_ptr, b_ptr, bs_ptr, as_ptr, bias_ptr, out_ptr,
    M, N, K,
    stride_am, stride_bn, stride_bsn, stride_asm, stride_om,
    A_KIND: tl.constexpr, B_KIND: tl.constexpr, DOT: tl.constexpr,
    FP8_NATIVE: tl.constexpr, FP8_TYPE: tl.constexpr,
    A_GROUP: tl.constexpr, B_GROUP: tl.constexpr, GROUPED: tl.constexpr,
    HAS_A_SCALE: tl.constexpr, HAS_B_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
    OUT_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """``out[M, N] = (A [M, K]) (B [N, K])^T`` with the scales of the module docstring.
    A: activations (KIND 0) or their int8 / e4m3 codes (1 / 2); B: int8 / e4m3 codes or
    packed e2m1 ``[N, K / 2]`` (3). Scales: ``as [M, *]`` / ``bs [N, *]`` float32, one
    per row (GROUP 0) or per GROUP input features."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_pid_n
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    rows_m = offs_m.to(tl.int64)
    rows_n = offs_n.to(tl.int64)
    a_rows = a_ptr + rows_m[:, None] * stride_am
    b_cols = b_ptr + rows_n[None, :] * stride_bn

    if DOT == 0 and not GROUPED:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if B_KIND == 3:
            kk = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            kmask = kk < K // 2
            packed = tl.load(b_cols + kk[:, None], mask=kmask[:, None] & n_mask[None, :],
                             other=0).to(tl.uint32)
            kg = k0 // 16 + tl.arange(0, BLOCK_K // 16)
            gscale = tl.load(bs_ptr + rows_n[None, :] * stride_bsn + kg[:, None],
                             mask=(kg[:, None] < K // 16) & n_mask[None, :], other=0.0)
            gscale = tl.reshape(tl.broadcast_to(gscale[:, None, :], (BLOCK_K // 16, 8, BLOCK_N)),
                                (BLOCK_K // 2, BLOCK_N))
            a_mask = m_mask[:, None] & kmask[None, :]
            a_lo = tl.load(a_rows + (2 * kk)[None, :], mask=a_mask, other=0.0)
            a_hi = tl.load(a_rows + (2 * kk + 1)[None, :], mask=a_mask, other=0.0)
            acc += _dot(_as_dot_dtype(a_lo, DOT), _nvfp4_weights(packed & 15, gscale, DOT), DOT)
            acc += _dot(_as_dot_dtype(a_hi, DOT), _nvfp4_weights(packed >> 4, gscale, DOT), DOT)
        else:
            offs_k = k0 + tl.arange(0, BLOCK_K)
            kmask = offs_k < K
            a = tl.load(a_rows + offs_k[None, :], mask=m_mask[:, None] & kmask[None, :], other=0)
            b = tl.load(b_cols + offs_k[:, None], mask=kmask[:, None] & n_mask[None, :], other=0)
            a = _operand(a, A_KIND, DOT, FP8_NATIVE, FP8_TYPE)
            b = _operand(b, B_KIND, DOT, FP8_NATIVE, FP8_TYPE)
            if GROUPED:
                part = _dot(a, b, DOT).to(tl.float32)
                if A_GROUP > 0:
                    sa = tl.load(as_ptr + rows_m * stride_asm + k0 // A_GROUP, mask=m_mask,
                                 other=0.0)
                    part = part * sa[:, None]
                if B_GROUP > 0:
                    sb = tl.load(bs_ptr + rows_n * stride_bsn + k0 // B_GROUP, mask=n_mask,
                                 other=0.0)
                    part = part * sb[None, :]
                acc += part
            else:
                acc += _dot(a, b, DOT)

    acc = acc.to(tl.float32)
    if HAS_A_SCALE and A_GROUP == 0:
        sa = tl.load(as_ptr + rows_m * stride_asm, mask=m_mask, other=0.0)
        acc = acc * sa[:, None]
    if HAS_B_SCALE and B_GROUP == 0:
        sb = tl.load(bs_ptr + rows_n * stride_bsn, mask=n_mask, other=0.0)
        acc = acc * sb[None, :]
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + rows_m[:, None] * stride_om + offs_n[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    if OUT_BF16:
        tl.store(out_ptrs, _bf16_rne(acc), mask=mask)
    else:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------- launchers


def _pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two <= cap dividing n."""
    d = 1
    while d * 2 <= cap and n % (d * 2) == 0:
        d *= 2
    return d


def quantize_activation(
    x: torch.Tensor,
    act: ActivationQuant,
    scale: torch.Tensor | None = None,
    *,
    qdq_dtype: torch.dtype | None = None,
    scale_mul: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x [M, K]`` quantized as ``act`` says, bit-identical to
    ``engine.quantization.numerics.quantize_dequantize``.

    ``scale``: a one-element tensor, the static scale (static schemes) or nvfp4's global
    input scale. With ``qdq_dtype`` the result is ``(QDQ(x) in qdq_dtype, None)`` (bf16
    rounded to nearest even); otherwise ``(codes, scales)``: int8 codes or e4m3fn bytes
    (uint8) ``[M, K]`` and float32 scales ``[M, 1]`` (per token / tensor / static) or
    ``[M, K / group]`` (groups), multiplied by ``scale_mul`` (2 for fnuz codes).
    """
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K], got {tuple(x.shape)}")
    if not x.is_contiguous():
        x = x.contiguous()
    m, k = x.shape
    enc = _ENC[act.encoding]
    grouped = act.dynamic and (act.strategy == "group" or enc == ENC_NVFP4)
    group = (act.group_size or 0) if grouped else 0
    if enc == ENC_NVFP4:
        if not act.dynamic or group != NVFP4_GROUP:
            raise ValueError("nvfp4 activations are dynamic groups of 16")
        if qdq_dtype is None:
            raise ValueError("nvfp4 activations are only quantize-dequantized here")
        if scale is None:
            raise ValueError("nvfp4 activations need the global input scale")
    if grouped and (group <= 0 or k % group):
        raise ValueError(f"activation groups of {act.group_size} over {k} features")
    if not act.dynamic and scale is None:
        raise ValueError("a static activation scheme needs its checkpoint scale")
    mode = (MODE_GROUP if grouped else MODE_STATIC if not act.dynamic
            else MODE_TENSOR if act.strategy == "tensor" else MODE_TOKEN)
    dev = x.device
    if qdq_dtype is not None:
        q = torch.empty((m, k), dtype=qdq_dtype, device=dev)
        scales = None
        s_arg, stride_sm = q, 0
    else:
        q = torch.empty((m, k), dtype=torch.int8 if enc == ENC_INT8 else torch.uint8, device=dev)
        scales = torch.empty((m, k // group if grouped else 1), dtype=torch.float32, device=dev)
        s_arg, stride_sm = scales, scales.stride(0)
    if m == 0:
        return q, scales
    scale_arg = scale.reshape(-1)[:1].float() if scale is not None else x
    block_k = min(next_power_of_2(k), 2048)
    rowmax = x
    if mode == MODE_TENSOR:
        rowmax = torch.empty(m, dtype=torch.float32, device=dev)
        _row_absmax_kernel[(m,)](x, rowmax, k, x.stride(0), BLOCK_K=block_k)
    group_p2 = next_power_of_2(group) if grouped else 1
    groups = min(max(1, 2048 // group_p2), next_power_of_2(k // group)) if grouped else 1
    _act_quant_kernel[(m,)](
        x, q, s_arg, scale_arg, rowmax,
        m, k, x.stride(0), q.stride(0), stride_sm,
        ENC=enc, MODE=mode, QDQ=qdq_dtype is not None,
        OUT_BF16=qdq_dtype == torch.bfloat16,
        HALF_RANGE=(127.5, FP8_MAX, 6.0)[enc], EPS=F32_EPS, SCALE_MUL=float(scale_mul),
        GROUP=max(group, 1), GROUP_P2=group_p2, GROUPS=groups,
        BLOCK_K=block_k, BLOCK_R=min(next_power_of_2(m), 1024),
    )
    return q, scales


@dataclass(frozen=True)
class _Tiles:
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


def _choose_tiles(m: int, n: int, k: int, *, dot: int, nvfp4: bool, k_group: int,
                  units: int, amd: bool) -> _Tiles:
    """Heuristic tiles (not tuned on hardware): decode rows get 16-row tiles and N tiles
    narrow enough to put about a program per compute unit on the weight stream; prefill
    128 x 128 tiles (32 x 64 for float32 dots, which are fma loops)."""
    eight_bit = dot in (DOT_INT8, DOT_FP8)
    block_m = min(max(16, next_power_of_2(m)), 128)
    if dot == DOT_FP32:  # fma dots: 32 x 64 x 32 is what fits sm_90's registers unspilled
        block_m = min(block_m, 32)
        block_n = 64 if block_m == 32 or -(-n // 64) >= units else 32
        block_k, warps, stages = (32 if block_m == 32 else 64), 4, 3
    elif block_m <= 32:
        block_n = 64 if -(-n // 64) >= units else 32
        block_k = 256 if eight_bit else 128
        warps, stages = 4, 4
    else:
        block_n = 128 if block_m == 128 else 64
        block_k = 128 if eight_bit else 64
        warps, stages = (8 if block_m == 128 else 4), 3
    block_n = min(block_n, max(16, next_power_of_2(n)))
    block_k = min(block_k, max(16, next_power_of_2(k)))
    if k_group:
        block_k = min(block_k, _pow2_divisor(k_group, 128))
    if nvfp4:
        block_k = max(block_k, 32)
    if amd:
        stages = 2
    return _Tiles(block_m, block_n, block_k, 8, warps, stages)


def _fp8_triton_type(flavour: str | None):
    if triton is None or flavour is None:
        return None
    return tl.float8e4b8 if flavour == "e4m3fnuz" else tl.float8e4nv


# --------------------------------------------------------------------------- kernel classes


@dataclass
class _Launch:
    """One GEMM launch: output rows ``start:end`` of the weights, quantized with input
    scale ``scale_index`` (None: dynamic or no activation quantization)."""

    start: int
    end: int
    scale_index: int | None


@dataclass
class _Plan:
    a_kind: int  # KIND_FLOAT (x itself or its QDQ) / KIND_INT8 / KIND_FP8 codes
    b_kind: int
    dot: int | None  # None: the activations' dtype decides (float operands)
    fp8_native: bool
    fp8_flavour: str | None
    act_scale_mul: float
    a_group: int
    b_group: int
    launches: list[_Launch] = field(default_factory=list)
    path: str = ""


class _TritonQuantGemm(QuantizedGemmKernel):
    """What the three kernels share: capability binding, shards, launches."""

    name: ClassVar[str] = "triton_quant_gemm"
    capability: ClassVar[DeviceCapability | None] = None
    encoding: ClassVar[str] = ""

    def __init__(self) -> None:
        self.path: str | None = None

    # -- binding ----------------------------------------------------------------------
    @classmethod
    def for_capability(cls, capability: DeviceCapability | None) -> type[_TritonQuantGemm]:
        """This kernel bound to a device's arithmetic (None: the interpreter's, for tests
        under TRITON_INTERPRET=1)."""
        return _bound(cls, capability)

    @classmethod
    def _fp8_flavour(cls) -> str | None:
        """The fp8 type the codes are multiplied in (None: decoded to bf16 instead)."""
        cap = cls.capability
        if cap is not None and cap.fp8_mma and cap.fp8_dtype in ("e4m3fn", "e4m3fnuz"):
            return cap.fp8_dtype
        return None

    @classmethod
    def _int8_mma(cls) -> bool:
        cap = cls.capability
        return _INTERPRETED if cap is None else cap.int8_mma

    # -- acceptance -------------------------------------------------------------------
    @classmethod
    def can_implement(cls, spec: QuantizedLayerSpec) -> str | None:
        if triton is None:
            return TRITON_MISSING_MESSAGE
        if cls.capability is None and not _INTERPRETED:
            return ("not bound to a device capability (fp_gemm_kernels(capability)); unbound "
                    "kernels run only under TRITON_INTERPRET=1")
        if spec.encoding != cls.encoding:
            return f"{spec.encoding} weights (it takes {cls.encoding})"
        if spec.act_dtype not in SUPPORTED_DTYPES:
            return f"activations in {spec.act_dtype} (it takes float16, bfloat16, float32)"
        if spec.in_features < 1 or spec.out_features < 1:
            return f"a {spec.out_features}x{spec.in_features} layer"
        if spec.act_order:
            return "act-order (g_idx) input features"
        if spec.has_zero_points:
            return "zero points (asymmetric weights)"
        if spec.in_features % spec.group_size:
            return f"{spec.in_features} input features in groups of {spec.group_size}"
        shards = spec.shard_sizes or (spec.out_features,)
        if sum(shards) != spec.out_features:
            return f"output shards {list(shards)} do not add up to {spec.out_features}"
        return cls._refuse(spec)

    @classmethod
    @abstractmethod
    def _refuse(cls, spec: QuantizedLayerSpec) -> str | None:
        """The subclass's own refusals (its encodings and activation strategies)."""

    @staticmethod
    def _k_group_reason(what: str, group: int, k: int) -> str | None:
        """Why a group of ``group`` input features cannot scale per K block (None: it can,
        or it spans the whole row)."""
        if group >= k:
            return None
        if _pow2_divisor(group, 128) < 16:
            return f"{what} groups of {group} (K blocks need a power of two >= 16 dividing it)"
        return None

    @classmethod
    def _act_reason(cls, spec: QuantizedLayerSpec, encoding: str) -> str | None:
        act = spec.activation
        if act is None:
            return None
        if act.encoding != encoding:
            return f"{act.encoding} activations with {spec.encoding} weights"
        if act.dynamic and act.strategy == "group":
            if not act.group_size or spec.in_features % act.group_size:
                return f"activation groups of {act.group_size} over {spec.in_features} features"
            if _pow2_divisor(act.group_size, 128) < 16:
                return (f"activation groups of {act.group_size} (K blocks need a power of two "
                        ">= 16 dividing it)")
        return None

    # -- preparing --------------------------------------------------------------------
    @abstractmethod
    def _codes(self, weights: QuantizedWeights) -> tuple[torch.Tensor, torch.Tensor]:
        """The weight codes and scales in this kernel's layout."""

    @abstractmethod
    def _plan(self, spec: QuantizedLayerSpec) -> _Plan:
        """How this kernel runs a layer of ``spec`` (tiles, scale modes)."""

    def prepare(self, layer: nn.Module, weights: QuantizedWeights) -> None:
        spec = weights.spec
        why = type(self).can_implement(spec)
        if why is not None:
            raise ValueError(f"{self.name} cannot run this layer: {why}")
        if weights.zeros is not None:
            raise ValueError(f"{self.name}: zero points (asymmetric weights)")
        if weights.g_idx is not None:
            trivial = torch.arange(spec.in_features, device=weights.g_idx.device) // spec.group_size
            if not bool((weights.g_idx.to(torch.int64) == trivial).all()):
                raise ValueError(f"{self.name}: act-order (g_idx) input features")
        codes, scales = self._codes(weights)
        plan = self._plan(spec)
        shards = tuple(weights.shard_sizes) or tuple(spec.shard_sizes) or (spec.out_features,)
        act = spec.activation
        input_scales = None
        if act is not None and (not act.dynamic or act.encoding == "nvfp4"):
            if weights.input_scales is None:
                raise ValueError(f"{self.name}: {spec.scheme} needs its input scales")
            input_scales = weights.input_scales.reshape(-1).float()
            if input_scales.numel() == 1 and len(shards) > 1:
                input_scales = input_scales.repeat(len(shards))
            if input_scales.numel() != len(shards):
                raise ValueError(f"{self.name}: {input_scales.numel()} input scales for "
                                 f"{len(shards)} shards")
            values = input_scales.tolist()  # once, at load: runs of equal scales share a launch
            start = 0
            for s, size in enumerate(shards):
                if plan.launches and values[plan.launches[-1].scale_index] == values[s]:
                    plan.launches[-1].end = start + size
                else:
                    plan.launches.append(_Launch(start, start + size, s))
                start += size
            input_scales = input_scales.contiguous()
        else:
            plan.launches.append(_Launch(0, spec.out_features, None))
        layer.register_buffer("qf_codes", codes.contiguous(), persistent=False)
        layer.register_buffer("qf_scales", scales.float().contiguous(), persistent=False)
        layer.register_buffer("qf_input_scales", input_scales, persistent=False)
        layer.quant_spec = spec
        layer.qf_plan = plan
        self.path = plan.path

    @property
    def description(self) -> str:
        return f"{self.name} ({self.path})" if self.path else self.name

    # -- running ----------------------------------------------------------------------
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None,
              out: torch.Tensor | None = None) -> torch.Tensor:
        """``x [..., K] -> [..., N]`` in x's dtype (into ``out`` when given)."""
        spec: QuantizedLayerSpec = layer.quant_spec
        plan: _Plan = layer.qf_plan
        k, n = spec.in_features, spec.out_features
        if x.shape[-1] != k:
            raise ValueError(f"x has {x.shape[-1]} features, the layer takes {k}")
        if x.dtype not in _DOT_OF_DTYPE:
            raise ValueError(f"x has dtype {x.dtype}; supported: float16, bfloat16, float32")
        rows = x.reshape(-1, k)
        if not rows.is_contiguous():
            rows = rows.contiguous()
        m = rows.shape[0]
        if out is None:
            out2 = torch.empty((m, n), dtype=x.dtype, device=x.device)
        else:
            if out.dtype != x.dtype or out.numel() != m * n or not out.is_contiguous():
                raise ValueError(f"out must be a contiguous {x.dtype} tensor of {m * n} values")
            out2 = out.view(m, n)
        if m == 0:
            return out2.reshape(*x.shape[:-1], n)
        codes, scales = layer.qf_codes, layer.qf_scales
        check_device(_INTERPRETED, rows, codes, scales, out2,
                     *([] if bias is None else [bias]))
        act = spec.activation
        dot = plan.dot if plan.dot is not None else _DOT_OF_DTYPE[x.dtype]
        if _INTERPRETED and dot in (DOT_BF16, DOT_FP16):
            dot = DOT_FP32  # the interpreter's 16-bit tl.dot is wrong; the values are exact
        qdq = plan.a_kind == KIND_FLOAT and act is not None
        shared = None  # dynamic schemes: one quantization serves every shard
        for launch in plan.launches:
            if act is None:
                a, a_scales = rows, None
            elif launch.scale_index is None:
                if shared is None:
                    shared = self._quantize(rows, act, None, plan, qdq)
                a, a_scales = shared
            else:
                s = launch.scale_index
                a, a_scales = self._quantize(rows, act, layer.qf_input_scales[s:s + 1], plan, qdq)
            self._gemm(plan, dot, a, a_scales, codes[launch.start:launch.end],
                       scales[launch.start:launch.end],
                       None if bias is None else bias[launch.start:launch.end],
                       out2[:, launch.start:launch.end])
        return out2.reshape(*x.shape[:-1], n)

    @staticmethod
    def _quantize(rows, act, scale, plan: _Plan, qdq: bool):
        if qdq:
            return quantize_activation(rows, act, scale, qdq_dtype=rows.dtype)
        return quantize_activation(rows, act, scale, scale_mul=plan.act_scale_mul)

    def _gemm(self, plan: _Plan, dot: int, a, a_scales, codes, scales, bias, out) -> None:
        m, n = out.shape
        k = a.shape[1]
        cap = type(self).capability
        nvfp4 = plan.b_kind == KIND_NVFP4
        k_group = math.gcd(plan.a_group, plan.b_group)  # 0: no K-block scales
        tiles = _choose_tiles(m, n, k, dot=dot, nvfp4=nvfp4,
                              k_group=k_group, units=compute_units(out.device),
                              amd=cap is not None and cap.vendor == "amd")
        grid = (triton.cdiv(m, tiles.block_m) * triton.cdiv(n, tiles.block_n),)
        a_scales_arg = a_scales if a_scales is not None else scales
        _qgemm_kernel[grid](
            a, codes, scales, a_scales_arg, bias if bias is not None else scales, out,
            m, n, k,
            a.stride(0), codes.stride(0), scales.stride(0), a_scales_arg.stride(0),
            out.stride(0),
            A_KIND=plan.a_kind, B_KIND=plan.b_kind, DOT=dot,
            FP8_NATIVE=plan.fp8_native, FP8_TYPE=_fp8_triton_type(plan.fp8_flavour),
            A_GROUP=plan.a_group, B_GROUP=plan.b_group,
            GROUPED=bool(plan.a_group or plan.b_group),
            HAS_A_SCALE=a_scales is not None, HAS_B_SCALE=not nvfp4,
            HAS_BIAS=bias is not None, OUT_BF16=out.dtype == torch.bfloat16,
            BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
            GROUP_M=tiles.group_m, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        )


@functools.cache
def _bound(cls: type[_TritonQuantGemm], capability: DeviceCapability | None) -> type:
    return type(cls.__name__, (cls,), {"capability": capability, "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__})


class TritonFp8Gemm(_TritonQuantGemm):
    """fp8 e4m3 weights (per tensor / channel / block) x fp8 or unquantized activations."""

    name: ClassVar[str] = "triton_fp8_gemm"
    encoding: ClassVar[str] = "fp8"

    @classmethod
    def _refuse(cls, spec: QuantizedLayerSpec) -> str | None:
        if spec.weight_bits != 8:
            return f"{spec.weight_bits}-bit fp8 weights"
        why = cls._k_group_reason("weight scale", spec.group_size, spec.in_features)
        return why or cls._act_reason(spec, "fp8")

    def _codes(self, weights: QuantizedWeights) -> tuple[torch.Tensor, torch.Tensor]:
        codes = weights.codes
        if codes.dtype not in (torch.float8_e4m3fn, torch.uint8):
            raise ValueError(f"{self.name}: fp8 codes in {codes.dtype} (e4m3fn expected)")
        codes = codes.view(torch.uint8)
        scales = weights.scales.float()
        if type(self)._fp8_flavour() == "e4m3fnuz":
            # a fn byte read as fnuz is half its value: keep the bytes, double the scales;
            # 0x80 (fn's -0) is fnuz's NaN
            codes = torch.where(codes == 0x80, torch.zeros_like(codes), codes)
            scales = scales * 2.0
        return codes, scales

    def _plan(self, spec: QuantizedLayerSpec) -> _Plan:
        flavour = type(self)._fp8_flavour()
        act = spec.activation
        b_group = spec.group_size if spec.group_size < spec.in_features else 0
        scales = "per-channel" if not b_group else f"groups of {b_group}"
        if act is None:
            return _Plan(KIND_FLOAT, KIND_FP8, None, flavour is not None, flavour, 1.0, 0,
                         b_group, path=f"weight-only, {scales}, "
                         f"{'fp8 cvt' if flavour else 'decoded'} to the activation dtype")
        a_group = act.group_size if act.dynamic and act.strategy == "group" else 0
        act_desc = (f"{'dynamic' if act.dynamic else 'static'} per-"
                    f"{'group ' + str(a_group) if a_group else act.strategy} activations")
        if flavour is not None:
            return _Plan(KIND_FP8, KIND_FP8, DOT_FP8, True, flavour,
                         2.0 if flavour == "e4m3fnuz" else 1.0, a_group, b_group,
                         path=f"{flavour} mma, {scales}, {act_desc}")
        return _Plan(KIND_FP8, KIND_FP8, DOT_BF16, False, None, 1.0, a_group, b_group,
                     path=f"decoded to bf16 (no fp8 mma), {scales}, {act_desc}")


class TritonInt8Gemm(_TritonQuantGemm):
    """Symmetric int8 weights x int8 (W8A8) or unquantized (W8A16) activations."""

    name: ClassVar[str] = "triton_int8_gemm"
    encoding: ClassVar[str] = "int"

    @classmethod
    def _refuse(cls, spec: QuantizedLayerSpec) -> str | None:
        if spec.weight_bits != 8:
            return f"{spec.weight_bits}-bit int codes (it takes 8)"
        why = cls._k_group_reason("weight scale", spec.group_size, spec.in_features)
        return why or cls._act_reason(spec, "int8")

    def _codes(self, weights: QuantizedWeights) -> tuple[torch.Tensor, torch.Tensor]:
        codes = weights.codes
        if codes.dtype != torch.uint8:
            raise ValueError(f"{self.name}: int codes in {codes.dtype} (uint8 expected)")
        return (codes ^ 0x80).view(torch.int8), weights.scales.float()  # code - 128

    def _plan(self, spec: QuantizedLayerSpec) -> _Plan:
        act = spec.activation
        b_group = spec.group_size if spec.group_size < spec.in_features else 0
        scales = "per-channel" if not b_group else f"groups of {b_group}"
        if act is None:
            return _Plan(KIND_FLOAT, KIND_INT8, None, False, None, 1.0, 0, b_group,
                         path=f"weight-only, {scales}")
        a_group = act.group_size if act.dynamic and act.strategy == "group" else 0
        mma = type(self)._int8_mma()
        return _Plan(KIND_INT8, KIND_INT8, DOT_INT8 if mma else DOT_BF16, False, None, 1.0,
                     a_group, b_group,
                     path=f"{'int8 mma' if mma else 'int8 as bf16 (no int8 mma)'}, {scales}")


class TritonNvfp4Gemm(_TritonQuantGemm):
    """NVFP4 (e2m1, fp8 group scales of 16) weights, dequantized to bf16 in the kernel,
    x NVFP4-QDQ or unquantized activations (module docstring: no native FP4 MMA)."""

    name: ClassVar[str] = "triton_nvfp4_gemm"
    encoding: ClassVar[str] = "nvfp4"

    @classmethod
    def _refuse(cls, spec: QuantizedLayerSpec) -> str | None:
        if spec.weight_bits != 4:
            return f"{spec.weight_bits}-bit nvfp4 weights"
        if spec.group_size != NVFP4_GROUP:
            return f"nvfp4 groups of {spec.group_size} (it takes 16)"
        act = spec.activation
        if act is not None and (act.encoding != "nvfp4" or not act.dynamic
                                or act.group_size != NVFP4_GROUP):
            return "activations other than dynamic nvfp4 groups of 16"
        return None

    def _codes(self, weights: QuantizedWeights) -> tuple[torch.Tensor, torch.Tensor]:
        spec = weights.spec
        codes = weights.codes
        if codes.dtype != torch.uint8 or tuple(codes.shape) != (spec.out_features,
                                                                spec.in_features // 2):
            raise ValueError(f"{self.name}: nvfp4 codes {codes.dtype} {tuple(codes.shape)}")
        return codes, weights.scales.float()

    def _plan(self, spec: QuantizedLayerSpec) -> _Plan:
        act = "nvfp4 activations (QDQ)" if spec.activation is not None else "weight-only"
        return _Plan(KIND_FLOAT, KIND_NVFP4, None, False, None, 1.0, 0, 0,
                     path=f"dequantized to bf16 (no portable fp4 mma), {act}")


KERNEL_CLASSES: tuple[type[_TritonQuantGemm], ...] = (TritonFp8Gemm, TritonInt8Gemm,
                                                      TritonNvfp4Gemm)


def fp_gemm_kernels(capability: DeviceCapability | None) -> list[type[QuantizedGemmKernel]]:
    """The W8A8 / FP8 / NVFP4 kernels bound to ``capability``, in preference order
    (their encodings do not overlap); [] without triton."""
    if triton is None:
        return []
    return [cls.for_capability(capability) for cls in KERNEL_CLASSES]

