"""The portable batched multi-LoRA kernel: shrink / expand in bulk torch ops (any device).

Tokens are grouped by slot on the host, and each group runs as one matmul against its
slot's adapter (so the Python loop is over groups, never tokens):

- **runs**: when the step has few runs of equal slots (a prefill: a request's tokens
  are contiguous), every run is a slice of the rows (views, nothing gathered);
- **sorted**: otherwise (a decode step: one token per request) the tokens are sorted by
  slot once, gathered, multiplied slot by slot and scattered back.

Arithmetic is float32 (activations and adapters widened); ``y`` is rounded once, after
the add. Finding the groups reads the slots on the host, so this kernel is not for device
graphs (the platforms' own kernels are); it is the reference every platform has.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from engine.core.interfaces.lora import LoRAKernel

MAX_RUNS = 16  # more runs than this (and than half the tokens): sort instead


def _groups(token_slots: torch.Tensor) -> tuple[torch.Tensor | None, list[tuple[int, int, int]]]:
    """``(order, [(slot, start, end), ...])``: rows ``start:end`` of the tokens taken in
    ``order`` (None: their own order) all have ``slot`` (>= 0; slot -1 dropped)."""
    t = token_slots.shape[0]
    if t == 0:
        return None, []
    slots = token_slots.to(torch.int64)
    change = torch.ones(t, dtype=torch.bool, device=slots.device)
    change[1:] = slots[1:] != slots[:-1]
    starts = torch.nonzero(change).flatten()
    if starts.numel() <= MAX_RUNS or 2 * starts.numel() <= t:
        bounds = torch.cat([starts, starts.new_tensor([t])])
        run_slots = slots[starts]
        pairs = torch.stack([run_slots, bounds[:-1], bounds[1:]], 1).tolist()
        return None, [(s, a, b) for s, a, b in pairs if s >= 0]
    sorted_slots, order = torch.sort(slots, stable=True)
    distinct, counts = torch.unique_consecutive(sorted_slots, return_counts=True)
    ends = torch.cumsum(counts, 0)
    pairs = torch.stack([distinct, ends - counts, ends], 1).tolist()
    return order, [(s, a, b) for s, a, b in pairs if s >= 0]


class TorchLoRAKernel(LoRAKernel):
    """Shrink / expand in torch ops on any device and dtype (see the module docstring)."""

    name: ClassVar[str] = "torch_lora"

    @classmethod
    def can_implement(cls, dtype: torch.dtype, device: torch.device) -> str | None:
        if not dtype.is_floating_point:
            return f"dtype {dtype} is not a float dtype"
        return None

    def shrink(self, x: torch.Tensor, lora_a: torch.Tensor, token_slots: torch.Tensor,
               out: torch.Tensor) -> None:
        order, groups = _groups(token_slots)
        if order is None:
            if sum(b - a for _, a, b in groups) < out.shape[0]:
                out.zero_()  # tokens without an adapter (or none at all)
            for slot, a, b in groups:
                torch.mm(x[a:b].float(), lora_a[slot].float().t(), out=out[a:b])
            return
        out.zero_()
        valid = order[groups[0][1]:groups[-1][2]] if groups else order[:0]
        xs = x.index_select(0, valid).float()
        first = groups[0][1] if groups else 0
        result = torch.empty((valid.shape[0], out.shape[1]), dtype=torch.float32,
                             device=out.device)
        for slot, a, b in groups:
            torch.mm(xs[a - first:b - first], lora_a[slot].float().t(),
                     out=result[a - first:b - first])
        out.index_copy_(0, valid, result)

    def expand(self, s: torch.Tensor, lora_b: torch.Tensor, token_slots: torch.Tensor,
               shard_bounds: tuple[int, ...], y: torch.Tensor) -> None:
        order, groups = _groups(token_slots)
        if not groups:
            return
        rank = lora_b.shape[1]  # B is R-major: [S, R, N]
        shards = [(j, shard_bounds[j], shard_bounds[j + 1]) for j in range(len(shard_bounds) - 1)
                  if shard_bounds[j + 1] > shard_bounds[j]]

        def add_into(acc: torch.Tensor, rows: torch.Tensor, slot: int) -> None:
            """``acc [len, N]`` (float32) += ``rows``' update for adapter ``slot``."""
            b = lora_b[slot].float()
            for j, lo, hi in shards:
                acc[:, lo:hi].addmm_(rows[:, j * rank:(j + 1) * rank], b[:, lo:hi])

        if order is None:
            for slot, a, b in groups:
                if y.dtype == torch.float32:
                    add_into(y[a:b], s[a:b], slot)
                else:  # float32 sums, y rounded once
                    acc = y[a:b].float()
                    add_into(acc, s[a:b], slot)
                    y[a:b] = acc
            return
        first = groups[0][1]
        valid = order[first:groups[-1][2]]
        ss = s.index_select(0, valid)
        acc = y.index_select(0, valid).float()
        for slot, a, b in groups:
            add_into(acc[a - first:b - first], ss[a - first:b - first], slot)
        y[valid] = acc.to(y.dtype)
