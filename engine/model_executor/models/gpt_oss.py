"""GPT-OSS (``GptOssForCausalLM``): the Llama decoder with attention sinks and a
mixture of experts with biases and a clamped SwiGLU.

What differs from Llama (transformers' ``modeling_gpt_oss``):

- attention: q/k/v/o biases; ``layer_types`` alternates sliding-window
  (``sliding_window``) and full layers; one learned sink logit per head
  (``self_attn.sinks``) joins each softmax denominator (the attention layer's
  ``use_sinks``); YaRN RoPE (engine/model_executor/layers/rotary.py);
- MLP (``mlp``): a router with a bias (``mlp.router``), top-k over the logits and a
  softmax over the k chosen ones; experts with biases whose activation is
  ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``, ``g = clamp(gate,
  max=limit)``.

Checkpoint layout of the experts (one tensor per layer): ``experts.gate_up_proj [E, H,
2I]`` with gate and up interleaved along the last dim (gate ``[..., ::2]``, up
``[..., 1::2]``), ``gate_up_proj_bias [E, 2I]`` likewise, ``down_proj [E, I, H]``,
``down_proj_bias [E, H]``. MXFP4 checkpoints (``quant_method: mxfp4``) store
``{gate_up,down}_proj_blocks`` / ``_scales`` as ``[E, out, in / 32, ...]`` instead;
they are dequantized at load (engine/quantization/mxfp4.py). The experts run on the
platform's fused-MoE kernel (engine/model_executor/layers/fused_moe.py) with expert
biases and the ``swigluoai`` activation; the engine's layout is ``w13 [E, 2I, H]`` (gate
rows, then up rows) and ``w2 [E, H, I]``.

Tensor parallel: attention as Llama's (sinks sliced to the rank's heads); the experts
are split by intermediate features or, with ``--enable-expert-parallel``, placed whole,
as FusedMoE does for every MoE model (the MXFP4 tensors are read for this rank's part
only).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.profiler import record_function

from engine.core.interfaces.moe import SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT
from engine.model_executor.layers.fused_moe import FusedMoE, RouterConfig
from engine.model_executor.layers.linear import ReplicatedLinear, copy_checked, tp_rank_size
from engine.model_executor.lazy_tensor import materialize, split_part
from engine.model_executor.models.interface import ModelInitContext
from engine.model_executor.models.llama import (
    DecoderOptions,
    LlamaAttention,
    LlamaForCausalLM,
    config_head_size,
)


def gpt_oss_windows(hf_config: Any) -> tuple[int | None, ...]:
    """Per-layer sliding windows from ``layer_types`` (None: full attention)."""
    window = getattr(hf_config, "sliding_window", None)
    types = getattr(hf_config, "layer_types", None) or (
        ["sliding_attention" if i % 2 == 0 else "full_attention"
         for i in range(hf_config.num_hidden_layers)])
    unknown = set(types) - {"sliding_attention", "full_attention"}
    if unknown:
        raise ValueError(f"GPT-OSS layer types {sorted(unknown)} are not supported")
    return tuple(window if t == "sliding_attention" and window else None for t in types)


class GptOssAttention(LlamaAttention):
    """Llama attention with biases and learned per-head sinks (``self.attn.sinks``,
    filled from the checkpoint's ``self_attn.sinks``)."""

    def extra_attention_args(self, ctx: ModelInitContext) -> dict[str, Any]:
        rank, _ = tp_rank_size(ctx.tp)  # this rank's heads start at rank * heads
        return {"use_sinks": True, "sinks_head_offset": rank * self.num_heads}


def deinterleave(gate_up: torch.Tensor, dim: int) -> torch.Tensor:
    """GPT-OSS's interleaved gate / up entries along ``dim`` -> all gates, then all ups."""
    index = [slice(None)] * gate_up.dim()
    index[dim] = slice(0, None, 2)
    gate = gate_up[tuple(index)]
    index[dim] = slice(1, None, 2)
    return torch.cat((gate, gate_up[tuple(index)]), dim=dim)


class GptOssMoE(nn.Module):
    """Router (``router``: linear with bias; top-k of the logits, softmax over the k) +
    routed experts (:class:`FusedMoE` with biases and ``swigluoai``): ``[T, H] -> [T, H]``,
    fully reduced. Loads the stacked checkpoint tensors (module docstring), dense or
    MXFP4."""

    def __init__(self, hf_config: Any, ctx: ModelInitContext) -> None:
        super().__init__()
        alpha = float(getattr(hf_config, "swiglu_alpha", SWIGLUOAI_ALPHA))
        limit = float(getattr(hf_config, "swiglu_limit", SWIGLUOAI_LIMIT))
        if (alpha, limit) != (SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT):
            raise ValueError(f"GPT-OSS experts with swiglu_alpha={alpha}, swiglu_limit={limit} "
                             f"are not supported (the kernels use {SWIGLUOAI_ALPHA}, "
                             f"{SWIGLUOAI_LIMIT})")
        num_experts, self.top_k = hf_config.num_local_experts, hf_config.num_experts_per_tok
        if not 0 < self.top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={self.top_k} must be in [1, {num_experts}]")
        self.tp = ctx.tp
        hidden = hf_config.hidden_size
        self.router = ReplicatedLinear(hidden, num_experts, bias=True, dtype=ctx.dtype,
                                       device=ctx.device)
        # RouterConfig is FusedMoE's bookkeeping only: the routing is GPT-OSS's, below.
        self.experts = FusedMoE(
            RouterConfig(num_experts, self.top_k), hidden, hf_config.intermediate_size,
            dtype=ctx.dtype, device=ctx.device, kernels=ctx.moe_kernels, tp=ctx.tp,
            expert_parallel=ctx.expert_parallel, ep=ctx.ep, activation="swigluoai",
            bias=True)
        plan = ctx.quantization
        method = getattr(plan.method, "experts_method", None) if plan is not None else None
        if plan is not None and method is None:
            raise ValueError(f"GPT-OSS experts cannot load a {plan.describe()} checkpoint "
                             "(supported: unquantized, mxfp4)")
        self.quant = method() if method is not None else None
        experts = self.experts
        for name, loader in (("w13", self._load_gate_up), ("w2", self._load_down),
                             ("w13_bias", self._load_gate_up_bias),
                             ("w2_bias", self._load_down_bias)):
            param = getattr(experts, name)
            param.weight_loader, param.shard_ids = loader, None
        if self.quant is not None:  # w13 / w2 come from the MXFP4 tensors after loading
            experts.w13.optional_weight = experts.w2.optional_weight = True
            e, inter = experts.num_local_experts, experts.intermediate_size
            self.quant.create_weights(experts, "gate_up_proj", (e, 2 * inter, hidden),
                                      ctx.device, self._load_blocks_rows)
            self.quant.create_weights(experts, "down_proj", (e, hidden, inter), ctx.device,
                                      self._load_blocks_cols)

    # checkpoint layout -> FusedMoE's (all experts; load_stacked takes this rank's part)
    def _load_gate_up(self, param: Any, loaded: Any) -> None:
        """``[E, H, 2I]`` interleaved -> ``w13 [E, 2I, H]``."""
        self.experts.load_stacked("w13", deinterleave(materialize(loaded), 2).transpose(1, 2))

    def _load_gate_up_bias(self, param: Any, loaded: Any) -> None:
        self.experts.load_stacked("w13_bias", deinterleave(materialize(loaded), 1))

    def _load_down(self, param: Any, loaded: Any) -> None:
        """``[E, I, H]`` -> ``w2 [E, H, I]``."""
        self.experts.load_stacked("w2", materialize(loaded).transpose(1, 2))

    def _load_down_bias(self, param: Any, loaded: Any) -> None:
        self.experts.load_stacked("w2_bias", loaded)

    def _mine(self, loaded: Any, dim: int) -> Any:
        """This rank's experts, and its part of ``dim`` (the intermediate features)."""
        experts = self.experts
        index, parts = experts.intermediate_part
        local = loaded.narrow(0, experts.first_expert, experts.num_local_experts)
        return split_part(local, dim, index, parts)

    def _load_blocks_rows(self, param: Any, loaded: Any) -> None:
        """MXFP4 gate_up ``[E, 2I, H / 32, ...]``, rows interleaved: a rank's ``2 I_rank``
        rows are one contiguous run."""
        copy_checked(param, materialize(self._mine(loaded, 1)), "experts.gate_up_proj (mxfp4)")

    def _load_blocks_cols(self, param: Any, loaded: Any) -> None:
        """MXFP4 down ``[E, H, I / 32, ...]``: a rank's blocks of input features."""
        copy_checked(param, materialize(self._mine(loaded, 2)), "experts.down_proj (mxfp4)")

    def process_weights_after_loading(self) -> None:
        """Dequantize MXFP4 experts into ``w13`` / ``w2`` (once)."""
        experts = self.experts
        if self.quant is None or not hasattr(experts, "gate_up_proj_blocks"):
            return
        gate_up = self.quant.dequantize(experts, "gate_up_proj", experts.w13.dtype)
        copy_checked(experts.w13, deinterleave(gate_up, 1), "experts.w13 (mxfp4)")
        copy_checked(experts.w2, self.quant.dequantize(experts, "down_proj", experts.w2.dtype),
                     "experts.w2 (mxfp4)")

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        with record_function("moe.select_experts"):
            logits = self.router(hidden)
            top, ids = logits.topk(self.top_k, dim=-1)
            weights = top.float().softmax(dim=-1)
        out = self.experts.forward_routed(hidden, weights, ids)
        if self.experts.outputs_partial_sums:
            return self.tp.all_reduce(out)
        return out


class GptOssForCausalLM(LlamaForCausalLM):
    attention_cls = GptOssAttention

    @classmethod
    def decoder_options(cls, hf_config: Any) -> DecoderOptions:
        bias = bool(getattr(hf_config, "attention_bias", True))
        return DecoderOptions(head_size=config_head_size(hf_config), qkv_bias=bias,
                              o_proj_bias=bias, sliding_windows=gpt_oss_windows(hf_config))

    @classmethod
    def make_mlp(cls, hf_config: Any, ctx: ModelInitContext, opts: DecoderOptions,
                 layer_idx: int) -> tuple[str, nn.Module]:
        return "mlp", GptOssMoE(hf_config, ctx)

    def load_name_mapper(self):
        return gpt_oss_name_mapper


_EXPERT_PARAMS = {"gate_up_proj": "w13", "gate_up_proj_bias": "w13_bias",
                  "down_proj": "w2", "down_proj_bias": "w2_bias"}


def gpt_oss_name_mapper(name: str) -> tuple[str, Any] | None:
    """``...self_attn.sinks`` -> the attention layer's ``...self_attn.attn.sinks``;
    ``...mlp.experts.gate_up_proj`` (and the others of :data:`_EXPERT_PARAMS`) -> the
    FusedMoE parameter whose loader converts the layout; None for every other name."""
    if name.endswith(".self_attn.sinks"):
        return name[: -len("sinks")] + "attn.sinks", None
    prefix, _, last = name.rpartition(".")
    if prefix.endswith(".mlp.experts") and last in _EXPERT_PARAMS:
        return f"{prefix}.{_EXPERT_PARAMS[last]}", None
    return None
