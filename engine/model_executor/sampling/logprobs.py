"""Logprobs of sampled and prompt tokens: the chosen token, its rank, and the top-k.

Logprobs describe the model's raw distribution (``log_softmax`` of the unmodified
logits), vLLM V1's default and what the OpenAI API reports: penalties, bans and
temperature change which token is picked, not the reported probabilities.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.core.scheduler.output import LogprobsLists
from engine.model_executor.sampling import row_softmax


@dataclass
class LogprobsTensors:
    """Row ``i``: column 0 is the chosen token, columns 1..K the top-K, descending."""

    token_ids: torch.Tensor  # int64 [N, K + 1]
    logprobs: torch.Tensor  # float32 [N, K + 1]
    ranks: torch.Tensor  # int64 [N], rank of the chosen token (1 = most likely)
    # Per row: how many alternatives it asked for (rows keep 1 + that many columns).
    num_logprobs: np.ndarray | None = None

    def tolists(self) -> BatchLogprobsLists:
        """One transfer to host for the whole batch; ``select(i)`` slices one row."""
        width = self.token_ids.shape[1] - 1
        per_row = (
            [width] * self.token_ids.shape[0]
            if self.num_logprobs is None
            else np.clip(self.num_logprobs, 0, width).tolist()
        )
        return BatchLogprobsLists(
            token_ids=self.token_ids.tolist(),
            logprobs=self.logprobs.tolist(),
            ranks=self.ranks.tolist(),
            num_logprobs=per_row,
        )


@dataclass
class BatchLogprobsLists:
    """Host copy of a batch's :class:`LogprobsTensors`, one row per sampling row."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]
    num_logprobs: list[int]

    def __len__(self) -> int:
        return len(self.ranks)

    def select_rows(self, start: int, count: int) -> LogprobsLists:
        """Rows ``start .. start + count - 1`` (one request's emitted tokens), each cut
        to its own k."""
        keep = [1 + n for n in self.num_logprobs[start : start + count]]
        span = range(start, start + count)
        return LogprobsLists(
            token_ids=[self.token_ids[i][:k] for i, k in zip(span, keep)],
            logprobs=[self.logprobs[i][:k] for i, k in zip(span, keep)],
            ranks=self.ranks[start : start + count],
        )

    def select(self, i: int) -> LogprobsLists:
        """Row ``i`` as a one-token :class:`LogprobsLists`, cut to that row's own k."""
        keep = 1 + self.num_logprobs[i]
        return LogprobsLists(
            token_ids=[self.token_ids[i][:keep]],
            logprobs=[self.logprobs[i][:keep]],
            ranks=[self.ranks[i]],
        )


def gather_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int
) -> LogprobsTensors:
    """The chosen tokens' logprobs and ranks plus the ``num_logprobs`` best of each row."""
    chosen_ids = token_ids.to(torch.int64).unsqueeze(1)
    chosen = logprobs.gather(1, chosen_ids)
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    if num_logprobs > 0:
        top_logprobs, top_ids = logprobs.topk(num_logprobs, dim=-1)
        chosen_ids = torch.cat([chosen_ids, top_ids], dim=1)
        chosen = torch.cat([chosen, top_logprobs], dim=1)
    return LogprobsTensors(token_ids=chosen_ids, logprobs=chosen, ranks=ranks)


def resolve_num_logprobs(num_logprobs: int, vocab_size: int, name: str = "logprobs") -> int:
    """User value -> alternatives to report: -1 means the whole vocabulary."""
    if num_logprobs == -1:
        return vocab_size
    if num_logprobs < 0:
        raise ValueError(f"{name} must be -1 (whole vocabulary) or >= 0, got {num_logprobs}")
    return min(num_logprobs, vocab_size)


def compute_prompt_logprobs(
    logits: torch.Tensor, next_token_ids: torch.Tensor, num_logprobs: int
) -> LogprobsLists:
    """Logprobs of the actual next prompt tokens given ``logits`` ``[P, V]`` of positions.

    Row ``i`` describes position ``i`` predicting ``next_token_ids[i]``; ``num_logprobs``
    follows ``SamplingParams.prompt_logprobs`` (-1 = whole vocabulary).
    """
    if logits.dim() != 2 or next_token_ids.shape != (logits.shape[0],):
        raise ValueError(
            f"prompt logprobs need logits [P, V] and next_token_ids [P]; got "
            f"{list(logits.shape)} and {list(next_token_ids.shape)}"
        )
    vocab_size = logits.shape[1]
    k = resolve_num_logprobs(num_logprobs, vocab_size, "prompt_logprobs")
    ids = next_token_ids.to(device=logits.device, dtype=torch.int64)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(f"prompt token ids must be in [0, {vocab_size})")
    raw = row_softmax.log_softmax(logits)
    tensors = gather_logprobs(raw, ids, k)
    return LogprobsLists(
        token_ids=tensors.token_ids.tolist(),
        logprobs=tensors.logprobs.tolist(),
        ranks=tensors.ranks.tolist(),
    )
