"""The "example-torch" platform: the host CPU through plain torch ops.

What a vendor replaces: ``device_type`` (its torch device), ``probe`` (look for the
driver / runtime without importing anything heavy), memory figures, the attention
backend and, when it has them, quantized-GEMM kernels, fused ops and a graph capturer.
"""

from __future__ import annotations

import os
from typing import Any

from engine.core.interfaces import Platform, ProbeResult

KV_CACHE_ENV = "EXAMPLE_PLUGIN_KV_CACHE_MIB"  # KV cache size in MiB
DEFAULT_KV_CACHE_MIB = 64.0


def _kv_cache_mib() -> float:
    raw = os.environ.get(KV_CACHE_ENV)
    if raw is None:
        return DEFAULT_KV_CACHE_MIB
    try:
        value = float(raw)
    except ValueError as exc:
        raise ValueError(f"{KV_CACHE_ENV}={raw!r} is not a number of MiB") from exc
    if value <= 0:
        raise ValueError(f"{KV_CACHE_ENV}={raw!r} must be > 0")
    return value


def _meminfo(field: str) -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key == field:
                    return int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class ExampleTorchPlatform(Platform):
    name = "example-torch"
    device_type = "cpu"
    priority = -10  # below the built-in cpu platform (0): --device auto keeps picking cpu
    description = "example plugin: host CPU through plain torch ops (gloo collectives)"
    dist_backend = "gloo"

    @classmethod
    def probe(cls) -> ProbeResult:
        # Needs nothing but torch, which the engine already requires.
        return ProbeResult.ok("plain torch on the host CPU")

    def supported_dtypes(self):
        import torch

        return [torch.float32, torch.bfloat16, torch.float16]

    def total_memory_bytes(self) -> int:
        total = _meminfo("MemTotal")
        return total if total is not None else os.sysconf("SC_PAGE_SIZE") * os.sysconf(
            "SC_PHYS_PAGES")

    def available_memory_bytes(self) -> int:
        free = _meminfo("MemAvailable")
        return free if free is not None else self.total_memory_bytes()

    def kv_cache_bytes(self, cache_config: Any, weights_bytes: int) -> int:
        """``EXAMPLE_PLUGIN_KV_CACHE_MIB`` MiB (default 64): small and predictable."""
        return int(_kv_cache_mib() * (1 << 20))

    def attention_backends(self):
        from engine_plugin_example.attention import ExampleSDPABackend

        return [ExampleSDPABackend]

    def communicator_cls(self):
        from engine.distributed import TorchDistributedCommunicator

        return TorchDistributedCommunicator.for_backend("gloo")

    # No fused ops, no graph capturer, no dense/quantized GEMM kernels: the defaults of
    # Platform (None / []) make every layer use its torch ops.

    def kernel_info(self) -> dict[str, Any]:
        return {"attention": "example-sdpa (torch matmuls)", "kv_cache_mib": _kv_cache_mib()}
