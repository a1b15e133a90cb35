"""The AMD ROCm platform: torch's ROCm (HIP) build behind the ``torch.cuda`` API.

torch's ROCm wheels reuse the "cuda" device type and expose RCCL as the "nccl"
backend, so only the probe tells this platform apart from CUDA: ``torch.version.hip``.
"""

from __future__ import annotations

import os

from engine.core.interfaces import ProbeResult
from engine.plugins.torch_cuda_api import TorchCudaApiPlatform


class ROCmPlatform(TorchCudaApiPlatform):
    name = "rocm"
    priority = 90
    description = "AMD GPUs through torch's ROCm build (Triton kernels, RCCL)"

    @classmethod
    def probe(cls) -> ProbeResult:
        try:
            import torch
        except Exception as exc:  # noqa: BLE001 - probes never raise
            return ProbeResult.unavailable(f"torch is not importable: {exc}")
        try:
            if torch.version.hip is None:
                return ProbeResult.unavailable(
                    f"torch {torch.__version__} is not a ROCm build "
                    "(ROCm torch wheels come from the PyTorch ROCm index)"
                )
            if not torch.cuda.is_available():
                visible = os.environ.get("HIP_VISIBLE_DEVICES")
                hint = f" (HIP_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
                return ProbeResult.unavailable(f"no ROCm (HIP) device visible{hint}")
            count = torch.cuda.device_count()
            return ProbeResult.ok(f"{count} ROCm device(s), HIP {torch.version.hip}")
        except Exception as exc:  # noqa: BLE001
            return ProbeResult.unavailable(f"ROCm probe failed: {exc}")
