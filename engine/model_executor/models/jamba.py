"""Jamba (AI21, transformers' ``JambaForCausalLM``): Bamba's layer layout with Mamba-1
mixers and mixture-of-experts feed-forward blocks.

Layer ``i`` is attention where ``i % attn_layer_period == attn_layer_offset``, a Mamba-1
mixer with RMSNorms on its time step, B and C elsewhere; its feed-forward is a sparse
MoE (softmax top-k, weights not renormalized; checkpoint ``router`` -> the block's
``gate``) where ``i % expert_layer_period == expert_layer_offset`` and
``num_experts > 1``, else a gated MLP. Attention uses no position embedding. The layer
(input norm -> mixer -> + residual -> ``pre_ff_layernorm`` -> feed-forward -> + residual)
and the model class are Bamba's (:mod:`engine.model_executor.models.bamba`): KV cache for
the attention layers only, per-request states for the Mamba layers. Tensor parallelism
splits the Mamba-1 channels (:mod:`engine.model_executor.layers.mamba1`); pipeline
parallelism is refused.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from engine.model_executor.layers.fused_moe import RouterConfig
from engine.model_executor.layers.mamba1 import Mamba1Dims, Mamba1Mixer
from engine.model_executor.layers.mamba2 import ssm_cache_dtype
from engine.model_executor.layers.norm import RMSNorm
from engine.model_executor.layers.rotary import RopeInputs
from engine.model_executor.models.bamba import BambaDecoderLayer, BambaForCausalLM
from engine.model_executor.models.interface import ModelInitContext
from engine.model_executor.models.llama import DecoderOptions, LlamaAttention, LlamaMLP
from engine.model_executor.models.moe_block import SparseMoeBlock, expert_name_mapper
from engine.model_executor.models.smollm3 import NoPositionEmbedding


def jamba_mamba_dims(hf_config: Any) -> Mamba1Dims:
    """The Mamba-1 mixer sizes of a ``JambaConfig`` (its ``mamba_*`` fields)."""
    return Mamba1Dims(
        hidden_size=hf_config.hidden_size,
        intermediate_size=int(hf_config.mamba_expand * hf_config.hidden_size),
        d_state=hf_config.mamba_d_state,
        d_conv=hf_config.mamba_d_conv,
        dt_rank=int(hf_config.mamba_dt_rank),
        use_bias=bool(hf_config.mamba_proj_bias),
        use_conv_bias=bool(hf_config.mamba_conv_bias),
        activation=hf_config.hidden_act,
        bcdt_norm_eps=hf_config.rms_norm_eps,
        ssm_state_dtype=ssm_cache_dtype(hf_config),
    )


def is_attention_layer(hf_config: Any, layer_idx: int) -> bool:
    return layer_idx % hf_config.attn_layer_period == hf_config.attn_layer_offset


def is_moe_layer(hf_config: Any, layer_idx: int) -> bool:
    return (hf_config.num_experts > 1
            and layer_idx % hf_config.expert_layer_period == hf_config.expert_layer_offset)


class NoRope(NoPositionEmbedding):
    """Jamba's attention has no position embedding: nothing to prepare, nothing to apply."""

    def prepare(self, positions: torch.Tensor) -> RopeInputs:
        return RopeInputs(positions)


class JambaDecoderLayer(BambaDecoderLayer):
    """Bamba's layer (its forward and names) with Jamba's mixers and feed-forward blocks."""

    def __init__(self, hf_config: Any, ctx: ModelInitContext, opts: DecoderOptions,
                 layer_idx: int, rotary_emb: Any, make_mlp: Any = None,
                 make_attention: Any = None) -> None:
        nn.Module.__init__(self)
        self.is_attention = is_attention_layer(hf_config, layer_idx)
        attn_before = sum(is_attention_layer(hf_config, i) for i in range(layer_idx))
        if self.is_attention:
            self.self_attn = LlamaAttention(hf_config, ctx, opts, layer_idx, rotary_emb,
                                            cache_index=attn_before)
        else:
            self.mamba = Mamba1Mixer(jamba_mamba_dims(hf_config), ctx,
                                     f"model.layers.{layer_idx}.mamba",
                                     layer_idx - attn_before)
        if is_moe_layer(hf_config, layer_idx):
            router = RouterConfig(hf_config.num_experts, hf_config.num_experts_per_tok,
                                  renormalize=False)
            mlp = SparseMoeBlock(hf_config, ctx, router, hf_config.intermediate_size)
        else:
            mlp = LlamaMLP(hf_config, ctx, opts, f"model.layers.{layer_idx}.{self.mlp_name}")
        self.add_module(self.mlp_name, mlp)
        norms = {"dtype": ctx.dtype, "device": ctx.device, "fused_ops": ctx.fused_ops}
        for name in ("input_layernorm", self.post_norm_name):
            self.add_module(name, RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps,
                                          **norms))


class JambaForCausalLM(BambaForCausalLM):
    """Bamba's model class (KV cache for the attention layers, states for the Mamba
    layers) with Jamba's layers, no rotary embedding and expert weights."""

    decoder_layer_cls = JambaDecoderLayer

    @staticmethod
    def _rotary(hf_config: Any, ctx: ModelInitContext, opts: DecoderOptions) -> NoRope:
        return NoRope()

    def load_name_mapper(self):
        return expert_name_mapper

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Bamba's loader with the MoE router under the block's name (``gate``)."""
        return super().load_weights(
            (name.replace(".feed_forward.router.", ".feed_forward.gate."), tensor)
            for name, tensor in weights)
