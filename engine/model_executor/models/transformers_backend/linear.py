"""The engine's linear / embedding layers in place of a transformers model's ``nn.Linear``
and ``nn.Embedding`` modules.

Each ``nn.Linear`` becomes a replicated, column- or row-parallel engine layer (by the
model's ``base_model_tp_plan`` under tensor parallelism: ``colwise`` / ``rowwise``;
replicated on one rank and for the plan's other styles) under the same name, so checkpoint names load unchanged and the
platform's dense GEMM kernels repack them. transformers calls them on ``[1, T, in]``: the
wrappers flatten the leading dims for the engine's 2-D kernels.
"""

from __future__ import annotations

import fnmatch
from typing import Any

import torch
from torch import nn

from engine.model_executor.layers.embedding import VocabEmbedding
from engine.model_executor.layers.linear import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)


def _flat_forward(base: type) -> Any:
    def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:
            return base.forward(self, x)
        out = base.forward(self, x.reshape(-1, x.shape[-1]))
        return out.view(*x.shape[:-1], out.shape[-1])
    return forward


class HFReplicatedLinear(ReplicatedLinear):
    forward = _flat_forward(ReplicatedLinear)


class HFColumnParallelLinear(ColumnParallelLinear):
    forward = _flat_forward(ColumnParallelLinear)


class HFRowParallelLinear(RowParallelLinear):
    forward = _flat_forward(RowParallelLinear)


class HFVocabEmbedding(VocabEmbedding):
    """``ids [..., T] -> [..., T, hidden]`` (transformers passes ``[1, T]``)."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        flat = super().forward(input_ids.reshape(-1))
        return flat.view(*input_ids.shape, flat.shape[-1])


def tp_style(name: str, tp_plan: dict[str, str], base_prefix: str) -> str | None:
    """The tensor-parallel style of module ``name`` in the model's base tp plan."""
    local = name.removeprefix(base_prefix + ".") if base_prefix else name
    for pattern, style in tp_plan.items():
        if fnmatch.fnmatchcase(local, pattern) or fnmatch.fnmatchcase(name, pattern):
            return style
    return None


def replace_linear(hf_linear: nn.Linear, name: str, ctx: Any, tp_plan: dict[str, str],
                   base_prefix: str) -> nn.Module:
    common = {**ctx.matrix_dtypes, "device": ctx.device,
              "quant_method": ctx.linear_method(name)}
    bias = hf_linear.bias is not None
    args = (hf_linear.in_features, hf_linear.out_features)
    if ctx.tp is None:
        return HFReplicatedLinear(*args, bias=bias, **common)
    style = tp_style(name, tp_plan, base_prefix)
    if style == "colwise":
        return HFColumnParallelLinear(*args, bias=bias, tp=ctx.tp, **common)
    if style == "rowwise":
        return HFRowParallelLinear(*args, bias=bias, tp=ctx.tp, **common)
    # Other styles (colwise_gather_output / rowwise_split_input around a norm over the
    # whole projection or a fused qkv, MLA's kv_a ...): the whole layer on every rank.
    return HFReplicatedLinear(*args, bias=bias, **common)
