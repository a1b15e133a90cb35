"""Multi-head latent attention (MLA, DeepSeek-V2/V3) on the CPU, with torch ops.

Contract: engine/core/interfaces/attention.py. An MLA layer's ``key`` rows are the new
tokens' latent entries ``[T, 1, D]`` (``D = kv_lora_rank + rope_dim``), shared by every
head; attention is multi-query over those entries, the values being their first
``L = kv_lora_rank`` dims, and the output is ``[T, num_heads, L]``.

Cache layout (one tensor per MLA layer, from
:meth:`~engine.plugins.cpu.attention.CPUAttentionBackend.get_mla_kv_cache_shape`)::

    kv_cache[block, offset, D]      # one latent entry per token, nothing duplicated

so the cache viewed as ``[num_blocks * block_size, D]`` is indexed by slot directly.

Per layer, :meth:`CPUMLAAttentionImpl.forward`:

1. stores the step's new entries with one ``index_copy_`` into that flat view (rows
   whose slot is -1 skipped) -- before any attention, so a request may read blocks
   another request of the batch filled this step (prefix caching relies on it);
2. attends for all single-token requests ("decodes") at once: one ``index_select``
   over token slots gathers every decode's context into a padded ``[Rd, S, D]`` tensor
   (``S`` = longest decode context), then one fused SDPA call with the queries as
   ``[Rd, 1, H, D]`` (the heads are the rows of one multi-query problem) and an
   additive mask over each request's padding positions;
3. attends for each multi-token request (a prefill chunk, possibly after cached
   context: a prefix-cache hit) with one SDPA call: queries ``[1, H, q_len, D]`` over
   its ``[S, D]`` context entries expanded (not copied) over the heads, SDPA's own
   ``is_causal`` when the chunk starts at position 0, else a causal mask offset by the
   context length. A loop over prefill chunks, not tokens: a step holds few of them,
   each one big call, and padding chunks of different lengths to one batch would cost
   more (masks and scores over the longest chunk) than the loop.

The values handed to SDPA are the whole entries (the same tensor as the keys), and
only the output's first ``L`` dims are kept: SDPA's fused (flash) CPU kernel needs
equal query / key / value widths, and without it the unfused path would materialise
``[H, q_len, S]`` scores. Computing ``D`` output dims instead of ``L`` costs
``rope_dim / kv_lora_rank`` more (1/8 for DeepSeek's 512 + 64).

Everything is computed in float32 (float64 for float64 queries) whatever the cache
dtype, and returned in the query's dtype. Only written, finite entries are read: a
decode's padding positions re-read its own first entry (masked out with -inf, so they
weigh exactly 0), and a prefill reads exactly its ``seq_len`` entries, never the tail
of its last block nor blocks outside its table. The index tensors depend only on the
batch, so they are built once per step (:class:`MLAPlan`, kept on the step's metadata)
and shared by every MLA layer.

With the plugin's C kernels (:mod:`.native`, unless ``ENGINE_CPU_NATIVE_KERNELS=0``)
and float32 / bf16 / fp16 activations, steps 1 and 2 are C calls instead: the store is
``mla_write_entries`` (every slot checked before any is written) and the decodes are
``mla_decode_attention`` (csrc/mla_decode.c), which reads each request's blocks in place,
once for all heads, over the step's ``decode_block_tables`` / ``decode_seq_lens``; no
plan is built for a decode-only step. Prefill chunks stay on SDPA (step 3).

Forward graphs: a decode-only step on the C path is nothing but those two kernel calls,
so the CPU graph capturer records it (:mod:`.graphs`). Any other capture (the torch path,
or a step with prefill chunks) is refused with :class:`GraphCaptureError`, raised before
anything is stored, and the runner runs that step eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from engine.core.interfaces import AttentionImpl, AttentionLayerSpec, GraphCaptureError
from engine.plugins.cpu import native

if TYPE_CHECKING:
    from engine.plugins.cpu.attention import CPUAttentionMetadata
    from engine.plugins.cpu.native import CPUKernels


def _capturing() -> bool:
    """Whether this thread is inside a CPU forward-graph capture (which replays only C
    kernels)."""
    return getattr(native._recording, "calls", None) is not None


@dataclass
class _Keys:
    """Which cache rows a group of queries reads, and the mask over them."""

    slots: torch.Tensor  # int64 [Rd, S] (decodes) or [S] (one prefill)
    mask: torch.Tensor | None  # bool, True = attend; None: plain top-left causal
    _bias: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)

    def bias(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The mask as an additive ``0 / -inf`` tensor of ``dtype`` (made once)."""
        if self.mask is None:
            return None
        bias = self._bias.get(dtype)
        if bias is None:
            bias = torch.zeros(self.mask.shape, dtype=dtype, device=self.mask.device)
            bias.masked_fill_(~self.mask, float("-inf"))
            self._bias[dtype] = bias
        return bias


@dataclass
class _PrefillKeys:
    start: int  # first token row of the step
    end: int
    keys: _Keys


@dataclass
class MLAPlan:
    """A step's MLA index tensors, shared by every MLA layer of the step."""

    write_slots: torch.Tensor  # int64 [W] slots of the written rows
    write_rows: torch.Tensor | None  # int64 [W] token rows written; None: all rows
    decode_rows: torch.Tensor | None  # int64 [Rd]; None: every row, in order
    decodes: _Keys | None  # None: no decodes
    prefills: list[_PrefillKeys]

    @classmethod
    def build(cls, md: CPUAttentionMetadata) -> MLAPlan:
        bs = md.block_size
        slots, rows = md.slot_mapping, None
        valid = slots >= 0
        if not bool(valid.all()):
            rows = valid.nonzero().squeeze(1)
            slots = slots[rows]
        decodes = None
        if md.num_decodes:
            seq = md.decode_seq_lens.to(torch.int64)
            pos = torch.arange(int(seq.max()), device=seq.device)
            mask = pos[None, :] < seq[:, None]  # [Rd, S]
            pos = pos * mask  # padding positions re-read the request's entry 0
            blocks = md.decode_block_tables.to(torch.int64).gather(1, pos // bs)
            decodes = _Keys(blocks * bs + pos % bs, mask[:, None, None, :])
        prefills = []
        for p in md.prefills:
            pos = torch.arange(p.seq_len, device=p.block_ids.device)
            key_slots = p.block_ids.to(torch.int64)[pos // bs] * bs + pos % bs
            q_len = p.end - p.start
            mask = None
            if q_len != p.seq_len:  # after cached context: causal offset by its length
                q_pos = p.seq_len - q_len + torch.arange(q_len, device=pos.device)
                mask = pos[None, :] <= q_pos[:, None]
            prefills.append(_PrefillKeys(p.start, p.end, _Keys(key_slots, mask)))
        return cls(slots, rows, md.decode_rows, decodes, prefills)


class CPUMLAAttentionImpl(AttentionImpl):
    """One MLA layer on the CPU: store the step's latent entries, then attend (torch
    ops, see the module docstring)."""

    def __init__(self, spec: AttentionLayerSpec, kernels: CPUKernels | None = None) -> None:
        if not spec.is_mla:
            raise ValueError("CPUMLAAttentionImpl serves MLA layers (kv_lora_rank set)")
        super().__init__(spec)
        self.lora_rank = int(spec.kv_lora_rank)
        self.entry_size = spec.head_size
        self.kernels = kernels  # the C store / decode kernels; None: torch ops only

    def _native(self, query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        """Whether this step's store and decodes run the C kernels (dtypes they take)."""
        codes = native.DTYPE_CODES
        return (self.kernels is not None and query.dtype in codes and kv_cache.dtype in codes
                and query.stride(2) == 1 and kv_cache.is_contiguous())

    def forward(
        self,
        query: torch.Tensor,  # [T, H, D]
        key: torch.Tensor | None,  # [T, 1, D] the new tokens' latent entries
        value: torch.Tensor | None,  # unused (None)
        kv_cache: torch.Tensor,  # [num_blocks, block_size, D]
        metadata: CPUAttentionMetadata,
    ) -> torch.Tensor:  # [T, H, L]
        spec, entry = self.spec, self.entry_size
        num_tokens = query.shape[0]
        if query.dim() != 3 or query.shape[1:] != (spec.num_heads, entry):
            raise ValueError(
                f"MLA query must be [T, {spec.num_heads}, {entry}], got {tuple(query.shape)}"
            )
        if kv_cache.dim() != 3 or kv_cache.shape[1:] != (metadata.block_size, entry):
            raise ValueError(
                f"MLA cache must be [num_blocks, {metadata.block_size}, {entry}], got "
                f"{tuple(kv_cache.shape)}"
            )
        use_c = self._native(query, kv_cache)
        decode_only = metadata.decode_rows is None and not metadata.prefills
        if _capturing() and not (use_c and decode_only):
            raise GraphCaptureError(
                "MLA attention runs torch ops on the CPU here (only decode-only steps on the "
                "C kernels can be replayed)"
            )
        if use_c:
            return self._forward_native(query, key, kv_cache, metadata, decode_only)
        plan = metadata.mla_plan
        if plan is None:
            plan = metadata.mla_plan = MLAPlan.build(metadata)
        flat = kv_cache.view(-1, entry)
        if key is not None:
            self._write(flat, key, plan, num_tokens)
        compute = torch.float64 if query.dtype == torch.float64 else torch.float32
        decode_only = plan.decode_rows is None and not plan.prefills
        if decode_only and plan.decodes is not None:
            return self._decode(query, flat, plan.decodes, compute).to(query.dtype)
        out = query.new_empty(num_tokens, spec.num_heads, self.lora_rank)
        if plan.decodes is not None:
            out[plan.decode_rows] = self._decode(
                query[plan.decode_rows], flat, plan.decodes, compute
            ).to(out.dtype)
        for p in plan.prefills:
            out[p.start : p.end] = self._prefill(query[p.start : p.end], flat, p.keys, compute)
        return out

    def _forward_native(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        kv_cache: torch.Tensor,
        metadata: CPUAttentionMetadata,
        decode_only: bool,
    ) -> torch.Tensor:
        """The C store and decode kernels (prefill chunks on SDPA, over the step plan)."""
        kernels, num_tokens = self.kernels, query.shape[0]
        if key is not None:
            if key.shape != (num_tokens, 1, self.entry_size):
                raise ValueError(
                    f"MLA key must be the latent entries [T, 1, {self.entry_size}], got "
                    f"{tuple(key.shape)}"
                )
            rows = key[:, 0]
            if rows.stride(-1) != 1 or rows.dtype not in native.DTYPE_CODES:
                rows = rows.contiguous().to(kv_cache.dtype)  # eager only: a copy
            kernels.mla_write_entries(rows, metadata.slot_mapping, kv_cache)
        if decode_only:
            return self._decode_native(query, kv_cache, metadata)
        plan = metadata.mla_plan
        if plan is None:
            plan = metadata.mla_plan = MLAPlan.build(metadata)
        compute = torch.float32
        flat = kv_cache.view(-1, self.entry_size)
        out = query.new_empty(num_tokens, self.spec.num_heads, self.lora_rank)
        if metadata.num_decodes:
            out[plan.decode_rows] = self._decode_native(query[plan.decode_rows], kv_cache,
                                                        metadata)
        for p in plan.prefills:
            out[p.start : p.end] = self._prefill(query[p.start : p.end], flat, p.keys, compute)
        return out

    def _decode_native(
        self, query: torch.Tensor, kv_cache: torch.Tensor, md: CPUAttentionMetadata
    ) -> torch.Tensor:
        """Every decode's ``query`` [Rd, H, D] over its blocks in place -> [Rd, H, L]."""
        return self.kernels.mla_decode_attention(
            query, kv_cache, md.decode_block_tables, md.decode_seq_lens, self.lora_rank,
            self.spec.scale,
        )

    def _write(
        self, flat: torch.Tensor, key: torch.Tensor, plan: MLAPlan, num_tokens: int
    ) -> None:
        if key.shape != (num_tokens, 1, self.entry_size):
            raise ValueError(
                f"MLA key must be the latent entries [T, 1, {self.entry_size}], got "
                f"{tuple(key.shape)}"
            )
        rows = key[:, 0]
        if plan.write_rows is not None:
            rows = rows.index_select(0, plan.write_rows)
        if plan.write_slots.numel():
            flat.index_copy_(0, plan.write_slots, rows.to(flat.dtype))

    def _decode(
        self, query: torch.Tensor, flat: torch.Tensor, keys: _Keys, compute: torch.dtype
    ) -> torch.Tensor:
        """``query`` [Rd, H, D] over each decode's padded context -> [Rd, H, L]."""
        num_decodes, width = keys.slots.shape
        entries = flat.index_select(0, keys.slots.flatten()).to(compute)
        entries = entries.view(num_decodes, 1, width, self.entry_size)
        q = query.to(compute).unsqueeze(1)  # [Rd, 1, H, D]: the heads share the keys
        out = F.scaled_dot_product_attention(
            q, entries, entries, attn_mask=keys.bias(compute), scale=self.spec.scale
        )
        return out[:, 0, :, : self.lora_rank]

    def _prefill(
        self, query: torch.Tensor, flat: torch.Tensor, keys: _Keys, compute: torch.dtype
    ) -> torch.Tensor:
        """One chunk's ``query`` [q_len, H, D] over its context -> [q_len, H, L]."""
        num_heads = self.spec.num_heads
        entries = flat.index_select(0, keys.slots).to(compute)  # [S, D]
        # [1, H, S, D] as a stride-0 view: no copy, and SDPA stays on its fused kernel.
        entries = entries[None, None].expand(1, num_heads, -1, -1)
        q = query.to(compute).permute(1, 0, 2).unsqueeze(0)  # [1, H, q_len, D]
        bias = keys.bias(compute)
        out = F.scaled_dot_product_attention(
            q, entries, entries, attn_mask=bias, is_causal=bias is None, scale=self.spec.scale
        )
        return out[0, :, :, : self.lora_rank].permute(1, 0, 2)
