"""SmolLM3: the Llama decoder where some layers use no position embedding (NoPE).

``no_rope_layers[i]`` is 1 where layer ``i`` applies RoPE and 0 where it does not
(transformers' default: every ``no_rope_layer_interval``-th layer skips it);
``layer_types`` marks sliding-window layers.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.model_executor.layers.rotary import RopeInputs, RotaryEmbedding
from engine.model_executor.models.interface import ModelInitContext
from engine.model_executor.models.llama import (
    DecoderOptions,
    LlamaAttention,
    LlamaForCausalLM,
    config_head_size,
)


class NoPositionEmbedding(nn.Module):
    """Stands in for the rotary embedding on a NoPE layer: leaves q and k as they are."""

    def apply(self, x: torch.Tensor, rope: RopeInputs) -> torch.Tensor:
        return x


class SmolLM3Attention(LlamaAttention):
    def __init__(self, hf_config: Any, ctx: ModelInitContext, opts: DecoderOptions,
                 layer_idx: int, rotary_emb: RotaryEmbedding) -> None:
        super().__init__(hf_config, ctx, opts, layer_idx, rotary_emb)
        uses_rope = getattr(hf_config, "no_rope_layers", None)
        if uses_rope is not None and not uses_rope[layer_idx]:
            self.rotary_emb = NoPositionEmbedding()


def smollm3_windows(hf_config: Any) -> tuple[int | None, ...]:
    """The window of each layer transformers' masks give it (``layer_types``)."""
    window = getattr(hf_config, "sliding_window", None)
    types = getattr(hf_config, "layer_types", None)
    if window is None or not types:
        return ()
    return tuple(window if t == "sliding_attention" else None for t in types)


class SmolLM3ForCausalLM(LlamaForCausalLM):
    attention_cls = SmolLM3Attention

    @classmethod
    def decoder_options(cls, hf_config: Any) -> DecoderOptions:
        bias = bool(getattr(hf_config, "attention_bias", False))
        return DecoderOptions(head_size=config_head_size(hf_config), qkv_bias=bias,
                              o_proj_bias=bias, mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
                              sliding_windows=smollm3_windows(hf_config))
