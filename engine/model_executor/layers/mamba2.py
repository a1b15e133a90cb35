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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import ssm
from engine.model_executor.forward_context import get_forward_context
from engine.model_executor.layers.linear import ReplicatedLinear
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


class GatedRMSNorm(nn.Module):
    """``weight * rmsnorm_per_group(x * silu(z))`` in float32 (transformers'
    ``MambaRMSNormGated`` with ``norm_before_gate=False``)."""

    def __init__(self, size: int, group_size: int, eps: float, *, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.group_size = group_size
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device),
                                   requires_grad=False)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float() * F.silu(z.float())
        groups = h.view(*h.shape[:-1], -1, self.group_size)
        groups = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * groups.view(h.shape).to(dtype)


class _Conv1dWeights(nn.Module):
    """Holds the checkpoint's ``conv1d.weight [conv_dim, 1, d_conv]`` and ``conv1d.bias``."""

    def __init__(self, dim: int, width: int, bias: bool, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, 1, width, dtype=dtype, device=device),
                                   requires_grad=False)
        if bias:
            self.bias = nn.Parameter(torch.empty(dim, dtype=dtype, device=device),
                                     requires_grad=False)
        else:
            self.register_parameter("bias", None)


class Mamba2Mixer(nn.Module):
    """One Mamba-2 mixer; ``state_index``: its place among the model's state layers."""

    def __init__(self, dims: Mamba2Dims, ctx: ModelInitContext, prefix: str,
                 state_index: int) -> None:
        super().__init__()
        if ctx.tp is not None:
            raise ValueError("Mamba-2 layers do not support tensor parallelism yet "
                             "(tensor_parallel_size must be 1)")
        if dims.num_heads * dims.head_dim != dims.intermediate_size:
            raise ValueError(f"Mamba-2: num_heads x head_dim = {dims.num_heads * dims.head_dim}"
                             f" != intermediate size {dims.intermediate_size}")
        if dims.activation not in ("silu", "swish"):
            raise ValueError(f"Mamba-2: activation {dims.activation!r} is not supported")
        self.dims = dims
        self.state_index = state_index
        self.dtype = ctx.dtype
        common = {**ctx.matrix_dtypes, "device": ctx.device}
        projection = dims.intermediate_size + dims.conv_dim + dims.num_heads
        self.in_proj = ReplicatedLinear(dims.hidden_size, projection, bias=dims.use_bias,
                                        quant_method=ctx.linear_method(f"{prefix}.in_proj"),
                                        **common)
        self.conv1d = _Conv1dWeights(dims.conv_dim, dims.d_conv, dims.use_conv_bias,
                                     ctx.dtype, ctx.device)
        f32 = {"dtype": torch.float32, "device": ctx.device}
        self.dt_bias = nn.Parameter(torch.empty(dims.num_heads, **f32), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(dims.num_heads, **f32), requires_grad=False)
        self.D = nn.Parameter(torch.empty(dims.num_heads, **f32), requires_grad=False)
        self.norm = GatedRMSNorm(dims.intermediate_size,
                                 dims.intermediate_size // dims.n_groups, dims.norm_eps,
                                 dtype=ctx.dtype, device=ctx.device)
        self.out_proj = ReplicatedLinear(dims.intermediate_size, dims.hidden_size,
                                         bias=dims.use_bias,
                                         quant_method=ctx.linear_method(f"{prefix}.out_proj"),
                                         **common)

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
