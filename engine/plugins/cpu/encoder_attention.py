"""Non-causal (encoder) attention on the CPU: each request's tokens of the step attend to
each other in both directions, with no KV cache.

The step's requests are padded into one ``[R, L, H, D]`` batch (``L`` the longest) and run
through one SDPA call with a boolean mask that hides the padding keys and, for a windowed
layer, keys more than ``window // 2`` positions away; the padded query rows are dropped.
Embedding batches are many prompts of similar length, so the padding costs little and one
call replaces a Python loop over requests.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F


def encoder_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      query_start_loc: np.ndarray, scale: float,
                      sliding_window: int | None = None,
                      logits_soft_cap: float | None = None) -> torch.Tensor:
    """``query [T, H, D]``, ``key`` / ``value [T, Hkv, D]`` -> ``[T, H, D]``; request
    ``r`` owns tokens ``query_start_loc[r] : query_start_loc[r + 1]``."""
    qsl = np.asarray(query_start_loc, dtype=np.int64)
    lens = np.diff(qsl)
    num_reqs, num_tokens = len(lens), int(qsl[-1])
    heads, kv_heads, dim = query.shape[1], key.shape[1], query.shape[2]
    if num_reqs == 0 or num_tokens == 0:
        return torch.empty_like(query)
    longest = int(lens.max())
    if num_reqs == 1:
        q, k, v = (t.unsqueeze(0) for t in (query, key, value))
        valid = None
    else:
        rows = torch.from_numpy(np.repeat(np.arange(num_reqs), lens))
        cols = torch.from_numpy(np.arange(num_tokens) - np.repeat(qsl[:-1], lens))
        q, k, v = (_pad(t, rows, cols, num_reqs, longest) for t in (query, key, value))
        valid = torch.from_numpy(np.arange(longest)[None, :] < lens[:, None])  # [R, L]
    mask = _mask(valid, longest, sliding_window)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [R, H, L, D]
    if kv_heads != heads:
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
    if logits_soft_cap is None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    else:
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
        scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        out = torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v)
    out = out.transpose(1, 2)  # [R, L, H, D]
    if valid is None:
        return out[0].contiguous()
    return out[rows, cols].reshape(num_tokens, heads, dim)


def _pad(x: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, num_reqs: int,
         longest: int) -> torch.Tensor:
    padded = x.new_zeros(num_reqs, longest, x.shape[1], x.shape[2])
    padded[rows, cols] = x
    return padded


def _mask(valid: torch.Tensor | None, longest: int, window: int | None) -> torch.Tensor | None:
    """Boolean ``[R or 1, 1, L, L]`` (True: attend), or None when every key is visible."""
    mask = None
    if valid is not None:
        mask = valid[:, None, None, :].expand(-1, 1, longest, -1)
    if window is not None and window // 2 < longest - 1:
        pos = torch.arange(longest)
        near = ((pos[:, None] - pos[None, :]).abs() <= window // 2)[None, None]
        mask = near if mask is None else mask & near
    return mask
