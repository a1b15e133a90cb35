"""Mamba-2 SSD (state space duality) scan and its decode step, bulk torch (the CPU path).

Per head ``h`` (group ``g = h // (H / G)``) and token ``t``, as transformers' Mamba2:
``dt = clamp(softplus(dt + dt_bias))``, ``state = exp(dt * A[h]) * state + dt * x[t] B[t]^T``
(state ``[head_dim, d_state]``), ``y[t] = state C[t] + D[h] x[t]``. Gating by ``z`` is
left to the model's gated RMSNorm. The state cache is ``[num_slots, H, head_dim, d_state]``.

Prefill uses the chunked SSD form: within a chunk the scan is a masked attention-like
matmul; only the chunk-boundary states recur, once per chunk index for the whole batch.
"""

from __future__ import annotations

import torch

from engine.kernels.ssm import _varlen

DtLimit = tuple[float, float]
NO_LIMIT: DtLimit = (0.0, float("inf"))
_TEMP_ELEMENTS = 1 << 22  # bound on the intra-chunk [chunks, H, L, L] temporaries


def _skip(y: torch.Tensor, x: torch.Tensor, D: torch.Tensor | None) -> torch.Tensor:
    """D skip connection; D is per head ``[H]`` or per channel ``[H, head_dim]``."""
    if D is None:
        return y
    d = D.to(y.dtype)
    return y + x * (d[:, None] if d.dim() == 1 else d)


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

    Reads/writes ``ssm_state[state_indices]`` (``[slots, H, P, N]``).
    """
    num_heads, head_dim = x.shape[1:]
    num_groups, d_state = B.shape[1:]
    hg = num_heads // num_groups  # heads of a group share B and C: never expanded
    cd = _varlen.compute_dtype(x)
    lay = _varlen.chunk_layout(query_start_loc, chunk_size)
    nc, L = lay.num_chunks, chunk_size
    dt = _varlen.softplus_dt(dt, dt_bias, dt_softplus, dt_limit, cd)
    dtc = _varlen.to_chunks(dt, lay)  # [NC, L, H]; 0 in the padding: no decay, no input
    Bc = _varlen.to_chunks(B.to(cd), lay)  # [NC, L, G, N]
    Cc = _varlen.to_chunks(C.to(cd), lay)
    xdt = _varlen.to_chunks(x.to(cd), lay) * dtc[..., None]  # [NC, L, H, P]
    xdt = xdt.view(nc, L, num_groups, hg, head_dim)
    acum = torch.cumsum(dtc * A.to(cd), dim=1)  # [NC, L, H]

    # Intra-chunk (diagonal blocks): y_l = sum_{s<=l} (C_l.B_s) exp(acum_l - acum_s) xdt_s,
    # a few chunks at a time so the [chunks, H, L, L] temporaries stay bounded.
    causal = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()
    acum_h = acum.view(nc, L, num_groups, hg).permute(0, 2, 3, 1)  # [NC, G, hg, L]
    y = torch.empty_like(xdt)
    step = max(1, _TEMP_ELEMENTS // (num_heads * L * L))
    for c0 in range(0, nc, step):
        c1 = min(nc, c0 + step)
        a = acum_h[c0:c1]
        scores = (a[..., :, None] - a[..., None, :]).masked_fill(~causal, float("-inf")).exp_()
        scores.mul_(torch.einsum("clgn,csgn->cgls", Cc[c0:c1], Bc[c0:c1])[:, :, None])
        y[c0:c1] = torch.einsum("cgjls,csgjp->clgjp", scores, xdt[c0:c1])

    # Each chunk's own contribution to its end state, and its total decay.
    to_end = (acum[:, -1:] - acum).exp().view(nc, L, num_groups, hg, 1)
    chunk_states = torch.einsum("clgn,clgjp->cgjpn", Bc, xdt * to_end)
    chunk_states = chunk_states.reshape(nc, num_heads, head_dim, d_state)
    chunk_decay = acum[:, -1].exp()  # [NC, H]

    # Inter-chunk recurrence over chunk index, all requests at once.
    cur = _varlen.load_initial_states(ssm_state, state_indices, has_initial_state, cd)
    starts = torch.empty_like(chunk_states)
    for reqs, cids in lay.steps:
        prev = cur[reqs]
        starts[cids] = prev
        cur[reqs] = prev * chunk_decay[cids][:, :, None, None] + chunk_states[cids]

    # Off-diagonal blocks: the chunk's start state read through C, decayed to position l.
    from_start = acum.exp().view(nc, L, num_groups, hg, 1)
    starts = starts.view(nc, num_groups, hg, head_dim, d_state)
    y += torch.einsum("clgn,cgjpn->clgjp", Cc, starts) * from_start
    _varlen.store_final_states(ssm_state, state_indices, cur)
    y = _varlen.from_chunks(y.view(nc, L, num_heads, head_dim), lay)
    return _skip(y, x.to(cd), D).to(x.dtype)


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
    """One token per request: x ``[R, H, P]``, dt ``[R, H]``, B/C ``[R, G, N]`` -> ``[R, H, P]``.

    The state is gathered once and updated in place (a batched outer product per group):
    on CPU the big temporaries, not the flops, are what costs.
    """
    num_reqs, num_heads, head_dim = x.shape
    num_groups, d_state = B.shape[1:]
    cd = _varlen.compute_dtype(x)
    idx = state_indices.to(torch.int64)
    dt = _varlen.softplus_dt(dt, dt_bias, dt_softplus, dt_limit, cd)  # [R, H]
    xf = x.to(cd)
    state = _varlen.gather_states(ssm_state, idx, cd)  # scratch, updated in place
    state.mul_((dt * A.to(cd)).exp()[..., None, None])
    rows = (num_reqs * num_groups, num_heads // num_groups * head_dim)
    flat = state.view(*rows, d_state)  # heads of one group share B and C
    xdt = (xf * dt[..., None]).reshape(*rows, 1)
    flat.baddbmm_(xdt, B.to(cd).reshape(rows[0], 1, d_state))
    ssm_state.index_copy_(0, idx, state.to(ssm_state.dtype))
    y = torch.bmm(flat, C.to(cd).reshape(rows[0], d_state, 1)).view(num_reqs, num_heads, head_dim)
    return _skip(y, xf, D).to(x.dtype)
