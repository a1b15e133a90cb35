"""Token embedding and the LM head (which may share the embedding's weight).

Both store their matrix in ``weight_dtype`` (default: ``dtype``, the activations'); a
narrower one (bf16 weights, float32 activations) is widened by the lookup and the GEMM.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.core.interfaces import DenseGemmKernel, DenseLayerSpec, FusedOps
from engine.model_executor.layers.linear import default_weight_loader, dense_linear, dense_spec


class VocabEmbedding(nn.Module):
    """``ids [T] -> [T, hidden]``."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        fused_ops: FusedOps | None = None,
        weight_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        weight_dtype = weight_dtype or dtype
        usable = fused_ops is not None and fused_ops.supports(dtype) and fused_ops.supports(
            weight_dtype)
        # The platform's lookup kernel (which a forward graph can replay), else F.embedding.
        self.fused_ops = fused_ops if usable else None
        self.dtype = dtype
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.weight = nn.Parameter(
            torch.empty(num_embeddings, embedding_dim, dtype=weight_dtype, device=device),
            requires_grad=False,
        )
        self.weight.weight_loader = default_weight_loader

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        fused = self.fused_ops
        if fused is not None and input_ids.dim() == 1 and input_ids.dtype == torch.int64:
            return fused.embedding(input_ids, self.weight, self.dtype)
        return F.embedding(input_ids, self.weight).to(self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


class LMHead(nn.Module):
    """``hidden [N, hidden] -> logits [N, vocab]`` in float32 (what samplers want)."""

    gemm_kernel: DenseGemmKernel | None = None  # set by pack_dense_weights

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        bias: bool = False,
        weight_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.dtype = dtype
        self.weight = nn.Parameter(
            torch.empty(vocab_size, hidden_size, dtype=weight_dtype or dtype, device=device),
            requires_grad=False,
        )
        self.weight.weight_loader = default_weight_loader
        if bias:
            self.bias = nn.Parameter(
                torch.empty(vocab_size, dtype=dtype, device=device), requires_grad=False
            )
            self.bias.weight_loader = default_weight_loader
        else:
            self.register_parameter("bias", None)
        self.tied = False

    def tie_to(self, embedding: VocabEmbedding) -> None:
        """Share the embedding matrix (``tie_word_embeddings``)."""
        if embedding.weight.shape != self.weight.shape:
            raise ValueError(
                f"cannot tie LM head {tuple(self.weight.shape)} to embedding "
                f"{tuple(embedding.weight.shape)}"
            )
        self.weight = embedding.weight
        self.tied = True

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return dense_linear(self, hidden, self.bias).float()

    def dense_weight_spec(self) -> DenseLayerSpec | None:
        """Packable unless tied: the embedding lookup needs the plain matrix, so a tied
        head only takes kernels that keep the layout (``shared``)."""
        if self.gemm_kernel:
            return None
        return dense_spec(self.weight, shared=self.tied, activation_dtype=self.dtype)
