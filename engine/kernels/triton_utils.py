"""Small helpers shared by the Triton kernel wrappers (no triton import at module level)."""

from __future__ import annotations

import functools
import os

import torch

TRITON_MISSING_MESSAGE = (
    "the Triton kernels need the 'triton' package (pip install 'engine[triton]'); "
    "on a machine without a GPU set TRITON_INTERPRET=1 to run them on CPU tensors"
)


def require_triton() -> None:
    """Raise a clear ImportError when triton is not installed."""
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        raise ImportError(TRITON_MISSING_MESSAGE) from exc


def optional_jit(fn):
    """``triton.jit(fn)`` when triton is installed; otherwise ``fn`` itself, never launched
    (so a kernel module imports without triton and refuses only when used)."""
    try:
        import triton
    except ImportError:
        return fn
    return triton.jit(fn)


def interpreting() -> bool:
    """Whether Triton runs kernels through its CPU interpreter (read at kernel import)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def check_device(interpreted: bool, *tensors: torch.Tensor) -> None:
    """Fail clearly when tensors sit where the jitted kernels cannot reach them."""
    on_cpu = [t.device.type == "cpu" for t in tensors]
    if any(on_cpu) and not interpreted:
        raise ValueError(
            "Triton kernels got CPU tensors but were compiled for a GPU; set "
            "TRITON_INTERPRET=1 before importing engine.kernels to run them on the CPU"
        )
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(f"Triton kernel inputs span several devices: {sorted(map(str, devices))}")


SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_dtype(name: str, tensor: torch.Tensor) -> None:
    if tensor.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{name} has dtype {tensor.dtype}; supported: float16, bfloat16, float32")


FP8_CACHE_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def check_cache_dtype(kv_cache: torch.Tensor, k_scale: float, v_scale: float) -> None:
    """A KV cache holds a float dtype or fp8 codes (engine.kernels.fp8_kv), these with
    positive scales."""
    if kv_cache.dtype in FP8_CACHE_DTYPES:
        if not (k_scale > 0 and v_scale > 0):
            raise ValueError(f"an fp8 KV cache needs positive scales, not {k_scale} / {v_scale}")
        return
    if kv_cache.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"kv_cache has dtype {kv_cache.dtype}; supported: float16, bfloat16, "
                         "float32, float8_e4m3fn, float8_e5m2")


@functools.cache
def compute_units(device: torch.device) -> int:
    """Streaming multiprocessors / compute units of ``device`` (CPU cores when interpreted).

    Used only to size launch grids, so a failed probe falls back to a typical count.
    """
    if device.type == "cpu":
        return os.cpu_count() or 1
    try:
        import triton

        index = device.index if device.index is not None else 0
        props = triton.runtime.driver.active.utils.get_device_properties(index)
        return int(props["multiprocessor_count"])
    except Exception:  # noqa: BLE001 - probing is best effort
        return 100
