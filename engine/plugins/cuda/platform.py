"""The NVIDIA CUDA platform: torch's CUDA build, Triton attention, NCCL collectives.

The probe never initializes a CUDA context (``is_available`` and ``device_count`` do not),
so a later fork of the process stays safe.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from engine.core.interfaces import Platform, ProbeResult
from engine.plugins.gpu_memory import gpu_kv_cache_bytes

if TYPE_CHECKING:
    import torch

    from engine.core.interfaces import AttentionBackend, Communicator


class CUDAPlatform(Platform):
    name = "cuda"
    device_type = "cuda"
    priority = 100
    description = "NVIDIA GPUs through torch's CUDA build (Triton kernels, NCCL)"
    dist_backend = "nccl"

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
