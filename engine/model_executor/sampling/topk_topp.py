"""Truncation of the (temperature-scaled) distribution: min-p, top-k and top-p.

All three only set logits to ``-inf``; the largest logit of a row always survives, so a
row never ends up empty. Ties at a top-k / top-p boundary are kept (every token whose
logit equals the last kept one), as vLLM does for top-k.

Top-k and top-p avoid a full sort of the vocabulary where they can: a row's kept set is
a prefix of its tokens in descending order, so it suffices to find how many tokens to
keep among the ``torch.topk`` candidates and mask everything below that threshold. Top-k
needs the batch's largest k candidates; top-p needs the nucleus to fit inside
``TOP_P_CANDIDATES`` candidates (always true with a top-k, usually true otherwise).
Rows whose nucleus is wider fall back to one ascending sort.
"""

from __future__ import annotations

import torch

from engine.model_executor.sampling import row_softmax

_NEG_INF = float("-inf")
TOP_P_CANDIDATES = 256


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """Drop tokens whose probability is below ``min_p * max_prob`` of their row."""
    probs = row_softmax.softmax(logits)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    logits.masked_fill_(probs < threshold, _NEG_INF)


def apply_top_k_top_p(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    max_top_k: int | None = None,
) -> torch.Tensor:
    """Keep each row's ``top_k`` largest logits, then the top-``top_p`` nucleus of those.

    ``top_k`` holds ``vocab_size`` for rows without top-k, ``top_p`` holds 1.0 for rows
    without top-p. Top-p is measured on the distribution left after top-k (renormalized),
    the HF / vLLM convention: a token stays while the mass of the tokens strictly more
    likely than it is below ``top_p``. ``max_top_k`` is the largest enabled k (vocab_size
    when none; computed when not given). Works in place and returns ``logits``.
    """
    vocab_size = logits.shape[1]
    if top_k is None and top_p is None:
        return logits
    if max_top_k is None:
        max_top_k = _max_enabled(top_k, vocab_size)
    if top_p is None:
        if max_top_k < vocab_size:
            values = logits.topk(max_top_k, dim=-1).values
            _mask_below(logits, values, top_k.clamp(1, max_top_k), top_k >= vocab_size)
        return logits
    width = max(max_top_k if max_top_k < vocab_size else 0, TOP_P_CANDIDATES)
    if width >= vocab_size:
        return top_k_top_p_by_sort(logits, top_k, top_p)
    return _top_k_top_p_candidates(logits, top_k, top_p, width)


def _top_k_top_p_candidates(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor, width: int
) -> torch.Tensor:
    vocab_size = logits.shape[1]
    values = logits.topk(width, dim=-1).values  # descending
    if top_k is None:
        top_k = torch.full_like(top_p, vocab_size, dtype=torch.int64)
    has_k = top_k < vocab_size
    in_k = torch.arange(width, device=logits.device) < top_k.unsqueeze(1)
    candidates = values.masked_fill(~in_k, _NEG_INF)
    # Normalize over the top-k set where there is one, else over the whole row.
    norm = candidates.logsumexp(dim=-1)
    if not bool(has_k.all()):
        norm = torch.where(has_k, norm, logits.logsumexp(dim=-1))
    probs = (candidates - norm.unsqueeze(1)).exp()
    cumulative = probs.cumsum(dim=-1)
    p = top_p.unsqueeze(1)
    keep_p = ((cumulative - probs) < p) & in_k
    count = torch.where(top_p >= 1.0, top_k.clamp(max=width), keep_p.sum(dim=-1).clamp(min=1))
    untouched = ~has_k & (top_p >= 1.0)
    # Without a top-k, the nucleus may reach past the candidates: those rows are sorted.
    too_wide = ~has_k & (top_p < 1.0) & (cumulative[:, -1] < top_p)
    _mask_below(logits, values, count, untouched | too_wide)
    if bool(too_wide.any()):
        rows = too_wide.nonzero().flatten()
        logits[rows] = top_k_top_p_by_sort(logits[rows], top_k[rows], top_p[rows])
    return logits


def top_k_top_p_by_sort(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Reference path: one ascending sort serves both top-k and top-p (in place)."""
    vocab_size = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    if top_k is not None:
        kth_index = (vocab_size - top_k.clamp(1, vocab_size)).unsqueeze(1)
        kth = sorted_logits.gather(1, kth_index)
        sorted_logits.masked_fill_(sorted_logits < kth, _NEG_INF)
    if top_p is not None:
        cumulative = row_softmax.softmax(sorted_logits).cumsum(dim=-1)
        drop = cumulative <= (1.0 - top_p).unsqueeze(1)
        drop[:, -1] = False  # the most likely token always stays
        sorted_logits.masked_fill_(drop, _NEG_INF)
    return logits.scatter_(1, order, sorted_logits)


def _mask_below(
    logits: torch.Tensor, values: torch.Tensor, count: torch.Tensor, skip: torch.Tensor
) -> None:
    """Keep the ``count`` largest (``values`` is descending) of each row not in ``skip``."""
    threshold = values.gather(1, (count - 1).unsqueeze(1))
    threshold.masked_fill_(skip.unsqueeze(1), _NEG_INF)
    logits.masked_fill_(logits < threshold, _NEG_INF)


def _max_enabled(top_k: torch.Tensor | None, vocab_size: int) -> int:
    if top_k is None:
        return vocab_size
    enabled = top_k[top_k < vocab_size]
    return int(enabled.max()) if enabled.numel() else vocab_size
