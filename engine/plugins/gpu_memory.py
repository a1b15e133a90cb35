"""KV-cache sizing shared by the GPU platforms (plain arithmetic, no device calls).

Each GPU plugin reads its own device's numbers (torch.cuda, torch.xpu) and lets this
function apply the one rule, so cuda, rocm and xpu size their caches identically.
"""

from __future__ import annotations

GIB = 1 << 30
MAX_ACTIVATION_MARGIN = 1 * GIB


def activation_margin(total_bytes: int) -> int:
    """Headroom left for the forward pass's activations and kernel workspaces."""
    return min(MAX_ACTIVATION_MARGIN, total_bytes // 20)


def gpu_kv_cache_bytes(
    *,
    total_bytes: int,
    free_bytes: int,
    torch_reserved_bytes: int,
    weights_bytes: int,
    utilization: float,
    platform: str,
    activation_bytes: int | None = None,
) -> int:
    """Bytes the KV cache may take on one device.

    ``total * utilization`` is this engine's share of the device. From it come off the
    loaded weights, memory held outside torch's allocator (driver context, other
    processes: ``total - free - torch_reserved``) and the activations: the peak a profile
    run measured (``activation_bytes``), else a fixed margin.
    """
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    if weights_bytes < 0:
        raise ValueError(f"weights_bytes must be >= 0, got {weights_bytes}")
    budget = int(total_bytes * utilization)
    outside_torch = max(0, total_bytes - free_bytes - torch_reserved_bytes)
    margin = activation_margin(total_bytes) if activation_bytes is None else activation_bytes
    kv_bytes = budget - weights_bytes - outside_torch - margin
    if kv_bytes <= 0:
        raise ValueError(
            f"no memory left for the KV cache on {platform}: gpu_memory_utilization="
            f"{utilization} allows {budget / GIB:.2f} GiB of {total_bytes / GIB:.2f} GiB, but "
            f"weights take {weights_bytes / GIB:.2f} GiB, memory outside torch "
            f"{outside_torch / GIB:.2f} GiB and activations {margin / GIB:.2f} GiB; "
            "raise gpu_memory_utilization, give --kv-cache-memory or use a smaller model"
        )
    return kv_bytes
