"""Independent float64 references and input builders for the paged-attention tests."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class PagedBatch:
    """A varlen batch over a paged cache whose context K/V are already stored."""

    q: torch.Tensor  # [T, H, D]
    kv_cache: torch.Tensor  # [2, NB, BS, Hkv, D]; unused slots are NaN
    query_start_loc: torch.Tensor  # int32 [R + 1]
    seq_lens: torch.Tensor  # int32 [R]
    block_tables: torch.Tensor  # int32 [R, M]
    slot_mapping: torch.Tensor  # int64 [T], slots of the new tokens
    keys: list[torch.Tensor]  # per request [seq_len, Hkv, D], all positions
    values: list[torch.Tensor]

    @property
    def max_query_len(self) -> int:
        return int((self.query_start_loc[1:] - self.query_start_loc[:-1]).max())

    @property
    def max_seq_len(self) -> int:
        return int(self.seq_lens.max())


def make_batch(
    requests: list[tuple[int, int]],  # (query_len, seq_len) per request
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    generator: torch.Generator,
    store_new_tokens: bool = True,
) -> PagedBatch:
    """Random q/K/V, blocks scattered randomly over a NaN-filled cache.

    With ``store_new_tokens=False`` only the context before this step's tokens is in the
    cache (the new tokens' slots stay NaN), as a backend's forward sees it.
    """
    blocks_per_req = [math.ceil(seq / block_size) for _, seq in requests]
    num_blocks = sum(blocks_per_req) + 3  # a few never used: they stay NaN
    perm = torch.randperm(num_blocks, generator=generator)
    width = max(blocks_per_req)
    block_tables = torch.zeros(len(requests), width, dtype=torch.int32)
    cache = torch.full(
        (2, num_blocks, block_size, num_kv_heads, head_size), float("nan"), dtype=dtype
    )
    keys, values, slots, q_rows = [], [], [], []
    used = 0
    for r, ((q_len, seq), n) in enumerate(zip(requests, blocks_per_req)):
        table = perm[used : used + n]
        used += n
        block_tables[r, :n] = table.to(torch.int32)
        k = torch.randn(seq, num_kv_heads, head_size, generator=generator).to(dtype)
        v = torch.randn(seq, num_kv_heads, head_size, generator=generator).to(dtype)
        pos = torch.arange(seq)
        slot = table[pos // block_size] * block_size + pos % block_size
        stored = seq if store_new_tokens else seq - q_len
        flat = cache.view(2, -1, num_kv_heads, head_size)
        flat[0, slot[:stored]] = k[:stored]
        flat[1, slot[:stored]] = v[:stored]
        keys.append(k)
        values.append(v)
        slots.append(slot[seq - q_len :])
        q_rows.append(torch.randn(q_len, num_heads, head_size, generator=generator).to(dtype))
    q_lens = torch.tensor([q for q, _ in requests])
    query_start_loc = torch.zeros(len(requests) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(q_lens, 0)
    return PagedBatch(
        q=torch.cat(q_rows),
        kv_cache=cache,
        query_start_loc=query_start_loc,
        seq_lens=torch.tensor([s for _, s in requests], dtype=torch.int32),
        block_tables=block_tables,
        slot_mapping=torch.cat(slots).to(torch.int64),
        keys=keys,
        values=values,
    )


def reference_attention(
    batch: PagedBatch,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """float64 causal attention from the per-request K/V (never reads the cache)."""
    outs = []
    num_heads = batch.q.shape[1]
    for r in range(len(batch.keys)):
        start, end = int(batch.query_start_loc[r]), int(batch.query_start_loc[r + 1])
        seq = int(batch.seq_lens[r])
        q = batch.q[start:end].double()
        group = num_heads // batch.keys[r].shape[1]
        k = batch.keys[r].double().repeat_interleave(group, dim=1)
        v = batch.values[r].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("lhd,shd->hls", q, k) * scale
        if soft_cap:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        q_pos = torch.arange(seq - (end - start), seq)[:, None]
        k_pos = torch.arange(seq)[None, :]
        allowed = k_pos <= q_pos
        if sliding_window:
            allowed &= q_pos - k_pos < sliding_window
        scores = scores.masked_fill(~allowed, float("-inf"))
        outs.append(torch.einsum("hls,shd->lhd", torch.softmax(scores, dim=-1), v))
    return torch.cat(outs)
