"""The engine's gated MLP in place of transformers' Llama-style MLP modules.

``LlamaMLP`` (and the families that copy it) runs ``down(act(gate(x)) * up(x))``: two
GEMMs over the same input and an activation, a multiply and their temporaries in torch.
:class:`FusedGatedMLP` is the native Llama's block: one ``gate_up_proj`` GEMM (column
parallel under TP), the platform's fused ``act_and_mul`` and ``down_proj`` (row parallel).
Only modules whose ``forward`` is textually Llama's, with bias-free or biased ``nn.Linear``
projections of matching shapes, are replaced; the checkpoint's ``gate_proj`` / ``up_proj``
tensors load into the fused matrix as its two shards (:func:`fused_mlp_name_mapper`).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from engine.model_executor.layers.activation import get_act_and_mul
from engine.model_executor.layers.linear import MergedLinear, RowParallelLinear
from engine.model_executor.models.transformers_backend.linear import tp_style
from engine.model_executor.models.transformers_backend.support import same_forward_as


def is_llama_mlp(module: nn.Module) -> bool:
    """Whether ``module`` computes exactly ``LlamaMLP``'s forward over plain linears."""
    from transformers.models.llama.modeling_llama import LlamaMLP

    if not same_forward_as(module, LlamaMLP):
        return False
    gate, up, down = (getattr(module, n, None) for n in ("gate_proj", "up_proj", "down_proj"))
    if not all(type(m) is nn.Linear for m in (gate, up, down)):
        return False
    return (gate.weight.shape == up.weight.shape
            and down.in_features == gate.out_features and down.out_features == gate.in_features
            and (gate.bias is None) == (up.bias is None))


class FusedGatedMLP(nn.Module):
    """``down(act_and_mul(gate_up(x)))`` over any leading dims."""

    def __init__(self, hidden: int, inter: int, hidden_act: str, bias: bool, down_bias: bool,
                 ctx: Any, prefix: str) -> None:
        super().__init__()
        common = {**ctx.matrix_dtypes, "device": ctx.device}
        self.gate_up_proj = MergedLinear(
            hidden, {0: inter, 1: inter}, bias=bias, **common, tp=ctx.tp,
            quant_method=ctx.linear_method(f"{prefix}.gate_proj", f"{prefix}.up_proj"))
        self.down_proj = RowParallelLinear(
            inter, hidden, bias=down_bias, **common, tp=ctx.tp,
            quant_method=ctx.linear_method(f"{prefix}.down_proj"))
        self.act_fn = get_act_and_mul(hidden_act, ctx.fused_ops, ctx.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        out = self.down_proj(self.act_fn(self.gate_up_proj(flat)))
        return out.view(*x.shape[:-1], out.shape[-1])


def _hidden_act(module: nn.Module) -> str | None:
    config = getattr(module, "config", None)
    act = getattr(config, "hidden_act", None) or getattr(config, "hidden_activation", None)
    return act if isinstance(act, str) else None


def replace_mlps(model: nn.Module, ctx: Any, tp_plan: dict[str, str], base_prefix: str) -> int:
    """Swap every Llama-style MLP of ``model`` whose activation the platform fuses (and,
    under TP, whose plan shards gate/up by columns and down by rows) for
    :class:`FusedGatedMLP`; how many were swapped."""
    swapped = 0
    for name, module in list(model.named_modules()):
        if not name or not is_llama_mlp(module):
            continue
        act = _hidden_act(module)
        if act is None:
            continue
        if ctx.tp is not None and not (
                tp_style(f"{name}.gate_proj", tp_plan, base_prefix) == "colwise"
                and tp_style(f"{name}.up_proj", tp_plan, base_prefix) == "colwise"
                and tp_style(f"{name}.down_proj", tp_plan, base_prefix) == "rowwise"):
            continue
        try:
            fused = FusedGatedMLP(module.gate_proj.in_features, module.gate_proj.out_features,
                                  act, module.gate_proj.bias is not None,
                                  module.down_proj.bias is not None, ctx, name)
        except ValueError:  # an activation without a fused act_and_mul: keep transformers'
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, fused)
        swapped += 1
    return swapped


_GATE_OR_UP = re.compile(r"^(.*)\.(gate_proj|up_proj)\.(.+)$")


def fused_mlp_name_mapper(model: nn.Module) -> Any:
    """``X.gate_proj.P`` / ``X.up_proj.P`` -> ``(X.gate_up_proj.P, 0 | 1)`` where ``X`` is
    a fused MLP (None for every other name)."""
    fused = {n for n, m in model.named_modules() if isinstance(m, FusedGatedMLP)}

    def mapper(name: str) -> tuple[str, Any] | None:
        m = _GATE_OR_UP.match(name)
        if m is None or m.group(1) not in fused:
            return None
        return f"{m.group(1)}.gate_up_proj.{m.group(3)}", 0 if m.group(2) == "gate_proj" else 1

    return mapper
