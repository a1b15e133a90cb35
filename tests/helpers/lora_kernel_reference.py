"""The float64 reference the LoRA kernel tests (portable, Triton, CPU C) compare with."""

from __future__ import annotations

import torch


def lora_reference(x, lora_a, lora_b, slots, bounds, y):
    """float64 ``(s, y + delta)`` of shrink then expand, one token at a time: ``lora_a
    [S, shards * R, in]``, ``lora_b [S, R, N]`` (rank-major), ``slots [T]`` (-1: none),
    ``bounds``: the shards' output columns."""
    s = torch.zeros(x.shape[0], lora_a.shape[1], dtype=torch.float64)
    y = y.double().clone()
    rank = lora_b.shape[1]
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        s[t] = lora_a[slot].double() @ x[t].double()
        for j in range(len(bounds) - 1):
            lo, hi = bounds[j], bounds[j + 1]
            y[t, lo:hi] += s[t, j * rank:(j + 1) * rank] @ lora_b[slot, :, lo:hi].double()
    return s, y
