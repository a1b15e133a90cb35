"""Verify speculative drafts so that the emitted tokens follow the target's distribution.

Request ``i`` brings ``k_i`` drafts ``d_1..d_k`` and ``k_i + 1`` target logits rows (one
per draft position plus the bonus position), laid out by :class:`SpecLayout`. Every row
goes through the sampler's own stages (logits processors, grammar bitmask, penalties,
temperature, min-p, top-k, top-p) with metadata built as if the drafts before it were
accepted (``SamplingState.build_spec_metadata``), giving the target distribution ``p_o``
plain sampling would use at that position. Then, vectorized over all rows:

1. greedy rows accept draft ``d_o`` iff it is ``argmax p_o`` (exact match);
2. random rows accept ``d_o`` with probability ``min(1, p_o(d_o) / q_o(d_o))``, ``q_o``
   being the draft's distribution (one-hot when the proposer is deterministic);
3. a request keeps its drafts up to the first rejection at row ``a``; there it draws its
   own token from ``norm(max(0, p_a - q_a))``, or from ``p_k`` (the bonus token) when
   every draft was accepted -- for greedy rows the argmax of that row.

This is the speculative sampling rule of Leviathan et al. / Chen et al.; each emitted
token is distributed exactly as the target's, whatever the draft. Seeded rows draw their
acceptance uniforms and their final token from keys of (seed, output position), so a
seeded request repeats itself. Logprobs are the target's raw ones at each emitted row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from engine.model_executor.sampling import row_softmax
from engine.model_executor.sampling.logprobs import LogprobsTensors, gather_logprobs
from engine.model_executor.sampling.metadata import SamplingMetadata
from engine.model_executor.sampling.sampler import (
    Categorical,
    draw_tokens,
    process_logits,
    torch_argmax,
)
from engine.model_executor.sampling.state import SpecLayout
from engine.model_executor.sampling.topk_topp import apply_min_p, apply_top_k_top_p

# Mixed into a seeded row's key for its acceptance uniform, so it does not reuse the
# stream its token draw uses.
_ACCEPT_SALT = 0x5DEECE66D


@dataclass
class RejectionOutput:
    token_ids: list[list[int]]  # per request: accepted drafts then its own token
    num_accepted: np.ndarray  # int64 [S] drafts kept per request
    emitted_rows: np.ndarray  # int64 [E] rows whose token was emitted, request by request
    logprobs: LogprobsTensors | None  # one row per emitted token; None when not asked


class RejectionSampler:
    """Stateless: per-row inputs arrive in the metadata and the layout."""

    def __init__(self, argmax: Callable[[torch.Tensor], torch.Tensor] = torch_argmax,
                 categorical: Categorical | None = None) -> None:
        self.argmax = argmax
        self.categorical = categorical  # the platform's random draw (draw_tokens)

    @torch.inference_mode()
    def __call__(
        self,
        logits: torch.Tensor,
        metadata: SamplingMetadata,
        layout: SpecLayout,
        draft_probs: torch.Tensor | None = None,
        token_bitmask: torch.Tensor | None = None,
    ) -> RejectionOutput:
        """``logits`` ``[N, V]`` (N = sum of k_i + 1); ``draft_probs`` ``[sum k_i, V]``
        (the draft's distribution per draft, request by request) or None (one-hot)."""
        logits, raw_logprobs = process_logits(logits, metadata, token_bitmask)
        device = logits.device
        draft_rows_np = _draft_rows(layout)
        drafts_np = layout.drafts[layout.drafts >= 0]
        if metadata.all_greedy:  # exact match, all on the host after one argmax
            greedy_np = self.argmax(logits).cpu().numpy()
            num_accepted = _leading_accepts(greedy_np[draft_rows_np] == drafts_np, layout)
            final = greedy_np[layout.starts + num_accepted]
        else:
            draft_rows = torch.from_numpy(draft_rows_np).to(device)
            drafts = torch.from_numpy(drafts_np).to(device)
            greedy_tokens = None if metadata.all_random else self.argmax(logits)
            probs = _target_probs(logits, metadata)
            accepted = self._accept(
                probs, greedy_tokens, metadata, draft_rows, drafts, draft_probs
            )
            num_accepted = _leading_accepts(accepted.cpu().numpy(), layout)
            final = self._final_tokens(
                probs, greedy_tokens, metadata, layout, num_accepted,
                layout.starts + num_accepted, draft_probs,
            ).cpu().numpy()
        token_ids, emitted_rows = _emitted(layout, num_accepted, final)
        logprobs = None
        if raw_logprobs is not None:
            rows = torch.from_numpy(emitted_rows).to(device)
            tokens = torch.from_numpy(np.concatenate([np.asarray(t) for t in token_ids])).to(device)
            logprobs = gather_logprobs(raw_logprobs.index_select(0, rows), tokens,
                                       metadata.max_num_logprobs)
            logprobs.num_logprobs = metadata.num_logprobs[emitted_rows]
        return RejectionOutput(token_ids, num_accepted, emitted_rows, logprobs)

    def _accept(
        self,
        probs: torch.Tensor,
        greedy_tokens: torch.Tensor | None,
        metadata: SamplingMetadata,
        draft_rows: torch.Tensor,
        drafts: torch.Tensor,
        draft_probs: torch.Tensor | None,
    ) -> torch.Tensor:
        """bool ``[sum k_i]``: whether each draft passes its own test (before the
        first-rejection cut)."""
        if not drafts.numel():
            return torch.zeros(0, dtype=torch.bool, device=drafts.device)
        greedy_ok = None
        if greedy_tokens is not None:
            greedy_ok = greedy_tokens.index_select(0, draft_rows) == drafts
        target = probs[draft_rows, drafts]
        proposal = (
            torch.ones_like(target) if draft_probs is None
            else draft_probs.gather(1, drafts.unsqueeze(1)).squeeze(1)
        )
        uniform = _uniforms(metadata, draft_rows, target.device)
        random_ok = uniform * proposal <= target
        random_ok &= target > 0  # a token the target forbids is never kept
        if greedy_ok is None:
            return random_ok
        return torch.where(metadata.greedy_mask.index_select(0, draft_rows), greedy_ok, random_ok)

    def _final_tokens(
        self,
        probs: torch.Tensor,
        greedy_tokens: torch.Tensor | None,
        metadata: SamplingMetadata,
        layout: SpecLayout,
        num_accepted: np.ndarray,
        final_rows: np.ndarray,
        draft_probs: torch.Tensor | None,
    ) -> torch.Tensor:
        """Each request's own token at its final row: the residual draw after a
        rejection, the bonus draw after full acceptance, the argmax for greedy rows."""
        device = probs.device
        rows = torch.from_numpy(final_rows).to(device)
        greedy = None if greedy_tokens is None else greedy_tokens.index_select(0, rows)
        dist = probs.index_select(0, rows)
        rejected = np.flatnonzero(num_accepted < layout.num_drafts)
        if rejected.size:
            rejected_t = torch.from_numpy(rejected).to(device)
            flat = _flat_draft_index(layout, rejected, num_accepted[rejected])
            if draft_probs is None:
                tokens = torch.from_numpy(layout.drafts[rejected, num_accepted[rejected]])
                q = torch.zeros_like(dist[rejected_t])
                q.scatter_(1, tokens.to(device).unsqueeze(1), 1.0)
            else:
                q = draft_probs.index_select(0, torch.from_numpy(flat).to(device))
            residual = (dist[rejected_t] - q).clamp_min_(0.0)
            # p == q leaves nothing: then the draft is always accepted and this row is
            # never reached, except through rounding; fall back to p itself.
            empty = residual.sum(dim=1, keepdim=True) <= 0
            dist[rejected_t] = torch.where(empty, dist[rejected_t], residual)
        generators = {
            i: metadata.generators[int(r)]
            for i, r in enumerate(final_rows.tolist())
            if int(r) in metadata.generators
        }
        drawn = draw_tokens(dist, generators, self.argmax, self.categorical)
        if greedy is None:
            return drawn
        return torch.where(metadata.greedy_mask.index_select(0, rows), greedy, drawn)


def _target_probs(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """The sampler's stages 4-7 on processed logits: temperature, min-p, top-k/p, softmax
    (greedy rows come out as their untempered distributions; only their argmax is used)."""
    if metadata.temperature is not None:
        logits.div_(metadata.temperature.unsqueeze(1))
    if metadata.min_p is not None:
        apply_min_p(logits, metadata.min_p)
    logits = apply_top_k_top_p(logits, metadata.top_k, metadata.top_p, metadata.max_top_k)
    return row_softmax.softmax(logits)


def _uniforms(metadata: SamplingMetadata, draft_rows: torch.Tensor, device: torch.device
              ) -> torch.Tensor:
    """One U[0, 1) per draft; seeded rows take theirs from the key of their position."""
    uniform = torch.rand(draft_rows.numel(), device=device)
    if metadata.generators:
        for j, row in enumerate(draft_rows.tolist()):
            generator = metadata.generators.get(row)
            if generator is not None:
                own = torch.Generator(device=device)
                own.manual_seed((generator.initial_seed() ^ _ACCEPT_SALT) & ((1 << 63) - 1))
                uniform[j] = torch.rand((), generator=own, device=device)
    return uniform


def _draft_rows(layout: SpecLayout) -> np.ndarray:
    """The row verifying each draft, request by request: ``starts[i] + o`` for o < k_i."""
    is_draft = layout.offsets < layout.num_drafts[layout.request_of]
    return np.flatnonzero(is_draft).astype(np.int64)


def _flat_draft_index(layout: SpecLayout, requests: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Index into the flat draft list of draft ``offsets[j]`` of request ``requests[j]``."""
    first = np.cumsum(layout.num_drafts) - layout.num_drafts
    return (first[requests] + offsets).astype(np.int64)


def _leading_accepts(accepted: np.ndarray, layout: SpecLayout) -> np.ndarray:
    """Per request, how many drafts pass before the first one that fails."""
    num = layout.num_drafts
    if not len(num) or not accepted.size:
        return np.zeros(len(num), dtype=np.int64)
    padded = np.zeros(layout.drafts.shape, dtype=bool)
    padded[np.arange(layout.drafts.shape[1])[None, :] < num[:, None]] = accepted
    return np.cumprod(padded, axis=1).sum(axis=1).astype(np.int64)


def _emitted(layout: SpecLayout, num_accepted: np.ndarray, final: np.ndarray
             ) -> tuple[list[list[int]], np.ndarray]:
    """Per request its accepted drafts then its own token; the rows they came from."""
    token_ids = [
        [*layout.drafts[i, :a].tolist(), int(final[i])] for i, a in enumerate(num_accepted.tolist())
    ]
    counts = num_accepted + 1
    rows = np.repeat(layout.starts, counts) + (
        np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    )
    return token_ids, rows.astype(np.int64)
