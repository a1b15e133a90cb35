"""The sparse MoE block the MoE members of the Llama family share (Mixtral, Qwen2-MoE,
Qwen3-MoE; DeepSeek-V3 adds grouped routing and shared experts through the same block).

``gate`` (the router: one logit per expert) -> routed :class:`FusedMoE` experts, plus an
optional shared expert (a dense MLP every token passes through; Qwen2-MoE scales it by a
sigmoid gate). Under tensor parallelism the shared expert's and the routed experts'
partial sums share one all-reduce.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from engine.model_executor.layers.fused_moe import FusedMoE, RouterConfig
from engine.model_executor.layers.linear import ReplicatedLinear

# Checkpoint names of one expert's projections -> (parameter, part).
_EXPERT_NAME = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\."
                          r"(?P<proj>w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
_PART = {"w1": "w1", "gate_proj": "w1", "w3": "w3", "up_proj": "w3", "w2": "w2",
         "down_proj": "w2"}


def expert_name_mapper(name: str) -> tuple[str, Any] | None:
    """``...experts.{e}.gate_proj.weight`` (or Mixtral's ``w1``) -> (``...experts.w13``,
    ``("w1", e)``); None for every other name."""
    match = _EXPERT_NAME.match(name)
    if match is None:
        return None
    part = _PART[match["proj"]]
    param = "w2" if part == "w2" else "w13"
    return f"{match['prefix']}.{param}", (part, int(match["expert"]))


class SparseMoeBlock(nn.Module):
    """Router + routed experts (+ shared expert): ``[T, H] -> [T, H]``, fully reduced."""

    def __init__(
        self,
        hf_config: Any,
        ctx: Any,
        router: RouterConfig,
        moe_intermediate_size: int,
        *,
        shared_expert: Callable[[], nn.Module] | None = None,
        shared_expert_name: str = "shared_expert",
        shared_expert_gate: bool = False,
        correction_bias: bool = False,
        router_dtype: torch.dtype | None = None,
        activation: str | None = None,
        gated: bool = True,
        expert_hidden_size: int | None = None,
    ) -> None:
        """``activation`` (default the config's ``hidden_act``) and ``gated`` (False:
        ungated experts, ``down(act(up x))``) describe the routed experts;
        ``expert_hidden_size``: the experts' input / output width where it is not the
        model's (a subclass projects into it, see :meth:`routed`)."""
        super().__init__()
        hidden = hf_config.hidden_size
        self.tp = ctx.tp
        # The router, replicated on every rank; ``router_dtype`` float32 where the model
        # computes its scores in float32 whatever the activations (DeepSeek).
        self.router_dtype = router_dtype or ctx.dtype
        self.gate = ReplicatedLinear(hidden, router.num_experts, bias=False,
                                     dtype=self.router_dtype, device=ctx.device)
        if correction_bias:
            self.gate.e_score_correction_bias = nn.Parameter(
                torch.zeros(router.num_experts, dtype=torch.float32, device=ctx.device),
                requires_grad=False)
        self.experts = FusedMoE(
            router, expert_hidden_size or hidden, moe_intermediate_size, dtype=ctx.dtype,
            device=ctx.device, kernels=ctx.moe_kernels, tp=ctx.tp,
            expert_parallel=ctx.expert_parallel, ep=ctx.ep,
            activation=activation or getattr(hf_config, "hidden_act", "silu"), gated=gated,
        )
        self.shared_expert_name = shared_expert_name if shared_expert is not None else None
        if shared_expert is not None:
            self.add_module(shared_expert_name, shared_expert())
        self.shared_expert_gate = (
            ReplicatedLinear(hidden, 1, bias=False, dtype=ctx.dtype, device=ctx.device)
            if shared_expert_gate else None)

    def routed(self, hidden: torch.Tensor) -> torch.Tensor:
        """The routed experts' output (partial sums under TP)."""
        bias = getattr(self.gate, "e_score_correction_bias", None)
        return self.experts(hidden, self.gate(hidden.to(self.router_dtype)), bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        routed = self.routed(hidden)
        shared = None
        if self.shared_expert_name is not None:  # partial sums under TP (no reduce)
            shared = getattr(self, self.shared_expert_name)(hidden)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(hidden)) * shared
        if self.tp is None:
            return routed if shared is None else routed + shared
        if self.experts.outputs_partial_sums:
            return self.tp.all_reduce(routed if shared is None else routed + shared)
        return routed if shared is None else routed + self.tp.all_reduce(shared)


def take_expert_load(model: nn.Module) -> torch.Tensor | None:
    """Tokens each expert received since the last call, summed over the model's MoE layers
    (None for a dense model)."""
    total = None
    for module in model.modules():
        if isinstance(module, FusedMoE):
            counts = module.take_expert_load()
            total = counts if total is None else total + counts
    return total
