"""What the GPU plugins offer of the shared Triton kernels, in preference order.

One place for the CUDA, ROCm and XPU platforms: each asks for the kernels bound to its own
device capability; without triton the lists are empty (the platform then has none).
"""

from __future__ import annotations

from typing import Any


def _have_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def triton_fused_moe_kernels() -> list[type[Any]]:
    """``[TritonFusedMoEKernel]`` when triton imports, else []."""
    if not _have_triton():
        return []
    from engine.kernels.fused_moe import TritonFusedMoEKernel

    return [TritonFusedMoEKernel]


def triton_quantized_gemm_kernels(capability: Any) -> list[type[Any]]:
    """The weight-only int kernels (Marlin-style first, then the plain W4A16 / W8A16 one),
    then the FP8 / int8 / NVFP4 ones, all bound to ``capability``; [] without triton."""
    if not _have_triton():
        return []
    from engine.kernels.quant_gemm_fp import fp_gemm_kernels
    from engine.kernels.quant_gemm_int import int_gemm_kernels

    return [*int_gemm_kernels(capability), *fp_gemm_kernels(capability)]
