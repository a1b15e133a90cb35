"""Causal depthwise conv1d with per-slot conv state, Triton (the accelerator path).

Same semantics and layouts as :mod:`engine.kernels.ssm.conv1d`. Two launches: the outputs
(one program per request x token block x channel block, reading the old state for the
first W-1 positions), then the state update (one program per request x channel block),
so no program overwrites a state another one still reads. Decode is the same kernels
with one token per request.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.ssm._varlen import initial_state_flags
from engine.kernels.triton_utils import check_device, interpreting, next_power_of_2

_INTERPRETED = interpreting()


@triton.jit
def _conv_out_kernel(
    x_ptr, w_ptr, bias_ptr, state_ptr, out_ptr, qsl_ptr, sidx_ptr, init_ptr,
    dim, stride_xt, stride_ot, stride_wd, stride_wk, stride_ss, stride_sd, stride_sk,
    WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    req = tl.program_id(0)
    start = tl.load(qsl_ptr + req).to(tl.int64)
    n = tl.load(qsl_ptr + req + 1).to(tl.int64) - start
    slot = tl.load(sidx_ptr + req).to(tl.int64)
    has_init = tl.load(init_ptr + req)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    tmask = t < n
    dmask = d < dim
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for k in tl.static_range(WIDTH):
        p = t - (WIDTH - 1) + k  # the input position this tap reads (< 0: the old state)
        m_x = (tmask & (p >= 0))[:, None] & dmask[None, :]
        xv = tl.load(x_ptr + (start + p)[:, None] * stride_xt + d[None, :], mask=m_x, other=0.0)
        m_s = (tmask & (p < 0) & ((p * 0 + has_init) != 0))[:, None] & dmask[None, :]
        sp = (WIDTH - 1) + p
        sv = tl.load(
            state_ptr + slot * stride_ss + d[None, :] * stride_sd + sp[:, None] * stride_sk,
            mask=m_s, other=0.0,
        )
        wv = tl.load(w_ptr + d * stride_wd + k * stride_wk, mask=dmask, other=0.0)
        acc += (xv.to(tl.float32) + sv.to(tl.float32)) * wv.to(tl.float32)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    out = out_ptr + (start + t)[:, None] * stride_ot + d[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=tmask[:, None] & dmask[None, :])


@triton.jit
def _conv_state_kernel(
    x_ptr, state_ptr, qsl_ptr, sidx_ptr, init_ptr,
    dim, stride_xt, stride_ss, stride_sd, stride_sk,
    WIDTH: tl.constexpr, HIST_PAD: tl.constexpr, BLOCK_D: tl.constexpr,
):
    req = tl.program_id(0)
    start = tl.load(qsl_ptr + req).to(tl.int64)
    n = tl.load(qsl_ptr + req + 1).to(tl.int64) - start
    slot = tl.load(sidx_ptr + req).to(tl.int64)
    has_init = tl.load(init_ptr + req)
    j = tl.arange(0, HIST_PAD)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    jmask = j < WIDTH - 1
    dmask = d < dim
    p = n - (WIDTH - 1) + j  # new state entry j = input position p (< 0: old state)
    m_x = (jmask & (p >= 0))[:, None] & dmask[None, :]
    xv = tl.load(x_ptr + (start + p)[:, None] * stride_xt + d[None, :], mask=m_x, other=0.0)
    m_s = (jmask & (p < 0) & ((p * 0 + has_init) != 0))[:, None] & dmask[None, :]
    base = state_ptr + slot * stride_ss + d[None, :] * stride_sd
    sv = tl.load(base + ((WIDTH - 1) + p)[:, None] * stride_sk, mask=m_s, other=0.0)
    new = xv.to(tl.float32) + sv.to(tl.float32)
    tl.store(base + j[:, None] * stride_sk, new.to(state_ptr.dtype.element_ty),
             mask=jmask[:, None] & dmask[None, :])


def _silu(activation: str | None) -> bool:
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"unsupported conv1d activation {activation!r}; use None or 'silu'")
    return activation is not None


def causal_conv1d_prefill(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
    max_query_len: int | None = None,
) -> torch.Tensor:
    """x ``[T, dim]``, weight ``[dim, W]`` -> ``[T, dim]``; updates ``conv_state`` slots.

    ``max_query_len`` sizes the grid; pass it to avoid a device-to-host sync.
    """
    check_device(_INTERPRETED, x, weight, conv_state, query_start_loc, state_indices)
    x = x.contiguous()
    num_tokens, dim = x.shape
    width = weight.shape[1]
    num_reqs = query_start_loc.numel() - 1
    out = torch.empty_like(x)
    if num_reqs == 0 or num_tokens == 0:
        return out
    has_initial_state = initial_state_flags(has_initial_state, num_reqs, x.device)
    init = has_initial_state.to(torch.int32)
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max().item())
    block_t = min(64, next_power_of_2(max_query_len))
    block_d = min(128, next_power_of_2(dim))
    bias_arg = bias if bias is not None else x
    grid = (num_reqs, triton.cdiv(max_query_len, block_t), triton.cdiv(dim, block_d))
    _conv_out_kernel[grid](
        x, weight, bias_arg, conv_state, out, query_start_loc, state_indices, init,
        dim, x.stride(0), out.stride(0), weight.stride(0), weight.stride(1),
        conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
        WIDTH=width, HAS_BIAS=bias is not None, SILU=_silu(activation),
        BLOCK_T=block_t, BLOCK_D=block_d,
    )
    if width > 1:
        _conv_state_kernel[(num_reqs, triton.cdiv(dim, block_d))](
            x, conv_state, query_start_loc, state_indices, init,
            dim, x.stride(0), conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
            WIDTH=width, HIST_PAD=next_power_of_2(width - 1), BLOCK_D=block_d,
        )
    return out


def causal_conv1d_decode(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    state_indices: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> torch.Tensor:
    """One new token per request: x ``[R, dim]`` -> ``[R, dim]``; shifts the slots."""
    num_reqs = x.shape[0]
    qsl = torch.arange(num_reqs + 1, dtype=torch.int32, device=x.device)
    return causal_conv1d_prefill(
        x, weight, conv_state, qsl, state_indices, None, bias, activation, max_query_len=1
    )
