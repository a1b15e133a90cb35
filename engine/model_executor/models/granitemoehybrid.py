"""Granite 4.0-H (transformers' ``GraniteMoeHybridForCausalLM``), its dense form:
Bamba's attention / Mamba-2 layers with Granite's multipliers.

``embedding_multiplier`` scales the embeddings, ``residual_multiplier`` each sub-layer's
output, ``attention_multiplier`` is the softmax scale and logits are divided by
``logits_scaling``; the MLP is ``shared_mlp`` (one fused ``input_linear`` [gate; up],
``output_linear``); attention layers use RoPE only with ``position_embedding_type ==
"rope"`` (Granite 4.0-H itself uses none). With routed experts (``num_local_experts``
> 0) each layer's ``block_sparse_moe`` adds them (softmax over the top-k router logits) to
the shared MLP: the engine's :class:`SparseMoeBlock` with ``shared_mlp`` as its shared
expert; the checkpoint's stacked ``input_linear`` [E, 2I, H] / ``output_linear`` load
per expert.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from engine.model_executor.layers.fused_moe import RouterConfig
from engine.model_executor.layers.mamba2 import Mamba2Dims
from engine.model_executor.layers.rotary import rotary_for_config
from engine.model_executor.lazy_tensor import materialize
from engine.model_executor.models.bamba import (
    BambaDecoderLayer,
    BambaForCausalLM,
    bamba_mamba_dims,
)
from engine.model_executor.models.granite import GraniteMultipliers
from engine.model_executor.models.interface import ModelInitContext
from engine.model_executor.models.llama import DecoderOptions, LlamaMLP
from engine.model_executor.models.moe_block import SparseMoeBlock, expert_name_mapper

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
                 prefix: str, reduce_results: bool = True) -> None:
        super().__init__(hf_config, ctx, opts, prefix,
                         intermediate_size=hf_config.shared_intermediate_size,
                         reduce_results=reduce_results)


class GraniteMoeHybridDecoderLayer(GraniteMultipliers, BambaDecoderLayer):
    mlp_name = "shared_mlp"
    post_norm_name = "post_attention_layernorm"
    attention_layers = staticmethod(granite_attention_layers)
    mamba_dims = staticmethod(granite_mamba_dims)
    make_mlp = staticmethod(_SharedMLP)

    def __init__(self, hf_config: Any, ctx: ModelInitContext, opts: DecoderOptions,
                 layer_idx: int, rotary_emb: Any, make_mlp: Any = None,
                 make_attention: Any = None) -> None:
        super().__init__(hf_config, ctx, opts, layer_idx, rotary_emb)
        self.init_multipliers(hf_config, layer_idx)


def _moe_block(hf_config: Any, ctx: ModelInitContext, opts: DecoderOptions,
               prefix: str) -> nn.Module:
    """``block_sparse_moe`` (routed experts) with ``shared_mlp`` inside it, summed (under
    TP the shared MLP's partial sums join the routed experts' in the block's one
    all-reduce)."""
    shared_prefix = prefix.rsplit(".", 1)[0] + ".shared_mlp"
    router = RouterConfig(hf_config.num_local_experts, hf_config.num_experts_per_tok)
    return SparseMoeBlock(hf_config, ctx, router, hf_config.intermediate_size,
                          shared_expert=lambda: _SharedMLP(hf_config, ctx, opts, shared_prefix,
                                                           reduce_results=False),
                          shared_expert_name="shared_mlp")


class GraniteMoeHybridMoELayer(GraniteMoeHybridDecoderLayer):
    """A layer with routed experts."""

    mlp_name = "block_sparse_moe"
    make_mlp = staticmethod(_moe_block)


def granite_layer(hf_config: Any, ctx: ModelInitContext, opts: DecoderOptions,
                  layer_idx: int, rotary_emb: Any, make_mlp: Any = None,
                  make_attention: Any = None) -> GraniteMoeHybridDecoderLayer:
    """The dense or the MoE layer, as the config has routed experts or not."""
    cls = (GraniteMoeHybridMoELayer if getattr(hf_config, "num_local_experts", 0)
           else GraniteMoeHybridDecoderLayer)
    return cls(hf_config, ctx, opts, layer_idx, rotary_emb)


def _expert_tensors(name: str, tensor: Any) -> Iterable[tuple[str, Any]]:
    """A MoE layer's checkpoint tensors under the names the engine's MoE block loads:
    the router, each expert's gate / up / down, the shared MLP inside the block."""
    prefix, _, rest = name.partition(".block_sparse_moe.")
    if not rest:
        yield name.replace(".shared_mlp.", ".block_sparse_moe.shared_mlp."), tensor
    elif rest == "router.layer.weight":
        yield f"{prefix}.block_sparse_moe.gate.weight", tensor
    else:
        parts = (("gate_proj", "up_proj") if rest == "input_linear.weight"
                 else ("down_proj",))
        for e in range(tensor.shape[0]):
            halves = materialize(tensor.narrow(0, e, 1))[0].chunk(len(parts))
            for part, half in zip(parts, halves):
                yield f"{prefix}.block_sparse_moe.experts.{e}.{part}.weight", half


class GraniteMoeHybridForCausalLM(BambaForCausalLM):
    decoder_layer_cls = staticmethod(granite_layer)

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

    def load_name_mapper(self):
        return expert_name_mapper

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """``shared_mlp.input_linear`` split into the gate and up halves it fuses,
        ``output_linear`` as the down projection (MoE layers: see _expert_tensors)."""
        moe = bool(getattr(self.config, "num_local_experts", 0))

        def each(weights: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
            for name, tensor in weights:
                yield from _expert_tensors(name, tensor) if moe else ((name, tensor),)

        def renamed() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in each(weights):
                if ".shared_mlp.input_linear." in name:
                    half = tensor.shape[0] // 2  # a lazy tensor: narrow, not chunk
                    yield name.replace(".input_linear.", ".gate_proj."), tensor.narrow(0, 0, half)
                    yield name.replace(".input_linear.", ".up_proj."), tensor.narrow(0, half, half)
                else:
                    yield name.replace(".shared_mlp.output_linear.", ".shared_mlp.down_proj."), tensor

        return super().load_weights(renamed())
