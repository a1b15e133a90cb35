"""Gated DeltaNet prefill in its chunked (WY / UT-transform) form, Triton.

Same semantics as :func:`engine.kernels.ssm.gated_delta.gated_delta_prefill`. Requests
are cut into chunks that never straddle requests; two launches:

1. per (chunk, value head): ``T = (I + strict_lower(beta K K^T * decay))^-1`` by forward
   substitution in registers, then ``u = T (beta V)`` and ``w = T (beta K exp(cum))``;
2. per (request, value head, v block): the recurrence over the request's chunks with the
   ``[k_dim, block]`` state in registers: ``v_new = u - w S``, the output
   ``(q exp(cum)) S + (q K^T * decay) v_new``, then ``S = exp(g_total) S + K_dec^T v_new``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.ssm._varlen import initial_state_flags
from engine.kernels.ssm.triton_mamba_ssd_chunked import _chunk_table
from engine.kernels.triton_utils import check_device, interpreting, next_power_of_2

_INTERPRETED = interpreting()


@triton.jit
def _load_qk(ptr, start, pos, valid, hk, s_t, s_h, k_dim, K_PAD: tl.constexpr,
             L2NORM: tl.constexpr):
    kk = tl.arange(0, K_PAD)
    t = tl.load(ptr + (start + pos)[:, None] * s_t + hk * s_h + kk[None, :],
                mask=valid[:, None] & (kk < k_dim)[None, :], other=0.0).to(tl.float32)
    if L2NORM:
        t = t / tl.sqrt(tl.sum(t * t, axis=1) + 1e-6)[:, None]
    return t


@triton.jit
def _wy_kernel(
    k_ptr, v_ptr, g_ptr, beta_ptr, cstart_ptr, clen_ptr, u_ptr, w_ptr,
    num_heads, k_dim, v_dim, heads_per_qk, s_kt, s_kh, s_vt, s_vh, s_gt,
    L2NORM: tl.constexpr, CHUNK: tl.constexpr, K_PAD: tl.constexpr, V_PAD: tl.constexpr,
):
    c = tl.program_id(0)
    h = tl.program_id(1)
    start = tl.load(cstart_ptr + c).to(tl.int64)
    n = tl.load(clen_ptr + c)
    pos = tl.arange(0, CHUNK)
    valid = pos < n
    kk = tl.arange(0, K_PAD)
    vv = tl.arange(0, V_PAD)
    k = _load_qk(k_ptr, start, pos, valid, h // heads_per_qk, s_kt, s_kh, k_dim, K_PAD, L2NORM)
    v = tl.load(v_ptr + (start + pos)[:, None] * s_vt + h * s_vh + vv[None, :],
                mask=valid[:, None] & (vv < v_dim)[None, :], other=0.0).to(tl.float32)
    g = tl.load(g_ptr + (start + pos) * s_gt + h, mask=valid, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + (start + pos) * s_gt + h, mask=valid, other=0.0).to(tl.float32)
    cum = tl.cumsum(g, axis=0)
    kb = k * beta[:, None]
    strict = pos[:, None] > pos[None, :]
    decay = tl.exp(tl.where(strict, cum[:, None] - cum[None, :], float("-inf")))
    a = tl.dot(kb, tl.trans(k), input_precision="ieee") * decay  # strictly lower
    rows = pos[:, None] + 0 * pos[None, :]
    inv = tl.where(rows == pos[None, :], 1.0, 0.0)
    for i in range(1, CHUNK):  # forward substitution: row i from the rows above it
        a_i = tl.sum(tl.where(rows == i, a, 0.0), axis=0)
        row = tl.where(pos == i, 1.0, 0.0) - tl.sum(a_i[:, None] * inv, axis=0)
        inv = tl.where(rows == i, row[None, :], inv)
    u = tl.dot(inv, v * beta[:, None], input_precision="ieee")
    w = tl.dot(inv, kb * tl.exp(cum)[:, None], input_precision="ieee")
    base = (c * num_heads + h).to(tl.int64) * CHUNK
    tl.store(u_ptr + (base + pos)[:, None] * V_PAD + vv[None, :], u)
    tl.store(w_ptr + (base + pos)[:, None] * K_PAD + kk[None, :], w)


@triton.jit
def _chunk_recurrence_kernel(
    q_ptr, k_ptr, g_ptr, u_ptr, w_ptr, state_ptr, out_ptr, cstart_ptr, clen_ptr,
    first_ptr, nchunks_ptr, sidx_ptr, init_ptr,
    num_heads, k_dim, v_dim, heads_per_qk, scale,
    s_kt, s_kh, s_gt, s_ot, s_oh, s_ss, s_sh, s_sk, s_sv,
    L2NORM: tl.constexpr, CHUNK: tl.constexpr, K_PAD: tl.constexpr, V_PAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    r = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // heads_per_qk
    kk = tl.arange(0, K_PAD)
    vv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    pos = tl.arange(0, CHUNK)
    smask = (kk < k_dim)[:, None] & (vv < v_dim)[None, :]
    slot = tl.load(sidx_ptr + r).to(tl.int64)
    has_init = tl.load(init_ptr + r)
    init_mask = (tl.zeros((K_PAD, BLOCK_V), dtype=tl.int32) + has_init) != 0
    s_ptrs = state_ptr + slot * s_ss + h * s_sh + kk[:, None] * s_sk + vv[None, :] * s_sv
    state = tl.load(s_ptrs, mask=smask & init_mask, other=0.0).to(tl.float32)
    causal = pos[:, None] >= pos[None, :]
    first = tl.load(first_ptr + r).to(tl.int64)
    count = tl.load(nchunks_ptr + r).to(tl.int64)
    for c in range(first, first + count):
        start = tl.load(cstart_ptr + c).to(tl.int64)
        n = tl.load(clen_ptr + c)
        valid = pos < n
        q = _load_qk(q_ptr, start, pos, valid, hk, s_kt, s_kh, k_dim, K_PAD, L2NORM) * scale
        k = _load_qk(k_ptr, start, pos, valid, hk, s_kt, s_kh, k_dim, K_PAD, L2NORM)
        g = tl.load(g_ptr + (start + pos) * s_gt + h, mask=valid, other=0.0).to(tl.float32)
        cum = tl.cumsum(g, axis=0)
        total = tl.sum(g, axis=0)
        base = (c * num_heads + h) * CHUNK
        u = tl.load(u_ptr + (base + pos)[:, None] * V_PAD + vv[None, :])
        w = tl.load(w_ptr + (base + pos)[:, None] * K_PAD + kk[None, :])
        v_new = u - tl.dot(w, state, input_precision="ieee")  # [CHUNK, BLOCK_V]
        decay = tl.exp(tl.where(causal, cum[:, None] - cum[None, :], float("-inf")))
        attn = tl.dot(q, tl.trans(k), input_precision="ieee") * decay
        o = tl.dot(q * tl.exp(cum)[:, None], state, input_precision="ieee")
        o += tl.dot(attn, v_new, input_precision="ieee")
        tl.store(out_ptr + (start + pos)[:, None] * s_ot + h * s_oh + vv[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=valid[:, None] & (vv < v_dim)[None, :])
        k_dec = k * tl.exp(total - cum)[:, None]
        state = state * tl.exp(total) + tl.dot(tl.trans(k_dec), v_new, input_precision="ieee")
    tl.store(s_ptrs, state.to(state_ptr.dtype.element_ty), mask=smask)


def gated_delta_prefill(
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

    Tiles use ``min(chunk_size, 64)`` tokens (at least 16): the result is the same.
    """
    check_device(_INTERPRETED, q, k, v, g, beta, ssm_state, query_start_loc, state_indices)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    g, beta = g.contiguous(), beta.contiguous()
    num_qk_heads, k_dim = q.shape[1:]
    num_heads, v_dim = v.shape[1:]
    num_reqs = query_start_loc.numel() - 1
    out = torch.empty_like(v)
    if num_reqs == 0 or v.shape[0] == 0:
        return out
    has_initial_state = initial_state_flags(has_initial_state, num_reqs, v.device)
    chunk = max(16, min(64, next_power_of_2(chunk_size)))
    num_chunks, cstart, clen, first, n_chunks = _chunk_table(query_start_loc, chunk)
    k_pad = max(16, next_power_of_2(k_dim))
    v_pad = max(16, next_power_of_2(v_dim))
    block_v = min(64, v_pad)
    f32 = torch.float32
    u = torch.empty(num_chunks, num_heads, chunk, v_pad, dtype=f32, device=v.device)
    w = torch.empty(num_chunks, num_heads, chunk, k_pad, dtype=f32, device=v.device)
    rep = num_heads // num_qk_heads
    _wy_kernel[(num_chunks, num_heads)](
        k, v, g, beta, cstart, clen, u, w, num_heads, k_dim, v_dim, rep,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0),
        L2NORM=use_qk_l2norm, CHUNK=chunk, K_PAD=k_pad, V_PAD=v_pad,
    )
    _chunk_recurrence_kernel[(num_reqs, num_heads, triton.cdiv(v_pad, block_v))](
        q, k, g, u, w, ssm_state, out, cstart, clen, first, n_chunks, state_indices,
        has_initial_state.to(torch.int32), num_heads, k_dim, v_dim, rep,
        float(scale if scale is not None else k_dim**-0.5),
        k.stride(0), k.stride(1), g.stride(0), out.stride(0), out.stride(1),
        *ssm_state.stride(),
        L2NORM=use_qk_l2norm, CHUNK=chunk, K_PAD=k_pad, V_PAD=v_pad, BLOCK_V=block_v,
    )
    return out
