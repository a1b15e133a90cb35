"""Mamba-2 decode step (and a recurrent varlen scan), Triton (the accelerator path).

Same semantics and layouts as :mod:`engine.kernels.ssm.mamba_ssd`. One program per
(request, head, block of head_dim) keeps its ``[block, d_state]`` state in registers and
walks the request's tokens in order, so the state is read once and written once per
request; decode is this kernel with one token per request. Prefill goes to the chunked
matmul form (:mod:`engine.kernels.ssm.triton_mamba_ssd_chunked`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.ssm.mamba_ssd import NO_LIMIT, DtLimit
from engine.kernels.ssm.triton_mamba_ssd_chunked import mamba2_ssd_prefill

__all__ = ["mamba2_ssd_decode", "mamba2_ssd_prefill", "mamba2_ssd_recurrent"]
from engine.kernels.ssm._varlen import initial_state_flags
from engine.kernels.triton_utils import check_device, interpreting, next_power_of_2

_INTERPRETED = interpreting()
_FLOAT_MAX = 3.0e38


@triton.jit
def _softplus_clamp(dt, SOFTPLUS: tl.constexpr, HAS_LIMIT: tl.constexpr, dt_min, dt_max):
    if SOFTPLUS:
        dt = tl.where(dt > 20.0, dt, tl.log(1.0 + tl.exp(dt)))
    if HAS_LIMIT:
        dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
    return dt


@triton.jit
def _ssd_scan_kernel(
    x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, dtb_ptr, state_ptr, out_ptr,
    qsl_ptr, sidx_ptr, init_ptr,
    head_dim, d_state, heads_per_group, dt_min, dt_max,
    s_xt, s_xh, s_dtt, s_bt, s_bg, s_ot, s_oh, s_ss, s_sh, s_sp, s_sn,
    HAS_D: tl.constexpr, D_PER_CHANNEL: tl.constexpr,
    SOFTPLUS: tl.constexpr, HAS_LIMIT: tl.constexpr,
    BLOCK_P: tl.constexpr, N_PAD: tl.constexpr,
):
    req = tl.program_id(0)
    h = tl.program_id(1)
    start = tl.load(qsl_ptr + req).to(tl.int64)
    end = tl.load(qsl_ptr + req + 1).to(tl.int64)
    slot = tl.load(sidx_ptr + req).to(tl.int64)
    has_init = tl.load(init_ptr + req)
    g = h // heads_per_group
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, N_PAD)
    pmask = p < head_dim
    nmask = n < d_state
    smask = pmask[:, None] & nmask[None, :]
    s_ptrs = state_ptr + slot * s_ss + h * s_sh + p[:, None] * s_sp + n[None, :] * s_sn
    # (a scalar condition in a mask is broadcast first: the interpreter rejects the mix)
    init_mask = (tl.zeros((BLOCK_P, N_PAD), dtype=tl.int32) + has_init) != 0
    state = tl.load(s_ptrs, mask=smask & init_mask, other=0.0).to(tl.float32)
    a = tl.load(a_ptr + h).to(tl.float32)
    bias = tl.load(dtb_ptr + h).to(tl.float32)  # the wrapper passes zeros when there is none
    skip = tl.zeros((BLOCK_P,), dtype=tl.float32)
    if HAS_D:
        if D_PER_CHANNEL:
            skip = tl.load(d_ptr + h * head_dim + p, mask=pmask, other=0.0).to(tl.float32)
        else:
            skip += tl.load(d_ptr + h).to(tl.float32)
    for t in range(start, end):
        x = tl.load(x_ptr + t * s_xt + h * s_xh + p, mask=pmask, other=0.0).to(tl.float32)
        dt = tl.load(dt_ptr + t * s_dtt + h).to(tl.float32) + bias
        dt = _softplus_clamp(dt, SOFTPLUS, HAS_LIMIT, dt_min, dt_max)
        bv = tl.load(b_ptr + t * s_bt + g * s_bg + n, mask=nmask, other=0.0).to(tl.float32)
        cv = tl.load(c_ptr + t * s_bt + g * s_bg + n, mask=nmask, other=0.0).to(tl.float32)
        state = state * tl.exp(dt * a) + (x * dt)[:, None] * bv[None, :]
        y = tl.sum(state * cv[None, :], axis=1) + skip * x
        tl.store(out_ptr + t * s_ot + h * s_oh + p, y.to(out_ptr.dtype.element_ty), mask=pmask)
    tl.store(s_ptrs, state.to(state_ptr.dtype.element_ty), mask=smask)


def mamba2_ssd_recurrent(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    ssm_state: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor | None = None,
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = True,
    dt_limit: DtLimit = NO_LIMIT,
    chunk_size: int = 256,
) -> torch.Tensor:
    """x ``[T, H, P]``, dt ``[T, H]``, A ``[H]``, B/C ``[T, G, N]`` -> y ``[T, H, P]``.

    Token by token (``chunk_size`` is accepted for API parity and ignored).
    """
    del chunk_size
    check_device(_INTERPRETED, x, dt, A, B, C, ssm_state, query_start_loc, state_indices)
    x, dt = x.contiguous(), dt.contiguous()
    B, C = B.contiguous(), C.contiguous()
    num_heads, head_dim = x.shape[1:]
    num_groups, d_state = B.shape[1:]
    num_reqs = query_start_loc.numel() - 1
    out = torch.empty_like(x)
    if num_reqs == 0:
        return out
    has_initial_state = initial_state_flags(has_initial_state, num_reqs, x.device)
    init = has_initial_state.to(torch.int32)
    has_limit = dt_limit is not None and (dt_limit[0] > 0.0 or dt_limit[1] != float("inf"))
    lo, hi = (dt_limit if has_limit else NO_LIMIT)
    Dc = D.contiguous() if D is not None else x
    dtb = dt_bias if dt_bias is not None else torch.zeros(num_heads, device=x.device)
    block_p = min(64, next_power_of_2(head_dim))
    grid = (num_reqs, num_heads, triton.cdiv(head_dim, block_p))
    _ssd_scan_kernel[grid](
        x, dt, A.contiguous(), B, C, Dc, dtb, ssm_state, out,
        query_start_loc, state_indices, init,
        head_dim, d_state, num_heads // num_groups, float(lo), float(min(hi, _FLOAT_MAX)),
        x.stride(0), x.stride(1), dt.stride(0), B.stride(0), B.stride(1),
        out.stride(0), out.stride(1),
        ssm_state.stride(0), ssm_state.stride(1), ssm_state.stride(2), ssm_state.stride(3),
        HAS_D=D is not None, D_PER_CHANNEL=D is not None and D.dim() == 2,
        SOFTPLUS=dt_softplus, HAS_LIMIT=has_limit,
        BLOCK_P=block_p, N_PAD=next_power_of_2(d_state),
    )
    return out


def mamba2_ssd_decode(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    ssm_state: torch.Tensor,
    state_indices: torch.Tensor,
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = True,
    dt_limit: DtLimit = NO_LIMIT,
) -> torch.Tensor:
    """One token per request: x ``[R, H, P]``, dt ``[R, H]``, B/C ``[R, G, N]``."""
    qsl = torch.arange(x.shape[0] + 1, dtype=torch.int32, device=x.device)
    return mamba2_ssd_recurrent(
        x, dt, A, B, C, ssm_state, qsl, state_indices, None, D, dt_bias, dt_softplus, dt_limit
    )
