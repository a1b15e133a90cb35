"""The GPU platforms' ``FusedOps`` in batch-invariant mode.

CUDA, ROCm and XPU have no fused kernels of their own (``fused_ops()`` is None), so
their RMSNorm runs torch's ``F.rms_norm``, whose CUDA schedule may follow the row
count. In the mode they return :class:`BatchInvariantFusedOps` instead: RMSNorm on the
one-program-per-row Triton kernel of :mod:`engine.kernels.batch_invariant`. The other
ops are elementwise or per-row exact (an element's value never depends on another row,
whatever the schedule), so they stay torch ops, in the same arithmetic order as the
layers' own torch paths. Importing this module needs no triton.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from engine.core.interfaces.fused_ops import FusedOps
from engine.kernels.triton_utils import SUPPORTED_DTYPES


class BatchInvariantFusedOps(FusedOps):
    """RMSNorm batch-invariant in Triton; silu-and-mul, rotary, embedding and argmax as
    torch ops (invariant by nature)."""

    def supports(self, dtype: torch.dtype) -> bool:
        return dtype in SUPPORTED_DTYPES

    def rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        from engine.kernels.batch_invariant import rms_norm

        return rms_norm(x, weight, eps, residual)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def rotary_neox_(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        head_size: int,
    ) -> None:
        """In place, with the ops and dtype of RotaryEmbedding's torch path (HF's)."""
        cos, sin = cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)
        cos, sin = cos[:, None, :], sin[:, None, :]
        heads = x.view(x.shape[0], -1, head_size)
        x1, x2 = heads.chunk(2, dim=-1)
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        heads.copy_(rotated)

    def embedding(
        self, ids: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        vocab = weight.shape[0]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            raise ValueError(f"token ids must be in [0, {vocab})")
        out = F.embedding(ids, weight)
        return out if dtype is None else out.to(dtype)

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        return x.argmax(dim=-1)


def batch_invariant_dense_gemm_kernels() -> list[type[Any]]:
    """What a GPU platform offers its dense layers first: the batch-invariant Triton GEMM
    in batch-invariant mode when triton imports, else nothing."""
    from engine.core.batch_invariance import batch_invariant_enabled

    if not batch_invariant_enabled() or not _have_triton():
        return []
    from engine.kernels.batch_invariant import TritonBatchInvariantGemm

    return [TritonBatchInvariantGemm]


def batch_invariant_fused_ops() -> FusedOps | None:
    """What a GPU platform's ``fused_ops()`` returns: these ops in batch-invariant mode
    when triton imports, else None (the layers' torch ops)."""
    from engine.core.batch_invariance import batch_invariant_enabled

    if not batch_invariant_enabled() or not _have_triton():
        return None
    return BatchInvariantFusedOps()


def _have_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
