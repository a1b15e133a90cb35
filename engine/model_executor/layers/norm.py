"""RMSNorm, with the residual add fused into the same call.

Decoder layers keep the residual stream separate from the normalized activations:
``norm(x, residual)`` adds ``x`` into the residual and normalizes the sum, which saves
a pass over the hidden states per sub-layer and keeps the HF arithmetic order (sum in
the model dtype, normalize in float32, cast back, then scale by the weight). A
platform's fused kernel (``FusedOps.rms_norm``) does all of it in one call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.core.batch_invariance import batch_invariant_enabled
from engine.core.interfaces import FusedOps


def _accelerator_invariant_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                                gemma: bool) -> torch.Tensor | None:
    """Batch-invariant mode on an accelerator: the one-program-per-row Triton RMSNorm
    (torch's GPU kernels may split a row when rows are few). None elsewhere: torch's CPU
    rms_norm already reduces a row on one thread in one order."""
    if x.device.type == "cpu" or not batch_invariant_enabled():
        return None
    from engine.kernels import batch_invariant

    if not batch_invariant.triton_batch_invariant_available(x.device):
        return None
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    return batch_invariant.rms_norm(rows, weight, eps, gemma=gemma).view(x.shape)


def residual_norm(norm: nn.Module, hidden: torch.Tensor, residual: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """A pre-norm layer's first norm: ``(norm(hidden + residual), hidden + residual)``; the
    first layer (``residual`` None) starts the residual stream with ``hidden`` itself."""
    if residual is None:
        return norm(hidden), hidden
    return norm(hidden, residual)


class RMSNorm(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        fused_ops: FusedOps | None = None,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.fused_ops = fused_ops if fused_ops is not None and fused_ops.supports(dtype) else None
        self.weight = nn.Parameter(
            torch.ones(hidden_size, dtype=dtype, device=device), requires_grad=False
        )

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # torch's fused kernel normalizes in float32 and returns x's dtype: bit-identical
        # to HF's op-by-op version, in one pass instead of five.
        invariant = _accelerator_invariant_norm(x, self.weight, self.eps, gemma=False)
        if invariant is not None:
            return invariant
        return F.rms_norm(x, self.weight.shape, None, self.eps) * self.weight

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``norm(x)``; with ``residual``: ``(norm(x + residual), x + residual)``.

        The platform's fused kernel, when there is one, writes ``x + residual`` into
        ``residual`` itself (the decoder's running residual, owned by the forward)."""
        fused = self.fused_ops
        if fused is not None and x.stride(-1) == 1:
            if residual is None:
                heads_contiguous = x.dim() == 3 and x.stride(1) == x.shape[-1]
                flat = x if x.dim() == 2 or heads_contiguous else x.reshape(-1, x.shape[-1])
                return fused.rms_norm(flat, self.weight, self.eps).view(x.shape)
            if x.dim() == 2 and residual.stride(-1) == 1:
                return fused.rms_norm(x, self.weight, self.eps, residual), residual
        if residual is None:
            return self._norm(x)
        summed = residual + x
        return self._norm(summed), summed

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: ``x / rms(x) * (1 + weight)``, all in float32, then cast back
    (HF multiplies before the cast, unlike Llama). The weight is stored zero-centred, as
    checkpoints hold it. ``norm(x, residual)`` adds and normalizes like :class:`RMSNorm`
    (never on the platform's fused kernel, which scales by ``weight`` itself)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, *, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__(hidden_size, eps, dtype=dtype, device=device, fused_ops=None)
        with torch.no_grad():
            self.weight.zero_()

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        invariant = _accelerator_invariant_norm(x, self.weight, self.eps, gemma=True)
        if invariant is not None:
            return invariant
        normed = F.rms_norm(x.float(), self.weight.shape, None, self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class Float32LayerNorm(nn.Module):
    """LayerNorm computed in float32 and cast back, with a weight and no bias (Cohere's
    ``(x - mean) / sqrt(var + eps) * weight``)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, *, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(
            torch.ones(hidden_size, dtype=dtype, device=device), requires_grad=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.layer_norm(x.float(), self.weight.shape, self.weight.float(), None, self.eps)
        return out.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"
