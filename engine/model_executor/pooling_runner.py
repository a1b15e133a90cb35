"""The model runner of ``--runner pooling``: prefill-only steps, one result per request.

The scheduler runs a pooling request as a prompt that is never chunked (chunked prefill
and prefix caching are off for pooling engines), so a request's whole prompt is in the
step that schedules it. This runner flattens the step as the generating runner does,
runs the model eagerly (with the prompts' token types where the model uses them), hands
the hidden states to the model's ``pooler`` and returns each request's result; the
scheduler then finishes the request and frees its blocks (an encoder model has no KV
layers at all; a decoder embedder's cache lives only for the step).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from engine.core.scheduler.output import ModelRunnerOutput, PooledData, SchedulerOutput
from engine.model_executor.forward_context import ForwardContext, set_forward_context
from engine.model_executor.layers.pooler import PoolingBatch
from engine.model_executor.model_runner import ModelRunner, StepInputs


class PoolingModelRunner(ModelRunner):
    """Runs a pooling model (one with a ``pooler``) for the engine core."""

    def __init__(self, model: torch.nn.Module, attn_backend: Any, platform: Any,
                 **kwargs: Any) -> None:
        if getattr(model, "pooler", None) is None:
            raise ValueError(f"{type(model).__name__} has no pooler: it cannot run with "
                             "--runner pooling")
        kwargs["enforce_eager"] = True  # no decode steps to capture
        super().__init__(model, attn_backend, platform, **kwargs)
        if self.pp is not None:
            raise ValueError("pooling models do not support pipeline parallelism")
        self._uses_token_types = bool(getattr(model, "uses_token_type_ids", False))
        self._pooling: dict[str, tuple[Any, np.ndarray | None]] = {}

    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self._pooling.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            if new.pooling_params is None:
                raise ValueError(f"request {new.req_id} has no pooling params: a pooling "
                                 "model only pools")
            types = (None if new.token_type_ids is None
                     else np.asarray(new.token_type_ids, dtype=np.int64))
            self._pooling[new.req_id] = (new.pooling_params, types)
        super()._update_states(so)

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput, grammar_bitmask: torch.Tensor | None = None
                      ) -> ModelRunnerOutput:
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            if self.lockstep:
                self._dummy_forward()
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        inputs = self._prepare_inputs(so)
        hidden = self._forward_with_types(inputs)
        batch = self._pooling_batch(inputs)
        results = self.model.pooler(hidden, batch)
        pooled = {rid: _packed(out) for rid, out in zip(inputs.req_ids, results)}
        for rid in inputs.req_ids:  # done: the scheduler finishes it with this result
            self._pooling.pop(rid, None)
        return ModelRunnerOutput(
            req_ids=inputs.req_ids,
            sampled_token_ids=[[] for _ in inputs.req_ids],
            pooler_output=pooled,
        )

    def _forward_with_types(self, inputs: StepInputs) -> torch.Tensor:
        metadata, input_ids, positions = self._eager_inputs(inputs.step)
        kwargs = {}
        if self._uses_token_types:
            kwargs["token_type_ids"] = self._upload(self._step_token_types(inputs))
        with set_forward_context(ForwardContext(metadata, self.kv_caches)):
            return self.model(input_ids, positions, **kwargs)

    def _step_token_types(self, inputs: StepInputs) -> np.ndarray:
        """Every step token's type, from its request's prompt (zeros where none given)."""
        step = inputs.step
        out = np.zeros(len(step.input_ids), dtype=np.int64)
        starts = step.query_start_loc
        for i, rid in enumerate(inputs.req_ids):
            types = self._pooling[rid][1]
            if types is not None:
                first = int(step.positions[starts[i]])
                out[starts[i] : starts[i + 1]] = types[first : first + starts[i + 1] - starts[i]]
        return out

    def _pooling_batch(self, inputs: StepInputs) -> PoolingBatch:
        """Every scheduled request with its whole prompt (the scheduler never chunks a
        pooling request; a step that did would pool half a prompt, so it is refused)."""
        step = inputs.step
        starts = step.query_start_loc[:-1].astype(np.int64)
        lens = step.num_scheduled.astype(np.int64)
        prompt_lens = self.input_batch.num_prompt_tokens[step.rows]
        if (step.positions[starts] != 0).any() or (lens != prompt_lens).any():
            raise RuntimeError("a pooling request was scheduled in chunks; pooling engines "
                               "run with chunked prefill and prefix caching off")
        params = [self._pooling[rid][0] for rid in inputs.req_ids]
        return PoolingBatch(starts, lens, params)


def _packed(result: torch.Tensor) -> PooledData:
    values = np.ascontiguousarray(result.detach().float().cpu().numpy())
    return PooledData(values.tobytes(), list(values.shape))
