"""Granite 4.0-H (transformers' ``GraniteMoeHybridForCausalLM``), its dense form:
Bamba's attention / Mamba-2 layers with Granite's multipliers.

``embedding_multiplier`` scales the embeddings, ``residual_multiplier`` each sub-layer's
output, ``attention_multiplier`` is the softmax scale and logits are divided by
``logits_scaling``; the MLP is ``shared_mlp`` (one fused ``input_linear`` [gate; up],
``output_linear``); attention layers use RoPE only with ``position_embedding_type ==
"rope"`` (Granite 4.0-H itself uses none). Checkpoints with routed experts
(``num_local_experts`` > 0) are refused for now.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from engine.model_executor.layers.mamba2 import Mamba2Dims
from engine.model_executor.layers.rotary import RopeInputs, rotary_for_config
from engine.model_executor.models.bamba import (
    BambaDecoderLayer,
    BambaForCausalLM,
    bamba_mamba_dims,
)
from engine.model_executor.models.interface import ModelInitContext
from engine.model_executor.models.llama import DecoderOptions, LlamaMLP

_ATTENTION = ("attention", "full_attention")


def granite_attention_layers(hf_config: Any) -> list[int]:
    return [i for i, kind in enumerate(hf_config.layer_types) if kind in _ATTENTION]


def granite_mamba_dims(hf_config: Any) -> Mamba2Dims:
    return bamba_mamba_dims(hf_config)  # the same mamba_* fields


class NoRotary(nn.Module):
    """Attention without positions (``position_embedding_type`` not "rope")."""

    def prepare(self, positions: torch.Tensor) -> None:
        return None

    def apply(self, x: torch.Tensor, rope: Any) -> torch.Tensor:
        return x


class _SharedMLP(LlamaMLP):
    """``shared_mlp``: the gated MLP of ``shared_intermediate_size``."""

    def __init__(self, hf_config: Any, ctx: ModelInitContext, opts: DecoderOptions,
                 prefix: str) -> None:
        super().__init__(hf_config, ctx, opts, prefix,
                         intermediate_size=hf_config.shared_intermediate_size)


class GraniteMoeHybridDecoderLayer(BambaDecoderLayer):
    mlp_name = "shared_mlp"
    post_norm_name = "post_attention_layernorm"
    attention_layers = staticmethod(granite_attention_layers)
    mamba_dims = staticmethod(granite_mamba_dims)
    make_mlp = staticmethod(_SharedMLP)

    def __init__(self, hf_config: Any, ctx: ModelInitContext, opts: DecoderOptions,
                 layer_idx: int, rotary_emb: Any, make_mlp: Any = None,
                 make_attention: Any = None) -> None:
        super().__init__(hf_config, ctx, opts, layer_idx, rotary_emb)
        self.residual_multiplier = float(hf_config.residual_multiplier)
        self.embedding_multiplier = (float(hf_config.embedding_multiplier)
                                     if layer_idx == 0 else None)

    def forward(self, rope: RopeInputs, hidden: torch.Tensor, residual: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            if self.embedding_multiplier is not None:
                hidden = hidden * self.embedding_multiplier
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.mix(rope, hidden) * self.residual_multiplier
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.shared_mlp(hidden) * self.residual_multiplier, residual


class GraniteMoeHybridForCausalLM(BambaForCausalLM):
    decoder_layer_cls = GraniteMoeHybridDecoderLayer

    def __init__(self, hf_config: Any, ctx: ModelInitContext) -> None:
        if getattr(hf_config, "num_local_experts", 0):
            raise ValueError("GraniteMoeHybridForCausalLM with routed experts "
                             f"(num_local_experts={hf_config.num_local_experts}) is not "
                             "supported yet; the dense form (0 experts) is")
        super().__init__(hf_config, ctx)

    @classmethod
    def decoder_options(cls, hf_config: Any) -> DecoderOptions:
        return dataclasses.replace(super().decoder_options(hf_config),
                                   attn_scale=float(hf_config.attention_multiplier))

    @staticmethod
    def _rotary(hf_config: Any, ctx: ModelInitContext, opts: DecoderOptions) -> Any:
        if getattr(hf_config, "position_embedding_type", None) != "rope":
            return NoRotary()
        return rotary_for_config(hf_config, opts.head_size, dtype=ctx.dtype, device=ctx.device,
                                 fused_ops=ctx.fused_ops)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) / self.config.logits_scaling

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """``shared_mlp.input_linear`` split into the gate and up halves it fuses,
        ``output_linear`` as the down projection."""
        def renamed() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if ".shared_mlp.input_linear." in name:
                    half = tensor.shape[0] // 2  # a lazy tensor: narrow, not chunk
                    yield name.replace(".input_linear.", ".gate_proj."), tensor.narrow(0, 0, half)
                    yield name.replace(".input_linear.", ".up_proj."), tensor.narrow(0, half, half)
                else:
                    yield name.replace(".shared_mlp.output_linear.", ".shared_mlp.down_proj."), tensor

        return super().load_weights(renamed())
