"""Paged attention on the CPU: the plugin's C kernel for every query token, torch ops
(SDPA and index_select gathers) wherever the C kernel is unavailable.

The cache holds the model dtype; queries may be wider (float32 activations over a bf16
cache, on CPUs without bf16 arithmetic): keys and values are rounded into the cache
and widened as they are read. With ``--kv-cache-dtype fp8 | fp8_e5m2`` it holds fp8 codes
of ``key / k_scale`` and ``value / v_scale`` (the layer's scales, see
:mod:`engine.core.interfaces.attention`): the C kernels quantize as they store and widen
the codes exactly as they read (the scales folded into the softmax scale and the
output); the torch-op paths quantize with torch and dequantize the gathered blocks.

Cache layout (one tensor per layer)::

    kv_cache[0 | 1, block, kv_head, block_size * head_size]   # 0 = K, 1 = V
    V row: [block_size, head_size]
    K row: for layers the C decode kernel runs, :class:`~.native.KeyLayout`
           ``DIMS_MAJOR`` [head_size, block_size] (one dimension of consecutive keys is
           contiguous) or, bf16 on AVX512-BF16 CPUs, ``DIM_PAIRS`` [head_size / 2,
           block_size, 2]; else ``PLAIN``, like V

Each (block, kv head) is one row, so one ``index_select`` over precomputed row ids
gathers a request's history for the torch ops (a kernel layout's K then needs one more
copy, in prefills only); the C decode kernel reads the rows in place, and its K layouts
let it score 16 keys per vector instruction. Slot ``s`` is ``(block = s //
block_size, offset = s % block_size)``.

Per layer, :meth:`CPUAttentionImpl.forward`:

1. writes every new K/V row of the step into the cache in one store (the C ``write_kv``
   where the kernels run, else indexed stores; rows whose slot is -1 are skipped) --
   before any attention, so a request may read blocks that another request of the same
   batch filled this step (prefix caching relies on it);
2. with the C kernel of :mod:`engine.plugins.cpu.native` (when it could be built and
   serves the layer): attends for every token of the step in one call, each token a
   query of its own over its causal prefix (a decode's whole context, a prefill
   token's keys up to its position), reading the blocks in place. For short prefill
   chunks this skips the gathers and per-request SDPA calls (64 x 128-token prompts:
   ~2x faster attention); chunks whose context exceeds ``KERNEL_PREFILL_MAX_CONTEXT``
   go to SDPA as in step 3, where its tiled matmuls win;
3. otherwise with torch ops: all single-token requests ("decodes") at once, their
   blocks gathered into a padded ``[R, kv_heads, keys, D]`` tensor and one masked SDPA
   with the queries grouped as ``[R, kv_heads, group, D]`` (GQA without repeating
   K/V); then each multi-token request (a prefill chunk, possibly after cached
   context) separately, queries as ``[kv_heads, group, q_len, D]`` against K/V
   expanded (not copied) to ``[kv_heads, group, keys, D]``, with a causal mask offset
   by the context length (SDPA's own ``is_causal`` when there is no context or window).

Chunked local attention (Llama 4, ``spec.attention_chunk_size = C``) and sliding
windows are per-query key starts: ``C * (p // C)`` and ``p - window + 1`` for a query at
position ``p`` (the C kernel computes them per query row from its ``seq_len``; the torch
paths mask per row). No path reads a cache block, or a block-table entry, before the
first key a query of the step needs: those blocks may already be freed. Learned sinks
(GPT-OSS, ``spec.use_sinks``; ``impl.sinks`` float32 ``[num_heads]``) add
``exp(sink_h)`` to each row's softmax denominator: the C kernel when it normalizes a
row (after merging its key splits), the torch paths as one more softmax column.

Everything that depends only on the batch (block indices, masks per sliding-window
size and chunk size) is computed once per step in :class:`CPUAttentionMetadata` and
shared by all layers. Masked-out cache slots must hold finite values (caches start zero-filled):
a masked key gets probability 0, but ``0 * inf`` would still poison the sum.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F

from engine.core.batch_invariance import batch_invariant_enabled
from engine.core.interfaces import (
    AttentionBackend,
    AttentionBatch,
    AttentionImpl,
    AttentionLayerSpec,
)
from engine.core.interfaces.attention import dequantize_kv, is_fp8_kv_cache, quantize_kv
from engine.plugins.cpu.encoder_attention import (
    EncoderPlan,
    encoder_attention,
    plan_encoder_step,
)
from engine.plugins.cpu.mla_attention import CPUMLAAttentionImpl, MLAPlan
from engine.plugins.cpu.native import CPUKernels, KeyLayout, load_kernels


@dataclass
class _KeyPlan:
    """Which cache blocks to gather for a group of queries, and the mask over them."""

    blocks: torch.Tensor  # int64 [R, nb] (decodes) or [nb] (one prefill)
    mask: torch.Tensor  # bool, True = attend: [R, 1, 1, nb*bs] or [q_len, nb*bs]
    # The mask is plain top-left causal (a prefill from position 0, no window), so SDPA
    # can take ``is_causal`` and skip reading a mask.
    causal: bool = False
    _rows: dict[int, torch.Tensor] = field(default_factory=dict)
    _bias: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)

    def bias(self, dtype: torch.dtype) -> torch.Tensor:
        """The mask as an additive ``0 / -inf`` tensor (SDPA would convert a bool mask
        again in every layer)."""
        bias = self._bias.get(dtype)
        if bias is None:
            bias = torch.zeros(self.mask.shape, dtype=dtype, device=self.mask.device)
            bias.masked_fill_(~self.mask, float("-inf"))
            self._bias[dtype] = bias
        return bias

    def rows(self, num_kv_heads: int) -> torch.Tensor:
        """Row ids into the cache viewed as ``[blocks * kv_heads, block_size * D]``,
        ordered ``[..., kv_head, block]``: one ``index_select`` (a plain row copy, much
        faster on CPU than two-tensor advanced indexing) gathers the history."""
        rows = self._rows.get(num_kv_heads)
        if rows is None:
            heads = torch.arange(num_kv_heads, device=self.blocks.device).view(-1, 1)
            rows = (self.blocks.unsqueeze(-2) * num_kv_heads + heads).flatten()
            self._rows[num_kv_heads] = rows
        return rows


@dataclass
class _Prefill:
    """One request with more than one new token."""

    start: int  # first token row of the step
    end: int
    seq_len: int
    block_ids: torch.Tensor  # int64 [ceil(seq_len / block_size)]
    # Per query, the exclusive end of its keys where some query attends past its own
    # position (AttentionBatch.key_ends_cpu: bidirectional image tokens); None: causal.
    key_ends: torch.Tensor | None = None


@dataclass
class _WriteIndex:
    """Where the torch-op store puts the step's new K/V rows (the C store reads only
    ``slot_mapping``)."""

    block: torch.Tensor  # int64 [W] block of each written row
    offset: torch.Tensor  # int64 [W] offset in block
    rows: torch.Tensor | None  # int64 [W] token rows written; None: all rows


# Prefill chunks whose context (cached + new tokens) is at most this long go through the
# C kernel one token at a time; longer ones through SDPA, whose tiled matmuls then win
# (llama-tiny prefill of one prompt: C 0.041 vs SDPA 0.047 s at 256 tokens, equal at
# 1024, 6.2 vs 4.9 s at 8000).
KERNEL_PREFILL_MAX_CONTEXT = 1024


@dataclass
class _TokenQueries:
    """The tokens of a step the C kernel attends for, each a query of its own: token
    ``t`` at position ``p`` attends to keys ``0 ..= p`` of its request (its causal
    prefix). Decodes and short prefill chunks; ``long_prefills`` go to SDPA."""

    rows: torch.Tensor | None  # int64 token rows; None: every token of the step
    seq_lens: torch.Tensor  # int64 [rows]: p + 1
    block_tables: torch.Tensor  # int64 [rows, M]: the token's request's row
    long_prefills: list[_Prefill]


@dataclass
class CPUAttentionMetadata:
    """Step-level index tensors, shared by every layer of the step."""

    num_tokens: int
    block_size: int
    slot_mapping: torch.Tensor  # int64 [T] every token's slot, -1: not written
    decode_rows: torch.Tensor | None  # int64 [Rd] token rows; None: every row, in order
    decode_seq_lens: torch.Tensor  # int64 [Rd]
    decode_block_tables: torch.Tensor  # int64 [Rd, M]
    prefills: list[_Prefill]
    # What token_queries() derives its tensors from (steps with prefill chunks only).
    query_lens: np.ndarray | None = None  # [R]
    seq_lens: np.ndarray | None = None  # int64 [R]
    block_tables: torch.Tensor | None = None  # int64 [R, M]
    query_start_loc: np.ndarray | None = None  # int64 [R + 1] (encoder layers' segments)
    _encoder_plan: EncoderPlan | None = None  # built by the step's first encoder layer
    _token_queries: _TokenQueries | None = None
    mla_plan: MLAPlan | None = None  # built by the step's first MLA layer (mla_attention)
    _write_index: _WriteIndex | None = None
    _decode_plans: dict[tuple[int | None, int | None], _KeyPlan] = field(default_factory=dict)
    _prefill_plans: dict[tuple[int | None, int | None, int], list[_KeyPlan]] = field(
        default_factory=dict)

    def write_index(self) -> _WriteIndex:
        """Block / offset of every written row, for the torch-op store (built once)."""
        if self._write_index is None:
            slots, rows = self.slot_mapping, None
            valid = slots >= 0
            if not bool(valid.all()):
                rows = valid.nonzero().squeeze(1)
                slots = slots[rows]
            bs = self.block_size
            block = torch.div(slots, bs, rounding_mode="floor")
            self._write_index = _WriteIndex(block, slots - block * bs, rows)
        return self._write_index

    def token_queries(self) -> _TokenQueries:
        """Per-token lengths and block tables of a step with prefill chunks (built once)."""
        if self._token_queries is None:
            query_lens = self.query_lens
            by_kernel = (query_lens <= 1) | (self.seq_lens <= KERNEL_PREFILL_MAX_CONTEXT)
            if batch_invariant_enabled():  # every query token summed as a decode's is
                by_kernel[:] = True
            # Queries that attend past their own position take the masked torch path
            # (the C kernel's keys end at each query's position).
            ahead = {p.start for p in self.prefills if p.key_ends is not None}
            if ahead:
                by_kernel[np.isin(self.query_start_loc[:-1], list(ahead))] = False
            token_req = np.repeat(np.arange(len(query_lens)), query_lens)
            ends = np.cumsum(query_lens)
            # token t of its request's chunk ending at ends[r]: position seq_len - (end - t)
            seq_lens = self.seq_lens[token_req] - (ends[token_req] - 1 - np.arange(len(token_req)))
            rows = None
            if not by_kernel.all():
                kept = np.flatnonzero(by_kernel[token_req])
                token_req, seq_lens, rows = token_req[kept], seq_lens[kept], _tensor(kept)
            long_starts = set((ends - query_lens)[~by_kernel].tolist())
            self._token_queries = _TokenQueries(
                rows=rows,
                seq_lens=_tensor(seq_lens),
                block_tables=self.block_tables.index_select(0, torch.from_numpy(token_req)),
                long_prefills=[p for p in self.prefills if p.start in long_starts],
            )
        return self._token_queries

    @property
    def num_decodes(self) -> int:
        return int(self.decode_seq_lens.shape[0])

    def decode_plan(self, window: int | None, chunk: int | None = None) -> _KeyPlan:
        plan = self._decode_plans.get((window, chunk))
        if plan is None:
            plan = self._decode_plans[window, chunk] = self._make_decode_plan(window, chunk)
        return plan

    def prefill_plans(self, window: int | None, prefills: list[_Prefill],
                      chunk: int | None = None) -> list[_KeyPlan]:
        """Key plans of ``prefills``: all of the step's, or the C path's long ones (a
        subset, so the two lists differ in length when they differ)."""
        key = (window, chunk, len(prefills))
        plans = self._prefill_plans.get(key)
        if plans is None:
            plans = self._prefill_plans[key] = [
                self._make_prefill_plan(p, window, chunk) for p in prefills
            ]
        return plans

    def _make_decode_plan(self, window: int | None, chunk: int | None) -> _KeyPlan:
        """The blocks from each decode's first key on (never a block before it: blocks
        outside a window or before the query's chunk may already be freed)."""
        bs = self.block_size
        seq = self.decode_seq_lens
        last_block = (seq + bs - 1) // bs  # exclusive
        first_key = torch.zeros_like(seq)
        if window is not None:
            first_key = (seq - window).clamp(min=0)
        if chunk is not None:  # the query (position seq - 1) sees its own chunk only
            first_key = torch.maximum(first_key, (seq - 1) // chunk * chunk)
        first_block = first_key // bs
        width = int((last_block - first_block).max())
        cols = first_block[:, None] + torch.arange(width, device=seq.device)  # unclamped
        # Columns past a row's last block (shorter rows of the padded width) repeat that
        # block, masked: no padding entry of the table is read.
        blocks = self.decode_block_tables.gather(1, torch.minimum(cols, last_block[:, None] - 1))
        key_pos = (cols[:, :, None] * bs + torch.arange(bs, device=seq.device)).flatten(1)
        mask = (key_pos < seq[:, None]) & (key_pos >= first_key[:, None])
        return _KeyPlan(blocks, mask[:, None, None, :])

    def _make_prefill_plan(self, p: _Prefill, window: int | None,
                           chunk: int | None) -> _KeyPlan:
        bs = self.block_size
        q_len = p.end - p.start
        first_query = p.seq_len - q_len
        first_key = 0 if window is None else max(0, first_query - window + 1)
        if chunk is not None:  # the first query's chunk start: no earlier key is needed
            first_key = max(first_key, first_query // chunk * chunk)
        first_block = first_key // bs
        blocks = p.block_ids[first_block:]
        device = blocks.device
        key_pos = first_block * bs + torch.arange(blocks.shape[0] * bs, device=device)
        query_pos = p.seq_len - q_len + torch.arange(q_len, device=device)
        if p.key_ends is None:
            mask = key_pos[None, :] <= query_pos[:, None]
        else:  # some queries see later keys too (their image's tokens)
            mask = key_pos[None, :] < p.key_ends[:, None]
        if window is not None:
            mask &= key_pos[None, :] > (query_pos - window)[:, None]
        if chunk is not None:
            mask &= key_pos[None, :] >= (query_pos // chunk * chunk)[:, None]
        causal = q_len == p.seq_len and p.key_ends is None and (
            window is None or window >= q_len) and (chunk is None or chunk >= q_len)
        return _KeyPlan(blocks, mask, causal=causal)


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: _KeyPlan,
    scale: float,
    soft_cap: float | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention over ``plan``'s keys; ``q``, ``k``, ``v`` share batch dims.
    ``sinks``: float32 sink logits broadcastable to the scores' ``[..., q_len, 1]``, one
    more (value-less, uncapped) column of each row's softmax."""
    if soft_cap is None and sinks is None:
        if plan.causal:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=plan.bias(q.dtype), scale=scale)
    if plan.mask.dim() == 2:  # a prefill: materialize the scores a block of rows at a time
        q_len, keys = plan.mask.shape
        rows = max(16, EXPLICIT_SCORES_BUDGET // max(1, keys * math.prod(q.shape[:-2])))
        if q_len > rows:
            return torch.cat([
                _explicit(q[..., i:i + rows, :], k, v, plan.mask[i:i + rows], scale, soft_cap,
                          sinks)
                for i in range(0, q_len, rows)], dim=-2)
    return _explicit(q, k, v, plan.mask, scale, soft_cap, sinks)


# Score elements (float32) the explicit path (soft caps, sinks) materializes at once for
# a prefill chunk: longer chunks go a block of query rows at a time.
EXPLICIT_SCORES_BUDGET = 1 << 24


def _explicit(q, k, v, mask, scale, soft_cap, sinks) -> torch.Tensor:
    """Scores, caps, masks and the sink column spelled out (float32 softmax)."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if soft_cap is not None:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v)
    sink_col = sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat((scores, sink_col), dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs.to(v.dtype), v)


class CPUAttentionImpl(AttentionImpl):
    def __init__(self, spec: AttentionLayerSpec, kernels: CPUKernels | None = None) -> None:
        super().__init__(spec)
        self.group = spec.num_heads // spec.num_kv_heads
        # The C decode kernel when it can serve this layer, else the torch-op path.
        self.kernels = kernels if kernels and kernels.supports_attention(spec) else None
        self._views: tuple[torch.Tensor, torch.Tensor, torch.Tensor, KeyLayout] | None = None

    def release_kv_cache(self) -> None:
        self._views = None

    def key_layout(self, dtype: torch.dtype) -> KeyLayout:
        """How this layer stores K rows in a cache of ``dtype``."""
        return self.kernels.key_layout(dtype) if self.kernels is not None else KeyLayout.PLAIN

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: CPUAttentionMetadata,
    ) -> torch.Tensor:
        if not self.spec.causal:
            spec = self.spec
            if metadata._encoder_plan is None:
                metadata._encoder_plan = plan_encoder_step(metadata.query_start_loc)
            return encoder_attention(query, key, value, metadata.query_start_loc, spec.scale,
                                     spec.sliding_window, spec.logits_soft_cap,
                                     plan=metadata._encoder_plan)
        key_cache, value_cache = self._cache_views(kv_cache, metadata.block_size)
        self._write(key_cache, value_cache, key, value, metadata)
        num_decodes = metadata.num_decodes
        decode_only = metadata.decode_rows is None and num_decodes == query.shape[0]
        window = self.spec.sliding_window
        if self.kernels is not None:
            if decode_only:
                return self._kernel(query, key_cache, value_cache, metadata.decode_seq_lens,
                                    metadata.decode_block_tables)
            # One C call for every token but those of long prefill chunks (SDPA's).
            tokens = metadata.token_queries()
            if tokens.rows is None:
                return self._kernel(query, key_cache, value_cache, tokens.seq_lens,
                                    tokens.block_tables)
            out = torch.empty_like(query)
            if tokens.rows.numel():
                out[tokens.rows] = self._kernel(query[tokens.rows], key_cache, value_cache,
                                                tokens.seq_lens, tokens.block_tables)
            prefills = tokens.long_prefills
        else:
            if decode_only:
                return self._decode(query, key_cache, value_cache, metadata)
            out = torch.empty_like(query)
            if num_decodes:
                rows = metadata.decode_rows
                out[rows] = self._decode(query[rows], key_cache, value_cache, metadata)
            prefills = metadata.prefills
        plans = metadata.prefill_plans(window, prefills, self.spec.attention_chunk_size)
        for p, plan in zip(prefills, plans):
            out[p.start : p.end] = self._prefill(
                query[p.start : p.end], key_cache, value_cache, plan
            )
        return out

    def _kernel(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
    ) -> torch.Tensor:
        """The C kernel: query row i attends to keys ``[0, seq_lens[i])`` of its table
        (from its window's or chunk's start)."""
        spec = self.spec
        return self.kernels.paged_decode_attention(
            query, key_cache, value_cache, block_tables, seq_lens,
            spec.scale, spec.sliding_window, spec.logits_soft_cap,
            k_scale=self.k_scale, v_scale=self.v_scale,
            chunk=spec.attention_chunk_size, sinks=self._sink_logits(),
        )

    def _sink_logits(self) -> torch.Tensor | None:
        """``self.sinks`` as contiguous float32 ``[num_heads]`` (None without sinks)."""
        if not self.spec.use_sinks:
            return None
        sinks = self.sinks
        if sinks is None:
            raise ValueError("this attention layer uses sinks (spec.use_sinks) but its "
                             "impl.sinks were never set (load the layer's weights first)")
        if sinks.shape != (self.spec.num_heads,):
            raise ValueError(f"impl.sinks must hold one logit per query head "
                             f"({self.spec.num_heads}), not shape {tuple(sinks.shape)}")
        return sinks.detach().to(torch.float32).contiguous()

    def _cache_views(
        self, kv_cache: torch.Tensor, block_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's cache as K rows ``[blocks, kv_heads, block_size * D]`` (in
        :meth:`key_layout`) and V blocks ``[blocks, kv_heads, block_size, D]`` (made
        once: a layer keeps its cache)."""
        views = self._views
        if views is None or views[0] is not kv_cache:
            num_blocks, kv_heads = kv_cache.shape[1:3]
            value_cache = kv_cache[1].view(num_blocks, kv_heads, block_size, self.spec.head_size)
            layout = self.key_layout(kv_cache.dtype)
            views = self._views = (kv_cache, kv_cache[0], value_cache, layout)
        return views[1], views[2]

    def _write(
        self,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        md: CPUAttentionMetadata,
    ) -> None:
        if self.kernels is not None:
            self.kernels.write_kv(key, value, md.slot_mapping, key_cache, value_cache,
                                  self.k_scale, self.v_scale)
            return
        where = md.write_index()
        if where.rows is not None:
            key, value = key[where.rows], value[where.rows]
        layout = self._views[3]
        tokens = layout.token_view(key_cache, md.block_size, self.spec.head_size)
        dtype = key_cache.dtype
        if is_fp8_kv_cache(dtype):
            key, value = quantize_kv(key, self.k_scale, dtype), quantize_kv(value, self.v_scale,
                                                                            dtype)
        tokens[where.block, :, where.offset] = key.to(dtype).unflatten(-1, (-1, layout.pack))
        value_cache[where.block, :, where.offset] = value.to(dtype)

    def _widen(self, gathered: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
        """Gathered cache values in the queries' ``dtype`` (an fp8 cache's dequantized)."""
        if is_fp8_kv_cache(gathered.dtype):
            return dequantize_kv(gathered, scale, dtype)
        return gathered.to(dtype)

    def _gather_values(self, cache: torch.Tensor, plan: _KeyPlan) -> torch.Tensor:
        """The plan's value blocks as ``[..., kv_heads, nb * block_size, D]`` (one copy)."""
        num_blocks, kv_heads, block_size, head_size = cache.shape
        flat = cache.view(num_blocks * kv_heads, block_size * head_size)
        gathered = flat.index_select(0, plan.rows(kv_heads))
        return gathered.view(*plan.blocks.shape[:-1], kv_heads, -1, head_size)

    def _gather_keys(self, cache: torch.Tensor, plan: _KeyPlan) -> torch.Tensor:
        """The plan's key blocks, token-major, as ``[..., kv_heads, nb * block_size, D]``
        (one copy; a kernel layout is reordered by a second)."""
        num_blocks, kv_heads, row_len = cache.shape
        head_size = self.spec.head_size
        gathered = cache.view(num_blocks * kv_heads, row_len).index_select(0, plan.rows(kv_heads))
        gathered = gathered.view(*plan.blocks.shape[:-1], kv_heads, -1, row_len)
        tokens = self._views[3].token_view(gathered, row_len // head_size, head_size)
        return tokens.reshape(*gathered.shape[:-2], -1, head_size)

    def _decode(
        self,
        query: torch.Tensor,  # [Rd, H, D]
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        md: CPUAttentionMetadata,
    ) -> torch.Tensor:
        spec = self.spec
        plan = md.decode_plan(spec.sliding_window, spec.attention_chunk_size)
        keys = self._widen(self._gather_keys(key_cache, plan), self.k_scale,
                           query.dtype)  # [Rd, Hkv, L, D]
        values = self._widen(self._gather_values(value_cache, plan), self.v_scale, query.dtype)
        q = query.view(-1, spec.num_kv_heads, self.group, spec.head_size)
        sinks = self._sink_logits()
        if sinks is not None:  # scores [Rd, Hkv, group, L]
            sinks = sinks.view(spec.num_kv_heads, self.group, 1)
        out = _attend(q, keys, values, plan, spec.scale, spec.logits_soft_cap, sinks)
        return out.reshape(-1, spec.num_heads, spec.head_size)

    def _prefill(
        self,
        query: torch.Tensor,  # [q_len, H, D]
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        plan: _KeyPlan,
    ) -> torch.Tensor:
        spec = self.spec
        q_len = query.shape[0]
        # [Hkv, group, L, D] as a stride-0 view: no copy, and unlike a broadcast batch
        # dim it keeps SDPA on its fused kernel instead of the score-materializing one.
        shape = (spec.num_kv_heads, self.group, -1, spec.head_size)
        keys = self._widen(self._gather_keys(key_cache, plan), self.k_scale, query.dtype)
        values = self._widen(self._gather_values(value_cache, plan), self.v_scale, query.dtype)
        keys, values = keys.unsqueeze(1).expand(shape), values.unsqueeze(1).expand(shape)
        q = query.view(q_len, spec.num_kv_heads, self.group, spec.head_size).permute(1, 2, 0, 3)
        sinks = self._sink_logits()
        if sinks is not None:  # scores [Hkv, group, q_len, L]
            sinks = sinks.view(spec.num_kv_heads, self.group, 1, 1)
        out = _attend(q, keys, values, plan, spec.scale, spec.logits_soft_cap, sinks)
        return out.permute(2, 0, 1, 3).reshape(q_len, spec.num_heads, spec.head_size)


class CPUAttentionBackend(AttentionBackend):
    """Paged attention for the CPU platform (any head size, block size, window): decodes
    through the plugin's C kernel where it serves the layer, the rest with torch ops."""

    name: ClassVar[str] = "cpu"

    @classmethod
    def supported_kv_cache_dtypes(cls, mla: bool = False) -> tuple[str, ...]:
        """fp8 caches for MHA / GQA layers (the C kernels at every ISA level and the
        torch-op paths); MLA caches hold the model dtype."""
        return ("auto",) if mla else ("auto", "fp8_e4m3", "fp8_e5m2")

    @classmethod
    def get_kv_cache_shape(
        cls, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        return (2, num_blocks, num_kv_heads, block_size * head_size)

    @classmethod
    def get_mla_kv_cache_shape(
        cls, num_blocks: int, block_size: int, entry_size: int
    ) -> tuple[int, ...]:
        """One latent entry per token (:mod:`.mla_attention`)."""
        return (num_blocks, block_size, entry_size)

    @classmethod
    def supports_encoder_attention(cls) -> bool:
        return True

    @classmethod
    def supports_key_ends(cls) -> bool:
        return True

    @classmethod
    def supports_attention_sinks(cls) -> bool:
        return True

    @classmethod
    def supports_chunked_local_attention(cls) -> bool:
        return True

    @classmethod
    def validate(cls, spec: AttentionLayerSpec, block_size: int) -> str | None:
        if spec.is_mla and (spec.sliding_window or spec.logits_soft_cap):
            return f"{cls.name} MLA attention has no sliding window or logits soft cap"
        if not spec.causal and (spec.use_sinks or spec.attention_chunk_size is not None):
            return (f"{cls.name} encoder (non-causal) attention has no sinks or chunked "
                    "local attention")
        if spec.attention_chunk_size is not None and spec.attention_chunk_size <= 0:
            return f"attention_chunk_size must be positive, not {spec.attention_chunk_size}"
        return super().validate(spec, block_size)

    def allocate_kv_cache(
        self, shape: tuple[int, ...], dtype: torch.dtype, num_layers: int
    ) -> list[torch.Tensor]:
        """Caches on anonymous memory maps: the OS hands out zero pages on first touch,
        so a multi-GiB cache costs neither startup time nor RAM until blocks are used
        (``torch.zeros`` would write every page up front)."""
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        caches = []
        for _ in range(num_layers):
            buffer = mmap.mmap(-1, max(nbytes, 1))
            flat = torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes)
            caches.append(flat.view(dtype).view(shape))
        return caches

    def make_impl(self, spec: AttentionLayerSpec) -> CPUAttentionImpl | CPUMLAAttentionImpl:
        if spec.is_mla:
            reason = self.validate(spec, self.block_size)
            if reason is not None:
                raise ValueError(reason)
            return CPUMLAAttentionImpl(spec, load_kernels())
        if spec.num_kv_heads <= 0 or spec.num_heads % spec.num_kv_heads:
            raise ValueError(
                f"num_heads ({spec.num_heads}) must be a multiple of "
                f"num_kv_heads ({spec.num_kv_heads})"
            )
        return CPUAttentionImpl(spec, load_kernels())

    def build_metadata(self, batch: AttentionBatch) -> CPUAttentionMetadata:
        bs = self.block_size
        qsl = _host(batch.query_start_loc_cpu, batch.query_start_loc).astype(np.int64)
        seq_lens = _host(batch.seq_lens_cpu, batch.seq_lens).astype(np.int64)
        num_reqs, num_tokens = batch.num_reqs, batch.num_tokens
        if qsl.shape[0] != num_reqs + 1 or seq_lens.shape[0] != num_reqs:
            raise ValueError(
                f"batch of {num_reqs} requests has {qsl.shape[0]} query_start_loc entries "
                f"and {seq_lens.shape[0]} seq_lens"
            )
        if qsl[-1] != num_tokens:
            raise ValueError(f"query_start_loc ends at {qsl[-1]}, not num_tokens={num_tokens}")
        query_lens = np.diff(qsl)
        if (query_lens < 0).any() or (query_lens > seq_lens).any():
            raise ValueError("every request needs 0 <= query_len <= seq_len")
        block_tables = batch.block_tables.to(device=self.device, dtype=torch.int64)
        needed = int(-(-seq_lens.max() // bs)) if num_reqs else 0
        if block_tables.shape[-1] < needed:
            raise ValueError(
                f"block tables have {block_tables.shape[-1]} columns; a context of "
                f"{int(seq_lens.max())} tokens needs {needed} blocks of {bs}"
            )

        slot_mapping = batch.slot_mapping[:num_tokens].to(device=self.device, dtype=torch.int64)
        is_decode = query_lens == 1
        decode_reqs = np.flatnonzero(is_decode)
        if len(decode_reqs) == num_reqs == num_tokens:  # a decode-only step: no gathers
            decode_rows, decode_tables = None, block_tables
            decode_seq_lens = torch.from_numpy(seq_lens)
        else:
            decode_rows = _tensor(qsl[decode_reqs])
            decode_tables = block_tables.index_select(0, _tensor(decode_reqs))
            decode_seq_lens = _tensor(seq_lens[decode_reqs])
        prefills = [
            _Prefill(
                start=int(qsl[r]),
                end=int(qsl[r + 1]),
                seq_len=int(seq_lens[r]),
                block_ids=block_tables[r, : -(-int(seq_lens[r]) // bs)],
                key_ends=_keys_ahead(batch.key_ends_cpu, int(qsl[r]), int(qsl[r + 1]),
                                     int(seq_lens[r])),
            )
            for r in np.flatnonzero(query_lens > 1)
        ]
        return CPUAttentionMetadata(
            num_tokens=num_tokens,
            block_size=bs,
            slot_mapping=slot_mapping.contiguous(),
            decode_rows=decode_rows,
            decode_seq_lens=decode_seq_lens,
            decode_block_tables=decode_tables,
            prefills=prefills,
            query_lens=None if decode_rows is None else query_lens,
            seq_lens=None if decode_rows is None else seq_lens,
            block_tables=None if decode_rows is None else block_tables,
            query_start_loc=qsl,
        )

    def build_graph_metadata(self, batch: AttentionBatch) -> CPUAttentionMetadata:
        """Decode-only metadata over the runner's persistent buffers, as they are: the C
        kernels read the block tables, lengths and slots at their addresses, so every
        replay of a captured forward attends with what the runner wrote for its step."""
        if batch.num_reqs != batch.num_tokens:
            raise ValueError("a captured forward takes one token per request")
        for name in ("slot_mapping", "seq_lens", "block_tables"):
            tensor = getattr(batch, name)
            if tensor.dtype != torch.int64 or tensor.stride(-1) != 1:
                raise ValueError(f"graph batches need int64 {name} with unit last stride")
        return CPUAttentionMetadata(
            num_tokens=batch.num_tokens,
            block_size=self.block_size,
            slot_mapping=batch.slot_mapping,
            decode_rows=None,
            decode_seq_lens=batch.seq_lens,
            decode_block_tables=batch.block_tables,
            prefills=[],
        )


def _keys_ahead(key_ends: np.ndarray | None, start: int, end: int, seq_len: int
                ) -> torch.Tensor | None:
    """A prefill's per-query key ends when some query attends past its own position
    (``AttentionBatch.key_ends_cpu``), else None."""
    if key_ends is None:
        return None
    ends = np.asarray(key_ends[start:end], dtype=np.int64)
    positions = seq_len - (end - start) + np.arange(end - start)
    if (ends > seq_len).any() or (ends <= positions).any():
        raise ValueError("key_ends must lie after each query's position and within its "
                         "request's context")
    if (ends == positions + 1).all():
        return None
    return _tensor(ends)


def _tensor(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64))  # host = device


def _host(array, tensor: torch.Tensor) -> np.ndarray:
    """The host copy when the runner provided one, else a copy of the tensor."""
    if array is not None:
        return np.asarray(array)
    return tensor.detach().cpu().numpy()
