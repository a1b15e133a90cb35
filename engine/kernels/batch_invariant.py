"""Batch-invariant Triton kernels: a row's result never depends on the other rows.

Batch-invariant mode (:mod:`engine.core.batch_invariance`) needs every reduction of a
row to run in one order whatever the number of rows, the row's place among them and the
step that produced it (prefill chunk, decode, speculative verification). Library kernels
break this by choosing their schedule from the shape: a GEMM switches tile sizes or
splits K when M is small, a norm splits a row over more threads when rows are few. The
kernels here fix the order by construction (the approach of vLLM's batch-invariant
ops and Thinking Machines' "Defeating Nondeterminism in LLM Inference"):

* :func:`matmul` (``y = x @ W^T + b``): ONE tile configuration per dtype pair, whatever
  M is; no split-K; each output element accumulates in fp32 over K in ``BLOCK_K`` steps,
  in increasing k. The row count only changes how many programs run, never what one
  program computes for an element (rows outside ``M`` are masked to zero and discarded).
* :func:`rms_norm` / :func:`log_softmax` / :func:`softmax`: one program per row, reducing the row in
  ``BLOCK``-wide chunks in increasing column order into a ``BLOCK``-wide fp32 vector
  that a single ``tl.sum`` folds at the end; ``BLOCK`` depends only on the row length.

The constant tile configurations are the price: a decode GEMM (M = 1) computes a full
``BLOCK_M`` tile. :class:`TritonBatchInvariantGemm` offers :func:`matmul` to the GPU
platforms' dense layers in the mode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import triton
import triton.language as tl

from engine.core.interfaces.gemm import DenseGemmKernel, DenseLayerSpec
from engine.kernels.triton_utils import (
    SUPPORTED_DTYPES,
    check_device,
    check_dtype,
    interpreting,
    next_power_of_2,
)

_INTERPRETED = interpreting()  # triton.jit below decides the same way, at import time
GPU_DEVICE_TYPES = ("cuda", "xpu")  # ROCm devices are "cuda" to torch
MAX_ROW_BLOCK = 4096  # widest chunk one norm / softmax program reduces at a time


def triton_batch_invariant_available(device: torch.device | str) -> bool:
    """Whether these kernels can run on ``device``: a GPU (CUDA, ROCm, XPU), or the CPU
    when Triton interprets kernels (``TRITON_INTERPRET=1``, how CI tests them)."""
    kind = torch.device(device).type
    return kind in GPU_DEVICE_TYPES or (kind == "cpu" and _INTERPRETED)


# ----------------------------------------------------------------------------- matmul


@dataclass(frozen=True)
class MatmulConfig:
    """The one tile shape used for every M (the point of the kernel)."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


# 16-bit operands run on tensor cores; fp32 runs IEEE dots (no TF32, like F.linear's
# default), whose fp32 operand tiles need a shorter K step to stay in shared memory.
# (vLLM's batch-invariant GEMM settled on the same tiles.)
_CONFIG_16BIT = MatmulConfig(128, 128, 64, 8, 8, 3)
_CONFIG_FP32 = MatmulConfig(128, 128, 32, 8, 8, 2)


def matmul_config(dtype: torch.dtype, device: torch.device | None = None) -> MatmulConfig:
    """The tile configuration for activations of ``dtype``: a function of the dtype and
    the device kind only, never of M. AMD (64 KiB LDS) and Intel GPUs pipeline one stage
    fewer; stages and warps decide how loads overlap, not the order of any sum."""
    cfg = _CONFIG_FP32 if dtype == torch.float32 else _CONFIG_16BIT
    if device is not None and (device.type == "xpu" or torch.version.hip is not None):
        cfg = MatmulConfig(cfg.block_m, cfg.block_n, cfg.block_k, cfg.group_m, cfg.num_warps,
                           max(1, cfg.num_stages - 1))
    return cfg


@triton.jit
def _matmul_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_ym,
    stride_yn,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] tile of y; K walked in BLOCK_K steps, in order, fp32 acc."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    # Grouped tile order (L2 reuse of W tiles): decides only which program computes a
    # tile, never how.
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    row_ok = rows < M
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        k_ok = k < K
        a = tl.load(
            x_ptr + rows[:, None] * stride_xm + k[None, :] * stride_xk,
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        b = tl.load(
            w_ptr + cols[None, :] * stride_wn + k[:, None] * stride_wk,
            mask=col_ok[None, :] & k_ok[:, None],
            other=0.0,
        )  # [BLOCK_K, BLOCK_N]: W^T's tile
        acc = tl.dot(a.to(DOT_DTYPE), b.to(DOT_DTYPE), acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(
        y_ptr + rows[:, None] * stride_ym + cols[None, :] * stride_yn,
        acc.to(y_ptr.dtype.element_ty),
        mask=row_ok[:, None] & col_ok[None, :],
    )


def _dot_types(x_dtype: torch.dtype) -> tuple[tl.dtype, str]:
    """What tl.dot multiplies (fp32 accumulation always): the activation's 16-bit type on a
    GPU, fp32 at IEEE precision otherwise (the interpreter has no 16-bit arithmetic)."""
    if _INTERPRETED or x_dtype == torch.float32:
        return tl.float32, "ieee"
    # The precision flag only concerns fp32 operands; "tf32" as unified attention passes.
    return (tl.float16 if x_dtype == torch.float16 else tl.bfloat16), "tf32"


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] @ weight[N, K]^T (+ bias [N])`` in x's dtype, batch-invariant.

    ``weight`` may be stored narrower than ``x`` (a bf16 weight under fp32 activations);
    it is widened tile by tile, which is exact."""
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)} do not chain")
    check_dtype("x", x)
    check_dtype("weight", weight)
    tensors = [x, weight] if bias is None else [x, weight, bias]
    check_device(_INTERPRETED, *tensors)
    n, k = weight.shape
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
    rows = x.reshape(-1, k)
    m = rows.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m and n:
        cfg = matmul_config(x.dtype, x.device)
        dot_dtype, precision = _dot_types(x.dtype)
        grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
        _matmul_kernel[grid](
            rows, weight, bias if bias is not None else y, y,
            m, n, k,
            *rows.stride(), *weight.stride(), *y.stride(),
            HAS_BIAS=bias is not None,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            GROUP_M=cfg.group_m, DOT_DTYPE=dot_dtype, DOT_PRECISION=precision,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    return y.view(*x.shape[:-1], n)


class TritonBatchInvariantGemm(DenseGemmKernel):
    """Dense layers on :func:`matmul` in batch-invariant mode (GPU platforms)."""

    name: ClassVar[str] = "triton_batch_invariant"
    keeps_layout: ClassVar[bool] = True  # reads the checkpoint's [out, in] weight
    batch_invariant: ClassVar[bool] = True

    @classmethod
    def can_implement(cls, spec: DenseLayerSpec) -> str | None:
        if not triton_batch_invariant_available(spec.device):
            return (f"{cls.name} runs on CUDA / ROCm / XPU devices (or the CPU under "
                    f"TRITON_INTERPRET=1), not {spec.device}")
        for what, dtype in (("weight", spec.dtype), ("activation", spec.act_dtype)):
            if dtype not in SUPPORTED_DTYPES:
                return f"{cls.name} needs float16 / bfloat16 / float32 {what}s, not {dtype}"
        return None

    def prepare(self, weight: torch.Tensor, spec: DenseLayerSpec) -> torch.Tensor:
        return weight

    def apply(
        self, weight: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return matmul(x, weight, bias)


# ---------------------------------------------------------------------------- RMSNorm


def row_block(width: int) -> int:
    """The chunk a per-row program reduces at a time: a function of the row width only."""
    return min(next_power_of_2(width), MAX_ROW_BLOCK)


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    width,
    heads,
    eps,
    stride_xt,
    stride_xh,
    stride_rt,
    stride_ot,
    HAS_RESIDUAL: tl.constexpr,
    GEMMA: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Row ``row`` (token ``row // heads``, head ``row % heads``): HF's order -- sum in the
    storage dtype, normalise in fp32, cast back, scale by the weight (Gemma: scale by
    ``1 + weight`` in fp32, then cast)."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + (row // heads) * stride_xt + (row % heads) * stride_xh
    cols = tl.arange(0, BLOCK)
    sq = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, width, BLOCK):
        c = start + cols
        ok = c < width
        v = tl.load(x_row + c, mask=ok, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + row * stride_rt + c, mask=ok, other=0.0)
            v = (v.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        v = v.to(tl.float32)
        sq += v * v
    inv = 1.0 / tl.sqrt(tl.sum(sq, axis=0) / width + eps)
    # Second pass re-reads the untouched inputs; each element's residual slot is written
    # after its own last read, so no other lane ever reads a written slot.
    for start in range(0, width, BLOCK):
        c = start + cols
        ok = c < width
        v = tl.load(x_row + c, mask=ok, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + row * stride_rt + c, mask=ok, other=0.0)
            v = (v.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
            tl.store(res_ptr + row * stride_rt + c, v, mask=ok)
        w = tl.load(w_ptr + c, mask=ok, other=0.0).to(tl.float32)
        if GEMMA:
            y = v.to(tl.float32) * inv * (1.0 + w)
        else:
            y = (v.to(tl.float32) * inv).to(x_ptr.dtype.element_ty).to(tl.float32) * w
        tl.store(out_ptr + row * stride_ot + c, y.to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    *,
    gemma: bool = False,
) -> torch.Tensor:
    """``FusedOps.rms_norm`` semantics, batch-invariant: ``weight * x / rms(x)``; with
    ``residual`` the same of ``x + residual`` (rounded to x's dtype), the sum written back
    into ``residual``. ``x`` is ``[rows, width]`` (rows may be strided) or, without a
    residual, ``[tokens, heads, width]`` with contiguous heads -> ``[tokens * heads, width]``.
    ``gemma``: GemmaRMSNorm's ``x / rms(x) * (1 + weight)`` all in fp32, then the cast.
    """
    if x.stride(-1) != 1:
        raise ValueError("rms_norm needs x's last dimension contiguous")
    width = x.shape[-1]
    if x.dim() == 3 and residual is None:
        if x.stride(1) != width:
            raise ValueError("a 3-D x needs contiguous heads ([tokens, heads, width])")
        tokens, heads = x.shape[0], x.shape[1]
        stride_xt, stride_xh = x.stride(0), x.stride(1)
    elif x.dim() == 2:
        tokens, heads = x.shape[0], 1
        stride_xt, stride_xh = x.stride(0), 0
    else:
        raise ValueError(f"rms_norm takes [rows, width] (or [tokens, heads, width] without a "
                         f"residual), got {tuple(x.shape)}")
    if weight.shape != (width,):
        raise ValueError(f"weight must be [{width}], got {tuple(weight.shape)}")
    check_dtype("x", x)
    tensors = [x, weight]
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(-1) != 1:
            raise ValueError("residual must match x's shape and dtype, last dim contiguous")
        tensors.append(residual)
    check_device(_INTERPRETED, *tensors)
    out = torch.empty((tokens * heads, width), dtype=x.dtype, device=x.device)
    if out.numel():
        _rms_norm_kernel[(tokens * heads,)](
            x, residual if residual is not None else x, weight, out,
            width, heads, float(eps),
            stride_xt, stride_xh,
            residual.stride(0) if residual is not None else 0,
            out.stride(0),
            HAS_RESIDUAL=residual is not None,
            GEMMA=gemma,
            BLOCK=row_block(width),
            num_warps=4 if width >= 1024 else 1,
        )
    return out


# ------------------------------------------------------------------------ log_softmax


@triton.jit
def _log_softmax_kernel(
    x_ptr, out_ptr, width, stride_x, stride_o, LOG: tl.constexpr, BLOCK: tl.constexpr
):
    """One row: max (exact in any order), then sum of exp(x - max) in fixed chunk order;
    writes x - max - log(sum) (LOG) or exp(x - max) / sum."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    for start in range(0, width, BLOCK):
        c = start + cols
        v = tl.load(x_ptr + row * stride_x + c, mask=c < width, other=float("-inf"))
        m = tl.maximum(m, v.to(tl.float32))
    row_max = tl.max(m, axis=0)
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, width, BLOCK):
        c = start + cols
        v = tl.load(x_ptr + row * stride_x + c, mask=c < width, other=float("-inf"))
        total += tl.exp(v.to(tl.float32) - row_max)
    row_sum = tl.sum(total, axis=0)
    log_total = tl.log(row_sum)
    for start in range(0, width, BLOCK):
        c = start + cols
        ok = c < width
        v = tl.load(x_ptr + row * stride_x + c, mask=ok, other=0.0).to(tl.float32)
        if LOG:
            y = (v - row_max) - log_total
        else:
            y = tl.exp(v - row_max) / row_sum
        tl.store(out_ptr + row * stride_o + c, y, mask=ok)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """``torch.log_softmax(x, dim=-1)`` in float32 for ``x [rows, vocab]``, batch-invariant."""
    return _row_softmax(x, log=True)


def softmax(x: torch.Tensor) -> torch.Tensor:
    """``torch.softmax(x, dim=-1, dtype=float32)`` for ``x [rows, vocab]``, batch-invariant
    (the sampler's probabilities)."""
    return _row_softmax(x, log=False)


def _row_softmax(x: torch.Tensor, log: bool) -> torch.Tensor:
    """One program per row (the reduction order depends on the row width only)."""
    if x.dim() != 2:
        raise ValueError(f"(log_)softmax takes [rows, vocab], got {tuple(x.shape)}")
    check_dtype("x", x)
    check_device(_INTERPRETED, x)
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows, width = x.shape
    out = torch.empty((rows, width), dtype=torch.float32, device=x.device)
    if out.numel():
        _log_softmax_kernel[(rows,)](
            x, out, width, x.stride(0), out.stride(0),
            LOG=log, BLOCK=row_block(width), num_warps=8 if width >= 4096 else 4,
        )
    return out
