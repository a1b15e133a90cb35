"""Fused mixture-of-experts kernels: a platform's way to run the expert half of a MoE layer.

The model's MoE layer does the routing itself (device-neutral torch: softmax or sigmoid
scores, top-k, renormalization, DeepSeek's grouped top-k): it hands a kernel the tokens,
each token's ``top_k`` chosen experts and their weights, and the stacked expert weights.
The kernel does the rest: permute the (token, expert) pairs by expert, the two grouped
GEMMs with the gated activation between them, and the weighted combine back into token
order. Expert ids are this rank's local ids; ``-1`` marks a choice that another rank
serves (expert parallelism) and contributes nothing here.

Weights, per local expert ``e``: ``w13[e]`` is ``[2 * I, H]`` (the gate projection's rows,
then the up projection's), ``w2[e]`` is ``[H, I]``; ``y = w2 @ (act(w1 x) * (w3 x))``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class MoELayerSpec:
    """What a fused-MoE kernel needs to know to accept or refuse a layer."""

    num_experts: int  # local experts (this rank's)
    hidden_size: int
    intermediate_size: int  # per expert, this rank's part under tensor parallelism
    top_k: int
    dtype: "torch.dtype"  # weights and activations
    device: "torch.device"
    activation: str = "silu"  # the gate's activation (gated MLP experts)


class FusedMoEKernel(ABC):
    """``out[t] = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(hidden[t])``."""

    name: ClassVar[str]

    @classmethod
    @abstractmethod
    def can_implement(cls, spec: MoELayerSpec) -> str | None:
        """None if this kernel can run ``spec``; otherwise why it cannot."""

    @abstractmethod
    def apply(
        self,
        hidden: "torch.Tensor",
        w13: "torch.Tensor",
        w2: "torch.Tensor",
        topk_weights: "torch.Tensor",
        topk_ids: "torch.Tensor",
        activation: str = "silu",
    ) -> "torch.Tensor":
        """``hidden [T, H]``, ``w13 [E, 2I, H]``, ``w2 [E, H, I]``, ``topk_weights
        [T, k]`` float32, ``topk_ids [T, k]`` int (local expert ids, -1: not here) ->
        ``[T, H]`` in hidden's dtype. A token whose choices are all elsewhere gets 0."""
