"""Mamba-2 (transformers' ``Mamba2ForCausalLM``): a pure state-space decoder.

``embeddings`` -> N x (RMSNorm -> Mamba-2 mixer -> + residual) -> ``norm_f`` -> LM head.
No attention layer, so no KV cache: every layer keeps a per-request state instead
(:mod:`engine.model_executor.state_cache`), and the KV cache manager holds one empty
group whose blocks cost nothing. ``residual_in_fp32`` keeps the residual stream in
float32 as transformers does. Tensor parallelism splits each mixer's heads (and groups)
and the vocabulary over the ranks; pipeline parallelism is refused.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from engine.model_executor.layers.embedding import LMHead, VocabEmbedding
from engine.model_executor.layers.mamba2 import (
    Mamba2Dims,
    Mamba2Mixer,
    dt_limit_of,
    ssm_cache_dtype,
)
from engine.model_executor.layers.norm import RMSNorm
from engine.model_executor.models.interface import (
    IntermediateTensors,
    ModelInitContext,
    ModelKVSpec,
)
from engine.model_executor.state_cache import StateCacheSpec
from engine.model_executor.weight_utils import load_named_weights


def mamba2_dims(hf_config: Any) -> Mamba2Dims:
    """The mixer sizes of a ``Mamba2Config``."""
    return Mamba2Dims(
        hidden_size=hf_config.hidden_size,
        num_heads=hf_config.num_heads,
        head_dim=hf_config.head_dim,
        n_groups=hf_config.n_groups,
        d_state=hf_config.state_size,
        d_conv=hf_config.conv_kernel,
        intermediate_size=int(hf_config.expand * hf_config.hidden_size),
        use_bias=bool(hf_config.use_bias),
        use_conv_bias=bool(hf_config.use_conv_bias),
        chunk_size=hf_config.chunk_size,
        norm_eps=hf_config.layer_norm_epsilon,
        dt_limit=dt_limit_of(hf_config),
        activation=hf_config.hidden_act,
        ssm_state_dtype=ssm_cache_dtype(hf_config),
    )


class Mamba2Block(nn.Module):
    def __init__(self, dims: Mamba2Dims, ctx: ModelInitContext, layer_idx: int,
                 residual_in_fp32: bool) -> None:
        super().__init__()
        self.dtype = ctx.dtype
        self.residual_in_fp32 = residual_in_fp32
        self.norm = RMSNorm(dims.hidden_size, dims.norm_eps, dtype=ctx.dtype, device=ctx.device,
                            fused_ops=ctx.fused_ops)
        self.mixer = Mamba2Mixer(dims, ctx, f"backbone.layers.{layer_idx}.mixer", layer_idx)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        residual = hidden.float() if self.residual_in_fp32 else hidden
        out = self.mixer(self.norm(hidden.to(self.dtype)))
        return residual + out


class Mamba2Backbone(nn.Module):
    def __init__(self, hf_config: Any, ctx: ModelInitContext, dims: Mamba2Dims) -> None:
        super().__init__()
        self.embeddings = VocabEmbedding(hf_config.vocab_size, dims.hidden_size,
                                         **ctx.matrix_dtypes, device=ctx.device,
                                         fused_ops=ctx.fused_ops, tp=ctx.tp)
        residual_in_fp32 = bool(getattr(hf_config, "residual_in_fp32", True))
        self.layers = nn.ModuleList(Mamba2Block(dims, ctx, i, residual_in_fp32)
                                    for i in range(hf_config.num_hidden_layers))
        # Reads the float32 residual stream itself (no fused kernel: mixed dtypes).
        self.norm_f = RMSNorm(dims.hidden_size, dims.norm_eps, dtype=ctx.dtype,
                              device=ctx.device)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embeddings(input_ids)
        for layer in self.layers:
            hidden = layer(hidden)
        return self.norm_f(hidden)


class Mamba2ForCausalLM(nn.Module):
    supports_pipeline_parallel = False

    def __init__(self, hf_config: Any, ctx: ModelInitContext) -> None:
        super().__init__()
        if ctx.linear_method("lm_head") is not None:
            raise ValueError("checkpoints with a quantized lm_head are not supported")
        self.config = hf_config
        self.dims = mamba2_dims(hf_config)
        self.vocab_size = hf_config.vocab_size
        self.activation_dtype = ctx.dtype
        self.backbone = Mamba2Backbone(hf_config, ctx, self.dims)
        self.lm_head = LMHead(hf_config.vocab_size, self.dims.hidden_size, **ctx.matrix_dtypes,
                              device=ctx.device, tp=ctx.tp)
        self.tied = bool(getattr(hf_config, "tie_word_embeddings", False))
        if self.tied:
            self.lm_head.tie_to(self.backbone.embeddings)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate: IntermediateTensors | None = None) -> torch.Tensor:
        return self.backbone(input_ids).to(self.activation_dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def kv_cache_spec(self) -> ModelKVSpec:
        """No attention layer: no KV cache layers."""
        return ModelKVSpec(num_layers=0, num_kv_heads=1, head_size=self.dims.head_dim,
                           sliding_windows=())

    def state_cache_spec(self) -> StateCacheSpec:
        return StateCacheSpec(tuple(layer.mixer.state_layer_spec()
                                    for layer in self.backbone.layers))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """HF names as they are (older checkpoints' ``backbone.embedding.`` renamed, as
        transformers' load hook does); a missing ``lm_head.weight`` ties the head."""
        def renamed() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                yield name.replace("backbone.embedding.", "backbone.embeddings."), tensor

        loaded = load_named_weights(
            self, renamed(),
            ignore={"lm_head.weight"} if self.tied else (),
            optional=() if self.tied else {"lm_head.weight"},
        )
        if not self.tied and "lm_head.weight" not in loaded:
            self.lm_head.tie_to(self.backbone.embeddings)
        return loaded
