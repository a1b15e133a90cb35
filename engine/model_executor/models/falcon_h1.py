"""Falcon-H1 (transformers' ``FalconH1ForCausalLM``): every layer runs attention and a
Mamba-2 mixer side by side on the same normed input and adds their outputs, then a gated
MLP (Llama-style names: ``self_attn``, ``mamba``, ``feed_forward``, ``pre_ff_layernorm``).

Its muP multipliers, each where transformers applies it: ``embedding_multiplier`` on the
embeddings, ``attention_in/out_multiplier`` and ``ssm_in/out_multiplier`` around the two
mixers, ``key_multiplier`` on the keys (folded into the softmax scale: every score is
scaled by it), ``ssm_multipliers`` per block of the mixer's ``in_proj`` output (z, x, B,
C, dt: the muP vector), ``mlp_multipliers`` on the gate and on the MLP output,
``lm_head_multiplier`` on the logits. The mixer's gated RMSNorm is optional
(``mamba_rms_norm``; without it the output is only gated) and may normalize before the
gate (``mamba_norm_before_gate``). Every layer is an attention layer for the KV cache and
a state layer. Tensor parallelism splits both mixers (the muP vector follows the rank's
``in_proj`` blocks); pipeline parallelism is refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.model_executor.layers.mamba2 import (
    GatedRMSNorm,
    Mamba2Dims,
    Mamba2Mixer,
    Part,
    StackedColumnLinear,
)
from engine.model_executor.layers.norm import RMSNorm, residual_norm
from engine.model_executor.layers.rotary import RopeInputs, rotary_for_config
from engine.model_executor.models.bamba import bamba_mamba_dims
from engine.model_executor.models.interface import ModelInitContext
from engine.model_executor.models.llama import DecoderOptions, LlamaAttention, LlamaMLP
from engine.model_executor.models.mamba2_hybrid import Mamba2HybridForCausalLM


def falcon_h1_mamba_dims(hf_config: Any) -> Mamba2Dims:
    """Bamba's ``mamba_*`` fields, with ``mamba_d_ssm`` as the intermediate size."""
    if bool(hf_config.mamba_proj_bias) != bool(getattr(hf_config, "projectors_bias", False)):
        raise ValueError("FalconH1ForCausalLM: mamba_proj_bias != projectors_bias (a bias on "
                         "only one of in_proj / out_proj) is not supported")
    d_ssm = getattr(hf_config, "mamba_d_ssm", None)
    inter = int(hf_config.mamba_expand * hf_config.hidden_size) if d_ssm is None else d_ssm
    return dataclasses.replace(bamba_mamba_dims(hf_config), intermediate_size=inter)


def mup_vector(block_sizes: Iterable[int], multipliers: Iterable[float]) -> torch.Tensor:
    """One multiplier per ``in_proj`` output feature: ``ssm_multipliers`` over its z, x,
    B, C and dt blocks (this rank's sizes of each)."""
    return torch.cat([torch.full((n,), float(m))
                      for n, m in zip(block_sizes, multipliers, strict=True)])


class MupInProj(StackedColumnLinear):
    """``in_proj`` whose output features are scaled by the muP vector (a buffer, not a
    checkpoint tensor)."""

    def __init__(self, *args: Any, multipliers: Iterable[float], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        scale = mup_vector(self.shard_sizes.values(), multipliers)
        self.register_buffer("mup_vector", scale.to(kwargs["device"]), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.mup_vector.to(x.dtype)


class NormThenGate(GatedRMSNorm):
    """``rmsnorm_per_group(x) * weight * silu(z)`` in float32 (``mamba_norm_before_gate``)."""

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        h = self.weight.float() * self.normalize(x.float()) * F.silu(z.float())
        return h.to(x.dtype)


class GateOnly(nn.Module):
    """``x * silu(z)``: the mixer's output without its RMSNorm (``mamba_rms_norm`` off)."""

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return x * F.silu(z)


class FalconH1Mixer(Mamba2Mixer):
    """The Mamba-2 mixer with the muP-scaled ``in_proj`` and Falcon-H1's output norm."""

    def __init__(self, hf_config: Any, ctx: ModelInitContext, layer_idx: int) -> None:
        dims = falcon_h1_mamba_dims(hf_config)
        prefix = f"model.layers.{layer_idx}.mamba"
        self.ssm_multipliers = tuple(hf_config.ssm_multipliers)  # read by make_in_proj
        super().__init__(dims, ctx, prefix, layer_idx)
        if not hf_config.mamba_rms_norm:
            self.norm = GateOnly()
        elif hf_config.mamba_norm_before_gate:
            self.norm = NormThenGate(dims.intermediate_size,
                                     dims.intermediate_size // dims.n_groups, dims.norm_eps,
                                     dtype=ctx.dtype, device=ctx.device, tp=ctx.tp)

    def make_in_proj(self, dims: Mamba2Dims, ctx: ModelInitContext, prefix: str,
                     blocks: dict[str, int], parts: dict[str, Part]) -> StackedColumnLinear:
        return MupInProj(dims.hidden_size, blocks, tp=ctx.tp, parts=parts,
                         bias=dims.use_bias, multipliers=self.ssm_multipliers,
                         quant_method=ctx.linear_method(f"{prefix}.in_proj"),
                         **ctx.matrix_dtypes, device=ctx.device)


class FalconH1MLP(LlamaMLP):
    """The gated MLP with ``mlp_multipliers``: (gate input, output)."""

    def __init__(self, hf_config: Any, ctx: ModelInitContext, opts: DecoderOptions,
                 prefix: str) -> None:
        super().__init__(hf_config, ctx, opts, prefix)
        self.gate_multiplier, self.down_multiplier = map(float, hf_config.mlp_multipliers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        gate_up[..., : gate_up.shape[-1] // 2] *= self.gate_multiplier
        return self.down_proj(self.act_fn(gate_up)) * self.down_multiplier


class FalconH1DecoderLayer(nn.Module):
    """Attention + Mamba-2 in parallel, then the MLP (LlamaModel's layer interface)."""

    def __init__(self, hf_config: Any, ctx: ModelInitContext, opts: DecoderOptions,
                 layer_idx: int, rotary_emb: Any, make_mlp: Any = None,
                 make_attention: Any = None) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(hf_config, ctx, opts, layer_idx, rotary_emb)
        self.mamba = FalconH1Mixer(hf_config, ctx, layer_idx)
        self.mlp_name = "feed_forward"
        self.feed_forward = FalconH1MLP(hf_config, ctx, opts,
                                        f"model.layers.{layer_idx}.feed_forward")
        common = {"dtype": ctx.dtype, "device": ctx.device, "fused_ops": ctx.fused_ops}
        self.input_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps, **common)
        self.pre_ff_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps,
                                        **common)
        self.embedding_multiplier = float(hf_config.embedding_multiplier)
        self.attn_in, self.attn_out = (float(hf_config.attention_in_multiplier),
                                       float(hf_config.attention_out_multiplier))
        self.ssm_in, self.ssm_out = (float(hf_config.ssm_in_multiplier),
                                     float(hf_config.ssm_out_multiplier))

    def forward(self, rope: RopeInputs, hidden: torch.Tensor, residual: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:  # the first layer: the embeddings themselves
            hidden = hidden * self.embedding_multiplier
        hidden, residual = residual_norm(self.input_layernorm, hidden, residual)
        mixed = (self.mamba(hidden * self.ssm_in) * self.ssm_out
                 + self.self_attn(rope, hidden * self.attn_in) * self.attn_out)
        hidden, residual = self.pre_ff_layernorm(mixed, residual)
        return self.feed_forward(hidden), residual


class FalconH1ForCausalLM(Mamba2HybridForCausalLM):
    decoder_layer_cls = FalconH1DecoderLayer

    @staticmethod
    def make_rotary(hf_config: Any, ctx: ModelInitContext, opts: DecoderOptions) -> Any:
        return rotary_for_config(hf_config, opts.head_size, dtype=ctx.dtype, device=ctx.device,
                                 fused_ops=ctx.fused_ops)

    @classmethod
    def decoder_options(cls, hf_config: Any) -> DecoderOptions:
        opts = super().decoder_options(hf_config)
        return dataclasses.replace(
            opts, attn_scale=opts.head_size**-0.5 * float(hf_config.key_multiplier))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) * float(self.config.lm_head_multiplier)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Llama's loader with Falcon-H1's final norm name."""
        return super().load_weights(
            (name.replace("model.final_layernorm.", "model.norm."), tensor)
            for name, tensor in weights)
