"""Qwen3-Next (transformers' ``Qwen3NextForCausalLM``): gated DeltaNet and gated
full-attention layers with Qwen's sparse MoE feed-forward.

``layer_types`` says per layer: "linear_attention" (the gated DeltaNet mixer,
:mod:`engine.model_executor.layers.gated_deltanet`, a per-request state) or
"full_attention" (KV cache): ``q_proj`` yields each head's query and an output gate side
by side (``[q_h | gate_h]`` per head), q/k get per-head zero-centred RMSNorms
(``1 + weight``), RoPE covers ``partial_rotary_factor`` of each head, and the attention
output is multiplied by ``sigmoid(gate)`` before ``o_proj``. Every norm of the decoder is
the zero-centred RMSNorm. The feed-forward is Qwen2-MoE's (routed softmax top-k experts,
renormalized per ``norm_topk_prob``, plus a shared expert scaled by a sigmoid gate) on
the layers ``decoder_sparse_step`` / ``mlp_only_layers`` select, a dense MLP elsewhere.

The layer (input norm -> mixer -> + residual -> post-attention norm -> feed-forward)
and the model class are Bamba's (:mod:`engine.model_executor.models.bamba`): KV cache for
the full-attention layers only. Multi-token-prediction weights (``mtp.*``) are skipped at
load, as vLLM does without MTP speculation. Tensor parallelism splits the attention
heads (each query head with its gate) and the DeltaNet key heads (each with its value
heads); pipeline parallelism is refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from engine.model_executor.layers.gated_deltanet import GatedDeltaNetDims, GatedDeltaNetMixer
from engine.model_executor.layers.linear import QKVLinear
from engine.model_executor.layers.norm import GemmaRMSNorm
from engine.model_executor.layers.rotary import RopeInputs
from engine.model_executor.models.bamba import BambaDecoderLayer, BambaForCausalLM
from engine.model_executor.models.interface import ModelInitContext
from engine.model_executor.models.llama import DecoderOptions, LlamaAttention
from engine.model_executor.models.mixtral import Qwen2MoeForCausalLM
from engine.model_executor.models.moe_block import expert_name_mapper
from engine.model_executor.state_cache import StateCacheSpec

LINEAR, FULL = "linear_attention", "full_attention"
MTP_PREFIX = "mtp."


def layer_kinds(hf_config: Any) -> list[str]:
    """``layer_types``, checked: one of "linear_attention" / "full_attention" per layer."""
    kinds = list(hf_config.layer_types)
    if len(kinds) != hf_config.num_hidden_layers:
        raise ValueError(f"Qwen3-Next: {len(kinds)} layer_types for "
                         f"{hf_config.num_hidden_layers} layers")
    unknown = sorted(set(kinds) - {LINEAR, FULL})
    if unknown:
        raise ValueError(f"Qwen3-Next: unsupported layer types {unknown}")
    return kinds


def deltanet_dims(hf_config: Any) -> GatedDeltaNetDims:
    """The gated DeltaNet sizes of a ``Qwen3NextConfig`` (its ``linear_*`` fields)."""
    return GatedDeltaNetDims(
        hidden_size=hf_config.hidden_size,
        num_k_heads=hf_config.linear_num_key_heads,
        num_v_heads=hf_config.linear_num_value_heads,
        head_k_dim=hf_config.linear_key_head_dim,
        head_v_dim=hf_config.linear_value_head_dim,
        conv_kernel=hf_config.linear_conv_kernel_dim,
        norm_eps=hf_config.rms_norm_eps,
        activation=hf_config.hidden_act,
    )


class Qwen3NextAttention(LlamaAttention):
    """Llama's attention with the gated query projection (``2 * head_dim`` per query
    head: query, then gate) and zero-centred q/k norms."""

    def __init__(self, hf_config: Any, ctx: ModelInitContext, opts: DecoderOptions,
                 layer_idx: int, rotary_emb: Any, cache_index: int) -> None:
        super().__init__(hf_config, ctx, opts, layer_idx, rotary_emb, cache_index=cache_index)
        # The same fused q/k/v layer with twice the query rows (query and gate per head);
        # ``self.num_heads`` (the attention op's) stays the rank's query head count; a
        # rank's query rows are its heads' ``[q_h | gate_h]``, as the checkpoint lays
        # them out per head.
        prefix = f"model.layers.{layer_idx}.self_attn"
        num_heads = hf_config.num_attention_heads
        num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
        self.qkv_proj = QKVLinear(
            hf_config.hidden_size, self.head_size, 2 * num_heads, num_kv_heads,
            bias=opts.qkv_bias, **ctx.matrix_dtypes, device=ctx.device, tp=ctx.tp,
            quant_method=ctx.linear_method(*(f"{prefix}.{p}_proj" for p in "qkv")))

    @staticmethod
    def make_head_norm(head_size: int, eps: float, ctx: ModelInitContext) -> nn.Module:
        return GemmaRMSNorm(head_size, eps, dtype=ctx.dtype, device=ctx.device)

    def forward(self, rope: RopeInputs, hidden: torch.Tensor) -> torch.Tensor:
        n = hidden.shape[0]
        q_gate, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        q, gate = q_gate.view(n, self.num_heads, 2 * self.head_size).chunk(2, dim=-1)
        q = self.q_norm(q.contiguous()).reshape(n, -1)
        k = self._head_norm(k, self.k_norm)
        q, k = self.rotary_emb.apply(q, rope), self.rotary_emb.apply(k, rope)
        out = self.attn(q, k, v) * torch.sigmoid(gate.reshape(n, -1))
        return self.o_proj(out)


class Qwen3NextDecoderLayer(BambaDecoderLayer):
    """Bamba's layer (its forward) with Qwen3-Next's mixers, MoE and norms."""

    mlp_name = "mlp"
    post_norm_name = "post_attention_layernorm"

    def __init__(self, hf_config: Any, ctx: ModelInitContext, opts: DecoderOptions,
                 layer_idx: int, rotary_emb: Any, make_mlp: Any = None,
                 make_attention: Any = None) -> None:
        nn.Module.__init__(self)
        kinds = layer_kinds(hf_config)
        self.is_attention = kinds[layer_idx] == FULL
        before = kinds[:layer_idx]
        if self.is_attention:
            self.self_attn = Qwen3NextAttention(hf_config, ctx, opts, layer_idx, rotary_emb,
                                                cache_index=before.count(FULL))
        else:
            self.linear_attn = GatedDeltaNetMixer(
                deltanet_dims(hf_config), ctx, f"model.layers.{layer_idx}.linear_attn",
                before.count(LINEAR))
        _, mlp = Qwen2MoeForCausalLM.make_mlp(hf_config, ctx, opts, layer_idx)
        self.mlp = mlp
        norm = {"dtype": ctx.dtype, "device": ctx.device}
        self.input_layernorm = GemmaRMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps,
                                            **norm)
        self.post_attention_layernorm = GemmaRMSNorm(hf_config.hidden_size,
                                                     hf_config.rms_norm_eps, **norm)

    def mix(self, rope: RopeInputs, hidden: torch.Tensor) -> torch.Tensor:
        return self.self_attn(rope, hidden) if self.is_attention else self.linear_attn(hidden)


class Qwen3NextForCausalLM(BambaForCausalLM):
    """Bamba's model class with Qwen3-Next's layers and zero-centred final norm."""

    decoder_layer_cls = Qwen3NextDecoderLayer

    def __init__(self, hf_config: Any, ctx: ModelInitContext) -> None:
        super().__init__(hf_config, ctx)
        self.model.norm = GemmaRMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps,
                                       dtype=ctx.dtype, device=ctx.device)

    @classmethod
    def decoder_options(cls, hf_config: Any) -> DecoderOptions:
        return dataclasses.replace(super().decoder_options(hf_config), qk_norm=True)

    def state_cache_spec(self) -> StateCacheSpec:
        mixers = sorted((m for m in self.model.modules() if isinstance(m, GatedDeltaNetMixer)),
                        key=lambda m: m.state_index)
        return StateCacheSpec(tuple(m.state_layer_spec() for m in mixers))

    def load_name_mapper(self):
        return expert_name_mapper

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Bamba's loader, without the multi-token-prediction head (``mtp.*``)."""
        return super().load_weights((name, tensor) for name, tensor in weights
                                    if not name.startswith(MTP_PREFIX))
