"""The attention layer: a thin, device-neutral shell around the platform's kernel.

It owns no weights. At construction it asks the backend whether it can serve this
layer's shape (a clear error otherwise) and gets the per-layer kernel object; at run
time it finds this step's metadata and its own KV cache in the forward context.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.core.interfaces import AttentionBackend, AttentionLayerSpec
from engine.model_executor.forward_context import get_forward_context


class Attention(nn.Module):
    """``(q [T, H*D], k [T, Hkv*D], v [T, Hkv*D]) -> [T, H*D]`` over the paged cache."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        layer_idx: int,
        attn_backend: AttentionBackend,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        cache_index: int | None = None,
        kv_lora_rank: int | None = None,
    ) -> None:
        super().__init__()
        if num_kv_heads <= 0 or num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads ({num_heads}) must be a positive multiple of "
                f"num_kv_heads ({num_kv_heads})"
            )
        if sliding_window is not None and sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive, not {sliding_window}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.layer_idx = layer_idx
        # This layer's cache among the rank's (a pipeline stage holds only its layers').
        self.cache_index = layer_idx if cache_index is None else cache_index
        self.spec = AttentionLayerSpec(
            num_heads=num_heads,
            head_size=head_size,
            num_kv_heads=num_kv_heads,
            scale=scale,
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
            kv_lora_rank=kv_lora_rank,
        )
        why = attn_backend.validate(self.spec, attn_backend.block_size)
        if why is not None:
            raise ValueError(
                f"attention backend {attn_backend.name!r} cannot run layer {layer_idx}: {why}"
            )
        self.impl = attn_backend.make_impl(self.spec)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None) -> torch.Tensor:
        """MHA: ``[T, H*D]`` out. MLA (``kv_lora_rank`` set): ``q [T, H*D]`` absorbed
        queries, ``k [T, D]`` latent entries, no ``v``; ``[T, H, kv_lora_rank]`` out."""
        ctx = get_forward_context()
        num_tokens = q.shape[0]
        if self.spec.is_mla:
            return self.impl.forward(
                q.view(num_tokens, self.num_heads, self.head_size),
                k.view(num_tokens, 1, self.head_size), None,
                ctx.kv_caches[self.cache_index], ctx.attn_metadata,
            )
        out = self.impl.forward(
            q.view(num_tokens, self.num_heads, self.head_size),
            k.view(num_tokens, self.num_kv_heads, self.head_size),
            v.view(num_tokens, self.num_kv_heads, self.head_size),
            ctx.kv_caches[self.cache_index],
            ctx.attn_metadata,
        )
        return out.reshape(num_tokens, self.num_heads * self.head_size)

    def extra_repr(self) -> str:
        return (
            f"layer={self.layer_idx}, heads={self.num_heads}, kv_heads={self.num_kv_heads}, "
            f"head_size={self.head_size}, window={self.spec.sliding_window}"
        )
