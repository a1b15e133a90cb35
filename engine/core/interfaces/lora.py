"""Batched multi-adapter LoRA kernels: a platform's way to add many adapters' deltas in one pass.

Punica's two halves, over a whole step's tokens at once (no per-request loop): every
token carries the device slot of its adapter (``-1``: none), and a layer's adapters sit
stacked by slot.

- **shrink**: ``s[t] = A[slot[t]] @ x[t]``, ``A: [S, K, in]`` with ``K = num_shards * R``
  (a fused layer's shards' ``A`` matrices stacked along the rank dim, each padded to
  the slot rank ``R``), ``s: [T, K]`` float32. Rows of tokens without an adapter are 0.
- **expand**: ``y[t, cols of shard j] += s[t, j*R:(j+1)*R] @ B[slot[t], :, cols of shard j]``,
  ``B: [S, R, N]``, rank-major (each slot's ``B`` stored transposed, so a token's update
  is ``R`` contiguous AXPYs over ``N``; the adapter's scaling already folded in),
  ``y: [T, N]`` updated in place; ``shard_bounds`` (``num_shards + 1`` ints, 0 to N) say
  which output columns form shard j. Tokens without an adapter leave ``y`` untouched.

Tokens of one request are contiguous in a step, so a prefill is a few long runs of one
slot (Punica's SGMV) and a decode step one token per request (BGMV); a kernel may use
either fact but must be right for any slot sequence. ``x``/``y``/``A``/``B`` share the
activation dtype (float32, bfloat16 or float16); accumulation is float32.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    import torch


class LoRAKernel(ABC):
    """Shrink and expand of the adapters of a whole batch (see the module docstring)."""

    name: ClassVar[str]

    @classmethod
    @abstractmethod
    def can_implement(cls, dtype: torch.dtype, device: torch.device) -> str | None:
        """None if this kernel runs adapters in ``dtype`` on ``device``; else why not."""

    @abstractmethod
    def shrink(self, x: torch.Tensor, lora_a: torch.Tensor, token_slots: torch.Tensor,
               out: torch.Tensor) -> None:
        """``out[t] = lora_a[token_slots[t]] @ x[t]`` (0 where the slot is -1).

        ``x [T, in]``, ``lora_a [S, K, in]``, ``token_slots [T]`` int32, ``out [T, K]``
        float32 (written, not accumulated)."""

    @abstractmethod
    def expand(self, s: torch.Tensor, lora_b: torch.Tensor, token_slots: torch.Tensor,
               shard_bounds: tuple[int, ...], y: torch.Tensor) -> None:
        """``y[t, lo_j:hi_j] += s[t, j*R:(j+1)*R] @ lora_b[slot, :, lo_j:hi_j]`` for every
        shard ``j`` (``lo_j, hi_j = shard_bounds[j], shard_bounds[j + 1]``).

        ``s [T, K]`` float32, ``lora_b [S, R, N]`` (rank-major), ``token_slots [T]`` int32, ``y [T, N]``
        (may be a strided view: a fused layer's output slice is not); slot -1: untouched."""
