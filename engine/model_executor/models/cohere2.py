"""Cohere2 (Command R7B / Command A), as transformers runs it.

- One LayerNorm per layer, with a weight and no bias, computed in float32
  (:class:`Float32LayerNorm`); the same for the final norm.
- Parallel block: attention and the (SwiGLU) MLP both read the normed input and
  ``residual + attention + mlp`` (in that order) is the layer's output.
- Sliding-window layers (``layer_types``) use RoPE in the interleaved (GPT-J) convention,
  pairs ``(x[2i], x[2i+1])``; full-attention layers use no positional encoding at all.
  Queries and keys of a sliding layer are de-interleaved per head (evens, then odds)
  before the NeoX-style rotation, which rotates the same pairs; q and k share the
  permutation, so every dot product is transformers' (values are untouched).
- Logits are multiplied by ``logit_scale``; the head is tied to the embedding by default.

Tensor parallel as Llama (column-parallel q/k/v and gate/up, row-parallel o/down, one
all-reduce each); pipeline stages as Llama's, with the residual stream carried whole.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.model_executor.layers.attention import Attention
from engine.model_executor.layers.embedding import VocabEmbedding
from engine.model_executor.layers.linear import QKVLinear, RowParallelLinear
from engine.model_executor.layers.norm import Float32LayerNorm
from engine.model_executor.layers.rotary import RopeInputs, RotaryEmbedding
from engine.model_executor.models.gemma import layer_types_of, rope_scaling_for
from engine.model_executor.models.interface import IntermediateTensors, ModelInitContext
from engine.model_executor.models.llama import (
    DecoderOptions,
    LlamaForCausalLM,
    LlamaMLP,
    PPMissingLayer,
)

SLIDING = "sliding_attention"


def cohere2_head_size(hf_config: Any) -> int:
    # Cohere2Config derives head_dim from hidden_size / heads (the modeling code reads it).
    return getattr(hf_config, "head_dim", None) or (
        hf_config.hidden_size // hf_config.num_attention_heads)


class Cohere2Attention(nn.Module):
    def __init__(self, hf_config: Any, ctx: ModelInitContext, opts: DecoderOptions,
                 layer_idx: int, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        num_heads = hf_config.num_attention_heads
        num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
        self.head_size = opts.head_size
        bias = bool(getattr(hf_config, "attention_bias", False))
        common = {**ctx.matrix_dtypes, "device": ctx.device}
        prefix = f"model.layers.{layer_idx}.self_attn"
        self.qkv_proj = QKVLinear(
            hf_config.hidden_size, self.head_size, num_heads, num_kv_heads, bias=bias,
            **common, tp=ctx.tp,
            quant_method=ctx.linear_method(*(f"{prefix}.{p}_proj" for p in "qkv")),
        )
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(
            num_heads * self.head_size, hf_config.hidden_size, bias=bias, **common,
            tp=ctx.tp, quant_method=ctx.linear_method(f"{prefix}.o_proj"),
        )
        window = opts.window(layer_idx)
        # Only the sliding layers are rotated; the full ones use no positions (NoPE).
        self.rotary_emb = rotary_emb if window is not None else None
        self.attn = Attention(
            self.num_heads, self.head_size, self.head_size**-0.5, self.num_kv_heads,
            layer_idx, ctx.attn_backend, sliding_window=window,
            cache_index=layer_idx - ctx.stage_layers(hf_config.num_hidden_layers).start,
        )

    def _deinterleave(self, x: torch.Tensor) -> torch.Tensor:
        """Per head: ``(x0, x1), (x2, x3) ...`` pairs -> evens, then odds."""
        heads = x.reshape(x.shape[0], -1, self.head_size)
        return torch.cat((heads[..., 0::2], heads[..., 1::2]), dim=-1).view(x.shape[0], -1)

    def forward(self, rope: RopeInputs, hidden: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        q_size, kv_size = self.qkv_proj.shard_sizes["q"], self.qkv_proj.shard_sizes["k"]
        q, k = qkv[:, :q_size], qkv[:, q_size : q_size + kv_size]
        v = qkv[:, q_size + kv_size :]
        if self.rotary_emb is not None:
            qk = self._deinterleave(qkv[:, : q_size + kv_size])  # q and k heads alike
            qk = self.rotary_emb.apply(qk, rope)
            q, k = qk.split([q_size, kv_size], dim=-1)
        return self.o_proj(self.attn(q, k, v))


class Cohere2DecoderLayer(nn.Module):
    def __init__(self, hf_config: Any, ctx: ModelInitContext, opts: DecoderOptions,
                 layer_idx: int, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = Float32LayerNorm(
            hf_config.hidden_size, hf_config.layer_norm_eps, dtype=ctx.dtype, device=ctx.device)
        self.self_attn = Cohere2Attention(hf_config, ctx, opts, layer_idx, rotary_emb)
        self.mlp = LlamaMLP(hf_config, ctx, opts, f"model.layers.{layer_idx}.mlp")

    def forward(self, rope: RopeInputs, hidden: torch.Tensor) -> torch.Tensor:
        normed = self.input_layernorm(hidden)
        return hidden + self.self_attn(rope, normed) + self.mlp(normed)


class Cohere2Model(nn.Module):
    def __init__(self, hf_config: Any, ctx: ModelInitContext, opts: DecoderOptions) -> None:
        super().__init__()
        common = {"dtype": ctx.dtype, "device": ctx.device}
        self.is_first_stage, self.is_last_stage = ctx.is_first_stage, ctx.is_last_stage
        self.embed_tokens: nn.Module = PPMissingLayer()
        if self.is_first_stage:
            self.embed_tokens = VocabEmbedding(
                hf_config.vocab_size, hf_config.hidden_size, **ctx.matrix_dtypes,
                device=ctx.device, fused_ops=ctx.fused_ops, tp=ctx.tp,
            )
        self.rotary_emb = RotaryEmbedding(opts.head_size, rope_scaling_for(hf_config), **common,
                                          fused_ops=ctx.fused_ops)
        self.stage_layers = ctx.stage_layers(hf_config.num_hidden_layers)
        self.layers = nn.ModuleList(
            Cohere2DecoderLayer(hf_config, ctx, opts, i, self.rotary_emb)
            if i in self.stage_layers else PPMissingLayer()
            for i in range(hf_config.num_hidden_layers)
        )
        self.norm: nn.Module = PPMissingLayer()
        if self.is_last_stage:
            self.norm = Float32LayerNorm(hf_config.hidden_size, hf_config.layer_norm_eps,
                                         **common)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate: IntermediateTensors | None = None
                ) -> torch.Tensor | IntermediateTensors:
        if self.is_first_stage:
            hidden = self.embed_tokens(input_ids)
        else:
            hidden = intermediate.hidden
        rope = self.rotary_emb.prepare(positions)
        for i in self.stage_layers:
            hidden = self.layers[i](rope, hidden)
        if not self.is_last_stage:
            return IntermediateTensors(hidden, hidden)  # the stream whole: no residual apart
        return self.norm(hidden)


class Cohere2ForCausalLM(LlamaForCausalLM):
    """Loading, pipeline-stage bookkeeping and the KV spec are Llama's."""

    supports_pipeline_parallel = True

    def __init__(self, hf_config: Any, ctx: ModelInitContext) -> None:
        nn.Module.__init__(self)
        self.config = hf_config
        types = layer_types_of(hf_config)
        window = getattr(hf_config, "sliding_window", None)
        self.opts = DecoderOptions(
            head_size=cohere2_head_size(hf_config),
            sliding_windows=tuple(window if t == SLIDING else None for t in types),
        )
        self.vocab_size = hf_config.vocab_size
        self.head_size = self.opts.head_size
        self.activation_dtype = ctx.dtype
        self.logit_scale = float(getattr(hf_config, "logit_scale", 1.0))
        if ctx.linear_method("lm_head") is not None:
            raise ValueError("checkpoints with a quantized lm_head are not supported")
        self.model = Cohere2Model(hf_config, ctx, self.opts)
        self.stage_layers = self.model.stage_layers
        self.num_layers = len(self.stage_layers)
        self.num_kv_heads = self.model.layers[self.stage_layers.start].self_attn.num_kv_heads
        self.init_lm_head(hf_config, ctx, tie_by_default=True)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden) * self.logit_scale
