"""Non-causal (encoder) varlen flash attention in Triton, for BERT-style pooling models.

Contract (engine/core/interfaces/attention.py, ``AttentionLayerSpec.causal`` False): the
step's tokens are concatenated, request ``r`` owning rows ``cu_seqlens[r] :
cu_seqlens[r+1]`` of ``q [T, H, D]`` and ``k`` / ``v [T, Hkv, D]``; each of its tokens
attends to every token of the same request, both directions, and to nothing else. With
a window ``w`` a query at position ``i`` sees only keys at ``|i - j| <= w // 2``
(ModernBERT's local attention). There is no KV cache: K and V are this step's rows.

Algorithm. The grid is ``(query blocks, kv heads)``, numbered as in
:mod:`.unified_attention`: a query block is ``BLOCK_Q`` consecutive tokens of one
request times the ``H / Hkv`` query heads sharing a KV head (GQA), i.e. ``BLOCK_M =
BLOCK_Q * QPK_PAD`` rows of one matrix, so every K/V tile serves all of them; request
``r``'s blocks start at ``cu_seqlens[r] // BLOCK_Q + r``, which bounds the grid by ``T //
BLOCK_Q + R`` without reading device data on the host (no sync per layer), and a program
finds its request by binary search. It walks the request's keys (only those its window
can reach) in tiles of ``TILE`` rows with an online softmax in float32 (base-2
exponentials, log2(e) folded into the scores) and writes the output in the input dtype.
Head sizes that are not powers of two (BERT-large's 64 is, some embedders' 40 or 80 are
not) are padded to the next power of two (>= 16, ``tl.dot``'s minimum) and masked.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# Shared with the causal kernel: request lookup by query block, a libdevice-free tanh,
# and which dtype / precision tl.dot runs at (float32 whenever interpreted).
from engine.kernels.triton_utils import check_device, check_dtype, interpreting, next_power_of_2
from engine.kernels.unified_attention import _dot_types, _find_request, _tanh

_INTERPRETED = interpreting()  # triton.jit below decides the same way, at import time

MIN_DOT = 16  # tl.dot's smallest dimension on a GPU


@triton.jit
def _encoder_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    cu_seqlens_ptr,
    num_reqs,
    scale,
    soft_cap,
    half_window,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_ot,
    stride_oh,
    stride_od,
    head_size,
    num_queries_per_kv,
    BLOCK_Q: tl.constexpr,
    QPK_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    TILE: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)

    req = _find_request(cu_seqlens_ptr, num_reqs, q_block, BLOCK_Q)
    start = tl.load(cu_seqlens_ptr + req)
    seq_len = tl.load(cu_seqlens_ptr + req + 1) - start
    local_block = q_block - (start // BLOCK_Q + req)
    if local_block * BLOCK_Q >= seq_len:
        return

    # Rows: query token (row // QPK_PAD) x query head of this KV head's group.
    rows = tl.arange(0, BLOCK_M)
    q_pos = local_block * BLOCK_Q + rows // QPK_PAD  # position within the request
    head_in_group = rows % QPK_PAD
    head = kv_head * num_queries_per_kv + head_in_group
    row_valid = (q_pos < seq_len) & (head_in_group < num_queries_per_kv)
    dims = tl.arange(0, HEAD_PAD)
    dim_valid = dims < head_size
    token = (start + q_pos).to(tl.int64)

    q_mask = row_valid[:, None] & dim_valid[None, :]
    q_off = token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :] * stride_qd
    # Cast right after every load: the interpreter cannot do arithmetic on bf16.
    q = tl.load(q_ptr + q_off, mask=q_mask, other=0.0).to(tl.float32)
    q_dot = q.to(DOT_DTYPE)

    # Keys any row of this block may see: the whole request, or the window around it.
    key_lo = 0
    key_hi = seq_len
    if USE_WINDOW:
        last_q = tl.minimum((local_block + 1) * BLOCK_Q, seq_len) - 1
        key_lo = tl.maximum(local_block * BLOCK_Q - half_window, 0)
        key_hi = tl.minimum(last_q + half_window + 1, seq_len)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    tile_offs = tl.arange(0, TILE)
    k_head = k_ptr + kv_head * stride_kh
    v_head = v_ptr + kv_head * stride_vh

    for tile in range(key_lo // TILE, tl.cdiv(key_hi, TILE)):
        k_pos = tile * TILE + tile_offs
        k_valid = k_pos < key_hi
        k_token = (start + k_pos).to(tl.int64)
        k = tl.load(
            k_head + k_token[None, :] * stride_kt + dims[:, None] * stride_kd,
            mask=k_valid[None, :] & dim_valid[:, None],
            other=0.0,
        ).to(tl.float32)  # [HEAD_PAD, TILE]
        v = tl.load(
            v_head + k_token[:, None] * stride_vt + dims[None, :] * stride_vd,
            mask=k_valid[:, None] & dim_valid[None, :],
            other=0.0,
        ).to(tl.float32)  # [TILE, HEAD_PAD]

        s = tl.dot(q_dot, k.to(DOT_DTYPE), input_precision=DOT_PRECISION) * scale
        if USE_SOFT_CAP:
            s = soft_cap * _tanh(s / soft_cap)
        s = s * 1.4426950408889634  # log2(e): exp2 below
        allowed = k_valid[None, :]
        if USE_WINDOW:  # keys below key_lo are out of every row's window too
            distance = q_pos[:, None] - k_pos[None, :]
            allowed = allowed & (distance <= half_window) & (distance >= -half_window)
        s = tl.where(allowed, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)  # rows with no key yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        pv = tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=DOT_PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    o_off = token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :] * stride_od
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=q_mask)


@dataclass(frozen=True)
class _LaunchConfig:
    block_m: int
    tile: int
    num_warps: int
    num_stages: int


def _launch_config(max_seqlen: int, qpk_pad: int, head_pad: int,
                   dtype: torch.dtype) -> _LaunchConfig:
    """Tile shapes: every tl.dot dimension >= 16, no taller than the longest request needs.

    Embedding batches are often many short sentences, so a query block never spans more
    tokens than the longest request has and a key tile never more keys. float32 runs its
    dots at IEEE precision on CUDA cores and needs small tiles to stay in registers.
    """
    if dtype == torch.float32:
        block_m, tile = max(MIN_DOT, qpk_pad), MIN_DOT
    else:
        block_m = max(64 if head_pad <= 128 else 32, qpk_pad)
        tile = 64 if head_pad <= 64 else 32
    longest = next_power_of_2(max(max_seqlen, 1))
    block_m = max(MIN_DOT, qpk_pad, min(block_m, longest * qpk_pad))
    tile = max(MIN_DOT, min(tile, longest))
    return _LaunchConfig(block_m, tile, 4, 2)


def _validate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
              cu_seqlens: torch.Tensor) -> None:
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q, k, v must be [T, heads, head_size], got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    num_tokens, num_heads, head_size = q.shape
    if k.shape != v.shape or k.shape[0] != num_tokens or k.shape[2] != head_size:
        raise ValueError(f"k and v must both be [{num_tokens}, num_kv_heads, {head_size}], "
                         f"got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[1] < 1 or num_heads % k.shape[1] != 0:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads "
                         f"({k.shape[1]})")
    if out.shape != q.shape or out.dtype != q.dtype:
        raise ValueError(f"out ({tuple(out.shape)}, {out.dtype}) must match q "
                         f"({tuple(q.shape)}, {q.dtype})")
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        check_dtype(name, tensor)
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 1:
        raise ValueError(f"cu_seqlens must be [R + 1], got {tuple(cu_seqlens.shape)}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens must be int32 or int64, got {cu_seqlens.dtype}")
    check_device(_INTERPRETED, q, k, v, out, cu_seqlens)


def encoder_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    tile_size: int | None = None,
) -> torch.Tensor:
    """Bidirectional attention of each request's tokens over each other -> ``[T, H, D]``.

    ``q [T, H, D]``, ``k`` / ``v [T, Hkv, D]`` (any strides); request ``r`` owns rows
    ``cu_seqlens[r] : cu_seqlens[r + 1]`` (int32/int64 ``[R + 1]`` on the tensors' device,
    ending at ``T``; not checked, which would sync). ``max_seqlen``: the longest request
    (a host int; it only sizes the tiles). ``sliding_window`` ``w``: keys within ``w // 2``
    positions either side (None or 0: all). ``out``: written in place when given, else
    allocated in ``q``'s dtype. ``block_m`` / ``tile_size`` override the query-rows x
    key-rows tile (powers of two, >= 16 on a GPU).
    """
    out = torch.empty_like(q) if out is None else out
    _validate(q, k, v, out, cu_seqlens)
    if sliding_window is not None and sliding_window < 0:
        raise ValueError(f"sliding_window must be positive (or None/0 for off), "
                         f"got {sliding_window}")
    if logits_soft_cap is not None and logits_soft_cap < 0:
        raise ValueError(f"logits_soft_cap must be positive, got {logits_soft_cap}")
    num_tokens, num_heads, head_size = q.shape
    num_reqs = cu_seqlens.shape[0] - 1
    if num_tokens == 0 or num_reqs == 0:
        return out
    num_kv_heads = k.shape[1]
    qpk = num_heads // num_kv_heads
    qpk_pad = next_power_of_2(qpk)
    head_pad = max(MIN_DOT, next_power_of_2(head_size))
    config = _launch_config(max_seqlen, qpk_pad, head_pad, q.dtype)
    rows = block_m if block_m is not None else config.block_m
    tile = tile_size if tile_size is not None else config.tile
    if rows < qpk_pad or rows & (rows - 1) or tile < 1 or tile & (tile - 1):
        raise ValueError(f"block_m ({rows}) must be a power of two >= {qpk_pad} and "
                         f"tile_size ({tile}) a power of two")
    dot_dtype, dot_precision = _dot_types(q.dtype)
    block_q = rows // qpk_pad
    grid = (num_tokens // block_q + num_reqs, num_kv_heads)
    _encoder_attention_kernel[grid](
        q,
        k,
        v,
        out,
        cu_seqlens,
        num_reqs,
        float(scale),
        float(logits_soft_cap or 0.0),
        int(sliding_window or 0) // 2,
        *q.stride(),
        *k.stride(),
        *v.stride(),
        *out.stride(),
        head_size,
        qpk,
        BLOCK_Q=block_q,
        QPK_PAD=qpk_pad,
        BLOCK_M=rows,
        HEAD_PAD=head_pad,
        TILE=tile,
        USE_SOFT_CAP=bool(logits_soft_cap),
        USE_WINDOW=bool(sliding_window),
        DOT_DTYPE=dot_dtype,
        DOT_PRECISION=dot_precision,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out
