"""The device-neutral model runner: scheduler diffs in, sampled tokens out.

Each step it (1) applies the scheduler's diffs to the persistent :class:`InputBatch`,
(2) flattens the scheduled tokens into one batch with bulk numpy work, (3) runs the
model once over that batch with the platform's attention backend, (4) computes logits
only for positions that sample (plus prompt positions whose logprobs were asked for)
and (5) samples. It never names a device: tensors go to ``platform.device()``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from engine.core.interfaces import AttentionBatch, Platform
from engine.core.scheduler.output import LogprobsLists, ModelRunnerOutput, SchedulerOutput
from engine.model_executor.forward_context import ForwardContext, set_forward_context
from engine.model_executor.input_batch import InputBatch, StepIndices
from engine.model_executor.sampling import Sampler, SamplingState, compute_prompt_logprobs

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVCacheSpec:
    """What one layer's KV cache needs, as the model reports it."""

    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype

    def block_bytes(self, block_size: int) -> int:
        """Bytes of one block across all layers (K and V)."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        per_layer = 2 * block_size * self.num_kv_heads * self.head_size * itemsize
        return per_layer * self.num_layers


class ModelRunner:
    """Runs one model on one device for the engine core."""

    def __init__(
        self,
        model: torch.nn.Module,
        attn_backend,
        platform: Platform,
        *,
        vocab_size: int,
        max_num_reqs: int,
        max_model_len: int,
        block_size: int,
    ) -> None:
        self.model = model
        self.attn_backend = attn_backend
        self.platform = platform
        self.device = platform.device()
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.input_batch = InputBatch(max_num_reqs, max_model_len, block_size)
        self.sampling_state = SamplingState(max_num_reqs, vocab_size, self.device)
        self.sampler = Sampler()
        self.kv_caches: list[torch.Tensor] = []
        # req_id -> number of prompt logprobs asked for (only while its prefill runs).
        self._prompt_logprobs: dict[str, int] = {}

    # -- KV cache -------------------------------------------------------------------------
    def allocate_kv_cache(self, spec: KVCacheSpec, num_blocks: int) -> None:
        shape = self.attn_backend.get_kv_cache_shape(
            num_blocks, self.block_size, spec.num_kv_heads, spec.head_size
        )
        self.kv_caches = [
            torch.zeros(shape, dtype=spec.dtype, device=self.device)
            for _ in range(spec.num_layers)
        ]

    # -- state updates --------------------------------------------------------------------
    def _apply_diffs(self, so: SchedulerOutput) -> None:
        batch = self.input_batch
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self._drop(req_id)
        for new in so.scheduled_new_reqs:
            self._drop(new.req_id)  # resumed after preemption: replace stale state
            row = batch.add(
                new.req_id,
                new.prompt_token_ids,
                new.output_token_ids,
                new.block_ids,
                new.num_computed_tokens,
            )
            params = new.sampling_params
            self.sampling_state.add_request(
                row,
                params,
                new.prompt_token_ids,
                new.output_token_ids,
                eos_token_id=new.eos_token_id,
            )
            if params.prompt_logprobs is not None and not new.output_token_ids:
                self._prompt_logprobs[new.req_id] = params.prompt_logprobs
        cached = so.scheduled_cached_reqs
        for req_id, new_blocks, computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens
        ):
            row = batch.req_id_to_row[req_id]
            batch.append_blocks(row, new_blocks)
            batch.num_computed_tokens[row] = computed

    def _drop(self, req_id: str) -> None:
        row = self.input_batch.remove(req_id)
        if row is not None:
            self.sampling_state.remove_request(row)
        self._prompt_logprobs.pop(req_id, None)

    # -- the step -------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._apply_diffs(so)
        if so.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        req_ids = list(so.num_scheduled_tokens)
        rows = np.fromiter(
            (self.input_batch.req_id_to_row[r] for r in req_ids), dtype=np.int64, count=len(req_ids)
        )
        num_scheduled = np.fromiter(
            so.num_scheduled_tokens.values(), dtype=np.int32, count=len(req_ids)
        )
        step = self.input_batch.prepare_step(rows, num_scheduled)
        hidden = self._run_model(step)

        prompt_lp = self._prompt_logprobs_of_step(req_ids, step, hidden)
        sampled = self._sample(step, hidden)

        sampled_lists: list[list[int]] = [[] for _ in req_ids]
        logprobs: dict[str, LogprobsLists] = {}
        if len(step.sample_batch_idx):
            token_ids = sampled.sampled_token_ids.cpu().numpy()
            sample_rows = rows[step.sample_batch_idx]
            self.input_batch.append_sampled(sample_rows, token_ids)
            self.sampling_state.append_tokens(sample_rows, token_ids)
            for i, tok in zip(step.sample_batch_idx.tolist(), token_ids.tolist()):
                sampled_lists[i] = [tok]
            if sampled.logprobs is not None:
                lists = sampled.logprobs.tolists()
                for j, i in enumerate(step.sample_batch_idx.tolist()):
                    if self.sampling_state.wants_logprobs(int(rows[i])):
                        logprobs[req_ids[i]] = lists.select(j)
        return ModelRunnerOutput(
            req_ids=req_ids,
            sampled_token_ids=sampled_lists,
            logprobs=logprobs,
            prompt_logprobs=prompt_lp,
        )

    def _run_model(self, step: StepIndices) -> torch.Tensor:
        dev = self.device
        batch = AttentionBatch(
            num_reqs=len(step.rows),
            num_tokens=len(step.input_ids),
            query_start_loc=torch.from_numpy(step.query_start_loc).to(dev),
            seq_lens=torch.from_numpy(step.seq_lens).to(dev),
            block_tables=torch.from_numpy(step.block_tables).to(dev),
            slot_mapping=torch.from_numpy(step.slot_mapping).to(dev),
            max_query_len=step.max_query_len,
            max_seq_len=step.max_seq_len,
            query_start_loc_cpu=step.query_start_loc,
            seq_lens_cpu=step.seq_lens,
        )
        metadata = self.attn_backend.build_metadata(batch)
        input_ids = torch.from_numpy(step.input_ids).to(dev)
        positions = torch.from_numpy(step.positions).to(dev)
        with set_forward_context(ForwardContext(metadata, self.kv_caches)):
            return self.model(input_ids, positions)

    def _sample(self, step: StepIndices, hidden: torch.Tensor):
        if not len(step.sample_batch_idx):
            return None
        idx = torch.from_numpy(step.logits_indices).to(self.device)
        logits = self.model.compute_logits(hidden.index_select(0, idx))
        metadata = self.sampling_state.build_metadata(step.rows[step.sample_batch_idx])
        return self.sampler(logits, metadata)

    def _prompt_logprobs_of_step(
        self, req_ids: list[str], step: StepIndices, hidden: torch.Tensor
    ) -> dict[str, LogprobsLists]:
        """Logprobs of each prompt token computed this step, for requests that asked.

        A position ``p`` predicts prompt token ``p + 1``; the first prompt token has no
        logprob (the output processor reports None for it).
        """
        if not self._prompt_logprobs:
            return {}
        out: dict[str, LogprobsLists] = {}
        batch = self.input_batch
        for i, req_id in enumerate(req_ids):
            k = self._prompt_logprobs.get(req_id)
            if k is None:
                continue
            row = int(step.rows[i])
            start = int(step.query_start_loc[i])
            first_pos = int(step.positions[start])
            n_prompt = int(batch.num_prompt_tokens[row])
            last_pos = min(first_pos + int(step.num_scheduled[i]), n_prompt - 1)
            if last_pos > first_pos:
                flat = torch.arange(start, start + last_pos - first_pos, device=self.device)
                logits = self.model.compute_logits(hidden.index_select(0, flat))
                targets = torch.from_numpy(batch.token_ids[row, first_pos + 1 : last_pos + 1])
                out[req_id] = compute_prompt_logprobs(logits, targets.to(self.device), k)
            if first_pos + int(step.num_scheduled[i]) >= n_prompt:
                del self._prompt_logprobs[req_id]  # prefill complete
        return out
