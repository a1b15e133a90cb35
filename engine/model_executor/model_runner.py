"""The device-neutral model runner: scheduler diffs in, sampled tokens out.

Each step it (1) applies the scheduler's diffs to the persistent :class:`InputBatch`,
(2) flattens the scheduled tokens into one batch with bulk numpy work, (3) runs the
model once over that batch with the platform's attention backend -- a decode-only step
by replaying the forward graph of its batch size (:mod:`.decode_graphs`) when the
platform can capture one --, (4) computes logits only for positions that sample (plus
prompt positions whose logprobs were asked for) and (5) samples. It never names a
device: tensors go to ``platform.device()``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from engine.core.interfaces import AttentionBatch, Platform
from engine.core.scheduler.output import LogprobsLists, ModelRunnerOutput, SchedulerOutput
from engine.model_executor.decode_graphs import DecodeGraphs
from engine.model_executor.forward_context import ForwardContext, set_forward_context
from engine.model_executor.input_batch import InputBatch, StepIndices
from engine.model_executor.sampling import Sampler, SamplingState, compute_prompt_logprobs
from engine.structured_output.bitmask import bitmask_for_sampling_rows

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


@dataclass
class _PromptLogprobsProgress:
    """How far a request's prompt logprobs got: prompt tokens ``[0, num_reported)`` are
    reported (token 0 has none), so a recomputed prefill does not report them twice."""

    num_logprobs: int  # SamplingParams.prompt_logprobs
    num_reported: int = 1


@dataclass
class StepInputs:
    """Everything one step's forward and sampling read, built once by ``_prepare_inputs``."""

    req_ids: list[str]  # batch order
    step: StepIndices


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
        enforce_eager: bool = False,
    ) -> None:
        self.model = model
        self.attn_backend = attn_backend
        self.platform = platform
        self.device = platform.device()
        self._device_is_host = self.device.type == "cpu"
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.input_batch = InputBatch(max_num_reqs, max_model_len, block_size)
        self.sampling_state = SamplingState(max_num_reqs, vocab_size, self.device)
        self.sampler = Sampler(platform.fused_ops())
        self.kv_caches: list[torch.Tensor] = []
        # Forward graphs of decode steps (made with the KV cache), unless forced eager.
        self._graph_capturer = None if enforce_eager else platform.forward_graph_capturer()
        self.decode_graphs: DecodeGraphs | None = None
        # Requests whose prompt logprobs are still due (kept across preemption).
        self._prompt_logprobs: dict[str, _PromptLogprobsProgress] = {}

    # -- KV cache -------------------------------------------------------------------------
    def allocate_kv_cache(self, spec: KVCacheSpec, num_blocks: int) -> None:
        shape = self.attn_backend.get_kv_cache_shape(
            num_blocks, self.block_size, spec.num_kv_heads, spec.head_size
        )
        self.kv_caches = self.attn_backend.allocate_kv_cache(shape, spec.dtype, spec.num_layers)
        if self._graph_capturer is not None:
            self.decode_graphs = DecodeGraphs(
                self._graph_capturer,
                self.model,
                self.attn_backend,
                self.kv_caches,
                max_batch_size=self.input_batch.max_num_reqs,
                max_blocks_per_seq=self.input_batch.block_table.shape[1],
                device=self.device,
            )

    # -- state updates --------------------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> None:
        """Apply the scheduler's diffs to the persistent batch (new, resumed, finished)."""
        batch = self.input_batch
        for req_id in so.finished_req_ids:
            self._prompt_logprobs.pop(req_id, None)
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
                # Kept across preemption: a recomputed prefill reports only new tokens.
                self._prompt_logprobs.setdefault(
                    new.req_id, _PromptLogprobsProgress(params.prompt_logprobs)
                )
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

    # -- the step -------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(
        self, so: SchedulerOutput, grammar_bitmask: torch.Tensor | None = None
    ) -> ModelRunnerOutput:
        """update states -> prepare inputs -> forward -> (prompt logprobs) -> sample.

        ``grammar_bitmask`` (structured outputs): one int32 row per id of
        ``so.structured_output_req_ids``, or None when no request is constrained."""
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        inputs = self._prepare_inputs(so)
        hidden = self._forward(inputs)
        prompt_lp = self._prompt_logprobs_of_step(inputs, hidden)
        tokens, logprobs = self._sample(
            inputs, hidden, so.structured_output_req_ids, grammar_bitmask
        )
        return ModelRunnerOutput(
            req_ids=inputs.req_ids,
            sampled_token_ids=self._token_lists(inputs, tokens),
            logprobs=logprobs,
            prompt_logprobs=prompt_lp,
        )

    def _prepare_inputs(self, so: SchedulerOutput) -> StepInputs:
        """Flatten the scheduled tokens (bulk numpy)."""
        req_ids = list(so.num_scheduled_tokens)
        row_of = self.input_batch.req_id_to_row
        rows = np.fromiter((row_of[r] for r in req_ids), dtype=np.int64, count=len(req_ids))
        num_scheduled = np.fromiter(
            so.num_scheduled_tokens.values(), dtype=np.int32, count=len(req_ids)
        )
        return StepInputs(req_ids, self.input_batch.prepare_step(rows, num_scheduled))

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        """The step's hidden states: a forward graph's replay for a decode step it
        covers, else the model called eagerly with the step's attention metadata."""
        step = inputs.step
        graphs = self.decode_graphs
        if graphs is not None and graphs.covers(step):
            hidden = graphs.forward(step)
            if hidden is not None:
                return hidden
        metadata, input_ids, positions = self._eager_inputs(step)
        with set_forward_context(ForwardContext(metadata, self.kv_caches)):
            return self.model(input_ids, positions)

    def _eager_inputs(self, step: StepIndices) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """The attention metadata, token ids and positions of a step run eagerly."""
        upload = self._upload
        batch = AttentionBatch(
            num_reqs=len(step.rows),
            num_tokens=len(step.input_ids),
            query_start_loc=upload(step.query_start_loc),
            seq_lens=upload(step.seq_lens),
            block_tables=upload(step.block_tables),
            slot_mapping=upload(step.slot_mapping),
            max_query_len=step.max_query_len,
            max_seq_len=step.max_seq_len,
            query_start_loc_cpu=step.query_start_loc,
            seq_lens_cpu=step.seq_lens,
        )
        metadata = self.attn_backend.build_metadata(batch)
        return metadata, upload(step.input_ids), upload(step.positions)

    def _upload(self, array: np.ndarray) -> torch.Tensor:
        """A host array as a tensor on the device (shared memory when that is the host)."""
        tensor = torch.from_numpy(array)
        return tensor if self._device_is_host else tensor.to(self.device, non_blocking=True)

    def _sample(
        self,
        inputs: StepInputs,
        hidden: torch.Tensor,
        structured_req_ids: list[str] | None = None,
        grammar_bitmask: torch.Tensor | None = None,
    ) -> tuple[list[int], dict[str, LogprobsLists]]:
        """Sample the rows that completed their known tokens; record the new tokens."""
        step = inputs.step
        if not len(step.sample_batch_idx):
            return [], {}
        if len(step.logits_indices) < hidden.shape[0]:
            idx = self._upload(step.logits_indices)
            hidden = hidden.index_select(0, idx)
        logits = self.model.compute_logits(hidden)  # every token samples: all of hidden
        sample_rows = step.rows[step.sample_batch_idx]
        token_bitmask = None
        if grammar_bitmask is not None:
            sampling_req_ids = [inputs.req_ids[i] for i in step.sample_batch_idx.tolist()]
            token_bitmask = bitmask_for_sampling_rows(
                grammar_bitmask, structured_req_ids or [], sampling_req_ids
            )
        sampled = self.sampler(
            logits, self.sampling_state.build_metadata(sample_rows), token_bitmask=token_bitmask
        )
        token_ids = sampled.sampled_token_ids.cpu().numpy()
        self.input_batch.append_sampled(sample_rows, token_ids)
        self.sampling_state.append_tokens(sample_rows, token_ids)
        logprobs: dict[str, LogprobsLists] = {}
        if sampled.logprobs is not None:
            lists = sampled.logprobs.tolists()
            for j, i in enumerate(step.sample_batch_idx.tolist()):
                if self.sampling_state.wants_logprobs(int(step.rows[i])):
                    logprobs[inputs.req_ids[i]] = lists.select(j)
        return token_ids.tolist(), logprobs

    @staticmethod
    def _token_lists(inputs: StepInputs, tokens: list[int]) -> list[list[int]]:
        """Per request of the step: ``[token]`` if it sampled, else ``[]``."""
        if len(tokens) == len(inputs.req_ids):  # every request sampled: the decode case
            return [[t] for t in tokens]
        lists: list[list[int]] = [[] for _ in inputs.req_ids]
        for i, tok in zip(inputs.step.sample_batch_idx.tolist(), tokens):
            lists[i] = [tok]
        return lists

    def _prompt_logprobs_of_step(
        self, inputs: StepInputs, hidden: torch.Tensor
    ) -> dict[str, LogprobsLists]:
        """Logprobs of each prompt token computed this step, for requests that asked.

        A position ``p`` predicts prompt token ``p + 1``; the first prompt token has no
        logprob (the output processor reports None for it). A prefill recomputed after a
        preemption reports only the prompt tokens not reported before it.
        """
        if not self._prompt_logprobs:
            return {}
        out: dict[str, LogprobsLists] = {}
        batch = self.input_batch
        step = inputs.step
        for i, req_id in enumerate(inputs.req_ids):
            progress = self._prompt_logprobs.get(req_id)
            if progress is None:
                continue
            row = int(step.rows[i])
            start = int(step.query_start_loc[i])
            first_pos = int(step.positions[start])
            n_prompt = int(batch.num_prompt_tokens[row])
            # Prompt tokens [first_target, last_target] are scored by positions one before.
            first_target = max(first_pos + 1, progress.num_reported)
            last_target = min(first_pos + int(step.num_scheduled[i]), n_prompt - 1)
            if last_target >= first_target:
                flat = torch.arange(
                    start + first_target - 1 - first_pos,
                    start + last_target - first_pos,
                    device=self.device,
                )
                logits = self.model.compute_logits(hidden.index_select(0, flat))
                targets = torch.from_numpy(batch.token_ids[row, first_target : last_target + 1])
                out[req_id] = compute_prompt_logprobs(
                    logits, targets.to(self.device), progress.num_logprobs
                )
                progress.num_reported = last_target + 1
            if first_pos + int(step.num_scheduled[i]) >= n_prompt:
                del self._prompt_logprobs[req_id]  # prefill complete
        return out
