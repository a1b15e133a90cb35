"""Dense (unquantized) GEMM kernels: a platform may run ``y = x W^T + b`` its own way.

Model code owns its weights in the checkpoint's ``[out, in]`` layout. After loading,
the engine offers each unquantized linear layer to the platform's dense-GEMM kernels
in preference order; the first that accepts it repacks the weight once into the layout
its GEMM reads fastest (e.g. oneDNN's blocked format on CPU, where a prepacked weight
avoids a reorder inside every call). A weight another layer also reads in its plain
layout (an LM head tied to the embedding) is offered only to kernels that keep the
layout (``keeps_layout``). Layers no kernel accepts keep ``F.linear`` (their weight
widened to the activation dtype first, when the two differ).

Weights may be stored narrower than the activations are computed in: a bf16 checkpoint
on a CPU without bf16 arithmetic keeps its bf16 weights (half the bytes a decode step
streams) and computes in float32; ``DenseLayerSpec.activation_dtype`` says so, and a
kernel that accepts such a layer widens the weight itself.

Batch-invariant mode (``engine.core.batch_invariance``) offers a layer only to kernels
whose ``batch_invariant`` is True: each output row reduced over k in one order whatever
the row count, the row's place among the rows and the step (prefill, decode, speculative
verification); layers none takes run ``F.linear`` on fixed-shape row chunks.
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
    dtype: "torch.dtype"  # the weight's
    device: "torch.device"
    # The weight is shared with a layer that reads it as a plain [out, in] matrix.
    shared: bool = False
    # The dtype of x and y (None: the weight's).
    activation_dtype: "torch.dtype | None" = None
    # Batch-invariant mode: only kernels with ``batch_invariant`` may take the layer.
    batch_invariant: bool = False

    @property
    def act_dtype(self) -> "torch.dtype":
        return self.dtype if self.activation_dtype is None else self.activation_dtype


class DenseGemmKernel(ABC):
    """A platform's implementation of ``y = x @ W.T (+ bias)`` for unquantized weights."""

    name: ClassVar[str]
    # True: prepare() returns the weight unchanged, so shared weights may use the kernel.
    keeps_layout: ClassVar[bool] = False
    # True: a row's result does not depend on how many rows a call has or where it sits
    # among them (the kernel runs in batch-invariant mode, set up by ``prepare``).
    batch_invariant: ClassVar[bool] = False

    @classmethod
    @abstractmethod
    def can_implement(cls, spec: DenseLayerSpec) -> str | None:
        """None if this kernel can run ``spec``; otherwise why it cannot."""

    @abstractmethod
    def prepare(self, weight: "torch.Tensor", spec: DenseLayerSpec) -> "torch.Tensor":
        """The ``[out, in]`` weight repacked for :meth:`apply` on layers of ``spec``
        (called once, after loading)."""

    @abstractmethod
    def apply(
        self, weight: "torch.Tensor", x: "torch.Tensor", bias: "torch.Tensor | None" = None
    ) -> "torch.Tensor":
        """``x [..., in] -> [..., out]`` in x's dtype, with the weight :meth:`prepare`
        returned."""
