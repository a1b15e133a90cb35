"""Gated activations on a merged ``gate_up`` projection: ``act(gate) * up``."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

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
    def __init__(self) -> None:
        super().__init__(F.silu, "silu")


def get_act_and_mul(hidden_act: str) -> ActAndMul:
    """The gated activation named by a HF config's ``hidden_act``."""
    if hidden_act in ("silu", "swish"):
        return SiluAndMul()
    if hidden_act not in _ACTIVATIONS:
        raise ValueError(
            f"activation {hidden_act!r} is not supported; supported: "
            + ", ".join(sorted(_ACTIVATIONS))
        )
    return ActAndMul(_ACTIVATIONS[hidden_act], hidden_act)
