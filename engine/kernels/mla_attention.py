"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over a paged latent cache, in Triton.

Contract (engine/core/interfaces/attention.py): an MLA layer's cache holds one latent
entry per token, ``D = kv_lora_rank + rope_dim`` wide (the compressed KV ``[:L]``, then
the rotated key part ``[L:]``), shared by every head. The queries come with the key
up-projection absorbed, ``[T, num_heads, D]``: attention is multi-query over the
entries, scores over all ``D`` dims, values the entries' first ``L`` dims, output
``[T, num_heads, L]``. Token layout and causality as for MHA: request ``r`` owns query
rows ``query_start_loc[r] : query_start_loc[r+1]``, its row ``i`` sits at position
``seq_lens[r] - query_len + i`` and attends to positions ``0 ..= that``.

Cache layout (one tensor per layer): ``[num_blocks, block_size, D]``; slot ``s`` is
``(block = s // block_size, offset = s % block_size)``.

:func:`mla_write_cache` stores the step's new entries (one program per token, slot -1
skipped). :func:`mla_attention` is one kernel for prefill chunks and decodes together.
Its grid is ``(query blocks, head groups)``: a program takes ``BLOCK_Q`` consecutive
query tokens of one request times ``HEAD_BLOCK`` heads, i.e. ``BLOCK_M = BLOCK_Q *
HEAD_BLOCK`` rows of one matrix, so each latent tile loaded from the cache serves all of
them (a decode's program is its ``HEAD_BLOCK`` heads). Query blocks are numbered as in
:mod:`.unified_attention` (request ``r``'s from ``query_start_loc[r] // BLOCK_Q + r``;
found by binary search). The program walks its keys in tiles of ``TILE`` positions
through the block table (any block size: each position looks up its own block), loads
each tile's ``[TILE, L]`` latent part once -- it is both the key's first ``L`` dims and
the value -- plus its ``[TILE, R]`` rope part, and keeps an online softmax in fp32
(base-2 exponentials, log2(e) folded into the scale). Every dimension is padded to a
power of two >= 16 (``tl.dot``'s minimum) and masked, so any ``L`` / ``R`` works
(e.g. 512 + 64, or 16 + 8 in tests); masked loads read nothing outside a request's
context, so stale or poisoned slots never reach the output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.kernels.triton_utils import (
    check_device,
    check_dtype,
    interpreting,
    next_power_of_2,
)

_INTERPRETED = interpreting()  # triton.jit below decides the same way, at import time

MIN_DOT = 16  # tl.dot's smallest dimension on a GPU


@triton.jit
def _mla_write_cache_kernel(
    entry_ptr,
    cache_ptr,
    slot_mapping_ptr,
    stride_et,
    stride_ed,
    stride_cb,
    stride_cs,
    stride_cd,
    entry_size,
    block_size,
    ENTRY_PAD: tl.constexpr,
):
    """One program per token: copy its latent entry to its slot."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:
        block = slot // block_size
        offset = slot % block_size
        dims = tl.arange(0, ENTRY_PAD)
        mask = dims < entry_size
        # Cast right after the load: the interpreter cannot do arithmetic on bf16.
        x = tl.load(entry_ptr + token * stride_et + dims * stride_ed, mask=mask, other=0.0)
        x = x.to(tl.float32)
        dst = cache_ptr + block * stride_cb + offset * stride_cs + dims * stride_cd
        tl.store(dst, x.to(cache_ptr.dtype.element_ty), mask=mask)


def mla_write_cache(
    entries: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store ``entries`` [T, 1, D] (or [T, D]) into ``kv_cache`` [num_blocks, block_size, D]
    at ``slot_mapping`` (int32/int64 [>= T]; negative entries are skipped), in place."""
    if kv_cache.dim() != 3:
        raise ValueError(
            f"an MLA cache is [num_blocks, block_size, entry_size], got {tuple(kv_cache.shape)}"
        )
    _, block_size, entry_size = kv_cache.shape
    if entries.dim() == 3:
        if entries.shape[1] != 1:
            raise ValueError(f"MLA entries are [T, 1, D], got {tuple(entries.shape)}")
        entries = entries[:, 0]
    num_tokens = entries.shape[0]
    if entries.dim() != 2 or entries.shape[1] != entry_size:
        raise ValueError(
            f"entries {tuple(entries.shape)} do not match the cache's entry size {entry_size}"
        )
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] < num_tokens:
        raise ValueError(
            f"slot_mapping must be 1-D with at least {num_tokens} entries, "
            f"got {tuple(slot_mapping.shape)}"
        )
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    check_dtype("entries", entries)
    check_dtype("kv_cache", kv_cache)
    check_device(_INTERPRETED, entries, kv_cache, slot_mapping)
    if num_tokens == 0:
        return
    _mla_write_cache_kernel[(num_tokens,)](
        entries,
        kv_cache,
        slot_mapping,
        *entries.stride(),
        *kv_cache.stride(),
        entry_size,
        block_size,
        ENTRY_PAD=next_power_of_2(entry_size),
        num_warps=4 if entry_size >= 512 else 1,
    )


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
def _mla_attention_kernel(
    q_ptr,
    cache_ptr,
    out_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    num_reqs,
    num_heads,
    scale_log2,  # softmax scale * log2(e)
    stride_qt,
    stride_qh,
    stride_qd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_cb,
    stride_cs,
    stride_cd,
    stride_bt,
    block_size,
    lora_rank,
    rope_dim,
    BLOCK_Q: tl.constexpr,
    HEAD_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    LORA_PAD: tl.constexpr,
    ROPE_PAD: tl.constexpr,
    TILE: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    q_block = tl.program_id(0)
    head_group = tl.program_id(1)

    req = _find_request(query_start_loc_ptr, num_reqs, q_block, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    local_block = q_block - (q_start // BLOCK_Q + req)
    if local_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - q_len

    # Rows: query token (row // HEAD_BLOCK) x head of this program's group.
    rows = tl.arange(0, BLOCK_M)
    q_tok = local_block * BLOCK_Q + rows // HEAD_BLOCK
    head = head_group * HEAD_BLOCK + rows % HEAD_BLOCK
    row_valid = (q_tok < q_len) & (head < num_heads)
    token = (q_start + q_tok).to(tl.int64)
    q_pos = context_len + q_tok
    lora = tl.arange(0, LORA_PAD)
    lora_valid = lora < lora_rank
    rope = tl.arange(0, ROPE_PAD)
    rope_valid = rope < rope_dim

    # Cast right after every load: the interpreter cannot do arithmetic on bf16.
    q_row = q_ptr + token[:, None] * stride_qt + head[:, None].to(tl.int64) * stride_qh
    q_lora_mask = row_valid[:, None] & lora_valid[None, :]
    q_lora = tl.load(q_row + lora[None, :] * stride_qd, mask=q_lora_mask, other=0.0)
    q_lora = q_lora.to(tl.float32).to(DOT_DTYPE)  # [BLOCK_M, LORA_PAD]
    q_rope = tl.load(
        q_row + (lora_rank + rope[None, :]) * stride_qd,
        mask=row_valid[:, None] & rope_valid[None, :],
        other=0.0,
    ).to(tl.float32).to(DOT_DTYPE)  # [BLOCK_M, ROPE_PAD]

    # Keys this program may need: up to its last query's position.
    key_end = context_len + tl.minimum((local_block + 1) * BLOCK_Q, q_len)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, LORA_PAD], tl.float32)
    block_row = block_tables_ptr + req.to(tl.int64) * stride_bt
    tile_offs = tl.arange(0, TILE)

    for tile in range(tl.cdiv(key_end, TILE)):
        k_pos = tile * TILE + tile_offs
        k_valid = k_pos < key_end
        block = tl.load(block_row + k_pos // block_size, mask=k_valid, other=0).to(tl.int64)
        slot = cache_ptr + block * stride_cb + (k_pos % block_size).to(tl.int64) * stride_cs
        latent = tl.load(
            slot[:, None] + lora[None, :] * stride_cd,
            mask=k_valid[:, None] & lora_valid[None, :],
            other=0.0,
        ).to(tl.float32).to(DOT_DTYPE)  # [TILE, LORA_PAD]: key part and value
        k_rope = tl.load(
            slot[:, None] + (lora_rank + rope[None, :]) * stride_cd,
            mask=k_valid[:, None] & rope_valid[None, :],
            other=0.0,
        ).to(tl.float32).to(DOT_DTYPE)  # [TILE, ROPE_PAD]

        s = tl.dot(q_lora, tl.trans(latent), input_precision=DOT_PRECISION)
        s = tl.dot(q_rope, tl.trans(k_rope), acc=s, input_precision=DOT_PRECISION)
        s = s * scale_log2
        allowed = k_valid[None, :] & (k_pos[None, :] <= q_pos[:, None])
        s = tl.where(allowed, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)  # rows with no key yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(DOT_DTYPE), latent, acc=acc, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    o_off = token[:, None] * stride_ot + head[:, None].to(tl.int64) * stride_oh
    o_off = o_off + lora[None, :] * stride_od
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=q_lora_mask)


@dataclass(frozen=True)
class MLALaunchConfig:
    head_block: int  # heads per program
    block_m: int  # rows per program: query tokens x head_block
    tile: int  # key positions per iteration
    num_warps: int
    num_stages: int


def launch_config(
    num_heads: int,
    max_query_len: int,
    lora_pad: int,
    dtype: torch.dtype,
    head_block: int | None = None,
    block_m: int | None = None,
    tile: int | None = None,
) -> MLALaunchConfig:
    """Tile shapes. The fp32 accumulator is ``[block_m, lora_pad]``, so wide latents
    (512) keep ``block_m`` at 16 rows; fp32 dots run at IEEE precision on CUDA cores and
    want small key tiles. Overrides (tests, tuning) must be powers of two."""
    wide = lora_pad >= 256
    if head_block is None:
        head_block = min(next_power_of_2(num_heads), 16 if wide else 32)
    if block_m is None:
        if max_query_len == 1 or wide:
            block_m = MIN_DOT  # a decode's program: its head group
        else:
            block_m = 64 if lora_pad <= 64 else 32
        block_m = max(block_m, head_block)
    if tile is None:
        tile = MIN_DOT if dtype == torch.float32 else (32 if wide else 64)
    for name, value in (("head_block", head_block), ("block_m", block_m), ("tile", tile)):
        if value < 1 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two, got {value}")
    if block_m < head_block:
        raise ValueError(f"block_m ({block_m}) must be >= head_block ({head_block})")
    if not _INTERPRETED and min(block_m, tile) < MIN_DOT:
        raise ValueError(f"block_m and tile must be >= {MIN_DOT} on a GPU (tl.dot)")
    return MLALaunchConfig(head_block, block_m, tile, 8 if wide else 4, 1 if wide else 2)


def _dot_types(dtype: torch.dtype) -> tuple[tl.dtype, str]:
    """The dtype fed to tl.dot (fp32 accumulation always) and its fp32 precision mode."""
    if _INTERPRETED or dtype == torch.float32:
        return tl.float32, "ieee"
    return (tl.float16 if dtype == torch.float16 else tl.bfloat16), "tf32"


def mla_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_query_len: int,
    lora_rank: int,
    scale: float,
    out: torch.Tensor | None = None,
    head_block: int | None = None,
    block_m: int | None = None,
    tile: int | None = None,
) -> torch.Tensor:
    """Causal MLA of ``q`` [T, H, D] over the latent cache [num_blocks, block_size, D]:
    returns ``out`` [T, H, lora_rank] (allocated in q's dtype when None).

    ``head_block`` / ``block_m`` / ``tile`` override :func:`launch_config`."""
    if kv_cache.dim() != 3:
        raise ValueError(
            f"an MLA cache is [num_blocks, block_size, entry_size], got {tuple(kv_cache.shape)}"
        )
    _, block_size, entry_size = kv_cache.shape
    if q.dim() != 3 or q.shape[2] != entry_size:
        raise ValueError(f"q must be [T, num_heads, {entry_size}], got {tuple(q.shape)}")
    if not 0 < lora_rank < entry_size:
        raise ValueError(f"lora_rank must be in 1..{entry_size - 1}, got {lora_rank}")
    num_tokens, num_heads, _ = q.shape
    if out is None:
        out = q.new_empty(num_tokens, num_heads, lora_rank)
    if out.shape != (num_tokens, num_heads, lora_rank) or out.dtype != q.dtype:
        raise ValueError(
            f"out must be {q.dtype} [{num_tokens}, {num_heads}, {lora_rank}], got "
            f"{out.dtype} {tuple(out.shape)}"
        )
    for name, tensor in (("q", q), ("kv_cache", kv_cache), ("out", out)):
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
    for name, tensor in (("query_start_loc", query_start_loc), ("seq_lens", seq_lens),
                         ("block_tables", block_tables)):
        if tensor.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {tensor.dtype}")
    check_device(_INTERPRETED, q, kv_cache, out, query_start_loc, seq_lens, block_tables)
    if num_tokens == 0 or num_reqs == 0:
        return out
    lora_pad = max(MIN_DOT, next_power_of_2(lora_rank))
    rope_pad = max(MIN_DOT, next_power_of_2(entry_size - lora_rank))
    config = launch_config(num_heads, max_query_len, lora_pad, q.dtype, head_block, block_m,
                           tile)
    block_q = config.block_m // config.head_block
    dot_dtype, dot_precision = _dot_types(q.dtype)
    grid = (num_tokens // block_q + num_reqs, triton.cdiv(num_heads, config.head_block))
    _mla_attention_kernel[grid](
        q,
        kv_cache,
        out,
        query_start_loc,
        seq_lens,
        block_tables,
        num_reqs,
        num_heads,
        float(scale) * 1.4426950408889634,
        *q.stride(),
        *out.stride(),
        *kv_cache.stride(),
        block_tables.stride(0),
        block_size,
        lora_rank,
        entry_size - lora_rank,
        BLOCK_Q=block_q,
        HEAD_BLOCK=config.head_block,
        BLOCK_M=config.block_m,
        LORA_PAD=lora_pad,
        ROPE_PAD=rope_pad,
        TILE=config.tile,
        DOT_DTYPE=dot_dtype,
        DOT_PRECISION=dot_precision,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out
