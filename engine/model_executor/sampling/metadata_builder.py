"""Gathers the batch-membership-dependent part of :class:`SamplingMetadata`.

Runs only when the set or order of sampling rows (or a row's request) changed since the
previous step: dense parameters are gathered with numpy fancy indexing and shipped in a
few transfers; the sparse per-request rules of the rows that have any are concatenated.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.core.sampling_params import SamplingType
from engine.model_executor.sampling.metadata import (
    AllowedTokens,
    LogitBias,
    PenaltyTensors,
    SamplingMetadata,
)

if TYPE_CHECKING:
    from engine.model_executor.sampling.state import SamplingState

ToDevice = Callable[[np.ndarray], torch.Tensor]


@dataclass
class MultiBadWords:
    """The batch's multi-token bad words, prefixes right-aligned for one vectorized match."""

    batch_rows: np.ndarray  # int64 [M]
    state_rows: np.ndarray  # int64 [M] persistent row (to read its recent tokens)
    prefix: np.ndarray  # int64 [M, P], -1 left padding
    valid: np.ndarray  # bool [M, P], False on the padding
    last: np.ndarray  # int64 [M] the token to ban when the prefix matches


@dataclass
class StaticBatch:
    template: SamplingMetadata  # bad_words and min_tokens are filled per step
    seeded_rows: np.ndarray  # persistent rows whose generators are re-keyed per step
    min_tokens_idx: np.ndarray | None
    bad_single: tuple[np.ndarray, np.ndarray] | None  # (batch rows, tokens)
    bad_multi: MultiBadWords | None


def build_static(state: SamplingState, rows: np.ndarray) -> StaticBatch:
    vocab_size = state.vocab_size

    def to_device(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(state.device)

    stype = state.sampling_type[rows]
    greedy = stype == int(SamplingType.GREEDY)
    all_greedy = bool(greedy.all())
    all_random = not bool(greedy.any())
    floats = np.stack([state.temperature[rows], state.top_p[rows], state.min_p[rows]])
    used = [bool((floats[0] != 1.0).any()), bool((floats[1] < 1.0).any()),
            bool((floats[2] > 0.0).any())]
    temperature = top_p = min_p = top_k = None
    max_top_k = vocab_size
    if not all_greedy:
        if any(used):
            float_tensor = to_device(floats)
            temperature, top_p, min_p = (
                float_tensor[i] if used[i] else None for i in range(3)
            )
        k = state.top_k[rows]
        enabled = k < vocab_size
        if enabled.any():
            top_k = to_device(k)
            max_top_k = int(k[enabled].max())
    seeded = np.flatnonzero(stype == int(SamplingType.RANDOM_SEED))
    generators = {int(i): state.generators[int(rows[i])] for i in seeded}
    num_logprobs = state.num_logprobs[rows].copy()
    asks = num_logprobs >= 0
    rules = _gather_rules(state, rows)
    template = SamplingMetadata(
        num_rows=len(rows),
        vocab_size=vocab_size,
        all_greedy=all_greedy,
        all_random=all_random,
        temperature=temperature,
        greedy_mask=None if all_greedy or all_random else to_device(greedy),
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        max_top_k=max_top_k,
        generators=generators,
        penalties=_penalties(state, rows, to_device),
        allowed_token_ids=rules.allowed(to_device),
        logit_bias=rules.bias(to_device),
        num_logprobs=num_logprobs,
        max_num_logprobs=int(num_logprobs[asks].max()) if asks.any() else None,
    )
    min_tokens_idx = np.flatnonzero(state.min_tokens[rows] > 0)
    return StaticBatch(
        template=template,
        seeded_rows=rows[seeded],
        min_tokens_idx=min_tokens_idx if min_tokens_idx.size else None,
        bad_single=rules.bad_single(),
        bad_multi=rules.bad_multi(),
    )


def _penalties(
    state: SamplingState, rows: np.ndarray, to_device: ToDevice
) -> PenaltyTensors | None:
    slots = state.penalty_slot[rows]
    idx = np.flatnonzero(slots >= 0)
    if not idx.size:
        return None
    state_rows = rows[idx]
    params = to_device(
        np.stack([state.repetition[state_rows], state.frequency[state_rows],
                  state.presence[state_rows]])
    )
    return PenaltyTensors(
        rows=None if idx.size == len(rows) else to_device(idx),
        slots=to_device(slots[idx]),
        prompt_mask_pool=state.token_counts.prompt_mask,
        output_counts_pool=state.token_counts.output_counts,
        repetition=params[0],
        frequency=params[1],
        presence=params[2],
    )


class _RulesGather:
    """Concatenates the sparse rules of the batch rows that have any."""

    def __init__(self) -> None:
        self.allowed_rows: list[int] = []
        self.allowed_tokens: list[np.ndarray] = []
        self.bias_rows: list[np.ndarray] = []
        self.bias_tokens: list[np.ndarray] = []
        self.bias_values: list[np.ndarray] = []
        self.single_rows: list[np.ndarray] = []
        self.single_tokens: list[np.ndarray] = []
        self.multi: list[tuple[int, int, np.ndarray, int]] = []  # batch, state row, prefix, last

    def allowed(self, to_device: ToDevice) -> AllowedTokens | None:
        if not self.allowed_rows:
            return None
        lengths = [len(t) for t in self.allowed_tokens]
        pair_index = np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)
        return AllowedTokens(
            rows=to_device(np.asarray(self.allowed_rows, dtype=np.int64)),
            pair_index=to_device(pair_index),
            tokens=to_device(np.concatenate(self.allowed_tokens)),
        )

    def bias(self, to_device: ToDevice) -> LogitBias | None:
        if not self.bias_rows:
            return None
        return LogitBias(
            rows=to_device(np.concatenate(self.bias_rows)),
            tokens=to_device(np.concatenate(self.bias_tokens)),
            values=to_device(np.concatenate(self.bias_values)),
        )

    def bad_single(self) -> tuple[np.ndarray, np.ndarray] | None:
        if not self.single_rows:
            return None
        return np.concatenate(self.single_rows), np.concatenate(self.single_tokens)

    def bad_multi(self) -> MultiBadWords | None:
        if not self.multi:
            return None
        width = max(len(prefix) for _, _, prefix, _ in self.multi)
        prefix = np.full((len(self.multi), width), -1, dtype=np.int64)
        valid = np.zeros((len(self.multi), width), dtype=bool)
        for j, (_, _, ids, _) in enumerate(self.multi):
            prefix[j, width - len(ids) :] = ids
            valid[j, width - len(ids) :] = True
        batch_rows, state_rows, _, last = zip(*self.multi)
        return MultiBadWords(
            batch_rows=np.asarray(batch_rows, dtype=np.int64),
            state_rows=np.asarray(state_rows, dtype=np.int64),
            prefix=prefix,
            valid=valid,
            last=np.asarray(last, dtype=np.int64),
        )


def _gather_rules(state: SamplingState, rows: np.ndarray) -> _RulesGather:
    out = _RulesGather()
    for i in np.flatnonzero(state.has_rules[rows]).tolist():
        row = int(rows[i])
        rules = state.rules[row]
        assert rules is not None
        if rules.allowed_token_ids is not None:
            out.allowed_rows.append(i)
            out.allowed_tokens.append(rules.allowed_token_ids)
        if rules.bias_token_ids is not None:
            out.bias_rows.append(np.full(len(rules.bias_token_ids), i, dtype=np.int64))
            out.bias_tokens.append(rules.bias_token_ids)
            out.bias_values.append(rules.bias_values)
        if rules.bad_single is not None:
            out.single_rows.append(np.full(len(rules.bad_single), i, dtype=np.int64))
            out.single_tokens.append(rules.bad_single)
        for prefix, last in rules.bad_multi or ():
            out.multi.append((i, row, prefix, last))
    return out
