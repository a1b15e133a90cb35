"""N-gram (prompt lookup) draft proposer, vLLM's ``method: "ngram"``, in bulk numpy.

For each row the proposer takes the longest ``n`` in ``[min_n, max_n]`` whose last-``n``-token
suffix occurred earlier in the history, picks the most recent such occurrence that the
history continues for as many tokens as the row may draft (else the most recent one), and
proposes the tokens that followed it. In text that loops (a list, a repeated line, a model
stuck on a phrase) the most recent occurrence is one period back and is followed by only
a period's tokens before the history ends; one period earlier it is followed by a full
draft, and the loop's continuation is the same. It needs no model, so it runs on the CPU
inside the step loop for hundreds of rows with histories of tens of thousands of tokens;
everything is therefore done on whole ``[rows, positions]`` arrays, looping only over ``n``.

The search works in *end-position* coordinates: ``match[r, e]`` says the ``n`` tokens ending
at ``e`` equal row ``r``'s suffix of length ``n``. Going from ``n - 1`` to ``n`` only adds one
comparison (the token ``n - 1`` before ``e`` against the token ``n`` before the end), so all
lengths cost one pass each over a single boolean array, instead of materialising every
window (``R * L * n`` booleans). Matches only shrink as ``n`` grows, so a row whose match
set becomes empty is finished: its answer is the last match at the previous ``n``.
"""

from __future__ import annotations

import numpy as np

# Cells (rows x positions) handled at once; bounds the boolean work arrays (~3 bytes a
# cell) and keeps them cache-sized. A chunk is never smaller than one row.
_CHUNK_CELLS = 1 << 21


class NgramProposer:
    """Prompt-lookup drafts: continue the history the way it continued last time."""

    def __init__(self, num_speculative_tokens: int, min_n: int, max_n: int) -> None:
        if num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {num_speculative_tokens}")
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.num_speculative_tokens = num_speculative_tokens
        self.min_n = min_n
        self.max_n = max_n

    def propose_tokens(
        self, token_ids: np.ndarray, num_tokens: np.ndarray, max_drafts: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Drafts for every row of a padded batch of token histories.

        token_ids: int64 [R, L] histories; row r's known tokens are
            ``token_ids[r, :num_tokens[r]]``, the rest is scratch and ignored.
        num_tokens: int64 [R] history lengths.
        max_drafts: int64 [R] cap on row r's drafts (0 = none; at most K).
        Returns (drafts int64 [R, K] padded with -1, num_drafts int64 [R]).
        """
        token_ids = np.asarray(token_ids)
        if token_ids.ndim != 2:
            raise ValueError(f"token_ids must be 2-D [R, L], got shape {token_ids.shape}")
        num_rows, width = token_ids.shape
        k = self.num_speculative_tokens
        lengths = np.clip(np.asarray(num_tokens, dtype=np.int64), 0, width)
        caps = np.clip(np.asarray(max_drafts, dtype=np.int64), 0, k)

        ends = np.full(num_rows, -1, dtype=np.int64)
        # Only rows that want drafts and are long enough for the shortest n can match.
        wanted = (caps > 0) & (lengths > self.min_n)
        if k > 0 and wanted.any():
            for lo, hi in _row_chunks(lengths, wanted):
                sel = np.flatnonzero(wanted[lo:hi]) + lo
                if len(sel) == 0:
                    continue
                span = int(lengths[sel].max())
                # A plain slice is a view; fancy indexing copies, so only use it when needed.
                rows = slice(lo, hi) if len(sel) == hi - lo else sel
                ends[sel] = self._match_ends(token_ids[rows, :span], lengths[sel], caps[sel])
        return _gather_drafts(token_ids, lengths, caps, ends, k)

    def _match_ends(self, tokens: np.ndarray, lengths: np.ndarray, wants: np.ndarray
                    ) -> np.ndarray:
        """End position of each row's chosen earlier occurrence, -1 where none.

        ``tokens`` is [C, S] with every length <= S; ``wants``: the drafts each row may
        take. Rows are dropped from the work arrays once they stop matching (compacted
        when at least half are gone) so that long runs of ``n`` only cost what the
        still-matching rows need.
        """
        result = np.full(len(lengths), -1, dtype=np.int64)
        rows = np.arange(len(lengths))  # result index of each working row
        # n = 0: every end position strictly before the final token is a candidate, so the
        # suffix itself (which ends at the final token) never counts as an occurrence.
        match = np.arange(tokens.shape[1]) < (lengths - 1)[:, None]
        alive = np.ones(len(lengths), dtype=bool)
        for n in range(1, self.max_n + 1):
            nxt = _extend_matches(tokens, lengths, match, n)
            still = nxt.any(axis=1)
            if n - 1 >= self.min_n:
                done = alive & ~still
                if done.any():
                    result[rows[done]] = _chosen_end(match[done], lengths[done], wants[done])
            alive &= still
            match = nxt
            if not alive.any():
                return result
            if 2 * int(alive.sum()) <= len(alive):
                tokens, lengths, wants = tokens[alive], lengths[alive], wants[alive]
                match, rows = match[alive], rows[alive]
                alive = np.ones(len(rows), dtype=bool)
        result[rows[alive]] = _chosen_end(match[alive], lengths[alive], wants[alive])
        return result


def _extend_matches(
    tokens: np.ndarray, lengths: np.ndarray, match: np.ndarray, n: int
) -> np.ndarray:
    """Matches of the length-``n`` suffix, from those of the length-``n - 1`` suffix.

    An occurrence ending at ``e`` extends iff ``tokens[e - n + 1]`` equals the token ``n``
    before the end; ends before ``n - 1`` have no room for ``n`` tokens. Rows shorter than
    ``n`` read a clamped (meaningless) suffix token, but their candidate ends are already
    empty because the n = 0 mask stops at ``length - 2``.
    """
    num_rows, span = tokens.shape
    out = np.zeros_like(match)
    if n > span:
        return out
    suffix_tok = tokens[np.arange(num_rows), np.maximum(lengths - n, 0)]
    tail = out[:, n - 1 :]
    np.equal(tokens[:, : span - n + 1], suffix_tok[:, None], out=tail)
    np.logical_and(tail, match[:, n - 1 :], out=tail)
    return out


def _last_true(mask: np.ndarray) -> np.ndarray:
    """Index of the last True in each row (rows must hold at least one): most recent match."""
    return mask.shape[1] - 1 - np.argmax(mask[:, ::-1], axis=1)


def _chosen_end(mask: np.ndarray, lengths: np.ndarray, wants: np.ndarray) -> np.ndarray:
    """Per row (each holds a match): the last match end that ``wants`` history tokens
    follow, else the last match end."""
    room = np.arange(mask.shape[1]) <= (lengths - 1 - wants)[:, None]
    full = mask & room
    return np.where(full.any(axis=1), _last_true(full), _last_true(mask))


def _row_chunks(lengths: np.ndarray, wanted: np.ndarray) -> list[tuple[int, int]]:
    """Contiguous row ranges whose wanted rows fit ``_CHUNK_CELLS`` at the longest history."""
    span = max(int(lengths[wanted].max()), 1)
    step = max(1, _CHUNK_CELLS // span)
    return [(lo, min(lo + step, len(lengths))) for lo in range(0, len(lengths), step)]


def _gather_drafts(
    token_ids: np.ndarray, lengths: np.ndarray, caps: np.ndarray, ends: np.ndarray, k: int
) -> tuple[np.ndarray, np.ndarray]:
    """The up-to-``k`` tokens after each match end, cut by the history end and the row's cap."""
    num_rows, width = token_ids.shape
    if width == 0 or k == 0:
        return np.full((num_rows, k), -1, dtype=np.int64), np.zeros(num_rows, dtype=np.int64)
    start = ends + 1
    num = np.where(ends >= 0, np.minimum(np.minimum(lengths - start, caps), k), 0)
    num = np.maximum(num, 0).astype(np.int64)
    offsets = np.arange(k)
    keep = offsets[None, :] < num[:, None]
    idx = np.clip(start[:, None] + offsets[None, :], 0, width - 1)
    picked = np.take_along_axis(token_ids, idx, axis=1).astype(np.int64, copy=False)
    drafts = np.where(keep, picked, np.int64(-1))
    return drafts, num
