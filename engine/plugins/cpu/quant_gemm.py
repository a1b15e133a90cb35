"""The CPU platform's quantized GEMM: every canonical encoding, in C, on every ISA level.

:class:`CPUQuantizedGemm` packs a layer's decoded weights once (csrc/gemm_quant.h: int4
/ int8 codes with group scales and zero points, fp8 e4m3 with tensor / channel / block
scales, nvfp4 e2m1 with fp8 group scales) and runs one C call per linear: activations
quantize-dequantized as the checkpoint's scheme says (bit-identical to
:mod:`engine.quantization.numerics`), permuted once into act-order (GPTQ ``g_idx``),
then multiplied by the weights dequantized inside the kernel. At decode sizes it
streams the packed codes once (int4: a quarter of a bf16 weight's bytes); at prefill
sizes it dequantizes blocks into the dense GEMM's register blocks. A forward graph
replays it like the dense GEMM.

The torch reference kernel (:class:`~engine.quantization.reference.TorchQuantizedGemm`)
stays behind it for what it refuses (other bit widths, shards not a multiple of 16
wide); ``$ENGINE_CPU_QUANT_GEMM=torch`` puts the reference first.
``$ENGINE_CPU_QUANT_GEMM=triton`` puts the GPU plugins' Triton weight-only int kernels
(:mod:`engine.kernels.quant_gemm_int`) first, run on CPU tensors by Triton's interpreter:
end-to-end tests of those kernels, only with ``TRITON_INTERPRET=1`` (a ValueError
otherwise); forward graphs refuse them (they replay only C kernels), so those steps run
eagerly.
"""

from __future__ import annotations

import functools
import os
from typing import ClassVar

import torch
from torch import nn

from engine.core.interfaces import QuantizedGemmKernel, QuantizedLayerSpec, QuantizedWeights
from engine.plugins.cpu.native import (
    DTYPE_CODES,
    QACT_CODES,
    QENC_FP8,
    QENC_INT,
    QENC_NVFP4,
    QSTRATEGY_CODES,
    CPUKernels,
    QGemmParams,
    load_kernels,
)

QUANT_GEMM_ENV = "ENGINE_CPU_QUANT_GEMM"  # auto | native | torch | triton (interpreted)
_ENCODINGS = {"int": QENC_INT, "fp8": QENC_FP8, "nvfp4": QENC_NVFP4}


def quant_gemm_preference() -> list[type[QuantizedGemmKernel]]:
    """The CPU platform's quantized kernels, preferred first."""
    from engine.quantization.reference import TorchQuantizedGemm

    raw = os.environ.get(QUANT_GEMM_ENV, "auto").strip().lower() or "auto"
    if raw not in ("auto", "native", "torch", "triton"):
        raise ValueError(f"{QUANT_GEMM_ENV}={raw!r}: expected auto, native or torch (or "
                         "triton, with TRITON_INTERPRET=1)")
    if raw == "torch":
        return [TorchQuantizedGemm, CPUQuantizedGemm]
    if raw == "triton":
        return [*interpreted_triton_kernels(), CPUQuantizedGemm, TorchQuantizedGemm]
    return [CPUQuantizedGemm, TorchQuantizedGemm]


def interpreted_triton_kernels() -> list[type[QuantizedGemmKernel]]:
    """The Triton int kernels (Marlin-style, then plain), unbound (they run interpreted),
    each refusing forward-graph capture; a ValueError saying what is missing."""
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise ValueError(f"{QUANT_GEMM_ENV}=triton runs the GPU plugins' Triton kernels on "
                         "the CPU through Triton's interpreter: set TRITON_INTERPRET=1 as well "
                         "(before engine.kernels is imported)")
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        from engine.kernels.triton_utils import TRITON_MISSING_MESSAGE

        raise ValueError(f"{QUANT_GEMM_ENV}=triton: {TRITON_MISSING_MESSAGE}") from exc
    from engine.kernels import quant_gemm_int

    if not quant_gemm_int.INTERPRETED:
        raise ValueError(f"{QUANT_GEMM_ENV}=triton: engine.kernels.quant_gemm_int was imported "
                         "before TRITON_INTERPRET=1 was set, so its kernels were compiled for "
                         "a GPU; set it before the engine starts")
    return [_refusing_capture(k) for k in quant_gemm_int.int_gemm_kernels(None)]


@functools.cache
def _refusing_capture(kernel_cls: type[QuantizedGemmKernel]) -> type[QuantizedGemmKernel]:
    """``kernel_cls`` whose apply refuses a CPU forward-graph capture (which would record
    only the C kernels and replay without this one)."""
    from engine.core.interfaces import GraphCaptureError
    from engine.plugins.cpu import native

    def apply(self, layer, x, bias=None):
        if getattr(native._recording, "calls", None) is not None:
            raise GraphCaptureError(f"{self.name} (interpreted Triton) cannot be replayed "
                                    "by a CPU forward graph")
        return kernel_cls.apply(self, layer, x, bias)

    return type(kernel_cls.__name__, (kernel_cls,), {"apply": apply,
                                                     "__module__": kernel_cls.__module__})


def act_order_permutation(g_idx: torch.Tensor, group: int) -> torch.Tensor | None:
    """The input features in group order (None: already in it), so a layer whose
    checkpoint permuted them (GPTQ act-order) reads its groups contiguously; a
    ValueError when a group does not hold exactly ``group`` features."""
    g_idx = g_idx.to(torch.int64)
    k = g_idx.numel()
    if bool((g_idx == torch.arange(k) // group).all()):
        return None
    counts = torch.bincount(g_idx, minlength=k // group)
    if counts.numel() != k // group or bool((counts != group).any()):
        raise ValueError(f"g_idx does not put {group} input features in each of "
                         f"{k // group} groups")
    return torch.argsort(g_idx, stable=True)


def pack_arguments(weights: QuantizedWeights) -> tuple:
    """:meth:`CPUKernels.qgemm_pack`'s arguments for canonical weights: the layer's
    parameters, its codes in act-order, scales, zero points, permutation and one
    activation scale per shard."""
    spec = weights.spec
    codes, perm = weights.codes, None
    if codes.dtype == torch.float8_e4m3fn:  # the C side reads the e4m3 bits
        codes = codes.view(torch.uint8)
    if weights.g_idx is not None:
        perm = act_order_permutation(weights.g_idx, spec.group_size)
        if perm is not None:
            codes = codes[:, perm]
    act = spec.activation
    shards = tuple(weights.shard_sizes) or (spec.out_features,)
    params = QGemmParams(
        n=spec.out_features, k=spec.in_features, encoding=_ENCODINGS[spec.encoding],
        bits=spec.weight_bits, group=spec.group_size, shard_sizes=shards,
        act=QACT_CODES[None if act is None else act.encoding],
        act_strategy=0 if act is None else QSTRATEGY_CODES[act.strategy],
        act_dynamic=bool(act is not None and act.dynamic),
        act_group=0 if act is None else (act.group_size or 0),
        has_perm=perm is not None,
        has_zeros=weights.zeros is not None,
        act_dtype=DTYPE_CODES[spec.act_dtype],
    )
    act_scales = weights.input_scales
    if act_scales is not None:
        act_scales = act_scales.reshape(-1).float()
        if act_scales.numel() == 1 and len(shards) > 1:
            act_scales = act_scales.repeat(len(shards))
    zeros = None if weights.zeros is None else weights.zeros.float().contiguous()
    return (params, codes.contiguous(), weights.scales.float().contiguous(), zeros, perm,
            act_scales)


class CPUQuantizedGemm(QuantizedGemmKernel):
    """``y = QDQ(x) dequant(W)^T + b`` through csrc/gemm_quant.h (module docstring)."""

    name: ClassVar[str] = "cpu_qgemm"

    def __init__(self, kernels: CPUKernels | None = None) -> None:
        kernels = kernels or load_kernels()
        if kernels is None:
            raise RuntimeError(f"{self.name} needs the plugin's C kernels")
        self.kernels = kernels
        self.path: str | None = None  # set by prepare: how the layer multiplies

    @classmethod
    def can_implement(cls, spec: QuantizedLayerSpec) -> str | None:
        if spec.act_dtype not in DTYPE_CODES:
            return f"activations in {spec.act_dtype}"
        if spec.encoding == "int" and spec.weight_bits not in (4, 8):
            return f"{spec.weight_bits}-bit int codes (it takes 4 and 8)"
        if spec.encoding not in _ENCODINGS:
            return f"{spec.encoding} weights"
        if spec.in_features % spec.group_size or spec.in_features % 2:
            return f"{spec.in_features} input features in groups of {spec.group_size}"
        shards = spec.shard_sizes or (spec.out_features,)
        if any(size % 16 for size in shards):
            return f"output shards {list(shards)} (it takes multiples of 16)"
        act = spec.activation
        if act is not None and act.encoding == "nvfp4" and (not act.dynamic
                                                            or act.group_size != 16):
            return "nvfp4 activations other than dynamic groups of 16"
        if act is not None and act.strategy == "group" and (
                not act.group_size or spec.in_features % act.group_size):
            return f"activation groups of {act.group_size} over {spec.in_features} features"
        if load_kernels() is None:
            return "the plugin's C kernels could not be built here"
        return None

    @property
    def description(self) -> str:
        path = "" if self.path in (None, "float32") else f", {self.path}"
        return f"{self.name} ({self.kernels.level}{path})"

    @property
    def vnni(self) -> bool:
        return self.path == "int8 vnni"

    def prepare(self, layer: nn.Module, weights: QuantizedWeights) -> None:
        packed = self.kernels.qgemm_pack(*pack_arguments(weights))
        layer.register_buffer("q_packed", packed, persistent=False)
        layer.quant_spec = weights.spec
        self.path = self.kernels.qgemm_path(packed)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
              ) -> torch.Tensor:
        if self.path == "int4 x bf16" and x.dtype != torch.bfloat16:
            raise ValueError(f"this int4 layer was packed for bfloat16 activations (vdpbf16ps), "
                             f"not {x.dtype}")
        return self.kernels.qgemm(layer.q_packed, x, layer.quant_spec.out_features, bias)
