"""The device-neutral model runner: scheduler diffs in, sampled tokens out.

Each step it (1) applies the scheduler's diffs to the persistent :class:`InputBatch`,
(2) flattens the scheduled tokens into one batch with bulk numpy work, (3) runs the
model once over that batch with the platform's attention backend -- a decode-only step
by replaying the forward graph of its batch size (:mod:`.decode_graphs`) when the
platform can capture one --, (4) computes logits only for positions that sample (plus
prompt positions whose logprobs were asked for) and (5) samples. It never names a
device: tensors go to ``platform.device()``.

As one pipeline stage of several, it receives the previous stage's activations before
its layers and sends its own after them, point to point over the pipeline group (the
step's layout is known on every rank from the scheduler output, so no shapes travel);
only the last stage computes logits and samples, and the earlier stages learn the
accepted tokens from the scheduler output (``CachedRequestData.new_token_ids``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from engine.core.interfaces import AttentionBatch, Platform
from engine.core.kv_cache.groups import KVCacheLayout
from engine.core.scheduler.output import LogprobsLists, ModelRunnerOutput, SchedulerOutput
from engine.lora.layers import LoRABatch
from engine.model_executor.decode_graphs import DecodeGraphs
from engine.model_executor.forward_context import ForwardContext, set_forward_context
from engine.model_executor.input_batch import (
    InputBatch,
    StepIndices,
    dummy_step,
    segment_offsets,
)
from engine.model_executor.sampling import Sampler, SamplingState, compute_prompt_logprobs
from engine.model_executor.sampling.rejection_sampler import RejectionSampler
from engine.model_executor.sampling.state import SpecLayout
from engine.model_executor.state_cache import (
    allocate_state_caches,
    build_state_metadata,
    model_state_spec,
)
from engine.structured_output.bitmask import bitmask_for_sampling_rows, bitmask_for_spec_rows

if TYPE_CHECKING:
    from engine.lora.manager import LoRAManager
    from engine.spec_decode.proposer import Proposer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVCacheSpec:
    """What one layer's KV cache needs, as the model reports it: K and V of
    ``num_kv_heads`` heads per token, or (``mla``) one latent entry of ``head_size``."""

    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    mla: bool = False

    def block_bytes(self, block_size: int) -> int:
        """Bytes of one block across all layers."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        entries = 1 if self.mla else 2  # MLA: the latent is key and value at once
        per_layer = entries * block_size * self.num_kv_heads * self.head_size * itemsize
        return per_layer * self.num_layers

    def cache_shape(self, backend: Any, num_blocks: int, block_size: int) -> tuple[int, ...]:
        if not self.mla:
            return backend.get_kv_cache_shape(num_blocks, block_size, self.num_kv_heads,
                                              self.head_size)
        shape = backend.get_mla_kv_cache_shape(num_blocks, block_size, self.head_size)
        if shape is None:
            raise ValueError(f"attention backend {backend.name!r} has no MLA kernels")
        return shape


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
    # Drafts verified this step (speculative decoding): per batch index, how many, and
    # the drafts themselves flat in batch order. None when no request has drafts.
    num_drafts: np.ndarray | None = None
    draft_token_ids: np.ndarray | None = None


def build_attention_metadata(
    attn_backend, step: StepIndices, upload: Callable[[np.ndarray], torch.Tensor],
    key_ends: np.ndarray | None = None,
) -> Any:
    """The backend's metadata for a step's layout (uploaded with ``upload``);
    ``key_ends``: per token, where its keys end when some reach past it (Gemma 3's
    images)."""
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
        key_ends_cpu=key_ends,
    )
    return attn_backend.build_metadata(batch)


def build_layer_metadata(
    attn_backend, step: StepIndices, group0_metadata: Any, layer_groups: list[int],
    upload: Callable[[np.ndarray], torch.Tensor], key_ends: np.ndarray | None = None,
) -> list[Any] | None:
    """Each layer's metadata for a hybrid model (one per KV cache group, built from the
    group's block tables and cache slots); None with one group."""
    if not step.group_slot_mappings:
        return None
    metadata = [group0_metadata]
    for slots, tables in zip(step.group_slot_mappings, step.group_block_tables):
        metadata.append(build_attention_metadata(
            attn_backend, replace(step, slot_mapping=slots, block_tables=tables), upload,
            key_ends))
    return [metadata[group] for group in layer_groups]


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
        proposer: Proposer | None = None,
        parallel: Any = None,
        kv_connector: Any = None,
        kv_cache_layout: KVCacheLayout | None = None,
        lora_manager: LoRAManager | None = None,
    ) -> None:
        """``kv_cache_layout``: the model's KV cache groups (None: one group).
        ``lora_manager``: the model's LoRA adapters (None: LoRA is off)."""
        self.model = model
        self.lora_manager = lora_manager
        self.kv_cache_layout = kv_cache_layout
        num_groups = 1 if kv_cache_layout is None else kv_cache_layout.num_groups
        # The KV cache group of each layer (None: all in one group).
        self._layer_groups = None if num_groups == 1 else [
            group for group, _ in kv_cache_layout.layer_slots()]
        # The KV connector's worker side (disaggregated prefill/decode, external caches).
        self.kv_connector = kv_connector
        if kv_connector is not None and kv_connector.uses_layer_hooks:
            enforce_eager = True  # the per-layer hooks run in Python
        # State layers (Mamba mixers): their per-slot states, beside the KV cache. Such
        # models run eagerly (the decode graphs know only attention metadata).
        self.state_spec = model_state_spec(model)
        self.state_caches: list[tuple[torch.Tensor, ...]] = []
        if self.state_spec is not None:
            enforce_eager = True
        # Pipeline position (engine.distributed.ParallelState; None: the whole model).
        self.pp = None if parallel is None or parallel.pp_size == 1 else parallel.pp
        self.is_first_stage = self.pp is None or self.pp.rank == 0
        self.samples = self.pp is None or self.pp.rank == self.pp.world_size - 1
        # Experts shared with other data-parallel replicas: every step runs one forward,
        # a dummy one when this replica has nothing scheduled (engine.core.dp_lockstep).
        self.lockstep = parallel is not None and parallel.layout.spans_data_parallel
        self.attn_backend = attn_backend
        self.platform = platform
        self.device = platform.device()
        self._device_is_host = self.device.type == "cpu"
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.input_batch = InputBatch(max_num_reqs, max_model_len, block_size, num_groups)
        self.sampling_state = SamplingState(max_num_reqs, vocab_size, self.device)
        self.sampler = Sampler(platform.fused_ops())
        self.kv_caches: list[torch.Tensor] = []
        # Forward graphs of decode steps (made with the KV cache), unless forced eager.
        self._graph_capturer = None if enforce_eager else platform.forward_graph_capturer()
        self.decode_graphs: DecodeGraphs | None = None
        # Requests whose prompt logprobs are still due (kept across preemption).
        self._prompt_logprobs: dict[str, _PromptLogprobsProgress] = {}
        # Speculative decoding: who drafts, who verifies, and the distributions the
        # pending drafts were drawn from (until the next step verifies them).
        self.proposer = proposer
        k = 0 if proposer is None else proposer.num_speculative_tokens
        self._max_verify_len = 1 + k  # tokens of a request whose drafts are verified
        self.rejection_sampler = RejectionSampler(self.sampler.argmax, self.sampler.categorical)
        self._draft_probs: dict[str, torch.Tensor] = {}
        from engine.model_executor.layers.fused_moe import FusedMoE

        self._has_moe = any(isinstance(m, FusedMoE) for m in model.modules())
        self._layer_hooks = (kv_connector if kv_connector is not None
                             and kv_connector.uses_layer_hooks else None)
        # Called as a step's forward starts, once its inputs are built (async scheduling:
        # the executor hands the previous step's output over there, see executor.py).
        self.on_forward_start: Callable[[], None] | None = None
        # Vision-language models: encoder runs, the encoder cache, image rows merged
        # into the step's embeddings, M-RoPE positions (None: a text model).
        self.mm = None
        if getattr(model, "supports_multimodal", False):
            from engine.model_executor.multimodal_runner import MultiModalRunner

            if proposer is not None:
                raise ValueError("speculative decoding is not supported with "
                                 "vision-language models")
            if self.pp is not None:
                raise ValueError("pipeline parallelism is not supported with "
                                 "vision-language models")
            self.mm = MultiModalRunner(model, self.device)
            if self.mm.bidirectional and not attn_backend.supports_key_ends():
                raise ValueError(
                    f"{type(model).__name__}'s image tokens attend to each other both ways; "
                    f"attention backend {attn_backend.name!r} cannot (supports_key_ends)")

    # -- KV cache -------------------------------------------------------------------------
    def allocate_kv_cache(self, spec: KVCacheSpec, num_blocks: int) -> None:
        """The target's KV cache (and the proposer's, over the same block ids)."""
        if self.proposer is not None:
            self.proposer.allocate_kv_cache(num_blocks)
        shape = spec.cache_shape(self.attn_backend, num_blocks, self.block_size)
        self.kv_caches = self.attn_backend.allocate_kv_cache(shape, spec.dtype, spec.num_layers)
        if self.state_spec is not None:
            self.state_caches = allocate_state_caches(
                self.state_spec, self.input_batch.max_num_reqs, self.device)
        if self._layer_groups is not None:
            # Hybrid: spec.num_layers is the group size; layer j of every group shares
            # cache tensor j (the groups hold disjoint block ids).
            tensors = self.kv_caches
            self.kv_caches = [tensors[j] for _, j in self.kv_cache_layout.layer_slots()]
        if self.kv_connector is not None:
            self.kv_connector.register_kv_caches(self.kv_caches,
                                                 self._kv_layout(spec, num_blocks))
        if self._graph_capturer is not None:
            self.decode_graphs = DecodeGraphs(
                self._graph_capturer,
                self.model,
                self.attn_backend,
                self.kv_caches,
                max_batch_size=self.input_batch.max_num_reqs * self._max_verify_len,
                max_blocks_per_seq=self.input_batch.block_table.shape[1],
                device=self.device,
                layer_groups=self._layer_groups,
                lora=self.lora_manager is not None,
            )

    def free_kv_cache(self) -> None:
        """Drop the KV cache (sleep mode) and the forward graphs that point into it; a
        later :meth:`allocate_kv_cache` allocates anew and captures again. Only while no
        request is in the batch."""
        from engine.core.interfaces.attention import AttentionImpl

        self.decode_graphs = None
        self.kv_caches = []
        self.state_caches = []
        if self.proposer is not None:
            self.proposer.free_kv_cache()
        models = [self.model, getattr(self.proposer, "model", None)]
        for module in (m for model in models if model is not None for m in model.modules()):
            impl = getattr(module, "impl", None)
            if isinstance(impl, AttentionImpl):
                impl.release_kv_cache()

    def _kv_layout(self, spec: KVCacheSpec, num_blocks: int) -> Any:
        from engine.core.interfaces.kv_connector import KVCacheLayout

        block_dim = self.attn_backend.kv_cache_block_dim(spec.mla)
        layer_bytes = self.kv_caches[0].numel() * self.kv_caches[0].element_size()
        return KVCacheLayout(
            num_layers=spec.num_layers, num_blocks=num_blocks, block_size=self.block_size,
            num_kv_heads=spec.num_kv_heads, head_size=spec.head_size,
            dtype=str(spec.dtype).removeprefix("torch."), block_dim=block_dim,
            block_bytes=layer_bytes // num_blocks, mla=spec.mla,
            backend=self.attn_backend.name,
        )

    # -- KV connector ---------------------------------------------------------------------
    def _start_kv_transfers(self, so: SchedulerOutput) -> None:
        connector = self.kv_connector
        metadata = so.kv_connector_metadata
        if metadata is not None and not isinstance(metadata, connector.metadata_cls):
            import msgspec  # decoded from another process: back into the connector's type

            metadata = msgspec.convert(metadata, connector.metadata_cls)
        connector.bind_connector_metadata(metadata)
        connector.start_load_kv()

    def _finish_kv_transfers(self, so: SchedulerOutput) -> Any:
        from engine.core.scheduler.output import KVConnectorOutput

        connector = self.kv_connector
        connector.wait_for_save()
        sending, receiving = connector.get_finished(set(so.finished_req_ids))
        stats = connector.stats()
        connector.bind_connector_metadata(None)
        return KVConnectorOutput(
            finished_sending=sorted(sending), finished_recving=sorted(receiving),
            failed_loads=sorted(connector.get_failed_loads()),
            bytes_sent=stats.bytes_sent, bytes_received=stats.bytes_received,
            blocks_sent=stats.blocks_sent, blocks_received=stats.blocks_received,
            transfer_seconds=stats.transfer_seconds, load_failures=stats.load_failures,
        )

    # -- state updates --------------------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> None:
        """Apply the scheduler's diffs to the persistent batch (new, resumed, finished)."""
        batch = self.input_batch
        for req_id in so.finished_req_ids:
            self._prompt_logprobs.pop(req_id, None)
        if self.mm is not None and so.free_encoder_ids:
            self.mm.free(so.free_encoder_ids)
        gone = so.finished_req_ids | so.preempted_req_ids
        for req_id in gone:
            self._drop(req_id)
        if self.proposer is not None and (gone or so.scheduled_new_reqs):
            self.proposer.forget(gone | {new.req_id for new in so.scheduled_new_reqs})
        if self._draft_probs:  # drafts a step runs without (or a request ends) are void
            spec, scheduled = so.scheduled_spec_decode_tokens, so.num_scheduled_tokens
            self._draft_probs = {
                r: p for r, p in self._draft_probs.items()
                if r in spec or (r not in scheduled and r not in gone)
            }
        for new in so.scheduled_new_reqs:
            self._drop(new.req_id)  # resumed after preemption: replace stale state
            row = batch.add(
                new.req_id,
                new.prompt_token_ids,
                new.output_token_ids,
                new.block_ids,
                new.num_computed_tokens,
                state_slot=new.state_slot,
                lora_id=0 if new.lora_request is None else new.lora_request.lora_int_id,
            )
            if new.lora_request is not None:
                self.lora_manager.register(new.lora_request)
            if self.mm is not None:
                self.mm.add_request(new.req_id, new.mm_features, new.prompt_token_ids)
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
        if not self.samples and cached.new_token_ids:  # tokens the last stage sampled
            rows = np.fromiter((batch.req_id_to_row[r] for r in cached.req_ids),
                               dtype=np.int64, count=cached.num_reqs)
            batch.append_token_lists(rows, cached.new_token_ids)

    def _drop(self, req_id: str) -> None:
        if self.mm is not None:
            self.mm.remove_request(req_id)
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
        if self.kv_connector is not None:
            self._start_kv_transfers(so)
        if so.total_num_scheduled_tokens == 0:
            if self.lockstep:
                self._dummy_forward()
            output = ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
            if self.kv_connector is not None:
                output.kv_connector_output = self._finish_kv_transfers(so)
            return output
        inputs = self._prepare_inputs(so)
        if self.mm is not None and so.scheduled_encoder_inputs:
            self.mm.encode(so.scheduled_encoder_inputs)
        if self.on_forward_start is not None:
            self.on_forward_start()
        hidden = self._forward(inputs)
        if not self.samples:  # an earlier pipeline stage: its activations went on
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        prompt_lp = self._prompt_logprobs_of_step(inputs, hidden)
        if inputs.num_drafts is None:
            tokens, logprobs = self._sample(
                inputs, hidden, so.structured_output_req_ids, grammar_bitmask
            )
            token_lists = self._token_lists(inputs, tokens)
        else:
            token_lists, logprobs = self._verify(
                inputs, hidden, so.structured_output_req_ids, grammar_bitmask
            )
        return ModelRunnerOutput(
            req_ids=inputs.req_ids,
            sampled_token_ids=token_lists,
            logprobs=logprobs,
            prompt_logprobs=prompt_lp,
            spec_token_ids=self._propose(inputs, hidden, token_lists, so.max_draft_tokens,
                                         so.drafts_settled_off),
            expert_load=self._expert_load(),
            kv_connector_output=(None if self.kv_connector is None
                                 else self._finish_kv_transfers(so)),
        )

    def _expert_load(self) -> list[int] | None:
        """What the model's MoE layers routed since the previous step (None: dense)."""
        if not self._has_moe:
            return None
        from engine.model_executor.models.moe_block import take_expert_load

        load = take_expert_load(self.model)
        return None if load is None else load.tolist()

    def _prepare_inputs(self, so: SchedulerOutput) -> StepInputs:
        """Flatten the scheduled tokens (bulk numpy); drafts to verify are written past
        each request's known tokens, where the step gathers its inputs."""
        req_ids = list(so.num_scheduled_tokens)
        batch = self.input_batch
        row_of = batch.req_id_to_row
        rows = np.fromiter((row_of[r] for r in req_ids), dtype=np.int64, count=len(req_ids))
        num_scheduled = np.fromiter(
            so.num_scheduled_tokens.values(), dtype=np.int32, count=len(req_ids)
        )
        spec = so.scheduled_spec_decode_tokens
        if not spec:
            return StepInputs(req_ids, batch.prepare_step(rows, num_scheduled))
        num_drafts = np.fromiter(
            (len(spec.get(r, ())) for r in req_ids), dtype=np.int64, count=len(req_ids)
        )
        drafts = np.fromiter(
            (t for r in req_ids for t in spec.get(r, ())), dtype=np.int64,
            count=int(num_drafts.sum()),
        )
        batch.write_scratch(rows, batch.num_tokens[rows], drafts, num_drafts)
        step = batch.prepare_step(rows, num_scheduled)
        # Every drafted request samples at each of its draft positions and after them.
        sampling = step.sample_batch_idx
        counts = num_drafts[sampling] + 1
        ends = step.query_start_loc[sampling + 1].astype(np.int64)
        step.logits_indices = np.repeat(ends - counts, counts) + segment_offsets(counts)
        return StepInputs(req_ids, step, num_drafts, drafts)

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        """The step's hidden states: a forward graph's replay for a decode step it
        covers, else the model called eagerly with the step's attention metadata. A step
        that only verifies drafts runs as a decode step of one row per token."""
        step = inputs.step
        if inputs.num_drafts is not None and step.max_query_len <= self._max_verify_len:
            step = self.input_batch.as_decode_rows(step)
        lora_slots = None
        if self.lora_manager is not None:  # each token's adapter slot
            row_slots = self.lora_manager.slots_for(self.input_batch.lora_ids[step.rows])
            lora_slots = np.repeat(row_slots, step.num_scheduled)
        mm_positions = None if self.mm is None else self.mm.positions(inputs.req_ids, step)
        graphs = self.decode_graphs
        if graphs is not None and graphs.covers(step) and (
                mm_positions is None or mm_positions.ndim == 1):
            graph_step = step if mm_positions is None else self.mm.with_positions(
                step, mm_positions)
            hidden = graphs.forward(graph_step, lora_slots=lora_slots)
            if hidden is not None:
                return hidden
        key_ends = None if self.mm is None else self.mm.key_ends(inputs.req_ids, step)
        metadata, input_ids, positions = self._eager_inputs(step, key_ends)
        if mm_positions is not None:
            positions = self._upload(np.ascontiguousarray(mm_positions))
        extra = {}
        if self.mm is not None:
            embeds = self.mm.inputs_embeds(inputs.req_ids, step, input_ids)
            if embeds is not None:
                extra["inputs_embeds"] = embeds
        if self.pp is None:
            layer_metadata = None if self._layer_groups is None else build_layer_metadata(
                self.attn_backend, step, metadata, self._layer_groups, self._upload, key_ends)
            ctx = ForwardContext(metadata, self.kv_caches, self._layer_hooks, layer_metadata)
            if lora_slots is not None:
                ctx.lora = LoRABatch(self._upload(lora_slots), active=bool((row_slots >= 0).any()))
            if self.state_caches:
                ctx.state_metadata = self._state_metadata(step)
                ctx.state_caches = self.state_caches
            with set_forward_context(ctx):
                return self.model(input_ids, positions, **extra)
        return self._forward_stage(metadata, input_ids, positions)

    def _dummy_forward(self) -> None:
        """One token at position 0 through the model, its KV written to the null block
        (block 0, and state slot 0: never read unmasked), nothing sampled: a lockstep
        replica with no work still joins the step's expert all-to-all."""
        step = dummy_step(len(self.input_batch.block_tables))
        metadata, input_ids, positions = self._eager_inputs(step)
        layer_metadata = None if self._layer_groups is None else build_layer_metadata(
            self.attn_backend, step, metadata, self._layer_groups, self._upload)
        ctx = ForwardContext(metadata, self.kv_caches, self._layer_hooks, layer_metadata)
        if self.lora_manager is not None:
            ctx.lora = LoRABatch(self._upload(np.full(1, -1, dtype=np.int64)), active=False)
        if self.state_caches:
            null_slot = np.zeros(1, dtype=np.int64)
            ctx.state_metadata = build_state_metadata(null_slot, null_slot,
                                                      step.query_start_loc, 1, self._upload)
            ctx.state_caches = self.state_caches
        with set_forward_context(ctx):
            self.model(input_ids, positions)

    def _state_metadata(self, step: StepIndices) -> Any:
        """The step's slots and whether each request continues from its state."""
        batch = self.input_batch
        return build_state_metadata(batch.state_slots[step.rows],
                                    batch.num_computed_tokens[step.rows],
                                    step.query_start_loc, step.max_query_len, self._upload)

    def _forward_stage(self, metadata: Any, input_ids: torch.Tensor, positions: torch.Tensor
                       ) -> torch.Tensor | None:
        """One pipeline stage: receive, run this stage's layers, send on (or return the
        hidden states on the last stage)."""
        from engine.model_executor.models.interface import IntermediateTensors

        pp = self.pp
        intermediate = None
        if not self.is_first_stage:
            buffer = self._stage_buffer(len(input_ids))
            intermediate = IntermediateTensors.unstack(pp.recv(buffer, pp.rank - 1))
        with set_forward_context(ForwardContext(metadata, self.kv_caches)):
            out = self.model(input_ids, positions, intermediate)
        if self.samples:
            return out
        pp.send(out.stacked(), pp.rank + 1)
        return None

    def _stage_buffer(self, num_tokens: int) -> torch.Tensor:
        """Where the previous stage's ``[2, T, hidden]`` activations land."""
        hidden_size = self.model.config.hidden_size
        return torch.empty(2, num_tokens, hidden_size, dtype=self.model.activation_dtype,
                           device=self.device)

    def _eager_inputs(self, step: StepIndices, key_ends: np.ndarray | None = None
                      ) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """The attention metadata, token ids and positions of a step run eagerly."""
        upload = self._upload
        metadata = build_attention_metadata(self.attn_backend, step, upload, key_ends)
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

    def _verify(
        self,
        inputs: StepInputs,
        hidden: torch.Tensor,
        structured_req_ids: list[str],
        grammar_bitmask: torch.Tensor | None,
    ) -> tuple[list[list[int]], dict[str, LogprobsLists]]:
        """Score every draft position and keep drafts by the rejection rule; each
        sampling request emits its accepted drafts and one token of its own."""
        step = inputs.step
        lists: list[list[int]] = [[] for _ in inputs.req_ids]
        sampling = step.sample_batch_idx
        if not len(sampling):
            return lists, {}
        idx = self._upload(step.logits_indices)
        logits = self.model.compute_logits(hidden.index_select(0, idx))
        rows = step.rows[sampling]
        num_drafts = inputs.num_drafts[sampling]
        first = np.cumsum(inputs.num_drafts) - inputs.num_drafts
        flat = np.concatenate(
            [inputs.draft_token_ids[first[i] : first[i] + inputs.num_drafts[i]] for i in sampling]
        ) if len(inputs.draft_token_ids) else inputs.draft_token_ids
        layout = SpecLayout.of(num_drafts, flat)
        sampling_req_ids = [inputs.req_ids[i] for i in sampling.tolist()]
        token_bitmask = None
        if grammar_bitmask is not None:
            token_bitmask = bitmask_for_spec_rows(
                grammar_bitmask, structured_req_ids, sampling_req_ids, layout.num_drafts
            )
        out = self.rejection_sampler(
            logits,
            self.sampling_state.build_spec_metadata(rows, num_drafts, flat, layout),
            layout,
            draft_probs=self._pending_draft_probs(sampling_req_ids, num_drafts),
            token_bitmask=token_bitmask,
        )
        self.input_batch.append_token_lists(rows, out.token_ids)
        self.sampling_state.append_token_lists(rows, out.token_ids)
        for i, tokens in zip(sampling.tolist(), out.token_ids):
            lists[i] = tokens
        logprobs: dict[str, LogprobsLists] = {}
        if out.logprobs is not None:
            batch_lists = out.logprobs.tolists()
            start = 0
            for j, (rid, tokens) in enumerate(zip(sampling_req_ids, out.token_ids)):
                if self.sampling_state.wants_logprobs(int(rows[j])):
                    logprobs[rid] = batch_lists.select_rows(start, len(tokens))
                start += len(tokens)
        return lists, logprobs

    def _pending_draft_probs(self, req_ids: list[str], num_drafts: np.ndarray
                             ) -> torch.Tensor | None:
        """The distributions the verified drafts were drawn from, flat in order, or None
        when every draft was deterministic (one-hot; greedy rows never read them)."""
        if not self._draft_probs:
            return None
        stored = [self._draft_probs.pop(r, None) for r in req_ids]
        if all(p is None for p in stored):
            return None
        out = torch.zeros(int(num_drafts.sum()), self.vocab_size, device=self.device)
        start = 0
        for probs, n in zip(stored, num_drafts.tolist()):
            if probs is not None and n:
                out[start : start + n] = probs[:n]
            start += n
        return out

    def _propose(
        self, inputs: StepInputs, hidden: torch.Tensor, token_lists: list[list[int]],
        max_drafts_per_request: int | None = None, settled_off: bool = False,
    ) -> list[list[int]] | None:
        """Drafts for the next step (None without a proposer); at most
        ``max_drafts_per_request`` each (the scheduler's budget; 0: none, and the proposer
        is skipped unless it must follow every step, as an EAGLE head does, which defers
        its pass: ``settled_off``, the governor's choice, lets it drop its oldest backlog)."""
        proposer = self.proposer
        if proposer is None:
            return None
        budget = proposer.num_speculative_tokens
        if max_drafts_per_request is not None:
            budget = min(budget, max_drafts_per_request)
        if budget <= 0 and proposer.may_skip(inputs.req_ids):
            return None  # nothing to draft, and nothing it must see this step
        step = inputs.step
        if budget <= 0 and inputs.num_drafts is None:
            # No drafts verified: each request's verified positions are its scheduled ones.
            first = step.query_start_loc[:-1]
            starts = step.positions[first].astype(np.int64)
            if proposer.defer(inputs.req_ids, starts, starts + step.num_scheduled, first,
                              hidden, may_drop=settled_off):
                return None  # kept for its next pass
        from engine.spec_decode.proposer import ProposalBatch

        batch = self.input_batch
        rows = step.rows
        emitted = np.fromiter(map(len, token_lists), dtype=np.int64, count=len(rows))
        sampled = emitted > 0
        starts = step.positions[step.query_start_loc[:-1]].astype(np.int64)
        scheduled = step.num_scheduled.astype(np.int64)
        drafts = np.zeros(len(rows), dtype=np.int64) if inputs.num_drafts is None else (
            inputs.num_drafts
        )
        # The step's real tokens, then the accepted drafts (emitted minus its own token).
        verified_ends = np.where(
            sampled, starts + scheduled - drafts + emitted - 1, starts + scheduled
        )
        num_tokens = batch.num_tokens[rows]
        newest = num_tokens - 1
        room = np.minimum(self.input_batch.max_model_len - 1 - newest, budget)
        if proposer.writes_kv_ahead:  # its KV writes stay inside the allocated blocks
            # (group 0's: a draft's cache shares the full-attention group's block ids)
            room = np.minimum(room, batch.num_blocks[0, rows] * self.block_size - newest)
        max_drafts = np.where(sampled, np.maximum(room, 0), 0)
        proposal = proposer.propose(
            ProposalBatch(
                req_ids=inputs.req_ids,
                rows=rows,
                input_batch=batch,
                sampling_state=self.sampling_state,
                starts=starts,
                verified_ends=verified_ends,
                num_tokens=num_tokens,
                sampled=sampled,
                max_drafts=max_drafts,
                hidden_starts=step.query_start_loc[:-1].astype(np.int64),
                target_hidden=hidden,
            )
        )
        if proposal.probs is not None:
            first = np.cumsum(proposal.num_drafts) - proposal.num_drafts
            for i, n in enumerate(proposal.num_drafts.tolist()):
                if n:
                    self._draft_probs[inputs.req_ids[i]] = proposal.probs[first[i] : first[i] + n]
        return proposal.lists()

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
