"""Messages between the front end and the engine core (possibly another process).

Compact msgspec structs (DESIGN lesson 3): array-like encoding, defaults omitted,
enums as ints. They are the only things that cross the ZeroMQ socket; never pickle.
"""

from __future__ import annotations

import msgspec

from engine.core.pooling_params import PoolingParams
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler.output import LogprobsLists, PooledData
from engine.lora.request import LoRARequest
from engine.multimodal.inputs import MultiModalFeature


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One sequence to run (the front end fans ``n > 1`` out into several)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = 0.0
    priority: int = 0
    cache_salt: str | None = None
    max_tokens: int = 16  # resolved against max_model_len by the processor
    # A pooling request: its resolved params (sampling_params then only fills the
    # slot: one step, no token sampled) and the prompt's token types (None: zeros).
    pooling_params: PoolingParams | None = None
    token_type_ids: list[int] | None = None
    lora_request: LoRARequest | None = None  # the adapter the request runs under
    # Its images / videos, processed (by prompt offset); None: text only.
    mm_features: list[MultiModalFeature] | None = None


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What one request produced in one step."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: int | None = None  # engine.core.request.FinishReason value
    stop_reason: int | str | None = None
    new_logprobs: LogprobsLists | None = None
    new_prompt_logprobs: LogprobsLists | None = None
    num_cached_tokens: int = 0
    # A KV connector's parameters for the client (disaggregated prefill: where the
    # prompt's KV waits), on the request's final output.
    kv_transfer_params: dict | None = None
    pooling_output: PooledData | None = None  # a pooling request's result (final output)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Everything one step produced, plus the core's load for metrics."""

    outputs: list[EngineCoreOutput] = []
    timestamp: float = 0.0
    # Requests the core finished on its own (e.g. aborted by an error), by id.
    finished_requests: list[str] = []
    # The core's KV cache usage (0-1) after the step; sent by data-parallel ranks only,
    # for the front end's routing (engine.core.dp_router).
    kv_cache_usage: float = 0.0
