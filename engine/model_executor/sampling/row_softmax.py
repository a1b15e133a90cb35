"""Row-wise softmax / log-softmax for the sampler, batch-invariant where it matters.

torch's CUDA / ROCm / XPU softmax may pick its reduction schedule from the row count, so
in batch-invariant mode (:mod:`engine.core.batch_invariance`) accelerator rows go
through the one-program-per-row Triton kernels of :mod:`engine.kernels.batch_invariant`.
torch's CPU kernels already reduce each row on one thread in one order at any row count
(checked for vocabularies up to 262k in tests/entrypoints/test_batch_invariance.py), so
CPU rows keep them.
"""

from __future__ import annotations

import torch

from engine.core.batch_invariance import batch_invariant_enabled


def _triton_rows(x: torch.Tensor) -> bool:
    if x.device.type == "cpu" or x.dim() != 2 or not batch_invariant_enabled():
        return False
    from engine.kernels.batch_invariant import triton_batch_invariant_available

    return triton_batch_invariant_available(x.device)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """float32 ``log_softmax(x, dim=-1)`` of 2-D ``x``."""
    if _triton_rows(x):
        from engine.kernels import batch_invariant

        return batch_invariant.log_softmax(x)
    return torch.log_softmax(x.to(torch.float32), dim=-1)


def softmax(x: torch.Tensor) -> torch.Tensor:
    """float32 ``softmax(x, dim=-1)`` of 2-D ``x``."""
    if _triton_rows(x):
        from engine.kernels import batch_invariant

        return batch_invariant.softmax(x)
    return x.softmax(dim=-1, dtype=torch.float32)
