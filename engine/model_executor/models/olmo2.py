"""OLMo 2: the Llama decoder with the norms moved after the sub-layers.

Each layer is ``h = h + post_attention_layernorm(attn(h))``, then
``h = h + post_feedforward_layernorm(mlp(h))`` (no pre-norms), and q / k are RMS-normed
over the whole projection (all heads at once, before RoPE), not per head.

Tensor parallel: a rank holds its heads of q and k, so their norms' weights are cut like
the projection, and the mean square is summed over the ranks (one all-reduce of a
``[T, 1]`` tensor each). Replicated key/value heads count once per rank holding them,
which leaves the mean unchanged since every head is held equally often.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.core.interfaces import Communicator
from engine.model_executor.layers.linear import copy_checked
from engine.model_executor.layers.norm import RMSNorm
from engine.model_executor.layers.rotary import RopeInputs, RotaryEmbedding
from engine.model_executor.lazy_tensor import split_part
from engine.model_executor.models.interface import ModelInitContext
from engine.model_executor.models.llama import (
    DecoderOptions,
    LlamaAttention,
    LlamaForCausalLM,
)


class ShardedRMSNorm(RMSNorm):
    """RMSNorm over a feature dim split over the TP ranks: this rank holds part
    ``part = (index, parts)`` of the weight and the features."""

    def __init__(self, local_size: int, eps: float, *, part: tuple[int, int],
                 tp: Communicator | None, dtype: torch.dtype, device: torch.device | str,
                 fused_ops: Any = None) -> None:
        self.tp = tp
        super().__init__(local_size, eps, dtype=dtype, device=device,
                         fused_ops=None if tp is not None else fused_ops)
        self.part = part
        self.weight.weight_loader = self._load

    def _load(self, param: torch.Tensor, loaded: Any, shard_id: Any = None) -> None:
        if shard_id is not None:
            raise ValueError(f"a norm weight has no shard {shard_id!r}")
        if self.part[1] > 1:
            loaded = split_part(loaded, 0, *self.part)
        copy_checked(param, loaded, "norm weight")

    def forward(self, x: torch.Tensor, residual: None = None) -> torch.Tensor:
        if self.tp is None:
            return super().forward(x)
        xf = x.float()
        square_sum = self.tp.all_reduce(xf.pow(2).sum(-1, keepdim=True))
        variance = square_sum / (x.shape[-1] * self.tp.world_size)
        return self.weight * (xf * torch.rsqrt(variance + self.eps)).to(x.dtype)


class Olmo2Attention(LlamaAttention):
    def __init__(self, hf_config: Any, ctx: ModelInitContext, opts: DecoderOptions,
                 layer_idx: int, rotary_emb: RotaryEmbedding) -> None:
        super().__init__(hf_config, ctx, opts, layer_idx, rotary_emb)
        tp = ctx.tp
        common = {"tp": tp, "dtype": ctx.dtype, "device": ctx.device, "fused_ops": ctx.fused_ops}
        sizes, parts = self.qkv_proj.shard_sizes, self.qkv_proj.output_parts
        eps = hf_config.rms_norm_eps
        self.q_norm = ShardedRMSNorm(sizes["q"], eps, part=parts["q"], **common)
        self.k_norm = ShardedRMSNorm(sizes["k"], eps, part=parts["k"], **common)

    def forward(self, rope: RopeInputs, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb.apply(q, rope), self.rotary_emb.apply(k, rope)
        return self.o_proj(self.attn(q, k, v))


class Olmo2DecoderLayer(nn.Module):
    def __init__(self, hf_config: Any, ctx: ModelInitContext, opts: DecoderOptions,
                 layer_idx: int, rotary_emb: RotaryEmbedding, make_mlp: Any = None,
                 make_attention: Any = None) -> None:
        super().__init__()
        self.self_attn = (make_attention or Olmo2Attention)(hf_config, ctx, opts, layer_idx,
                                                            rotary_emb)
        self.mlp_name, mlp = (make_mlp or LlamaForCausalLM.make_mlp)(hf_config, ctx, opts,
                                                                     layer_idx)
        self.add_module(self.mlp_name, mlp)
        norm = {"dtype": ctx.dtype, "device": ctx.device, "fused_ops": ctx.fused_ops}
        eps = hf_config.rms_norm_eps
        self.post_attention_layernorm = RMSNorm(hf_config.hidden_size, eps, **norm)
        self.post_feedforward_layernorm = RMSNorm(hf_config.hidden_size, eps, **norm)

    def forward(
        self, rope: RopeInputs, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mlp branch, stream)``: the branch is added to the stream by the next layer
        (or the final norm), as the Llama layers leave theirs."""
        if residual is not None:
            hidden = residual + hidden
        hidden = hidden + self.post_attention_layernorm(self.self_attn(rope, hidden))
        branch = self.post_feedforward_layernorm(getattr(self, self.mlp_name)(hidden))
        return branch, hidden


class Olmo2ForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = Olmo2DecoderLayer
