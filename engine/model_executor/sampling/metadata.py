"""What the sampler needs for one step: per-row tensors gathered for the sampling rows.

Every optional field is ``None`` when no row of the batch uses the feature, so the
sampler skips that stage entirely (the fast-path flags are derived from that).
Row indices inside these tensors are *batch* indices (0..N-1, the logits' rows), not
the persistent rows of :class:`~engine.model_executor.sampling.state.SamplingState`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class TokenPairs:
    """Sparse (batch row, token id) pairs, e.g. the tokens to ban this step."""

    rows: torch.Tensor  # int64 [M]
    tokens: torch.Tensor  # int64 [M]


@dataclass
class LogitBias:
    """Sparse additive biases: ``logits[rows, tokens] += values``."""

    rows: torch.Tensor  # int64 [M]
    tokens: torch.Tensor  # int64 [M]
    values: torch.Tensor  # float32 [M]


@dataclass
class AllowedTokens:
    """Rows restricted to a token whitelist; every other token is masked.

    ``pair_index`` indexes ``rows`` (not the batch), so the mask is built on the
    restricted rows only: ``mask[pair_index, tokens] = allowed``.
    """

    rows: torch.Tensor  # int64 [A] batch rows that have a whitelist
    pair_index: torch.Tensor  # int64 [M] position in ``rows``
    tokens: torch.Tensor  # int64 [M]


@dataclass
class PenaltyTensors:
    """Repetition / frequency / presence penalties of the rows that use any.

    The token statistics live in persistent per-request slots (updated in place as
    tokens are appended); ``slots`` picks this batch's rows out of the pools.
    """

    rows: torch.Tensor | None  # int64 [P] batch rows; None = every row, in order
    slots: torch.Tensor  # int64 [P] slot of each row in the pools
    prompt_mask_pool: torch.Tensor  # bool [S, V]: token occurs in the prompt
    output_counts_pool: torch.Tensor  # int32 [S, V]: occurrences in the output
    repetition: torch.Tensor  # float32 [P]
    frequency: torch.Tensor  # float32 [P]
    presence: torch.Tensor  # float32 [P]
    # (penalty row in 0..P-1, token) pairs counted as output on top of the pools: the
    # drafts before a verification row (speculative decoding).
    extra_output_tokens: TokenPairs | None = None


@dataclass
class SamplingMetadata:
    """Per-step sampling inputs for ``num_rows`` logits rows (batch order)."""

    num_rows: int
    vocab_size: int
    all_greedy: bool
    all_random: bool
    # float32 [N]; greedy rows hold 1.0. None when every row is greedy or at 1.0.
    temperature: torch.Tensor | None
    greedy_mask: torch.Tensor | None  # bool [N]; only for batches mixing greedy and random
    top_k: torch.Tensor | None  # int64 [N]; vocab_size = disabled; None if no row uses it
    top_p: torch.Tensor | None  # float32 [N]; 1.0 = disabled
    min_p: torch.Tensor | None  # float32 [N]; 0.0 = disabled
    max_top_k: int  # largest enabled top-k in the batch (vocab_size if none)
    # Batch row -> that request's own generator, already keyed for this step's draw
    # (seeded random rows only).
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    penalties: PenaltyTensors | None = None
    allowed_token_ids: AllowedTokens | None = None
    bad_words: TokenPairs | None = None  # tokens banned this step by bad_words
    logit_bias: LogitBias | None = None
    min_tokens: TokenPairs | None = None  # stop tokens banned while output < min_tokens
    # Per batch row: logprobs asked for (-1 = none, vocab_size = whole vocab).
    num_logprobs: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    max_num_logprobs: int | None = None  # None when no row asks for logprobs

    @property
    def no_penalties(self) -> bool:
        return self.penalties is None

    @property
    def no_min_tokens(self) -> bool:
        return self.min_tokens is None

    @property
    def no_logit_bias(self) -> bool:
        return self.logit_bias is None

    @property
    def no_allowed_token_ids(self) -> bool:
        return self.allowed_token_ids is None

    @property
    def no_bad_words(self) -> bool:
        return self.bad_words is None
