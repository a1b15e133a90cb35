"""Bamba (transformers' ``BambaForCausalLM``): Llama-style decoder layers whose mixer is
either attention (the layers in ``attn_layer_indices``) or a Mamba-2 mixer (all others).

Each layer: ``input_layernorm`` -> attention or Mamba-2 -> + residual ->
``pre_ff_layernorm`` -> gated MLP (``feed_forward``) -> + residual; RoPE on half of each
attention head (``partial_rotary_factor`` 0.5). Only the attention layers hold KV cache
(their cache indices count attention layers only); the Mamba layers keep per-request
states (:mod:`engine.model_executor.state_cache`), so a long request holds KV blocks for
a few layers only. Tensor parallelism splits the attention heads as Llama's and the
Mamba-2 heads / groups as the mixer does; pipeline parallelism is refused.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from engine.model_executor.layers.mamba2 import (
    Mamba2Dims,
    Mamba2Mixer,
    dt_limit_of,
    ssm_cache_dtype,
)
from engine.model_executor.layers.norm import RMSNorm
from engine.model_executor.layers.rotary import RopeInputs, rotary_for_config
from engine.model_executor.models.interface import ModelInitContext, ModelKVSpec
from engine.model_executor.models.llama import (
    DecoderOptions,
    LlamaAttention,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    PreNormDecoderLayer,
)
from engine.model_executor.state_cache import StateCacheSpec


def bamba_mamba_dims(hf_config: Any) -> Mamba2Dims:
    """The Mamba-2 mixer sizes of a ``BambaConfig`` (its ``mamba_*`` fields)."""
    return Mamba2Dims(
        hidden_size=hf_config.hidden_size,
        num_heads=hf_config.mamba_n_heads,
        head_dim=hf_config.mamba_d_head,
        n_groups=hf_config.mamba_n_groups,
        d_state=hf_config.mamba_d_state,
        d_conv=hf_config.mamba_d_conv,
        intermediate_size=int(hf_config.mamba_expand * hf_config.hidden_size),
        use_bias=bool(hf_config.mamba_proj_bias),
        use_conv_bias=bool(hf_config.mamba_conv_bias),
        chunk_size=hf_config.mamba_chunk_size,
        norm_eps=hf_config.rms_norm_eps,
        dt_limit=dt_limit_of(hf_config),
        activation=hf_config.hidden_act,
        ssm_state_dtype=ssm_cache_dtype(hf_config),
    )


def attention_layers(hf_config: Any) -> list[int]:
    """Indices of the attention layers (the rest are Mamba-2 layers)."""
    return sorted(set(getattr(hf_config, "attn_layer_indices", None) or ()))


class BambaDecoderLayer(PreNormDecoderLayer):
    """Attention or Mamba-2, then the MLP (LlamaModel's layer interface). Subclasses
    name the MLP and the second norm as their checkpoints do."""

    mlp_name = "feed_forward"
    post_norm_name = "pre_ff_layernorm"

    def __init__(self, hf_config: Any, ctx: ModelInitContext, opts: DecoderOptions,
                 layer_idx: int, rotary_emb: Any, make_mlp: Any = None,
                 make_attention: Any = None) -> None:
        super().__init__()
        attn = self.attention_layers(hf_config)
        self.is_attention = layer_idx in attn
        if self.is_attention:
            self.self_attn = LlamaAttention(hf_config, ctx, opts, layer_idx, rotary_emb,
                                            cache_index=attn.index(layer_idx))
        else:
            state_index = layer_idx - sum(1 for i in attn if i < layer_idx)
            self.mamba = Mamba2Mixer(self.mamba_dims(hf_config), ctx,
                                     f"model.layers.{layer_idx}.mamba", state_index)
        self.add_module(self.mlp_name, self.make_mlp(
            hf_config, ctx, opts, f"model.layers.{layer_idx}.{self.mlp_name}"))
        common = {"dtype": ctx.dtype, "device": ctx.device, "fused_ops": ctx.fused_ops}
        eps = hf_config.rms_norm_eps
        self.input_layernorm = RMSNorm(hf_config.hidden_size, eps, **common)
        self.add_module(self.post_norm_name, RMSNorm(hf_config.hidden_size, eps, **common))

    attention_layers = staticmethod(attention_layers)
    mamba_dims = staticmethod(bamba_mamba_dims)

    @staticmethod
    def make_mlp(hf_config: Any, ctx: ModelInitContext, opts: DecoderOptions,
                 prefix: str) -> nn.Module:
        return LlamaMLP(hf_config, ctx, opts, prefix)

    def mix(self, rope: RopeInputs, hidden: torch.Tensor) -> torch.Tensor:
        return self.self_attn(rope, hidden) if self.is_attention else self.mamba(hidden)


class BambaForCausalLM(LlamaForCausalLM):
    supports_pipeline_parallel = False
    decoder_layer_cls = BambaDecoderLayer

    def __init__(self, hf_config: Any, ctx: ModelInitContext) -> None:
        nn.Module.__init__(self)
        if ctx.linear_method("lm_head") is not None:
            raise ValueError("checkpoints with a quantized lm_head are not supported")
        self.config = hf_config
        self.opts = self.decoder_options(hf_config)
        self.vocab_size = hf_config.vocab_size
        self.head_size = self.opts.head_size
        self.activation_dtype = ctx.dtype
        self.model = LlamaModel(hf_config, ctx, self.opts, make_layer=self.decoder_layer_cls,
                                make_rotary=self._rotary)
        self.stage_layers = self.model.stage_layers
        attn = [layer for layer in self.model.layers if layer.is_attention]
        self.num_layers = len(attn)  # KV cache layers: the attention layers only
        self.num_kv_heads = attn[0].self_attn.num_kv_heads if attn else 1
        self.init_lm_head(hf_config, ctx)

    @staticmethod
    def _rotary(hf_config: Any, ctx: ModelInitContext, opts: DecoderOptions) -> Any:
        return rotary_for_config(hf_config, opts.head_size, dtype=ctx.dtype, device=ctx.device,
                                 fused_ops=ctx.fused_ops)

    def kv_cache_spec(self) -> ModelKVSpec:
        return ModelKVSpec(self.num_layers, self.num_kv_heads, self.head_size,
                           (None,) * self.num_layers)

    def state_cache_spec(self) -> StateCacheSpec:
        return StateCacheSpec(tuple(layer.mamba.state_layer_spec()
                                    for layer in self.model.layers if not layer.is_attention))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Llama's loader with Bamba's final norm name."""
        return super().load_weights(
            (name.replace("model.final_layernorm.", "model.norm."), tensor)
            for name, tensor in weights)
