"""The adapter slots of one linear layer, and the delta they add to its output.

A linear layer that LoRA may target gets a :class:`LoRALinearSlots`: for each of the
``max_loras`` device slots, the stacked ``A`` matrices of its shards (``[S, shards * R,
in]``) and its ``B`` matrices transposed, rank-major (``[S, R, out]``: the expand kernels
then add ``R`` contiguous rows per token), ``R = max_lora_rank``; an adapter of lower
rank fills the first rows and leaves zeros. The scaling is folded into ``B``
when a slot is written. Tensor parallelism: the slots hold this rank's part, cut like
the layer's own weight (a column-parallel layer's ``B`` rows, a row-parallel layer's
``A`` columns; the row-parallel partial sums then meet in the layer's all-reduce).

At run time the layer calls :meth:`LoRALinearSlots.add_delta` on its output: the step's
:class:`LoRABatch` (each token's slot, in the forward context) drives one shrink and one
expand of the platform's :class:`~engine.core.interfaces.LoRAKernel` for the whole batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import torch

from engine.core.interfaces import LoRAKernel
from engine.model_executor.forward_context import current_forward_context


@dataclass
class LoRABatch:
    """The step's adapter slot of every token (``-1``: the base model).

    ``active``: some token has an adapter (an eager step without any skips the LoRA
    kernels; a captured forward graph always runs them, since its slots change)."""

    token_slots: torch.Tensor  # int32 [T]
    active: bool


@dataclass(frozen=True)
class ShardWeights:
    """One shard's adapter matrices for this rank: ``A [r, in]``, ``B [out, r]`` with
    the scaling folded in, in the slots' dtype."""

    lora_a: torch.Tensor
    lora_b: torch.Tensor


class LoRALinearSlots:
    """``max_loras`` adapter slots of one linear layer (see the module docstring)."""

    def __init__(self, layer: Any, num_slots: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device, kernel: LoRAKernel) -> None:
        self.shard_ids = list(layer.shard_sizes)
        sizes = list(layer.shard_sizes.values())
        self.shard_bounds = tuple(accumulate(sizes, initial=0))
        self.in_features = layer.in_features
        self.max_rank = max_rank
        self.kernel = kernel
        shards = len(sizes)
        self.lora_a = torch.zeros(num_slots, shards * max_rank, layer.in_features, dtype=dtype,
                                  device=device)
        self.lora_b = torch.zeros(num_slots, max_rank, self.shard_bounds[-1], dtype=dtype,
                                  device=device)  # rank-major: B[out, r] stored as [r, out]

    @property
    def nbytes(self) -> int:
        return (self.lora_a.numel() * self.lora_a.element_size()
                + self.lora_b.numel() * self.lora_b.element_size())

    def shard_size(self, shard_id: Any) -> int:
        j = self.shard_ids.index(shard_id)
        return self.shard_bounds[j + 1] - self.shard_bounds[j]

    def write_slot(self, slot: int, shards: dict[Any, ShardWeights]) -> None:
        """Put an adapter's matrices into ``slot`` (shards it does not adapt stay 0)."""
        self.clear_slot(slot)
        rank_width = self.max_rank
        for shard_id, weights in shards.items():
            j = self.shard_ids.index(shard_id)
            rank = weights.lora_a.shape[0]
            lo, hi = self.shard_bounds[j], self.shard_bounds[j + 1]
            self.lora_a[slot, j * rank_width: j * rank_width + rank].copy_(weights.lora_a)
            self.lora_b[slot, :rank, lo:hi].copy_(weights.lora_b.t())

    def clear_slot(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()

    def add_delta(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """``y += B[slot] A[slot] x`` per token, for the step's tokens with an adapter."""
        ctx = current_forward_context()
        batch = None if ctx is None else ctx.lora
        if batch is None or not batch.active:
            return
        x2 = x.reshape(-1, x.shape[-1])
        y2 = y.view(-1, y.shape[-1])
        if x2.shape[0] != batch.token_slots.shape[0]:
            raise RuntimeError(f"LoRA: {x2.shape[0]} tokens in the layer, "
                               f"{batch.token_slots.shape[0]} adapter slots in the step")
        shrunk = torch.empty(x2.shape[0], self.lora_a.shape[1], dtype=torch.float32,
                             device=x.device)
        self.kernel.shrink(x2, self.lora_a, batch.token_slots, shrunk)
        self.kernel.expand(shrunk, self.lora_b, batch.token_slots, self.shard_bounds, y2)
