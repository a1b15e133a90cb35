"""Fused kernels of decoder layers (and the sampler's argmax) that a platform may supply.

At decode batch sizes RMSNorm (with its residual add), the gated activation, the
rotary embedding and the embedding lookup are a few kilobytes of arithmetic each, but
as chains of torch ops they cost a dispatch per op, dozens per layer. A platform that
has fused kernels for them returns a :class:`FusedOps` from ``Platform.fused_ops()``;
the model's layers then call it for the dtypes it supports and keep their torch op
chains otherwise. Each kernel must round to the storage dtype where the op chain it replaces
does (HF's arithmetic order), so swapping one in moves results by float32 rounding at
most. The sampler takes its row-wise argmax (greedy rows and the exponential race) from
here too: torch's index-tracking reduction reads [64, 16000] float32 logits at ~1 GB/s;
and, where the platform has one, its random draw (``categorical``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class FusedOps(ABC):
    """Fused kernels over 2-D ``[tokens, features]`` tensors whose rows may be strided
    (slices of a fused projection's output) but whose last dimension is contiguous."""

    @abstractmethod
    def supports(self, dtype: "torch.dtype") -> bool:
        """Whether the kernels run tensors of ``dtype``."""

    @abstractmethod
    def rms_norm(
        self,
        x: "torch.Tensor",
        weight: "torch.Tensor",
        eps: float,
        residual: "torch.Tensor | None" = None,
    ) -> "torch.Tensor":
        """``weight * x / rms(x)``; with ``residual``: the same of ``x + residual``, and
        the sum written back into ``residual`` (in place). Without a residual ``x`` may
        also be ``[tokens, heads, head_size]`` with contiguous heads (per-head q/k norms
        on a fused projection's slice); the result is ``[tokens * heads, head_size]``."""

    def residual_add_(self, x: "torch.Tensor", residual: "torch.Tensor") -> "torch.Tensor":
        """``residual += x`` in place for ``[rows, hidden]`` tensors; returns ``residual``.
        A residual add no norm follows (an EAGLE head's); the default is torch's add,
        which a forward graph of a C-kernel platform cannot record."""
        return residual.add_(x)

    @abstractmethod
    def silu_and_mul(self, x: "torch.Tensor") -> "torch.Tensor":
        """``silu(gate) * up`` for ``x = [gate | up]`` of width ``2 * I``."""

    @abstractmethod
    def rotary_neox_(
        self,
        x: "torch.Tensor",
        positions: "torch.Tensor",
        cos_sin_cache: "torch.Tensor",
        head_size: int,
    ) -> None:
        """Rotate-half rotary embedding of every head of ``x [T, heads * head_size]``, in
        place; ``cos_sin_cache[p]`` is ``cos | sin`` (head_size values) for position p,
        ``positions`` int64 and within the cache."""

    @abstractmethod
    def embedding(
        self, ids: "torch.Tensor", weight: "torch.Tensor", dtype: "torch.dtype | None" = None
    ) -> "torch.Tensor":
        """``weight[ids]`` for int64 ``ids [T]`` and a contiguous ``weight [vocab, hidden]``,
        in ``dtype`` (None: the table's; a narrower table is widened) -- a ValueError for
        an id outside the vocabulary."""

    def embedding_shard(
        self, ids: "torch.Tensor", weight: "torch.Tensor", start: int, num_real: int,
        vocab: int, dtype: "torch.dtype | None" = None,
    ) -> "torch.Tensor":
        """A tensor-parallel rank's part of the lookup: ``weight[id - start]`` for the
        ids ``start <= id < start + num_real`` its shard holds, zeros for the other ids of
        ``[0, vocab)`` (the all-reduce after it adds them), a ValueError for an id outside
        the vocabulary. The default is torch ops, which a forward graph of a C-kernel
        platform cannot record."""
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            raise ValueError(f"a token id is outside the vocabulary of {vocab}")
        local = ids - start
        outside = (local < 0) | (local >= num_real)
        out = self.embedding(local.masked_fill(outside, 0), weight, dtype)
        return out.masked_fill_(outside.unsqueeze(-1), 0)

    @abstractmethod
    def argmax(self, x: "torch.Tensor") -> "torch.Tensor":
        """``x.argmax(dim=-1)`` (int64) for float32 ``x [rows, cols]``: the first maximum
        of each row, or its first NaN, as torch returns it."""

    def categorical(self, probs: "torch.Tensor", u: "torch.Tensor") -> "torch.Tensor | None":
        """One index per row of float32 ``probs [rows, cols]`` (non-negative, any scale),
        drawn by inverse CDF with the float64 uniforms ``u [rows]`` in [0, 1): the first
        index whose running sum exceeds ``u x`` the row's sum, never one of probability 0.
        None (the default): no kernel, the sampler races exponentials instead (one random
        number per entry: cheap on GPUs, ~22 ns each in torch on a CPU)."""
        return None
