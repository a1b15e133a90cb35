"""Model proposers: a small draft model, or an EAGLE head over the target's hidden states.

Both run in the target's runner, on the target's platform, with their own paged KV
cache over the target's block tables. Each step they make:

1. one pass over every position the target computed with right tokens (so their KV
   cache stays complete, for prefill chunks too, and prefix-cache hits find it) whose
   last row yields the first draft of each request that wants drafts;
2. up to K-1 single-token passes, batched over the requests still drafting, each
   feeding the previous draft back (a draft model's decode steps replay forward graphs
   when the platform records them).

Where they differ is what a pass reads at position ``i``:

- draft model: token ``t_i``, as any language model; draft ``j`` sits at ``P + j``
  (``P`` the newest known token's position);
- EAGLE: token ``t_{i+1}`` and the target's hidden state ``h_i`` (later passes: its own
  output), one position behind, reusing the target's embedding and LM head.

Greedy requests draft the argmax (verified by exact match); random ones draw from
``q = softmax(logits / temperature)`` and hand ``q`` to the rejection sampler, seeded
requests from a key of (seed, position) so they repeat themselves.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass

import numpy as np
import torch

from engine.core.interfaces import Platform
from engine.core.sampling_params import SamplingType
from engine.model_executor.decode_graphs import DecodeGraphs
from engine.model_executor.forward_context import ForwardContext, set_forward_context
from engine.model_executor.input_batch import InputBatch, StepIndices, segment_offsets
from engine.model_executor.model_runner import KVCacheSpec, build_attention_metadata
from engine.model_executor.sampling.sampler import Sampler
from engine.model_executor.sampling.state import SamplingState, draw_seed
from engine.spec_decode.proposer import DraftProposal, ProposalBatch, Proposer

# Mixed into a seeded request's seed for its drafts' draws (not the target's stream).
_DRAFT_SALT = 0x2545F4914F6CDD1D
_MASK64 = (1 << 64) - 1


@dataclass
class _Draws:
    tokens: np.ndarray  # int64 [B]
    probs: torch.Tensor | None  # float32 [B, V] for batches with random rows


class ModelProposer(Proposer):
    """A proposer that runs a model with its own KV cache (see the module docstring)."""

    writes_kv_ahead = True

    def __init__(
        self,
        num_speculative_tokens: int,
        model: torch.nn.Module,
        attn_backend,
        platform: Platform,
        kv_dtype: torch.dtype,
        *,
        max_num_reqs: int,
        max_blocks_per_seq: int,
        enforce_eager: bool = False,
    ) -> None:
        super().__init__(num_speculative_tokens)
        self.model = model
        self.attn_backend = attn_backend
        self.platform = platform
        self.device = platform.device()
        self._host = self.device.type == "cpu"
        self.kv_dtype = kv_dtype
        self.max_num_reqs = max_num_reqs
        self.max_blocks_per_seq = max_blocks_per_seq
        self.kv_caches: list[torch.Tensor] = []
        # A first pass over a decoding request covers its newest tokens: at most the
        # K + 1 the target verified and the one it sampled.
        self._max_decode_len = num_speculative_tokens + 2
        self._capturer = None if enforce_eager else platform.forward_graph_capturer()
        self.graphs: DecodeGraphs | None = None
        self._sampler = Sampler(platform.fused_ops())  # its random draw, as the target's

    # -- KV cache -------------------------------------------------------------------------
    def kv_cache_spec(self) -> KVCacheSpec:
        spec = self.model.kv_cache_spec()
        return KVCacheSpec(spec.num_layers, spec.num_kv_heads, spec.head_size, self.kv_dtype)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        spec = self.kv_cache_spec()
        shape = self.attn_backend.get_kv_cache_shape(
            num_blocks, self.attn_backend.block_size, spec.num_kv_heads, spec.head_size
        )
        self.kv_caches = self.attn_backend.allocate_kv_cache(shape, spec.dtype, spec.num_layers)
        if self._capturer is not None:
            self.graphs = DecodeGraphs(
                self._capturer, self.model, self.attn_backend, self.kv_caches,
                max_batch_size=self.max_num_reqs * self._max_decode_len,
                max_blocks_per_seq=self.max_blocks_per_seq,
                device=self.device,
                hidden_input=self.hidden_input,
            )

    def free_kv_cache(self) -> None:
        self.graphs = None
        self.kv_caches = []

    @property
    def hidden_input(self) -> tuple[int, torch.dtype] | None:
        """(width, dtype) of the per-row hidden input its model takes besides token ids
        and positions (None: a plain language model)."""
        return None

    # -- proposing ------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, batch: ProposalBatch) -> DraftProposal:
        k = self.num_speculative_tokens
        num_rows = len(batch.rows)
        drafts = np.full((num_rows, k), -1, dtype=np.int64)
        hidden, last_rows = self._first_pass(batch)
        drafting = np.flatnonzero(batch.max_drafts > 0)
        num_drafts = np.minimum(batch.max_drafts, k).astype(np.int64)
        if not drafting.size:
            return DraftProposal(drafts, np.zeros(num_rows, dtype=np.int64))
        last = torch.from_numpy(last_rows[drafting]).to(self.device)
        hidden = hidden.index_select(0, last)
        prob_rows: list[tuple[np.ndarray, int, torch.Tensor]] = []
        cur = drafting
        for j in range(k):
            draws = self._draw(hidden, batch, cur, j)
            drafts[cur, j] = draws.tokens
            if draws.probs is not None:
                prob_rows.append((cur, j, draws.probs))
            keep = num_drafts[cur] > j + 1
            if j + 1 == k or not keep.any():
                break
            cur, tokens = cur[keep], draws.tokens[keep]
            hidden = hidden[torch.from_numpy(np.flatnonzero(keep)).to(self.device)]
            hidden = self._step(batch, cur, j + 1, tokens, hidden)
        return DraftProposal(drafts, num_drafts, self._flat_probs(prob_rows, num_drafts))

    @abstractmethod
    def _first_pass(self, batch: ProposalBatch) -> tuple[torch.Tensor, np.ndarray]:
        """Run over each request's verified positions: the hidden states of every row
        and, per request, the index of its last row."""

    @abstractmethod
    def _step(self, batch: ProposalBatch, cur: np.ndarray, j: int, tokens: np.ndarray,
              hidden: torch.Tensor) -> torch.Tensor:
        """Draft ``j``'s pass for requests ``cur``: ``tokens`` are their drafts ``j - 1``,
        ``hidden`` the previous pass's output rows of the same requests."""

    def _draw(self, hidden: torch.Tensor, batch: ProposalBatch, cur: np.ndarray, j: int) -> _Draws:
        """Draft ``j`` of requests ``cur`` from the logits of ``hidden``."""
        logits = self.compute_logits(hidden)
        state: SamplingState = batch.sampling_state
        rows = batch.rows[cur]
        stype = state.sampling_type[rows]
        greedy = stype == int(SamplingType.GREEDY)
        tokens = logits.argmax(dim=-1)
        if greedy.all():
            return _Draws(tokens.cpu().numpy(), None)
        temperature = torch.from_numpy(state.temperature[rows]).to(self.device)
        probs = torch.softmax(logits / temperature.unsqueeze(1), dim=-1)
        generators = {}
        for i in np.flatnonzero(stype == int(SamplingType.RANDOM_SEED)).tolist():
            row = int(rows[i])
            generator = torch.Generator(device=self.device)
            key = (int(state.seed[row]) ^ _DRAFT_SALT) & _MASK64
            generator.manual_seed(draw_seed(key, int(state.num_output_tokens[row]) + j))
            generators[i] = generator
        drawn = self._sampler.draw(probs.clone(), generators)
        tokens = torch.where(torch.from_numpy(greedy).to(self.device), tokens, drawn)
        return _Draws(tokens.cpu().numpy(), probs)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)

    @staticmethod
    def _flat_probs(
        prob_rows: list[tuple[np.ndarray, int, torch.Tensor]], num_drafts: np.ndarray
    ) -> torch.Tensor | None:
        """The draws' distributions laid out flat, request by request, draft by draft."""
        if not prob_rows:
            return None
        first = np.cumsum(num_drafts) - num_drafts
        vocab = prob_rows[0][2].shape[1]
        out = prob_rows[0][2].new_zeros(int(num_drafts.sum()), vocab)
        for cur, j, probs in prob_rows:
            index = torch.from_numpy(first[cur] + j).to(out.device)
            out.index_copy_(0, index, probs)
        return out

    # -- running passes -------------------------------------------------------------------
    def _upload(self, array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(np.ascontiguousarray(array))
        return tensor if self._host else tensor.to(self.device, non_blocking=True)

    def _run(self, input_batch: InputBatch, step: StepIndices, **extra: torch.Tensor
             ) -> torch.Tensor:
        """The model over ``step`` with this proposer's KV cache; a few tokens per request
        run as decode rows (graph replay where it is captured)."""
        if 1 < step.max_query_len <= self._max_decode_len:
            step = input_batch.as_decode_rows(step)
        graphs = self.graphs
        if graphs is not None and graphs.covers(step):
            out = graphs.forward(step, **extra)
            if out is not None:
                return out
        metadata = build_attention_metadata(self.attn_backend, step, self._upload)
        with set_forward_context(ForwardContext(metadata, self.kv_caches)):
            return self.model(self._upload(step.input_ids), self._upload(step.positions), **extra)


class DraftModelProposer(ModelProposer):
    """A smaller language model with the target's tokenizer.

    Its KV at a position depends only on the tokens up to it, so what its last proposal
    wrote for drafts that were then accepted is already right: the next first pass
    starts after them (a decoding request's first pass is then its newest token, or the
    last draft and the bonus token after a full acceptance)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # Per request: (position of the newest token when it last proposed, end of the
        # positions its KV was written for then).
        self._written: dict[str, tuple[int, int]] = {}
        # Per request: the end of the positions its first passes covered with the right
        # tokens. Steps that drafted nothing skip the proposer (the scheduler's draft
        # budget 0); its next first pass starts there, so the KV cache catches up.
        self._valid_end: dict[str, int] = {}

    def forget(self, req_ids) -> None:
        for req_id in req_ids:
            self._written.pop(req_id, None)
            self._valid_end.pop(req_id, None)

    def may_skip(self, req_ids: list[str]) -> bool:
        """Only once it has run for each of them: where a request's positions start (its
        prompt, after a prefix-cache hit) is known at its first pass alone."""
        return all(req_id in self._valid_end for req_id in req_ids)

    def propose(self, batch: ProposalBatch) -> DraftProposal:
        proposal = super().propose(batch)
        newest = batch.num_tokens - 1
        written = newest + np.maximum(proposal.num_drafts, 1)
        for i, req_id in enumerate(batch.req_ids):
            if batch.sampled[i]:
                self._written[req_id] = (int(newest[i]), int(written[i]))
            else:
                self._written.pop(req_id, None)
        return proposal

    def _first_pass(self, batch: ProposalBatch) -> tuple[torch.Tensor, np.ndarray]:
        ends = batch.verified_ends + batch.sampled  # and the newest token itself
        starts = batch.starts
        if self._written:
            last = [self._written.get(r, (-1, -1)) for r in batch.req_ids]
            proposed_at = np.fromiter((p for p, _ in last), dtype=np.int64, count=len(last))
            written_end = np.fromiter((e for _, e in last), dtype=np.int64, count=len(last))
            # Continuing from its last proposal: the accepted drafts' KV is in place.
            reuse = proposed_at == starts
            starts = np.where(reuse, np.maximum(starts, np.minimum(written_end, ends - 1)), starts)
        if self._valid_end:  # positions of steps that skipped it: covered now
            valid = np.fromiter((self._valid_end.get(r, -1) for r in batch.req_ids),
                                dtype=np.int64, count=len(batch.req_ids))
            starts = np.where((valid >= 0) & (valid < batch.starts), valid, starts)
        for req_id, end in zip(batch.req_ids, ends.tolist()):
            self._valid_end[req_id] = end
        step = batch.input_batch.span(batch.rows, starts, ends - starts)
        return self._run(batch.input_batch, step), step.logits_indices

    def _step(self, batch: ProposalBatch, cur: np.ndarray, j: int, tokens: np.ndarray,
              hidden: torch.Tensor) -> torch.Tensor:
        positions = batch.num_tokens[cur] - 1 + j
        step = batch.input_batch.span(batch.rows[cur], positions, np.ones(len(cur)), tokens)
        return self._run(batch.input_batch, step)


@dataclass
class _Deferred:
    """A request's positions ``[start, end)`` the head has not run over yet, with the
    target's hidden states there (one tensor per step that deferred)."""

    start: int
    end: int
    hidden: list[torch.Tensor]


class EagleProposer(ModelProposer):
    """An EAGLE head: (embedding of t_{i+1}, target hidden h_i) -> features predicting
    t_{i+2}, with the target's LM head (models.eagle_llama).

    Position i needs the target's h_i, which exists only in the step that computed it,
    so the head follows every step. But a step that drafts nothing (the speculation
    governor measured that drafting does not pay, or a batch past disable_by_batch_size)
    needs no pass yet: it keeps the step's hidden rows and the head runs over the whole
    backlog at the next pass, as one multi-token pass (a GEMM over many rows instead of
    a decode-sized pass and its host work every step). A pass comes when some request
    drafts, or when a backlog reaches ``max_deferred_positions``. What is skipped is
    only ever the head's own KV for positions still ahead of its next pass; a request
    that leaves first (finished, preempted) takes its backlog with it, so a prefix-cache
    hit on its blocks may find that KV missing, which costs acceptance, never output
    correctness (the target verifies every draft), as for a draft model's skipped
    steps."""

    follows_every_step = True  # position i needs the target's h_i, there only that step
    max_deferred_positions = 64  # per request; 0: a pass every step

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._deferred: dict[str, _Deferred] = {}
        self.dropped_positions = 0  # backlog let go while drafting was settled off

    def forget(self, req_ids) -> None:
        for req_id in req_ids:
            self._deferred.pop(req_id, None)

    def free_kv_cache(self) -> None:
        super().free_kv_cache()
        self._deferred.clear()  # their positions' KV went with the cache

    def defer(self, req_ids: list[str], starts: np.ndarray, ends: np.ndarray,
              hidden_starts: np.ndarray, target_hidden: torch.Tensor, *,
              may_drop: bool = False) -> bool:
        """Keep this step's hidden rows instead of a pass; False (nothing kept) when a
        backlog would pass its limit (unless ``may_drop``: it then restarts at this step,
        its positions left without head KV, as a request's prefix-cache hit may find
        them) or not continue where the step starts."""
        limit = self.max_deferred_positions
        if limit <= 0:
            return False
        deferred = self._deferred
        held = [deferred.get(r) for r in req_ids]
        starts_list, ends_list = starts.tolist(), ends.tolist()
        dropped = []
        for i, (h, start, end) in enumerate(zip(held, starts_list, ends_list)):
            if end - start > limit:
                return False
            if h is not None and (h.end != start or end - h.start > limit):
                if not may_drop or h.end != start:
                    return False
                dropped.append(i)
        for i in dropped:
            self.dropped_positions += held[i].end - held[i].start
            held[i] = None
        rows = self._hidden_rows(target_hidden, hidden_starts, ends - starts)
        first = 0
        for req_id, h, start, end in zip(req_ids, held, starts_list, ends_list):
            n = end - start
            if h is None:
                deferred[req_id] = _Deferred(start, end, [rows[first : first + n]])
            else:
                h.end = end
                h.hidden.append(rows[first : first + n])
            first += n
        return True

    @property
    def hidden_input(self) -> tuple[int, torch.dtype] | None:
        # The target's hidden states come in its activation dtype, which norms follow.
        norm = self.model.layers[0].post_attention_layernorm.weight
        return self.model.config.hidden_size, norm.dtype

    def _first_pass(self, batch: ProposalBatch) -> tuple[torch.Tensor, np.ndarray]:
        """Over each request's backlog (if any) and this step's verified positions."""
        starts = batch.starts
        counts = batch.verified_ends - starts
        target_hidden = self._hidden_rows(batch.target_hidden, batch.hidden_starts, counts)
        backlog = [self._deferred.pop(r, None) for r in batch.req_ids]
        if any(held is not None for held in backlog):
            starts, target_hidden = self._with_backlog(batch, backlog, counts, target_hidden)
            counts = batch.verified_ends - starts
        ib = batch.input_batch
        step = ib.span(batch.rows, starts, counts)
        row_of = np.repeat(batch.rows, counts)
        step.input_ids = ib.token_ids[row_of, step.positions + 1]  # one token ahead
        return self._run(batch.input_batch, step, target_hidden=target_hidden), step.logits_indices

    def _hidden_rows(self, target_hidden: torch.Tensor, hidden_starts: np.ndarray,
                     counts: np.ndarray) -> torch.Tensor:
        """``counts[i]`` rows of the target's output from flat row ``hidden_starts[i]``,
        request by request, as a copy (the target's next step overwrites its output)."""
        flat = hidden_starts if (counts == 1).all() else (  # decode steps: one row each
            np.repeat(hidden_starts, counts) + segment_offsets(counts))
        first = int(flat[0]) if len(flat) else 0
        if (flat == np.arange(first, first + len(flat))).all():  # one run of rows: a slice
            return target_hidden[first : first + len(flat)].clone()
        return target_hidden.index_select(0, self._upload(flat))

    @staticmethod
    def _with_backlog(batch: ProposalBatch, backlog: list[_Deferred | None],
                      counts: np.ndarray, target_hidden: torch.Tensor
                      ) -> tuple[np.ndarray, torch.Tensor]:
        """Pass starts moved back over each continuing backlog, and the hidden rows in
        pass order (a backlog that does not end where the step starts, e.g. a request
        recomputed after preemption, is dropped: the step covers its positions again)."""
        starts = batch.starts.copy()
        pieces: list[torch.Tensor] = []
        first = 0
        for i, (held, n) in enumerate(zip(backlog, counts.tolist())):
            if held is not None and held.end == starts[i]:
                pieces.extend(held.hidden)
                starts[i] = held.start
            pieces.append(target_hidden[first : first + n])
            first += n
        return starts, torch.cat(pieces)

    def _step(self, batch: ProposalBatch, cur: np.ndarray, j: int, tokens: np.ndarray,
              hidden: torch.Tensor) -> torch.Tensor:
        positions = batch.num_tokens[cur] - 2 + j
        step = batch.input_batch.span(batch.rows[cur], positions, np.ones(len(cur)), tokens)
        return self._run(batch.input_batch, step, target_hidden=hidden)
