"""The NVIDIA CUDA platform: torch's CUDA build, Triton attention, NCCL collectives.

The probe never initializes a CUDA context (``is_available`` and ``device_count`` do not),
so a later fork of the process stays safe.
"""

from __future__ import annotations

import os

from engine.core.interfaces import ProbeResult
from engine.plugins.torch_cuda_api import TorchCudaApiPlatform


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
