"""Token embedding and the LM head (which may share the embedding's weight).

Both store their matrix in ``weight_dtype`` (default: ``dtype``, the activations'); a
narrower one (bf16 weights, float32 activations) is widened by the lookup and the GEMM.

Vocab parallel (``tp`` of more than one rank): each rank holds ``ceil(vocab / tp)`` rows
(:class:`VocabShard`; the last rank's tail is zero padding). The embedding looks up the ids
its rows cover, zeroes the others and all-reduces; the LM head computes its rows' logits
and all-gathers them, dropping the padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.core.interfaces import Communicator, DenseGemmKernel, DenseLayerSpec, FusedOps
from engine.model_executor.layers.linear import (
    copy_checked,
    default_weight_loader,
    dense_linear,
    dense_spec,
    tp_rank_size,
)
from engine.model_executor.lazy_tensor import materialize


@dataclass(frozen=True)
class VocabShard:
    """Rows ``[start, start + num_real)`` of the vocabulary, stored in ``num_rows`` rows
    (the rest padding)."""

    vocab_size: int
    start: int
    num_real: int
    num_rows: int

    @classmethod
    def of(cls, vocab_size: int, tp: Communicator | None) -> VocabShard:
        rank, size = tp_rank_size(tp)
        rows = -(-vocab_size // size)
        start = min(rank * rows, vocab_size)
        return cls(vocab_size, start, max(0, min(rows, vocab_size - start)), rows)

    @property
    def sharded(self) -> bool:
        return self.num_rows != self.vocab_size or self.start != 0

    def loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: object = None
               ) -> None:
        """Copy this shard's rows of a ``[vocab, ...]`` checkpoint tensor; zero the padding."""
        if shard_id is not None:
            raise ValueError(f"vocabulary parameter has no shard {shard_id!r}")
        if loaded.shape[0] != self.vocab_size:
            raise ValueError(f"checkpoint tensor has {loaded.shape[0]} vocabulary rows, the "
                             f"model expects {self.vocab_size}")
        rows = materialize(loaded.narrow(0, self.start, self.num_real))
        copy_checked(param[: self.num_real], rows, "vocabulary rows")
        with torch.no_grad():
            param[self.num_real :].zero_()


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
        tp: Communicator | None = None,
    ) -> None:
        super().__init__()
        weight_dtype = weight_dtype or dtype
        self.shard = VocabShard.of(num_embeddings, tp)
        self.tp = tp if self.shard.sharded else None
        usable = fused_ops is not None and fused_ops.supports(dtype) and fused_ops.supports(
            weight_dtype)
        # The platform's lookup kernel (which a forward graph can replay), else F.embedding.
        self.fused_ops = fused_ops if usable else None
        self.dtype = dtype
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.weight = nn.Parameter(
            torch.empty(self.shard.num_rows, embedding_dim, dtype=weight_dtype, device=device),
            requires_grad=False,
        )
        self.weight.weight_loader = self.shard.loader if self.tp else default_weight_loader

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return self._lookup(input_ids)
        fused = self.fused_ops
        if fused is not None and input_ids.dim() == 1 and input_ids.dtype == torch.int64:
            # One kernel call (a forward graph records it with the all-reduce).
            out = fused.embedding_shard(input_ids, self.weight, self.shard.start,
                                        self.shard.num_real, self.num_embeddings, self.dtype)
            return self.tp.all_reduce(out)
        local = input_ids - self.shard.start
        outside = (local < 0) | (local >= self.shard.num_real)
        out = self._lookup(local.masked_fill(outside, 0))
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)

    def _lookup(self, input_ids: torch.Tensor) -> torch.Tensor:
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
        tp: Communicator | None = None,
    ) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.dtype = dtype
        self.shard = VocabShard.of(vocab_size, tp)
        self.tp = tp if self.shard.sharded else None
        loader = self.shard.loader if self.tp else default_weight_loader
        rows = self.shard.num_rows
        self.weight = nn.Parameter(
            torch.empty(rows, hidden_size, dtype=weight_dtype or dtype, device=device),
            requires_grad=False,
        )
        self.weight.weight_loader = loader
        if bias:
            self.bias = nn.Parameter(
                torch.empty(rows, dtype=dtype, device=device), requires_grad=False
            )
            self.bias.weight_loader = loader
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
        logits = dense_linear(self, hidden, self.bias).float()
        if self.tp is None:
            return logits
        return self.tp.all_gather(logits, dim=-1)[:, : self.vocab_size]

    def dense_weight_spec(self) -> DenseLayerSpec | None:
        """Packable unless tied: the embedding lookup needs the plain matrix, so a tied
        head only takes kernels that keep the layout (``shared``)."""
        if self.gemm_kernel:
            return None
        return dense_spec(self.weight, shared=self.tied, activation_dtype=self.dtype)
