"""The Intel XPU platform: torch's built-in ``torch.xpu`` (Triton kernels, oneCCL).

intel-extension-for-pytorch is optional: the probe only notes whether it is installed
(``find_spec``, never an import), and nothing here requires it. Collectives use torch's
"xccl" backend, or "ccl" from oneccl_bindings_for_pytorch on torch builds without xccl.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any

from engine.core.interfaces import Platform, ProbeResult
from engine.plugins.gpu_memory import gpu_kv_cache_bytes

if TYPE_CHECKING:
    import torch

    from engine.core.interfaces import AttentionBackend, Communicator, FusedOps

IPEX_MODULE = "intel_extension_for_pytorch"
ONECCL_MODULE = "oneccl_bindings_for_pytorch"


def ipex_installed() -> bool:
    return importlib.util.find_spec(IPEX_MODULE) is not None


def xpu_dist_backend() -> str:
    """Torch's "xccl" when available; "ccl" when only the oneccl bindings are installed."""
    import torch.distributed as dist

    is_xccl = getattr(dist, "is_xccl_available", None)
    if is_xccl is not None and is_xccl():
        return "xccl"
    if importlib.util.find_spec(ONECCL_MODULE) is not None:
        return "ccl"
    return "xccl"  # init_process_group will then name the missing backend itself


class XPUPlatform(Platform):
    name = "xpu"
    device_type = "xpu"
    priority = 80
    description = "Intel GPUs through torch.xpu (Triton kernels, oneCCL)"
    dist_backend = "xccl"  # instances hold the resolved backend ("xccl" or "ccl")

    def __init__(self) -> None:
        self.dist_backend = xpu_dist_backend()

    @classmethod
    def probe(cls) -> ProbeResult:
        try:
            import torch
        except Exception as exc:  # noqa: BLE001 - probes never raise
            return ProbeResult.unavailable(f"torch is not importable: {exc}")
        try:
            ipex = "intel-extension-for-pytorch " + ("installed" if ipex_installed() else "absent")
            xpu = getattr(torch, "xpu", None)
            compiled = getattr(xpu, "_is_compiled", None)
            if xpu is None or (compiled is not None and not compiled()):
                return ProbeResult.unavailable(
                    f"torch {torch.__version__} was built without XPU support ({ipex})"
                )
            if not xpu.is_available():
                return ProbeResult.unavailable(f"no Intel XPU device visible ({ipex})")
            return ProbeResult.ok(f"{xpu.device_count()} XPU device(s), {ipex}")
        except Exception as exc:  # noqa: BLE001
            return ProbeResult.unavailable(f"XPU probe failed: {exc}")

    def supported_dtypes(self) -> list[torch.dtype]:
        import torch

        return [torch.bfloat16, torch.float16, torch.float32]

    ray_device_key = "GPU"  # Ray counts Intel GPUs as GPU resources too

    def device(self, index: int | None = None) -> torch.device:
        import torch

        return torch.device("xpu", torch.xpu.current_device() if index is None else index)

    def bind_worker(self, local_rank: int, local_world_size: int) -> None:
        """Device ``local_rank`` becomes this process's current XPU."""
        import torch

        count = torch.xpu.device_count()
        if local_rank >= count:
            raise ValueError(f"local rank {local_rank} needs a device, but {count} are visible")
        torch.xpu.set_device(local_rank)

    def _mem_info(self) -> tuple[int, int]:
        """(free, total) bytes of the current device."""
        import torch

        dev = self.device()
        if hasattr(torch.xpu, "mem_get_info"):
            free, total = torch.xpu.mem_get_info(dev)
            return int(free), int(total)
        total = torch.xpu.get_device_properties(dev).total_memory
        return total - torch.xpu.memory_reserved(dev), total

    def total_memory_bytes(self) -> int:
        return self._mem_info()[1]

    def available_memory_bytes(self) -> int:
        return self._mem_info()[0]

    def kv_cache_bytes(self, cache_config: Any, weights_bytes: int) -> int:
        return self.kv_cache_budget(cache_config, weights_bytes, None)

    def kv_cache_budget(self, cache_config: Any, weights_bytes: int,
                        activation_bytes: int | None) -> int:
        import torch

        free, total = self._mem_info()
        return gpu_kv_cache_bytes(
            total_bytes=total,
            free_bytes=free,
            torch_reserved_bytes=torch.xpu.memory_reserved(self.device()),
            weights_bytes=weights_bytes,
            utilization=cache_config.gpu_utilization,
            platform=f"{self.name} device {self.device()}",
            activation_bytes=activation_bytes,
        )

    def kv_cache_needs_profile(self, cache_config: Any) -> bool:
        return True  # the KV cache is what is left after the activations

    def profile_peak_bytes(self, fn: Any) -> int | None:
        """torch.xpu's allocator peak over ``fn()`` (None on a torch without the XPU
        memory statistics)."""
        import torch

        xpu = torch.xpu
        if not all(hasattr(xpu, name) for name in (
                "reset_peak_memory_stats", "max_memory_allocated", "memory_allocated")):
            fn()
            return None
        dev = self.device()
        xpu.synchronize()
        xpu.reset_peak_memory_stats(dev)
        before = xpu.memory_allocated(dev)
        fn()
        xpu.synchronize()
        peak = xpu.max_memory_allocated(dev) - before
        if hasattr(xpu, "empty_cache"):
            xpu.empty_cache()
        return max(0, int(peak))

    def synchronize(self) -> None:
        import torch

        torch.xpu.synchronize()

    def release_cached_memory(self) -> None:
        import torch

        torch.xpu.synchronize()
        torch.xpu.empty_cache()

    def attention_backends(self) -> list[type[AttentionBackend]]:
        from engine.kernels.triton_backend import TritonAttentionBackend

        return [TritonAttentionBackend]

    def dense_gemm_kernels(self) -> list[type[Any]]:
        """Batch-invariant mode: the invariant Triton GEMM first (engine.kernels.
        batch_invariant); otherwise none (F.linear)."""
        from engine.kernels.batch_invariant_ops import batch_invariant_dense_gemm_kernels

        return batch_invariant_dense_gemm_kernels()

    def fused_ops(self) -> FusedOps | None:
        """Batch-invariant mode: a per-row Triton RMSNorm (engine.kernels.
        batch_invariant_ops); otherwise None (the layers' torch ops)."""
        from engine.kernels.batch_invariant_ops import batch_invariant_fused_ops

        return batch_invariant_fused_ops()

    def fused_moe_kernels(self) -> list[type[Any]]:
        from engine.kernels.offers import triton_fused_moe_kernels

        return triton_fused_moe_kernels()

    def lora_kernels(self) -> list[type[Any]]:
        from engine.kernels.lora_triton import triton_lora_kernels

        return triton_lora_kernels()

    def quantized_gemm_kernels(self) -> list[type[Any]]:
        """The shared Triton kernels (engine.kernels.offers) bound to this device (a
        generic Intel GPU when it reports no capability of its own)."""
        from engine.core.interfaces import DeviceCapability
        from engine.kernels.offers import triton_quantized_gemm_kernels

        return triton_quantized_gemm_kernels(
            self.device_capability() or DeviceCapability("intel", "xpu"))

    def communicator_cls(self) -> type[Communicator]:
        from engine.distributed import TorchDistributedCommunicator

        return TorchDistributedCommunicator.for_backend(self.dist_backend)
