"""Linear layers whose GEMM goes through a method object.

A layer owns its parameters; *how* they are created and multiplied belongs to a
linear method. The default :class:`UnquantizedLinearMethod` holds a dense weight and
calls ``torch.nn.functional.linear``. A quantized format plugs in through the same two
calls (``create_weights`` / ``apply``, the signatures of
:class:`engine.core.interfaces.QuantMethod`), so the model code never changes when a
checkpoint is quantized.

A layer's ``dtype`` is its activations'; an unquantized weight is stored in
``weight_dtype`` (default the same), which may be narrower: bf16 weights computed in
float32 on a CPU without bf16 arithmetic. Biases follow the activations.

Merged layers (``qkv_proj``, ``gate_up_proj``) concatenate several checkpoint tensors
along the output dimension so one GEMM replaces two or three; their parameters carry a
``weight_loader(param, tensor, shard_id)`` that copies one checkpoint tensor into its
slice, and ``shard_ids`` so the loader can tell which slices are still missing.

Every parameter says how its dims map onto the layer's features (:class:`ParamLayout`):
which dim indexes output features, which input features, which is packed and by how
much (eight int4 codes per int32, 128 output rows per FP8 block scale), or whether it
holds one entry per fused shard (per-tensor scales). A shard's slice is derived from
that alone, so dense weights, packed quantized tensors, group scales and zero points
all load through the same two functions.

Tensor parallelism uses the same metadata: a column-parallel layer (the merged QKV and
gate-up included) keeps ``1/tp`` of each checkpoint shard's output features, a
row-parallel layer ``1/tp`` of the input features and all-reduces its partial sums. The
rank's part is cut from the checkpoint tensor along the dim its layout names, in stored
units (so packed codes, group scales and block scales split alike), before it is read
whole: :class:`~engine.model_executor.weight_utils.LazyTensor` reads only that part from
the safetensors file. GQA key/value heads split over the ranks, or are replicated when
there are more ranks than heads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from engine.core.batch_invariance import batch_invariant_enabled, fixed_shape_linear
from engine.core.interfaces import Communicator, DenseGemmKernel, DenseLayerSpec
from engine.model_executor.lazy_tensor import materialize, split_part


class LinearMethod(Protocol):
    """What a layer asks of its linear method (QuantMethod satisfies this)."""

    def create_weights(
        self, layer: nn.Module, in_features: int, out_features: int, params_dtype: torch.dtype
    ) -> None: ...

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor: ...


class UnquantizedLinearMethod:
    """Dense ``[out, in]`` weight in the layer's ``weight_dtype``; ``y = x W^T + b``.

    The GEMM is the platform's dense kernel once :func:`pack_dense_weights` gave the
    layer one (its weight then lives in that kernel's layout), else ``F.linear``."""

    def create_weights(
        self, layer: nn.Module, in_features: int, out_features: int, params_dtype: torch.dtype
    ) -> None:
        dtype = getattr(layer, "weight_dtype", None) or params_dtype
        weight = torch.empty(out_features, in_features, dtype=dtype, device=layer.device)
        layer.weight = nn.Parameter(weight, requires_grad=False)

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return dense_linear(layer, x, bias)


def dense_linear(layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x W^T + b`` for a layer holding a dense ``weight`` (packed or not)."""
    kernel = layer.gemm_kernel
    if kernel is None:
        if batch_invariant_enabled():
            return fixed_shape_linear(x, layer.weight, bias)
        return F.linear(x, layer.weight, bias)
    return kernel.apply(layer.weight, x, bias)


def pack_dense_weights(model: nn.Module, kernels: list[type[DenseGemmKernel]]) -> int:
    """Offer every dense weight of ``model`` to the platform's kernels, in order; the
    first that accepts a layer repacks its weight (or, for a kernel that keeps the layout,
    only takes it over). Returns how many layers got a kernel. A layer no kernel takes
    keeps ``F.linear``, its weight widened to the activation dtype when stored narrower.

    A layer opts in by defining ``dense_weight_spec()`` (None: no kernel; ``shared``: the
    weight is also read plainly elsewhere, e.g. an LM head tied to the embedding) and a
    ``gemm_kernel`` attribute."""
    packed = 0
    chosen: dict[type[DenseGemmKernel], DenseGemmKernel] = {}
    for module in model.modules():
        spec_of = getattr(module, "dense_weight_spec", None)
        spec = spec_of() if spec_of is not None else None
        if spec is None:
            continue
        for kernel_cls in kernels:
            if spec.batch_invariant and not kernel_cls.batch_invariant:
                continue
            # Repacking would change the weight under its other reader; batch-invariant
            # mode packs a copy instead (a tied LM head's plain-layout GEMM would have
            # to keep one order at every row count, ~2x slower than the packed one).
            if spec.shared and not kernel_cls.keeps_layout and not spec.batch_invariant:
                continue
            if kernel_cls.can_implement(spec) is None:
                kernel = chosen.setdefault(kernel_cls, kernel_cls())
                if not kernel_cls.keeps_layout:
                    weight = kernel.prepare(module.weight, spec)
                    module.weight = nn.Parameter(weight, requires_grad=False)
                module.gemm_kernel = kernel
                packed += 1
                break
        else:
            if spec.dtype != spec.act_dtype:  # F.linear multiplies one dtype
                widened = module.weight.detach().to(spec.act_dtype)
                module.weight = nn.Parameter(widened, requires_grad=False)
    return packed


def dense_spec(
    weight: torch.Tensor, shared: bool = False, activation_dtype: torch.dtype | None = None
) -> DenseLayerSpec:
    out_features, in_features = weight.shape
    return DenseLayerSpec(in_features, out_features, weight.dtype, weight.device, shared,
                          activation_dtype, batch_invariant_enabled())


@dataclass(frozen=True)
class ParamLayout:
    """How a linear parameter's dims map onto the layer's features.

    ``output_dim`` / ``input_dim``: the dims indexing output / input features (None: the
    parameter has none). ``packed_dim``: a dim whose stored elements each cover
    ``packed_factor`` features (int4 codes in an int32: 8; a 128 x 128 block scale: 128).
    ``per_shard``: dim 0 has one entry per fused shard (a per-tensor scale of each of
    q, k and v); ``input_dim`` then names the entry's input-feature dim, if any.
    ``values``: what the values mean when a tensor-parallel shard must rewrite them:
    ``"group_index"`` (GPTQ's g_idx: the scale group of each input feature) or
    ``"feature_shape"`` (a stored ``[out_features, in_features]``)."""

    output_dim: int | None = 0
    input_dim: int | None = 1
    packed_dim: int | None = None
    packed_factor: int = 1
    per_shard: bool = False
    values: Literal["group_index", "feature_shape"] | None = None

    def shard_slice(self, param: torch.Tensor, offset: int, size: int) -> torch.Tensor:
        """The part of ``param`` that output features ``[offset, offset + size)`` own."""
        if self.output_dim is None:
            return param
        if self.packed_dim == self.output_dim and self.packed_factor > 1:
            factor = self.packed_factor
            if offset % factor or size % factor:
                raise ValueError(f"a shard of {size} output features at {offset} does not "
                                 f"align with {factor} features per stored element")
            offset, size = offset // factor, size // factor
        return param.narrow(self.output_dim, offset, size)


DENSE_WEIGHT = ParamLayout(output_dim=0, input_dim=1)
OUTPUT_VECTOR = ParamLayout(output_dim=0, input_dim=None)  # a bias


def param_layout(param: torch.Tensor) -> ParamLayout:
    """A parameter's layout (dense ``[out, in]`` weights and biases need no annotation)."""
    layout = getattr(param, "feature_layout", None)  # (``Tensor.layout`` is torch's own)
    if layout is not None:
        return layout
    return DENSE_WEIGHT if param.dim() == 2 else OUTPUT_VECTOR


def copy_checked(param: torch.Tensor, loaded: torch.Tensor, what: str) -> None:
    """Copy a checkpoint tensor into ``param`` (casting dtype), refusing shape mismatches."""
    loaded = materialize(loaded)
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(
            f"checkpoint tensor for {what} has shape {tuple(loaded.shape)}, "
            f"the model expects {tuple(param.shape)}"
        )
    with torch.no_grad():
        param.copy_(loaded)


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor, shard_id: Any = None) -> None:
    """Whole-tensor load for parameters that are not merged."""
    if shard_id is not None:
        raise ValueError(f"parameter of shape {tuple(param.shape)} has no shard {shard_id!r}")
    copy_checked(param, loaded, "parameter")


def tp_rank_size(tp: Communicator | None) -> tuple[int, int]:
    return (0, 1) if tp is None else (tp.rank, tp.world_size)


def divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"{what} ({total}) is not divisible by tensor_parallel_size={parts}")
    return total // parts


class LinearBase(nn.Module):
    """``y = x W^T (+ b)`` with the GEMM delegated to ``quant_method``.

    ``shard_sizes`` maps each checkpoint tensor the layer is built from (None for a
    plain layer) to the output features this rank owns, in concatenation order.
    ``output_parts[shard]`` = ``(part, parts)``: this rank holds part ``part`` of the
    checkpoint shard's output features cut in ``parts`` (column parallel);
    ``input_part`` the same for the input features (row parallel)."""

    gemm_kernel: DenseGemmKernel | None = None  # set by pack_dense_weights
    # LoRA adapter slots (engine.lora.layers.LoRALinearSlots), set when LoRA is enabled.
    lora: Any = None
    shard_sizes: dict[Any, int]
    output_parts: dict[Any, tuple[int, int]]
    input_part: tuple[int, int] | None = None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device | str,
        quant_method: LinearMethod | None = None,
        weight_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.params_dtype = dtype
        self.weight_dtype = weight_dtype or dtype
        self.device = torch.device(device)
        if not hasattr(self, "shard_sizes"):
            self.shard_sizes = {None: out_features}
        if not hasattr(self, "output_parts"):
            self.output_parts = {}
        self.quant_method: LinearMethod = quant_method or UnquantizedLinearMethod()
        self.quant_method.create_weights(self, in_features, out_features, dtype)
        if bias:
            self.bias = nn.Parameter(
                torch.empty(out_features, dtype=dtype, device=self.device), requires_grad=False
            )
        else:
            self.register_parameter("bias", None)
        self._set_loaders()

    def _set_loaders(self) -> None:
        for param in self.parameters(recurse=False):
            param.weight_loader = self._load_shard
            if len(self.shard_sizes) > 1:
                param.shard_ids = tuple(self.shard_sizes)

    def _load_shard(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: Any = None) -> None:
        """Copy one checkpoint tensor into the part of ``param`` its shard owns."""
        if shard_id not in self.shard_sizes:
            raise ValueError(f"linear layer has shards {list(self.shard_sizes)}, not {shard_id!r}")
        layout = param_layout(param)
        loaded = self._rank_part(loaded, layout, shard_id)
        index = list(self.shard_sizes).index(shard_id)
        if layout.per_shard:
            target = param[index]
            if target.numel() != loaded.numel():
                raise ValueError(f"checkpoint tensor for shard {shard_id} has shape "
                                 f"{tuple(loaded.shape)}, one entry of {tuple(target.shape)} "
                                 "expected")
            copy_checked(target, loaded.reshape(target.shape), f"shard {shard_id}")
            return
        offset = sum(list(self.shard_sizes.values())[:index])
        target = layout.shard_slice(param, offset, self.shard_sizes[shard_id])
        copy_checked(target, loaded, "parameter" if shard_id is None else f"shard {shard_id}")

    def _rank_part(self, loaded: Any, layout: ParamLayout, shard_id: Any) -> torch.Tensor:
        """This rank's part of a checkpoint tensor, read from the file only now."""
        part = self.output_parts.get(shard_id)
        if part is not None and part[1] > 1:
            if layout.values == "feature_shape":
                loaded = materialize(loaded).clone()
                loaded[..., 0] //= part[1]
            elif layout.output_dim is not None and not layout.per_shard:
                loaded = split_part(loaded, layout.output_dim, *part)
        if self.input_part is not None and self.input_part[1] > 1:
            rank, parts = self.input_part
            if layout.values == "feature_shape":
                loaded = materialize(loaded).clone()
                loaded[..., 1] //= parts
            elif layout.input_dim is not None:
                dim = layout.input_dim - 1 if layout.per_shard else layout.input_dim
                if layout.values == "group_index":
                    return _rebased_group_index(materialize(loaded), dim, rank, parts)
                if loaded.shape[dim] > 1:  # one group for the whole row: every rank's
                    loaded = split_part(loaded, dim, rank, parts)
        return materialize(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.quant_method.apply(self, x, self.bias)
        if self.lora is not None:
            self.lora.add_delta(x, out)
        return out

    def dense_weight_spec(self) -> DenseLayerSpec | None:
        """Packable when unquantized and not packed yet."""
        if type(self.quant_method) is not UnquantizedLinearMethod or self.gemm_kernel:
            return None
        return dense_spec(self.weight, activation_dtype=self.params_dtype)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"


def _rebased_group_index(g_idx: torch.Tensor, dim: int, rank: int, parts: int) -> torch.Tensor:
    """Rank ``rank``'s input features of a g_idx, renumbered to its own scale groups.
    An act-order g_idx sends a rank's features to other ranks' groups: refused."""
    groups = int(g_idx.max()) + 1
    if groups == 1:  # one group for the whole row (channelwise): nothing to renumber
        return split_part(g_idx, dim, rank, parts)
    local_groups = divide(groups, parts, "the number of scale groups")
    local = split_part(g_idx, dim, rank, parts) - rank * local_groups
    if bool(((local < 0) | (local >= local_groups)).any()):
        raise ValueError(
            "an act-order g_idx (desc_act) maps this rank's input features to other ranks' "
            "scale groups, so the row-parallel layer cannot be split across "
            f"{parts} tensor-parallel ranks; use tensor_parallel_size=1"
        )
    return local


class ReplicatedLinear(LinearBase):
    """A plain linear layer loaded from one checkpoint tensor (every rank holds it all)."""


class ColumnParallelLinear(LinearBase):
    """Output features split over the TP ranks; each rank returns its slice (no
    communication: the next layer is row parallel, or the caller gathers)."""

    def __init__(self, in_features: int, out_features: int, *, tp: Communicator | None,
                 **kwargs: Any) -> None:
        rank, size = tp_rank_size(tp)
        local = divide(out_features, size, "output features")
        self.shard_sizes = {None: local}
        self.output_parts = {None: (rank, size)}
        super().__init__(in_features, local, **kwargs)


class RowParallelLinear(LinearBase):
    """Input features split over the TP ranks: each rank multiplies its slice of the
    input by its slice of the weight, then the partial sums are all-reduced; the bias is
    added once, after the reduction."""

    def __init__(self, in_features: int, out_features: int, *, tp: Communicator | None,
                 reduce_results: bool = True, **kwargs: Any) -> None:
        rank, size = tp_rank_size(tp)
        self.tp = tp if size > 1 else None
        self.input_part = (rank, size)
        # False: the caller sums this partial result with another before one all-reduce
        # (a MoE layer's shared expert with its routed experts); the bias must be absent.
        self.reduce_results = reduce_results
        super().__init__(divide(in_features, size, "input features"), out_features, **kwargs)
        if not reduce_results and self.bias is not None and self.tp is not None:
            raise ValueError("a row-parallel layer that leaves the reduction to its caller "
                             "cannot add a bias")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return super().forward(x)
        out = self.quant_method.apply(self, x, None)
        if self.lora is not None:  # this rank's partial delta joins the reduction
            self.lora.add_delta(x, out)
        if not self.reduce_results:
            return out
        out = self.tp.all_reduce(out)
        return out if self.bias is None else out + self.bias


class MergedLinear(LinearBase):
    """Several checkpoint linears stacked along the output dimension.

    ``shards`` maps a shard id (what the model's name mapping passes) to the number of
    output rows it owns, in concatenation order. With ``tp`` every shard is column
    parallel: this rank keeps its ``1/tp`` of each (``parts`` overrides how a shard is
    cut: ``{shard: (part, parts)}``, for replicated KV heads).
    """

    def __init__(
        self,
        in_features: int,
        shards: dict[Any, int],
        *,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device | str,
        quant_method: LinearMethod | None = None,
        weight_dtype: torch.dtype | None = None,
        tp: Communicator | None = None,
        parts: dict[Any, tuple[int, int]] | None = None,
    ) -> None:
        rank, size = tp_rank_size(tp)
        self.output_parts = {s: (rank, size) for s in shards} | (parts or {})
        self.shard_sizes = {
            s: divide(n, self.output_parts[s][1], f"output features of shard {s!r}")
            for s, n in shards.items()
        }
        super().__init__(
            in_features,
            sum(self.shard_sizes.values()),
            bias=bias,
            dtype=dtype,
            device=device,
            quant_method=quant_method,
            weight_dtype=weight_dtype,
        )

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Split a forward output back into its shards (views, no copy)."""
        return y.split(list(self.shard_sizes.values()), dim=-1)


class QKVLinear(MergedLinear):
    """Fused q/k/v projection: shards ``"q"``, ``"k"``, ``"v"``.

    With ``tp`` each rank keeps ``num_heads / tp`` query heads and ``num_kv_heads / tp``
    key/value heads; with more ranks than key/value heads each head is replicated on
    ``tp / num_kv_heads`` consecutive ranks (so a rank's query heads still read their own
    group's head). ``num_heads`` / ``num_kv_heads`` are then the rank's counts."""

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        num_heads: int,
        num_kv_heads: int,
        *,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device | str,
        quant_method: LinearMethod | None = None,
        weight_dtype: torch.dtype | None = None,
        tp: Communicator | None = None,
    ) -> None:
        rank, size = tp_rank_size(tp)
        divide(num_heads, size, "attention heads")
        if num_kv_heads >= size:
            divide(num_kv_heads, size, "key/value heads")
            kv_part = (rank, size)
        else:  # replicate: ranks [h * r, (h + 1) * r) share kv head h
            if size % num_kv_heads:
                raise ValueError(f"tensor_parallel_size={size} is not a multiple of the "
                                 f"{num_kv_heads} key/value heads")
            kv_part = (rank // (size // num_kv_heads), num_kv_heads)
        self.head_size = head_size
        self.num_heads = num_heads // size
        self.num_kv_heads = num_kv_heads // kv_part[1]
        super().__init__(
            hidden_size,
            {
                "q": num_heads * head_size,
                "k": num_kv_heads * head_size,
                "v": num_kv_heads * head_size,
            },
            bias=bias,
            dtype=dtype,
            device=device,
            quant_method=quant_method,
            weight_dtype=weight_dtype,
            tp=tp,
            parts={"k": kv_part, "v": kv_part},
        )
