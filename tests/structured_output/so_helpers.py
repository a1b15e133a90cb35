"""Test helpers: unpack bitmask rows, decode allowed tokens."""

from __future__ import annotations

import torch


def allowed_ids(bitmask: torch.Tensor, row: int, vocab_size: int) -> set[int]:
    """Token ids whose bit is set in ``bitmask[row]`` (independent of the sampler's unpack)."""
    words = bitmask[row].tolist()
    return {t for t in range(vocab_size) if (words[t // 32] >> (t % 32)) & 1}


def new_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)
