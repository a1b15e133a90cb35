"""Mamba-1 selective scan and decode step, Triton (the accelerator path).

Same semantics and layouts as :mod:`engine.kernels.ssm.selective_scan`. One program per
(request, block of channels) keeps its ``[block, d_state]`` state in registers and walks
the request's tokens in order (as mamba_ssm's selective-scan kernel does per channel);
decode is the same kernel with one token per request.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.ssm._varlen import initial_state_flags
from engine.kernels.triton_utils import check_device, interpreting, next_power_of_2

_INTERPRETED = interpreting()


@triton.jit
def _selective_scan_kernel(
    x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, z_ptr, dtb_ptr, state_ptr, out_ptr,
    qsl_ptr, sidx_ptr, init_ptr,
    dim, d_state, s_xt, s_bt, s_ss, s_sd, s_sn,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    BLOCK_D: tl.constexpr, N_PAD: tl.constexpr,
):
    req = tl.program_id(0)
    start = tl.load(qsl_ptr + req).to(tl.int64)
    end = tl.load(qsl_ptr + req + 1).to(tl.int64)
    slot = tl.load(sidx_ptr + req).to(tl.int64)
    has_init = tl.load(init_ptr + req)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    n = tl.arange(0, N_PAD)
    dmask = d < dim
    nmask = n < d_state
    smask = dmask[:, None] & nmask[None, :]
    s_ptrs = state_ptr + slot * s_ss + d[:, None] * s_sd + n[None, :] * s_sn
    init_mask = (tl.zeros((BLOCK_D, N_PAD), dtype=tl.int32) + has_init) != 0
    state = tl.load(s_ptrs, mask=smask & init_mask, other=0.0).to(tl.float32)
    a = tl.load(a_ptr + d[:, None] * d_state + n[None, :], mask=smask, other=0.0).to(tl.float32)
    bias = tl.zeros((BLOCK_D,), dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(dtb_ptr + d, mask=dmask, other=0.0).to(tl.float32)
    skip = tl.zeros((BLOCK_D,), dtype=tl.float32)
    if HAS_D:
        skip = tl.load(d_ptr + d, mask=dmask, other=0.0).to(tl.float32)
    for t in range(start, end):
        x = tl.load(x_ptr + t * s_xt + d, mask=dmask, other=0.0).to(tl.float32)
        dt = tl.load(dt_ptr + t * s_xt + d, mask=dmask, other=0.0).to(tl.float32) + bias
        if SOFTPLUS:
            dt = tl.where(dt > 20.0, dt, tl.log(1.0 + tl.exp(dt)))
        bv = tl.load(b_ptr + t * s_bt + n, mask=nmask, other=0.0).to(tl.float32)
        cv = tl.load(c_ptr + t * s_bt + n, mask=nmask, other=0.0).to(tl.float32)
        state = state * tl.exp(dt[:, None] * a) + (dt * x)[:, None] * bv[None, :]
        y = tl.sum(state * cv[None, :], axis=1) + skip * x
        if HAS_Z:
            zv = tl.load(z_ptr + t * s_xt + d, mask=dmask, other=0.0).to(tl.float32)
            y = y * zv * tl.sigmoid(zv)
        tl.store(out_ptr + t * s_xt + d, y.to(out_ptr.dtype.element_ty), mask=dmask)
    tl.store(s_ptrs, state.to(state_ptr.dtype.element_ty), mask=smask)


def selective_scan_prefill(
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
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = True,
) -> torch.Tensor:
    """x/dt/z ``[T, dim]``, A ``[dim, N]``, B/C ``[T, N]`` -> y ``[T, dim]``."""
    check_device(_INTERPRETED, x, dt, A, B, C, ssm_state, query_start_loc, state_indices)
    # x, dt, z and out share one row stride: all contiguous [T, dim]
    x, dt = x.contiguous(), dt.contiguous()
    z = z.contiguous() if z is not None else None
    B, C = B.contiguous(), C.contiguous()
    dim = x.shape[1]
    d_state = A.shape[1]
    num_reqs = query_start_loc.numel() - 1
    out = torch.empty_like(x)
    if num_reqs == 0:
        return out
    has_initial_state = initial_state_flags(has_initial_state, num_reqs, x.device)
    block_d = min(64, next_power_of_2(dim))
    grid = (num_reqs, triton.cdiv(dim, block_d))
    _selective_scan_kernel[grid](
        x, dt, A.contiguous(), B, C, D if D is not None else x, z if z is not None else x,
        dt_bias if dt_bias is not None else x, ssm_state, out,
        query_start_loc, state_indices, has_initial_state.to(torch.int32),
        dim, d_state, x.stride(0), B.stride(0),
        ssm_state.stride(0), ssm_state.stride(1), ssm_state.stride(2),
        HAS_D=D is not None, HAS_Z=z is not None, HAS_BIAS=dt_bias is not None,
        SOFTPLUS=dt_softplus, BLOCK_D=block_d, N_PAD=next_power_of_2(d_state),
    )
    return out


def selective_scan_decode(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    ssm_state: torch.Tensor,
    state_indices: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = True,
) -> torch.Tensor:
    """One token per request: x/dt/z ``[R, dim]``, B/C ``[R, N]`` -> ``[R, dim]``."""
    qsl = torch.arange(x.shape[0] + 1, dtype=torch.int32, device=x.device)
    return selective_scan_prefill(
        x, dt, A, B, C, ssm_state, qsl, state_indices, None, D, z, dt_bias, dt_softplus
    )
