"""Mamba (transformers' ``MambaForCausalLM``, Mamba-1): a pure state-space decoder.

``embeddings`` -> N x (RMSNorm -> Mamba-1 mixer -> + residual) -> ``norm_f`` -> LM head:
Mamba-2's model (:mod:`engine.model_executor.models.mamba2`) with the Mamba-1 mixer
(:mod:`engine.model_executor.layers.mamba1`), so the block, backbone, head tying, weight
loading and state cache spec are Mamba-2's. No KV cache; ``residual_in_fp32`` keeps the
residual stream in float32. Tensor parallelism splits each mixer's channels and the
vocabulary over the ranks; pipeline parallelism is refused.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from engine.model_executor.layers.embedding import LMHead, VocabEmbedding
from engine.model_executor.layers.mamba1 import Mamba1Dims, Mamba1Mixer
from engine.model_executor.layers.mamba2 import ssm_cache_dtype
from engine.model_executor.layers.norm import RMSNorm
from engine.model_executor.models.interface import ModelInitContext, ModelKVSpec
from engine.model_executor.models.mamba2 import Mamba2Backbone, Mamba2Block, Mamba2ForCausalLM


def mamba1_dims(hf_config: Any) -> Mamba1Dims:
    """The mixer sizes of a ``MambaConfig``."""
    return Mamba1Dims(
        hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size,
        d_state=hf_config.state_size,
        d_conv=hf_config.conv_kernel,
        dt_rank=int(hf_config.time_step_rank),
        use_bias=bool(hf_config.use_bias),
        use_conv_bias=bool(hf_config.use_conv_bias),
        activation=hf_config.hidden_act,
        ssm_state_dtype=ssm_cache_dtype(hf_config),
    )


class MambaBlock(Mamba2Block):
    """Mamba-2's block (norm, mixer, residual) around a Mamba-1 mixer."""

    def __init__(self, hf_config: Any, dims: Mamba1Dims, ctx: ModelInitContext,
                 layer_idx: int) -> None:
        nn.Module.__init__(self)
        self.dtype = ctx.dtype
        self.residual_in_fp32 = bool(getattr(hf_config, "residual_in_fp32", True))
        self.norm = RMSNorm(dims.hidden_size, hf_config.layer_norm_epsilon, dtype=ctx.dtype,
                            device=ctx.device, fused_ops=ctx.fused_ops)
        self.mixer = Mamba1Mixer(dims, ctx, f"backbone.layers.{layer_idx}.mixer", layer_idx)


class MambaBackbone(Mamba2Backbone):
    def __init__(self, hf_config: Any, ctx: ModelInitContext, dims: Mamba1Dims) -> None:
        nn.Module.__init__(self)
        self.embeddings = VocabEmbedding(hf_config.vocab_size, dims.hidden_size,
                                         **ctx.matrix_dtypes, device=ctx.device,
                                         fused_ops=ctx.fused_ops, tp=ctx.tp)
        self.layers = nn.ModuleList(MambaBlock(hf_config, dims, ctx, i)
                                    for i in range(hf_config.num_hidden_layers))
        # Reads the float32 residual stream itself (no fused kernel: mixed dtypes).
        self.norm_f = RMSNorm(dims.hidden_size, hf_config.layer_norm_epsilon,
                              dtype=ctx.dtype, device=ctx.device)


class MambaForCausalLM(Mamba2ForCausalLM):
    """Mamba-2's model class with the Mamba-1 backbone (tied head unless the config says
    otherwise, as transformers' ``MambaConfig`` defaults)."""

    def __init__(self, hf_config: Any, ctx: ModelInitContext) -> None:
        nn.Module.__init__(self)
        if ctx.linear_method("lm_head") is not None:
            raise ValueError("checkpoints with a quantized lm_head are not supported")
        self.config = hf_config
        self.dims = mamba1_dims(hf_config)
        self.vocab_size = hf_config.vocab_size
        self.activation_dtype = ctx.dtype
        self.backbone = MambaBackbone(hf_config, ctx, self.dims)
        self.lm_head = LMHead(hf_config.vocab_size, self.dims.hidden_size, **ctx.matrix_dtypes,
                              device=ctx.device, tp=ctx.tp)
        self.tied = bool(getattr(hf_config, "tie_word_embeddings", True))
        if self.tied:
            self.lm_head.tie_to(self.backbone.embeddings)

    def kv_cache_spec(self) -> ModelKVSpec:
        """No attention layer: no KV cache layers."""
        return ModelKVSpec(num_layers=0, num_kv_heads=1, head_size=self.dims.d_state,
                           sliding_windows=())
