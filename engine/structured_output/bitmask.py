"""Lay the core's grammar bitmask out over the sampler's rows.

The core fills one row per constrained request (in ``structured_output_req_ids``
order); the sampler wants one row per logits row. Unconstrained rows get ``-1`` (all
allowed); when every sampling row is constrained and in order the bitmask passes through
untouched.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def bitmask_for_sampling_rows(
    bitmask: torch.Tensor,
    structured_req_ids: Sequence[str],
    sampling_req_ids: Sequence[str],
) -> torch.Tensor | None:
    """int32 ``[len(sampling_req_ids), W]`` from the ``[len(structured_req_ids), W]``
    ``bitmask``; None when no constrained request samples this step."""
    if bitmask.shape[0] != len(structured_req_ids):
        raise ValueError(
            f"grammar bitmask has {bitmask.shape[0]} rows for "
            f"{len(structured_req_ids)} constrained requests"
        )
    position = {rid: i for i, rid in enumerate(sampling_req_ids)}
    src, dst = [], []
    for j, rid in enumerate(structured_req_ids):
        i = position.get(rid)
        if i is not None:
            src.append(j)
            dst.append(i)
    if not dst:
        return None
    n = len(sampling_req_ids)
    if dst == list(range(n)) and src == dst:
        return bitmask
    rows = torch.full((n, bitmask.shape[1]), -1, dtype=torch.int32, device=bitmask.device)
    rows[torch.tensor(dst)] = bitmask[torch.tensor(src)]
    return rows
