"""Unified paged attention: one Triton kernel for prefill chunks and decodes together.

Contract (engine/core/interfaces/attention.py): request ``r`` owns query rows
``query_start_loc[r] : query_start_loc[r+1]``; its row ``i`` sits at position
``seq_lens[r] - query_len + i`` and attends causally to cached keys ``0 ..= position``
(only the last ``sliding_window`` of them when a window is set; with chunked local
attention, ``attention_chunk_size = C``, only those from ``C * (position // C)`` on).
Learned attention sinks (``sinks``, float32 ``[num_heads]``) add ``exp(sinks[h])`` to
each row's softmax denominator: once, when a row is normalised (the single-pass kernel's
epilogue, or the split-KV merge). Keys are read from the
paged cache ``[2, num_blocks, block_size, num_kv_heads, head_size]`` through
``block_tables``.

Algorithm. The launch grid is ``(query blocks, kv heads, kv splits)``. A query block is
``BLOCK_Q`` consecutive query tokens of one request times the ``num_heads /
num_kv_heads`` query heads that share a KV head (GQA), i.e. ``BLOCK_M = BLOCK_Q *
QPK_PAD`` rows of one matrix, so every K/V tile loaded from the cache serves all of
them. Request ``r``'s query blocks are numbered from ``query_start_loc[r] // BLOCK_Q +
r``, which bounds the grid by ``T // BLOCK_Q + R`` without reading device data on the
host; a program finds its request by binary search and exits if it has no rows. It then
walks the keys in tiles of ``TILE`` positions (any block size: each position looks up
its own block), with online softmax in fp32 (base-2 exponentials, log2(e) folded into
the scores). Key positions before the program's first needed key (its first query's
window or chunk start) are masked before their block-table entries are loaded, so the
blocks there (which the KV cache manager may already have freed) are never touched.

fp8 caches (``float8_e4m3fn`` / ``float8_e5m2``): the tiles are loaded as uint8 codes and
widened exactly (:mod:`engine.kernels.fp8_kv`); ``k_scale`` multiplies the softmax scale
and ``v_scale`` the output, which is attention over the dequantized cache.

Split-KV (flash-decoding): with ``num_kv_splits > 1`` each program handles only an equal
share of its key tiles and writes partial (max, sum, unnormalised output) rows; a second
kernel merges the shares. It pays off when ``requests x kv heads`` programs cannot fill
the device, i.e. few long decodes; :func:`choose_num_kv_splits` decides.

Batch-invariant mode (``batch_invariant=True``): a query row's keys are reduced in one
order whatever its step. Tiles start at key position 0 (or at the window / chunk start,
rounded down to a tile) and hold ``TILE`` consecutive positions, so their boundaries
depend on key positions only; tiles past a row's own position are fully masked for it
and leave its running max, sum and output bit-for-bit unchanged (``exp2(-inf) = 0``,
``alpha = 1``). What still depends on the step is excluded: split-KV (shares sized to
the batch) is refused, and the tile shape (:func:`batch_invariant_launch_config`) is one
for prefill chunks, decodes and speculative verification rows alike, so every ``tl.dot``
and row sum a row takes part in has the same shape.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.kernels import stats
from engine.kernels.fp8_kv import cache_format, fp8_to_float
from engine.kernels.split_kv import SplitKVWorkspace, choose_num_kv_splits, split_kv_reduce
from engine.kernels.triton_utils import (
    check_cache_dtype,
    check_device,
    check_dtype,
    compute_units,
    interpreting,
    next_power_of_2,
)

_INTERPRETED = interpreting()  # triton.jit below decides the same way, at import time


@triton.jit
def _tanh(x):
    """Portable tanh (no vendor libdevice): 1 - 2 / (exp(2x) + 1), exact at +-inf."""
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _find_request(query_start_loc_ptr, num_reqs, q_block, BLOCK_Q: tl.constexpr):
    """The request whose query blocks include ``q_block`` (binary search)."""
    lo = 0
    hi = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _unified_attention_kernel(
    q_ptr,
    key_cache_ptr,
    value_cache_ptr,
    out_ptr,
    part_max_ptr,  # float32 [T, num_heads, NUM_SPLITS] (only used when NUM_SPLITS > 1)
    part_sum_ptr,  # float32 [T, num_heads, NUM_SPLITS]
    part_acc_ptr,  # float32 [T, num_heads, NUM_SPLITS, HEAD_PAD]
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    num_reqs,
    num_heads,
    scale,  # times an fp8 cache's k_scale
    v_scale,  # an fp8 cache's (unused otherwise)
    soft_cap,
    sliding_window,
    chunk_size,  # chunked local attention's C (unused unless USE_CHUNK)
    sinks_ptr,  # float32 [num_heads] sink logits (unused unless USE_SINKS)
    key_ends_ptr,  # int32 [T] each query's exclusive key end (unused unless USE_KEY_ENDS)
    stride_qt,
    stride_qh,
    stride_qd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_cd,
    stride_bt,
    block_size,
    head_size,
    num_queries_per_kv,
    BLOCK_Q: tl.constexpr,
    QPK_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    TILE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_CHUNK: tl.constexpr,
    USE_SINKS: tl.constexpr,
    USE_KEY_ENDS: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,  # 0: the cache's own dtype; else fp8_kv's format of uint8 codes
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    req = _find_request(query_start_loc_ptr, num_reqs, q_block, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    local_block = q_block - (q_start // BLOCK_Q + req)
    if local_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - q_len

    # Rows: query token (row // QPK_PAD) x query head of this KV head's group.
    rows = tl.arange(0, BLOCK_M)
    q_tok = local_block * BLOCK_Q + rows // QPK_PAD
    head_in_group = rows % QPK_PAD
    head = kv_head * num_queries_per_kv + head_in_group
    row_valid = (q_tok < q_len) & (head_in_group < num_queries_per_kv)
    dims = tl.arange(0, HEAD_PAD)
    dim_valid = dims < head_size
    token = (q_start + q_tok).to(tl.int64)
    q_pos = context_len + q_tok

    q_mask = row_valid[:, None] & dim_valid[None, :]
    q_off = token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :] * stride_qd
    # Cast right after every load: the interpreter cannot do arithmetic on bf16.
    q = tl.load(q_ptr + q_off, mask=q_mask, other=0.0).to(tl.float32)
    q_dot = q.to(DOT_DTYPE)

    # Keys this program may need: up to its last query's position (or the furthest key
    # end a query has, for image tokens that see their whole image), from the first
    # query's window or chunk start.
    key_end = context_len + tl.minimum((local_block + 1) * BLOCK_Q, q_len)
    if USE_KEY_ENDS:
        q_key_end = tl.load(key_ends_ptr + token, mask=row_valid, other=0)
        key_end = tl.maximum(key_end, tl.max(q_key_end, axis=0))
    first_q_pos = context_len + local_block * BLOCK_Q
    key_start = 0
    if USE_WINDOW:
        key_start = tl.maximum(first_q_pos - sliding_window + 1, 0)
    if USE_CHUNK:
        key_start = tl.maximum(key_start, (first_q_pos // chunk_size) * chunk_size)
    tile_lo = key_start // TILE
    tile_hi = tl.cdiv(key_end, TILE)
    if NUM_SPLITS > 1:
        per_split = tl.cdiv(tile_hi - tile_lo, NUM_SPLITS)
        tile_lo = tile_lo + split * per_split
        tile_hi = tl.minimum(tile_lo + per_split, tile_hi)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    block_row = block_tables_ptr + req.to(tl.int64) * stride_bt
    tile_offs = tl.arange(0, TILE)

    for tile in range(tile_lo, tile_hi):
        k_pos = tile * TILE + tile_offs
        k_valid = (k_pos < key_end) & (k_pos >= key_start)
        block = tl.load(block_row + k_pos // block_size, mask=k_valid, other=0).to(tl.int64)
        slot = block * stride_cb + (k_pos % block_size).to(tl.int64) * stride_cs
        slot = slot + kv_head * stride_ch
        kv_mask = k_valid[None, :] & dim_valid[:, None]
        k = tl.load(
            key_cache_ptr + slot[None, :] + dims[:, None] * stride_cd, mask=kv_mask, other=0
        )  # [HEAD_PAD, TILE]
        v = tl.load(
            value_cache_ptr + slot[:, None] + dims[None, :] * stride_cd,
            mask=k_valid[:, None] & dim_valid[None, :],
            other=0,
        )  # [TILE, HEAD_PAD]
        if KV_FP8 > 0:  # codes: their values (the scales are applied to scores / output)
            k = fp8_to_float(k, KV_FP8)
            v = fp8_to_float(v, KV_FP8)
        else:
            k = k.to(tl.float32)
            v = v.to(tl.float32)

        s = tl.dot(q_dot, k.to(DOT_DTYPE), input_precision=DOT_PRECISION) * scale
        if USE_SOFT_CAP:
            s = soft_cap * _tanh(s / soft_cap)
        s = s * 1.4426950408889634  # log2(e): exp2 below
        if USE_KEY_ENDS:
            allowed = k_valid[None, :] & (k_pos[None, :] < q_key_end[:, None])
        else:
            allowed = k_valid[None, :] & (k_pos[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            allowed = allowed & (q_pos[:, None] - k_pos[None, :] < sliding_window)
        if USE_CHUNK:
            allowed = allowed & (k_pos[None, :] >= ((q_pos // chunk_size) * chunk_size)[:, None])
        s = tl.where(allowed, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)  # rows with no key yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        pv = tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=DOT_PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    if KV_FP8 > 0:
        acc = acc * v_scale
    if NUM_SPLITS == 1:
        if USE_SINKS:  # one more term of the denominator, exp(sink), with no value
            sink = tl.load(sinks_ptr + head, mask=row_valid, other=float("-inf"))
            sink = sink * 1.4426950408889634
            m_fin = tl.maximum(m_i, sink)
            m_fin = tl.where(m_fin > float("-inf"), m_fin, 0.0)
            alpha = tl.exp2(m_i - m_fin)
            l_i = l_i * alpha + tl.exp2(sink - m_fin)
            acc = acc * alpha[:, None]
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        o_off = token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :] * stride_od
        tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        part = (token * num_heads + head) * NUM_SPLITS + split
        tl.store(part_max_ptr + part, m_i, mask=row_valid)
        tl.store(part_sum_ptr + part, l_i, mask=row_valid)
        acc_off = part[:, None] * HEAD_PAD + dims[None, :]
        tl.store(part_acc_ptr + acc_off, acc, mask=row_valid[:, None])


@dataclass(frozen=True)
class _LaunchConfig:
    block_m: int
    tile: int
    num_warps: int
    num_stages: int


def _launch_config(
    max_query_len: int, qpk_pad: int, head_pad: int, dtype: torch.dtype
) -> _LaunchConfig:
    """Tile shapes: tl.dot needs every dimension >= 16; prefill wants taller query tiles.

    fp32 runs its dots at IEEE precision on CUDA cores, which needs small tiles to stay
    in registers.
    """
    if dtype == torch.float32:
        return _LaunchConfig(max(16, qpk_pad), 16, 4, 2)
    if max_query_len == 1:
        return _LaunchConfig(max(16, qpk_pad), 64 if head_pad <= 128 else 32, 4, 2)
    block_m = 64 if head_pad <= 128 else 32
    return _LaunchConfig(max(block_m, qpk_pad), 32, 4, 2)


def batch_invariant_launch_config(
    qpk_pad: int, head_pad: int, dtype: torch.dtype
) -> _LaunchConfig:
    """The one tile shape of batch-invariant mode, whatever the step's query lengths: the
    prefill shape (a decode then fills fewer of its rows, which costs idle MMA lanes in a
    memory-bound loop, not bandwidth)."""
    return _launch_config(2, qpk_pad, head_pad, dtype)


def _dot_types(dtype: torch.dtype) -> tuple[tl.dtype, str]:
    """The dtype fed to tl.dot (fp32 accumulation always) and its fp32 precision mode."""
    if _INTERPRETED or dtype == torch.float32:
        return tl.float32, "ieee"
    return (tl.float16 if dtype == torch.float16 else tl.bfloat16), "tf32"


def _validate(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    out: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
) -> None:
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(
            "kv_cache must have shape [2, num_blocks, block_size, num_kv_heads, head_size], "
            f"got {tuple(kv_cache.shape)}"
        )
    num_kv_heads, head_size = kv_cache.shape[3], kv_cache.shape[4]
    if q.dim() != 3 or q.shape[2] != head_size:
        raise ValueError(f"q must be [T, num_heads, {head_size}], got {tuple(q.shape)}")
    if q.shape[1] % num_kv_heads != 0:
        raise ValueError(
            f"num_heads ({q.shape[1]}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    if head_size < 16:
        raise ValueError(f"head_size must be >= 16, got {head_size}")
    if out.shape != q.shape:
        raise ValueError(f"out {tuple(out.shape)} must match q {tuple(q.shape)}")
    if out.dtype != q.dtype:
        raise ValueError(f"out dtype {out.dtype} differs from q dtype {q.dtype}")
    # The cache may be narrower than q (float32 activations over a bf16 cache, or fp8
    # codes): every value is widened to float32 as it is loaded.
    for name, tensor in (("q", q), ("out", out)):
        check_dtype(name, tensor)
    num_reqs = seq_lens.shape[0]
    if query_start_loc.shape != (num_reqs + 1,):
        raise ValueError(
            f"query_start_loc must have {num_reqs + 1} entries for {num_reqs} requests, "
            f"got {tuple(query_start_loc.shape)}"
        )
    if block_tables.dim() != 2 or block_tables.shape[0] < num_reqs:
        raise ValueError(
            f"block_tables must be [>= {num_reqs}, M], got {tuple(block_tables.shape)}"
        )
    for name, tensor in (
        ("query_start_loc", query_start_loc),
        ("seq_lens", seq_lens),
        ("block_tables", block_tables),
    ):
        if tensor.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {tensor.dtype}")
    check_device(_INTERPRETED, q, kv_cache, out, query_start_loc, seq_lens, block_tables)


def unified_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    out: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    num_kv_splits: int | None = None,
    workspace: SplitKVWorkspace | None = None,
    block_m: int | None = None,
    tile_size: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    attention_chunk_size: int | None = None,
    sinks: torch.Tensor | None = None,
    batch_invariant: bool = False,
    key_ends: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal paged attention of ``q`` [T, num_heads, head_size] into ``out`` (returned).

    ``num_kv_splits``: None picks automatically (:func:`choose_num_kv_splits`), 1 forces
    the single-pass kernel, n > 1 forces split-KV with n splits. ``block_m`` / ``tile_size``
    override the query-rows x key-positions tile (powers of two, >= 16 on a GPU).
    ``k_scale`` / ``v_scale``: an fp8 cache's (K = k_scale * code), ignored otherwise.
    ``attention_chunk_size``: chunked local attention (a query at position p sees keys
    ``C * (p // C) ..= p``); ``sinks``: float32 ``[num_heads]`` sink logits.
    ``batch_invariant``: one tile shape for every step and no split-KV (None splits mean
    1; more is an error), so a row's result does not depend on its batch or step.
    ``key_ends``: int32 ``[T]``, each query's exclusive key end where it reaches past the
    query's position (``AttentionBatch.key_ends_cpu``: an image's tokens see the whole
    image, Gemma 3); the window still counts back from the query's position.
    """
    _validate(q, kv_cache, out, query_start_loc, seq_lens, block_tables)
    check_cache_dtype(kv_cache, k_scale, v_scale)
    if sliding_window is not None and sliding_window < 0:
        raise ValueError(
            f"sliding_window must be positive (or None/0 for off), got {sliding_window}"
        )
    if logits_soft_cap is not None and logits_soft_cap < 0:
        raise ValueError(f"logits_soft_cap must be positive, got {logits_soft_cap}")
    if attention_chunk_size is not None and attention_chunk_size <= 0:
        raise ValueError(f"attention_chunk_size must be positive, got {attention_chunk_size}")
    num_tokens, num_heads, head_size = q.shape
    if sinks is not None:
        if sinks.shape != (num_heads,) or sinks.dtype != torch.float32:
            raise ValueError(f"sinks must be float32 [{num_heads}], got {sinks.dtype} "
                             f"{tuple(sinks.shape)}")
        check_device(_INTERPRETED, q, sinks)
        sinks = sinks.contiguous()
    if key_ends is not None:
        if key_ends.shape != (num_tokens,):
            raise ValueError(f"key_ends must have one entry per query token ({num_tokens}), "
                             f"got shape {tuple(key_ends.shape)}")
        check_device(_INTERPRETED, q, key_ends)
        key_ends = key_ends.to(torch.int32).contiguous()
    num_reqs = seq_lens.shape[0]
    if num_tokens == 0 or num_reqs == 0:
        return out
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    qpk = num_heads // num_kv_heads
    qpk_pad = next_power_of_2(qpk)
    head_pad = next_power_of_2(head_size)
    if batch_invariant:
        if num_kv_splits is not None and num_kv_splits > 1:
            raise ValueError("batch-invariant attention cannot split the keys (split-KV "
                             f"shares follow the batch), got num_kv_splits={num_kv_splits}")
        num_kv_splits = 1
        config = batch_invariant_launch_config(qpk_pad, head_pad, q.dtype)
    else:
        config = _launch_config(max_query_len, qpk_pad, head_pad, q.dtype)
    rows = block_m if block_m is not None else config.block_m
    tile = tile_size if tile_size is not None else config.tile
    if rows < qpk_pad or rows & (rows - 1) or tile & (tile - 1):
        raise ValueError(
            f"block_m ({rows}) must be a power of two >= {qpk_pad} and tile_size ({tile}) "
            "a power of two"
        )
    if num_kv_splits is None:
        num_kv_splits = choose_num_kv_splits(
            num_reqs, num_kv_heads, max_query_len, max_seq_len, compute_units(q.device)
        )
    if num_kv_splits < 1:
        raise ValueError(f"num_kv_splits must be >= 1, got {num_kv_splits}")
    block_q = rows // qpk_pad
    dot_dtype, dot_precision = _dot_types(q.dtype)
    fp8, cache = cache_format(kv_cache)
    key_cache, value_cache = cache[0], cache[1]
    if num_kv_splits > 1:
        workspace = workspace if workspace is not None else SplitKVWorkspace()
        part_max, part_sum, part_acc = workspace.get(
            num_tokens, num_heads, num_kv_splits, head_pad, q.device
        )
    else:
        part_max = part_sum = part_acc = out  # never touched by the single-pass kernel

    grid = (num_tokens // block_q + num_reqs, num_kv_heads, num_kv_splits)
    _unified_attention_kernel[grid](
        q,
        key_cache,
        value_cache,
        out,
        part_max,
        part_sum,
        part_acc,
        query_start_loc,
        seq_lens,
        block_tables,
        num_reqs,
        num_heads,
        float(scale) * (float(k_scale) if fp8 else 1.0),
        float(v_scale),
        float(logits_soft_cap or 0.0),
        int(sliding_window or 0),
        int(attention_chunk_size or 0),
        sinks if sinks is not None else out,
        key_ends if key_ends is not None else seq_lens,
        *q.stride(),
        *out.stride(),
        *key_cache.stride(),
        block_tables.stride(0),
        block_size,
        head_size,
        qpk,
        BLOCK_Q=block_q,
        QPK_PAD=qpk_pad,
        BLOCK_M=rows,
        HEAD_PAD=head_pad,
        TILE=tile,
        NUM_SPLITS=num_kv_splits,
        USE_SOFT_CAP=bool(logits_soft_cap),
        USE_WINDOW=bool(sliding_window),
        USE_CHUNK=attention_chunk_size is not None,
        USE_SINKS=sinks is not None,
        USE_KEY_ENDS=key_ends is not None,
        DOT_DTYPE=dot_dtype,
        DOT_PRECISION=dot_precision,
        KV_FP8=fp8,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if num_kv_splits == 1:
        stats.launches.unified_attention += 1
        return out
    stats.launches.split_kv_attention += 1
    split_kv_reduce(out, (part_max, part_sum, part_acc), num_kv_splits, sinks)
    return out
