"""Independent float64 references: one request at a time, one token at a time.

Written from the recurrences in transformers' slow paths (Mamba slow_forward, Mamba2
torch_forward / selective_state_update, Qwen3-Next torch_recurrent_gated_delta_rule,
causal_conv1d_update), deliberately naive so they share no code with engine.kernels.ssm.
"""

from __future__ import annotations

import math

import torch

F64 = torch.float64


def _softplus(x: float) -> float:
    return x if x > 20.0 else math.log1p(math.exp(x))


def conv1d(x, weight, bias, state, activation):
    """x [L, dim] of one request, state [dim, W-1] -> (y [L, dim], new state)."""
    x, weight, state = x.to(F64), weight.to(F64), state.to(F64).clone()
    ys = []
    for t in range(x.shape[0]):
        window = torch.cat([state, x[t][:, None]], dim=1)  # [dim, W]
        y = (window * weight).sum(-1)
        if bias is not None:
            y = y + bias.to(F64)
        if activation == "silu":
            y = y * torch.sigmoid(y)
        ys.append(y)
        state = window[:, 1:]
    return torch.stack(ys), state


def _dt(dt_raw, bias, softplus, limit):
    v = float(dt_raw) + (float(bias) if bias is not None else 0.0)
    v = _softplus(v) if softplus else v
    return min(max(v, limit[0]), limit[1]) if limit is not None else v


def mamba2(x, dt, A, B, C, D, dt_bias, state, dt_limit=(0.0, math.inf)):
    """One request: x [L, H, P], dt [L, H], B/C [L, G, N], state [H, P, N]."""
    L, H, P = x.shape
    G = B.shape[1]
    state = state.to(F64).clone()
    y = torch.zeros(L, H, P, dtype=F64)
    for t in range(L):
        for h in range(H):
            g = h // (H // G)
            d = _dt(dt[t, h], None if dt_bias is None else dt_bias[h], True, dt_limit)
            state[h] = math.exp(d * float(A[h])) * state[h] + d * torch.outer(
                x[t, h].to(F64), B[t, g].to(F64)
            )
            y[t, h] = state[h] @ C[t, g].to(F64)
            if D is not None:
                y[t, h] += D[h].to(F64) * x[t, h].to(F64)  # D [H] or [H, P]
    return y, state


def mamba1(x, dt, A, B, C, D, z, dt_bias, state):
    """One request: x/dt/z [L, dim], A [dim, N], B/C [L, N], state [dim, N]."""
    L, dim = x.shape
    state = state.to(F64).clone()
    y = torch.zeros(L, dim, dtype=F64)
    for t in range(L):
        d = dt[t].to(F64) + (dt_bias.to(F64) if dt_bias is not None else 0.0)
        d = torch.nn.functional.softplus(d)
        state = torch.exp(d[:, None] * A.to(F64)) * state + (d * x[t].to(F64))[:, None] * B[
            t
        ].to(F64)
        y[t] = state @ C[t].to(F64)
        if D is not None:
            y[t] += D.to(F64) * x[t].to(F64)
        if z is not None:
            zt = z[t].to(F64)
            y[t] *= zt * torch.sigmoid(zt)
    return y, state


def gated_delta(q, k, v, g, beta, state, use_qk_l2norm=True, scale=None):
    """One request: q/k [L, Hk, K], v [L, Hv, V], g/beta [L, Hv], state [Hv, K, V]."""
    L, Hv, V = v.shape
    Hk, K = q.shape[1:]
    scale = K**-0.5 if scale is None else scale
    state = state.to(F64).clone()
    o = torch.zeros(L, Hv, V, dtype=F64)
    for t in range(L):
        for h in range(Hv):
            qt, kt = q[t, h // (Hv // Hk)].to(F64), k[t, h // (Hv // Hk)].to(F64)
            if use_qk_l2norm:
                qt = qt / torch.sqrt((qt * qt).sum() + 1e-6)
                kt = kt / torch.sqrt((kt * kt).sum() + 1e-6)
            s = state[h] * math.exp(float(g[t, h]))
            delta = (v[t, h].to(F64) - kt @ s) * float(beta[t, h])
            s = s + torch.outer(kt, delta)
            state[h] = s
            o[t, h] = (qt * scale) @ s
    return o, state
