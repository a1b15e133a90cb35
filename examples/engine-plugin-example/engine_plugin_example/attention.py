"""The "example-sdpa" attention backend: a paged KV cache and plain torch attention.

Cache layout (one tensor per layer)::

    kv_cache[0 | 1, num_blocks, block_size, num_kv_heads, head_size]   # 0 = K, 1 = V

Slot ``s`` of the step's ``slot_mapping`` is ``(block = s // block_size, offset = s %
block_size)``; slots of -1 are not written. Every new K/V row is stored before any
attention, so a request may read rows written this very step (its own prefill chunk).

Attention runs per request with plain matmuls in float32 (or float64 inputs stay
float64): request ``r``'s query row ``i`` sits at position ``seq_len - query_len + i``
and sees keys ``0 ..= that position`` (only the last ``sliding_window`` of them when the
layer has a window), exactly the contract of ``engine.core.interfaces.attention``.
GQA groups ``num_heads // num_kv_heads`` query heads onto each KV head.

Test-only: ``EXAMPLE_PLUGIN_ATTENTION_BUG=1`` (read when a layer's kernel is made) hides
the newest key from every query row (a subtle off-by-one a conformance kit must catch).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from engine.core.interfaces import (
    AttentionBackend,
    AttentionBatch,
    AttentionImpl,
    AttentionLayerSpec,
)

BUG_ENV = "EXAMPLE_PLUGIN_ATTENTION_BUG"


@dataclass
class ExampleAttentionMetadata:
    query_start_loc: list[int]  # host ints [R + 1]
    seq_lens: list[int]  # host ints [R]
    block_tables: torch.Tensor  # int64 [R, M]
    slot_mapping: torch.Tensor  # int64 [T]
    num_tokens: int


def _host_list(host: Any, tensor: torch.Tensor) -> list[int]:
    if host is not None:
        return [int(x) for x in host]
    return [int(x) for x in tensor.tolist()]


class ExampleSDPAImpl(AttentionImpl):
    def __init__(self, spec: AttentionLayerSpec, block_size: int) -> None:
        super().__init__(spec)
        self.block_size = block_size
        self.bug = os.environ.get(BUG_ENV) == "1"

    def forward(self, query, key, value, kv_cache, metadata: ExampleAttentionMetadata):
        spec = self.spec
        num_tokens = metadata.num_tokens
        bs = self.block_size
        # 1. store this step's K/V rows (slot -1: skip)
        slots = metadata.slot_mapping[:num_tokens]
        keep = slots >= 0
        if bool(keep.any()):
            slots_k = slots[keep]
            blocks, offsets = slots_k // bs, slots_k % bs
            kv_cache[0, blocks, offsets] = key[:num_tokens][keep].to(kv_cache.dtype)
            kv_cache[1, blocks, offsets] = value[:num_tokens][keep].to(kv_cache.dtype)

        # 2. attend per request
        out = torch.zeros_like(query)
        group = spec.num_heads // spec.num_kv_heads
        compute = torch.float64 if query.dtype == torch.float64 else torch.float32
        qsl, seq_lens = metadata.query_start_loc, metadata.seq_lens
        for r, seq_len in enumerate(seq_lens):
            start, end = qsl[r], qsl[r + 1]
            q_len = end - start
            if q_len == 0:
                continue
            n_blocks = -(-seq_len // bs)
            table = metadata.block_tables[r, :n_blocks]
            # [n_blocks, bs, Hkv, D] -> [seq_len, Hkv, D]
            k = kv_cache[0, table].reshape(-1, spec.num_kv_heads, spec.head_size)[:seq_len]
            v = kv_cache[1, table].reshape(-1, spec.num_kv_heads, spec.head_size)[:seq_len]
            k = k.to(compute).repeat_interleave(group, dim=1).transpose(0, 1)  # [H, S, D]
            v = v.to(compute).repeat_interleave(group, dim=1).transpose(0, 1)
            q = query[start:end].to(compute).transpose(0, 1)  # [H, Q, D]
            scores = torch.matmul(q, k.transpose(1, 2)) * spec.scale  # [H, Q, S]
            if spec.logits_soft_cap is not None:
                scores = spec.logits_soft_cap * torch.tanh(scores / spec.logits_soft_cap)
            q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device).unsqueeze(1)
            k_pos = torch.arange(seq_len, device=query.device).unsqueeze(0)
            # the bug hides the query's own (newest) key: k_pos < q_pos instead of <=
            allowed = k_pos < q_pos if self.bug else k_pos <= q_pos
            if self.bug:
                allowed = allowed | (k_pos == 0)  # keep a key per row: no NaN gives it away
            if spec.sliding_window is not None:
                allowed = allowed & (k_pos > q_pos - spec.sliding_window)
            scores = scores.masked_fill(~allowed, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            out[start:end] = torch.matmul(probs, v).transpose(0, 1).to(query.dtype)
        return out


class ExampleSDPABackend(AttentionBackend):
    name = "example-sdpa"

    @classmethod
    def get_kv_cache_shape(cls, num_blocks, block_size, num_kv_heads, head_size):
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True  # the mask keeps the last ``sliding_window`` keys

    def build_metadata(self, batch: AttentionBatch) -> ExampleAttentionMetadata:
        qsl = _host_list(batch.query_start_loc_cpu, batch.query_start_loc)
        seq_lens = _host_list(batch.seq_lens_cpu, batch.seq_lens)
        if len(qsl) < batch.num_reqs + 1 or len(seq_lens) < batch.num_reqs:
            raise ValueError("query_start_loc / seq_lens do not cover the batch")
        return ExampleAttentionMetadata(
            query_start_loc=qsl[: batch.num_reqs + 1],
            seq_lens=seq_lens[: batch.num_reqs],
            block_tables=batch.block_tables.to(device=self.device, dtype=torch.int64),
            slot_mapping=batch.slot_mapping.to(device=self.device, dtype=torch.int64),
            num_tokens=batch.num_tokens,
        )

    def make_impl(self, spec: AttentionLayerSpec) -> AttentionImpl:
        if spec.is_mla:
            raise ValueError("example-sdpa has no MLA kernels")
        return ExampleSDPAImpl(spec, self.block_size)
