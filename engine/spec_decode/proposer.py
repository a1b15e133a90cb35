"""The proposer interface: after each step, draft the next tokens of every request.

The model runner calls ``propose(batch)`` once per step, after verification, with the
step's layout and the target's hidden states; the drafts go back to the scheduler, which
schedules them as extra tokens of the next step, where the target verifies them all in
one forward. A proposer that runs a model (draft model, EAGLE head) owns a KV cache in
the same block tables as the target (same block ids, its own tensors), so the scheduler's
blocks and prefix cache serve both; it writes up to K positions past the verified tokens,
which the scheduler reserves as lookahead slots.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from engine.model_executor.input_batch import InputBatch
    from engine.model_executor.model_runner import KVCacheSpec
    from engine.model_executor.sampling.state import SamplingState


@dataclass
class ProposalBatch:
    """One finished step, seen by a proposer (arrays in the step's batch order).

    Positions ``[starts[i], verified_ends[i])`` were computed by the target this step
    with tokens that turned out right (their hidden states are valid); a request that
    sampled now knows ``num_tokens[i]`` tokens, its newest at ``num_tokens[i] - 1``."""

    req_ids: list[str]
    rows: np.ndarray  # int64 [R] persistent rows of the input batch
    input_batch: InputBatch  # token histories and block tables
    sampling_state: SamplingState  # each request's sampling type, temperature, seed
    starts: np.ndarray  # int64 [R]
    verified_ends: np.ndarray  # int64 [R]
    num_tokens: np.ndarray  # int64 [R]
    sampled: np.ndarray  # bool [R] the request emitted tokens this step
    max_drafts: np.ndarray  # int64 [R] drafts wanted (0: none)
    hidden_starts: np.ndarray  # int64 [R] flat index of position starts[i] in target_hidden
    target_hidden: torch.Tensor  # [T, hidden] the target's output this step


@dataclass
class DraftProposal:
    """Drafts per request: ``token_ids[i, :num_drafts[i]]``. ``probs`` holds the
    distribution each draft was drawn from (flat, request by request) when the proposer
    samples; None for deterministic drafts (one-hot)."""

    token_ids: np.ndarray  # int64 [R, K] padded with -1
    num_drafts: np.ndarray  # int64 [R]
    probs: torch.Tensor | None = None  # float32 [sum num_drafts, V]

    def lists(self) -> list[list[int]]:
        return [row[:n].tolist() for row, n in zip(self.token_ids, self.num_drafts.tolist())]


class Proposer(ABC):
    """Drafts tokens for the target to verify."""

    #: Whether it writes a KV cache ahead of the verified tokens (lookahead slots).
    writes_kv_ahead: bool = False
    #: Whether it must run over every step's positions even in steps it drafts nothing
    #: for (its cache can be filled only then: an EAGLE head reads the target's hidden
    #: states of that step). False: such steps skip it altogether (a draft model catches
    #: up on the skipped positions at its next proposal).
    follows_every_step: bool = False

    def __init__(self, num_speculative_tokens: int) -> None:
        self.num_speculative_tokens = num_speculative_tokens

    @abstractmethod
    def propose(self, batch: ProposalBatch) -> DraftProposal:
        """Drafts for the requests of a finished step (none where ``max_drafts`` is 0).
        A model proposer also runs over every position the target computed, sampling or
        not, so its own KV cache stays complete."""

    def may_skip(self, req_ids: list[str]) -> bool:
        """Whether a step of these requests that drafts nothing may skip it."""
        return not self.follows_every_step

    def defer(self, req_ids: list[str], starts: "np.ndarray", ends: "np.ndarray",
              hidden_starts: "np.ndarray", target_hidden: "torch.Tensor", *,
              may_drop: bool = False) -> bool:
        """A step that drafts nothing and verified no drafts, for a proposer that follows
        every step: keep what it needs of the step (positions ``[starts[i], ends[i])``,
        their target hidden states from flat row ``hidden_starts[i]``) for a later pass
        instead of running now. ``may_drop``: drafting is settled off, so a backlog at its
        limit may lose its oldest positions instead of forcing a pass. False: nothing
        kept, :meth:`propose` runs."""
        return False

    def forget(self, req_ids: Iterable[str]) -> None:
        """Drop what it keeps about requests that finished or were preempted."""

    def kv_cache_spec(self) -> KVCacheSpec | None:
        """What its KV cache needs per block (None: it keeps none)."""
        return None

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Allocate its KV cache over the same ``num_blocks`` block ids as the target."""

    def free_kv_cache(self) -> None:
        """Drop its KV cache and anything pointing into it (sleep mode)."""

    def runtime_info(self) -> dict[str, object]:
        return {}


class NgramDraftProposer(Proposer):
    """Prompt lookup over each request's own history (engine.spec_decode.ngram)."""

    def __init__(self, num_speculative_tokens: int, min_n: int, max_n: int) -> None:
        from engine.spec_decode.ngram import NgramProposer

        super().__init__(num_speculative_tokens)
        self.ngram = NgramProposer(num_speculative_tokens, min_n, max_n)

    def propose(self, batch: ProposalBatch) -> DraftProposal:
        width = int(batch.num_tokens.max()) if len(batch.num_tokens) else 0
        history = batch.input_batch.token_ids[batch.rows, :width]
        drafts, num = self.ngram.propose_tokens(history, batch.num_tokens, batch.max_drafts)
        return DraftProposal(drafts, num)

    def runtime_info(self) -> dict[str, object]:
        return {"prompt_lookup_min": self.ngram.min_n, "prompt_lookup_max": self.ngram.max_n}
