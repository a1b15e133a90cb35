"""Repetition, frequency and presence penalties, vectorized over rows and vocabulary.

Formulas (per row, per token ``t``):

* repetition (HF / vLLM, over prompt + output tokens): if ``t`` occurred,
  ``logit > 0 ? logit / r : logit * r`` -- so ``r > 1`` always makes ``t`` less likely;
* frequency and presence (OpenAI, over output tokens only):
  ``logit -= frequency * count[t] + presence * (count[t] > 0)``.
"""

from __future__ import annotations

import torch

from engine.model_executor.sampling.metadata import PenaltyTensors


def apply_penalties(
    logits: torch.Tensor,
    prompt_mask: torch.Tensor,
    output_counts: torch.Tensor,
    repetition: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> torch.Tensor:
    """Penalized copy of ``logits`` ``[P, V]`` given per-row token statistics."""
    occurred = output_counts > 0
    rep = repetition.unsqueeze(1)
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(prompt_mask | occurred, penalized, logits)
    counts = output_counts.to(logits.dtype)
    return logits - (frequency.unsqueeze(1) * counts + presence.unsqueeze(1) * occurred)


def apply_batch_penalties(logits: torch.Tensor, penalties: PenaltyTensors) -> None:
    """Apply penalties in place to the rows of ``logits`` that use them."""
    prompt_mask = penalties.prompt_mask_pool.index_select(0, penalties.slots)
    output_counts = penalties.output_counts_pool.index_select(0, penalties.slots)
    extra = penalties.extra_output_tokens
    if extra is not None:
        ones = torch.ones(extra.rows.numel(), dtype=output_counts.dtype, device=logits.device)
        output_counts.index_put_((extra.rows, extra.tokens), ones, accumulate=True)
    if penalties.rows is None:
        logits.copy_(
            apply_penalties(
                logits, prompt_mask, output_counts,
                penalties.repetition, penalties.frequency, penalties.presence,
            )
        )
        return
    logits[penalties.rows] = apply_penalties(
        logits[penalties.rows], prompt_mask, output_counts,
        penalties.repetition, penalties.frequency, penalties.presence,
    )
