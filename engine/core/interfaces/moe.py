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

Layers with expert biases (``MoELayerSpec.has_bias``; GPT-OSS) also pass ``w13_bias [E,
2I]`` and ``w2_bias [E, H]`` (either may be None: a tensor-parallel rank other than the
first has no down bias): ``g, u = w1 x + b1, w3 x + b3``, ``y = w2 @ h + b2``, the
routing weight scaling the whole ``y``. Activation ``"swigluoai"`` (GPT-OSS's clamped
SwiGLU) is not ``act(g) * u`` but ``h = (clamp(u, -7, 7) + 1) * g' * sigmoid(1.702 g')``
with ``g' = clamp(g, max=7)`` (:data:`SWIGLUOAI_ALPHA`, :data:`SWIGLUOAI_LIMIT`).

Ungated experts (``MoELayerSpec.gated`` False; Nemotron-H): ``w13[e]`` is ``[I, H]``, the
up projection alone, and ``y = w2 @ act(w13 x)``; activation ``"relu2"`` is
``relu(x) ** 2`` (:data:`UNGATED_ACTIVATIONS`). Such a layer is given only to a kernel with
``supports_ungated``, which apply() then receives with ``gated=False``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    import torch

SWIGLUOAI_ALPHA = 1.702  # GPT-OSS: sigmoid gain of the clamped SwiGLU
SWIGLUOAI_LIMIT = 7.0  # GPT-OSS: the clamp on gate (above) and up (both sides)
# Activations of ungated experts, ``y = w2 @ act(w13 x)`` (relu2: relu(x) ** 2)
UNGATED_ACTIVATIONS = ("relu2", "silu", "gelu")


@dataclass(frozen=True)
class MoELayerSpec:
    """What a fused-MoE kernel needs to know to accept or refuse a layer."""

    num_experts: int  # local experts (this rank's)
    hidden_size: int
    intermediate_size: int  # per expert, this rank's part under tensor parallelism
    top_k: int
    dtype: "torch.dtype"  # weights and activations
    device: "torch.device"
    activation: str = "silu"  # the gate's activation (gated MLP experts), or "swigluoai"
    has_bias: bool = False  # expert biases w13_bias / w2_bias (see the module docstring)
    gated: bool = True  # False: ungated experts, w13 [E, I, H] (see the module docstring)


class FusedMoEKernel(ABC):
    """``out[t] = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(hidden[t])``."""

    name: ClassVar[str]
    # Whether apply() takes w13_bias / w2_bias (a ``has_bias`` layer is refused otherwise)
    supports_expert_bias: ClassVar[bool] = False
    # Whether apply() takes ``gated=False`` layers (an ungated layer is refused otherwise)
    supports_ungated: ClassVar[bool] = False

    @classmethod
    @abstractmethod
    def can_implement(cls, spec: MoELayerSpec) -> str | None:
        """None if this kernel can run ``spec``; otherwise why it cannot."""

    def prepare_weights(self, w13: "torch.Tensor", w2: "torch.Tensor"
                        ) -> tuple["torch.Tensor", "torch.Tensor"]:
        """Once, after the layer's weights are loaded: ``w13`` / ``w2`` in the layout
        :meth:`apply` will be given (e.g. each expert repacked for the platform's GEMM;
        the same shapes and dtypes). Default: as loaded."""
        return w13, w2

    @abstractmethod
    def apply(
        self,
        hidden: "torch.Tensor",
        w13: "torch.Tensor",
        w2: "torch.Tensor",
        topk_weights: "torch.Tensor",
        topk_ids: "torch.Tensor",
        activation: str = "silu",
        *,
        w13_bias: torch.Tensor | None = None,
        w2_bias: torch.Tensor | None = None,
        gated: bool = True,
    ) -> "torch.Tensor":
        """``hidden [T, H]``, ``w13 [E, 2I, H]``, ``w2 [E, H, I]``, ``topk_weights
        [T, k]`` float32, ``topk_ids [T, k]`` int (local expert ids, -1: not here) ->
        ``[T, H]`` in hidden's dtype. A token whose choices are all elsewhere gets 0.
        ``w13_bias`` / ``w2_bias``: passed only for a ``has_bias`` layer, which only a
        kernel with ``supports_expert_bias`` is given. ``gated=False``: ``w13 [E, I, H]``,
        passed only for an ungated layer, which only a kernel with ``supports_ungated``
        is given."""
