"""Quantization: the checkpoint format (QuantMethod) and the GEMM kernel are separate.

A QuantMethod knows a format (AWQ, GPTQ, FP8, ...): which tensors a layer owns, how to
post-process them after loading. It never contains device code: at apply time it asks
the platform's quantized-GEMM kernels, in preference order, which one can implement the
layer, and each kernel answers yes or says why not.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class QuantizedLayerSpec:
    """What a GEMM kernel needs to know to accept or refuse a layer."""

    scheme: str  # e.g. "awq", "gptq", "fp8", "nvfp4"
    weight_bits: int
    group_size: int | None
    in_features: int
    out_features: int
    act_dtype: "torch.dtype"
    has_zero_points: bool = False
    extra: tuple[tuple[str, Any], ...] = ()


class QuantizedGemmKernel(ABC):
    """A platform's implementation of ``y = x @ dequant(W).T (+ bias)`` for some schemes."""

    name: ClassVar[str]
    schemes: ClassVar[tuple[str, ...]]

    @classmethod
    @abstractmethod
    def can_implement(cls, spec: QuantizedLayerSpec) -> str | None:
        """None if this kernel can run ``spec``; otherwise why it cannot."""

    @abstractmethod
    def prepare(self, layer: Any) -> None:
        """Repack the layer's loaded tensors into this kernel's preferred layout."""

    @abstractmethod
    def apply(
        self, layer: Any, x: "torch.Tensor", bias: "torch.Tensor | None" = None
    ) -> "torch.Tensor":
        """Run the quantized GEMM."""


class QuantMethod(ABC):
    """One checkpoint quantization format, applied to linear layers."""

    name: ClassVar[str]

    @classmethod
    @abstractmethod
    def from_config(cls, quant_config: dict[str, Any]) -> "QuantMethod":
        """Build from the checkpoint's ``quantization_config``."""

    @abstractmethod
    def create_weights(
        self, layer: Any, in_features: int, out_features: int, params_dtype: "torch.dtype"
    ) -> None:
        """Register the (packed) parameters the checkpoint provides for ``layer``."""

    @abstractmethod
    def layer_spec(self, layer: Any) -> QuantizedLayerSpec:
        """Describe ``layer`` for kernel selection."""

    def select_kernel(
        self, layer: Any, kernels: list[type[QuantizedGemmKernel]]
    ) -> QuantizedGemmKernel:
        """First kernel that accepts the layer; a clear error listing every refusal."""
        spec = self.layer_spec(layer)
        reasons = []
        for kernel_cls in kernels:
            why = kernel_cls.can_implement(spec)
            if why is None:
                return kernel_cls()
            reasons.append(f"{kernel_cls.name}: {why}")
        detail = "; ".join(reasons) or "the platform offers no quantized-GEMM kernels"
        raise ValueError(f"no kernel can run {spec.scheme} layer {spec}: {detail}")

    def process_weights_after_loading(
        self, layer: Any, kernels: list[type[QuantizedGemmKernel]]
    ) -> None:
        """Pick the kernel and let it repack the loaded tensors."""
        layer.quant_kernel = self.select_kernel(layer, kernels)
        layer.quant_kernel.prepare(layer)

    def apply(
        self, layer: Any, x: "torch.Tensor", bias: "torch.Tensor | None" = None
    ) -> "torch.Tensor":
        return layer.quant_kernel.apply(layer, x, bias)
