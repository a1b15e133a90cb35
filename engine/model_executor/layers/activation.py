"""Gated activations on a merged ``gate_up`` projection: ``act(gate) * up``."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.core.interfaces import FusedOps

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
}


class ActAndMul(nn.Module):
    """``x [..., 2*I] -> act(x[..., :I]) * x[..., I:]``."""

    def __init__(self, act: Callable[[torch.Tensor], torch.Tensor], name: str) -> None:
        super().__init__()
        self.act = act
        self.name = name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return self.act(gate) * up

    def extra_repr(self) -> str:
        return self.name


class SiluAndMul(ActAndMul):
    """SwiGLU; through the platform's fused kernel for the dtypes it supports."""

    def __init__(self, fused_ops: FusedOps | None = None, dtype: torch.dtype | None = None):
        super().__init__(F.silu, "silu")
        usable = fused_ops is not None and dtype is not None and fused_ops.supports(dtype)
        self.fused_ops = fused_ops if usable else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_ops is not None and x.dim() == 2 and x.stride(-1) == 1:
            return self.fused_ops.silu_and_mul(x)
        return super().forward(x)


def get_act_and_mul(
    hidden_act: str, fused_ops: FusedOps | None = None, dtype: torch.dtype | None = None
) -> ActAndMul:
    """The gated activation named by a HF config's ``hidden_act`` (``fused_ops`` and
    ``dtype``: the platform's fused kernel, used where it supports the dtype)."""
    if hidden_act in ("silu", "swish"):
        return SiluAndMul(fused_ops, dtype)
    if hidden_act not in _ACTIVATIONS:
        raise ValueError(
            f"activation {hidden_act!r} is not supported; supported: "
            + ", ".join(sorted(_ACTIVATIONS))
        )
    return ActAndMul(_ACTIVATIONS[hidden_act], hidden_act)
