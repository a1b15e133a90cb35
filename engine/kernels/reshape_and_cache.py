"""Write this step's new K/V rows into the paged KV cache.

Cache layout (one tensor per layer): ``[2, num_blocks, block_size, num_kv_heads,
head_size]``, index 0 = K, 1 = V. Token ``t`` goes to slot ``slot_mapping[t]`` =
``block_id * block_size + offset``; a negative slot means "do not store" (padding
tokens, or tokens whose KV is already cached). An fp8 cache (``float8_e4m3fn`` / ``float8_e5m2``)
stores the codes of ``key / k_scale`` and ``value / v_scale`` (:mod:`engine.kernels.fp8_kv`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import stats
from engine.kernels.fp8_kv import cache_format, float_to_fp8
from engine.kernels.triton_utils import (
    check_cache_dtype,
    check_device,
    check_dtype,
    interpreting,
    next_power_of_2,
)

_INTERPRETED = interpreting()  # triton.jit below decides the same way, at import time


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_cb,  # cache strides (same for the K and V halves)
    stride_cs,
    stride_ch,
    stride_cd,
    num_kv_heads,
    head_size,
    block_size,
    k_scale,
    v_scale,
    HEADS_PAD: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    KV_FP8: tl.constexpr,  # 0: the cache's own dtype; else fp8_kv's format of uint8 codes
):
    """One program per token: copy its [num_kv_heads, head_size] K and V rows."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:
        block = slot // block_size
        offset = slot % block_size
        heads = tl.arange(0, HEADS_PAD)
        dims = tl.arange(0, HEAD_PAD)
        mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < head_size)
        # Cast right after the load: the interpreter cannot do arithmetic on bf16.
        k = tl.load(
            key_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :] * stride_kd,
            mask=mask,
            other=0.0,
        ).to(tl.float32)
        v = tl.load(
            value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :] * stride_vd,
            mask=mask,
            other=0.0,
        ).to(tl.float32)
        dst = block * stride_cb + offset * stride_cs + heads[:, None] * stride_ch
        dst = dst + dims[None, :] * stride_cd
        if KV_FP8 > 0:  # IEEE division (not div.full): codes bit for bit as quantize_kv's
            k = tl.div_rn(k, tl.zeros_like(k) + k_scale)
            v = tl.div_rn(v, tl.zeros_like(v) + v_scale)
            tl.store(key_cache_ptr + dst, float_to_fp8(k, KV_FP8), mask=mask)
            tl.store(value_cache_ptr + dst, float_to_fp8(v, KV_FP8), mask=mask)
        else:
            tl.store(key_cache_ptr + dst, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
            tl.store(value_cache_ptr + dst, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Store ``key``/``value`` [T, num_kv_heads, head_size] into ``kv_cache`` in place.

    ``kv_cache``: [2, num_blocks, block_size, num_kv_heads, head_size];
    ``slot_mapping``: int [T] (int64 or int32), negative entries are skipped;
    ``k_scale`` / ``v_scale``: an fp8 cache's (ignored for other dtypes).
    """
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(
            "kv_cache must have shape [2, num_blocks, block_size, num_kv_heads, head_size], "
            f"got {tuple(kv_cache.shape)}"
        )
    _, _, block_size, num_kv_heads, head_size = kv_cache.shape
    num_tokens = key.shape[0]
    if key.shape != (num_tokens, num_kv_heads, head_size) or value.shape != key.shape:
        raise ValueError(
            f"key {tuple(key.shape)} / value {tuple(value.shape)} do not match the cache's "
            f"[T, {num_kv_heads}, {head_size}]"
        )
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] < num_tokens:
        raise ValueError(
            f"slot_mapping must be 1-D with at least {num_tokens} entries, "
            f"got {tuple(slot_mapping.shape)}"
        )
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    check_dtype("key", key)
    check_dtype("value", value)
    check_cache_dtype(kv_cache, k_scale, v_scale)
    check_device(_INTERPRETED, key, value, kv_cache, slot_mapping)
    if num_tokens == 0:
        return
    fp8, cache = cache_format(kv_cache)
    key_cache, value_cache = cache[0], cache[1]
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        *key.stride(),
        *value.stride(),
        *key_cache.stride(),
        num_kv_heads,
        head_size,
        block_size,
        float(k_scale),
        float(v_scale),
        HEADS_PAD=next_power_of_2(num_kv_heads),
        HEAD_PAD=next_power_of_2(head_size),
        KV_FP8=fp8,
        num_warps=4 if num_kv_heads * head_size >= 1024 else 1,
    )
    stats.launches.reshape_and_cache += 1
