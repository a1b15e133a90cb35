"""What the cuda and rocm platforms share: torch's ``torch.cuda`` device API.

torch's ROCm build exposes AMD GPUs through the same ``torch.cuda`` calls (device type
"cuda", RCCL under the "nccl" name), so the two platforms differ only in their probe.
This module sits beside the plugins, not inside one, so no plugin imports another.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.core.interfaces import DeviceCapability, Platform
from engine.plugins.gpu_memory import gpu_kv_cache_bytes

if TYPE_CHECKING:
    import torch

    from engine.core.interfaces import AttentionBackend, Communicator, FusedOps


class TorchCudaApiPlatform(Platform):
    """Memory, dtypes, sync, Triton attention and NCCL over ``torch.cuda``."""

    device_type = "cuda"
    dist_backend = "nccl"
    ray_device_key = "GPU"  # the Ray resource one rank reserves

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

    def supported_dtypes(self) -> list[torch.dtype]:
        import torch

        dtypes = [torch.float16, torch.float32]
        if torch.cuda.is_bf16_supported():
            dtypes.insert(0, torch.bfloat16)
        return dtypes

    def device(self, index: int | None = None) -> torch.device:
        import torch

        return torch.device("cuda", torch.cuda.current_device() if index is None else index)

    def device_capability(self) -> DeviceCapability | None:
        """Compute capability and FP8 support of the current device (ROCm: gfx arch,
        e4m3fnuz on MI300-class gfx94x)."""
        import torch

        if not torch.cuda.is_available():
            return None
        major, minor = torch.cuda.get_device_capability()
        if torch.version.hip is not None:
            arch = torch.cuda.get_device_properties(0).gcnArchName.split(":")[0]
            fnuz = arch.startswith("gfx94")
            fp8 = "e4m3fnuz" if fnuz else ("e4m3fn" if arch.startswith("gfx95") else None)
            return DeviceCapability("amd", arch, major, minor, fp8_dtype=fp8,
                                    fp8_mma=fp8 is not None, int8_mma=True)
        has_fp8 = (major, minor) >= (8, 9)
        return DeviceCapability("nvidia", f"sm_{major}{minor}", major, minor,
                                fp8_dtype="e4m3fn" if has_fp8 else None, fp8_mma=has_fp8,
                                fp4_mma=major >= 10, int8_mma=(major, minor) >= (7, 5))

    def bind_worker(self, local_rank: int, local_world_size: int) -> None:
        """Device ``local_rank`` becomes this process's current device."""
        import torch

        count = torch.cuda.device_count()
        if local_rank >= count:
            raise ValueError(f"local rank {local_rank} needs a device, but {count} are visible")
        torch.cuda.set_device(local_rank)

    def total_memory_bytes(self) -> int:
        import torch

        return torch.cuda.mem_get_info(self.device())[1]

    def available_memory_bytes(self) -> int:
        import torch

        return torch.cuda.mem_get_info(self.device())[0]

    def kv_cache_bytes(self, cache_config: Any, weights_bytes: int) -> int:
        return self.kv_cache_budget(cache_config, weights_bytes, None)

    def kv_cache_budget(self, cache_config: Any, weights_bytes: int,
                        activation_bytes: int | None) -> int:
        import torch

        dev = self.device()
        free, total = torch.cuda.mem_get_info(dev)
        return gpu_kv_cache_bytes(
            total_bytes=total,
            free_bytes=free,
            torch_reserved_bytes=torch.cuda.memory_reserved(dev),
            weights_bytes=weights_bytes,
            utilization=cache_config.gpu_utilization,
            platform=f"{self.name} device {dev}",
            activation_bytes=activation_bytes,
        )

    def kv_cache_needs_profile(self, cache_config: Any) -> bool:
        return True  # the KV cache is what is left after the activations

    def profile_peak_bytes(self, fn: Any) -> int | None:
        """torch.cuda's allocator peak over ``fn()`` (HIP: the same API), above what was
        allocated before; the cached blocks are handed back afterwards."""
        import torch

        dev = self.device()
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        before = torch.cuda.memory_allocated(dev)
        fn()
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) - before
        torch.cuda.empty_cache()
        return max(0, int(peak))

    def synchronize(self) -> None:
        import torch

        torch.cuda.synchronize()

    def release_cached_memory(self) -> None:
        import torch

        torch.cuda.synchronize(self.device())
        torch.cuda.empty_cache()

    def attention_backends(self) -> list[type[AttentionBackend]]:
        from engine.kernels.triton_backend import TritonAttentionBackend

        return [TritonAttentionBackend]

    def fused_moe_kernels(self) -> list[type[Any]]:
        from engine.kernels.offers import triton_fused_moe_kernels

        return triton_fused_moe_kernels()

    def lora_kernels(self) -> list[type[Any]]:
        from engine.kernels.lora_triton import triton_lora_kernels

        return triton_lora_kernels()

    def quantized_gemm_kernels(self) -> list[type[Any]]:
        """The shared Triton kernels (engine.kernels.offers) bound to this device."""
        from engine.kernels.offers import triton_quantized_gemm_kernels

        return triton_quantized_gemm_kernels(self.device_capability())

    def communicator_cls(self) -> type[Communicator]:
        from engine.distributed import NcclCommunicator

        return NcclCommunicator
