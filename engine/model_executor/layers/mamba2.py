"""The Mamba-2 mixer, shared by pure Mamba-2 models and attention + Mamba-2 hybrids.

Per token (transformers' ``Mamba2Mixer`` torch path): ``in_proj`` -> split into the gate
``z``, ``xBC`` and ``dt``; a causal depthwise conv + SiLU over ``xBC`` (its last
``d_conv - 1`` inputs kept per request in the conv state); the SSD scan with
``A = -exp(A_log)``, ``dt = softplus(dt + dt_bias)`` (clamped to ``time_step_limit``) and
the ``D`` skip (its state ``[nheads, head_dim, d_state]`` kept per request); a gated
RMSNorm (``x * silu(z)``, normalized per group of ``intermediate / n_groups``); then
``out_proj``.

The states live in the runner's state caches; the layer reads its own pair
(``ForwardContext.state_caches[state_index]``) and the step's slots and progress
(``ForwardContext.state_metadata``). A step where every request decodes one token from
its state runs the single-step kernels, a prefill-only step the varlen prefill kernels,
and a step mixing both runs each group on its own kernels (the metadata's ``parts``), so
a decode is never padded to a prefill chunk.

Tensor parallelism (vLLM's split): ``in_proj`` is column parallel with each of its z, x,
B, C and dt blocks cut on its own (z, x, dt by heads; B, C by groups, each group
replicated on ``tp / n_groups`` consecutive ranks when there are fewer groups than
ranks, like GQA's key/value heads), the depthwise conv's channels follow x, B and C,
``A_log`` / ``D`` / ``dt_bias`` split by heads, the gated norm keeps the rank's channels
(a group spread over several ranks sums its squares over them), and ``out_proj`` is row
parallel. Each rank's state is its heads' and groups' share.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.core.interfaces import Communicator
from engine.kernels import ssm
from engine.model_executor.forward_context import get_forward_context
from engine.model_executor.layers.linear import (
    MergedLinear,
    RowParallelLinear,
    copy_checked,
    param_layout,
    tp_rank_size,
)
from engine.model_executor.lazy_tensor import split_part
from engine.model_executor.models.interface import ModelInitContext
from engine.model_executor.state_cache import StateLayerSpec


@dataclass(frozen=True)
class Mamba2Dims:
    """A Mamba-2 mixer's sizes and switches, whatever the config family calls them."""

    hidden_size: int
    num_heads: int
    head_dim: int
    n_groups: int
    d_state: int
    d_conv: int
    intermediate_size: int
    use_bias: bool
    use_conv_bias: bool
    chunk_size: int
    norm_eps: float
    dt_limit: tuple[float, float] = (0.0, float("inf"))
    activation: str = "silu"
    ssm_state_dtype: torch.dtype | None = None  # None: the model dtype

    @property
    def conv_dim(self) -> int:
        return self.intermediate_size + 2 * self.n_groups * self.d_state

    def state_layer_spec(self, dtype: torch.dtype) -> StateLayerSpec:
        """Conv window ``[conv_dim, d_conv - 1]`` and SSM state ``[nheads, head_dim,
        d_state]`` per slot."""
        return StateLayerSpec(
            shapes=((self.conv_dim, self.d_conv - 1),
                    (self.num_heads, self.head_dim, self.d_state)),
            dtypes=(dtype, self.ssm_state_dtype or dtype),
        )


def ssm_cache_dtype(hf_config: Any) -> torch.dtype | None:
    """``mamba_ssm_cache_dtype`` (Nemotron-H style configs; vLLM's option): "float32"
    keeps the SSM state in float32; absent or "auto": the model dtype."""
    name = getattr(hf_config, "mamba_ssm_cache_dtype", None)
    return None if name in (None, "auto") else getattr(torch, name)


def dt_limit_of(hf_config: Any) -> tuple[float, float]:
    limit = getattr(hf_config, "time_step_limit", None) or (0.0, float("inf"))
    return float(limit[0]), float(limit[1])


def scan_chunk_size(config_chunk: int, max_query_len: int) -> int:
    """The SSD scan's chunk length for a step: the config's, or less when no request has
    that many tokens (each request's tokens are padded to whole chunks, and a chunk costs
    its length squared; the result is the same up to rounding)."""
    return max(1, min(config_chunk, 1 << max(4, (max_query_len - 1).bit_length())))


Part = tuple[int, int]  # (part, parts): this rank holds part ``part`` of ``parts``
Segments = list[tuple[int, Part]]  # rows of a checkpoint tensor, in order, and their cut


def rank_part(tp: Communicator | None) -> Part:
    return tp_rank_size(tp)


def group_part(n_groups: int, tp: Communicator | None, what: str = "Mamba-2") -> Part:
    """How B / C groups are cut: ``n_groups / tp`` per rank, or each group replicated on
    ``tp / n_groups`` consecutive ranks when there are fewer groups than ranks."""
    rank, size = tp_rank_size(tp)
    if n_groups % size == 0:
        return rank, size
    if size % n_groups == 0:
        return rank // (size // n_groups), n_groups
    raise ValueError(f"{what}: n_groups ({n_groups}) and tensor_parallel_size={size}: the "
                     "groups must split evenly over the ranks or be replicated evenly "
                     "(one must divide the other)")


def check_heads(num_heads: int, tp: Communicator | None, what: str) -> int:
    """``num_heads / tp``, or a ValueError naming both numbers."""
    size = tp_rank_size(tp)[1]
    if num_heads % size:
        raise ValueError(f"{what} ({num_heads}) is not divisible by "
                         f"tensor_parallel_size={size}")
    return num_heads // size


def segment_loader(segments: Segments) -> Callable[..., None]:
    """A weight loader for a parameter whose dim 0 stacks checkpoint segments, each cut
    over the ranks by its own part (a depthwise conv over x, B and C; per-head vectors):
    this rank's piece of each, read from the file only now, side by side."""

    def load(param: torch.Tensor, loaded: Any, shard_id: Any = None) -> None:
        if shard_id is not None:
            raise ValueError(f"parameter of shape {tuple(param.shape)} has no shard "
                             f"{shard_id!r}")
        full = sum(n for n, _ in segments)
        if loaded.shape[0] != full:
            raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)}: {full} rows "
                             "expected")
        at = local = 0
        for n, (part, parts) in segments:
            piece = loaded.narrow(0, at, n)
            if parts > 1:
                piece = split_part(piece, 0, part, parts)
            copy_checked(param.narrow(0, local, n // parts), piece, "parameter")
            at, local = at + n, local + n // parts

    return load


def sharded_parameter(shape: tuple[int, ...], segments: Segments, *, dtype: torch.dtype,
                      device: torch.device, fill: float | None = None) -> nn.Parameter:
    """This rank's rows of a parameter whose dim 0 stacks ``segments``."""
    rows = sum(n // parts for n, (_, parts) in segments)
    data = torch.empty((rows, *shape), dtype=dtype, device=device)
    if fill is not None:
        data.fill_(fill)
    param = nn.Parameter(data, requires_grad=False)
    param.weight_loader = segment_loader(segments)
    return param


class StackedColumnLinear(MergedLinear):
    """A column-parallel linear loaded from ONE checkpoint tensor that stacks several
    blocks along its output features (Mamba's ``in_proj``: z, x, B, C, dt): each block is
    cut over the ranks by its own part (``parts``, default ``1/tp``), as a merged layer's
    shards are, and the rank's pieces sit side by side (``split()`` returns them)."""

    def __init__(self, in_features: int, blocks: dict[str, int], *, tp: Communicator | None,
                 parts: dict[str, Part] | None = None, **kwargs: Any) -> None:
        self.full_sizes = dict(blocks)
        super().__init__(in_features, blocks, tp=tp, parts=parts, **kwargs)
        for param in self.parameters(recurse=False):
            if hasattr(param, "shard_ids"):
                del param.shard_ids  # one checkpoint tensor fills every block
            param.weight_loader = self._load_stacked

    def _load_stacked(self, param: torch.Tensor, loaded: Any, shard_id: Any = None) -> None:
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} loads one stacked tensor, not shard "
                             f"{shard_id!r}")
        layout = param_layout(param)
        if layout.output_dim is None or layout.per_shard:  # one value for every block
            for block in self.full_sizes:
                self._load_shard(param, loaded, block)
            return
        dim = layout.output_dim
        factor = layout.packed_factor if layout.packed_dim == dim else 1
        total = sum(self.full_sizes.values())
        if loaded.shape[dim] * factor != total:
            raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)}: {total} "
                             f"output features expected along dim {dim}")
        at = 0
        for block, n in self.full_sizes.items():
            if at % factor or n % factor:
                raise ValueError(f"block {block!r} ({n} features at {at}) does not align "
                                 f"with {factor} features per stored element")
            self._load_shard(param, loaded.narrow(dim, at // factor, n // factor), block)
            at += n


class GatedRMSNorm(nn.Module):
    """``weight * rmsnorm_per_group(x * silu(z))`` in float32 (transformers'
    ``MambaRMSNormGated`` with ``norm_before_gate=False``).

    ``size`` is the whole intermediate size and ``group_size`` its ``size / n_groups``
    (transformers'), whatever the ranks: with ``tp`` this rank holds ``size / tp``
    channels (its heads'); when a group is wider than that (fewer groups than ranks) the
    group's sum of squares is gathered from the ranks that share it."""

    def __init__(self, size: int, group_size: int, eps: float, *, dtype: torch.dtype,
                 device: torch.device, tp: Communicator | None = None) -> None:
        super().__init__()
        rank, ranks = tp_rank_size(tp)
        self.group_size = group_size
        self.eps = eps
        local = size // ranks
        # Ranks per group (1: this rank holds whole groups).
        self.span = group_size // local if group_size > local else 1
        self.tp = tp if self.span > 1 else None
        self.weight = sharded_parameter((), [(size, (rank, ranks))], dtype=dtype,
                                        device=device, fill=1.0)

    def normalize(self, h: torch.Tensor) -> torch.Tensor:
        """``h`` (float32) RMS-normalized per group of ``group_size``."""
        if self.tp is None:
            groups = h.view(*h.shape[:-1], -1, self.group_size)
            groups = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.eps)
            return groups.view(h.shape)
        sums = self.tp.all_gather(h.pow(2).sum(-1, keepdim=True), dim=-1)  # [..., tp]
        mine = self.tp.rank // self.span
        group = sums.view(*sums.shape[:-1], -1, self.span).sum(-1)[..., mine:mine + 1]
        return h * torch.rsqrt(group / self.group_size + self.eps)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = self.normalize(x.float() * F.silu(z.float()))
        return self.weight * h.to(dtype)


class _Conv1dWeights(nn.Module):
    """Holds the checkpoint's ``conv1d.weight [conv_dim, 1, d_conv]`` and ``conv1d.bias``;
    ``segments``: how the channels are cut over the ranks (depthwise: each channel's
    filter stays with its channel; default: all ``dim`` channels on every rank)."""

    def __init__(self, dim: int, width: int, bias: bool, dtype: torch.dtype,
                 device: torch.device, segments: Segments | None = None) -> None:
        super().__init__()
        segments = segments or [(dim, (0, 1))]
        if sum(n for n, _ in segments) != dim:
            raise ValueError(f"conv segments {segments} do not cover {dim} channels")
        common = {"dtype": dtype, "device": device}
        self.weight = sharded_parameter((1, width), segments, **common)
        if bias:
            self.bias = sharded_parameter((), segments, **common)
        else:
            self.register_parameter("bias", None)


class Mamba2Mixer(nn.Module):
    """One Mamba-2 mixer; ``state_index``: its place among the model's state layers."""

    def __init__(self, dims: Mamba2Dims, ctx: ModelInitContext, prefix: str,
                 state_index: int) -> None:
        super().__init__()
        if dims.num_heads * dims.head_dim != dims.intermediate_size:
            raise ValueError(f"Mamba-2: num_heads x head_dim = {dims.num_heads * dims.head_dim}"
                             f" != intermediate size {dims.intermediate_size}")
        if dims.num_heads % dims.n_groups:
            raise ValueError(f"Mamba-2: num_heads ({dims.num_heads}) is not a multiple of "
                             f"n_groups ({dims.n_groups})")
        if dims.activation not in ("silu", "swish"):
            raise ValueError(f"Mamba-2: activation {dims.activation!r} is not supported")
        heads = rank_part(ctx.tp)
        local_heads = check_heads(dims.num_heads, ctx.tp, "Mamba-2: num_heads")
        groups = group_part(dims.n_groups, ctx.tp)
        self.full_dims = dims
        # This rank's sizes: its heads, their channels and their groups.
        self.dims = dataclasses.replace(dims, num_heads=local_heads,
                                        n_groups=dims.n_groups // groups[1],
                                        intermediate_size=local_heads * dims.head_dim)
        self.state_index = state_index
        self.dtype = ctx.dtype
        inner, gn = dims.intermediate_size, dims.n_groups * dims.d_state
        self.in_proj = self.make_in_proj(
            dims, ctx, prefix, {"z": inner, "x": inner, "B": gn, "C": gn,
                                "dt": dims.num_heads}, {"B": groups, "C": groups})
        self.conv1d = _Conv1dWeights(dims.conv_dim, dims.d_conv, dims.use_conv_bias,
                                     ctx.dtype, ctx.device,
                                     segments=[(inner, heads), (gn, groups), (gn, groups)])
        f32 = {"dtype": torch.float32, "device": ctx.device}
        per_head = [(dims.num_heads, heads)]
        self.dt_bias = sharded_parameter((), per_head, **f32)
        self.A_log = sharded_parameter((), per_head, **f32)
        self.D = sharded_parameter((), per_head, **f32)
        self.norm = GatedRMSNorm(inner, inner // dims.n_groups, dims.norm_eps,
                                 dtype=ctx.dtype, device=ctx.device, tp=ctx.tp)
        self.out_proj = RowParallelLinear(inner, dims.hidden_size, bias=dims.use_bias,
                                          tp=ctx.tp,
                                          quant_method=ctx.linear_method(f"{prefix}.out_proj"),
                                          **ctx.matrix_dtypes, device=ctx.device)

    def make_in_proj(self, dims: Mamba2Dims, ctx: ModelInitContext, prefix: str,
                     blocks: dict[str, int], parts: dict[str, Part]) -> StackedColumnLinear:
        """``in_proj``: the checkpoint's [z, x, B, C, dt] rows, each block cut by its part."""
        return StackedColumnLinear(dims.hidden_size, blocks, tp=ctx.tp, parts=parts,
                                   bias=dims.use_bias,
                                   quant_method=ctx.linear_method(f"{prefix}.in_proj"),
                                   **ctx.matrix_dtypes, device=ctx.device)

    def state_layer_spec(self) -> StateLayerSpec:
        return self.dims.state_layer_spec(self.dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        d = self.dims
        fwd = get_forward_context()
        md = fwd.state_metadata
        states = fwd.state_caches[self.state_index]
        num_tokens = hidden.shape[0]
        z, xbc, dt = self.in_proj(hidden).split(
            [d.intermediate_size, d.conv_dim, d.num_heads], dim=-1)
        if not md.parts:
            y = self._scan(xbc, dt, states, md)
        else:  # decodes and prefills of one step, each on its own kernels
            y = xbc.new_empty(num_tokens, d.intermediate_size)
            for part in md.parts:
                rows = part.token_index
                y.index_copy_(0, rows, self._scan(xbc.index_select(0, rows),
                                                  dt.index_select(0, rows), states, part))
        y = self.norm(y, z)
        return self.out_proj(y.to(self.dtype))

    def _scan(self, xbc: torch.Tensor, dt: torch.Tensor,
              states: tuple[torch.Tensor, ...], md: Any) -> torch.Tensor:
        """Conv + SiLU, then the SSD scan with the ``D`` skip: ``[n, intermediate]``."""
        d = self.dims
        conv_state, ssm_state = states
        num_tokens = xbc.shape[0]
        weight = self.conv1d.weight.view(d.conv_dim, d.d_conv)
        if md.is_decode:
            xbc = ssm.causal_conv1d_decode(xbc, weight, conv_state, md.state_indices,
                                           bias=self.conv1d.bias, activation="silu")
        else:
            xbc = ssm.causal_conv1d_prefill(xbc, weight, conv_state, md.query_start_loc,
                                            md.state_indices, md.has_initial_state,
                                            bias=self.conv1d.bias, activation="silu")
        gn = d.n_groups * d.d_state
        x, b, c = xbc.split([d.intermediate_size, gn, gn], dim=-1)
        x = x.reshape(num_tokens, d.num_heads, d.head_dim)
        b = b.reshape(num_tokens, d.n_groups, d.d_state)
        c = c.reshape(num_tokens, d.n_groups, d.d_state)
        a = -torch.exp(self.A_log)
        if md.is_decode:
            y = ssm.mamba2_ssd_decode(x, dt, a, b, c, ssm_state, md.state_indices, D=self.D,
                                      dt_bias=self.dt_bias, dt_limit=d.dt_limit)
        else:
            y = ssm.mamba2_ssd_prefill(x, dt, a, b, c, ssm_state, md.query_start_loc,
                                       md.state_indices, md.has_initial_state, D=self.D,
                                       dt_bias=self.dt_bias, dt_limit=d.dt_limit,
                                       chunk_size=scan_chunk_size(d.chunk_size,
                                                                  md.max_query_len))
        return y.reshape(num_tokens, d.intermediate_size)
