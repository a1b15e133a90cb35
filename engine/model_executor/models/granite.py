"""Granite (3.x): the Llama decoder with four scalar multipliers from the config.

``embedding_multiplier`` scales the embeddings, ``residual_multiplier`` each sub-layer's
output before it joins the residual stream, ``attention_multiplier`` is the softmax scale
(instead of ``head_size ** -0.5``) and the logits are divided by ``logits_scaling``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from engine.model_executor.layers.norm import residual_norm
from engine.model_executor.layers.rotary import RopeInputs, RotaryEmbedding
from engine.model_executor.models.interface import ModelInitContext
from engine.model_executor.models.llama import (
    DecoderOptions,
    LlamaDecoderLayer,
    LlamaForCausalLM,
)


class GraniteMultipliers:
    """Granite's embedding and residual multipliers around a pre-norm layer
    (:class:`PreNormDecoderLayer`): Granite 3's Llama layers and Granite 4.0-H's attention /
    Mamba-2 layers alike. Call :meth:`init_multipliers` from ``__init__``."""

    def init_multipliers(self, hf_config: Any, layer_idx: int) -> None:
        self.residual_multiplier = float(hf_config.residual_multiplier)
        # Layer 0 receives the embeddings themselves (always on the first stage).
        self.embedding_multiplier = (float(hf_config.embedding_multiplier)
                                     if layer_idx == 0 else None)

    def forward(
        self, rope: RopeInputs, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None and self.embedding_multiplier is not None:
            hidden = hidden * self.embedding_multiplier
        hidden, residual = residual_norm(self.input_layernorm, hidden, residual)
        hidden = self.mix(rope, hidden) * self.residual_multiplier
        hidden, residual = getattr(self, self.post_norm_name)(hidden, residual)
        return getattr(self, self.mlp_name)(hidden) * self.residual_multiplier, residual


class GraniteDecoderLayer(GraniteMultipliers, LlamaDecoderLayer):
    def __init__(self, hf_config: Any, ctx: ModelInitContext, opts: DecoderOptions,
                 layer_idx: int, rotary_emb: RotaryEmbedding, make_mlp: Any = None,
                 make_attention: Any = None) -> None:
        super().__init__(hf_config, ctx, opts, layer_idx, rotary_emb, make_mlp, make_attention)
        self.init_multipliers(hf_config, layer_idx)


class GraniteForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = GraniteDecoderLayer

    @classmethod
    def decoder_options(cls, hf_config: Any) -> DecoderOptions:
        return dataclasses.replace(super().decoder_options(hf_config),
                                   attn_scale=float(hf_config.attention_multiplier))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) / self.config.logits_scaling
