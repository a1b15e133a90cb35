"""GLM-4 (0414): the Llama decoder with sandwich norms and half-rotated, interleaved RoPE.

- Each sub-layer's output is RMS-normed again before it joins the residual stream
  (``post_self_attn_layernorm``, ``post_mlp_layernorm``).
- RoPE rotates the first ``partial_rotary_factor`` (default 1/2) of each head in the
  GPT-J convention (interleaved pairs), see :class:`PartialRotaryEmbedding`.
- q / k / v carry biases (``attention_bias``), ``o_proj`` none; the checkpoint's
  ``mlp.gate_up_proj`` is fused (cut at load time, as for Phi-3).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from engine.model_executor.layers.norm import RMSNorm, residual_norm
from engine.model_executor.layers.rotary import RopeInputs, RotaryEmbedding
from engine.model_executor.models.interface import ModelInitContext
from engine.model_executor.models.llama import (
    DecoderOptions,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    config_head_size,
)
from engine.model_executor.models.phi3 import config_rotary, gate_up_split, unfuse_checkpoint


class Glm4DecoderLayer(LlamaDecoderLayer):
    def __init__(self, hf_config: Any, ctx: ModelInitContext, opts: DecoderOptions,
                 layer_idx: int, rotary_emb: RotaryEmbedding, make_mlp: Any = None,
                 make_attention: Any = None) -> None:
        super().__init__(hf_config, ctx, opts, layer_idx, rotary_emb, make_mlp, make_attention)
        norm = {"dtype": ctx.dtype, "device": ctx.device, "fused_ops": ctx.fused_ops}
        eps = hf_config.rms_norm_eps
        self.post_self_attn_layernorm = RMSNorm(hf_config.hidden_size, eps, **norm)
        self.post_mlp_layernorm = RMSNorm(hf_config.hidden_size, eps, **norm)

    def forward(
        self, rope: RopeInputs, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = residual_norm(self.input_layernorm, hidden, residual)
        hidden = self.post_self_attn_layernorm(self.self_attn(rope, hidden))
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.post_mlp_layernorm(getattr(self, self.mlp_name)(hidden)), residual


class Glm4ForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = Glm4DecoderLayer

    @classmethod
    def decoder_options(cls, hf_config: Any) -> DecoderOptions:
        return DecoderOptions(head_size=config_head_size(hf_config),
                              qkv_bias=bool(getattr(hf_config, "attention_bias", True)))

    @staticmethod
    def make_rotary(hf_config: Any, ctx: ModelInitContext, opts: DecoderOptions
                    ) -> RotaryEmbedding:
        return config_rotary(hf_config, ctx, opts.head_size, interleaved=True)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(unfuse_checkpoint(weights, (gate_up_split(self.config),)))
