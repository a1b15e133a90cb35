"""The CPU platform's GEMMs for unquantized linears, weights repacked once after loading.

:class:`AVX512BF16Gemm` (bf16 on CPUs with AVX512-BF16) runs the plugin's C kernel
(csrc/gemm_bf16.c): ~2 us of fixed cost per call against oneDNN's ~15 us and a panel
layout that streams at memory speed, so a batch-1 decode step of llama-tiny spends
1.5 ms in its linears instead of 2.5 ms; at prefill sizes both reach the cores'
dot-product peak. On AMX CPUs oneDNN's AMX GEMM is several times faster at prefill
sizes, so the platform puts :class:`OneDNNPackedGemm` first there (it also takes
float32 everywhere); :func:`gemm_preference` says which order applies. A bf16 weight
that must stay plain (an LM head tied to the embedding, which ``F.linear`` would
reorder in every call) gets :class:`AVX512BF16PlainGemv` for decode batch sizes.

``F.linear`` hands oneDNN a plain ``[out, in]`` weight, which it reorders into its
blocked layout inside every call. Reordering once after loading and calling oneDNN's
linear on the packed tensor skips that work: on an AVX-512 CPU it measured 1.5x faster
in bf16 at one token per step (the weight streams at memory speed), 1.25x at 64 and
about 2x in float32. The results are bit-identical in bf16; in float32 the blocked
accumulation order changes the last bits.
"""

from __future__ import annotations

import os
from typing import ClassVar

import torch
import torch.nn.functional as F

from engine.core.interfaces import DenseGemmKernel, DenseLayerSpec
from engine.plugins.cpu import kernel_build
from engine.plugins.cpu.native import GEMV_MAX_ROWS, load_kernels

AMX_FLAGS = frozenset({"amx_bf16", "amx_tile"})
GEMM_ENV = "ENGINE_CPU_GEMM"  # auto | onednn | avx512_bf16


def gemm_preference() -> list[type[DenseGemmKernel]]:
    """The CPU platform's dense kernels, preferred first: the AVX512-BF16 kernel before
    oneDNN unless the CPU has AMX (``$ENGINE_CPU_GEMM`` = ``onednn`` or ``avx512_bf16``
    puts that one first whatever the CPU); the plain GEMV takes what both refuse."""
    choice = os.environ.get(GEMM_ENV, "auto").strip().lower() or "auto"
    if choice not in ("auto", "onednn", "avx512_bf16"):
        raise ValueError(f"{GEMM_ENV}={choice!r}: expected auto, onednn or avx512_bf16")
    onednn_first = choice == "onednn" or (
        choice == "auto" and AMX_FLAGS <= kernel_build.cpu_flags()
    )
    first, second = (
        (OneDNNPackedGemm, AVX512BF16Gemm) if onednn_first else (AVX512BF16Gemm, OneDNNPackedGemm)
    )
    return [first, second, AVX512BF16PlainGemv]


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
        if not _onednn_linear_available():
            return "this torch build has no oneDNN linear ops"
        if spec.dtype == torch.float32:
            return None
        if spec.dtype == torch.bfloat16:
            if torch.ops.mkldnn._is_mkldnn_bf16_supported():
                return None
            return "oneDNN has no bf16 GEMM for this CPU"
        return f"dtype {spec.dtype} is not packed (float32 and bfloat16 are)"

    def prepare(self, weight: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)

    def apply(
        self, weight: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _native_bf16_refusal(spec: DenseLayerSpec) -> str | None:
    """Why the plugin's AVX512-BF16 kernels cannot take ``spec`` at all (None: they can)."""
    if spec.device.type != "cpu":
        return f"weights on {spec.device}, not the CPU"
    if spec.dtype != torch.bfloat16:
        return f"dtype {spec.dtype}: this kernel is bf16 only"
    kernels = load_kernels()
    if kernels is None or not kernels.has_bf16_gemm:
        return "the C kernels are not built or this CPU lacks AVX512-BF16"
    return None


class _NativeBF16Kernel(DenseGemmKernel):
    """A kernel of the plugin's C library that needs AVX512-BF16."""

    def __init__(self) -> None:
        kernels = load_kernels()
        if kernels is None or not kernels.has_bf16_gemm:
            raise RuntimeError(f"{self.name} is not available on this machine")
        self.kernels = kernels


class AVX512BF16Gemm(_NativeBF16Kernel):
    """``y = x W^T + b`` in bf16 through the plugin's AVX512-BF16 kernel (dot products of
    bf16 pairs into float32), ``W`` packed into its panel layout once."""

    name: ClassVar[str] = "avx512_bf16"

    @classmethod
    def can_implement(cls, spec: DenseLayerSpec) -> str | None:
        refusal = _native_bf16_refusal(spec)
        if refusal is not None:
            return refusal
        return load_kernels().bf16_gemm_refusal(spec.out_features, spec.in_features)

    def prepare(self, weight: torch.Tensor) -> torch.Tensor:
        return self.kernels.pack_bf16(weight.detach())

    def apply(
        self, weight: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.kernels.gemm_bf16(weight, x, bias)


class AVX512BF16PlainGemv(_NativeBF16Kernel):
    """``y = x W^T + b`` on the plain ``[out, in]`` bf16 weight (kept as is, so a weight
    shared with the embedding can use it): the C row GEMV for up to GEMV_MAX_ROWS rows
    of x, ``F.linear`` above that. A tied 16000 x 512 LM head at one row: ~3x F.linear."""

    name: ClassVar[str] = "avx512_bf16_plain_gemv"
    keeps_layout: ClassVar[bool] = True

    @classmethod
    def can_implement(cls, spec: DenseLayerSpec) -> str | None:
        return _native_bf16_refusal(spec)

    def prepare(self, weight: torch.Tensor) -> torch.Tensor:
        return weight

    def apply(
        self, weight: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        if 0 < x.numel() // max(x.shape[-1], 1) <= GEMV_MAX_ROWS and x.dtype == weight.dtype:
            return self.kernels.gemv_bf16(weight, x, bias)
        return F.linear(x, weight, bias)
