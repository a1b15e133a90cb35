"""The engine's RMSNorm in place of transformers' Llama-style RMSNorm modules.

transformers' ``LlamaRMSNorm`` (and the many families that copy it verbatim) normalizes
op by op in Python: five tensor ops and a cast per call, twice per layer plus the q/k
norms of some families. The engine's :class:`RMSNorm` computes the same thing (float32
normalization, cast back, then the weight) in one platform kernel. Only modules whose
``forward`` is textually Llama's are replaced, so a variant (Gemma's ``1 + weight``,
OLMo's weight-before-cast) keeps its own code.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.model_executor.layers.norm import RMSNorm
from engine.model_executor.models.transformers_backend.support import same_forward_as


def is_llama_rms_norm(module: nn.Module) -> bool:
    """Whether ``module`` computes exactly ``LlamaRMSNorm``'s forward."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    weight = getattr(module, "weight", None)
    return (same_forward_as(module, LlamaRMSNorm) and isinstance(weight, nn.Parameter) and weight.dim() == 1
            and isinstance(getattr(module, "variance_epsilon", None), float))


class HFRMSNorm(RMSNorm):
    """``norm(x)`` over any leading dims (transformers passes ``[1, T, H]`` or
    ``[1, T, heads, D]``)."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        if residual is not None or x.dim() <= 3:
            return super().forward(x, residual)
        return super().forward(x.reshape(-1, x.shape[-1])).view(x.shape)


def replace_rms_norms(model: nn.Module, ctx: Any) -> int:
    """Swap every Llama-style RMSNorm of ``model`` for :class:`HFRMSNorm` (same parameter
    name ``weight``); how many were swapped."""
    swapped = 0
    for name, module in list(model.named_modules()):
        if not name or not is_llama_rms_norm(module):
            continue
        norm = HFRMSNorm(module.weight.shape[0], module.variance_epsilon, dtype=ctx.dtype,
                         device=ctx.device, fused_ops=ctx.fused_ops)
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, norm)
        swapped += 1
    return swapped
