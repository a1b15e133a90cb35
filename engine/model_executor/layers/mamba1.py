"""The Mamba-1 mixer, shared by pure Mamba models and attention + Mamba-1 hybrids (Jamba).

Per token (transformers' ``MambaMixer`` torch path): ``in_proj`` -> the SSM input ``x``
and the gate ``z``; a causal depthwise conv + SiLU over ``x`` (its last ``d_conv - 1``
inputs kept per request in the conv state ``[d_inner, d_conv - 1]``); ``x_proj`` -> the
time step (rank ``dt_rank``), ``B`` and ``C`` (Jamba RMS-normalizes each of the three);
``dt = dt_proj.weight @ time_step`` whose bias the scan adds before the softplus; the
selective scan with ``A = -exp(A_log)``, the ``D`` skip and the ``silu(z)`` gate (its
state ``[d_inner, d_state]`` kept per request); then ``out_proj``.

States and per-step metadata come from the forward context as for the Mamba-2 mixer
(:mod:`engine.model_executor.layers.mamba2`): a decode-only step runs the single-step
kernels, a prefill step the varlen kernels, a mixed step each part on its own.

Tensor parallelism (vLLM's split): the ``d_inner`` channels are cut over the ranks:
``in_proj`` column parallel (its x and z halves each), the conv, ``dt_proj``, ``A_log``
and ``D`` by channel, ``x_proj`` row parallel (its time step, B and C all-reduced, so
every rank scans its channels with the whole B and C), ``out_proj`` row parallel.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import ssm
from engine.model_executor.forward_context import get_forward_context
from engine.model_executor.layers.linear import RowParallelLinear
from engine.model_executor.layers.mamba2 import (
    Segments,
    StackedColumnLinear,
    _Conv1dWeights,
    check_heads,
    rank_part,
    sharded_parameter,
)
from engine.model_executor.layers.norm import RMSNorm
from engine.model_executor.models.interface import ModelInitContext
from engine.model_executor.state_cache import StateLayerSpec, StateMetadata


@dataclass(frozen=True)
class Mamba1Dims:
    """A Mamba-1 mixer's sizes and switches, whatever the config family calls them."""

    hidden_size: int
    intermediate_size: int
    d_state: int
    d_conv: int
    dt_rank: int
    use_bias: bool
    use_conv_bias: bool
    activation: str = "silu"
    # Jamba: RMSNorm over the time step, B and C with this eps; None: no such norms.
    bcdt_norm_eps: float | None = None
    ssm_state_dtype: torch.dtype | None = None  # None: the model dtype

    def state_layer_spec(self, dtype: torch.dtype) -> StateLayerSpec:
        """Conv window ``[d_inner, d_conv - 1]`` and SSM state ``[d_inner, d_state]`` per
        slot."""
        return StateLayerSpec(
            shapes=((self.intermediate_size, self.d_conv - 1),
                    (self.intermediate_size, self.d_state)),
            dtypes=(dtype, self.ssm_state_dtype or dtype),
        )


class _DtProj(nn.Module):
    """``dt_proj``'s weight ``[d_inner, dt_rank]`` and bias, kept apart: the bias goes to
    the scan (added in float32 before the softplus, as transformers does)."""

    def __init__(self, rank: int, channels: Segments, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.weight = sharded_parameter((rank,), channels, dtype=dtype, device=device)
        self.bias = sharded_parameter((), channels, dtype=torch.float32, device=device)


def by_parts(md: StateMetadata, width: int, inputs: tuple[torch.Tensor, ...],
             run: Callable[..., torch.Tensor]) -> torch.Tensor:
    """``run(*inputs, md)`` on the whole step, or on each of its parts' rows (decodes and
    prefills of one step, each on its own kernels), gathered back into ``[T, width]``."""
    if not md.parts:
        return run(*inputs, md)
    out = inputs[0].new_empty(inputs[0].shape[0], width)
    for part in md.parts:
        rows = part.token_index
        out.index_copy_(0, rows, run(*(t.index_select(0, rows) for t in inputs), part))
    return out


class Mamba1Mixer(nn.Module):
    """One Mamba-1 mixer; ``state_index``: its place among the model's state layers."""

    def __init__(self, dims: Mamba1Dims, ctx: ModelInitContext, prefix: str,
                 state_index: int) -> None:
        super().__init__()
        if dims.activation not in ("silu", "swish"):
            raise ValueError(f"Mamba-1: activation {dims.activation!r} is not supported")
        inner, n = dims.intermediate_size, dims.d_state
        local = check_heads(inner, ctx.tp, "Mamba-1: intermediate_size")
        channels = [(inner, rank_part(ctx.tp))]
        self.full_dims = dims
        self.dims = dataclasses.replace(dims, intermediate_size=local)  # this rank's channels
        self.state_index = state_index
        self.dtype = ctx.dtype
        common = {**ctx.matrix_dtypes, "device": ctx.device, "tp": ctx.tp}
        self.in_proj = StackedColumnLinear(
            dims.hidden_size, {"x": inner, "z": inner}, bias=dims.use_bias,
            quant_method=ctx.linear_method(f"{prefix}.in_proj"), **common)
        self.conv1d = _Conv1dWeights(inner, dims.d_conv, dims.use_conv_bias, ctx.dtype,
                                     ctx.device, segments=channels)
        self.x_proj = RowParallelLinear(inner, dims.dt_rank + 2 * n, bias=False,
                                        quant_method=ctx.linear_method(f"{prefix}.x_proj"),
                                        **common)
        self.dt_proj = _DtProj(dims.dt_rank, channels, ctx.dtype, ctx.device)
        f32 = {"dtype": torch.float32, "device": ctx.device}
        self.A_log = sharded_parameter((n,), channels, **f32)
        self.D = sharded_parameter((), channels, **f32)
        self.out_proj = RowParallelLinear(inner, dims.hidden_size, bias=dims.use_bias,
                                          quant_method=ctx.linear_method(f"{prefix}.out_proj"),
                                          **common)
        if dims.bcdt_norm_eps is not None:
            norm = {"dtype": ctx.dtype, "device": ctx.device}
            self.dt_layernorm = RMSNorm(dims.dt_rank, dims.bcdt_norm_eps, **norm)
            self.b_layernorm = RMSNorm(n, dims.bcdt_norm_eps, **norm)
            self.c_layernorm = RMSNorm(n, dims.bcdt_norm_eps, **norm)

    def state_layer_spec(self) -> StateLayerSpec:
        return self.dims.state_layer_spec(self.dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        md = get_forward_context().state_metadata
        x, z = self.in_proj(hidden).chunk(2, dim=-1)
        y = by_parts(md, self.dims.intermediate_size, (x, z), self._scan)
        return self.out_proj(y.to(self.dtype))

    def _scan(self, x: torch.Tensor, z: torch.Tensor, md: StateMetadata) -> torch.Tensor:
        """Conv + SiLU, the selective projections, then the gated scan: ``[n, d_inner]``."""
        d = self.dims
        conv_state, ssm_state = get_forward_context().state_caches[self.state_index]
        weight = self.conv1d.weight.view(d.intermediate_size, d.d_conv)
        if md.is_decode:
            x = ssm.causal_conv1d_decode(x, weight, conv_state, md.state_indices,
                                         bias=self.conv1d.bias, activation="silu")
        else:
            x = ssm.causal_conv1d_prefill(x, weight, conv_state, md.query_start_loc,
                                          md.state_indices, md.has_initial_state,
                                          bias=self.conv1d.bias, activation="silu")
        time_step, b, c = self.x_proj(x).split([d.dt_rank, d.d_state, d.d_state], dim=-1)
        if d.bcdt_norm_eps is not None:
            time_step = self.dt_layernorm(time_step.contiguous())
            b, c = self.b_layernorm(b.contiguous()), self.c_layernorm(c.contiguous())
        dt = F.linear(time_step, self.dt_proj.weight)
        a = -torch.exp(self.A_log)
        common = {"D": self.D, "z": z, "dt_bias": self.dt_proj.bias, "dt_softplus": True}
        if md.is_decode:
            return ssm.selective_scan_decode(x, dt, a, b, c, ssm_state, md.state_indices,
                                             **common)
        return ssm.selective_scan_prefill(x, dt, a, b, c, ssm_state, md.query_start_loc,
                                          md.state_indices, md.has_initial_state, **common)
