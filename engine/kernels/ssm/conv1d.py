"""Causal depthwise conv1d with a per-slot conv state (bulk torch, the CPU path).

Semantics of transformers' ``causal_conv1d_fn`` / ``causal_conv1d_update``: output ``t``
of a channel is ``bias + sum_k weight[k] * u[t - (W-1) + k]`` over the request's inputs
``u``, where the ``W-1`` inputs before a request's first token come from its conv state
(a continuing request) or are zero (a fresh prefill). The conv state of a slot holds the
last ``W-1`` inputs (before bias / activation), oldest first: ``[num_slots, dim, W-1]``.
"""

from __future__ import annotations

import torch

from engine.kernels.ssm import _varlen


def _activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return y
    if activation in ("silu", "swish"):
        return torch.nn.functional.silu(y)
    raise ValueError(f"unsupported conv1d activation {activation!r}; use None or 'silu'")


def causal_conv1d_prefill(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> torch.Tensor:
    """x ``[T, dim]``, weight ``[dim, W]`` -> ``[T, dim]``; updates ``conv_state`` slots.

    The packed inputs are laid out as ``[hist_0, x_0, hist_1, x_1, ...]`` (each ``hist``
    is the request's W-1 previous inputs), so the outputs are one convolution of that
    buffer and the new state is the last W-1 rows of each request's segment.
    """
    num_tokens, dim = x.shape
    width = weight.shape[1]
    hist = width - 1
    cd = _varlen.compute_dtype(x)
    qsl = query_start_loc.to(torch.int64)
    num_reqs = qsl.numel() - 1
    lens = qsl[1:] - qsl[:-1]
    prev = _varlen.load_initial_states(conv_state, state_indices, has_initial_state, cd)
    seg_start = qsl[:-1] + torch.arange(num_reqs, device=x.device) * hist  # [R]
    ext = x.new_zeros(num_tokens + num_reqs * hist, dim, dtype=cd)
    if hist > 0:
        hist_pos = seg_start[:, None] + torch.arange(hist, device=x.device)  # [R, W-1]
        ext[hist_pos.reshape(-1)] = prev.transpose(1, 2).reshape(-1, dim)
    req = _varlen.token_requests(qsl, num_tokens)
    tok_pos = torch.arange(num_tokens, device=x.device) + (req + 1) * hist  # [T]
    ext[tok_pos] = x.to(cd)
    # Convolve the whole buffer with W shifted views (no gathers), then keep token rows.
    w = weight.to(cd)
    n_out = ext.shape[0] - hist
    full = ext[:n_out] * w[:, 0]
    for k in range(1, width):  # W is the kernel width (4), not a token count
        full.addcmul_(ext[k : k + n_out], w[:, k])
    y = full[tok_pos - hist]
    if bias is not None:
        y = y + bias.to(cd)
    if hist > 0:
        seg_end = seg_start + hist + lens  # one past each request's last row
        last_pos = seg_end[:, None] - hist + torch.arange(hist, device=x.device)
        new_state = ext[last_pos.reshape(-1)].view(num_reqs, hist, dim).transpose(1, 2)
        _varlen.store_final_states(conv_state, state_indices, new_state)
    return _activate(y, activation).to(x.dtype)


def causal_conv1d_decode(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    state_indices: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> torch.Tensor:
    """One new token per request: x ``[R, dim]`` -> ``[R, dim]``; shifts the slots."""
    cd = _varlen.compute_dtype(x)
    idx = state_indices.to(torch.int64)
    window = torch.cat([conv_state.index_select(0, idx).to(cd), x.to(cd)[:, :, None]], dim=2)
    y = (window * weight.to(cd)).sum(-1)
    if bias is not None:
        y = y + bias.to(cd)
    if weight.shape[1] > 1:
        conv_state.index_copy_(0, idx, window[:, :, 1:].to(conv_state.dtype))
    return _activate(y, activation).to(x.dtype)
