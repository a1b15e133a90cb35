"""Gated DeltaNet decode step (and a recurrent varlen form), Triton (the accelerator path).

Same semantics and layouts as :mod:`engine.kernels.ssm.gated_delta`. One program per
(request, value head, block of v_dim) keeps its ``[k_dim, block]`` state in registers
and applies the delta rule token by token (the recurrent form); decode is this kernel
with one token per request. Prefill goes to the chunked WY form
(:mod:`engine.kernels.ssm.triton_gated_delta_chunked`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.ssm._varlen import initial_state_flags
from engine.kernels.ssm.triton_gated_delta_chunked import gated_delta_prefill
from engine.kernels.triton_utils import check_device, interpreting, next_power_of_2

__all__ = ["gated_delta_decode", "gated_delta_prefill", "gated_delta_recurrent"]

_INTERPRETED = interpreting()


@triton.jit
def _gated_delta_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, out_ptr, qsl_ptr, sidx_ptr, init_ptr,
    k_dim, v_dim, heads_per_qk, scale,
    s_qt, s_qh, s_vt, s_vh, s_gt, s_ot, s_oh, s_ss, s_sh, s_sk, s_sv,
    L2NORM: tl.constexpr, K_PAD: tl.constexpr, BLOCK_V: tl.constexpr,
):
    req = tl.program_id(0)
    h = tl.program_id(1)
    start = tl.load(qsl_ptr + req).to(tl.int64)
    end = tl.load(qsl_ptr + req + 1).to(tl.int64)
    slot = tl.load(sidx_ptr + req).to(tl.int64)
    has_init = tl.load(init_ptr + req)
    hk = h // heads_per_qk
    kk = tl.arange(0, K_PAD)
    vv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    kmask = kk < k_dim
    vmask = vv < v_dim
    smask = kmask[:, None] & vmask[None, :]
    s_ptrs = state_ptr + slot * s_ss + h * s_sh + kk[:, None] * s_sk + vv[None, :] * s_sv
    init_mask = (tl.zeros((K_PAD, BLOCK_V), dtype=tl.int32) + has_init) != 0
    state = tl.load(s_ptrs, mask=smask & init_mask, other=0.0).to(tl.float32)
    for t in range(start, end):
        q = tl.load(q_ptr + t * s_qt + hk * s_qh + kk, mask=kmask, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + t * s_qt + hk * s_qh + kk, mask=kmask, other=0.0).to(tl.float32)
        if L2NORM:
            q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6)
            k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
        v = tl.load(v_ptr + t * s_vt + h * s_vh + vv, mask=vmask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + t * s_gt + h).to(tl.float32)
        beta = tl.load(beta_ptr + t * s_gt + h).to(tl.float32)
        state = state * tl.exp(g)
        delta = (v - tl.sum(state * k[:, None], axis=0)) * beta
        state = state + k[:, None] * delta[None, :]
        o = tl.sum(state * (q * scale)[:, None], axis=0)
        tl.store(out_ptr + t * s_ot + h * s_oh + vv, o.to(out_ptr.dtype.element_ty), mask=vmask)
    tl.store(s_ptrs, state.to(state_ptr.dtype.element_ty), mask=smask)


def gated_delta_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_state: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
    scale: float | None = None,
    chunk_size: int = 64,
) -> torch.Tensor:
    """q/k ``[T, Hk, K]``, v ``[T, Hv, V]``, g/beta ``[T, Hv]`` -> o ``[T, Hv, V]``.

    Token by token (``chunk_size`` is accepted for API parity and ignored).
    """
    del chunk_size
    check_device(_INTERPRETED, q, k, v, g, beta, ssm_state, query_start_loc, state_indices)
    # q and k share strides; g and beta share strides: all made contiguous
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    g, beta = g.contiguous(), beta.contiguous()
    num_qk_heads, k_dim = q.shape[1:]
    num_v_heads, v_dim = v.shape[1:]
    num_reqs = query_start_loc.numel() - 1
    out = torch.empty_like(v)
    if num_reqs == 0:
        return out
    has_initial_state = initial_state_flags(has_initial_state, num_reqs, v.device)
    block_v = min(32, next_power_of_2(v_dim))
    grid = (num_reqs, num_v_heads, triton.cdiv(v_dim, block_v))
    _gated_delta_kernel[grid](
        q, k, v, g, beta, ssm_state, out, query_start_loc, state_indices,
        has_initial_state.to(torch.int32),
        k_dim, v_dim, num_v_heads // num_qk_heads,
        float(scale if scale is not None else k_dim**-0.5),
        q.stride(0), q.stride(1), v.stride(0), v.stride(1), g.stride(0),
        out.stride(0), out.stride(1),
        ssm_state.stride(0), ssm_state.stride(1), ssm_state.stride(2), ssm_state.stride(3),
        L2NORM=use_qk_l2norm, K_PAD=next_power_of_2(k_dim), BLOCK_V=block_v,
    )
    return out


def gated_delta_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_state: torch.Tensor,
    state_indices: torch.Tensor,
    use_qk_l2norm: bool = True,
    scale: float | None = None,
) -> torch.Tensor:
    """One token per request: q/k ``[R, Hk, K]``, v ``[R, Hv, V]``, g/beta ``[R, Hv]``."""
    qsl = torch.arange(v.shape[0] + 1, dtype=torch.int32, device=v.device)
    return gated_delta_recurrent(
        q, k, v, g, beta, ssm_state, qsl, state_indices, None, use_qk_l2norm, scale
    )
