"""The CPU platform's batched multi-LoRA kernel: Punica's shrink and expand in C.

:class:`CPULoRAKernel` runs csrc/lora.c from the library of this CPU's ISA level (or
the one it is given): tokens grouped by slot in C (a counting sort of the step's
``token_slots``, read at run time), each slot's adapter rows reused by all of its tokens,
float32 multiply-adds with bf16 / fp16 widened as read. As C kernels the calls are
:class:`~engine.plugins.cpu.native.NativeOp` calls, so a decode step's forward graph
(:mod:`.graphs`) records them once and replays them with each step's slots. A token's
result does not depend on the other tokens of the batch (batch-invariant as it is).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch

from engine.core.interfaces import LoRAKernel
from engine.plugins.cpu.native import DTYPE_CODES, CPUKernels, load_kernels


def lora_preference() -> list[type[LoRAKernel]]:
    """``[CPULoRAKernel]`` when the C kernels load here, else [] (the torch kernel)."""
    return [CPULoRAKernel] if load_kernels() is not None else []


class CPULoRAKernel(LoRAKernel):
    """shrink / expand through the plugin's C kernels (``kernels``: a level's library;
    default the one the engine loads)."""

    name: ClassVar[str] = "cpu_native_lora"

    @classmethod
    def can_implement(cls, dtype: torch.dtype, device: torch.device) -> str | None:
        if torch.device(device).type != "cpu":
            return f"runs on the CPU, not {device}"
        if dtype not in DTYPE_CODES:
            return f"dtype {dtype} is not supported (float32, bfloat16, float16)"
        if load_kernels() is None:
            return "the CPU plugin's C kernels could not be built or are disabled"
        return None

    def __init__(self, kernels: CPUKernels | None = None) -> None:
        kernels = kernels if kernels is not None else load_kernels()
        if kernels is None:
            raise RuntimeError("the CPU plugin's C kernels are unavailable")
        self.kernels = kernels
        # Shard bounds as int64 arrays, kept for the kernel's life: a recorded graph holds
        # their addresses (numpy, so making one inside a capture runs no torch op).
        self._bounds: dict[tuple[int, ...], np.ndarray] = {}

    def shrink(self, x: torch.Tensor, lora_a: torch.Tensor, token_slots: torch.Tensor,
               out: torch.Tensor) -> None:
        self.kernels.lora_shrink(x, lora_a, token_slots, out)

    def expand(self, s: torch.Tensor, lora_b: torch.Tensor, token_slots: torch.Tensor,
               shard_bounds: tuple[int, ...], y: torch.Tensor) -> None:
        key = tuple(int(b) for b in shard_bounds)
        bounds = self._bounds.get(key)
        if bounds is None:
            bounds = self._bounds[key] = np.array(key, dtype=np.int64)
        self.kernels.lora_expand(s, lora_b, token_slots, bounds, y)
