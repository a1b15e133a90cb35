"""Split-KV (flash-decoding) support for unified attention: policy, buffers, reduce.

With ``num_kv_splits = n > 1`` the unified kernel gives each (query block, kv head) ``n``
programs, each over an equal share of the key tiles; each writes fp32 partial rows
(running max in log2 units, softmax denominator, unnormalised output). The reduce kernel
here rescales every share to the global max and normalises once; attention sinks join
the denominator there, once per row (never in the shares, which would count them ``n``
times).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from engine.kernels import stats
from engine.kernels.triton_utils import next_power_of_2

MAX_KV_SPLITS = 64
MIN_KEYS_PER_SPLIT = 256


@triton.jit
def _split_kv_reduce_kernel(
    out_ptr,
    part_max_ptr,
    part_sum_ptr,
    part_acc_ptr,
    sinks_ptr,  # float32 [num_heads] (unused unless USE_SINKS)
    num_heads,
    head_size,
    stride_ot,
    stride_oh,
    stride_od,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    USE_SINKS: tl.constexpr,
):
    """Merge the split partials of one (token, head): rescale each to the global max."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    split_valid = splits < NUM_SPLITS
    dims = tl.arange(0, HEAD_PAD)
    dim_valid = dims < head_size
    part = (token * num_heads + head) * NUM_SPLITS + splits
    m = tl.load(part_max_ptr + part, mask=split_valid, other=float("-inf"))
    l = tl.load(part_sum_ptr + part, mask=split_valid, other=0.0)
    m_max = tl.max(m, axis=0)
    if USE_SINKS:  # the sink logit (log2 units like the maxima): denominator only
        sink = tl.load(sinks_ptr + head) * 1.4426950408889634
        m_max = tl.maximum(m_max, sink)
    weight = tl.where(m > float("-inf"), tl.exp2(m - m_max), 0.0)  # empty splits count 0
    total = tl.sum(l * weight, axis=0)
    if USE_SINKS:
        total += tl.where(sink > float("-inf"), tl.exp2(sink - m_max), 0.0)
    acc = tl.load(
        part_acc_ptr + part[:, None] * HEAD_PAD + dims[None, :],
        mask=split_valid[:, None] & dim_valid[None, :],
        other=0.0,
    )
    out = tl.sum(acc * weight[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)
    o_off = token * stride_ot + head * stride_oh + dims * stride_od
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=dim_valid)


@dataclass
class SplitKVWorkspace:
    """Reusable fp32 partial buffers for split-KV, shared by all layers of a step."""

    buffers: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(
        default_factory=dict
    )

    def get(
        self, num_tokens: int, num_heads: int, num_splits: int, head_pad: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        key = (num_heads, num_splits, head_pad, device)
        held = self.buffers.get(key)
        if held is None or held[0].shape[0] < num_tokens:
            shape = (num_tokens, num_heads, num_splits)
            held = (
                torch.empty(shape, dtype=torch.float32, device=device),
                torch.empty(shape, dtype=torch.float32, device=device),
                torch.empty((*shape, head_pad), dtype=torch.float32, device=device),
            )
            self.buffers[key] = held
        return held


def choose_num_kv_splits(
    num_reqs: int,
    num_kv_heads: int,
    max_query_len: int,
    max_seq_len: int,
    num_compute_units: int,
) -> int:
    """How many programs share one (request, kv head)'s keys; 1 means no split.

    Splits only pure-decode batches whose ``requests x kv heads`` programs leave the
    device under-filled (fewer than two per compute unit), and never below
    ``MIN_KEYS_PER_SPLIT`` keys per split so the extra reduce stays cheap.
    """
    if max_query_len != 1 or num_reqs == 0:
        return 1
    programs = num_reqs * max(num_kv_heads, 1)
    target = 2 * num_compute_units
    if programs >= target:
        return 1
    wanted = triton.cdiv(target, programs)
    by_length = max_seq_len // MIN_KEYS_PER_SPLIT
    splits = min(wanted, by_length, MAX_KV_SPLITS)
    return max(1, splits)


def split_kv_reduce(
    out: torch.Tensor,
    partials: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    num_kv_splits: int,
    sinks: torch.Tensor | None = None,
) -> None:
    """Merge ``partials`` (from :meth:`SplitKVWorkspace.get`) into ``out`` [T, H, D];
    ``sinks``: float32 ``[H]`` sink logits added to each row's denominator."""
    num_tokens, num_heads, head_size = out.shape
    part_max, part_sum, part_acc = partials
    head_pad = part_acc.shape[-1]
    _split_kv_reduce_kernel[(num_tokens, num_heads)](
        out,
        part_max,
        part_sum,
        part_acc,
        sinks if sinks is not None else part_max,
        num_heads,
        head_size,
        *out.stride(),
        NUM_SPLITS=num_kv_splits,
        SPLITS_PAD=next_power_of_2(num_kv_splits),
        HEAD_PAD=head_pad,
        USE_SINKS=sinks is not None,
        num_warps=4 if head_pad >= 128 else 1,
    )
    stats.launches.split_kv_reduce += 1
