"""What every checkpoint format shares: registering its tensors on a linear layer, the
bit unpacking, and the hand-over of the decoded weights to the platform's kernel.

A format's :class:`QuantizedLinearMethod` is the layer's ``quant_method``:

1. ``create_weights`` registers the checkpoint's tensors (packed as stored) with their
   :class:`~engine.model_executor.layers.linear.ParamLayout`, so the loader fills fused
   shards without knowing the format;
2. after loading, ``finish_loading`` decodes them (:meth:`decode`) into the canonical
   :class:`~engine.core.interfaces.QuantizedWeights`, picks the first of the platform's
   kernels that accepts the layer, lets it take the weights into its own layout and drops
   the checkpoint tensors;
3. ``apply`` runs that kernel.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from engine.core.interfaces import (
    QuantizedGemmKernel,
    QuantizedWeights,
    select_quantized_kernel,
)
from engine.model_executor.layers.linear import ParamLayout, param_layout

# Per fused shard: the scale group of each input feature (GPTQ / compressed-tensors g_idx),
# and a stored [out_features, in_features]; tensor-parallel shards rewrite both.
GROUP_INDEX = ParamLayout(output_dim=None, input_dim=1, per_shard=True, values="group_index")
FEATURE_SHAPE = ParamLayout(output_dim=None, input_dim=None, per_shard=True,
                            values="feature_shape")


def add_param(layer: nn.Module, name: str, shape: Sequence[int], dtype: torch.dtype,
              layout: ParamLayout) -> nn.Parameter:
    """Register a checkpoint tensor of ``layer`` (filled by the loader)."""
    param = nn.Parameter(torch.zeros(tuple(shape), dtype=dtype, device=layer.device),
                         requires_grad=False)
    param.feature_layout = layout
    layer.register_parameter(name, param)
    return param


def whole_group(scheme: str, group: int, in_features: int) -> int:
    """``group`` (<= 0: the whole row) input features per weight scale; ValueError when the
    layer's K is not a whole number of them."""
    group = group if group > 0 else in_features
    if in_features % group:
        raise ValueError(f"{scheme}: {in_features} input features are not a multiple of the "
                         f"group size {group}")
    return group


def num_shards(layer: nn.Module) -> int:
    return len(layer.shard_sizes)


def unpack_codes(packed: torch.Tensor, bits: int, dim: int, order: Sequence[int] | None = None
                 ) -> torch.Tensor:
    """uint8 codes of ``bits``-bit values packed ``32 // bits`` to an int32 along ``dim``:
    element ``j`` of a word at bits ``bits * order[j]`` (``order`` default: in order).
    The result has ``32 // bits`` times the elements along ``dim``."""
    if bits not in (2, 4, 8):
        raise ValueError(f"{bits}-bit codes are not packed whole into int32 words")
    per_word = 32 // bits
    shifts = torch.tensor([bits * (order[j] if order is not None else j)
                           for j in range(per_word)], dtype=torch.int64, device=packed.device)
    words = packed.to(torch.int64) & 0xFFFFFFFF
    moved = words.movedim(dim, -1).unsqueeze(-1)
    codes = (moved >> shifts) & ((1 << bits) - 1)
    codes = codes.flatten(-2).movedim(-1, dim)
    return codes.to(torch.uint8)


def expand_rows(values: torch.Tensor, shard_sizes: Sequence[int]) -> torch.Tensor:
    """A per-shard vector ``[S]`` repeated over each shard's output rows: ``[N, 1]``."""
    sizes = torch.tensor(list(shard_sizes), device=values.device)
    return values.reshape(-1).float().repeat_interleave(sizes).unsqueeze(1)


class QuantizedLinearMethod(ABC):
    """The ``quant_method`` of a linear layer whose weights are quantized (see the
    module docstring); one instance per scheme, shared by the layers that use it."""

    scheme: str  # for messages, e.g. "gptq", "compressed-tensors w4a16"
    # checkpoint scales that must be finite and positive (no tool writes a zero: they
    # replace it by an epsilon); checked before decoding, so a corrupt file is an error
    # naming the tensor instead of NaN / zero outputs
    scale_params: tuple[str, ...] = ()

    @abstractmethod
    def create_weights(self, layer: nn.Module, in_features: int, out_features: int,
                       params_dtype: torch.dtype) -> None:
        """Register the checkpoint's tensors on ``layer``."""

    @abstractmethod
    def decode(self, layer: nn.Module) -> QuantizedWeights:
        """The loaded tensors in canonical form (ValueError for values that cannot be)."""

    def checkpoint_params(self, layer: nn.Module) -> list[str]:
        """The parameters decode() reads, dropped once the kernel has the weights."""
        return [name for name, _ in layer.named_parameters(recurse=False) if name != "bias"]

    def finish_loading(self, layer: nn.Module, kernels: list[type[QuantizedGemmKernel]],
                       kernel_filter: Any = None) -> QuantizedGemmKernel:
        """Decode, pick the kernel, hand the weights over, drop the checkpoint tensors."""
        check_scales(layer, self.scale_params)
        weights = self.decode(layer)
        shards = tuple(weights.shard_sizes) or (weights.spec.out_features,)
        weights.spec = dataclasses.replace(weights.spec, shard_sizes=shards)
        candidates = [k for k in kernels if kernel_filter is None or kernel_filter(k)]
        if kernel_filter is not None and not candidates:
            raise ValueError(f"{kernel_filter.describe()}: none of the platform's quantized "
                             f"kernels ({', '.join(k.name for k in kernels) or 'none'}) is one")
        kernel = select_quantized_kernel(weights.spec, candidates)
        for name in self.checkpoint_params(layer):
            delattr(layer, name)
        kernel.prepare(layer, weights)
        layer.quant_kernel = kernel
        return kernel

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
              ) -> torch.Tensor:
        return layer.quant_kernel.apply(layer, x, bias)


def _shard_at(layer: nn.Module, param: torch.Tensor, index: tuple[int, ...]) -> Any:
    """The fused shard owning element ``index`` of ``param`` (None for a plain layer or a
    parameter without output features)."""
    shards = list(layer.shard_sizes)
    if len(shards) == 1:
        return None
    layout = param_layout(param)
    if layout.per_shard:
        return shards[index[0]]
    if layout.output_dim is None:
        return None
    row = index[layout.output_dim]
    if layout.packed_dim == layout.output_dim:
        row *= layout.packed_factor
    for shard, size in layer.shard_sizes.items():
        if row < size:
            return shard
        row -= size
    return None


def check_scales(layer: nn.Module, names: Sequence[str]) -> None:
    """A ValueError naming the first of ``names`` (the layer's loaded scale tensors) that
    holds a NaN, infinite, zero or negative value, and the fused shard it belongs to."""
    for name in names:
        param = getattr(layer, name, None)
        if param is None:
            continue
        values = param.detach().float()
        bad = ~torch.isfinite(values) | (values <= 0)
        if bool(bad.any()):
            index = tuple(int(i) for i in bad.nonzero()[0])
            shard = _shard_at(layer, param, index)
            where = "" if shard is None else f" (shard {shard!r})"
            raise ValueError(f"checkpoint tensor {name}{where} holds {int(bad.sum())} invalid "
                             f"value(s), e.g. {values[index].item()} at {list(index)}: scales "
                             "must be finite and positive (a corrupt checkpoint?)")


def check_whole_blocks(layer: nn.Module, scheme: str, rows: int, cols: int,
                       in_features: int) -> None:
    """Block-scaled weights load only as whole blocks: every output shard a multiple of
    ``rows`` and the input features of ``cols`` (a ValueError saying so, instead of the
    shard loader's misalignment message)."""
    sizes = list(layer.shard_sizes.values())
    if any(size % rows for size in sizes) or in_features % cols:
        raise ValueError(f"{scheme}: {rows}x{cols} weight blocks need output shards and input "
                         f"features that are whole blocks; this layer has output shards "
                         f"{sizes} and {in_features} input features (partial, padded blocks "
                         "are not supported)")


def shard_g_idx(layer: nn.Module, g_idx: torch.Tensor) -> torch.Tensor:
    """The one act-order of a fused layer's shards (they read the same input, so GPTQ
    orders them alike); a ValueError when they differ."""
    first = g_idx[0]
    if not bool((g_idx == first).all()):
        raise ValueError("the fused shards of this layer have different g_idx (act-order "
                         "permutations); they cannot share one GEMM")
    return first.to(torch.int64)


def trivial_g_idx(g_idx: torch.Tensor, group_size: int) -> bool:
    """Whether ``g_idx`` is the plain ``k // group_size`` (no reordering needed)."""
    plain = torch.arange(g_idx.numel(), dtype=torch.int64, device=g_idx.device) // group_size
    return bool((g_idx.to(torch.int64) == plain).all())
