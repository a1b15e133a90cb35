"""Gated DeltaNet (Qwen3-Next linear attention), bulk torch (the CPU path).

Per value head and token, as transformers' ``torch_recurrent_gated_delta_rule``:
``S = exp(g) S``; ``S += k (beta (v - S^T k))^T``; ``o = S^T (scale q)`` with ``S``
``[k_dim, v_dim]``, q/k optionally L2-normalized (eps 1e-6) and ``scale = k_dim ** -0.5``.
Query/key heads are shared by ``Hv / Hk`` consecutive value heads. The state cache is
``[num_slots, Hv, k_dim, v_dim]``.

Prefill uses the chunked (WY / UT-transform) form of ``torch_chunk_gated_delta_rule``:
one triangular solve per chunk for all chunks at once, then a recurrence over chunk index.
"""

from __future__ import annotations

import torch

from engine.kernels.ssm import _varlen


def _prepare_qk(
    q: torch.Tensor, k: torch.Tensor, num_v_heads: int, use_qk_l2norm: bool,
    scale: float | None, dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Expand grouped q/k heads to the value heads, normalize, and scale q."""
    rep = num_v_heads // q.shape[-2]
    q, k = q.to(dtype), k.to(dtype)
    if rep > 1:
        q = q.repeat_interleave(rep, dim=-2)
        k = k.repeat_interleave(rep, dim=-2)
    if use_qk_l2norm:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    return q * (scale if scale is not None else q.shape[-1] ** -0.5), k


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

    ``g`` is the log decay (<= 0). Reads/writes ``ssm_state[state_indices]``.
    """
    num_v_heads = v.shape[1]
    cd = _varlen.compute_dtype(v)
    lay = _varlen.chunk_layout(query_start_loc, chunk_size)
    qf, kf = _prepare_qk(q, k, num_v_heads, use_qk_l2norm, scale, cd)

    def chunks(t: torch.Tensor) -> torch.Tensor:  # [T, H, ...] -> [NC, H, L, ...]
        return _varlen.to_chunks(t.to(cd), lay).transpose(1, 2).contiguous()

    qc, kc, vc = chunks(qf), chunks(kf), chunks(v)
    gc, bc = chunks(g), chunks(beta)  # padding: g = 0 (no decay), beta = 0 (no write)
    kb, vb = kc * bc[..., None], vc * bc[..., None]
    cum = torch.cumsum(gc, dim=-1)  # [NC, H, L]
    L = chunk_size
    causal = torch.ones(L, L, dtype=torch.bool, device=v.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    # UT transform: (I + strict_lower(beta K K^T * decay))^-1 applied to beta V and decayed beta K.
    system = (kb @ kc.transpose(-1, -2)) * decay
    solve = torch.linalg.solve_triangular
    u = solve(system, vb, upper=False, unitriangular=True)
    w = solve(system, kb * cum.exp()[..., None], upper=False, unitriangular=True)
    attn = (qc @ kc.transpose(-1, -2)) * decay  # lower triangle incl. the diagonal
    q_dec = qc * cum.exp()[..., None]
    k_dec = kc * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [NC, H, 1, 1]

    cur = _varlen.load_initial_states(ssm_state, state_indices, has_initial_state, cd)
    out = torch.empty_like(u)  # [NC, H, L, V]
    for reqs, cids in lay.steps:  # one step per chunk index, all requests at once
        state = cur[reqs]
        v_new = u[cids] - w[cids] @ state
        out[cids] = q_dec[cids] @ state + attn[cids] @ v_new
        cur[reqs] = state * chunk_decay[cids] + k_dec[cids].transpose(-1, -2) @ v_new
    _varlen.store_final_states(ssm_state, state_indices, cur)
    return _varlen.from_chunks(out.transpose(1, 2), lay).to(v.dtype)


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
    """One token per request: q/k ``[R, Hk, K]``, v ``[R, Hv, V]``, g/beta ``[R, Hv]``.

    The state is gathered once and updated in place (batched matvec + outer product).
    """
    num_reqs, num_heads, v_dim = v.shape
    cd = _varlen.compute_dtype(v)
    idx = state_indices.to(torch.int64)
    qf, kf = _prepare_qk(q, k, num_heads, use_qk_l2norm, scale, cd)
    k_dim = kf.shape[-1]
    rows = num_reqs * num_heads
    state = _varlen.gather_states(ssm_state, idx, cd)  # scratch, updated in place
    state.mul_(g.to(cd).exp()[..., None, None])
    flat = state.view(rows, k_dim, v_dim)
    predicted = torch.bmm(kf.reshape(rows, 1, k_dim), flat)  # [RH, 1, V]
    delta = (v.to(cd).reshape(rows, 1, v_dim) - predicted) * beta.to(cd).reshape(rows, 1, 1)
    flat.baddbmm_(kf.reshape(rows, k_dim, 1), delta)
    ssm_state.index_copy_(0, idx, state.to(ssm_state.dtype))
    out = torch.bmm(qf.reshape(rows, 1, k_dim), flat)
    return out.view(num_reqs, num_heads, v_dim).to(v.dtype)
