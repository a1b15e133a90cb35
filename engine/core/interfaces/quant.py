"""Quantization: the checkpoint format (QuantMethod) and the GEMM kernel are separate.

A :class:`QuantMethod` knows one checkpoint format (compressed-tensors, GPTQ, AWQ, FP8):
which tensors a linear layer owns, with the metadata the loader slices fused shards by,
and how to decode them after loading into one of three canonical encodings
(:class:`QuantizedWeights`): integer codes with group scales and zero points, FP8 values
with scales, or NVFP4 (e2m1) codes with group scales. A :class:`QuantizedGemmKernel`
multiplies one encoding. The platform offers kernels in preference order; each accepts
a layer's :class:`QuantizedLayerSpec` or says why not, and a layer no kernel accepts is
a clear error listing every refusal. Neither side knows the other: a format never
contains device code and a kernel never parses a checkpoint.

Activations a checkpoint was calibrated with quantized (W8A8, FP8, NVFP4) are quantized
exactly as the format says (:class:`ActivationQuant`), then either dequantized for a
floating-point GEMM or multiplied as integers by a kernel that can.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

if TYPE_CHECKING:
    import torch

Encoding = Literal["int", "fp8", "nvfp4"]


@dataclass(frozen=True)
class ActivationQuant:
    """How a layer's input is quantized before its GEMM.

    ``encoding`` int8 (symmetric, scale = max|x| / 127.5), fp8 (e4m3, scale = max|x| /
    448) or nvfp4 (e2m1 per group of 16, the group scale rounded to fp8 after
    multiplying by the layer's global input scale). ``strategy``: one scale per token
    (row), per tensor, or per ``group_size`` values of a row. ``dynamic``: scales
    computed from each input; static ones come from the checkpoint (per fused shard).
    """

    encoding: Literal["int8", "fp8", "nvfp4"]
    strategy: Literal["token", "tensor", "group"]
    dynamic: bool
    group_size: int | None = None


@dataclass(frozen=True)
class QuantizedLayerSpec:
    """What a GEMM kernel needs to know to accept or refuse a layer."""

    scheme: str  # the checkpoint's scheme, for messages: "gptq", "compressed-tensors w4a16"
    encoding: Encoding
    weight_bits: int
    group_size: int  # input features per weight scale (in_features: per channel / tensor)
    in_features: int
    out_features: int
    act_dtype: "torch.dtype"
    has_zero_points: bool = False
    act_order: bool = False  # input features permuted into their groups (GPTQ g_idx)
    activation: ActivationQuant | None = None  # None: weight-only
    shard_sizes: tuple[int, ...] = ()  # output features per fused shard (q / k / v, ...)
    extra: tuple[tuple[str, Any], ...] = ()


@dataclass
class QuantizedWeights:
    """A linear layer's weights decoded into the canonical form of ``spec.encoding``,
    rows = output features (N), columns = input features (K):

    - ``int``: ``codes`` uint8 ``[N, K]``, unsigned (0 .. 2^bits - 1); weight =
      (code - zero) * scale with ``scales`` float32 ``[N, K / group]`` and ``zeros``
      float32 ``[N, K / group]`` (None: the midpoint 2^(bits-1), symmetric schemes);
    - ``fp8``: ``codes`` float8_e4m3fn ``[N, K]``; weight = code * scale, ``scales``
      float32 ``[N, K / group]`` (per-tensor and per-channel scales repeated, 128 x 128
      blocks per row);
    - ``nvfp4``: ``codes`` uint8 ``[N, K / 2]``, two e2m1 codes a byte (even k in the low
      nibble; bit 3 the sign); weight = bf16(e2m1 * scale), ``scales`` float32
      ``[N, K / 16]`` (the fp8 group scale divided by the shard's global scale). The
      product is rounded to bf16 as compressed-tensors decompresses NVFP4 (and as the
      checkpoints' own references compute), a 2^-9 relative step far below e2m1's.

    ``g_idx`` int64 ``[K]``: the group of every input feature when the checkpoint orders
    them (act-order); None: feature k is in group k // group. ``input_scales`` float32
    ``[S]``: per output shard (``shard_sizes``), the static activation scale (int8 /
    fp8 per tensor) or NVFP4's global input scale; None when activations have none.
    """

    spec: QuantizedLayerSpec
    codes: "torch.Tensor"
    scales: "torch.Tensor"
    zeros: "torch.Tensor | None" = None
    g_idx: "torch.Tensor | None" = None
    input_scales: "torch.Tensor | None" = None
    shard_sizes: tuple[int, ...] = field(default_factory=tuple)


class QuantizedGemmKernel(ABC):
    """A platform's ``y = quantize(x) @ dequant(W).T (+ bias)`` for some encodings."""

    name: ClassVar[str]

    @classmethod
    @abstractmethod
    def can_implement(cls, spec: QuantizedLayerSpec) -> str | None:
        """None if this kernel can run ``spec``; otherwise why it cannot."""

    @abstractmethod
    def prepare(self, layer: Any, weights: QuantizedWeights) -> None:
        """Take the decoded weights into this kernel's layout, held by ``layer`` (as
        buffers, so the model's memory report counts them)."""

    @abstractmethod
    def apply(
        self, layer: Any, x: "torch.Tensor", bias: "torch.Tensor | None" = None
    ) -> "torch.Tensor":
        """``x [..., K] -> [..., N]`` in x's dtype."""


class QuantMethod(ABC):
    """One checkpoint quantization format (``quantization_config.quant_method``).

    ``from_config`` reads the checkpoint's config; ``linear_method`` answers, per linear
    layer (its checkpoint names: several for a fused layer), the method that creates,
    loads and decodes its tensors, or None for a layer the checkpoint left unquantized.
    """

    name: ClassVar[str]  # quant_method in config.json; what --quantization selects

    @classmethod
    @abstractmethod
    def from_config(cls, quant_config: dict[str, Any]) -> "QuantMethod":
        """Build from the checkpoint's ``quantization_config`` (ValueError when bad)."""

    @abstractmethod
    def linear_method(self, prefixes: tuple[str, ...]) -> Any:
        """The LinearMethod of the layer whose checkpoint modules are ``prefixes``
        (e.g. ``("model.layers.0.self_attn.q_proj", ...k_proj, ...v_proj)``), or None
        when they are not quantized."""

    def describe(self) -> str:
        return self.name


def select_quantized_kernel(
    spec: QuantizedLayerSpec, kernels: list[type[QuantizedGemmKernel]]
) -> QuantizedGemmKernel:
    """The first kernel that accepts ``spec``; a ValueError listing every refusal."""
    reasons = []
    for kernel_cls in kernels:
        why = kernel_cls.can_implement(spec)
        if why is None:
            return kernel_cls()
        reasons.append(f"{kernel_cls.name}: {why}")
    detail = "; ".join(reasons) or "the platform offers no quantized-GEMM kernels"
    raise ValueError(f"no kernel can run this {spec.scheme} layer ({spec.encoding} "
                     f"{spec.weight_bits}-bit weights, {spec.out_features}x{spec.in_features}, "
                     f"group {spec.group_size}): {detail}")
