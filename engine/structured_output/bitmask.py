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


def bitmask_for_spec_rows(
    bitmask: torch.Tensor,
    structured_req_ids: Sequence[str],
    sampling_req_ids: Sequence[str],
    num_drafts: Sequence[int],
) -> torch.Tensor | None:
    """The bitmask over verification rows: request ``sampling_req_ids[i]`` owns
    ``num_drafts[i] + 1`` consecutive rows, and so does each constrained request in
    ``bitmask`` (its next-token row, then one per draft position, as the core fills
    them). None when no constrained request samples this step."""
    counts = [int(n) + 1 for n in num_drafts]
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + c)
    position = {rid: i for i, rid in enumerate(sampling_req_ids)}
    src: list[int] = []
    dst: list[int] = []
    offset = 0
    for rid in structured_req_ids:
        i = position.get(rid)
        if i is None:
            raise ValueError(f"constrained request {rid!r} does not sample this step")
        src.extend(range(offset, offset + counts[i]))
        dst.extend(range(starts[i], starts[i] + counts[i]))
        offset += counts[i]
    if offset != bitmask.shape[0]:
        raise ValueError(
            f"grammar bitmask has {bitmask.shape[0]} rows for {offset} verification rows"
        )
    if not dst:
        return None
    rows = torch.full((starts[-1], bitmask.shape[1]), -1, dtype=torch.int32,
                      device=bitmask.device)
    rows[torch.tensor(dst)] = bitmask[torch.tensor(src)]
    return rows
