"""The float64 routing loop every fused-MoE kernel test compares with; each test gives
its own expert (gated, ungated, with biases, GPT-OSS's clamped SwiGLU)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def routed_reference(hidden: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor,
                     expert: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``out[t] = sum_j topk_weights[t, j] * expert(topk_ids[t, j], x[t])`` in float64,
    token by token, choice by choice; a choice ``-1`` (another rank's) adds nothing."""
    x = hidden.double()
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            if e >= 0:
                out[t] += float(topk_weights[t, j]) * expert(e, x[t])
    return out
