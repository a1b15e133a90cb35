"""Pytest plugin: run the Triton kernel tests (written for CPU tensors under the interpreter)
on a real GPU, with the tests' own float64 references.

The kernel tests build their inputs on the CPU (CPU generators, CPU references). This plugin
wraps each Triton launcher so a call with CPU tensors runs compiled on the GPU: its tensor
arguments (also inside lists, tuples and dataclasses) are copied to the device once per
object, the launcher runs there, arguments the kernel wrote are copied back into the
caller's CPU tensors, and returned tensors come back to the CPU. Nothing in the tests
changes, so a pass means the compiled kernel agrees with the same reference the interpreter
is held to.

    TRITON_INTERPRET=0 PYTHONPATH=ci python3 -m pytest -p gpu_kernel_shim tests/kernels/test_mla_attention.py

`ENGINE_GPU_SHIM_DEVICE` names the device (default ``cuda``); ``cpu`` with
``TRITON_INTERPRET=1`` exercises the plugin's own plumbing (each argument cloned, kernels
interpreted) on a machine without a GPU. Tests that assert the interpreter's own rules (a
CPU tensor accepted, float32 dots) fail by design under this plugin; read the failures.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
import sys
from typing import Any, Callable

import torch

DEVICE = torch.device(os.environ.get("ENGINE_GPU_SHIM_DEVICE", "cuda"))

# (module, launcher names): the entry points that launch Triton kernels.
LAUNCHERS: dict[str, tuple[str, ...]] = {
    "engine.kernels.mla_attention": ("mla_write_cache", "mla_attention"),
    "engine.kernels.lora_triton": ("lora_shrink", "lora_expand"),
    "engine.kernels.fused_moe": ("fused_moe",),
    "engine.kernels.unified_attention": ("unified_attention",),
    "engine.kernels.reshape_and_cache": ("reshape_and_cache",),
    "engine.kernels.encoder_attention": ("encoder_attention",),
    "engine.kernels.ssm.triton_conv1d": ("causal_conv1d_prefill", "causal_conv1d_decode"),
    "engine.kernels.ssm.triton_gated_delta": ("gated_delta_recurrent", "gated_delta_decode"),
    "engine.kernels.ssm.triton_gated_delta_chunked": ("gated_delta_prefill",),
    "engine.kernels.ssm.triton_mamba_ssd": ("mamba2_ssd_recurrent", "mamba2_ssd_decode"),
    "engine.kernels.ssm.triton_mamba_ssd_chunked": ("mamba2_ssd_prefill",),
    "engine.kernels.ssm.triton_selective_scan": ("selective_scan_prefill",
                                                 "selective_scan_decode"),
}


class _Mover:
    """Copies a call's CPU tensors to DEVICE once each (aliases stay aliases)."""

    def __init__(self) -> None:
        self.moved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def to_device(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            if value.device.type != "cpu":
                return value
            key = id(value)
            if key not in self.moved:
                copy = value.clone() if DEVICE.type == "cpu" else value.to(DEVICE)
                self.moved[key] = (value, copy)
            return self.moved[key][1]
        return _map(value, self.to_device)

    def write_back(self) -> None:
        """Copy what the kernel wrote into the caller's tensors (unchanged ones untouched,
        so read-only views such as expanded tensors are never written)."""
        for original, copy in self.moved.values():
            result = copy.to("cpu")
            if not torch.equal(result, original):
                original.copy_(result)

    def to_cpu(self, value: Any) -> Any:
        """Returned tensors back on the CPU: a moved argument as the caller's own tensor
        (launchers that return their ``out=`` argument keep that identity)."""
        if isinstance(value, torch.Tensor):
            for original, copy in self.moved.values():
                if value is copy:
                    return original
            return value.to("cpu")
        return _map(value, self.to_cpu)


def _map(value: Any, fn: Callable[[Any], Any]) -> Any:
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(fn(v) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(fn(v) for v in value)
    if isinstance(value, dict):
        return {k: fn(v) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {f.name: fn(getattr(value, f.name))
                   for f in dataclasses.fields(value) if f.init}
        return dataclasses.replace(value, **changes)
    return value


def on_device(launcher: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(launcher)
    def run(*args: Any, **kwargs: Any) -> Any:
        mover = _Mover()
        result = launcher(*mover.to_device(list(args)), **mover.to_device(kwargs))
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()
        mover.write_back()
        return mover.to_cpu(result)

    run.__wrapped_for_device__ = True  # type: ignore[attr-defined]
    return run


def install() -> int:
    """Wraps every launcher, in its module and wherever it was imported by name."""
    originals: dict[int, Callable[..., Any]] = {}
    for module_name, names in LAUNCHERS.items():
        module = importlib.import_module(module_name)
        for name in names:
            fn = getattr(module, name)
            if getattr(fn, "__wrapped_for_device__", False):
                continue
            wrapped = on_device(fn)
            originals[id(fn)] = wrapped
            setattr(module, name, wrapped)
    for module in list(sys.modules.values()):
        if module is None or not getattr(module, "__name__", "").startswith(("engine", "tests")):
            continue
        for attr, value in list(vars(module).items()):
            if callable(value) and id(value) in originals:
                setattr(module, attr, originals[id(value)])
    return len(originals)


def pytest_configure(config: Any) -> None:
    if DEVICE.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("ci.gpu_kernel_shim: no CUDA device")
    count = install()
    print(f"gpu_kernel_shim: {count} Triton launchers run on {DEVICE} "
          f"(TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '0')})")

