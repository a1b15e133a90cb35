"""Nemotron-H (transformers' ``NemotronHForCausalLM``): a stack of single-mixer blocks,
RMSNorm -> mixer -> + residual, the mixer per ``layers_block_type`` (the older
``hybrid_override_pattern``): Mamba-2 ("M"), attention without positional encoding
("*") or a squared-ReLU MLP ("-"). Mixture-of-experts blocks ("E", Nemotron-H v2 / 3)
are refused: their experts are ungated (up -> relu^2 -> down), which the fused-MoE
kernels do not offer.

Checkpoint names: ``backbone.embeddings`` / ``backbone.layers.{i}.mixer`` /
``backbone.norm_f`` become Llama's ``model.embed_tokens`` / ``model.layers.{i}.mixer`` /
``model.norm``. Tensor and pipeline parallelism are refused.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from engine.model_executor.layers.linear import ReplicatedLinear
from engine.model_executor.layers.mamba2 import (
    Mamba2Dims,
    Mamba2Mixer,
    dt_limit_of,
    ssm_cache_dtype,
)
from engine.model_executor.layers.norm import RMSNorm
from engine.model_executor.layers.rotary import RopeInputs
from engine.model_executor.models.granitemoehybrid import NoRotary
from engine.model_executor.models.interface import ModelInitContext
from engine.model_executor.models.llama import (
    STACKED_PARAMS,
    DecoderOptions,
    LlamaAttention,
)
from engine.model_executor.models.mamba2_hybrid import ConfigView, Mamba2HybridForCausalLM

MAMBA, ATTENTION, MLP = "mamba", "attention", "mlp"
# Each spelling of a block kind (pattern characters, older and newer names) -> ours.
_KINDS = {"M": MAMBA, "mamba": MAMBA, "linear_attention": MAMBA,
          "*": ATTENTION, "attention": ATTENTION, "full_attention": ATTENTION,
          "-": MLP, "mlp": MLP}
_MOE = ("E", "moe")


def block_kinds(hf_config: Any) -> list[str]:
    """Each block's mixer kind (``MAMBA``, ``ATTENTION`` or ``MLP``)."""
    kinds = (getattr(hf_config, "layers_block_type", None)
             or list(getattr(hf_config, "hybrid_override_pattern", "")))
    if any(kind in _MOE for kind in kinds):
        raise ValueError("NemotronHForCausalLM: mixture-of-experts blocks are not supported "
                         "yet (ungated experts: no fused-MoE kernel for them)")
    unknown = sorted({kind for kind in kinds if kind not in _KINDS})
    if unknown or not kinds:
        raise ValueError(f"NemotronHForCausalLM: unknown block types {unknown or kinds}")
    return [_KINDS[kind] for kind in kinds]


def nemotron_h_mamba_dims(hf_config: Any) -> Mamba2Dims:
    inter = hf_config.mamba_num_heads * hf_config.mamba_head_dim
    return Mamba2Dims(
        hidden_size=hf_config.hidden_size,
        num_heads=hf_config.mamba_num_heads,
        head_dim=hf_config.mamba_head_dim,
        n_groups=hf_config.n_groups,
        d_state=hf_config.ssm_state_size,
        d_conv=hf_config.conv_kernel,
        intermediate_size=inter,
        use_bias=bool(hf_config.use_bias),
        use_conv_bias=bool(hf_config.use_conv_bias),
        chunk_size=hf_config.chunk_size,
        norm_eps=hf_config.layer_norm_epsilon,
        dt_limit=dt_limit_of(hf_config),
        activation=hf_config.mamba_hidden_act,
        ssm_state_dtype=ssm_cache_dtype(hf_config),
    )


class SquaredReluMLP(nn.Module):
    """``down(relu(up(x)) ** 2)`` (``mlp_hidden_act`` "relu2"; no gate)."""

    def __init__(self, hf_config: Any, ctx: ModelInitContext, prefix: str) -> None:
        super().__init__()
        act = getattr(hf_config, "mlp_hidden_act", "relu2")
        if act != "relu2":
            raise ValueError(f"NemotronHForCausalLM: mlp_hidden_act {act!r} is not supported")
        hidden, inter, bias = (hf_config.hidden_size, hf_config.intermediate_size,
                               bool(hf_config.mlp_bias))
        common = {**ctx.matrix_dtypes, "device": ctx.device}
        self.up_proj = ReplicatedLinear(hidden, inter, bias=bias, **common,
                                        quant_method=ctx.linear_method(f"{prefix}.up_proj"))
        self.down_proj = ReplicatedLinear(inter, hidden, bias=bias, **common,
                                          quant_method=ctx.linear_method(f"{prefix}.down_proj"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.relu(self.up_proj(x)).square())


class NemotronHBlock(nn.Module):
    """RMSNorm -> one mixer -> + residual (LlamaModel's layer interface)."""

    def __init__(self, hf_config: Any, ctx: ModelInitContext, opts: DecoderOptions,
                 layer_idx: int, rotary_emb: Any, make_mlp: Any = None,
                 make_attention: Any = None) -> None:
        super().__init__()
        kinds = block_kinds(hf_config)
        self.kind = kinds[layer_idx]
        before = kinds[:layer_idx]
        prefix = f"model.layers.{layer_idx}.mixer"
        if self.kind == ATTENTION:
            self.mixer = LlamaAttention(hf_config, ctx, opts, layer_idx, rotary_emb,
                                        cache_index=before.count(ATTENTION))
        elif self.kind == MAMBA:
            self.mixer = Mamba2Mixer(nemotron_h_mamba_dims(hf_config), ctx, prefix,
                                     before.count(MAMBA))
        else:
            self.mixer = SquaredReluMLP(hf_config, ctx, prefix)
        self.norm = RMSNorm(hf_config.hidden_size, hf_config.layer_norm_epsilon,
                            dtype=ctx.dtype, device=ctx.device, fused_ops=ctx.fused_ops)

    def forward(self, rope: RopeInputs, hidden: torch.Tensor, residual: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.norm(hidden)
        else:
            hidden, residual = self.norm(hidden, residual)
        out = self.mixer(rope, hidden) if self.kind == ATTENTION else self.mixer(hidden)
        return out, residual


class NemotronHForCausalLM(Mamba2HybridForCausalLM):
    decoder_layer_cls = NemotronHBlock
    stacked_params = tuple(p for p in STACKED_PARAMS if p.target == ".qkv_proj.")

    def __init__(self, hf_config: Any, ctx: ModelInitContext) -> None:
        if getattr(hf_config, "sliding_window", None) is not None:
            raise ValueError("NemotronHForCausalLM: sliding-window attention is not supported")
        # LlamaModel's field names: the layer count from the block types, the norms' eps.
        super().__init__(ConfigView(hf_config, num_hidden_layers=len(block_kinds(hf_config)),
                                    rms_norm_eps=hf_config.layer_norm_epsilon), ctx)

    @staticmethod
    def make_rotary(hf_config: Any, ctx: ModelInitContext, opts: DecoderOptions) -> Any:
        return NoRotary()  # no positional encoding

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Llama's loader under Llama's names (``backbone.`` or ``model.`` prefixed)."""
        def renamed() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name.startswith("backbone."):
                    name = "model." + name[len("backbone."):]
                yield (name.replace("model.embeddings.", "model.embed_tokens.")
                       .replace("model.norm_f.", "model.norm."), tensor)

        return super().load_weights(renamed())
