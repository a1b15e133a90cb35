"""Mamba-1 selective scan and its decode step, bulk torch (the CPU path).

Per channel ``d`` and token ``t``, as transformers' Mamba (``slow_forward``):
``dt = softplus(dt + dt_bias)``, ``state[d] = exp(dt[d] * A[d]) * state[d] + dt[d] x[d] B[t]``
(``state [d_state]`` per channel), ``y[d] = state[d] . C[t] + D[d] x[d]``, then
``y * silu(z)`` when ``z`` is given. The state cache is ``[num_slots, dim, d_state]``.

The decay differs per (channel, state) element, so no matmul form exists; prefill runs a
log-depth (Hillis-Steele) associative scan over blocks of the packed token stream. A
request's first token gets decay 0 (so nothing leaks in from the previous request) and its
initial state folded into its input; only the state between blocks recurs.
"""

from __future__ import annotations

import torch

from engine.kernels.ssm import _varlen

_BLOCK_ELEMENTS = 1 << 19  # tokens * dim * d_state per block: small enough to stay in cache
# and under glibc's mmap threshold (fresh pages cost more than the arithmetic)


def _scan(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Inclusive scan of ``h_t = a_t h_{t-1} + b_t`` (h_{-1} = 0) along dim 0, log depth.

    Ping-pongs between two buffers (``a`` and ``b`` are overwritten): fresh large
    temporaries per step cost more than the arithmetic on CPU.
    """
    n = a.shape[0]
    a2, b2 = torch.empty_like(a), torch.empty_like(b)
    off = 1
    while off < n:
        b2[:off] = b[:off]
        torch.addcmul(b[off:], a[off:], b[:-off], out=b2[off:])
        if off * 2 < n:  # the decays are not needed after the last step
            a2[:off] = a[:off]
            torch.mul(a[off:], a[:-off], out=a2[off:])
            a, a2 = a2, a
        b, b2 = b2, b
        off *= 2
    return b


def _finish(y: torch.Tensor, x: torch.Tensor, D: torch.Tensor | None, z: torch.Tensor | None):
    if D is not None:
        y = y + x * D.to(y.dtype)
    if z is not None:
        y = y * torch.nn.functional.silu(z.to(y.dtype))
    return y


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
    block_tokens: int | None = None,
) -> torch.Tensor:
    """x/dt/z ``[T, dim]``, A ``[dim, N]``, B/C ``[T, N]`` -> y ``[T, dim]``.

    Reads/writes ``ssm_state[state_indices]`` (``[slots, dim, N]``).
    """
    num_tokens, dim = x.shape
    n_state = A.shape[1]
    cd = _varlen.compute_dtype(x)
    qsl = query_start_loc.to(torch.int64)
    dt = _varlen.softplus_dt(dt, dt_bias, dt_softplus, None, cd)
    xf, Af, Bf, Cf = x.to(cd), A.to(cd), B.to(cd), C.to(cd)
    init = _varlen.load_initial_states(ssm_state, state_indices, has_initial_state, cd)
    final = torch.empty_like(init)
    starts, ends = qsl[:-1].tolist(), (qsl[1:] - 1).tolist()
    start_set = set(starts)
    block = block_tokens or max(4, _BLOCK_ELEMENTS // max(1, dim * n_state))
    y = torch.empty(num_tokens, dim, dtype=cd, device=x.device)
    carry = torch.zeros(dim, n_state, dtype=cd, device=x.device)
    for t0 in range(0, num_tokens, block):  # per block of tokens, not per token
        t1 = min(t0 + block, num_tokens)
        a = torch.exp(dt[t0:t1, :, None] * Af)  # [l, dim, N]
        b = (dt[t0:t1] * xf[t0:t1])[:, :, None] * Bf[t0:t1, None, :]
        if t0 not in start_set:  # the block continues the request of the previous block
            b[0] += a[0] * carry
        first = [(r, s - t0) for r, s in enumerate(starts) if t0 <= s < t1]
        if first:
            reqs = torch.tensor([r for r, _ in first], device=x.device)
            rows = torch.tensor([p for _, p in first], device=x.device)
            b[rows] = b[rows] + a[rows] * init[reqs]
            a[rows] = 0.0
        h = _scan(a, b)
        y[t0:t1] = torch.bmm(h, Cf[t0:t1, :, None])[..., 0]
        last = [(r, e - t0) for r, e in enumerate(ends) if t0 <= e < t1]
        if last:
            reqs = torch.tensor([r for r, _ in last], device=x.device)
            final[reqs] = h[torch.tensor([p for _, p in last], device=x.device)]
        carry = h[-1]
    _varlen.store_final_states(ssm_state, state_indices, final)
    return _finish(y, xf, D, z).to(x.dtype)


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
    cd = _varlen.compute_dtype(x)
    idx = state_indices.to(torch.int64)
    dt = _varlen.softplus_dt(dt, dt_bias, dt_softplus, None, cd)
    xf = x.to(cd)
    state = _varlen.gather_states(ssm_state, idx, cd)  # scratch, updated in place
    state.mul_(torch.exp(dt[..., None] * A.to(cd)))
    state.baddbmm_((dt * xf)[..., None], B.to(cd)[:, None, :])
    ssm_state.index_copy_(0, idx, state.to(ssm_state.dtype))
    y = torch.bmm(state, C.to(cd)[..., None])[..., 0]
    return _finish(y, xf, D, z).to(x.dtype)
