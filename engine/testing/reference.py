"""Float64 references for the conformance kit (independent of any backend or kernel)."""

from __future__ import annotations

import math

import torch


def paged_attention_reference(
    query: torch.Tensor,  # [T, H, D] this step's queries
    keys: list[torch.Tensor],  # per request [seq_len, Hkv, D]: the whole context
    values: list[torch.Tensor],
    query_lens: list[int],
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal (optionally windowed) GQA attention in float64, request by request: query
    row ``i`` of a request with ``q`` new tokens and ``S`` context tokens sits at position
    ``S - q + i`` and attends to keys ``0 ..= position`` (the last ``sliding_window`` of
    them when set). Returns float64 ``[T, H, D]``."""
    num_heads = query.shape[1]
    out = []
    start = 0
    for k, v, qlen in zip(keys, values, query_lens):
        seq_len = k.shape[0]
        group = num_heads // k.shape[1]
        q = query[start:start + qlen].double()  # [q, H, D]
        kk = k.double().repeat_interleave(group, dim=1)  # [S, H, D]
        vv = v.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, kk) * scale
        pos = torch.arange(seq_len - qlen, seq_len).unsqueeze(1)  # [q, 1]
        key_pos = torch.arange(seq_len).unsqueeze(0)  # [1, S]
        allowed = key_pos <= pos
        if sliding_window is not None:
            allowed &= key_pos > pos - sliding_window
        scores = scores.masked_fill(~allowed, -math.inf)
        probs = torch.softmax(scores, dim=-1)
        out.append(torch.einsum("hqk,khd->qhd", probs, vv))
        start += qlen
    return torch.cat(out, dim=0)


def linear_reference(x: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + b`` in float64."""
    y = x.double() @ weight.double().T
    return y if bias is None else y + bias.double()


def dequantize_int_weights(codes: torch.Tensor, scales: torch.Tensor,
                           zeros: torch.Tensor | None, bits: int, group: int) -> torch.Tensor:
    """The canonical ``int`` encoding decoded in float64: ``(code - zero) * scale`` with
    one scale (and zero) per ``group`` input features; no zeros: the midpoint."""
    codes = codes.double()
    z = torch.full_like(scales, 2 ** (bits - 1), dtype=torch.float64) if zeros is None \
        else zeros.double()
    return (codes - z.repeat_interleave(group, dim=1)) * scales.double().repeat_interleave(
        group, dim=1)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return weight.double() * x / torch.sqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.double().chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def rotary_neox_reference(x: torch.Tensor, positions: torch.Tensor,
                          cos_sin_cache: torch.Tensor, head_size: int) -> torch.Tensor:
    """Rotate-half rotary of ``x [T, heads * head_size]`` in float64."""
    t = x.shape[0]
    xs = x.double().view(t, -1, head_size)
    cos, sin = cos_sin_cache.double()[positions].chunk(2, dim=-1)  # [T, D/2] each
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    x1, x2 = xs[..., : head_size // 2], xs[..., head_size // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).view(t, -1)
