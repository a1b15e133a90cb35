"""Dense (unquantized) GEMM kernels: a platform may run ``y = x W^T + b`` its own way.

Model code owns its weights in the checkpoint's ``[out, in]`` layout. After loading,
the engine offers each unquantized linear layer to the platform's dense-GEMM kernels
in preference order; the first that accepts it repacks the weight once into the layout
its GEMM reads fastest (e.g. oneDNN's blocked format on CPU, where a prepacked weight
avoids a reorder inside every call). A weight another layer also reads in its plain
layout (an LM head tied to the embedding) is offered only to kernels that keep the
layout (``keeps_layout``). Layers no kernel accepts keep ``F.linear``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class DenseLayerSpec:
    """What a dense-GEMM kernel needs to know to accept or refuse a layer."""

    in_features: int
    out_features: int
    dtype: "torch.dtype"
    device: "torch.device"
    # The weight is shared with a layer that reads it as a plain [out, in] matrix.
    shared: bool = False


class DenseGemmKernel(ABC):
    """A platform's implementation of ``y = x @ W.T (+ bias)`` for unquantized weights."""

    name: ClassVar[str]
    # True: prepare() returns the weight unchanged, so shared weights may use the kernel.
    keeps_layout: ClassVar[bool] = False

    @classmethod
    @abstractmethod
    def can_implement(cls, spec: DenseLayerSpec) -> str | None:
        """None if this kernel can run ``spec``; otherwise why it cannot."""

    @abstractmethod
    def prepare(self, weight: "torch.Tensor") -> "torch.Tensor":
        """The ``[out, in]`` weight repacked for :meth:`apply` (called once, after loading)."""

    @abstractmethod
    def apply(
        self, weight: "torch.Tensor", x: "torch.Tensor", bias: "torch.Tensor | None" = None
    ) -> "torch.Tensor":
        """``x [..., in] -> [..., out]`` with the weight :meth:`prepare` returned."""
