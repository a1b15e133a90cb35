"""The attention layer: a thin, device-neutral shell around the platform's kernel.

It owns no weights but two optional float32 scalars, ``k_scale`` and ``v_scale``: the
scales of an fp8 KV cache (vLLM's names; a checkpoint without them leaves 1.0, and a
cache of the model dtype ignores them; weight_utils maps the checkpoint spellings). At
construction it asks the backend whether it can serve this layer's shape and cache
dtype (a clear error otherwise) and gets the per-layer kernel object, which it hands the
scales once they are loaded; at run time it finds this step's metadata and its own KV
cache in the forward context.

Learned attention sinks (GPT-OSS, ``use_sinks``): the layer also owns ``sinks``, float32
``[num_heads]`` (this rank's query heads). The checkpoint holds one logit per head of the
whole model; the weight loader keeps this tensor-parallel rank's slice, heads
``sinks_head_offset ..`` (a rank's heads are consecutive: ``tp_rank * num_heads``, as
QKVLinear splits them), and hands it to the kernel object (``impl.sinks``). Chunked
local attention (Llama 4, ``attention_chunk_size``) is a property of the spec alone.
"""

from __future__ import annotations

import math
from typing import Any

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
        causal: bool = True,
        attention_chunk_size: int | None = None,
        use_sinks: bool = False,
        sinks_head_offset: int = 0,
    ) -> None:
        """``num_heads`` / ``num_kv_heads``: this rank's. ``sinks_head_offset``: the first
        of this rank's query heads in the checkpoint's numbering (``tp_rank * num_heads``),
        where the rank's slice of the checkpoint's sinks starts."""
        super().__init__()
        if num_kv_heads <= 0 or num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads ({num_heads}) must be a positive multiple of "
                f"num_kv_heads ({num_kv_heads})"
            )
        if sliding_window is not None and sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive, not {sliding_window}")
        if attention_chunk_size is not None and attention_chunk_size <= 0:
            raise ValueError(f"attention_chunk_size must be positive, not "
                             f"{attention_chunk_size}")
        if sinks_head_offset < 0:
            raise ValueError(f"sinks_head_offset must be >= 0, not {sinks_head_offset}")
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
            kv_cache_dtype=getattr(attn_backend, "kv_cache_dtype", "auto"),
            causal=causal,
            attention_chunk_size=attention_chunk_size,
            use_sinks=use_sinks,
        )
        why = attn_backend.validate(self.spec, attn_backend.block_size)
        if why is not None:
            raise ValueError(
                f"attention backend {attn_backend.name!r} cannot run layer {layer_idx}: {why}"
            )
        self.impl = attn_backend.make_impl(self.spec)
        device = getattr(attn_backend, "device", None)
        self.k_scale = self._kv_scale_parameter(device)
        self.v_scale = self._kv_scale_parameter(device)
        self.sinks_head_offset = sinks_head_offset
        self._sinks_loaded = False
        if use_sinks:  # the checkpoint must provide them (no optional_weight)
            self.sinks = nn.Parameter(torch.zeros(num_heads, dtype=torch.float32,
                                                  device=device), requires_grad=False)
            self.sinks.weight_loader = self._load_sinks
        else:
            self.sinks = None

    def _kv_scale_parameter(self, device: Any) -> nn.Parameter:
        """A float32 scalar the checkpoint may fill (``optional_weight``), 1.0 otherwise."""
        param = nn.Parameter(torch.ones((), dtype=torch.float32, device=device),
                             requires_grad=False)
        param.weight_loader = self._load_kv_scale
        param.optional_weight = True
        return param

    def _load_kv_scale(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        from engine.model_executor.lazy_tensor import materialize

        if shard_id is not None:
            raise ValueError(f"a KV cache scale has no shard {shard_id!r}")
        value = materialize(loaded)
        if value.numel() != 1:
            raise ValueError(f"KV cache scales are per layer (one value), not "
                             f"{tuple(value.shape)} (per-head scales are not supported)")
        param.copy_(value.reshape(()).to(torch.float32))
        self.process_weights_after_loading()

    def _load_sinks(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        """The checkpoint's sinks of every head ``[total_heads]``: keep this rank's
        ``num_heads`` from ``sinks_head_offset`` (a tensor of exactly this rank's heads,
        offset 0, is taken whole)."""
        from engine.model_executor.lazy_tensor import materialize

        if shard_id is not None:
            raise ValueError(f"attention sinks have no shard {shard_id!r}")
        value = materialize(loaded)
        first, count = self.sinks_head_offset, self.num_heads
        if value.dim() != 1 or value.shape[0] < first + count:
            raise ValueError(
                f"attention layer {self.layer_idx}: the checkpoint's sinks must be one logit "
                f"per query head [total_heads], at least {first + count} for this rank's "
                f"heads {first}..{first + count - 1}, not shape {tuple(value.shape)}")
        param.copy_(value[first:first + count].to(torch.float32))
        self._sinks_loaded = True
        self.process_weights_after_loading()

    def process_weights_after_loading(self) -> None:
        """Hand the (loaded or default) scales to the kernel object as floats, and the
        sinks (once loaded) as a float32 tensor."""
        if self.sinks is not None and self._sinks_loaded:
            if not bool((torch.isfinite(self.sinks) | torch.isneginf(self.sinks)).all()):
                raise ValueError(f"attention layer {self.layer_idx}: sinks must not be NaN "
                                 "or +inf")
            self.impl.sinks = self.sinks.data
        scales = {"k_scale": float(self.k_scale), "v_scale": float(self.v_scale)}
        for name, value in scales.items():
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"attention layer {self.layer_idx}: {name} must be a "
                                 f"positive finite number, not {value}")
        self.impl.k_scale, self.impl.v_scale = scales["k_scale"], scales["v_scale"]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None) -> torch.Tensor:
        """MHA: ``[T, H*D]`` out. MLA (``kv_lora_rank`` set): ``q [T, H*D]`` absorbed
        queries, ``k [T, D]`` latent entries, no ``v``; ``[T, H, kv_lora_rank]`` out."""
        ctx = get_forward_context()
        num_tokens = q.shape[0]
        connector = ctx.kv_connector
        if connector is not None:
            connector.wait_for_layer_load(self.cache_index)
        # An encoder layer keeps no cache (the model reports no KV layers for it).
        cache = ctx.kv_caches[self.cache_index] if self.spec.causal else None
        metadata = ctx.metadata_for(self.cache_index)
        if self.spec.is_mla:
            out = self.impl.forward(
                q.view(num_tokens, self.num_heads, self.head_size),
                k.view(num_tokens, 1, self.head_size), None, cache, metadata,
            )
        else:
            out = self.impl.forward(
                q.view(num_tokens, self.num_heads, self.head_size),
                k.view(num_tokens, self.num_kv_heads, self.head_size),
                v.view(num_tokens, self.num_kv_heads, self.head_size),
                cache,
                metadata,
            ).reshape(num_tokens, self.num_heads * self.head_size)
        if connector is not None:
            connector.save_kv_layer(self.cache_index, cache, metadata)
        return out

    def extra_repr(self) -> str:
        return (
            f"layer={self.layer_idx}, heads={self.num_heads}, kv_heads={self.num_kv_heads}, "
            f"head_size={self.head_size}, window={self.spec.sliding_window}"
            + ("" if self.spec.attention_chunk_size is None else
               f", chunk={self.spec.attention_chunk_size}")
            + (", sinks" if self.spec.use_sinks else "")
            + ("" if self.spec.kv_cache_dtype == "auto" else
               f", kv_cache={self.spec.kv_cache_dtype} (k_scale={self.impl.k_scale:g}, "
               f"v_scale={self.impl.v_scale:g})")
        )
