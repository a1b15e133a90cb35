"""The gated DeltaNet mixer (Qwen3-Next's "linear_attention" layers).

Per token (transformers' ``Qwen3NextGatedDeltaNet`` torch path): ``in_proj_qkvz`` and
``in_proj_ba`` project the hidden state; their outputs are laid out per key head
(``[q | k | v-group | z-group]`` and ``[b-group | a-group]``, a group being the
``Hv / Hk`` value heads that share the key head), so they are regrouped into q, k, v, z,
b, a; a causal depthwise conv + SiLU runs over the concatenated ``[q | k | v]`` (its last
``kernel - 1`` inputs kept per request in the conv state ``[conv_dim, kernel - 1]``); the
gated delta rule with ``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta = sigmoid(b)``
and L2-normalized q/k (q/k heads shared by their value-head group; the recurrent state
``[Hv, head_k_dim, head_v_dim]`` kept per request, in float32 as transformers keeps it);
a gated RMSNorm per value head with ``z``; then ``out_proj``.

States and step metadata come from the forward context as for the Mamba mixers; a step
mixing decodes and prefills runs each part on its own kernels (the Mamba-1 mixer's
:func:`~engine.model_executor.layers.mamba1.by_parts`).

Tensor parallelism (vLLM's split): the key heads are cut over the ranks, each with its
value-head group. ``in_proj_qkvz`` / ``in_proj_ba`` are laid out per key head, so a
plain column-parallel cut gives each rank its key heads' q, k, v, z, b and a; the conv's
q, k and v channels, ``A_log`` and ``dt_bias`` are cut to match, the per-head norm is
replicated, ``out_proj`` is row parallel.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import ssm
from engine.model_executor.forward_context import get_forward_context
from engine.model_executor.layers import mamba1
from engine.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
from engine.model_executor.layers.mamba2 import (
    _Conv1dWeights,
    check_heads,
    rank_part,
    sharded_parameter,
)
from engine.model_executor.models.interface import ModelInitContext
from engine.model_executor.state_cache import StateLayerSpec, StateMetadata


@dataclass(frozen=True)
class GatedDeltaNetDims:
    """A gated DeltaNet mixer's sizes, whatever the config family calls them."""

    hidden_size: int
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    norm_eps: float
    activation: str = "silu"

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def group(self) -> int:
        """Value heads per key head."""
        return self.num_v_heads // self.num_k_heads

    def state_layer_spec(self, dtype: torch.dtype) -> StateLayerSpec:
        """Conv window ``[conv_dim, kernel - 1]`` (model dtype) and recurrent state
        ``[Hv, head_k_dim, head_v_dim]`` (float32, as transformers keeps it)."""
        return StateLayerSpec(
            shapes=((self.conv_dim, self.conv_kernel - 1),
                    (self.num_v_heads, self.head_k_dim, self.head_v_dim)),
            dtypes=(dtype, torch.float32),
        )


class GatedRMSNorm(nn.Module):
    """Qwen3-Next's ``RMSNormGated``: normalize in float32, cast back, scale by the
    (not zero-centred) weight, then multiply by ``silu(gate)`` in float32."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device),
                                   requires_grad=False)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype)
        return (self.weight * normed * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNetMixer(nn.Module):
    """One gated DeltaNet mixer; ``state_index``: its place among the state layers."""

    def __init__(self, dims: GatedDeltaNetDims, ctx: ModelInitContext, prefix: str,
                 state_index: int) -> None:
        super().__init__()
        if dims.activation not in ("silu", "swish"):
            raise ValueError(f"gated DeltaNet: activation {dims.activation!r} is not supported")
        if dims.num_v_heads % dims.num_k_heads:
            raise ValueError("gated DeltaNet: value heads must be a multiple of key heads")
        local_k = check_heads(dims.num_k_heads, ctx.tp, "gated DeltaNet: num_k_heads")
        part = rank_part(ctx.tp)
        self.full_dims = dims
        # This rank's key heads and their value-head groups.
        self.dims = dataclasses.replace(dims, num_k_heads=local_k,
                                        num_v_heads=local_k * dims.group)
        self.state_index = state_index
        self.dtype = ctx.dtype
        common = {**ctx.matrix_dtypes, "device": ctx.device, "tp": ctx.tp}
        self.in_proj_qkvz = ColumnParallelLinear(
            dims.hidden_size, 2 * dims.key_dim + 2 * dims.value_dim, bias=False,
            quant_method=ctx.linear_method(f"{prefix}.in_proj_qkvz"), **common)
        self.in_proj_ba = ColumnParallelLinear(
            dims.hidden_size, 2 * dims.num_v_heads, bias=False,
            quant_method=ctx.linear_method(f"{prefix}.in_proj_ba"), **common)
        self.conv1d = _Conv1dWeights(
            dims.conv_dim, dims.conv_kernel, False, ctx.dtype, ctx.device,
            segments=[(dims.key_dim, part), (dims.key_dim, part), (dims.value_dim, part)])
        f32 = {"dtype": torch.float32, "device": ctx.device}
        self.dt_bias = sharded_parameter((), [(dims.num_v_heads, part)], fill=1.0, **f32)
        self.A_log = sharded_parameter((), [(dims.num_v_heads, part)], fill=0.0, **f32)
        self.norm = GatedRMSNorm(dims.head_v_dim, dims.norm_eps, ctx.dtype, ctx.device)
        self.out_proj = RowParallelLinear(
            dims.value_dim, dims.hidden_size, bias=False,
            quant_method=ctx.linear_method(f"{prefix}.out_proj"), **common)

    def state_layer_spec(self) -> StateLayerSpec:
        return self.dims.state_layer_spec(self.dtype)

    def _regroup(self, qkvz: torch.Tensor, ba: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-key-head layouts -> ``[q | k | v]`` (conv input), z ``[T, Hv, V]``,
        b and a ``[T, Hv]``."""
        d, n = self.dims, qkvz.shape[0]
        gv = d.group * d.head_v_dim
        q, k, v, z = qkvz.view(n, d.num_k_heads, -1).split(
            [d.head_k_dim, d.head_k_dim, gv, gv], dim=-1)
        b, a = ba.view(n, d.num_k_heads, -1).split([d.group, d.group], dim=-1)
        mixed = torch.cat([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], dim=-1)
        return (mixed, z.reshape(n, d.num_v_heads, d.head_v_dim),
                b.reshape(n, d.num_v_heads), a.reshape(n, d.num_v_heads))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        md = get_forward_context().state_metadata
        d = self.dims
        mixed, z, b, a = self._regroup(self.in_proj_qkvz(hidden), self.in_proj_ba(hidden))
        core = mamba1.by_parts(md, d.value_dim, (mixed, b, a), self._mix)
        out = self.norm(core.view(-1, d.head_v_dim), z.reshape(-1, d.head_v_dim))
        return self.out_proj(out.view(hidden.shape[0], d.value_dim))

    def _mix(self, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
             md: StateMetadata) -> torch.Tensor:
        """Conv + SiLU over ``[q | k | v]``, then the gated delta rule: ``[n, value_dim]``."""
        d, n = self.dims, mixed.shape[0]
        conv_state, rec_state = get_forward_context().state_caches[self.state_index]
        weight = self.conv1d.weight.view(d.conv_dim, d.conv_kernel)
        if md.is_decode:
            mixed = ssm.causal_conv1d_decode(mixed, weight, conv_state, md.state_indices,
                                             activation="silu")
        else:
            mixed = ssm.causal_conv1d_prefill(mixed, weight, conv_state, md.query_start_loc,
                                              md.state_indices, md.has_initial_state,
                                              activation="silu")
        q, k, v = mixed.split([d.key_dim, d.key_dim, d.value_dim], dim=-1)
        q = q.reshape(n, d.num_k_heads, d.head_k_dim)
        k = k.reshape(n, d.num_k_heads, d.head_k_dim)
        v = v.reshape(n, d.num_v_heads, d.head_v_dim)
        g = -torch.exp(self.A_log) * F.softplus(a.float() + self.dt_bias)
        beta = torch.sigmoid(b)
        if md.is_decode:
            out = ssm.gated_delta_decode(q, k, v, g, beta, rec_state, md.state_indices,
                                         use_qk_l2norm=True)
        else:
            out = ssm.gated_delta_prefill(q, k, v, g, beta, rec_state, md.query_start_loc,
                                          md.state_indices, md.has_initial_state,
                                          use_qk_l2norm=True)
        return out.reshape(n, d.value_dim)
