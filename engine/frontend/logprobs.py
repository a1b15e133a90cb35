"""LogprobsLists rows (from the sampler) -> user-facing ``dict[token_id, Logprob]``."""

from __future__ import annotations

from engine.core.outputs import Logprob, PositionLogprobs
from engine.core.scheduler.output import LogprobsLists
from engine.core.tokenizer import TokenDecoder


def convert_logprobs(lists: LogprobsLists, decoder: TokenDecoder | None) -> list[PositionLogprobs]:
    """One dict per row: the chosen token first (with its true rank), then the top-k
    alternatives with ranks 1..k. A chosen token that is also in the top-k keeps its
    true rank. ``decoded_token`` is None without a decoder (``detokenize=False``).
    """
    positions: list[PositionLogprobs] = []
    for ids, lps, rank in zip(lists.token_ids, lists.logprobs, lists.ranks):
        texts = decoder.decode_tokens(ids) if decoder is not None else [None] * len(ids)
        row: PositionLogprobs = {int(ids[0]): Logprob(float(lps[0]), int(rank), texts[0])}
        for top_rank, (token_id, logprob, text) in enumerate(zip(ids[1:], lps[1:], texts[1:]), 1):
            row.setdefault(int(token_id), Logprob(float(logprob), top_rank, text))
        positions.append(row)
    return positions


def chosen_logprob_sum(lists: LogprobsLists) -> float:
    """Sum of the chosen tokens' logprobs (for ``cumulative_logprob``)."""
    return float(sum(float(lps[0]) for lps in lists.logprobs))
