"""Per-request token statistics for penalties, kept on the device and updated in place.

Only requests with a penalty own a slot: a ``[V]`` prompt-occurrence mask and a ``[V]``
output-count vector. They are built once when the request arrives (bincount of its
tokens) and then bumped by one scatter-add per step, so a step never rescans the
context. Slots are recycled; the pools double when full. Every mutation runs under
``torch.inference_mode`` so the pools are updated the same way whether or not the
caller (the model runner's step) is inside inference mode.
"""

from __future__ import annotations

import numpy as np
import torch


class TokenCountsPool:
    """Slots of ``prompt_mask`` (bool ``[S, V]``) and ``output_counts`` (int32 ``[S, V]``)."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.prompt_mask = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)
        self.output_counts = torch.zeros(0, vocab_size, dtype=torch.int32, device=device)
        self._free: list[int] = []

    @property
    def capacity(self) -> int:
        return self.prompt_mask.shape[0]

    @property
    def num_free(self) -> int:
        return len(self._free)

    @torch.inference_mode()
    def allocate(self, prompt_token_ids: np.ndarray, output_token_ids: np.ndarray) -> int:
        """A slot holding the statistics of these tokens (ids already range-checked)."""
        if not self._free:
            self._grow()
        slot = self._free.pop()
        prompt = torch.from_numpy(prompt_token_ids).to(self.device)
        output = torch.from_numpy(output_token_ids).to(self.device)
        self.prompt_mask[slot] = torch.bincount(prompt, minlength=self.vocab_size) > 0
        self.output_counts[slot] = torch.bincount(output, minlength=self.vocab_size)
        return slot

    def free(self, slot: int) -> None:
        self._free.append(slot)

    @torch.inference_mode()
    def add_tokens(self, slots: np.ndarray, token_ids: np.ndarray) -> None:
        """``output_counts[slots[i], token_ids[i]] += 1`` (repeated pairs accumulate)."""
        index = (
            torch.from_numpy(slots).to(self.device),
            torch.from_numpy(token_ids).to(self.device),
        )
        ones = torch.ones(len(slots), dtype=torch.int32, device=self.device)
        self.output_counts.index_put_(index, ones, accumulate=True)

    def _grow(self) -> None:
        old = self.capacity
        new = max(4, 2 * old)
        extra = new - old
        self.prompt_mask = torch.cat(
            [self.prompt_mask, self.prompt_mask.new_zeros(extra, self.vocab_size)]
        )
        self.output_counts = torch.cat(
            [self.output_counts, self.output_counts.new_zeros(extra, self.vocab_size)]
        )
        self._free.extend(range(new - 1, old - 1, -1))  # pop() hands out low slots first
