"""Independent float64 references and input builders for the attention tests (paged causal
attention and encoder, i.e. non-causal, attention)."""

from __future__ import annotations

import itertools
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
    chunk_size: int | None = None,
    sinks: torch.Tensor | None = None,
    key_ends: torch.Tensor | None = None,
) -> torch.Tensor:
    """float64 causal attention from the per-request K/V (never reads the cache).

    ``chunk_size``: chunked local attention, a query at position p sees keys ``C * (p //
    C) ..= p``; ``sinks`` ([H]): one more, uncapped and value-less, column per head's
    softmax (dropped after it); ``key_ends`` ([T]): each query's keys end there instead
    of at its position (bidirectional image tokens, the window still counted from the
    query)."""
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
        allowed = k_pos <= q_pos if key_ends is None else (
            k_pos < key_ends[start:end, None])
        if sliding_window:
            allowed &= q_pos - k_pos < sliding_window
        if chunk_size:
            allowed &= k_pos >= q_pos // chunk_size * chunk_size
        scores = scores.masked_fill(~allowed, float("-inf"))
        if sinks is None:
            probs = torch.softmax(scores, dim=-1)
        else:
            sink_col = sinks.double()[:, None, None].expand(-1, end - start, 1)
            probs = torch.softmax(torch.cat((scores, sink_col), dim=-1), dim=-1)[..., :-1]
        outs.append(torch.einsum("hls,shd->lhd", probs, v))
    return torch.cat(outs)


def hide_blocks_before(batch: PagedBatch, first_key) -> None:
    """Blocks wholly before each request's first needed key (``first_key(q_len,
    seq_len)``, its first query's window or chunk start) may already be freed: their
    cache rows become NaN and their block-table entries name a never-used (NaN) block, so
    a kernel that reads either returns NaN."""
    block_size = batch.kv_cache.shape[2]
    spare = batch.kv_cache.shape[1] - 1  # make_batch leaves the last blocks unused...
    while bool((batch.block_tables == spare).any()):
        spare -= 1  # ...in a random order: find one no request names
    for r in range(batch.seq_lens.shape[0]):
        q_len = int(batch.query_start_loc[r + 1] - batch.query_start_loc[r])
        skipped = first_key(q_len, int(batch.seq_lens[r])) // block_size
        batch.kv_cache[:, batch.block_tables[r, :skipped].long()] = float("nan")
        batch.block_tables[r, :skipped] = spare


@dataclass
class EncoderBatch:
    """A step of encoder (non-causal) requests: this step's q/K/V rows and no cache."""

    q: torch.Tensor  # [T, H, D]
    k: torch.Tensor  # [T, Hkv, D]
    v: torch.Tensor  # [T, Hkv, D]
    query_start_loc: torch.Tensor  # int32 [R + 1]

    @property
    def max_query_len(self) -> int:
        return int((self.query_start_loc[1:] - self.query_start_loc[:-1]).max())


def make_encoder_batch(
    lengths: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
    generator: torch.Generator,
) -> EncoderBatch:
    """Random q/K/V for requests of ``lengths`` tokens, concatenated in request order."""
    total = sum(lengths)

    def rows(heads: int) -> torch.Tensor:
        return torch.randn(total, heads, head_size, generator=generator).to(dtype)

    query_start_loc = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(torch.tensor(lengths), 0)
    return EncoderBatch(rows(num_heads), rows(num_kv_heads), rows(num_kv_heads), query_start_loc)


def reference_encoder_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_start_loc,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """float64 bidirectional attention within each request's rows (``query_start_loc``
    segments); a window ``w`` keeps keys with ``|q_pos - k_pos| <= w // 2``."""
    outs = []
    bounds = [int(x) for x in query_start_loc]
    group = q.shape[1] // k.shape[1]
    for start, end in itertools.pairwise(bounds):
        qr = q[start:end].double()
        kr = k[start:end].double().repeat_interleave(group, dim=1)
        vr = v[start:end].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("lhd,shd->hls", qr, kr) * scale
        if soft_cap:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        if sliding_window is not None:
            pos = torch.arange(end - start)
            near = (pos[:, None] - pos[None, :]).abs() <= sliding_window // 2
            scores = scores.masked_fill(~near, float("-inf"))
        outs.append(torch.einsum("hls,shd->lhd", torch.softmax(scores, dim=-1), vr))
    return torch.cat(outs) if outs else q.new_empty(q.shape, dtype=torch.float64)
