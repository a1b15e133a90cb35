"""Mixtral and the Qwen MoE models: the Llama decoder with sparse MoE feed-forward blocks.

- ``MixtralForCausalLM``: every layer's ``block_sparse_moe`` (softmax top-k, renormalized).
- ``Qwen2MoeForCausalLM``: q/k/v biases; MoE layers (``decoder_sparse_step``,
  ``mlp_only_layers``) with a shared expert scaled by a sigmoid gate; ``norm_topk_prob``.
- ``Qwen3MoeForCausalLM``: Qwen3's per-head q/k norm; MoE layers without shared experts.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from engine.model_executor.layers.fused_moe import RouterConfig
from engine.model_executor.models.interface import ModelInitContext
from engine.model_executor.models.llama import (
    DecoderOptions,
    LlamaForCausalLM,
    LlamaMLP,
    MistralForCausalLM,
    config_head_size,
    layer_type_windows,
)
from engine.model_executor.models.moe_block import SparseMoeBlock, expert_name_mapper
from engine.model_executor.models.qwen3 import Qwen3ForCausalLM


class MixtralForCausalLM(MistralForCausalLM):
    @classmethod
    def make_mlp(cls, hf_config: Any, ctx: ModelInitContext, opts: DecoderOptions,
                 layer_idx: int) -> tuple[str, nn.Module]:
        router = RouterConfig(hf_config.num_local_experts, hf_config.num_experts_per_tok)
        return "block_sparse_moe", SparseMoeBlock(hf_config, ctx, router,
                                                  hf_config.intermediate_size)

    def load_name_mapper(self):
        return expert_name_mapper


def is_qwen_moe_layer(hf_config: Any, layer_idx: int) -> bool:
    """Qwen-MoE's rule for which layers are sparse."""
    return (layer_idx not in (getattr(hf_config, "mlp_only_layers", None) or [])
            and hf_config.num_experts > 0
            and (layer_idx + 1) % getattr(hf_config, "decoder_sparse_step", 1) == 0)


def qwen_router(hf_config: Any) -> RouterConfig:
    return RouterConfig(hf_config.num_experts, hf_config.num_experts_per_tok,
                        renormalize=bool(getattr(hf_config, "norm_topk_prob", False)))


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_options(cls, hf_config: Any) -> DecoderOptions:
        return DecoderOptions(
            head_size=config_head_size(hf_config),
            qkv_bias=bool(getattr(hf_config, "qkv_bias", True)),
            sliding_windows=layer_type_windows(hf_config),
        )

    @classmethod
    def make_mlp(cls, hf_config: Any, ctx: ModelInitContext, opts: DecoderOptions,
                 layer_idx: int) -> tuple[str, nn.Module]:
        prefix = f"model.layers.{layer_idx}.mlp"
        if not is_qwen_moe_layer(hf_config, layer_idx):
            return "mlp", LlamaMLP(hf_config, ctx, opts, prefix)
        shared_size = getattr(hf_config, "shared_expert_intermediate_size", 0) or 0
        shared = (lambda: LlamaMLP(hf_config, ctx, opts, f"{prefix}.shared_expert", shared_size,
                                   reduce_results=False)) if shared_size else None
        return "mlp", SparseMoeBlock(hf_config, ctx, qwen_router(hf_config),
                                     hf_config.moe_intermediate_size, shared_expert=shared,
                                     shared_expert_gate=shared is not None)

    def load_name_mapper(self):
        return expert_name_mapper


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    @classmethod
    def make_mlp(cls, hf_config: Any, ctx: ModelInitContext, opts: DecoderOptions,
                 layer_idx: int) -> tuple[str, nn.Module]:
        prefix = f"model.layers.{layer_idx}.mlp"
        if not is_qwen_moe_layer(hf_config, layer_idx):
            return "mlp", LlamaMLP(hf_config, ctx, opts, prefix)
        return "mlp", SparseMoeBlock(hf_config, ctx, qwen_router(hf_config),
                                     hf_config.moe_intermediate_size)

    def load_name_mapper(self):
        return expert_name_mapper
