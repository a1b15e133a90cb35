"""Mamba-2 SSD prefill in its chunked (matmul) form, Triton (the accelerator path).

Same semantics as :func:`engine.kernels.ssm.mamba_ssd.mamba2_ssd_prefill`. Each request is
cut into chunks of at most ``CHUNK`` tokens that never straddle requests; three launches:

1. per (chunk, head, head_dim block): the chunk's own end state ``sum_l exp(acum_end -
   acum_l) dt_l x_l B_l^T`` (one ``tl.dot``) and its total log decay;
2. per (request, head, head_dim block): the recurrence over the request's chunks (each
   chunk's start state; the final state into the slot);
3. per (chunk, head, head_dim block): outputs = the masked ``(C B^T) * decay`` block times
   ``dt x`` plus the start state read through ``C``, plus the D skip.

The results do not depend on the chunk size, so the kernel picks a tile-friendly one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.ssm._varlen import initial_state_flags
from engine.kernels.ssm.mamba_ssd import NO_LIMIT, DtLimit
from engine.kernels.triton_utils import check_device, interpreting, next_power_of_2

_INTERPRETED = interpreting()
_FLOAT_MAX = 3.0e38


@triton.jit
def _chunk_dt(dt_ptr, dtb_ptr, start, n, h, s_dtt, a, dt_min, dt_max,
              SOFTPLUS: tl.constexpr, HAS_LIMIT: tl.constexpr, CHUNK: tl.constexpr):
    """The chunk's processed dt (0 past its end) and in-chunk cumulative log decay."""
    pos = tl.arange(0, CHUNK)
    valid = pos < n
    dt = tl.load(dt_ptr + (start + pos) * s_dtt + h, mask=valid, other=0.0).to(tl.float32)
    dt = dt + tl.load(dtb_ptr + h).to(tl.float32)
    if SOFTPLUS:
        dt = tl.where(dt > 20.0, dt, tl.log(1.0 + tl.exp(dt)))
    if HAS_LIMIT:
        dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
    dt = tl.where(valid, dt, 0.0)
    return dt, tl.cumsum(dt * a, axis=0)


@triton.jit
def _chunk_state_kernel(
    x_ptr, dt_ptr, a_ptr, b_ptr, dtb_ptr, cstart_ptr, clen_ptr, states_ptr, decay_ptr,
    num_heads, head_dim, d_state, heads_per_group, dt_min, dt_max,
    s_xt, s_xh, s_dtt, s_bt, s_bg,
    SOFTPLUS: tl.constexpr, HAS_LIMIT: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK_P: tl.constexpr, N_PAD: tl.constexpr,
):
    c = tl.program_id(0)
    h = tl.program_id(1)
    start = tl.load(cstart_ptr + c).to(tl.int64)
    n = tl.load(clen_ptr + c)
    a = tl.load(a_ptr + h).to(tl.float32)
    dt, acum = _chunk_dt(dt_ptr, dtb_ptr, start, n, h, s_dtt, a, dt_min, dt_max,
                         SOFTPLUS, HAS_LIMIT, CHUNK)
    total = tl.sum(dt * a, axis=0)
    pos = tl.arange(0, CHUNK)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    ns = tl.arange(0, N_PAD)
    valid = pos < n
    g = h // heads_per_group
    x = tl.load(x_ptr + (start + pos)[:, None] * s_xt + h * s_xh + p[None, :],
                mask=valid[:, None] & (p < head_dim)[None, :], other=0.0).to(tl.float32)
    b = tl.load(b_ptr + (start + pos)[:, None] * s_bt + g * s_bg + ns[None, :],
                mask=valid[:, None] & (ns < d_state)[None, :], other=0.0).to(tl.float32)
    xw = x * (dt * tl.exp(total - acum))[:, None]  # [CHUNK, BLOCK_P]
    st = tl.dot(tl.trans(xw), b, input_precision="ieee")  # [BLOCK_P, N_PAD]
    base = (c * num_heads + h).to(tl.int64) * head_dim * d_state
    tl.store(states_ptr + base + p[:, None] * d_state + ns[None, :], st,
             mask=(p < head_dim)[:, None] & (ns < d_state)[None, :])
    if tl.program_id(2) == 0:
        tl.store(decay_ptr + c * num_heads + h, total)


@triton.jit
def _state_passing_kernel(
    states_ptr, decay_ptr, starts_ptr, ssm_ptr, first_ptr, nchunks_ptr, sidx_ptr, init_ptr,
    num_heads, head_dim, d_state, s_ss, s_sh, s_sp, s_sn,
    BLOCK_P: tl.constexpr, N_PAD: tl.constexpr,
):
    r = tl.program_id(0)
    h = tl.program_id(1)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    ns = tl.arange(0, N_PAD)
    mask = (p < head_dim)[:, None] & (ns < d_state)[None, :]
    slot = tl.load(sidx_ptr + r).to(tl.int64)
    has_init = tl.load(init_ptr + r)
    init_mask = (tl.zeros((BLOCK_P, N_PAD), dtype=tl.int32) + has_init) != 0
    s_ptrs = ssm_ptr + slot * s_ss + h * s_sh + p[:, None] * s_sp + ns[None, :] * s_sn
    cur = tl.load(s_ptrs, mask=mask & init_mask, other=0.0).to(tl.float32)
    first = tl.load(first_ptr + r).to(tl.int64)
    count = tl.load(nchunks_ptr + r).to(tl.int64)
    offs = p[:, None] * d_state + ns[None, :]
    for c in range(first, first + count):
        base = (c * num_heads + h) * head_dim * d_state
        tl.store(starts_ptr + base + offs, cur, mask=mask)
        own = tl.load(states_ptr + base + offs, mask=mask, other=0.0)
        cur = cur * tl.exp(tl.load(decay_ptr + c * num_heads + h)) + own
    tl.store(s_ptrs, cur.to(ssm_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _chunk_output_kernel(
    x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, dtb_ptr, cstart_ptr, clen_ptr, starts_ptr,
    out_ptr,
    num_heads, head_dim, d_state, heads_per_group, dt_min, dt_max,
    s_xt, s_xh, s_dtt, s_bt, s_bg, s_ot, s_oh,
    HAS_D: tl.constexpr, D_PER_CHANNEL: tl.constexpr,
    SOFTPLUS: tl.constexpr, HAS_LIMIT: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK_P: tl.constexpr, N_PAD: tl.constexpr,
):
    c = tl.program_id(0)
    h = tl.program_id(1)
    start = tl.load(cstart_ptr + c).to(tl.int64)
    n = tl.load(clen_ptr + c)
    a = tl.load(a_ptr + h).to(tl.float32)
    dt, acum = _chunk_dt(dt_ptr, dtb_ptr, start, n, h, s_dtt, a, dt_min, dt_max,
                         SOFTPLUS, HAS_LIMIT, CHUNK)
    pos = tl.arange(0, CHUNK)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    ns = tl.arange(0, N_PAD)
    valid = pos < n
    pmask = p < head_dim
    g = h // heads_per_group
    bc_mask = valid[:, None] & (ns < d_state)[None, :]
    bc_offs = (start + pos)[:, None] * s_bt + g * s_bg + ns[None, :]
    b = tl.load(b_ptr + bc_offs, mask=bc_mask, other=0.0).to(tl.float32)
    cm = tl.load(c_ptr + bc_offs, mask=bc_mask, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + (start + pos)[:, None] * s_xt + h * s_xh + p[None, :],
                mask=valid[:, None] & pmask[None, :], other=0.0).to(tl.float32)
    # diagonal block: y_l = sum_{s<=l} (C_l . B_s) exp(acum_l - acum_s) dt_s x_s
    causal = pos[:, None] >= pos[None, :]
    seg = tl.where(causal, acum[:, None] - acum[None, :], float("-inf"))
    scores = tl.dot(cm, tl.trans(b), input_precision="ieee") * tl.exp(seg) * dt[None, :]
    y = tl.dot(scores, x, input_precision="ieee")
    # off-diagonal: the chunk's start state read through C, decayed to position l
    base = (c * num_heads + h).to(tl.int64) * head_dim * d_state
    s0 = tl.load(starts_ptr + base + p[:, None] * d_state + ns[None, :],
                 mask=pmask[:, None] & (ns < d_state)[None, :], other=0.0)
    y += tl.dot(cm, tl.trans(s0), input_precision="ieee") * tl.exp(acum)[:, None]
    if HAS_D:
        if D_PER_CHANNEL:
            skip = tl.load(d_ptr + h * head_dim + p, mask=pmask, other=0.0).to(tl.float32)
            y += x * skip[None, :]
        else:
            y += x * tl.load(d_ptr + h).to(tl.float32)
    tl.store(out_ptr + (start + pos)[:, None] * s_ot + h * s_oh + p[None, :],
             y.to(out_ptr.dtype.element_ty), mask=valid[:, None] & pmask[None, :])


def _chunk_table(query_start_loc: torch.Tensor, chunk: int):
    """Chunks that never straddle requests: token start / length per chunk, and each
    request's first chunk and chunk count (one host sync for the grid size)."""
    qsl = query_start_loc.to(torch.int64)
    lens = qsl[1:] - qsl[:-1]
    n_chunks = (lens + chunk - 1) // chunk
    first = torch.cumsum(n_chunks, 0) - n_chunks
    total = int(n_chunks.sum().item())
    req = torch.repeat_interleave(torch.arange(lens.numel(), device=qsl.device), n_chunks,
                                  output_size=total)
    local = torch.arange(total, device=qsl.device) - first[req]
    cstart = qsl[:-1][req] + local * chunk
    clen = torch.minimum(qsl[1:][req] - cstart, torch.full_like(cstart, chunk))
    return total, cstart, clen.to(torch.int32), first, n_chunks


def mamba2_ssd_prefill(
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

    Tiles use ``min(chunk_size, 64)`` tokens (at least 16): the result is the same.
    """
    check_device(_INTERPRETED, x, dt, A, B, C, ssm_state, query_start_loc, state_indices)
    x, dt, B, C = x.contiguous(), dt.contiguous(), B.contiguous(), C.contiguous()
    num_heads, head_dim = x.shape[1:]
    num_groups, d_state = B.shape[1:]
    num_reqs = query_start_loc.numel() - 1
    out = torch.empty_like(x)
    if num_reqs == 0 or x.shape[0] == 0:
        return out
    has_initial_state = initial_state_flags(has_initial_state, num_reqs, x.device)
    chunk = max(16, min(64, next_power_of_2(chunk_size)))
    num_chunks, cstart, clen, first, n_chunks = _chunk_table(query_start_loc, chunk)
    has_limit = dt_limit is not None and (dt_limit[0] > 0.0 or dt_limit[1] != float("inf"))
    lo, hi = dt_limit if has_limit else NO_LIMIT
    lims = (float(lo), float(min(hi, _FLOAT_MAX)))
    dtb = dt_bias if dt_bias is not None else torch.zeros(num_heads, device=x.device)
    A = A.contiguous()
    block_p = max(16, min(64, next_power_of_2(head_dim)))
    n_pad = max(16, next_power_of_2(d_state))
    f32 = torch.float32
    states = torch.empty(num_chunks, num_heads, head_dim, d_state, dtype=f32, device=x.device)
    starts = torch.empty_like(states)
    decay = torch.empty(num_chunks, num_heads, dtype=f32, device=x.device)
    hpg = num_heads // num_groups
    p_blocks = triton.cdiv(head_dim, block_p)
    common = {"SOFTPLUS": dt_softplus, "HAS_LIMIT": has_limit, "CHUNK": chunk,
              "BLOCK_P": block_p, "N_PAD": n_pad}
    _chunk_state_kernel[(num_chunks, num_heads, p_blocks)](
        x, dt, A, B, dtb, cstart, clen, states, decay,
        num_heads, head_dim, d_state, hpg, *lims,
        x.stride(0), x.stride(1), dt.stride(0), B.stride(0), B.stride(1), **common,
    )
    _state_passing_kernel[(num_reqs, num_heads, p_blocks)](
        states, decay, starts, ssm_state, first, n_chunks, state_indices,
        has_initial_state.to(torch.int32), num_heads, head_dim, d_state,
        *ssm_state.stride(), BLOCK_P=block_p, N_PAD=n_pad,
    )
    _chunk_output_kernel[(num_chunks, num_heads, p_blocks)](
        x, dt, A, B, C, D.contiguous() if D is not None else x, dtb, cstart, clen, starts,
        out, num_heads, head_dim, d_state, hpg, *lims,
        x.stride(0), x.stride(1), dt.stride(0), B.stride(0), B.stride(1),
        out.stride(0), out.stride(1),
        HAS_D=D is not None, D_PER_CHANNEL=D is not None and D.dim() == 2, **common,
    )
    return out
