"""The NVIDIA CUDA platform: torch's CUDA build, Triton attention, NCCL collectives.

The probe never initializes a CUDA context (``is_available`` and ``device_count`` do not),
so a later fork of the process stays safe.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from engine.core.interfaces import ProbeResult
from engine.plugins.torch_cuda_api import TorchCudaApiPlatform

if TYPE_CHECKING:
    from engine.core.interfaces import FusedOps


class CUDAPlatform(TorchCudaApiPlatform):
    name = "cuda"
    priority = 100
    description = "NVIDIA GPUs through torch's CUDA build (Triton kernels, NCCL)"

    @classmethod
    def probe(cls) -> ProbeResult:
        try:
            import torch
        except Exception as exc:  # noqa: BLE001 - probes never raise
            return ProbeResult.unavailable(f"torch is not importable: {exc}")
        try:
            if torch.version.hip is not None:
                return ProbeResult.unavailable(
                    f"torch {torch.__version__} is a ROCm build (use the rocm platform)"
                )
            if torch.version.cuda is None:
                return ProbeResult.unavailable(f"torch {torch.__version__} was built without CUDA")
            if not torch.cuda.is_available():
                visible = os.environ.get("CUDA_VISIBLE_DEVICES")
                hint = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
                return ProbeResult.unavailable(f"no CUDA device visible{hint}")
            count = torch.cuda.device_count()
            return ProbeResult.ok(f"{count} CUDA device(s), CUDA {torch.version.cuda}")
        except Exception as exc:  # noqa: BLE001
            return ProbeResult.unavailable(f"CUDA probe failed: {exc}")

    def dense_gemm_kernels(self) -> list[type[Any]]:
        """Batch-invariant mode: the invariant Triton GEMM first (engine.kernels.
        batch_invariant); otherwise none (F.linear, i.e. cuBLAS / hipBLASLt)."""
        from engine.kernels.batch_invariant_ops import batch_invariant_dense_gemm_kernels

        return batch_invariant_dense_gemm_kernels()

    def fused_ops(self) -> FusedOps | None:
        """Batch-invariant mode: a per-row Triton RMSNorm (engine.kernels.
        batch_invariant_ops); otherwise None (the layers' torch ops)."""
        from engine.kernels.batch_invariant_ops import batch_invariant_fused_ops

        return batch_invariant_fused_ops()
