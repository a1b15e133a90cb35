"""Persistent per-row sampling state of the model runner's batch.

Rows mirror the runner's persistent batch: a request is added to a free row, may be
moved to another row when the batch is compacted, and is removed when it finishes or
is preempted. Dense parameters (temperature, top-k, ...) live in numpy arrays indexed by
row, so a step gathers them for its sampling rows with a few vectorized operations.
The parts of the metadata that only depend on which request sits in which row are
cached and reused while the batch is unchanged (the steady decode case); only the
step-dependent parts (min_tokens still in force, multi-token bad words whose prefix
just matched) are recomputed, also in bulk. Penalty statistics live on the device in
:class:`TokenCountsPool` and are updated in place by :meth:`append_tokens`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from engine.core.sampling_params import SamplingParams, SamplingType
from engine.model_executor.sampling.logprobs import resolve_num_logprobs
from engine.model_executor.sampling.metadata import SamplingMetadata, TokenPairs
from engine.model_executor.sampling.metadata_builder import MultiBadWords, build_static
from engine.model_executor.sampling.request_rules import RequestRules, check_token_ids, parse_rules
from engine.model_executor.sampling.token_counts import TokenCountsPool

# Dense per-row arrays and the value a free row holds.
_ROW_DEFAULTS: dict[str, tuple[type, float | int]] = {
    "sampling_type": (np.int8, int(SamplingType.GREEDY)),
    "temperature": (np.float32, 1.0),
    "top_p": (np.float32, 1.0),
    "min_p": (np.float32, 0.0),
    "repetition": (np.float32, 1.0),
    "frequency": (np.float32, 0.0),
    "presence": (np.float32, 0.0),
    "penalty_slot": (np.int64, -1),
    "min_tokens": (np.int64, 0),
    "num_output_tokens": (np.int64, 0),
    "num_logprobs": (np.int64, -1),
    "has_rules": (np.bool_, False),  # rules[row] is set (whitelist, bias, bad words)
    "seed": (np.uint64, 0),  # seeded random rows only, as an unsigned 64-bit value
}
_MASK64 = (1 << 64) - 1


@dataclass
class _BatchCache:
    key: tuple[int, bytes]
    template: SamplingMetadata  # everything but the step-dependent fields
    seeded_rows: np.ndarray  # persistent rows of the batch's seeded random requests
    min_tokens_idx: np.ndarray | None  # batch rows whose request has min_tokens > 0
    bad_single: tuple[np.ndarray, np.ndarray] | None  # (batch rows, tokens)
    bad_single_pairs: TokenPairs | None
    bad_multi: MultiBadWords | None


class SamplingState:
    """Sampling parameters and token statistics of up to ``max_num_reqs`` rows."""

    # Dense per-row arrays (created from _ROW_DEFAULTS, plus top_k and active).
    sampling_type: np.ndarray
    temperature: np.ndarray
    top_p: np.ndarray
    min_p: np.ndarray
    repetition: np.ndarray
    frequency: np.ndarray
    presence: np.ndarray
    penalty_slot: np.ndarray
    min_tokens: np.ndarray
    num_output_tokens: np.ndarray
    num_logprobs: np.ndarray
    has_rules: np.ndarray
    seed: np.ndarray

    def __init__(self, max_num_reqs: int, vocab_size: int, device: torch.device) -> None:
        if max_num_reqs <= 0 or vocab_size <= 0:
            raise ValueError(
                f"max_num_reqs and vocab_size must be positive, got {max_num_reqs}, {vocab_size}"
            )
        self.max_num_reqs = max_num_reqs
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.active = np.zeros(max_num_reqs, dtype=bool)
        for name, (dtype, default) in _ROW_DEFAULTS.items():
            setattr(self, name, np.full(max_num_reqs, default, dtype=dtype))
        self.top_k = np.full(max_num_reqs, vocab_size, dtype=np.int64)  # vocab = disabled
        # Stop ids banned while output < min_tokens, padded with -1 (grows in width).
        self.min_tokens_stop_ids = np.full((max_num_reqs, 0), -1, dtype=np.int64)
        # Last W known tokens per row, right-aligned, -1 = unknown; W = longest
        # multi-token bad-word prefix seen so far (0: not maintained at all).
        self.recent_tokens = np.full((max_num_reqs, 0), -1, dtype=np.int64)
        self.generators: list[torch.Generator | None] = [None] * max_num_reqs
        self.rules: list[RequestRules | None] = [None] * max_num_reqs
        self.token_counts = TokenCountsPool(vocab_size, self.device)
        self._version = 0  # bumped whenever a row's request changes
        self._cache: _BatchCache | None = None

    # -- request lifecycle -----------------------------------------------------------------
    def add_request(
        self,
        row: int,
        params: SamplingParams,
        prompt_token_ids: Sequence[int],
        output_token_ids: Sequence[int],
        eos_token_id: int | None = None,
    ) -> None:
        """Seat a request in free ``row``; ``output_token_ids`` non-empty on resume."""
        self._check_row(row)
        if self.active[row]:
            raise ValueError(f"row {row} already holds a request; remove or move it first")
        prompt = np.asarray(prompt_token_ids, dtype=np.int64).reshape(-1)
        output = np.asarray(output_token_ids, dtype=np.int64).reshape(-1)
        check_token_ids(prompt, self.vocab_size, "prompt_token_ids")
        check_token_ids(output, self.vocab_size, "output_token_ids")
        rules = parse_rules(params, self.vocab_size)
        stop_ids = self._min_tokens_stop_ids(params, eos_token_id)
        num_logprobs = -1
        if params.logprobs is not None:
            num_logprobs = resolve_num_logprobs(params.logprobs, self.vocab_size)

        self._set_distribution(row, params)
        self.min_tokens[row] = params.min_tokens
        self.num_output_tokens[row] = len(output)
        self.num_logprobs[row] = num_logprobs
        self._set_min_tokens_stop_ids(row, stop_ids)
        if params.repetition_penalty != 1.0 or params.frequency_penalty or params.presence_penalty:
            self.repetition[row] = params.repetition_penalty
            self.frequency[row] = params.frequency_penalty
            self.presence[row] = params.presence_penalty
            self.penalty_slot[row] = self.token_counts.allocate(prompt, output)
        if params.sampling_type == SamplingType.RANDOM_SEED:
            self.seed[row] = params.seed & _MASK64
            self.generators[row] = torch.Generator(device=self.device)
        self.rules[row] = rules
        self.has_rules[row] = rules is not None
        if rules is not None and rules.max_bad_prefix > self.recent_tokens.shape[1]:
            self._widen_recent_tokens(rules.max_bad_prefix)
        self._set_recent_tokens(row, prompt, output)
        self.active[row] = True
        self._version += 1

    def remove_request(self, row: int) -> None:
        self._check_active(row)
        if self.penalty_slot[row] >= 0:
            self.token_counts.free(int(self.penalty_slot[row]))
        self._reset_row(row)
        self._version += 1

    def move_row(self, src: int, dst: int) -> None:
        """Move the request in ``src`` to free row ``dst`` (batch compaction)."""
        self._check_active(src)
        self._check_row(dst)
        if self.active[dst]:
            raise ValueError(f"cannot move row {src} to row {dst}: row {dst} is occupied")
        for name in (*_ROW_DEFAULTS, "top_k", "active"):
            array = getattr(self, name)
            array[dst] = array[src]
        self.min_tokens_stop_ids[dst] = self.min_tokens_stop_ids[src]
        self.recent_tokens[dst] = self.recent_tokens[src]
        self.generators[dst] = self.generators[src]
        self.rules[dst] = self.rules[src]
        self._reset_row(src)
        self._version += 1

    def wants_logprobs(self, row: int) -> bool:
        return bool(self.num_logprobs[row] >= 0)

    @property
    def num_requests(self) -> int:
        return int(self.active.sum())

    # -- per step ---------------------------------------------------------------------------
    def append_tokens(self, rows: np.ndarray, token_ids: np.ndarray) -> None:
        """Record one new output token per row (bulk)."""
        rows = self._checked_rows(rows, "append_tokens")
        tokens = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        if tokens.shape != rows.shape:
            raise ValueError(f"append_tokens: {len(rows)} rows but {tokens.size} token ids")
        check_token_ids(tokens, self.vocab_size, "appended token ids")
        self.num_output_tokens[rows] += 1
        if self.recent_tokens.shape[1]:
            self.recent_tokens[rows, :-1] = self.recent_tokens[rows, 1:]
            self.recent_tokens[rows, -1] = tokens
        self._count_tokens(rows, tokens)

    def append_token_lists(self, rows: np.ndarray, token_ids: Sequence[Sequence[int]]) -> None:
        """Record several new output tokens per row (e.g. accepted speculative tokens)."""
        rows = self._checked_rows(rows, "append_token_lists")
        if len(token_ids) != len(rows):
            raise ValueError(f"append_token_lists: {len(rows)} rows but {len(token_ids)} lists")
        lengths = np.fromiter(map(len, token_ids), dtype=np.int64, count=len(rows))
        flat = np.fromiter(chain.from_iterable(token_ids), dtype=np.int64, count=int(lengths.sum()))
        check_token_ids(flat, self.vocab_size, "appended token ids")
        self.num_output_tokens[rows] += lengths
        width = self.recent_tokens.shape[1]
        if width:
            for row, tokens in zip(rows.tolist(), token_ids):
                if tokens:
                    merged = np.concatenate([self.recent_tokens[row], np.asarray(tokens)])
                    self.recent_tokens[row] = merged[-width:]
        self._count_tokens(np.repeat(rows, lengths), flat)

    def build_metadata(self, rows: np.ndarray) -> SamplingMetadata:
        """Sampling inputs for ``rows`` (persistent rows, in the logits' batch order)."""
        rows = np.asarray(rows)
        if rows.dtype.kind not in "iu":
            raise ValueError(f"build_metadata: rows must be integers, got dtype {rows.dtype}")
        rows = rows.astype(np.int64, copy=False)
        key = (self._version, rows.tobytes())
        cache = self._cache
        if cache is None or cache.key != key:
            rows = self._checked_rows(rows, "build_metadata")
            cache = self._cache = self._build_cache(key, rows)
        for row in cache.seeded_rows.tolist():
            self.generators[row].manual_seed(
                draw_seed(int(self.seed[row]), int(self.num_output_tokens[row]))
            )
        return dataclasses.replace(
            cache.template,
            bad_words=self._bad_words(cache, self._recent_of(cache)),
            min_tokens=self._min_tokens(cache, rows, self.num_output_tokens[rows]),
        )

    def build_spec_metadata(
        self,
        rows: np.ndarray,
        num_drafts: np.ndarray,
        draft_token_ids: np.ndarray,
        layout: SpecLayout | None = None,
    ) -> SamplingMetadata:
        """Sampling inputs for verifying drafts: ``num_drafts[i] + 1`` logits rows per
        request ``rows[i]``, row ``o`` of a request scoring its output position
        ``num_output_tokens + o`` as if its first ``o`` drafts had been accepted.

        Everything that depends on the output so far follows that assumption, so each
        row's distribution is exactly the one plain sampling would see at that position:
        penalties count the earlier drafts, min_tokens counts them, multi-token bad words
        match across them, and seeded rows draw from the key of their own position.
        ``draft_token_ids`` holds the drafts flat, request by request."""
        rows = self._checked_rows(rows, "build_spec_metadata")
        num_drafts = np.asarray(num_drafts, dtype=np.int64).reshape(-1)
        drafts = np.asarray(draft_token_ids, dtype=np.int64).reshape(-1)
        if num_drafts.shape != rows.shape or int(num_drafts.sum()) != drafts.size:
            raise ValueError(
                f"build_spec_metadata: {len(rows)} rows, {num_drafts.tolist()} drafts, "
                f"{drafts.size} draft ids"
            )
        check_token_ids(drafts, self.vocab_size, "draft token ids")
        layout = layout or SpecLayout.of(num_drafts, drafts)
        expanded = np.repeat(rows, num_drafts + 1)
        cache = self._build_cache((-1, b""), expanded)
        num_output = self.num_output_tokens[expanded] + layout.offsets
        template = cache.template
        generators = {}
        for i in np.flatnonzero(self.sampling_type[expanded] == int(SamplingType.RANDOM_SEED)):
            generator = torch.Generator(device=self.device)
            generator.manual_seed(draw_seed(int(self.seed[expanded[i]]), int(num_output[i])))
            generators[int(i)] = generator
        penalties = template.penalties
        if penalties is not None and drafts.size:
            penalties = dataclasses.replace(
                penalties, extra_output_tokens=self._draft_counts(expanded, layout)
            )
        recent = self._recent_of(cache)
        if recent is not None:
            recent = layout.extend_history(recent, cache.bad_multi.batch_rows, recent.shape[1])
        return dataclasses.replace(
            template,
            generators=generators,
            penalties=penalties,
            bad_words=self._bad_words(cache, recent),
            min_tokens=self._min_tokens(cache, expanded, num_output),
        )

    def _draft_counts(self, expanded: np.ndarray, layout: SpecLayout) -> TokenPairs | None:
        """(penalty row, token) for every draft that precedes a penalized row."""
        penalized = np.flatnonzero(self.penalty_slot[expanded] >= 0)
        position = np.full(len(expanded), -1, dtype=np.int64)
        position[penalized] = np.arange(len(penalized))
        batch_rows, tokens = layout.preceding_drafts()
        keep = position[batch_rows] >= 0
        if not keep.any():
            return None
        return TokenPairs(
            self._to_device(position[batch_rows[keep]]), self._to_device(tokens[keep])
        )

    # -- metadata pieces --------------------------------------------------------------------
    def _build_cache(self, key: tuple[int, bytes], rows: np.ndarray) -> _BatchCache:
        static = build_static(self, rows)
        bad_single_pairs = None
        if static.bad_single is not None:
            bad_single_pairs = TokenPairs(*(self._to_device(a) for a in static.bad_single))
        return _BatchCache(
            key=key,
            template=static.template,
            seeded_rows=static.seeded_rows,
            min_tokens_idx=static.min_tokens_idx,
            bad_single=static.bad_single,
            bad_single_pairs=bad_single_pairs,
            bad_multi=static.bad_multi,
        )

    def _recent_of(self, cache: _BatchCache) -> np.ndarray | None:
        """The recent tokens of each multi-token bad word's row ``[M, W]``."""
        multi = cache.bad_multi
        return None if multi is None else self.recent_tokens[multi.state_rows]

    def _bad_words(self, cache: _BatchCache, recent: np.ndarray | None) -> TokenPairs | None:
        """Banned tokens: single-token words, plus the last token of each multi-token
        word whose prefix ends ``recent`` (one history row per multi-token word)."""
        multi = cache.bad_multi
        if multi is None or recent is None:
            return cache.bad_single_pairs
        width = multi.prefix.shape[1]
        recent = recent[:, recent.shape[1] - width :]
        hit = ((recent == multi.prefix) | ~multi.valid).all(axis=1)
        if not hit.any():
            return cache.bad_single_pairs
        batch_rows, tokens = multi.batch_rows[hit], multi.last[hit]
        if cache.bad_single is not None:
            batch_rows = np.concatenate([cache.bad_single[0], batch_rows])
            tokens = np.concatenate([cache.bad_single[1], tokens])
        return TokenPairs(self._to_device(batch_rows), self._to_device(tokens))

    def _min_tokens(
        self, cache: _BatchCache, rows: np.ndarray, num_output: np.ndarray
    ) -> TokenPairs | None:
        """Stop tokens banned on batch rows whose output (``num_output`` per batch row)
        is still shorter than min_tokens."""
        idx = cache.min_tokens_idx
        if idx is None:
            return None
        state_rows = rows[idx]
        short = num_output[idx] < self.min_tokens[state_rows]
        if not short.any():
            return None
        stop_ids = self.min_tokens_stop_ids[state_rows[short]]
        valid = stop_ids >= 0
        if not valid.any():
            return None
        batch_rows = np.broadcast_to(idx[short][:, None], stop_ids.shape)[valid]
        return TokenPairs(self._to_device(batch_rows), self._to_device(stop_ids[valid]))

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device)

    # -- helpers ----------------------------------------------------------------------------
    def _set_distribution(self, row: int, params: SamplingParams) -> None:
        stype = params.sampling_type
        self.sampling_type[row] = int(stype)
        if stype == SamplingType.GREEDY:
            return  # defaults: temperature 1 (never divides by 0), no truncation
        self.temperature[row] = params.temperature
        self.top_p[row] = params.top_p
        self.min_p[row] = params.min_p
        if params.top_k > 0:
            self.top_k[row] = min(params.top_k, self.vocab_size)

    def _min_tokens_stop_ids(self, params: SamplingParams, eos_token_id: int | None) -> list[int]:
        if params.min_tokens == 0:
            return []
        ids = set(params.stop_token_ids or ())
        if eos_token_id is not None and not params.ignore_eos:
            ids.add(eos_token_id)
        stop_ids = sorted(ids)
        check_token_ids(np.asarray(stop_ids, dtype=np.int64), self.vocab_size, "stop_token_ids")
        return stop_ids

    def _set_min_tokens_stop_ids(self, row: int, stop_ids: list[int]) -> None:
        width = self.min_tokens_stop_ids.shape[1]
        if len(stop_ids) > width:
            pad = np.full((self.max_num_reqs, len(stop_ids) - width), -1, dtype=np.int64)
            self.min_tokens_stop_ids = np.concatenate([self.min_tokens_stop_ids, pad], axis=1)
        self.min_tokens_stop_ids[row] = -1
        self.min_tokens_stop_ids[row, : len(stop_ids)] = stop_ids

    def _widen_recent_tokens(self, width: int) -> None:
        pad = np.full((self.max_num_reqs, width - self.recent_tokens.shape[1]), -1, np.int64)
        self.recent_tokens = np.concatenate([pad, self.recent_tokens], axis=1)

    def _set_recent_tokens(self, row: int, prompt: np.ndarray, output: np.ndarray) -> None:
        width = self.recent_tokens.shape[1]
        if not width:
            return
        tail = np.concatenate([prompt[-width:], output[-width:]])[-width:]
        self.recent_tokens[row] = -1
        self.recent_tokens[row, width - len(tail) :] = tail

    def _count_tokens(self, rows: np.ndarray, tokens: np.ndarray) -> None:
        slots = self.penalty_slot[rows]
        has_slot = slots >= 0
        if has_slot.any():
            self.token_counts.add_tokens(slots[has_slot], tokens[has_slot])

    def _reset_row(self, row: int) -> None:
        for name, (_, default) in _ROW_DEFAULTS.items():
            getattr(self, name)[row] = default
        self.top_k[row] = self.vocab_size
        self.active[row] = False
        self.min_tokens_stop_ids[row] = -1
        self.recent_tokens[row] = -1
        self.generators[row] = None
        self.rules[row] = None

    def _check_row(self, row: int) -> None:
        if not 0 <= row < self.max_num_reqs:
            raise ValueError(f"row {row} is outside [0, {self.max_num_reqs})")

    def _check_active(self, row: int) -> None:
        self._check_row(row)
        if not self.active[row]:
            raise ValueError(f"row {row} holds no request")

    def _checked_rows(self, rows: np.ndarray, what: str) -> np.ndarray:
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        if rows.size:
            if rows.min() < 0 or rows.max() >= self.max_num_reqs:
                raise ValueError(f"{what}: rows must be in [0, {self.max_num_reqs})")
            if not self.active[rows].all():
                raise ValueError(f"{what}: rows {rows[~self.active[rows]].tolist()} hold no request")
            if len(np.unique(rows)) != rows.size:
                raise ValueError(f"{what}: rows must not repeat")
        return rows


@dataclass(frozen=True)
class SpecLayout:
    """Where each request's drafts sit among its verification rows.

    Request ``i`` owns rows ``starts[i] .. starts[i] + num_drafts[i]``; row ``o`` of it
    scores output position ``o`` past the known tokens, draft ``o`` is verified there
    and the last row is the bonus position."""

    num_drafts: np.ndarray  # int64 [S]
    drafts: np.ndarray  # int64 [S, K] padded with -1
    starts: np.ndarray  # int64 [S] first row of each request
    offsets: np.ndarray  # int64 [N] row's position within its request
    request_of: np.ndarray  # int64 [N] request index of each row

    @classmethod
    def of(cls, num_drafts: np.ndarray, flat_drafts: np.ndarray) -> SpecLayout:
        counts = num_drafts + 1
        starts = np.cumsum(counts) - counts
        total = int(counts.sum())
        request_of = np.repeat(np.arange(len(counts)), counts)
        offsets = np.arange(total, dtype=np.int64) - starts[request_of]
        width = int(num_drafts.max()) if len(num_drafts) else 0
        drafts = np.full((len(counts), width), -1, dtype=np.int64)
        column = np.arange(width)
        drafts[column[None, :] < num_drafts[:, None]] = flat_drafts
        return cls(num_drafts, drafts, starts, offsets, request_of)

    def preceding_drafts(self) -> tuple[np.ndarray, np.ndarray]:
        """(row, token) for every draft ``j`` of a request and each of its rows ``o > j``."""
        rows, tokens = [], []
        for j in range(self.drafts.shape[1]):  # K is small; each pass is bulk
            has = np.flatnonzero(self.num_drafts > j)
            for o in range(j + 1, self.drafts.shape[1] + 1):
                later = has[self.num_drafts[has] >= o]
                if not later.size:
                    break
                rows.append(self.starts[later] + o)
                tokens.append(self.drafts[later, j])
        if not rows:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        return np.concatenate(rows), np.concatenate(tokens)

    def extend_history(self, recent: np.ndarray, rows: np.ndarray, width: int) -> np.ndarray:
        """The last ``width`` tokens of each of ``rows``' histories ``recent`` ``[M, W]``
        followed by the drafts before that row."""
        k = self.drafts.shape[1]
        joined = np.concatenate([recent, self.drafts[self.request_of[rows]]], axis=1)
        end = recent.shape[1] + self.offsets[rows]
        cols = end[:, None] - width + np.arange(width)[None, :]
        return np.take_along_axis(joined, cols, axis=1) if k else recent


def draw_seed(seed: int, position: int) -> int:
    """Seed of a request's draw for output token ``position``: splitmix64 output number
    ``position + 1`` of the stream seeded with ``seed``.

    Keying each draw by (seed, position) instead of letting one generator run on makes a
    request's tokens depend on nothing but its seed and its own history: not on the
    batch, not on its row, and not on a preemption (a resumed request continues where it
    left off without replaying its earlier draws). Re-keying is idempotent, so building
    the same step's metadata twice draws the same token.
    """
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)
