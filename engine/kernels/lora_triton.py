"""Batched multi-LoRA in portable Triton: Punica's shrink and expand, tokens grouped by slot.

Contract: engine/core/interfaces/lora.py. Algorithm (vLLM v1's punica kernels' shape):

1. :func:`group_by_slot` sorts the token ids by slot with torch ops on the device (a
   stable argsort; slot ``-1`` and anything outside ``[0, S)`` go to an extra bucket
   ``S``) and counts each bucket, giving bucket ``b``'s tokens as ``order[start[b] :
   start[b] + count[b]]``. Nothing is read on the host, so both launches are capturable
   in a device graph (shapes come from tensor sizes alone).
2. Both kernels run a grid of ``(token tiles, output tiles, S + 1 buckets)``; a program
   whose tile lies past its bucket's count returns at once. A program gathers its
   ``BLOCK_M`` tokens through ``order`` and multiplies them by its slot's adapter with
   ``tl.dot`` (one weight tile for every token of the tile: Punica's SGMV; a decode
   step's tiles are mostly one token, BGMV's case, at a dot's minimum size).

- shrink: ``out[t, k] = sum_i x[t, i] A[slot, k, i]`` over ``BLOCK_K`` chunks of ``in``;
  the bucket of tokens without an adapter writes zero rows.
- expand: an output tile of columns ``n`` may straddle shards: column ``n`` of shard
  ``j(n)`` reads ``s[t, j(n) R : j(n) R + R]``, so the tile's dot runs over all
  ``K = shards * R`` columns of ``s`` against ``B`` loaded block-diagonally (entry
  ``(k, n)`` is ``B[slot, k - j(n) R, n]`` when ``k`` falls in ``n``'s shard, else 0;
  ``B`` is R-major, ``[S, R, N]``, so a tile's row of ``n`` is contiguous):
  every ``B`` element is read once, the dot wastes a factor ``shards`` of (cheap)
  multiply-adds. ``y`` (any row / column stride) is loaded, added in float32 and stored
  rounded once; the bucket without an adapter does nothing. Shard bounds are scalar
  arguments (up to :data:`MAX_SHARDS` per launch; more launch per group of shards).

Accumulation is float32. shrink's dot takes bf16 / fp16 operands natively (exact
products); float32 runs at IEEE precision, and so does expand's (``s`` stays float32).
Importing this module needs no triton; launching does.
"""

from __future__ import annotations

from itertools import pairwise
from typing import Any, ClassVar, NamedTuple

import torch

from engine.core.interfaces.lora import LoRAKernel
from engine.kernels.triton_utils import (
    SUPPORTED_DTYPES,
    TRITON_MISSING_MESSAGE,
    check_device,
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

_INTERPRETED = interpreting()
GPU_DEVICE_TYPES = ("cuda", "xpu")  # torch's ROCm build also says "cuda"
MAX_SHARDS = 8  # shard bounds one expand launch takes as scalars



class SlotGroups(NamedTuple):
    """Token ids bucketed by slot (bucket ``S``: no adapter), all on the device."""

    order: torch.Tensor  # int32 [T]: token ids, bucket by bucket
    start: torch.Tensor  # int32 [S + 1]: first position of each bucket in order
    count: torch.Tensor  # int32 [S + 1]


def group_by_slot(token_slots: torch.Tensor, num_slots: int) -> SlotGroups:
    """Sort the tokens by slot with device ops only (no host synchronisation)."""
    slots = token_slots.to(torch.int64)
    bucket = torch.where((slots >= 0) & (slots < num_slots), slots, num_slots)
    order = torch.argsort(bucket, stable=True)
    count = torch.zeros(num_slots + 1, dtype=torch.int64, device=slots.device)
    count.scatter_add_(0, bucket, torch.ones_like(bucket))
    start = torch.cumsum(count, 0) - count
    return SlotGroups(order.to(torch.int32), start.to(torch.int32), count.to(torch.int32))


@optional_jit
def _bucket_tile(order_ptr, start_ptr, slot, m_tile, count, BLOCK_M: tl.constexpr):
    """Tile ``m_tile`` of bucket ``slot``: its token ids (int64) and which are real."""
    first = tl.load(start_ptr + slot)
    pos = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_valid = pos < count
    token = tl.load(order_ptr + first + pos, mask=row_valid, other=0).to(tl.int64)
    return token, row_valid


@optional_jit
def _shrink_kernel(
    x_ptr, a_ptr, out_ptr, order_ptr, start_ptr, count_ptr,
    K, IN, NUM_SLOTS,
    stride_xm, stride_xk, stride_as, stride_ak, stride_ai, stride_om, stride_ok,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """``BLOCK_M`` tokens of one bucket x ``BLOCK_N`` rows of its ``A``."""
    m_tile = tl.program_id(0)
    n_tile = tl.program_id(1)
    slot = tl.program_id(2)
    count = tl.load(count_ptr + slot)
    if m_tile * BLOCK_M >= count:
        return
    token, row_valid = _bucket_tile(order_ptr, start_ptr, slot, m_tile, count, BLOCK_M)
    cols = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    col_valid = cols < K
    out_ptrs = out_ptr + token[:, None] * stride_om + cols[None, :] * stride_ok
    out_mask = row_valid[:, None] & col_valid[None, :]
    in_len = tl.where(slot < NUM_SLOTS, IN, 0)  # tokens without an adapter: zero rows
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + token[:, None] * stride_xm + ks[None, :] * stride_xk
    a_ptrs = (a_ptr + slot.to(tl.int64) * stride_as + cols[None, :].to(tl.int64) * stride_ak
              + ks[:, None] * stride_ai)  # [BLOCK_K, BLOCK_N]: A[slot].T's tile
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k_start in range(0, in_len, BLOCK_K):
        k_valid = ks < in_len - k_start
        # Cast right after the load: the interpreter cannot do arithmetic on bf16.
        xv = tl.load(x_ptrs, mask=row_valid[:, None] & k_valid[None, :], other=0.0)
        av = tl.load(a_ptrs, mask=k_valid[:, None] & col_valid[None, :], other=0.0)
        acc += tl.dot(xv.to(DOT_DTYPE), av.to(DOT_DTYPE), input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        a_ptrs += BLOCK_K * stride_ai
    tl.store(out_ptrs, acc, mask=out_mask)


@optional_jit
def _expand_kernel(
    s_ptr, b_ptr, y_ptr, order_ptr, start_ptr, count_ptr,
    N, RANK, K, NUM_SLOTS, COL0, SHARD0,
    B1, B2, B3, B4, B5, B6, B7,  # shard bounds (relative to COL0) after the first
    stride_sm, stride_sk, stride_bs, stride_bn, stride_br, stride_ym, stride_yn,
    NUM_SHARDS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """``BLOCK_M`` tokens of one bucket x ``BLOCK_N`` output columns ``COL0 + n``."""
    m_tile = tl.program_id(0)
    n_tile = tl.program_id(1)
    slot = tl.program_id(2)
    # tokens without an adapter (the last bucket): y untouched
    count = tl.where(slot < NUM_SLOTS, tl.load(count_ptr + slot), 0)
    if m_tile * BLOCK_M >= count:
        return
    token, row_valid = _bucket_tile(order_ptr, start_ptr, slot, m_tile, count, BLOCK_M)
    cols = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    col_valid = cols < N
    shard = tl.zeros([BLOCK_N], dtype=tl.int32)  # each column's shard in this launch
    if NUM_SHARDS > 1:
        shard += (cols >= B1).to(tl.int32)
    if NUM_SHARDS > 2:
        shard += (cols >= B2).to(tl.int32)
    if NUM_SHARDS > 3:
        shard += (cols >= B3).to(tl.int32)
    if NUM_SHARDS > 4:
        shard += (cols >= B4).to(tl.int32)
    if NUM_SHARDS > 5:
        shard += (cols >= B5).to(tl.int32)
    if NUM_SHARDS > 6:
        shard += (cols >= B6).to(tl.int32)
    if NUM_SHARDS > 7:
        shard += (cols >= B7).to(tl.int32)
    first_k = (SHARD0 + shard) * RANK  # column n reads s[t, first_k[n] : first_k[n] + R]
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    b_base = b_ptr + slot.to(tl.int64) * stride_bs + (COL0 + cols[None, :]).to(tl.int64) * stride_bn
    for k_start in range(SHARD0 * RANK, K, BLOCK_K):  # this launch's columns of s
        kk = k_start + ks
        sv = tl.load(s_ptr + token[:, None] * stride_sm + kk[None, :] * stride_sk,
                     mask=row_valid[:, None] & (kk < K)[None, :], other=0.0)
        r = kk[:, None] - first_k[None, :]  # [BLOCK_K, BLOCK_N]: the rank index, if in shard
        in_shard = (r >= 0) & (r < RANK) & col_valid[None, :]
        bv = tl.load(b_base + r * stride_br, mask=in_shard, other=0.0)
        acc += tl.dot(sv.to(tl.float32), bv.to(tl.float32), input_precision="ieee")
    y_ptrs = y_ptr + token[:, None] * stride_ym + (COL0 + cols[None, :]).to(tl.int64) * stride_yn
    y_mask = row_valid[:, None] & col_valid[None, :]
    yv = tl.load(y_ptrs, mask=y_mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (yv + acc).to(y_ptr.dtype.element_ty), mask=y_mask)


def _dot_types(dtype: torch.dtype) -> tuple[Any, str]:
    if _INTERPRETED or dtype == torch.float32:
        return tl.float32, "ieee"
    return (tl.float16 if dtype == torch.float16 else tl.bfloat16), "tf32"


def _block_m(num_tokens: int) -> int:
    """Tokens per tile: 16 (a dot's minimum) for decode-sized steps, up to 64 for prefill."""
    return 16 if num_tokens <= 128 else (32 if num_tokens <= 1024 else 64)


def _check(name: str, act: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor,
           num_tokens: int) -> None:
    if triton is None:
        raise ImportError(TRITON_MISSING_MESSAGE)
    if act.dtype not in SUPPORTED_DTYPES or weights.dtype != act.dtype:
        raise ValueError(f"{name}: activations and adapters must share a float dtype, not "
                         f"{act.dtype} / {weights.dtype}")
    if act.dim() != 2 or weights.dim() != 3 or slots.shape != (num_tokens,):
        raise ValueError(f"{name}: shapes {tuple(act.shape)} / {tuple(weights.shape)} / "
                         f"slots {tuple(slots.shape)} do not fit the LoRA contract")
    check_device(_INTERPRETED, act, weights, slots)


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, token_slots: torch.Tensor,
                out: torch.Tensor, groups: SlotGroups | None = None) -> None:
    """``out[t] = lora_a[slot[t]] @ x[t]`` (see the module docstring)."""
    t, k = out.shape
    _check("shrink", x, lora_a, token_slots, t)
    num_slots, _, n_in = lora_a.shape
    if out.dtype != torch.float32 or x.shape[0] != t or lora_a.shape[1] != k:
        raise ValueError(f"shrink: x {tuple(x.shape)}, A {tuple(lora_a.shape)}, out "
                         f"{out.dtype} {tuple(out.shape)} do not fit")
    if t == 0:
        return
    groups = groups or group_by_slot(token_slots, num_slots)
    block_m = _block_m(t)
    block_n = min(max(next_power_of_2(k), 16), 64)
    block_k = 32 if x.dtype == torch.float32 else 64
    dot_dtype, precision = _dot_types(x.dtype)
    grid = (triton.cdiv(t, block_m), triton.cdiv(k, block_n), num_slots + 1)
    _shrink_kernel[grid](
        x, lora_a, out, groups.order, groups.start, groups.count,
        k, n_in, num_slots,
        *x.stride(), *lora_a.stride(), *out.stride(),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_DTYPE=dot_dtype, DOT_PRECISION=precision,
    )


def lora_expand(s: torch.Tensor, lora_b: torch.Tensor, token_slots: torch.Tensor,
                shard_bounds: tuple[int, ...], y: torch.Tensor,
                groups: SlotGroups | None = None) -> None:
    """``y[t, lo_j:hi_j] += s[t, j*R:(j+1)*R] @ lora_b[slot, :, lo_j:hi_j]`` (see above)."""
    t, n = y.shape
    _check("expand", y, lora_b, token_slots, t)
    num_slots, rank, _ = lora_b.shape
    shards = len(shard_bounds) - 1
    if (s.dtype != torch.float32 or s.shape != (t, shards * rank) or lora_b.shape[2] != n
            or shards < 1 or shard_bounds[0] != 0 or shard_bounds[-1] != n
            or any(b > c for b, c in pairwise(shard_bounds))):
        raise ValueError(f"expand: s {s.dtype} {tuple(s.shape)}, B {tuple(lora_b.shape)}, y "
                         f"{tuple(y.shape)}, bounds {shard_bounds} do not fit")
    if t == 0:
        return
    groups = groups or group_by_slot(token_slots, num_slots)
    block_m = _block_m(t)
    block_n = 64 if n >= 64 else max(next_power_of_2(n), 16)
    for j0 in range(0, shards, MAX_SHARDS):  # one launch for up to MAX_SHARDS shards
        j1 = min(j0 + MAX_SHARDS, shards)
        col0, width = shard_bounds[j0], shard_bounds[j1] - shard_bounds[j0]
        if width == 0:
            continue
        rel = [b - col0 for b in shard_bounds[j0 + 1:j1]] + [width] * (MAX_SHARDS - (j1 - j0))
        k_span = (j1 - j0) * rank
        block_k = min(max(next_power_of_2(k_span), 16), 32)
        grid = (triton.cdiv(t, block_m), triton.cdiv(width, block_n), num_slots + 1)
        _expand_kernel[grid](
            s, lora_b, y, groups.order, groups.start, groups.count,
            width, rank, j1 * rank, num_slots, col0, j0,
            *rel[:MAX_SHARDS - 1],
            *s.stride(), lora_b.stride(0), lora_b.stride(2), lora_b.stride(1), *y.stride(),
            NUM_SHARDS=j1 - j0, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        )


def triton_lora_kernels() -> list[type[LoRAKernel]]:
    """``[TritonLoRAKernel]`` when triton imports, else [] (what the GPU platforms offer)."""
    return [TritonLoRAKernel] if triton is not None else []


class TritonLoRAKernel(LoRAKernel):
    """:func:`lora_shrink` / :func:`lora_expand` behind the platform interface (cuda,
    rocm, xpu; CPU tensors only under ``TRITON_INTERPRET=1``)."""

    name: ClassVar[str] = "triton_lora"

    @classmethod
    def can_implement(cls, dtype: torch.dtype, device: torch.device) -> str | None:
        if triton is None:
            return TRITON_MISSING_MESSAGE
        device_type = torch.device(device).type
        if device_type == "cpu":
            if not _INTERPRETED:
                return ("Triton kernels need a GPU; CPU tensors run only under "
                        "TRITON_INTERPRET=1 (set before engine.kernels.lora_triton is imported)")
        elif device_type not in GPU_DEVICE_TYPES:
            return f"Triton kernels run on {', '.join(GPU_DEVICE_TYPES)} devices, not {device_type}"
        if dtype not in SUPPORTED_DTYPES:
            return f"dtype {dtype} is not supported (float16, bfloat16, float32)"
        return None

    def shrink(self, x: torch.Tensor, lora_a: torch.Tensor, token_slots: torch.Tensor,
               out: torch.Tensor) -> None:
        lora_shrink(x, lora_a, token_slots, out)

    def expand(self, s: torch.Tensor, lora_b: torch.Tensor, token_slots: torch.Tensor,
               shard_bounds: tuple[int, ...], y: torch.Tensor) -> None:
        lora_expand(s, lora_b, token_slots, shard_bounds, y)
