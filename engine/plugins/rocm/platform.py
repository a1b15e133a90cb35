"""The AMD ROCm platform: torch's ROCm (HIP) build behind the ``torch.cuda`` API.

torch's ROCm wheels reuse the "cuda" device type and expose RCCL as the "nccl"
backend, so only the probe tells this platform apart from CUDA: ``torch.version.hip``.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from engine.core.interfaces import Platform, ProbeResult
from engine.plugins.gpu_memory import gpu_kv_cache_bytes

if TYPE_CHECKING:
    import torch

    from engine.core.interfaces import AttentionBackend, Communicator


class ROCmPlatform(Platform):
    name = "rocm"
    device_type = "cuda"  # torch's ROCm build addresses AMD GPUs as "cuda"
    priority = 90
    description = "AMD GPUs through torch's ROCm build (Triton kernels, RCCL)"
    dist_backend = "nccl"  # RCCL, under torch's NCCL name

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

    def supported_dtypes(self) -> list[torch.dtype]:
        import torch

        dtypes = [torch.float16, torch.float32]
        if torch.cuda.is_bf16_supported():
            dtypes.insert(0, torch.bfloat16)
        return dtypes

    def device(self, index: int | None = None) -> torch.device:
        import torch

        return torch.device("cuda", torch.cuda.current_device() if index is None else index)

    def total_memory_bytes(self) -> int:
        import torch

        return torch.cuda.mem_get_info(self.device())[1]

    def available_memory_bytes(self) -> int:
        import torch

        return torch.cuda.mem_get_info(self.device())[0]

    def kv_cache_bytes(self, cache_config: Any, weights_bytes: int) -> int:
        import torch

        dev = self.device()
        free, total = torch.cuda.mem_get_info(dev)
        return gpu_kv_cache_bytes(
            total_bytes=total,
            free_bytes=free,
            torch_reserved_bytes=torch.cuda.memory_reserved(dev),
            weights_bytes=weights_bytes,
            utilization=cache_config.gpu_memory_utilization,
            platform=f"{self.name} device {dev}",
        )

    def synchronize(self) -> None:
        import torch

        torch.cuda.synchronize()

    def attention_backends(self) -> list[type[AttentionBackend]]:
        from engine.kernels.triton_backend import TritonAttentionBackend

        return [TritonAttentionBackend]

    def communicator_cls(self) -> type[Communicator]:
        from engine.distributed import NcclCommunicator

        return NcclCommunicator
