"""The CPU platform's GEMMs for unquantized linears, weights repacked once after loading.

:class:`CPUPackedGemm` runs the plugin's C GEMM (csrc/gemm.c) from the library of this
CPU's ISA level, on the weight packed once into panels that stream as one sequence:
float32 multiply-adds on every level, bf16 / fp16 weights widened inside the kernel (so
a bf16 checkpoint keeps half the bytes on a CPU without bf16 arithmetic), and bf16 x
bf16 through vdpbf16ps where the CPU has AVX512-BF16. Its fixed cost is ~2 us per call
against oneDNN's ~15 us, and as a C kernel a forward graph can replay it. A weight that
must stay plain (an LM head tied to the embedding, which ``F.linear`` would reorder in
every call) gets :class:`CPUPlainGemm`.

:class:`OneDNNPackedGemm` calls oneDNN's linear on a weight reordered once into its
blocked layout (``F.linear`` would reorder it inside every call). It comes first only
where it is measured faster: AMX CPUs at prefill sizes, until the plugin has AMX tiles
of its own (``python ci/bench_gemm.py`` compares the kernels; ``$ENGINE_CPU_GEMM``
overrides the order). oneDNN is a torch op, so forwards that use it run eagerly.
"""

from __future__ import annotations

import os
from typing import ClassVar

import torch
import torch.nn.functional as F

from engine.core.interfaces import DenseGemmKernel, DenseLayerSpec
from engine.plugins.cpu import kernel_build
from engine.plugins.cpu.native import DTYPE_CODES, CPUKernels, load_kernels

AMX_FLAGS = frozenset({"amx_bf16", "amx_tile"})
GEMM_ENV = "ENGINE_CPU_GEMM"  # auto | native | onednn
_GEMM_CHOICES = {"auto": "auto", "native": "native", "onednn": "onednn",
                 "avx512_bf16": "native"}  # the C kernel's name before it covered every level


def gemm_preference() -> list[type[DenseGemmKernel]]:
    """The CPU platform's dense kernels, preferred first: the plugin's C GEMM before
    oneDNN unless the CPU has AMX and the loaded kernels have no AMX tiles
    (``$ENGINE_CPU_GEMM`` = ``native`` or ``onednn`` puts that one first whatever the CPU);
    the plain-layout GEMM takes the shared weights both refuse."""
    raw = os.environ.get(GEMM_ENV, "auto").strip().lower() or "auto"
    choice = _GEMM_CHOICES.get(raw)
    if choice is None:
        raise ValueError(f"{GEMM_ENV}={raw!r}: expected auto, native or onednn")
    if choice == "auto":
        amx_cpu = AMX_FLAGS <= kernel_build.cpu_flags()
        choice = "native"
        if amx_cpu:
            kernels = load_kernels()
            choice = "onednn" if not (kernels and kernels.has_amx) else "native"
    if choice == "onednn":
        return [OneDNNPackedGemm, CPUPackedGemm, CPUPlainGemm]
    return [CPUPackedGemm, OneDNNPackedGemm, CPUPlainGemm]


def _onednn_linear_available() -> bool:
    ops = torch.ops.mkldnn
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(ops, "_reorder_linear_weight")
        and hasattr(ops, "_linear_pointwise")
    )


class OneDNNPackedGemm(DenseGemmKernel):
    """``y = x W^T + b`` through oneDNN with ``W`` reordered once into its blocked layout."""

    name: ClassVar[str] = "onednn_packed"

    @classmethod
    def can_implement(cls, spec: DenseLayerSpec) -> str | None:
        if spec.device.type != "cpu":
            return f"weights on {spec.device}, not the CPU"
        if spec.act_dtype != spec.dtype:
            return f"{spec.dtype} weights with {spec.act_dtype} activations"
        if not _onednn_linear_available():
            return "this torch build has no oneDNN linear ops"
        if spec.dtype == torch.float32:
            return None
        if spec.dtype == torch.bfloat16:
            if torch.ops.mkldnn._is_mkldnn_bf16_supported():
                return None
            return "oneDNN has no bf16 GEMM for this CPU"
        return f"dtype {spec.dtype} is not packed (float32 and bfloat16 are)"

    def prepare(self, weight: torch.Tensor, spec: DenseLayerSpec) -> torch.Tensor:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)

    def apply(
        self, weight: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _native_refusal(spec: DenseLayerSpec) -> str | None:
    """Why the plugin's C GEMMs cannot take ``spec`` at all (None: they can)."""
    if spec.device.type != "cpu":
        return f"weights on {spec.device}, not the CPU"
    if spec.dtype not in DTYPE_CODES or spec.act_dtype not in DTYPE_CODES:
        return f"{spec.dtype} weights / {spec.act_dtype} activations are not float types"
    if spec.act_dtype not in (spec.dtype, torch.float32):
        return f"{spec.dtype} weights with {spec.act_dtype} activations (float32 or the same)"
    if load_kernels() is None:
        return "the plugin's C kernels could not be built here"
    return None


class _NativeKernel(DenseGemmKernel):
    """A GEMM of the plugin's C library (this CPU's ISA level, or ``kernels``)."""

    def __init__(self, kernels: CPUKernels | None = None) -> None:
        kernels = kernels or load_kernels()
        if kernels is None:
            raise RuntimeError(f"{self.name} needs the plugin's C kernels")
        self.kernels = kernels

    @property
    def description(self) -> str:
        return f"{self.name} ({self.kernels.level})"


class CPUPackedGemm(_NativeKernel):
    """``y = x W^T + b`` through the plugin's C GEMM, ``W`` packed into its panel layout
    once (in its own dtype: bf16 and fp16 weights are widened inside the kernel)."""

    name: ClassVar[str] = "cpu_packed"
    batch_invariant: ClassVar[bool] = True  # one k order per row (csrc: batch_invariant_mode)

    @classmethod
    def can_implement(cls, spec: DenseLayerSpec) -> str | None:
        refusal = _native_refusal(spec)
        if refusal is not None:
            return refusal
        return CPUKernels.gemm_refusal(spec.out_features, spec.in_features)

    def prepare(self, weight: torch.Tensor, spec: DenseLayerSpec) -> torch.Tensor:
        return self.kernels.pack(weight.detach(), spec.act_dtype)

    def apply(
        self, weight: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.kernels.gemm(weight, x, bias)


# Rows of x from which a bf16 x bf16 plain-layout GEMM goes to F.linear (oneDNN, which
# reorders the weight in every call) on CPUs with AVX512-BF16: the C dot products reduce
# lanes for every (row, weight row) pair, which dominates at K ~ 512 (a tied 16000 x 512
# head at 64 rows: 2.55 ms in C, 1.24 ms through F.linear, measured on a Zen 5).
PLAIN_ONEDNN_ROWS = 16


class CPUPlainGemm(_NativeKernel):
    """``y = x W^T + b`` on the plain ``[out, in]`` weight, kept as it is so a weight
    shared with the embedding can use it: dot products of x rows with weight rows, a
    block of weight rows at a time (a tied 16000 x 512 LM head at one row: ~3x F.linear),
    and from 24 rows panels transposed on the fly for the packed GEMM's register blocks."""

    name: ClassVar[str] = "cpu_plain"
    keeps_layout: ClassVar[bool] = True
    batch_invariant: ClassVar[bool] = True  # in the mode, never F.linear from some rows

    @classmethod
    def can_implement(cls, spec: DenseLayerSpec) -> str | None:
        return _native_refusal(spec)

    def prepare(self, weight: torch.Tensor, spec: DenseLayerSpec) -> torch.Tensor:
        return weight

    def apply(
        self, weight: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        rows = x.numel() // max(x.shape[-1], 1)
        if (rows >= PLAIN_ONEDNN_ROWS and not self.kernels.batch_invariant and self.kernels.has_bf16_dot
                and x.dtype == weight.dtype == torch.bfloat16):
            return F.linear(x, weight, bias)
        return self.kernels.gemm_plain(weight, x, bias)
