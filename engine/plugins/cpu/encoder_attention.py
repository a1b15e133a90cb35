"""Non-causal (encoder) attention on the CPU: each request's tokens of the step attend to
each other in both directions, with no KV cache.

A step of an embedding workload is many prompts of uneven length. They are sorted by
length and cut into groups whose padding stays small (:func:`plan_encoder_step`, once
per step, shared by every layer); each group is gathered into one padded ``[n, L, H, D]``
batch and run through one SDPA call -- with no mask at all when its prompts are equally
long and no window applies, else a boolean mask hiding the padding keys and, for a
windowed layer, keys more than ``window // 2`` positions away -- and the valid rows are
copied back. Padded query rows attend to real keys only, so they never produce NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

# A group stops growing when its padded area would exceed MAX_PADDING times its tokens
# (for prompts past LONG_PROMPT none: a masked SDPA costs far more than an unmasked one
# there) or it holds MAX_GROUP prompts. Measured on a 2-core Zen 4 over short, uneven and
# long prompt mixes: ~1.3-1.7x a loop of one SDPA call per prompt, ~2x one padded batch.
MAX_PADDING = 1.25
LONG_PROMPT = 128
MAX_GROUP = 16


@dataclass
class _Group:
    """Prompts run in one SDPA call."""

    # int64 [n * L]: the token row of each padded slot; a padding slot reads the group's
    # first token (any real row: masked as a key, dropped as a query), so no zero row
    # has to be appended to the step's tensors.
    gather: torch.Tensor
    valid_slots: torch.Tensor | None  # int64: padded slots that are tokens (None: all)
    tokens: torch.Tensor  # int64: their token rows, in the same order
    lengths: np.ndarray  # [n]
    longest: int


@dataclass
class EncoderPlan:
    """How one step's requests are grouped (see the module docstring)."""

    num_tokens: int
    groups: list[_Group]


def plan_encoder_step(query_start_loc: np.ndarray) -> EncoderPlan:
    qsl = np.asarray(query_start_loc, dtype=np.int64)
    lens = np.diff(qsl)
    num_tokens = int(qsl[-1])
    if (lens <= 0).any():
        raise ValueError("every request of an encoder step needs at least one token")
    order = np.argsort(lens, kind="stable")
    groups: list[_Group] = []
    start = 0
    while start < len(order):
        end = start + 1
        total = int(lens[order[start]])
        while end < len(order) and end - start < MAX_GROUP:
            longest = int(lens[order[end]])  # sorted: the newcomer is the longest
            allowed = MAX_PADDING if longest <= LONG_PROMPT else 1.0
            if longest * (end + 1 - start) > allowed * (total + longest):
                break
            total += longest
            end += 1
        groups.append(_group(qsl, lens, order[start:end]))
        start = end
    return EncoderPlan(num_tokens, groups)


def _group(qsl: np.ndarray, lens: np.ndarray, members: np.ndarray) -> _Group:
    lengths = lens[members]
    longest = int(lengths.max())
    slot = np.arange(longest)
    rows = qsl[members][:, None] + slot[None, :]  # [n, L]
    valid = slot[None, :] < lengths[:, None]
    gather = np.where(valid, rows, qsl[members[0]]).reshape(-1)
    flat_valid = valid.reshape(-1)
    all_valid = bool(flat_valid.all())
    return _Group(
        gather=torch.from_numpy(gather),
        valid_slots=None if all_valid else torch.from_numpy(np.flatnonzero(flat_valid)),
        tokens=torch.from_numpy(rows.reshape(-1)[flat_valid]),
        lengths=lengths,
        longest=longest,
    )


def encoder_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      query_start_loc: np.ndarray, scale: float,
                      sliding_window: int | None = None,
                      logits_soft_cap: float | None = None,
                      plan: EncoderPlan | None = None) -> torch.Tensor:
    """``query [T, H, D]``, ``key`` / ``value [T, Hkv, D]`` -> ``[T, H, D]``; request
    ``r`` owns tokens ``query_start_loc[r] : query_start_loc[r + 1]``. ``plan``: the
    step's grouping (computed here when not given)."""
    num_tokens, heads, dim = query.shape
    if num_tokens == 0:
        return torch.empty_like(query)
    if plan is None:
        plan = plan_encoder_step(query_start_loc)
    if len(plan.groups) == 1 and plan.groups[0].valid_slots is None and len(
            plan.groups[0].lengths) == 1:
        return _attend(query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0), None,
                       plan.groups[0].longest, scale, sliding_window, logits_soft_cap)[0]
    out = torch.empty_like(query)
    for group in plan.groups:
        n, longest = len(group.lengths), group.longest
        q, k, v = (t.index_select(0, group.gather).view(n, longest, *t.shape[1:])
                   for t in (query, key, value))
        valid = None
        if group.valid_slots is not None:
            valid = torch.from_numpy(np.arange(longest)[None, :] < group.lengths[:, None])
        rows = _attend(q, k, v, valid, longest, scale, sliding_window,
                       logits_soft_cap).reshape(n * longest, heads, dim)
        if group.valid_slots is not None:
            rows = rows.index_select(0, group.valid_slots)
        out.index_copy_(0, group.tokens, rows)
    return out


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor | None,
            longest: int, scale: float, window: int | None, soft_cap: float | None
            ) -> torch.Tensor:
    """``[n, L, H, D]`` padded prompts (``valid [n, L]``: which keys are tokens) ->
    ``[n, L, H, D]``."""
    heads, kv_heads = q.shape[2], k.shape[2]
    mask = _mask(valid, longest, window)
    dtype = q.dtype
    # torch's CPU SDPA runs prompt-sized bf16 / fp16 batches ~1.5x slower than float32
    # ones (measured, 2-core Zen 4), and the widening copy is small next to it.
    q, k, v = (t.transpose(1, 2).float() for t in (q, k, v))  # [n, H, L, D]
    if kv_heads != heads:
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
    if soft_cap is None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    else:
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
        scores = soft_cap * torch.tanh(scores / soft_cap)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        out = torch.matmul(torch.softmax(scores, dim=-1), v)
    return out.transpose(1, 2).to(dtype)


def _mask(valid: torch.Tensor | None, longest: int, window: int | None) -> torch.Tensor | None:
    """Boolean ``[n or 1, 1, L, L]`` (True: attend), or None when every key is visible."""
    mask = None
    if valid is not None:
        mask = valid[:, None, None, :].expand(-1, 1, longest, -1)
    if window is not None and window // 2 < longest - 1:
        pos = torch.arange(longest)
        near = ((pos[:, None] - pos[None, :]).abs() <= window // 2)[None, None]
        mask = near if mask is None else mask & near
    return mask
